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

What to ablate is one frozen :class:`AblationSpec`: a map ``(stack, layer, head) -> operation``
that is validated when it is made (stack known, layer and head in range, one operation per head),
usually built from :class:`HeadSelection` rules over a head-type assignment::

    spec = AblationSpec.build(
        {"prune": ["dense", "vertical"], "uniform": HeadSelection.layers([0], stack="decoder")},
        assignments, shapes={"encoder": (6, 12), "decoder": (6, 12), "cross": (6, 12)},
    )
    with Ablator(model, spec) as ab:
        for batch in batches:
            ab.set_batch(batch["attention_mask"], token_type_ids=batch["token_type_ids"])
            model(**batch)

The :class:`Ablator` is an :class:`~ingest.attention.AttentionProbe` keyed by each call's
``(stack, layer)`` (an encoder-decoder's encoder, decoder and cross layer 0 are three different
layers): each layer with selected heads edits them with one indexed, batched tensor operation
per operation (no loop over samples); layers with nothing selected return ``None`` and stay
bit-for-bit those of the eager model. :func:`paper_plan` lists the rows of Guan et al.'s Tables 2
and 3 as :class:`PlanRow`\\ s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
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
    Shapes,
    as_selection,
    check_operation,
    describe_shapes,
    model_shape,
    model_shapes,
    paper_plan,
)
from ingest.types import Stack

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
    "spec_callback",
    "as_selection",
    "Shapes",
    "describe_shapes",
    "model_shape",
    "model_shapes",
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


