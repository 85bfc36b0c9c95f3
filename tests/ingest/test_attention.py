"""The attention probe itself, model by model, against ``output_attentions=True`` in eager mode.

Each tiny random model of ``test_architectures`` (query/key weights scaled up so heads differ) is
run once eagerly with ``output_attentions=True`` and once under :class:`AttentionProbe`; the
probabilities the probe hands its callback, per ``(stack, layer)``, must be the eager model's,
exactly where it places them. Replacements (``callback`` and ``on_output``) are checked against
an independent mechanism: a forward pre-hook on the output projection that edits one head's slice
of its input. Every refusal's message is asserted in full.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from transformers.models.bert.modeling_bert import BertSelfAttention

from ingest.attention import AttentionCall, AttentionProbe
from tests.ingest.test_architectures import FAMILIES, build

# --- helpers -----------------------------------------------------------------------------------


def _family(name: str) -> Any:
    return next(family for family in FAMILIES if family.name == name)


def _inputs(model: Any, batch: int = 3, length: int = 7, pad: int = 2) -> dict[str, torch.Tensor]:
    """Random ids (no special meaning) with the last sample padded by ``pad`` tokens."""
    generator = torch.Generator().manual_seed(3)
    vocab = int(model.config.get_text_config().vocab_size)
    ids = torch.randint(5, vocab, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[-1, length - pad :] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = torch.randint(5, vocab, (batch, length - 2), generator=generator)
    return inputs


def eager_maps(model: Any, inputs: dict[str, torch.Tensor], stack: str = "encoder") -> dict[tuple[str, int], Any]:
    """``(stack, layer) -> (batch, head, q, k)`` from ``output_attentions=True`` (eager)."""
    with torch.no_grad():
        output = model(**inputs, output_attentions=True)
    if model.config.is_encoder_decoder:
        stacks = {"encoder": output.encoder_attentions, "decoder": output.decoder_attentions,
                  "cross": output.cross_attentions}  # fmt: skip
    else:
        stacks = {stack: output.attentions}
    return {(name, layer): maps for name, layers in stacks.items() for layer, maps in enumerate(layers)}


def probed_maps(model: Any, inputs: dict[str, torch.Tensor], **options: Any) -> dict[tuple[str, int], Any]:
    """``(stack, layer) -> (batch, head, q, k)`` as the probe's callback sees them (sub-batches put back by row)."""
    seen: dict[tuple[str, int], dict[int, torch.Tensor]] = {}

    def record(call: AttentionCall) -> None:
        parts = seen.setdefault((call.stack, call.layer), {})
        assert call.rows not in parts, "one row seen twice"
        parts[call.rows] = call.probs.clone()

    with torch.no_grad(), AttentionProbe(model, record, **options):
        model(**inputs)
    return {key: torch.cat([parts[row] for row in sorted(parts)]) for key, parts in seen.items()}


def assert_same_maps(got: dict[tuple[str, int], Any], want: dict[tuple[str, int], Any]) -> None:
    assert sorted(got) == sorted(want)
    for key, maps in want.items():
        try:
            torch.testing.assert_close(got[key], maps, atol=1e-6, rtol=1e-6)
        except AssertionError as error:
            raise AssertionError(f"{key}: {error}") from None


# --- a forward under a decorator ---------------------------------------------------------------


def _passthrough(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator defined here, as transformers 5.24's ``deprecate_kwarg`` wraps attention forwards."""

    @functools.wraps(forward)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        return forward(self, *args, **kwargs)

    return wrapper


class DecoratedSelfAttention(BertSelfAttention):
    """BERT's self-attention, its forward wrapped by a decorator whose globals (this file) have no eager function."""

    forward = _passthrough(inspect.unwrap(BertSelfAttention.forward))


def test_a_decorated_forward_is_seen_and_follows_its_own_eager_function() -> None:
    model = build(_family("bert"))
    for layer in model.encoder.layer:
        layer.attention.self.__class__ = DecoratedSelfAttention
    inputs = _inputs(model)
    assert_same_maps(probed_maps(model, inputs), eager_maps(model, inputs))
