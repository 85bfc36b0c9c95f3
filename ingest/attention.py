"""Per-layer access to attention probabilities inside the forward pass.

transformers 5 dispatches every encoder's attention through ``AttentionInterface``. headcat
registers one more implementation, ``"headcat"``: eager attention that hands each layer's
probabilities to the active :class:`AttentionProbe` the moment they exist. The probe can
reduce them (feature extraction) or replace them (ablation); they are dropped when the layer
returns, so no more than one layer's maps is ever alive.

    with AttentionProbe(model, callback):
        model(**batch)

``callback(call)`` receives an :class:`AttentionCall` and returns ``None`` (keep the
probabilities) or a tensor of the same shape to use instead. ``on_output(call)``, when given,
receives each layer's per-head context vectors (the attention output before the heads are
merged and projected) as an :class:`OutputCall` and may likewise return a replacement: that is
where a per-head gate (importance) or a gradient tap (attribution) lives.

Every call names its ``stack`` (:data:`ingest.types.Stack`) and its layer within that stack;
probabilities and outputs are always per **query** head (grouped key/value heads repeated).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ingest.types import Stack

IMPLEMENTATION = "headcat"


@dataclass(frozen=True, slots=True)
class AttentionCall:
    """One attention layer's call, as seen by a probe callback."""

    layer: int  # 0-based within its stack
    probs: torch.Tensor  # (batch, head, q, k), rows sum to 1 over unmasked keys
    scores: torch.Tensor  # (batch, head, q, k), scaled logits plus the additive mask
    module: nn.Module
    stack: Stack = "encoder"


@dataclass(frozen=True, slots=True)
class OutputCall:
    """One attention layer's per-head context vectors ``z = A V``, before the output projection."""

    layer: int  # 0-based within its stack
    output: torch.Tensor  # (batch, q, head, head_dim)
    module: nn.Module
    stack: Stack = "encoder"


ProbeCallback = Callable[[AttentionCall], "torch.Tensor | None"]
OutputCallback = Callable[[OutputCall], "torch.Tensor | None"]

_active: contextvars.ContextVar[_ProbeState | None] = contextvars.ContextVar("headcat_attention_probe", default=None)


@dataclass
class _ProbeState:
    callback: ProbeCallback
    on_output: OutputCallback | None = None
    next_layer: int = 0


def headcat_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # (batch, head, q, d)
    key: torch.Tensor,  # (batch, head, k, d)
    value: torch.Tensor,  # (batch, head, k, d)
    attention_mask: torch.Tensor | None,  # additive (batch, 1, q, k) or None
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Eager attention, op for op as ``transformers``' ``eager_attention_forward``, with a probe.

    Never returns the probabilities: holding them is what this module exists to avoid.
    """
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            attention_mask = torch.zeros_like(attention_mask, dtype=scores.dtype).masked_fill_(
                ~attention_mask, torch.finfo(scores.dtype).min
            )
        scores = scores + attention_mask
    probs = nn.functional.softmax(scores, dim=-1)

    state = _active.get()
    layer = 0
    if state is not None:
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            layer = state.next_layer
        state.next_layer = layer + 1
        replaced = state.callback(AttentionCall(layer=layer, probs=probs, scores=scores, module=module))
        if replaced is not None:
            probs = replaced

    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    output = torch.matmul(probs, value).transpose(1, 2).contiguous()  # (batch, q, head, d)
    if state is not None and state.on_output is not None:
        replaced = state.on_output(OutputCall(layer=layer, output=output, module=module))
        if replaced is not None:
            output = replaced
    return output, None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(IMPLEMENTATION, headcat_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, eager_mask)


_register()


class AttentionProbe:
    """Context manager: route ``model``'s attention through ``callback`` while active.

    The model's previous attention implementation is restored on exit. Layers are numbered by
    the module's ``layer_idx`` where the architecture sets it, else by call order within one
    forward pass (encoders call their layers in order).
    """

    def __init__(self, model: nn.Module, callback: ProbeCallback, *, on_output: OutputCallback | None = None) -> None:
        self.model: Any = model  # a transformers PreTrainedModel
        self.callback = callback
        self.on_output = on_output

    def __enter__(self) -> AttentionProbe:
        self._previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(IMPLEMENTATION)
        self._state = _ProbeState(self.callback, self.on_output)
        self._token = _active.set(self._state)
        self._hook = self.model.register_forward_pre_hook(self._reset_layer_counter)
        return self

    def _reset_layer_counter(self, *_: Any) -> None:
        self._state.next_layer = 0

    def __exit__(self, *exc: object) -> None:
        self._hook.remove()
        _active.reset(self._token)
        self.model.set_attn_implementation(self._previous)
