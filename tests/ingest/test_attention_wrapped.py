"""An attention module whose ``forward`` is decorated (transformers 5.24 wraps BERT's in ``deprecate_kwarg``)
is still found: the probe looks at the decorated function's own code."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import BertConfig, BertModel
from transformers.models.bert import modeling_bert

from ingest.attention import AttentionProbe, attention_sites


def _decorated(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    return wrapper


class _Wrapped(modeling_bert.BertSelfAttention):
    forward = _decorated(_decorated(getattr(modeling_bert.BertSelfAttention.forward, "__wrapped__", None)
                                    or modeling_bert.BertSelfAttention.forward))  # fmt: skip


_Wrapped.__module__ = modeling_bert.__name__  # headcat follows the module's own eager_attention_forward


def test_a_decorated_attention_forward_is_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(modeling_bert, "BertSelfAttention", _Wrapped)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16)
    model = BertModel(config, add_pooling_layer=False).eval()
    model.set_attn_implementation("eager")
    assert all(isinstance(model.encoder.layer[i].attention.self, _Wrapped) for i in range(2))
    assert [(site.name, site.stack, site.layer) for site in attention_sites(model)] == [
        ("encoder.layer.0.attention.self", "encoder", 0),
        ("encoder.layer.1.attention.self", "encoder", 1),
    ]
    ids = torch.tensor([[2, 7, 9, 3]])
    seen: list[torch.Tensor] = []
    with torch.inference_mode():
        expected = model(ids, output_attentions=True).attentions
        with AttentionProbe(model, lambda call: seen.append(call.probs.clone())):
            model(ids)
    assert len(seen) == 2
    for found, reference in zip(seen, expected, strict=True):
        torch.testing.assert_close(found, reference)
