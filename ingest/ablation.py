"""Head surgery inside the attention of a ``transformers`` encoder (SPEC section 4, Guan et al. 2020, section 5).

Four operations act on the attention probabilities ``A`` (batch, head, q, k) of selected heads:

- ``prune``: ``A = 0``, so the head's output is 0.
- ``uniform``: ``A[s, t] = 1 / L`` over the ``L`` real (non-padding) keys of the sample, 0 on padding.
- ``drop_intra``: ``A[s, t] = 0`` where ``s`` and ``t`` lie in the same segment.
- ``drop_inter``: ``A[s, t] = 0`` where they lie in different segments.

The drops do not renormalise unless the spec says ``renormalize=True`` (then each row is divided by
its remaining mass; a row with nothing left stays 0). A *segment* is a run of equal
``token_type_ids`` by default (``[CLS] question [SEP]`` | ``context [SEP]`` for BERT); models
without token types (RoBERTa, DistilBERT) pass segment ids, e.g. from
:func:`segments_from_separators`. Padding keys are in segment ``-1``; their probabilities are
already 0, so no operation changes them.

What to ablate is one frozen :class:`AblationSpec`: a map ``(layer, head) -> operation`` that is
validated when it is made (layer and head in range, one operation per head), usually built from
:class:`HeadSelection` rules over a head-type assignment::

    spec = AblationSpec.build(
        {"prune": ["dense", "vertical"], "uniform": HeadSelection.layers([0])},
        assignments, num_layers=6, num_heads=12,
    )
    with Ablator(model, spec) as ab:
        for batch in batches:
            ab.set_batch(batch["attention_mask"], token_type_ids=batch["token_type_ids"])
            model(**batch)

The :class:`Ablator` is an :class:`~ingest.attention.AttentionProbe`: each layer with selected
heads edits them with one indexed, batched tensor operation per operation (no loop over
samples); layers with nothing selected return ``None`` and stay bit-for-bit those of the eager
model. :func:`paper_plan` lists the rows of Guan et al.'s Tables 2 and 3 as :class:`PlanRow`\\ s.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TypeAlias

import torch
from torch import nn

from ingest.attention import AttentionCall, AttentionProbe
from ingest.selection import (  # re-exported: the selection API is part of this module's interface
    OPERATIONS,
    SEGMENT_OPERATIONS,
    AblationSpec,
    AblationSpecError,
    Assignments,
    Head,
    HeadSelection,
    Operation,
    PlanRow,
    SelectionLike,
    as_selection,
    check_operation,
    model_shape,
    paper_plan,
)

logger = logging.getLogger(__name__)

HeadIndex: TypeAlias = "slice | torch.Tensor"  # a contiguous run of heads, or a 1-D index tensor

__all__ = [
    "OPERATIONS",
    "SEGMENT_OPERATIONS",
    "AblationSpec",
    "AblationSpecError",
    "Ablator",
    "Assignments",
    "BatchMasks",
    "Head",
    "HeadSelection",
    "Operation",
    "PlanRow",
    "SelectionLike",
    "ablate_probs",
    "apply_ablation",
    "as_selection",
    "model_shape",
    "paper_plan",
    "segments_from_separators",
    "segments_from_token_types",
]


def segments_from_token_types(
    token_type_ids: torch.Tensor,  # (batch, seq)
    attention_mask: torch.Tensor | None = None,  # (batch, seq), 1 = real token
) -> torch.Tensor:  # (batch, seq) long, -1 on padding
    """Number the runs of equal token type ids 0, 1, ...; padding gets -1.

    ``[CLS] q [SEP] c [SEP]`` with types ``0 0 0 1 1`` gives ``0 0 0 1 1``.
    """
    changes = (token_type_ids[:, 1:] != token_type_ids[:, :-1]).long()
    segments = torch.cat([torch.zeros_like(changes[:, :1]), changes.cumsum(dim=1)], dim=1)
    if attention_mask is not None:
        segments = segments.masked_fill(attention_mask == 0, -1)
    return segments


def segments_from_separators(
    input_ids: torch.Tensor,  # (batch, seq)
    sep_token_ids: int | Iterable[int],
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:  # (batch, seq) long, -1 on padding
    """Segments for models without token types (RoBERTa, DistilBERT, XLM-R...).

    A new segment starts right after each run of separator tokens, and the run belongs to the
    segment it closes: ``<s> A </s></s> B </s>`` gives ``0 0 0 0 1 1`` and
    ``[CLS] A [SEP] B [SEP]`` gives ``0 0 0 1 1``, the same as BERT's token type ids.
    Pass ``tokenizer.sep_token_id``; padding gets -1.
    """
    ids = [sep_token_ids] if isinstance(sep_token_ids, int) else list(sep_token_ids)
    is_sep = torch.isin(input_ids, torch.tensor(ids, device=input_ids.device))
    next_is_sep = torch.cat([is_sep[:, 1:], torch.zeros_like(is_sep[:, :1])], dim=1)
    run_end = (is_sep & ~next_is_sep).long()
    segments = run_end.cumsum(dim=1) - run_end  # exclusive: the run's end still belongs to it
    if attention_mask is not None:
        segments = segments.masked_fill(attention_mask == 0, -1)
    return segments


# --------------------------------------------------------------------------------------------
# The edit
# --------------------------------------------------------------------------------------------


class BatchMasks:
    """Per-batch masks derived once and shared by every layer of a forward pass.

    ``key_mask`` (batch, k) bool marks real tokens; ``segment_ids`` (batch, k) long or None.
    Derived tensors are cached per dtype/device.
    """

    def __init__(self, attention_mask: torch.Tensor | None, segment_ids: torch.Tensor | None) -> None:
        self.key_mask = None if attention_mask is None else attention_mask.bool()
        self.segment_ids = segment_ids
        if self.key_mask is not None and segment_ids is not None and self.key_mask.shape != segment_ids.shape:
            raise ValueError(
                f"attention_mask {tuple(self.key_mask.shape)} and segment ids {tuple(segment_ids.shape)} "
                "differ in shape"
            )
        self._cache: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def _shape(self) -> tuple[int, int] | None:
        ref = self.key_mask if self.key_mask is not None else self.segment_ids
        return None if ref is None else (int(ref.shape[0]), int(ref.shape[1]))

    def check(self, probs: torch.Tensor, layer: int) -> None:
        shape = self._shape()
        if shape is not None and (shape[0] != probs.shape[0] or shape[1] != probs.shape[-1]):
            raise RuntimeError(
                f"layer {layer}: attention is (batch {probs.shape[0]}, keys {probs.shape[-1]}) but the "
                f"masks set for this batch are {shape}; call set_batch(...) before every forward pass"
            )

    def uniform(self, probs: torch.Tensor) -> torch.Tensor:  # (batch, 1, 1, k)
        key = ("uniform", probs.dtype, probs.device)
        if key not in self._cache:
            if self.key_mask is None:
                real = torch.ones(probs.shape[0], probs.shape[-1], dtype=probs.dtype, device=probs.device)
            else:
                real = self.key_mask.to(device=probs.device, dtype=probs.dtype)
            self._cache[key] = (real / real.sum(dim=-1, keepdim=True).clamp_min(1))[:, None, None, :]
        return self._cache[key]

    def keep(self, op: Operation, probs: torch.Tensor) -> torch.Tensor:  # (batch, 1, q, k)
        key = (op, probs.dtype, probs.device)
        if key not in self._cache:
            if self.segment_ids is None:
                raise RuntimeError(f"{op} needs segment ids: pass token_type_ids or segment_ids to set_batch")
            seg = self.segment_ids.to(probs.device)
            same = seg[:, :, None] == seg[:, None, :]  # (batch, q, k)
            keep = ~same if op == "drop_intra" else same
            self._cache[key] = keep[:, None].to(probs.dtype)
        return self._cache[key]


LayerPlan: TypeAlias = "list[tuple[Operation, HeadIndex]]"


def _head_index(heads: Sequence[int], device: torch.device | None = None) -> HeadIndex:
    """A slice when the heads are one contiguous run (in-place view ops), else an index tensor."""
    heads = sorted(heads)
    if heads == list(range(heads[0], heads[-1] + 1)):
        return slice(heads[0], heads[-1] + 1)
    return torch.tensor(heads, dtype=torch.long, device=device)


def _edit(
    probs: torch.Tensor,  # (batch, head, q, k)
    plan: LayerPlan,
    masks: BatchMasks,
    renormalize: bool,
) -> torch.Tensor:
    """Apply one layer's operations in place (on a copy when autograd tracks ``probs``)."""
    if probs.requires_grad:
        probs = probs.clone()
    for op, index in plan:
        if isinstance(index, torch.Tensor) and index.device != probs.device:
            index = index.to(probs.device)
        if op == "prune":
            if isinstance(index, slice):
                probs[:, index].zero_()
            else:
                probs.index_fill_(1, index, 0.0)
        elif op == "uniform":
            probs[:, index] = masks.uniform(probs)
        else:
            keep = masks.keep(op, probs)
            if isinstance(index, slice):
                view = probs[:, index]
                view.mul_(keep)
                if renormalize:
                    view.div_(view.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny))
            else:
                sub = probs[:, index] * keep
                if renormalize:
                    sub = sub / sub.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
                probs[:, index] = sub
    return probs


