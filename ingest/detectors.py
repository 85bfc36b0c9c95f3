"""Head detectors (SPEC section 10; Olsson et al. 2022, TransformerLens ``head_detector``, Gu et al. 2024).

Which heads are **induction**, **duplicate-token**, **previous-token** or **sink** heads, read off
their attention on seeded repeated random sequences:

- Sequences (:func:`make_sequences`): ``S`` sequences, each the model's start token when it has
  one (the tokenizer's own prefix, ``[CLS]`` / ``<s>``; else a causal model's BOS), ``R`` ids drawn
  uniformly **without replacement** from the vocabulary minus special tokens (one draw per
  sequence, ``numpy.random.default_rng(seed)``), the same ``R`` ids ``C`` times, and the
  tokenizer's own suffix (``[SEP]`` / ``</s>``) where it adds one. Encoder-decoders: the encoder
  and the decoder both read the sequence as it is (the decoder teacher-forced on it).
- Patterns over query rows ``i`` and key columns ``j`` (special positions never equal any other):
  previous_token ``(i, i-1)``; duplicate_token ``(i, j)``, ``j < i``, ``ids[j] == ids[i]``;
  induction ``(i, j+1)`` for every ``j`` with ``ids[j] == ids[i]`` and ``j + 1 < i``; sink ``(i, 0)``.
- Score (TransformerLens' ``mul``): the head's attention mass on the pattern's cells over its
  mass on every query row but the first (the masses as they are: an edited map need not sum to 1
  per row), per sequence, averaged over sequences; in [0, 1]. A perfect induction or
  duplicate-token head on ``C`` copies scores about ``(C - 1) / C``: only later copies have an
  earlier copy. Cross-attention heads get sink and previous_token over encoder positions, and no
  induction or duplicate score (NaN).
- Roles: every detector whose score reaches its threshold (:data:`DEFAULT_THRESHOLDS`).
- Repeat gain (causal models with an LM head): the mean next-token loss (nats) on the first copy
  minus the mean on the later copies, each copy's tokens but its first (the first token of a copy
  cannot be read off any earlier copy: it follows a token that occurred once before).

How it is computed: each batch runs once under an :class:`~ingest.attention.AttentionProbe`;
each layer's maps, the moment they exist, are multiplied by the run's five pattern masks in one
product ``(batch * head, q*k) @ (q*k, 5)`` (every sequence has the same repetition pattern, checked
on the ids, so one mask serves all) and only ``(batch, head, 4)`` scores outlive the call (plus the
first sequence's map, the example the catalog shows). Where the fused kernel covers the model
(:func:`ingest.features.choose_reduction`, the feature runs' rule, with no ``edit``), no map is made: the
same five masses are accumulators of the attention's own pass (:func:`ingest.fused.attend_cells`), and the
run's stored config says which (``reduction: fused | maps``). The score never implies the
gain, nor the gain the score (SPEC 10): both are reported.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ingest import fused as fused_kernel
from ingest.attention import AttentionCall, AttentionProbe, FusedCall, ProbeCallback, attention_sites
from ingest.types import ROLES, STACKS, Role, Stack

logger = logging.getLogger(__name__)

Detector = Role  # a head's detectors are the roles it can have
DETECTORS: tuple[Detector, ...] = ROLES
CROSS_DETECTORS: tuple[Detector, ...] = ("previous_token", "sink")  # cross heads: keys are the encoder's
DEFAULT_THRESHOLDS: dict[str, float] = {"induction": 0.4, "duplicate_token": 0.4, "previous_token": 0.4, "sink": 0.3}
EXAMPLE_MAP_MAX = 128  # the first sequence's maps are kept at most this many tokens on a side (else pooled)
SUB_BATCH_MAP_BYTES = 4 << 20
# Logits scored for the next-token loss at once, as float32: on the CPU about what stays in cache between the
# log-softmax and the targets' read; on a GPU a bound on the float32 copy of half-precision logits.
LOSS_CHUNK_BYTES = {"cpu": 2 << 20, "cuda": 256 << 20}

ProgressCallback = Callable[[int, int], None]


class DetectionError(ValueError):
    """A detection run that cannot be computed exactly; the one-line message names what is wrong."""


@dataclass(frozen=True)
class DetectionConfig:
    """One detection run's parameters; stored with its results (:meth:`to_json`)."""

    sequences: int = 32  # S
    length: int = 24  # R: distinct ids per copy
    copies: int = 2  # C
    seed: int = 0
    batch_size: int = 32
    thresholds: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))
    device: str = "auto"
    dtype: str = "float32"
    # Filled by detect_heads in the result's config (so the stored run config records it): "fused" when every
    # layer's pattern masses were taken in the attention's own pass (ingest.fused, no map held), "maps" when each
    # layer's maps were multiplied by the pattern masks. Not an input.
    reduction: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("sequences", "batch_size"):
            if getattr(self, name) < 1:
                raise DetectionError(f"{name}: must be >= 1, not {getattr(self, name)}")
        if self.length < 2:
            raise DetectionError(f"length: must be >= 2 (an induction cell needs two ids per copy), not {self.length}")
        if self.copies < 2:
            raise DetectionError(f"copies: must be >= 2 (nothing repeats in {self.copies} copy), not {self.copies}")
        if self.seed < 0:
            raise DetectionError(f"seed: must be >= 0, not {self.seed}")
        unknown = sorted(set(self.thresholds) - set(DETECTORS))
        if unknown:
            raise DetectionError(f"thresholds: unknown detector {unknown[0]!r}; known: {', '.join(DETECTORS)}")
        merged = {**DEFAULT_THRESHOLDS, **{k: float(v) for k, v in self.thresholds.items()}}
        for name, value in merged.items():
            if not (0.0 <= value <= 1.0):  # NaN fails too
                raise DetectionError(f"thresholds.{name}: must lie in [0, 1], not {value}")
        object.__setattr__(self, "thresholds", {name: merged[name] for name in DETECTORS})

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["thresholds"] = dict(self.thresholds)
        return data