def _visible_uniform(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # (batch, head, q, k)
    """``1 / n`` over the keys each query may attend to (the model's mask left them above ``min / 2``)."""
    allowed = (scores > torch.finfo(scores.dtype).min / 2).to(dtype)
    return allowed / allowed.sum(dim=-1, keepdim=True).clamp_min(1)


def _edit(
    probs: torch.Tensor,  # (batch, head, q, k)
    plan: LayerPlan,
    masks: BatchMasks,
    renormalize: bool,
    visible: torch.Tensor | None = None,  # (batch, head, q, k) scores, for causal stacks
) -> torch.Tensor:
    """Apply one layer's operations in place (on a copy when autograd tracks ``probs``).

    ``uniform`` is ``1 / L`` over the real keys, or with ``visible`` (the layer's scores, mask
    included) over the keys each query can see: causal stacks never get mass on future tokens.
    """
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
            if visible is None:
                probs[:, index] = masks.uniform(probs)
            else:
                probs[:, index] = _visible_uniform(visible[:, index], probs.dtype)
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
    selected head are untouched (the callback returns ``None``). The plan is keyed by the call's
    ``(stack, layer)``; a call from a stack the spec does not know, or with another head count,
    is an error (never a silently unablated layer). ``layers_seen`` holds the ``(stack, layer)``
    keys of the last forward pass.
    """

    def __init__(self, model: nn.Module, spec: AblationSpec) -> None:
        self.model = model
        self.spec = spec

    def __enter__(self) -> Ablator:
        shapes = model_shapes(self.model)
        wanted = self.spec.stack_shapes
        if shapes != wanted:
            if len(shapes) == len(wanted) == 1 and shapes.keys() == wanted.keys():
                (have,), (want,) = shapes.values(), wanted.values()
                raise AblationSpecError(
                    f"the spec is for {want[0]} layers x {want[1]} heads but the model has {have[0]} x {have[1]}"
                )
            raise AblationSpecError(
                f"the spec is for {describe_shapes(wanted)} (layers x heads) but the model "
                f"has {describe_shapes(shapes)}"
            )
        self._shapes = shapes
        self._plan: dict[tuple[Stack, int], LayerPlan] = {
            key: [(op, _head_index(heads)) for op, heads in ops] for key, ops in self.spec.by_layer().items()
        }
        self._masks: dict[Stack, BatchMasks] | None = None
        self.layers_seen: set[tuple[Stack, int]] = set()
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
        decoder_attention_mask: torch.Tensor | None = None,  # (batch, target seq), encoder-decoders
        decoder_segment_ids: torch.Tensor | None = None,  # (batch, target seq), encoder-decoders
    ) -> None:
        """Set the masks of the next forward pass (required when the spec does more than prune).

        ``attention_mask`` and the segments are those of the model's input: the encoder's (and
        the cross stack's keys) for encoders and encoder-decoders, the decoder's for decoder-only
        models. The decoder of an encoder-decoder reads ``decoder_attention_mask`` and
        ``decoder_segment_ids``.
        """
        first = next(iter(self._shapes))
        drops = {stack for (stack, _, _), op in self.spec.ops if op in SEGMENT_OPERATIONS}
        if segment_ids is None and token_type_ids is not None and first in drops:
            segment_ids = segments_from_token_types(token_type_ids, attention_mask)
        if first in drops and segment_ids is None:
            raise AblationSpecError(
                "drop_intra/drop_inter need segments: pass token_type_ids or segment_ids "
                "(segments_from_separators for models without token types)"
            )
        masks = {first: BatchMasks(attention_mask, segment_ids)}
        if "cross" in self._shapes:  # keys are the encoder's tokens
            masks["cross"] = BatchMasks(attention_mask, None)
            if "decoder" in drops and decoder_segment_ids is None:
                raise AblationSpecError("drop_intra/drop_inter on the decoder stack need decoder_segment_ids")
            masks["decoder"] = BatchMasks(decoder_attention_mask, decoder_segment_ids)
        self._masks = masks
        self.layers_seen = set()

    def _callback(self, call: AttentionCall) -> torch.Tensor | None:
        key = (call.stack, call.layer)
        shape = self._shapes.get(call.stack)
        if shape is None:
            raise RuntimeError(
                f"the model called {call.stack} attention (layer {call.layer}) but the spec knows only the "
                f"stacks {', '.join(self._shapes)}"
            )
        self.layers_seen.add(key)
        plan = self._plan.get(key)
        if not plan:
            return None
        if call.probs.shape[1] != shape[1]:
            raise RuntimeError(f"{call.stack} layer {call.layer} has {call.probs.shape[1]} heads, the spec {shape[1]}")
        if self._masks is None:
            if self.spec.needs_mask:
                raise RuntimeError("call set_batch(attention_mask, ...) before the forward pass")
            masks = BatchMasks(None, None)
        else:
            masks = self._masks[call.stack]
        masks.check(call.probs, call.layer)
        # causal self-attention: uniform over the keys the model's own mask lets the query see
        visible = call.scores if call.stack == "decoder" else None
        return _edit(call.probs, plan, masks, self.spec.renormalize, visible)


def spec_callback(spec: AblationSpec) -> Callable[[AttentionCall], torch.Tensor | None]:
    """A probe callback applying ``spec``'s ``prune`` and ``uniform`` operations, for a reduction that runs
    its own probe (``detect_heads(edit=...)``): the same edit the :class:`Ablator` makes, keyed by the
    call's ``(stack, layer)``. Segment drops need a batch's segments and are refused here."""
    if spec.needs_segments:
        raise AblationSpecError("drop_intra/drop_inter need a batch's segments; only prune and uniform apply here")
    plan = {key: [(op, _head_index(heads)) for op, heads in ops] for key, ops in spec.by_layer().items()}
    shapes = spec.stack_shapes

    def callback(call: AttentionCall) -> torch.Tensor | None:
        shape = shapes.get(call.stack)
        if shape is None or call.probs.shape[1] != shape[1]:
            raise RuntimeError(f"{call.stack} layer {call.layer} is not in the spec's {describe_shapes(shapes)}")
        layer_plan = plan.get((call.stack, call.layer))
        if not layer_plan:
            return None
        visible = call.scores if call.stack == "decoder" else None
        return _edit(call.probs.clone(), layer_plan, BatchMasks(None, None), spec.renormalize, visible)

    return callback


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