def ablate_probs(
    probs: torch.Tensor,  # (batch, head, q, k)
    ops: Mapping[Operation, Sequence[int]],
    *,
    attention_mask: torch.Tensor | None = None,  # (batch, k)
    segment_ids: torch.Tensor | None = None,  # (batch, k)
    renormalize: bool = False,
) -> torch.Tensor:
    """One layer's edit on a probability tensor (a copy; the input is left alone).

    ``ops`` maps an operation to the heads of this layer it applies to. This is the exact
    function the :class:`Ablator` runs inside the forward pass.
    """
    plan: list[tuple[Operation, slice | torch.Tensor]] = []
    for op, heads in ops.items():
        check_operation(op)
        if heads:
            plan.append((op, _head_index(heads, probs.device)))
    return _edit(probs.clone(), plan, BatchMasks(attention_mask, segment_ids), renormalize)


# --------------------------------------------------------------------------------------------
# The probe
# --------------------------------------------------------------------------------------------


class Ablator:
    """Context manager applying an :class:`AblationSpec` to every forward pass of ``model``.

    Call :meth:`set_batch` with the batch's attention mask (and token type ids or segment ids
    when the spec drops intra/inter-segment attention) before each forward pass. Layers with no
    selected head are untouched (the callback returns ``None``).
    """

    def __init__(self, model: nn.Module, spec: AblationSpec) -> None:
        self.model = model
        self.spec = spec

    def __enter__(self) -> Ablator:
        num_layers, num_heads = model_shape(self.model)
        if (num_layers, num_heads) != (self.spec.num_layers, self.spec.num_heads):
            raise AblationSpecError(
                f"the spec is for {self.spec.num_layers} layers x {self.spec.num_heads} heads but the model "
                f"has {num_layers} x {num_heads}"
            )
        self._plan: dict[int, LayerPlan] = {
            layer: [(op, _head_index(heads)) for op, heads in ops] for layer, ops in self.spec.by_layer().items()
        }
        self._masks: BatchMasks | None = None
        self.layers_seen: set[int] = set()
        self._probe = AttentionProbe(self.model, self._callback)
        self._probe.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._probe.__exit__(*exc)
        self._masks = None

    def set_batch(
        self,
        attention_mask: torch.Tensor | None = None,  # (batch, seq)
        *,
        token_type_ids: torch.Tensor | None = None,  # (batch, seq)
        segment_ids: torch.Tensor | None = None,  # (batch, seq), wins over token_type_ids
    ) -> None:
        """Set the masks of the next forward pass (required when the spec does more than prune)."""
        if segment_ids is None and token_type_ids is not None and self.spec.needs_segments:
            segment_ids = segments_from_token_types(token_type_ids, attention_mask)
        if self.spec.needs_segments and segment_ids is None:
            raise AblationSpecError(
                "drop_intra/drop_inter need segments: pass token_type_ids or segment_ids "
                "(segments_from_separators for models without token types)"
            )
        self._masks = BatchMasks(attention_mask, segment_ids)
        self.layers_seen = set()

    def _callback(self, call: AttentionCall) -> torch.Tensor | None:
        self.layers_seen.add(call.layer)
        plan = self._plan.get(call.layer)
        if not plan:
            return None
        if call.probs.shape[1] != self.spec.num_heads:
            raise RuntimeError(f"layer {call.layer} has {call.probs.shape[1]} heads, the spec {self.spec.num_heads}")
        masks = self._masks
        if masks is None:
            if self.spec.needs_mask:
                raise RuntimeError("call set_batch(attention_mask, ...) before the forward pass")
            masks = BatchMasks(None, None)
        masks.check(call.probs, call.layer)
        return _edit(call.probs, plan, masks, self.spec.renormalize)


@contextmanager
def apply_ablation(
    model: nn.Module,
    spec: AblationSpec,
    *,
    attention_mask: torch.Tensor | None = None,
    token_type_ids: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
) -> Iterator[Ablator]:
    """One batch's ablation: ``with apply_ablation(model, spec, attention_mask=m): model(...)``.

    For many batches use :class:`Ablator` and :meth:`Ablator.set_batch` per batch.
    """
    with Ablator(model, spec) as ablator:
        ablator.set_batch(attention_mask, token_type_ids=token_type_ids, segment_ids=segment_ids)
        yield ablator


# --------------------------------------------------------------------------------------------
# Guan et al. 2020, Tables 2 and 3
# --------------------------------------------------------------------------------------------