# --- the sequences -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SequencePlan:
    """What every sequence of a run looks like around its random ids; decided before any compute."""

    prefix: tuple[int, ...]  # the start token, or nothing
    suffix: tuple[int, ...]  # [SEP] / </s> where the tokenizer adds one
    pool: np.ndarray  # (V',) int64: the ids drawn from (the vocabulary minus special tokens), sorted
    prefix_source: str  # "tokenizer", "bos" (prepended for a causal model) or "none"

    def total(self, length: int, copies: int) -> int:
        return len(self.prefix) + length * copies + len(self.suffix)


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    return config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config


def _affixes(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids ``tokenizer`` puts before and after a text's own tokens (``[CLS]`` and ``[SEP]`` for BERT)."""
    for probe in ("a", "the", "x", "1"):
        plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
        full = list(tokenizer(probe)["input_ids"])
        if not plain:
            continue
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return full[:start], full[start + len(plain) :]
    return [], []


def _positions(config: Any) -> int | None:
    """The most positions a model with this (text) config embeds, or None where it has no limit (relative positions)."""
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _is_causal_lm(model: nn.Module, stacks: set[Stack]) -> bool:
    getter = getattr(model, "get_output_embeddings", None)
    return stacks == {"decoder"} and callable(getter) and getter() is not None


def plan_sequences(model: nn.Module, tokenizer: Any, config: DetectionConfig) -> SequencePlan:
    """The run's sequence layout, with every refusal made before any compute (:func:`plan_for`)."""
    stacks = {site.stack for site in attention_sites(model)}
    return plan_for(_text_config(model), tokenizer, stacks, config)


def plan_for(text_config: Any, tokenizer: Any, stacks: set[Stack] | set[str], config: DetectionConfig) -> SequencePlan:
    """The sequence layout of a model with this (text) config, tokenizer and stacks; needs no weights,
    so the service checks a request with it before anything is queued.

    Raises :class:`DetectionError` when the model's vocabulary has fewer than 2 non-special ids,
    when ``config.length`` is more than the non-special ids (they are drawn without replacement),
    or when a sequence would be longer than the model's positions.
    """
    prefix, suffix = _affixes(tokenizer)
    source = "tokenizer" if prefix else "none"
    text = text_config
    if not prefix and stacks == {"decoder"}:
        bos = getattr(text, "bos_token_id", None)
        bos = bos if isinstance(bos, int) and bos >= 0 else getattr(tokenizer, "bos_token_id", None)
        if isinstance(bos, int) and bos >= 0:
            prefix, source = [bos], "bos"
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    vocab = min(vocab, len(tokenizer)) if vocab else len(tokenizer)
    special = {int(i) for i in getattr(tokenizer, "all_special_ids", [])} | set(prefix) | set(suffix)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        for holder in (text, tokenizer):
            value = getattr(holder, name, None)
            if isinstance(value, int):
                special.add(value)
    pool = np.array(sorted(set(range(vocab)) - special), dtype=np.int64)
    if len(pool) < 2:
        raise DetectionError(
            f"the model's vocabulary has {len(pool)} non-special token(s); detection needs at least 2 to repeat"
        )
    if config.length > len(pool):
        raise DetectionError(
            f"length {config.length} is more than the {len(pool)} non-special tokens of the vocabulary "
            "(the ids of a copy are drawn without replacement)"
        )
    plan = SequencePlan(tuple(prefix), tuple(suffix), pool, source)
    total, limit = plan.total(config.length, config.copies), _positions(text)
    if limit is not None and total > limit:
        raise DetectionError(
            f"length {config.length} x copies {config.copies} makes {total}-token sequences "
            f"(with {len(prefix) + len(suffix)} special), more than the model's {limit} positions"
        )
    return plan


def make_sequences(plan: SequencePlan, config: DetectionConfig) -> np.ndarray:
    """``(S, T)`` int64: every sequence's ids, start and end tokens included; the same for the same seed."""
    rng = np.random.default_rng(config.seed)
    rows = []
    for _ in range(config.sequences):
        body = rng.choice(plan.pool, size=config.length, replace=False)
        rows.append(np.concatenate([plan.prefix, np.tile(body, config.copies), plan.suffix]).astype(np.int64))
    return np.stack(rows)


def pattern_masks(ids: torch.Tensor, special: torch.Tensor) -> torch.Tensor:
    """``(batch, T, T, 5)`` 0/1 float32: the cells of induction, duplicate_token, previous_token, sink
    (rows 1.. only) and, last, every cell of the rows scored (every row but the first).

    ``special`` (T,) bool marks the start and end positions, which equal no other position.
    """
    batch, length = ids.shape
    position = torch.arange(length, device=ids.device)
    identity = torch.where(special[None, :], -1 - position[None, :], ids)  # (batch, T)
    same = identity[:, :, None] == identity[:, None, :]  # (batch, i, j)
    before = position[None, :] < position[:, None]  # j < i
    duplicate = same & before
    induction = torch.zeros_like(duplicate)  # (i, j + 1) where ids[j] == ids[i] and j + 1 < i
    induction[:, :, 1:] = same[:, :, :-1] & (position[None, 1:] < position[:, None])
    previous = (position[None, :] == position[:, None] - 1).expand(batch, length, length)
    sink = (position[None, :] == 0) & torch.ones(length, 1, dtype=torch.bool, device=ids.device)
    rows = (position[:, None] >= 1).expand(length, length)
    masks = torch.stack([induction, duplicate, previous, sink.expand(batch, -1, -1), rows.expand(batch, -1, -1)], -1)
    return masks & rows[None, :, :, None]


def first_positions(identity: torch.Tensor) -> torch.Tensor:
    """``(batch, T)`` int64: for each position, the first position holding the same id in its row.

    Two rows share one repetition pattern (``ids[i] == ids[j]`` for the same ``i, j``) exactly when their
    first positions are equal: an ``O(T log T)`` check where comparing the ``T x T`` equality maps is ``O(T^2)``."""
    ordered, order = identity.sort(dim=1, stable=True)  # equal ids adjacent, by position
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    run_start = (torch.arange(ordered.shape[1]) * starts).cummax(1).values  # where each entry's run begins
    first = order.gather(1, run_start)  # a run's first entry is its earliest position (stable sort)
    return torch.empty_like(order).scatter_(1, order, first)


def pattern_cells(identity: torch.Tensor) -> fused_kernel.Cells:
    """:func:`pattern_masks`' five masks of one sequence as :class:`ingest.fused.Cells`, built from its ``(T,)``
    identity (ids, special positions made unique) in ``O(T * copies)``: no ``T x T`` structure.

    Accumulators: 0 induction ``(i, j + 1)``, 1 duplicate ``(i, j)`` for each earlier ``j`` with the same id (and
    ``j + 1 < i`` for induction), 2 previous ``(i, i - 1)``, 3 sink ``(i, 0)``, 4 the whole of row ``i``; rows
    ``i >= 1`` only."""
    length = identity.shape[0]
    ordered, order = identity.sort(stable=True)  # equal ids adjacent, each group by position
    queries, earlier = [], []
    for gap in range(1, length):  # pairs (later, earlier) of one id, gap apart in its group: as many gaps as copies
        same = ordered[gap:] == ordered[:-gap]
        if not bool(same.any()):
            break
        queries.append(order[gap:][same])
        earlier.append(order[:-gap][same])
    query = torch.cat(queries) if queries else torch.empty(0, dtype=torch.long)
    key = torch.cat(earlier) if earlier else torch.empty(0, dtype=torch.long)
    induced = key + 1 < query
    position = torch.arange(length)
    rows = torch.cat([query[induced], query, position[1:], position[1:], position[1:]])
    keys = torch.cat([key[induced] + 1, key, position[:-1], torch.zeros(length - 1, dtype=torch.long),
                      torch.full((length - 1,), -1, dtype=torch.long)])  # fmt: skip
    sizes = [int(induced.sum()), len(query), length - 1, length - 1, length - 1]
    kinds = torch.cat([torch.full((size,), kind) for kind, size in enumerate(sizes)])
    chosen = rows >= 1
    rows, keys, kinds = rows[chosen], keys[chosen], kinds[chosen]
    ranked = torch.sort(rows, stable=True).indices
    pointers = torch.zeros(length + 1, dtype=torch.long)
    pointers[1:] = torch.bincount(rows, minlength=length).cumsum(0)
    return fused_kernel.Cells(pointers, keys[ranked].contiguous(), kinds[ranked].long().contiguous(), 5)


def cell_masks(cells: fused_kernel.Cells, length: int) -> torch.Tensor:
    """``(T * T, 5)`` float32: ``cells`` as the dense masks the maps path multiplies each layer's maps by."""
    masks = torch.zeros(length, length, cells.count)
    rows = torch.repeat_interleave(torch.arange(length), cells.rows.diff())
    whole = cells.keys < 0
    masks[rows[~whole], cells.keys[~whole], cells.kinds[~whole]] = 1.0
    masks[rows[whole][:, None], torch.arange(length)[None, :], cells.kinds[whole][:, None]] = 1.0  # key -1: the row
    return masks.view(length * length, cells.count)


# --- the run ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DetectionResult:
    """Per head of each stack, the four scores (``(layers, heads, 4)``, NaN where a stack has no such
    score), and the model's repeat gain where it has an LM head."""

    scores: dict[Stack, np.ndarray]  # stack -> (layers, heads, 4) float64, in DETECTORS order
    sequences: np.ndarray  # (S, T) int64
    plan: SequencePlan
    config: DetectionConfig
    loss_first: float | None  # mean next-token loss on the first copy (nats)
    loss_later: float | None  # on the later copies
    example_maps: dict[Stack, np.ndarray]  # stack -> (layers, heads, t, t) float32: the first sequence's maps
    example_tokens: list[str]
    seconds: float
    device: str
    dtype: str

    @property
    def repeat_gain(self) -> float | None:
        if self.loss_first is None or self.loss_later is None:
            return None
        return self.loss_first - self.loss_later

    def score(self, stack: Stack, detector: Detector) -> np.ndarray:
        return self.scores[stack][..., DETECTORS.index(detector)]

    def roles(self, stack: Stack) -> list[list[list[str]]]:
        """Per layer and head, the detectors whose score reaches its threshold, in DETECTORS order."""
        values = self.scores[stack]
        thresholds = [self.config.thresholds[name] for name in DETECTORS]
        return [
            [[name for k, name in enumerate(DETECTORS) if row[k] >= thresholds[k]] for row in layer] for layer in values
        ]

    def metadata(self) -> dict[str, Any]:
        return {
            "sequences": self.sequences.tolist(),
            "prefix": list(self.plan.prefix),
            "suffix": list(self.plan.suffix),
            "prefix_source": self.plan.prefix_source,
            "pool_size": len(self.plan.pool),
            "decoder_input": "the sequence itself" if "cross" in self.scores else None,
        }


class _DetectorReducer:
    """The probe callback: each layer's maps times the batch's pattern masks, per sequence, summed."""

    def __init__(self, edit: ProbeCallback | None) -> None:
        self.edit = edit
        self.sums: dict[tuple[Stack, int], torch.Tensor] = {}  # (stack, layer) -> (heads, 4) float64
        self.examples: dict[tuple[Stack, int], torch.Tensor] = {}  # (stack, layer) -> (heads, t, t) float32
        self.length = 0
        self.masks: torch.Tensor | None = None  # (T*T, 5) float32, the maps path's only
        self.cells: fused_kernel.Cells | None = None  # the five patterns' cells, the fused kernel's accumulators
        self.keep_example = False
        self.calls = 0

    def start(self, identity: torch.Tensor) -> None:
        """The run's pattern cells from one sequence's ``(T,)`` identity: the same for every sequence (see
        :func:`detect_heads`); the maps path makes them dense masks on its first call only."""
        self.length = identity.shape[0]
        self.masks = None
        self.cells = pattern_cells(identity.cpu())

    def start_batch(self, keep_example: bool) -> None:
        self.keep_example = keep_example

    def __call__(self, call: AttentionCall) -> torch.Tensor | None:
        if self.masks is None:  # (T*T, 5) float32: 5 * 4 T^2 bytes, which the fused path never needs
            assert self.cells is not None
            self.masks = cell_masks(self.cells, self.length)
        replaced = self.edit(call) if self.edit is not None else None
        probs = call.probs if replaced is None else replaced  # (batch, head, q, k)
        batch, heads, queries, keys = probs.shape
        if queries * keys != self.masks.shape[0]:
            raise RuntimeError(f"{call.stack} layer {call.layer}: a {queries}x{keys} map, not the sequence's")
        masks = self.masks.to(probs.device)
        flat = probs.reshape(batch * heads, queries * keys).to(masks.dtype)
        sums = torch.matmul(flat, masks).view(batch, heads, -1)  # (batch, head, 5): one GEMM over every map
        self._add(call.stack, call.layer, sums)
        if self.keep_example and call.rows == 0:
            self.examples[call.stack, call.layer] = _example(probs[0])
        return replaced

    def fused(self, call: FusedCall) -> torch.Tensor:
        """A layer's attention output, the five masses taken in the same pass (:func:`ingest.fused.attend_cells`)."""
        assert self.cells is not None
        if call.query.shape[2] != self.cells.rows.shape[0] - 1 or call.key.shape[2] != call.query.shape[2]:
            raise RuntimeError(f"{call.stack} layer {call.layer}: a {call.query.shape[2]}x{call.key.shape[2]} map, "
                               "not the sequence's")  # fmt: skip
        example = None
        if self.keep_example:  # a fused call holds the whole batch: its first sequence is the run's, pooled in the pass
            length = call.query.shape[2]
            side = min(length, EXAMPLE_MAP_MAX)
            example = fused_kernel.Example(0, length, length, (side, side))
        output, masses = fused_kernel.attend_cells(
            call.query, call.key, call.value, call.mask,
            scale=call.scale, causal=call.causal, softcap=call.softcap, cells=self.cells, example=example,
        )  # fmt: skip
        self._add(call.stack, call.layer, masses)
        if example is not None:
            assert example.maps is not None
            self.examples[call.stack, call.layer] = example.maps.float().cpu()
        return output

    def _add(self, stack: Stack, layer: int, sums: torch.Tensor) -> None:
        """One call's ``(batch, head, 5)`` masses (four patterns, then the rows scored) into the layer's scores."""
        total = sums[..., 4:]
        per_sequence = torch.where(total > 0, sums[..., :4] / total.clamp_min(torch.finfo(total.dtype).tiny), 0.0)
        if stack == "cross":
            per_sequence[..., :2] = torch.nan  # keys are the encoder's: no duplicate or induction
        key = (stack, layer)
        layer_sums = per_sequence.double().sum(0)  # (head, 4)
        self.sums[key] = self.sums[key] + layer_sums if key in self.sums else layer_sums
        self.calls += 1


def _example(probs: torch.Tensor) -> torch.Tensor:
    """One sequence's ``(head, q, k)`` maps as float32 on the CPU, pooled to EXAMPLE_MAP_MAX a side when longer."""
    maps = probs.detach().float()
    if max(maps.shape[-2:]) > EXAMPLE_MAP_MAX:
        maps = torch.nn.functional.adaptive_avg_pool2d(maps, EXAMPLE_MAP_MAX)
    return maps.cpu()


def next_token_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each position's next-token loss in nats, ``(batch, T - 1)``: ``cross_entropy(logits[:, :-1], ids[:, 1:])``
    in float32, :data:`LOSS_CHUNK_BYTES` of rows at a time, each chunk's log-probabilities read back while they are
    in cache: no (batch, T - 1, V) copy of the logits, and no (batch, T - 1, V) of log-probabilities. On the CPU
    that whole call cost 0.26x-0.4x of a random Llama's forward at 50 tokens (its LM head's logits) by CPU time,
    this about 0.06x (docs/detectors.md, "Cost: a detection run against the plain eager forward")."""
    batch, length, vocab = logits.shape
    flat = logits.reshape(batch * length, vocab)  # a view of the model's contiguous logits
    # position t's target is token t + 1; the last position's (the next sequence's first) is dropped below
    targets = torch.roll(ids.reshape(-1), -1).to(logits.device)
    step = max(1, LOSS_CHUNK_BYTES.get(logits.device.type, LOSS_CHUNK_BYTES["cuda"]) // (vocab * 4))
    losses = torch.empty(batch * length, dtype=torch.float32, device=logits.device)
    for first in range(0, batch * length, step):
        rows = torch.log_softmax(flat[first : first + step].float(), dim=-1)  # cache-sized: read back while there
        torch.neg(rows.gather(1, targets[first : first + step, None]).squeeze(1), out=losses[first : first + step])
    return losses.view(batch, length)[:, :-1]


def _model_device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def detect_heads(
    model: nn.Module,
    tokenizer: Any,
    config: DetectionConfig | None = None,
    *,
    edit: ProbeCallback | None = None,
    progress: ProgressCallback | None = None,
) -> DetectionResult:
    """The four scores of every head of every stack, and the repeat gain of a causal LM (SPEC 10).

    ``edit``, when given, may replace a layer's probabilities (as an :class:`AttentionProbe`
    callback does) before they are scored and used: the scores and gain of an ablated model.
    Every refusal (:class:`DetectionError`) comes before any forward pass.
    """
    config = config or DetectionConfig()
    started = time.perf_counter()
    plan = plan_sequences(model, tokenizer, config)
    stacks_present = {site.stack for site in attention_sites(model)}
    causal_lm = _is_causal_lm(model, stacks_present)
    sequences = make_sequences(plan, config)
    count, length = sequences.shape
    device = _model_device(model)
    special = torch.zeros(length, dtype=torch.bool)
    special[: len(plan.prefix)] = True
    special[length - len(plan.suffix) :] = True
    start, copy = len(plan.prefix), config.length
    # Next-token targets scored for the gain: every token of a copy but its first, by copy.
    target_copy = torch.full((length,), -1, dtype=torch.long)
    for c in range(config.copies):
        target_copy[start + c * copy + 1 : start + (c + 1) * copy] = c
    loss_sums, loss_counts = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    # the positions 1.. predicted on the first copy, and on the later ones, each counted once
    scored = [(chosen, int(chosen.sum())) for chosen in (target_copy[1:] == 0, target_copy[1:] >= 1)]

    # Every sequence has the same equality pattern (distinct ids in a copy, the same copies, unique special
    # tokens), so one set of pattern cells serves them all: checked here, once, on the ids themselves.
    everything = torch.from_numpy(sequences)
    identity = torch.where(special[None, :], -1 - torch.arange(length)[None, :], everything)
    if not bool((first_positions(identity) == first_positions(identity[:1])).all()):
        raise RuntimeError("the sequences do not share one repetition pattern; they are not make_sequences'")
    reducer = _DetectorReducer(edit)
    reducer.start(identity[0])
    if edit is not None:
        reduction, why = "maps", "an edit replaces the maps"
    else:
        from ingest.features import choose_reduction  # the feature runs' rule: one policy for both

        reduction, why = choose_reduction(model, device, stacks_present, length)
    logger.info("reduction: %s (%s)", reduction, why)
    budget = SUB_BATCH_MAP_BYTES if device.type == "cpu" else None
    encoder_decoder = "cross" in stacks_present
    was_training = model.training
    model.eval()
    done = 0
    fused = reducer.fused if reduction == "fused" else None
    try:
        with torch.inference_mode(), AttentionProbe(model, reducer, max_map_bytes=budget, fused=fused):
            for number, first in enumerate(range(0, count, config.batch_size)):
                ids = torch.from_numpy(sequences[first : first + config.batch_size])
                reducer.start_batch(keep_example=first == 0)
                inputs = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}
                if encoder_decoder:
                    inputs["decoder_input_ids"] = inputs["input_ids"]
                calls = reducer.calls
                output = model(**inputs)
                if number == 0 and reducer.calls == calls:
                    raise RuntimeError(f"{type(model).__name__} ran without calling headcat's attention probe")
                if causal_lm:
                    losses = next_token_losses(output.logits, inputs["input_ids"])  # (batch, T-1): positions 1..
                    for k, (chosen, positions) in enumerate(scored):
                        loss_sums[k] += float(losses[:, chosen.to(losses.device)].double().sum())  # a no-op on the CPU
                        loss_counts[k] += positions * len(ids)
                    del losses
                del output
                done += len(ids)
                if progress is not None:
                    progress(done, count)
    finally:
        model.train(was_training)

    scores: dict[Stack, np.ndarray] = {}
    examples: dict[Stack, np.ndarray] = {}
    for stack in STACKS:
        layers = sorted(layer for name, layer in reducer.sums if name == stack)
        if not layers:
            continue
        if layers != list(range(len(layers))):
            raise RuntimeError(f"the probe saw {stack} layers {layers}; expected 0..{len(layers) - 1}")
        scores[stack] = torch.stack([reducer.sums[stack, layer] for layer in layers]).cpu().numpy() / count
        examples[stack] = torch.stack([reducer.examples[stack, layer] for layer in layers]).numpy()
    parameter = next(model.parameters())
    loss_first = float(loss_sums[0] / loss_counts[0]) if causal_lm else None
    loss_later = float(loss_sums[1] / loss_counts[1]) if causal_lm else None
    seconds = time.perf_counter() - started
    result = DetectionResult(
        scores=scores,
        sequences=sequences,
        plan=plan,
        config=dataclasses.replace(config, reduction=reduction),
        loss_first=loss_first,
        loss_later=loss_later,
        example_maps=examples,
        example_tokens=list(tokenizer.convert_ids_to_tokens(sequences[0].tolist())),
        seconds=seconds,
        device=str(device),
        dtype=str(parameter.dtype).removeprefix("torch."),
    )
    logger.info(
        "head detectors of %s on %d sequences of %d tokens in %.1f s%s",
        ", ".join(f"{stack} {v.shape[0]}x{v.shape[1]}" for stack, v in scores.items()),
        count,
        length,
        seconds,
        "" if result.repeat_gain is None else f"; repeat gain {result.repeat_gain:.3f} nats",
    )
    return result


def role_heads(result: DetectionResult, role: Detector) -> list[tuple[Stack, int, int]]:
    """Every ``(stack, layer, head)`` with ``role``, in stack, layer, head order."""
    out = []
    for stack in STACKS:
        if stack not in result.scores:
            continue
        values = result.score(stack, role)
        threshold = result.config.thresholds[role]
        out += [(stack, int(layer), int(head)) for layer, head in zip(*np.nonzero(values >= threshold), strict=True)]
    return out


def roles_by_head(result: DetectionResult) -> dict[tuple[Stack, int, int], list[str]]:
    """``{(stack, layer, head): roles}`` of every head: what selections by role resolve against."""
    return {
        (stack, layer, head): roles
        for stack in result.scores
        for layer, by_head in enumerate(result.roles(stack))
        for head, roles in enumerate(by_head)
    }


def finite_or_none(value: float) -> float | None:
    """A score for JSON and SQL: NaN (no such score for the stack) as None."""
    return None if math.isnan(value) else float(value)


def next_token_loss(
    model: nn.Module,
    tokenizer: Any,
    texts: Sequence[str],
    *,
    edit: ProbeCallback | None = None,
    max_length: int = 128,
    batch_size: int = 16,
) -> float:
    """A causal LM's mean next-token loss (nats) over every predicted token of ``texts`` (each truncated to
    ``max_length`` tokens, the model's BOS first where its tokenizer adds none), with ``edit`` applied to
    the attention inside the forward when given (an ablation)."""
    text_config = _text_config(model)
    bos = getattr(text_config, "bos_token_id", None)
    prefix, _ = _affixes(tokenizer)
    rows = []
    for text in texts:
        encoded = list(tokenizer(text, add_special_tokens=True)["input_ids"])
        if not prefix and isinstance(bos, int) and bos >= 0:
            encoded = [bos, *encoded]
        if len(encoded) >= 2:
            rows.append(encoded[:max_length])
    if not rows:
        raise DetectionError("corpus: no text with two tokens to score the next-token loss on")
    device = _model_device(model)
    total, count = 0.0, 0
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    probe = AttentionProbe(model, edit) if edit is not None else None
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            if probe is not None:
                probe.__enter__()
            try:
                for start in range(0, len(rows), batch_size):
                    part = rows[start : start + batch_size]
                    length = max(len(r) for r in part)
                    ids = torch.full((len(part), length), pad, dtype=torch.long)
                    mask = torch.zeros_like(ids)
                    for row, values in enumerate(part):
                        ids[row, : len(values)] = torch.tensor(values)
                        mask[row, : len(values)] = 1
                    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
                    losses = next_token_losses(logits, ids)
                    real = mask[:, 1:].bool().to(device)
                    total += float(losses[real].double().sum())
                    count += int(real.sum())
            finally:
                if probe is not None:
                    probe.__exit__(None, None, None)
    finally:
        model.train(was_training)
    return total / count


def causal_check(
    model: nn.Module,
    tokenizer: Any,
    result: DetectionResult,
    roles: Sequence[Detector] = ("induction",),
    *,
    texts: Sequence[str] | None = None,
    max_length: int = 128,
) -> list[dict[str, Any]]:
    """What each role is for (SPEC 10): the repeat gain on the run's own sequences with the heads of the
    role pruned (``role:<name>``, through the ablation's own edit), against the gain with every head; with
    ``texts``, also the next-token loss on them (:func:`next_token_loss`) with and without the heads.

    Returns one entry per role: its heads, and the next-token losses and gain without them; a role no
    head has is reported with no losses. Needs a causal LM (a result with a repeat gain).
    """
    from ingest.ablation import AblationSpec, HeadSelection, spec_callback
    from ingest.selection import model_shapes

    if result.repeat_gain is None:
        raise DetectionError("the causal check measures the repeat gain, which needs a causal LM head")
    corpus = None if texts is None else next_token_loss(model, tokenizer, texts, max_length=max_length)
    out: list[dict[str, Any]] = []
    for role in roles:
        heads = role_heads(result, role)
        entry: dict[str, Any] = {"role": role, "heads": [list(head) for head in heads],
                                 "with": {"loss_first": result.loss_first, "loss_later": result.loss_later,
                                          "repeat_gain": result.repeat_gain, "corpus_loss": corpus}}  # fmt: skip
        if heads:
            spec = AblationSpec.build(
                {"prune": HeadSelection.of_role(role)}, roles=roles_by_head(result), shapes=model_shapes(model)
            )
            edit = spec_callback(spec)
            pruned = detect_heads(model, tokenizer, result.config, edit=edit)
            entry["without"] = {"loss_first": pruned.loss_first, "loss_later": pruned.loss_later,
                                "repeat_gain": pruned.repeat_gain, "corpus_loss": None if texts is None else
                                next_token_loss(model, tokenizer, texts, edit=edit, max_length=max_length)}  # fmt: skip
        else:
            entry["without"] = None
        out.append(entry)
        logger.info("causal check of %s (%d heads): repeat gain %.3f with them, %s without", role, len(heads),
                    result.repeat_gain, "n/a" if entry["without"] is None else
                    f"{entry['without']['repeat_gain']:.3f}")  # fmt: skip
    return out
