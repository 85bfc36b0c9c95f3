"""Distance features of every attention head (SPEC section 1; Guan et al. 2020, section 3).

For one sample, one head, ``L`` real tokens and attention ``A[s, t]``, every cell ``(s, t)`` of
the ``L x L`` map belongs to exactly one group:

- the key's special group (``cls``, ``sep``, ``period``, ``comma``) when key ``t`` is special;
- else ``self`` when ``t == s``;
- else window ``i = min(N - 1, floor(|s - t| * N / L))``.

A group's feature is the attention in its cells summed over all queries and divided by ``L``,
so the ``N + 5`` features of a sample sum to 1. A head's vector is the mean over samples, in the
order ``w0..w{N-1}, self, cls, sep, period, comma``. Scalars beside it (Clark et al. 2019):
entropy (nats), attention to the previous and to the next token, mean attention distance, and
``[SEP]``-to-``[SEP]`` attention.

How it is computed: the model runs once per batch under an :class:`~ingest.attention.AttentionProbe`.
Each layer's probabilities are reduced the moment they exist (:func:`reduce_attention`, with the
per-batch :func:`build_weights`): windows, self, previous/next token and distance depend only on
the offset ``t - s``, so they follow from the map's per-offset (diagonal) sums, one pass over the
map whatever the number of features, and a small product with weights shared by all samples of
one length; the few special keys' cells are taken out of those sums and moved to their groups;
entropy comes from the scores without an ``exp`` or ``log`` pass over the map. On the CPU, all of
this is one compiled pass over each map (:mod:`ingest.kernels`), run on a few samples' maps at a
time while they are in cache; on a GPU, a few batched torch ops. Only per-sample sums
(``batch x head x features``) outlive the layer, summed in float64 on the model's device. No
layer's map is kept, except the downsampled example map.

Measured with ``bench/features.py`` (all-MiniLM-L6-v2 on CPU, 1 thread): see the README's
Performance section for the figures and the machine.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ingest import fused as fused_kernel
from ingest import kernels
from ingest.attention import AttentionCall, AttentionProbe, FusedCall, attention_sites
from ingest.corpora import Sample
from ingest.loading import LoadedModel
from ingest.types import SCALARS, SPECIAL_GROUPS, STACKS, SpecialGroup, Stack, feature_names

logger = logging.getLogger(__name__)

# Prefixes that byte-level BPE ("Ġ") and SentencePiece ("▁") put on a word-initial token.
_WORD_PREFIXES = "Ġ▁"
_PUNCTUATION: dict[SpecialGroup, str] = {"period": ".", "comma": ","}

ProgressCallback = Callable[[int, int], None]


@dataclass(frozen=True)
class FeatureConfig:
    """One feature run's parameters; stored with its results (:meth:`to_json`)."""

    num_windows: int = 16
    max_length: int = 128  # tokens per sample after truncation, special tokens included
    batch_size: int = 32
    samples: int = 1000  # at most this many samples are read from the corpus
    map_size: int = 32  # side of the downsampled example attention map
    device: str = "auto"  # what load_model is asked for; extraction runs where the model is
    dtype: str = "float32"
    prepend_bos: bool = True  # causal models whose tokenizer adds no start token get the model's BOS
    # Filled by extract_features in the result's config (so the stored run config records it):
    # {"prepended_bos": bool, "decoder_input": {...} for encoder-decoders}. Not an input.
    input_form: dict[str, Any] | None = field(default=None, compare=False)
    # Filled by extract_features in the result's config: "fused" when every layer's statistics were taken in
    # the attention's own pass (ingest.fused, no map held), "maps" when each layer's maps were reduced. Not an input.
    reduction: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_windows", "max_length", "batch_size", "samples", "map_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"FeatureConfig.{name} must be >= 1, not {getattr(self, name)}")
        if self.max_length < 2:
            raise ValueError("FeatureConfig.max_length must be >= 2")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def num_features(self) -> int:
        return self.num_windows + 1 + len(SPECIAL_GROUPS)


@dataclass(frozen=True)
class SpecialTokens:
    """The token ids (and their strings) of each special group, as resolved from a tokenizer."""

    ids: dict[str, list[int]]
    tokens: dict[str, list[str]]

    def group_table(self, vocab_size: int) -> torch.Tensor:
        """``(vocab,)`` long: the group index (SPECIAL_GROUPS order) of each token id, -1 if none."""
        size = max([vocab_size, *(i + 1 for ids in self.ids.values() for i in ids)])
        table = torch.full((size,), -1, dtype=torch.long)
        for g, group in reversed(list(enumerate(SPECIAL_GROUPS))):  # cls wins over sep, ...
            table[torch.tensor(self.ids[group], dtype=torch.long)] = g
        return table


def resolve_special_tokens(tokenizer: Any) -> SpecialTokens:
    """``cls`` = the classifier token (or BOS), ``sep`` = the separator (or EOS), ``period`` and
    ``comma`` = every vocabulary token that is ``.`` or ``,`` once stripped of ``Ġ``/``▁``.

    An id in two groups counts in the first of ``cls, sep, period, comma`` (e.g. GPT-2's
    ``<|endoftext|>`` is both BOS and EOS: it counts as ``cls``).
    """
    ids: dict[str, list[int]] = {group: [] for group in SPECIAL_GROUPS}
    for group, names in (("cls", ("cls_token_id", "bos_token_id")), ("sep", ("sep_token_id", "eos_token_id"))):
        for name in names:
            value = getattr(tokenizer, name, None)
            if isinstance(value, int):
                ids[group] = [value]
                break
    marks: dict[str, str] = {mark: group for group, mark in _PUNCTUATION.items()}
    for token, index in tokenizer.get_vocab().items():
        if token[-1:] in marks and (marked := marks.get(token.lstrip(_WORD_PREFIXES))) is not None:
            ids[marked].append(int(index))
    claimed: set[int] = set()
    for group in SPECIAL_GROUPS:
        ids[group] = sorted(set(ids[group]) - claimed)
        claimed.update(ids[group])
    tokens: dict[str, list[str]] = {
        group: list(tokenizer.convert_ids_to_tokens(ids[group])) for group in SPECIAL_GROUPS
    }
    return SpecialTokens(ids=ids, tokens=tokens)


# --- the reduction ----------------------------------------------------------------------------
#
# Every real cell (s, t) of a sample's L x L map is in exactly one group: the key's special group
# when key t is special, else self (t == s), else window min(N - 1, floor(|s - t| N / L)).
# For one layer's probabilities A, per sample and head:
#
# 1. "All keys": the windows, self, previous / next token and distance of a cell depend only on
#    its offset o = t - s (and L), so they follow from the map's per-offset (diagonal) sums
#    D[o] = sum_s A[s, s + o], as if no key were special: one pass over the map that does not
#    grow with the number of features (on the CPU, the compiled kernel of ingest.kernels; on a GPU,
#    _offset_sums: the column sums of a skewed copy), then
#    D @ W_L, W_L (2T - 1, N + 4) having the columns w0..w{N-1}, self (one-hot of the offset's
#    window or self), t == s - 1, t == s + 1 and |s - t| of each offset, zero where |o| >= L
#    (offset_weights). It depends only on (L, T): cached across batches (LengthWeightsCache).
#    When products are batched (CUDA, many lengths), the cell-by-cell A @ W_cells is used
#    instead, W_cells (T*T, N + 4) being those columns for every cell, zero where s or t is
#    padding (length_weights).
# 2. Special keys: their mass in windows/self (the step-1 columns of those cells, subtracted from
#    it), in their group, and sep_to_sep (both s and t_j [SEP]). On the CPU, the kernel reads each
#    row's J special cells in the same pass: their own per-offset sums (@ W_L, as in step 1), each
#    special column's sum (@ the slots' group one-hot) and the [SEP] rows' mass on [SEP] keys. On a
#    GPU, the J columns A[:, :, :, t_j] are gathered, (batch, head, T, J), and one small product with a
#    (batch, T*J, N + 6) matrix of the cells' indicators gives all three.
# 3. Entropy from the scores (see reduce_attention).
# Indicators are exact in any float dtype; each sample's divisors (L, L - 1, number of [SEP]
# queries) are applied at the end in float64.
#
# Outputs of reduce_attention, per sample and head (F = N + 10):
#   0..N+4  the N + 5 distance features w0..w{N-1}, self, cls, sep, period, comma (sum to 1)
#   N+5..   the SCALARS: entropy, prev_token, next_token, mean_distance, sep_to_sep

# On CUDA, a batch with more runs of equal length than this uses one batched product with a
# per-sample copy of W_cells instead of one reduction per run (kernel launches cost more than bytes there).
MAX_RUNS_ON_GPU = 4
# The GPU branches of reduce_attention (no host synchronisation: _log_normalizer's fallback computed
# everywhere, the offset sums by _offset_sums and the entropy's product by one einsum instead of the
# compiled kernel) run wherever the maps are not on the CPU, and on the CPU too when this is set: the
# tests set it.
GPU_BRANCHES_ON_CPU = False
# Bytes of scratch that stay in cache (a few maps' skewed copies at a time, see _skewed_sums): half
# of a 2 MiB L2. Measured on one sample's maps at 384 tokens, 1 thread: the reduction took 0.74x the
# time it took with 4 MiB of scratch; at 128 and 512 tokens, 0.9-1.0x.
_CACHE_BYTES = 1 << 20
# Off the CPU, each skewed copy (see _skewed_sums) takes as many maps as fit in this many bytes: there a
# copy and its column sum cost a kernel launch each, far more than the bytes they move (at 1 MiB a copy,
# BERT-base's 384 maps of 128 tokens were 110 launches a layer, and features ran at 0.37x the forward on
# an H200; see bench/gpu.sh).
_DEVICE_COPY_BYTES = 256 << 20
# On the CPU, the attention of a batch runs over sub-batches whose maps take at most this many bytes
# (one sample at least): its scores, softmax and reduction stay in cache. Measured on MiniLM (12 heads,
# 32 samples), 1 thread, forward alone, on a busy host: 4 samples a call at 128 tokens, 1 at 384 and
# 512 were fastest (0.87x, 0.65x, 0.60x the CPU time of whole-batch calls); on an idle one, 0.89-0.94x.
SUB_BATCH_MAP_BYTES = 4 << 20


def length_weights(
    length: int, padded: int, num_windows: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """W_cells: ``(T*T, N + 4)``: window / self one-hot, previous, next and distance of each real cell."""
    n = num_windows
    position = torch.arange(padded, device=device)
    distance = (position[None, :] - position[:, None]).abs()  # (T, T)
    group = torch.where(distance == 0, n, torch.clamp(distance * n // max(length, 1), max=n - 1))
    real = position < length  # (T,)
    cell_real = real[:, None] & real[None, :]  # (T, T)
    group = torch.where(cell_real, group, n + 1)  # matches no column
    weights = torch.empty(padded * padded, n + 4, dtype=dtype, device=device)  # (T*T, N + 4)
    codes = torch.arange(n + 1, device=device)
    torch.eq(group.view(-1, 1), codes.view(1, -1), out=weights[:, : n + 1])
    offset = position[None, :] - position[:, None]  # (T, T): t - s
    torch.logical_and(offset == -1, cell_real, out=weights[:, n + 1].view(padded, padded))
    torch.logical_and(offset == 1, cell_real, out=weights[:, n + 2].view(padded, padded))
    torch.mul(distance.view(-1), cell_real.view(-1), out=weights[:, n + 3])
    return weights


def offset_weights(
    length: int, padded: int, num_windows: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """W_L: ``(2T - 1, N + 4)``, the step-1 columns of offset ``o = t - s`` in row ``T - 1 + o``, 0 if ``|o| >= L``."""
    offsets = torch.arange(-(padded - 1), padded, device=device)
    return kernels.offset_columns(offsets, length, num_windows, dtype)


class LengthWeightsCache:
    """Per-length weights (W_L, and W_cells where needed) by (length, padded length), least
    recently used first out, at most ``max_bytes``."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[Any, ...], torch.Tensor] = OrderedDict()

    def get(self, length: int, padded: int, num_windows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """W_cells (:func:`length_weights`)."""
        return self._get(length_weights, length, padded, num_windows, dtype, device)

    def offsets(
        self, length: int, padded: int, num_windows: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """W_L (:func:`offset_weights`)."""
        return self._get(offset_weights, length, padded, num_windows, dtype, device)

    def _get(
        self,
        build: Callable[[int, int, int, torch.dtype, torch.device], torch.Tensor],
        length: int,
        padded: int,
        num_windows: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        key = (build.__name__, length, padded, num_windows, dtype, str(device))
        weights = self._entries.pop(key, None)
        if weights is None:
            weights = build(length, padded, num_windows, dtype, device)
        self._entries[key] = weights
        while len(self._entries) > 1 and self._bytes() > self.max_bytes:
            self._entries.popitem(last=False)
        return weights

    def _bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self._entries.values())


@dataclass(frozen=True)
class ReductionWeights:
    """What :func:`reduce_attention` needs about one padded batch; built once, used by every layer."""

    num_windows: int
    runs: tuple[tuple[int, int, int, torch.Tensor], ...]  # (start, stop, L, offset weights): rows start:stop
    per_sample: torch.Tensor | None  # (batch, T*T, N + 4): W_cells of each row, when products are batched
    special_index: torch.Tensor  # (batch, 1, 1, J) long: special key positions (0 in unused slots)
    special_counts: torch.Tensor  # (batch,) long: used slots (the first ones)
    slot_groups: torch.Tensor  # (batch, J) long: SPECIAL_GROUPS index of each slot's key, -1 in unused slots
    sep_queries: torch.Tensor  # (batch, T) bool: real [SEP] query rows
    # (batch, T*J, N + 6): each (query, slot) cell's window/self column, group and sep_to_sep, as indicators;
    # None on the CPU, whose kernel needs none (made when a torch branch runs there: see _special_mass)
    special_matrix: torch.Tensor | None
    query_mask: torch.Tensor  # (batch, T) bool: real query positions
    scale: torch.Tensor  # (batch, F) float64 per-sample divisor reciprocals (0 where undefined)
    has_sep: torch.Tensor  # (batch,) bool: the sample has a [SEP] query (sep_to_sep is defined)
    # Buffers reused by every layer of the batch (no allocation per layer: fresh large
    # allocations cost page faults on CPU and fragment the heap for the model's own tensors).
    scratch: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict, compare=False)
    # heads -> the CPU kernel's inputs for these rows (see _kernel_inputs): not shared with row slices
    kernel_inputs: dict[int, tuple[kernels.Plan, torch.Tensor]] = field(default_factory=dict, compare=False)

    def rows(self, start: int, stop: int) -> ReductionWeights:
        """The weights of batch rows ``start:stop`` (a sub-batch's maps), sharing this batch's buffers."""
        runs = tuple(
            (max(first, start) - start, min(last, stop) - start, value, offsets)
            for first, last, value, offsets in self.runs
            if first < stop and last > start
        )
        return dataclasses.replace(
            self,
            runs=runs,
            per_sample=self.per_sample[start:stop] if self.per_sample is not None else None,
            special_index=self.special_index[start:stop],
            special_counts=self.special_counts[start:stop],
            slot_groups=self.slot_groups[start:stop],
            sep_queries=self.sep_queries[start:stop],
            special_matrix=self.special_matrix[start:stop] if self.special_matrix is not None else None,
            query_mask=self.query_mask[start:stop],
            scale=self.scale[start:stop],
            has_sep=self.has_sep[start:stop],
            scratch=self.scratch,
            kernel_inputs={},
        )


def _special_matrix(
    positions: torch.Tensor,  # (batch, J) long
    slot_groups: torch.Tensor,  # (batch, J) long, -1 unused
    sep_queries: torch.Tensor,  # (batch, T) bool
    query_mask: torch.Tensor,  # (batch, T) bool
    num_windows: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``(batch, T*J, N + 6)``: indicators of each (real query, used slot) cell's window/self column, group and
    sep_to_sep (both the query and the slot's key [SEP])."""
    batch, length = query_mask.shape
    slots = positions.shape[1]
    n = num_windows
    lengths = query_mask.sum(1)  # (batch,)
    position = torch.arange(length, device=positions.device)
    cell = query_mask[:, :, None] & (slot_groups >= 0)[:, None, :]  # (batch, T, J)
    distance = (position[None, :, None] - positions[:, None, :]).abs()  # (batch, T, J)
    window = torch.clamp(distance * n // lengths.clamp(min=1)[:, None, None], max=n - 1)
    code = torch.where(cell, torch.where(distance == 0, n, window), -1)  # (batch, T, J)
    group_code = torch.where(cell, slot_groups[:, None, :], -1)  # (batch, T, J)
    matrix = torch.empty(batch, length, slots, n + 6, dtype=dtype, device=positions.device)
    torch.eq(code[..., None], torch.arange(n + 1, device=positions.device), out=matrix[..., : n + 1])
    torch.eq(
        group_code[..., None],
        torch.arange(len(SPECIAL_GROUPS), device=positions.device),
        out=matrix[..., n + 1 : n + 5],
    )
    sep = SPECIAL_GROUPS.index("sep")
    torch.logical_and(sep_queries[:, :, None], slot_groups[:, None, :] == sep, out=matrix[..., n + 5])
    return matrix.view(batch, length * slots, n + 6)


def build_weights(
    key_groups: torch.Tensor,  # (batch, T) long: SPECIAL_GROUPS index of each token, -1 if none
    lengths: torch.Tensor,  # (batch,) long: real tokens per sample (real tokens come first)
    num_windows: int,
    dtype: torch.dtype = torch.float32,
    *,
    device: torch.device | str | None = None,
    cache: LengthWeightsCache | None = None,
    batched: bool | None = None,  # one batched product (True) or one per run of lengths (False)
) -> ReductionWeights:
    """Everything :func:`reduce_attention` needs about one right-padded batch (see above).

    ``key_groups`` and ``lengths`` are best given on the CPU: the sizes are read there, with no
    device synchronisation; the weights are built on ``device`` (default: ``key_groups``' device).
    """
    if not 1 <= num_windows < 250:
        raise ValueError(f"num_windows must be in 1..249, not {num_windows}")
    batch, length = key_groups.shape
    device = torch.device(device) if device is not None else key_groups.device
    n = num_windows
    cache = cache if cache is not None else LengthWeightsCache()
    host_lengths = [int(value) for value in lengths.tolist()]
    host_position = torch.arange(length)
    host_special = (key_groups.cpu() >= 0) & (host_position[None, :] < lengths.cpu()[:, None])  # (batch, T)
    slots = int(host_special.sum(1).max()) if batch else 0  # J: most special keys in one sample
    key_groups = key_groups.to(device=device, dtype=torch.long)
    lengths = lengths.to(device=device, dtype=torch.long)
    position = torch.arange(length, device=device)
    real = position[None, :] < lengths[:, None]  # (batch, T)

    # 1. Offset weights per run of equal lengths (batches sorted by length have few runs), in the
    # dtype the sums are taken in (float32 for half-precision maps).
    step_dtype = _accumulation_dtype(dtype)
    runs: list[tuple[int, int, int, torch.Tensor]] = []
    for row, value in enumerate(host_lengths):
        if runs and runs[-1][2] == value:
            runs[-1] = (runs[-1][0], row + 1, value, runs[-1][3])
        else:
            runs.append((row, row + 1, value, cache.offsets(value, length, n, step_dtype, device)))
    if batched is None:
        batched = device.type != "cpu" and len(runs) > MAX_RUNS_ON_GPU
    per_sample = None
    if batched:
        per_sample = torch.cat(
            [cache.get(value, length, n, dtype, device).expand(stop - start, -1, -1) for start, stop, value, _ in runs]
        )  # (batch, T*T, N + 4)

    # 2. Special keys: positions (stable order), group, and the correction matrix.
    special = (key_groups >= 0) & real  # (batch, T)
    counts = special.sum(1)  # (batch,)
    order = torch.argsort((~special).to(torch.uint8), dim=1, stable=True)[:, :slots]  # (batch, J)
    valid = torch.arange(slots, device=device)[None, :] < counts[:, None]  # (batch, J)
    positions = torch.where(valid, order, 0)  # (batch, J)
    slot_group = torch.where(valid, key_groups.gather(1, positions), -1)  # (batch, J)
    sep = SPECIAL_GROUPS.index("sep")
    is_sep = (key_groups == sep) & real  # (batch, T)
    special_index = positions[:, None, None, :]  # (batch, 1, 1, J)
    matrix = None  # the CPU's kernel needs none
    if device.type != "cpu":
        matrix = _special_matrix(positions, slot_group, is_sep, real, n, step_dtype)

    # Divisors, in float64: L for the distance features, entropy and mean distance; L - 1 for
    # previous / next token; the number of [SEP] queries for sep_to_sep.
    as_float = lengths.to(torch.float64)
    inverse_length = torch.where(as_float > 0, 1.0 / as_float.clamp(min=1), 0.0)  # (batch,)
    inverse_pairs = torch.where(as_float > 1, 1.0 / (as_float - 1).clamp(min=1), 0.0)
    seps = is_sep.sum(1).to(torch.float64)
    inverse_seps = torch.where(seps > 0, 1.0 / seps.clamp(min=1), 0.0)
    scale = torch.stack(
        [inverse_length] * (n + 5) + [inverse_length, inverse_pairs, inverse_pairs, inverse_length, inverse_seps],
        dim=1,
    )  # (batch, F)
    return ReductionWeights(
        num_windows=n,
        runs=tuple(runs),
        per_sample=per_sample,
        special_index=special_index,
        special_counts=counts,
        slot_groups=slot_group,
        sep_queries=is_sep,
        special_matrix=matrix,
        query_mask=real,
        scale=scale,
        has_sep=seps > 0,
    )


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b``, with float32 results from half-precision inputs where the backend offers it."""
    if a.is_cuda and a.dtype in (torch.float16, torch.bfloat16):
        try:
            return torch.bmm(a, b, out_dtype=torch.float32)  # type: ignore[call-arg]
        except (TypeError, RuntimeError, NotImplementedError):
            pass
    return torch.bmm(a, b)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _compiled(probs: torch.Tensor, scores: torch.Tensor | None) -> bool:
    """Whether the CPU kernel (:func:`ingest.kernels.reduce_maps`) takes this layer's sums (see _compiled_sums)."""
    return probs.device.type == "cpu" and not GPU_BRANCHES_ON_CPU and (scores is None or scores.dtype == probs.dtype)


def _compiled_sums(
    probs: torch.Tensor,  # (batch, head, T, T) on the CPU
    scores: torch.Tensor | None,
    weights: ReductionWeights,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`_offset_sums` ``(batch * head, 2T - 1)``, the entropy summed over real queries ``(batch, head)``
    (None without scores) and :func:`_special_mass` ``(batch, head, N + 6)`` (None without special keys) in one
    compiled pass over each map. Half-precision maps are widened to float32 first, the dtype all are summed in
    anyway; their lse then comes from the widened diagonal, exact as the softmax's own upcast."""
    batch, heads, length, _ = probs.shape
    dtype = _accumulation_dtype(probs.dtype)
    inputs = weights.kernel_inputs.get(heads)
    if inputs is None:  # the batch's (or sub-batch's) first layer
        inputs = weights.kernel_inputs[heads] = _kernel_inputs(weights, heads)
    plan, slot_groups = inputs
    result = kernels.reduce_maps(
        probs.to(dtype).view(batch * heads, length, length),
        plan,
        scores.to(dtype).reshape(batch * heads, length, length) if scores is not None else None,
    )
    entropy = result.entropy.view(batch, heads) if result.entropy is not None else None
    return result.offsets, entropy, _kernel_special(result, slot_groups, weights, batch, heads)


def _kernel_special(
    result: kernels.MapSums, slot_groups: torch.Tensor, weights: ReductionWeights, batch: int, heads: int
) -> torch.Tensor | None:
    """:func:`_special_mass` ``(batch, head, N + 6)`` from a kernel's sums (None without special keys)."""
    n = weights.num_windows
    if result.special_offsets is None or result.special_columns is None or result.sep_to_sep is None:
        return None
    offsets = result.special_offsets.view(batch, heads, -1)  # the special keys' windows and self, as the map's
    windows_self = torch.cat([offsets[start:stop] @ columns[:, : n + 1] for start, stop, _, columns in weights.runs])
    groups = result.special_columns.view(batch, heads, -1) @ slot_groups  # (batch, head, 4)
    sep_to_sep = result.sep_to_sep.view(batch, heads, 1)
    return torch.cat([windows_self.double(), groups, sep_to_sep], dim=-1)  # (batch, head, N + 6)


def _kernel_inputs(weights: ReductionWeights, heads: int) -> tuple[kernels.Plan, torch.Tensor]:
    """The kernel's checked plan for this batch's maps, and each special slot's group one-hot ``(batch, J, 4)``:
    made on the batch's first layer, used by the rest."""
    lengths = torch.tensor([value for start, stop, value, _ in weights.runs for _ in range(start, stop)])
    sep = weights.slot_groups == SPECIAL_GROUPS.index("sep")
    specials = kernels.Specials(  # the plan checks and keeps them as host arrays; the Triton kernel copies them back
        weights.special_index[:, 0, 0, :].cpu(),
        weights.special_counts.cpu(),
        sep.cpu(),
        weights.sep_queries.cpu(),
        weights.slot_groups.cpu(),
    )
    plan = kernels.plan(lengths, weights.query_mask.shape[1], heads, specials, num_windows=weights.num_windows,
                        group_count=len(SPECIAL_GROUPS))  # fmt: skip
    slot_groups = F.one_hot(weights.slot_groups + 1, len(SPECIAL_GROUPS) + 1)[..., 1:].double()  # unused slots: 0
    return plan, slot_groups


def _offset_sums(probs: torch.Tensor, weights: ReductionWeights) -> torch.Tensor:
    """``(batch * head, 2T - 1)``: ``D[o] = sum_s A[s, s + o]`` over the real cells of each map, in row ``T - 1 + o``.

    In a batch sorted by decreasing length (as :func:`extract_features` makes them) whose key padding
    holds no mass (it never does after a finfo.min or -inf mask: checked), the maps are copied, a few
    at a time, into a skewed buffer (:func:`_skewed_sums`) whose column sums are the offset sums. Otherwise
    run by run, over real cells only, a query row at a time: ``D[T - 1 - s : T - 1 - s + L] += A[s, :L]``.
    """
    batch, heads, length, _ = probs.shape
    maps = probs.view(batch * heads, length, length)
    dtype = weights.runs[0][3].dtype if weights.runs else _accumulation_dtype(probs.dtype)
    lengths = [value for start, stop, value, _ in weights.runs for _ in range(start, stop)]
    descending = all(earlier >= later for earlier, later in zip(lengths, lengths[1:], strict=False))
    if descending and not any(
        bool(probs[start:stop, :, :value, value:].any()) for start, stop, value, _ in weights.runs if value < length
    ):
        return _skewed_sums(maps, lengths, heads, dtype, weights.scratch)
    sums = torch.zeros(batch * heads, 2 * length - 1, dtype=dtype, device=probs.device)
    for start, stop, value, _ in weights.runs:
        rows = slice(start * heads, stop * heads)
        for s in range(value):
            sums[rows, length - 1 - s : length - 1 - s + value] += maps[rows, s, :value]
    return sums


def _skewed_sums(
    maps: torch.Tensor,  # (batch * head, T, T), no mass on padding keys
    lengths: list[int],  # real tokens of each sample (query rows s >= L are not summed)
    heads: int,
    dtype: torch.dtype,
    scratch: dict[tuple[int, ...], torch.Tensor],
) -> torch.Tensor:
    """Offset sums through a skewed copy: row ``s`` of a map goes to row ``s`` of a zeroed ``(T, R)`` buffer,
    starting at column ``T - 1 - s``, so that column ``T - 1 + o`` holds ``A[s, s + o]`` and the buffer's
    column sums are ``D``. One strided copy and one column sum per few maps, in a buffer that stays in cache
    (off the CPU, per as many maps as ``_DEVICE_COPY_BYTES`` holds: there launches cost more than bytes);
    the cells the copy never writes stay zero across calls (the buffer is kept in ``scratch``). The row
    length ``R >= 2T - 1`` makes the copy's row stride an odd multiple of 64 bytes (at ``R = 2T - 1`` and
    T = 512 consecutive rows are 4 KiB apart less 8 bytes, and the stores alias in the cache: 2-3x slower).
    """
    count, length, _ = maps.shape
    stride = 16 * (((2 * length - 2) // 16) | 1)  # R - 1, in elements: >= 2T - 2, an odd multiple of 16
    if stride < 2 * length - 2:
        stride += 32
    width = stride + 1  # R
    budget = _CACHE_BYTES if maps.device.type == "cpu" else _DEVICE_COPY_BYTES
    chunk = max(1, budget // (length * width * torch.finfo(dtype).bits // 8))  # maps per copy
    chunk = min(chunk, count)
    key = (chunk, length, width, -1)  # -1: not a tensor shape of reduce_attention's
    buffer = scratch.get(key)
    if buffer is None or buffer.dtype != dtype or buffer.device != maps.device:
        buffer = scratch[key] = maps.new_zeros(chunk * length * width, dtype=dtype)
    sums = maps.new_empty(count, width, dtype=dtype)
    for first in range(0, count, chunk):
        last = min(first + chunk, count)
        skewed = buffer.as_strided((last - first, length, length), (length * width, stride, 1), length - 1)
        skewed.copy_(maps[first:last])
        for sample in range(first // heads, (last - 1) // heads + 1):  # query rows past the sample's end
            if lengths[sample] < length:
                rows = slice(max(sample * heads, first) - first, min((sample + 1) * heads, last) - first)
                skewed[rows, lengths[sample] :].zero_()
        torch.sum(buffer[: (last - first) * length * width].view(last - first, length, width), 1, out=sums[first:last])
    return sums[:, : 2 * length - 1]


def _log_normalizer(
    probs: torch.Tensor,  # (batch, head, T, T)
    scores: torch.Tensor,  # (batch, head, T, T)
    query_mask: torch.Tensor,  # (batch, T) bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``lse = log sum_t exp(scores[s, t])``, ``(batch, head, T)``, without an ``exp`` pass: as
    ``lse`` rounded to the dtype the scores are summed in, and the float64 remainder ``lse - rounded``.

    ``A[s, t] = exp(scores[s, t] - lse)``, so for a reference key ``r`` with a normal ``A[s, r]``,
    ``lse = scores[s, r] - log A[s, r]``: the diagonal (a strided read of T values per head), or, for
    the rare row whose ``A[s, s]`` underflowed, the row's largest ``A`` (>= 1 / L). The sum is taken in
    float64; the rounded ``lse`` is what :func:`_expected_score` subtracts from the scores, so that
    ``scores - lse`` is small where ``A`` is large, even where ``lse`` itself is large (T5's unscaled
    logits reach ~100), and the remainder puts back what the rounding took (see :func:`reduce_attention`).
    """
    dtype = _accumulation_dtype(probs.dtype)  # half-precision values summed in float32
    diagonal = probs.diagonal(0, 2, 3)  # (batch, head, T): A[s, s]
    offset = -diagonal.double().log()
    reference = scores.diagonal(0, 2, 3).to(torch.float64, copy=True)  # written below: never a view of the scores
    trusted = (diagonal > torch.finfo(probs.dtype).tiny * 1024) | ~query_mask[:, None, :]
    if probs.device.type != "cpu" or GPU_BRANCHES_ON_CPU:  # no host sync: compute the fallback everywhere
        offset = torch.where(trusted, offset, -probs.amax(-1).double().log())
        reference = torch.where(trusted, reference, scores.amax(-1).double())
    elif not bool(trusted.all()):
        rows = (~trusted).nonzero(as_tuple=True)
        offset[rows] = -probs[rows].amax(-1).double().log()
        reference[rows] = scores[rows].amax(-1).double()
    lse = reference + offset
    rounded = lse.to(dtype)
    return rounded, lse - rounded.double()


def _expected_score(
    probs: torch.Tensor,  # (batch, head, T, T)
    scores: torch.Tensor,  # (batch, head, T, T)
    lse: torch.Tensor,  # (batch, head, T): each row's log normalizer, rounded (see _log_normalizer)
    weights: ReductionWeights,
) -> torch.Tensor:
    """``sum_s sum_t A[s, t] (scores[s, t] - lse_s)`` over the real queries of each map, ``(batch, head)`` float64.

    One einsum over the batch; on the CPU, :func:`_compiled_sums` takes it with the offset sums instead. Products
    in the maps' dtype (float32 for half-precision maps), small where ``A`` is large; rows' sums in float64.
    """
    dtype = _accumulation_dtype(probs.dtype)
    shifted = torch.einsum("bhqk,bhqk->bhq", probs.to(dtype), scores.to(dtype) - lse[..., None])
    return torch.where(weights.query_mask[:, None, :], shifted, 0).sum(-1, dtype=torch.float64)


def _special_mass(probs: torch.Tensor, weights: ReductionWeights) -> torch.Tensor:
    """The special keys' columns, gathered, times their cells' indicators: ``(batch, head, N + 6)`` float64."""
    batch, heads, length, _ = probs.shape
    slots = weights.special_index.shape[-1]
    shape = (batch, heads, length, slots)
    columns = weights.scratch.get(shape)
    if columns is None or columns.dtype != probs.dtype:  # kept for the batch's other layers
        columns = weights.scratch[shape] = probs.new_empty(shape)
    if probs.device.type == "cpu" and probs.is_contiguous():  # a sample at a time: ~1.4x the gather there
        positions = weights.special_index[:, 0, 0, :]  # (batch, J)
        for row in range(batch):
            torch.index_select(
                probs[row].view(heads * length, length), 1, positions[row], out=columns[row].view(-1, slots)
            )
    else:
        torch.gather(probs, 3, weights.special_index.expand(shape), out=columns)  # (batch, head, T, J)
    matrix = weights.special_matrix
    if matrix is None:
        matrix = _special_matrix(
            weights.special_index[:, 0, 0, :],
            weights.slot_groups,
            weights.sep_queries,
            weights.query_mask,
            weights.num_windows,
            _accumulation_dtype(probs.dtype),
        )
    flat_columns = columns.reshape(batch, heads, length * slots).to(matrix.dtype)
    return _matmul(flat_columns, matrix).double()


def reduce_attention(
    probs: torch.Tensor,  # (batch, head, T, T), rows sum to 1 over real keys
    scores: torch.Tensor | None,  # (batch, head, T, T) the logits softmax saw, or None
    weights: ReductionWeights,
) -> torch.Tensor:
    """Per-sample features and scalars of one layer: ``(batch, head, F)`` float64 (see above).

    With ``scores`` (finite, the padding mask added: ``probs`` is exactly 0 where they are very
    negative), entropy is ``sum_t A (lse - scores)``, each row's ``lse`` read off a reference key
    (see :func:`_log_normalizer`): one product pass, no ``exp`` or ``log`` over the whole map. Without
    them it is ``-sum A log A``.
    """
    batch, heads, length, _ = probs.shape
    if scores is not None and scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.clamp(min=torch.finfo(scores.dtype).min)  # finfo.min + logit can round to -inf there

    # 1. Per-offset sums of each map, then (2T - 1, N + 4) per run of equal lengths -> (batch, head, N + 4);
    # or one product with the cell weights of each sample when batched. On the CPU, the offset sums, the
    # entropy and the special keys' mass come from one compiled pass over each map (ingest.kernels).
    special = entropy = None
    if weights.per_sample is not None:
        all_keys = _matmul(probs.reshape(batch, heads, length * length), weights.per_sample)
    else:
        probs = probs.contiguous()
        if _compiled(probs, scores):
            sums, entropy, special = _compiled_sums(probs, scores, weights)
        else:
            sums = _offset_sums(probs, weights)  # (batch * head, 2T - 1)
        sums = sums.view(batch, heads, -1)
        all_keys = torch.cat([sums[start:stop] @ offsets for start, stop, _, offsets in weights.runs])

    # 2. Special keys: (batch, head, T, J) gathered, @ (batch, T*J, N + 6) -> (batch, head, N + 6), unless
    # the kernel took their mass already: by window/self (to subtract), group, and sep_to_sep.
    if weights.special_index.shape[-1] and special is None:
        special = _special_mass(probs, weights)

    # 3. Entropy of each real query row, summed: -sum_t A log A = sum_t A (lse - scores)
    #    = r sum_t A - sum_t A (scores - lse~), with lse~ the rounded lse and r = lse - lse~ its
    #    remainder (see _log_normalizer); sum_t A = 1 up to rounding, and r is below lse's last bit,
    #    so r sum_t A is r to far below float32 precision and no pass over the map is needed for it.
    #    The CPU's kernel takes the same steps row by row (ingest.kernels._row_entropy).
    if entropy is None and scores is None:
        row_entropy = torch.special.entr(probs).sum(-1, dtype=_accumulation_dtype(probs.dtype))  # (batch, head, T)
        entropy = torch.where(weights.query_mask[:, None, :], row_entropy, 0).sum(-1, dtype=torch.float64)
    elif entropy is None:
        assert scores is not None
        lse, remainder = _log_normalizer(probs, scores, weights.query_mask)  # (batch, head, T) each
        shifted = _expected_score(probs, scores, lse, weights)
        entropy = torch.where(weights.query_mask[:, None, :], remainder, 0).sum(-1) - shifted
    return _combine(all_keys, special, entropy, weights)


def _combine(
    all_keys: torch.Tensor,  # (batch, head, N + 4): step 1's columns over every key
    special: torch.Tensor | None,  # (batch, head, N + 6) float64: the special keys' mass (None without any)
    entropy: torch.Tensor,  # (batch, head) float64: summed over real queries
    weights: ReductionWeights,
) -> torch.Tensor:
    """The features and scalars ``(batch, head, F)`` float64 from a layer's sums (see above)."""
    batch, heads = all_keys.shape[:2]
    n = weights.num_windows
    windows_self = all_keys[..., : n + 1].double()  # (batch, head, N + 1)
    previous, following, distance = all_keys[..., n + 1 :].double().unbind(-1)  # (batch, head) each
    if special is not None:
        windows_self = windows_self - special[..., : n + 1]
        groups, sep_to_sep = special[..., n + 1 : n + 5], special[..., n + 5]
    else:
        groups = all_keys.new_zeros(batch, heads, len(SPECIAL_GROUPS), dtype=torch.float64)
        sep_to_sep = all_keys.new_zeros(batch, heads, dtype=torch.float64)
    scalars = torch.stack([entropy, previous, following, distance, sep_to_sep], dim=-1)  # (batch, head, 5)
    raw = torch.cat([windows_self, groups, scalars], dim=-1)  # (batch, head, F)
    return raw * weights.scale[:, None, :]


# --- cross-attention maps (SPEC section 6) ------------------------------------------------------
#
# A cross map is rectangular: decoder queries s < Lq (real decoder tokens) by encoder keys t < Lk
# (real encoder tokens). Its cells are grouped as a square map's, over the encoder's keys: the key's
# special group when encoder token t is special, else self when t == s (same position), else window
# min(N - 1, floor(|s - t| N / Lk)), with L = Lk, the number of real encoder tokens, as SPEC 6 says.
# Each real query's row sums to 1 over the real keys, so dividing a sample's group sums by Lq (its
# real decoder queries) makes its N + 5 features sum to 1, as a square map's do. Scalars: entropy
# and mean distance |s - t| per real query (divided by Lq); previous (t == s - 1) and next (t == s + 1)
# token divided by the number of real queries whose such key is real; sep_to_sep over decoder [SEP]
# queries and encoder [SEP] keys, divided by the decoder's [SEP] queries. Cross modules are a
# minority of heads: this is one scatter-add per layer, written for clarity.


@dataclass(frozen=True)
class CrossWeights:
    """What :func:`reduce_cross_attention` needs about one batch of (decoder, encoder) pairs."""

    num_windows: int
    group: torch.Tensor  # (batch, Tq*Tk) long: the cell's feature index 0..N+4, N+5 for padding cells
    previous: torch.Tensor  # (batch, Tq, Tk) bool: real cells with t == s - 1
    following: torch.Tensor  # (batch, Tq, Tk) bool: real cells with t == s + 1
    distance: torch.Tensor  # (batch, Tq, Tk) float64: |s - t| on real cells, else 0
    sep_cells: torch.Tensor  # (batch, Tq, Tk) bool: decoder [SEP] query, encoder [SEP] key
    real: torch.Tensor  # (batch, Tq, Tk) bool: real query and real key
    scale: torch.Tensor  # (batch, F) float64 per-sample divisor reciprocals (0 where undefined)
    has_sep: torch.Tensor  # (batch,) bool: the sample has a decoder [SEP] query

    def rows(self, start: int, stop: int) -> CrossWeights:
        """The weights of batch rows ``start:stop`` (a sub-batch's maps): every tensor field is batch-major."""
        fields = (f.name for f in dataclasses.fields(self) if f.name != "num_windows")
        return dataclasses.replace(self, **{name: getattr(self, name)[start:stop] for name in fields})


def build_cross_weights(
    query_groups: torch.Tensor,  # (batch, Tq) long: SPECIAL_GROUPS index of each decoder token, -1 if none
    query_lengths: torch.Tensor,  # (batch,) real decoder tokens (real tokens first)
    key_groups: torch.Tensor,  # (batch, Tk) long: the same for the encoder's tokens
    key_lengths: torch.Tensor,  # (batch,) real encoder tokens
    num_windows: int,
    *,
    device: torch.device | str | None = None,
) -> CrossWeights:
    """The cell groups and divisors of one batch's cross maps (see above)."""
    device = torch.device(device) if device is not None else key_groups.device
    n = num_windows
    query_groups, key_groups = query_groups.to(device), key_groups.to(device)
    query_lengths, key_lengths = query_lengths.to(device), key_lengths.to(device)
    batch, tq = query_groups.shape
    tk = key_groups.shape[1]
    s = torch.arange(tq, device=device)[None, :, None]  # (1, Tq, 1)
    t = torch.arange(tk, device=device)[None, None, :]  # (1, 1, Tk)
    real_query = s < query_lengths[:, None, None]  # (batch, Tq, 1)
    real_key = t < key_lengths[:, None, None]  # (batch, 1, Tk)
    real = real_query & real_key  # (batch, Tq, Tk)
    distance = (s - t).abs()  # (1, Tq, Tk)
    window = torch.clamp(distance * n // key_lengths.clamp(min=1)[:, None, None], max=n - 1)  # (batch, Tq, Tk)
    group = torch.where(distance == 0, n, window)
    special = key_groups[:, None, :].expand(batch, tq, tk)  # (batch, Tq, Tk)
    group = torch.where(special >= 0, n + 1 + special, group)
    group = torch.where(real, group, n + 5)
    sep = SPECIAL_GROUPS.index("sep")
    sep_cells = real & (query_groups == sep)[:, :, None] & (key_groups == sep)[:, None, :]
    previous = real & (t == s - 1)
    following = real & (t == s + 1)

    queries = query_lengths.to(torch.float64)
    pairs_before = previous.any(2).sum(1).to(torch.float64)  # real queries s whose key s - 1 is real
    pairs_after = following.any(2).sum(1).to(torch.float64)
    seps = ((query_groups == sep) & real_query[..., 0]).sum(1).to(torch.float64)

    def inverse(count: torch.Tensor) -> torch.Tensor:
        return torch.where(count > 0, 1.0 / count.clamp(min=1), 0.0)

    per_query = inverse(queries)
    scale = torch.stack(
        [per_query] * (n + 5) + [per_query, inverse(pairs_before), inverse(pairs_after), per_query, inverse(seps)],
        dim=1,
    )  # (batch, F)
    return CrossWeights(
        num_windows=n,
        group=group.reshape(batch, tq * tk),
        previous=previous,
        following=following,
        distance=torch.where(real, distance, 0).to(torch.float64),
        sep_cells=sep_cells,
        real=real,
        scale=scale,
        has_sep=seps > 0,
    )


def reduce_cross_attention(probs: torch.Tensor, weights: CrossWeights) -> torch.Tensor:
    """Per-sample features and scalars of one cross layer: ``(batch, head, F)`` float64.

    ``probs`` is ``(batch, head, Tq, Tk)``: decoder queries over encoder keys.
    """
    batch, heads, tq, tk = probs.shape
    n = weights.num_windows
    p = probs.double()
    flat = p.reshape(batch, heads, tq * tk)
    groups = torch.zeros(batch, heads, n + 6, dtype=torch.float64, device=probs.device)
    groups.scatter_add_(2, weights.group[:, None, :].expand(batch, heads, tq * tk), flat)

    def cells(mask: torch.Tensor) -> torch.Tensor:  # (batch, Tq, Tk) -> (batch, head): attention summed there
        return torch.einsum("bhqk,bqk->bh", p, mask.to(torch.float64))

    entropy = torch.einsum("bhqk,bqk->bh", torch.special.entr(p), weights.real.to(torch.float64))
    scalars = torch.stack(
        [
            entropy,
            cells(weights.previous),
            cells(weights.following),
            torch.einsum("bhqk,bqk->bh", p, weights.distance),
            cells(weights.sep_cells),
        ],
        dim=-1,
    )  # (batch, head, 5)
    raw = torch.cat([groups[..., : n + 5], scalars], dim=-1)  # (batch, head, F)
    return raw * weights.scale[:, None, :]


# --- the run ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StackFeatures:
    """The per-head arrays of one stack (SPEC section 6): ``encoder``, ``decoder`` or ``cross``."""

    stack: Stack
    vectors: np.ndarray  # (layers, heads, N + 5) float64: w0..w{N-1}, self, cls, sep, period, comma
    scalars: dict[str, np.ndarray]  # SCALARS name -> (layers, heads) float64; sep_to_sep NaN if no [SEP]
    example_maps: np.ndarray  # (layers, heads, m_q, m_k) float32, m = min(map_size, real tokens of the example)

    @property
    def num_layers(self) -> int:
        return int(self.vectors.shape[0])

    @property
    def num_heads(self) -> int:
        return int(self.vectors.shape[1])


@dataclass(frozen=True)
class FeatureResult:
    """A feature run's arrays, per stack, and everything needed to store and reproduce it."""

    stacks: dict[Stack, StackFeatures]  # in STACKS order; encoder-only models have just "encoder"
    example_tokens: list[str]  # the example sample's tokens (first sample read)
    num_samples: int
    num_tokens: int  # real tokens over all samples
    special_token_ids: dict[str, list[int]]
    special_tokens: dict[str, list[str]]
    device: str
    dtype: str
    seconds: float
    config: FeatureConfig
    feature_names: list[str] = field(default_factory=list)
    prepended_bos: bool = False  # the model's BOS was put before every sample (causal models, SPEC 6)
    decoder_input: dict[str, Any] | None = None  # how an encoder-decoder's decoder was fed (SPEC 6)
    decoder_example_tokens: list[str] | None = None  # the example sample's decoder input tokens

    @property
    def only(self) -> StackFeatures:
        """The one stack of a single-stack model; raises for encoder-decoders (never mix stacks)."""
        if len(self.stacks) != 1:
            raise ValueError(f"this run has {len(self.stacks)} stacks ({', '.join(self.stacks)}); pick one")
        return next(iter(self.stacks.values()))

    @property
    def vectors(self) -> np.ndarray:
        """``(layers, heads, N + 5)`` of a single-stack model (see :attr:`only`)."""
        return self.only.vectors

    @property
    def scalars(self) -> dict[str, np.ndarray]:
        return self.only.scalars

    @property
    def example_maps(self) -> np.ndarray:
        return self.only.example_maps

    def metadata(self) -> dict[str, Any]:
        """The JSON-able description of the run (everything but the arrays)."""
        return {
            "config": self.config.to_json(),
            "feature_names": self.feature_names,
            "stacks": {name: [s.num_layers, s.num_heads] for name, s in self.stacks.items()},
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "special_token_ids": self.special_token_ids,
            "special_tokens": self.special_tokens,
            "example_tokens": self.example_tokens,
            "device": self.device,
            "dtype": self.dtype,
            "seconds": self.seconds,
            "prepended_bos": self.prepended_bos,
            "decoder_input": self.decoder_input,
            "decoder_example_tokens": self.decoder_example_tokens,
        }


@dataclass(frozen=True)
class Encoded:
    """One sample's token ids, exactly as ``tokenizer(text, text_pair, truncation=True, max_length=...)``."""

    input_ids: list[int]
    token_type_ids: list[int] | None


def encode_samples(tokenizer: Any, samples: Sequence[Sample], max_length: int) -> list[Encoded]:
    """Tokenize each sample as ``tokenizer(text, text_pair, truncation=True, max_length=max_length)``.

    Singles and pairs are tokenized in two batched calls (same result as one call per sample).
    """
    encoded: list[Encoded | None] = [None] * len(samples)
    for paired in (False, True):
        indexes = [i for i, sample in enumerate(samples) if (sample.text_pair is not None) == paired]
        if not indexes:
            continue
        texts = [samples[i].text for i in indexes]
        pairs = [samples[i].text_pair for i in indexes] if paired else None
        output = tokenizer(texts, pairs, truncation=True, max_length=max_length)
        type_ids = output.get("token_type_ids")
        for j, i in enumerate(indexes):
            encoded[i] = Encoded(output["input_ids"][j], type_ids[j] if type_ids is not None else None)
    return [e for e in encoded if e is not None]


def _batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Sample indexes grouped into batches of similar length (longest first), to limit padding."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def _pad(encoded: Sequence[Encoded], pad_id: int, pad_type_id: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Right-padded model inputs and the lengths of one batch."""
    lengths = torch.tensor([len(e.input_ids) for e in encoded], dtype=torch.long)  # (batch,)
    length = int(lengths.max())
    input_ids = torch.full((len(encoded), length), pad_id, dtype=torch.long)  # (batch, T)
    attention_mask = torch.zeros((len(encoded), length), dtype=torch.long)
    token_type_ids = torch.full((len(encoded), length), pad_type_id, dtype=torch.long)
    for row, e in enumerate(encoded):
        input_ids[row, : len(e.input_ids)] = torch.tensor(e.input_ids)
        attention_mask[row, : len(e.input_ids)] = 1
        if e.token_type_ids is not None:
            token_type_ids[row, : len(e.input_ids)] = torch.tensor(e.token_type_ids)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if encoded[0].token_type_ids is not None:
        inputs["token_type_ids"] = token_type_ids
    return inputs, lengths


# Architectures (config.model_type) whose attention the fused kernel expresses exactly: scaling, boolean masks
# (padding, causal, sliding windows), grouped key/value heads, soft-capping, rotary applied to q and k before the
# call. Each is checked against its eager output_attentions in tests/ingest/test_architectures.py; any other
# (relative position biases of T5 and DeBERTa, own-attention modules, anything unknown) runs the maps path.
FUSED_FAMILIES = frozenset(
    {"bert", "roberta", "xlm-roberta", "electra", "albert", "llama", "qwen2", "mistral", "gemma2"}
)
# "auto": the fused path wherever it can run and pays (choose_reduction), else the maps; "fused": wherever it can
# run; "maps": always the maps.
REDUCTION = "auto"
# On CUDA, below this many tokens the maps path runs: the Triton kernel was measured from 512 tokens on, the maps path
# at 128 (docs/performance.md). The CPU kernel runs at every length (it builds in seconds; at 32 and 128 tokens it ran
# well ahead of the maps path, at 64 within the runs' spread of it).
TRITON_MIN_LENGTH = 256


def choose_reduction(
    model: nn.Module, device: torch.device, stacks: Collection[str], max_length: int | None = None
) -> tuple[str, str]:
    """``("fused", why)`` when the run's statistics can be taken in the attention's own pass, else ``("maps", why)``;
    ``max_length`` (the run's): under ``REDUCTION = "auto"`` the Triton kernel runs from :data:`TRITON_MIN_LENGTH`
    on."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    dtype = next(model.parameters()).dtype
    if REDUCTION == "maps":
        return "maps", "the maps path was asked for"
    if device.type == "cuda" or (GPU_BRANCHES_ON_CPU and fused_kernel.TRITON_ON_CPU):
        if REDUCTION == "auto" and max_length is not None and max_length < TRITON_MIN_LENGTH:
            return "maps", f"max_length {max_length} < {TRITON_MIN_LENGTH}: the Triton kernel runs from there on"
        name, unavailable, where = "the Triton fused kernel", fused_kernel.triton_unavailable, f"{device} (Triton)"
    elif device.type != "cpu" or GPU_BRANCHES_ON_CPU:
        return "maps", f"the fused kernels run on the CPU or CUDA, the model is on {device}"
    else:
        name, unavailable, where = "the fused kernel", fused_kernel.unavailable, "the CPU"
    if dtype != torch.float32:
        return "maps", f"{name} computes in float32, the model is {dtype}"
    if kind not in FUSED_FAMILIES or len(stacks) != 1:
        return "maps", f"{name} does not cover {kind!r} attention"
    problem = unavailable()
    if problem is not None:
        return "maps", f"{name} is not available here ({problem})"
    return "fused", f"{kind!r} attention in float32 on {where}"


def _map_budget(device: torch.device) -> int | None:
    """The probe's ``max_map_bytes``: on the CPU, attention runs a few samples at a time so that the
    maps stay in cache (see :func:`~ingest.attention.headcat_attention_forward`); on a GPU, whole batches."""
    return SUB_BATCH_MAP_BYTES if device.type == "cpu" else None


def _model_device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _check_max_length(model: nn.Module, max_length: int) -> None:
    from ingest.types import positions

    limit = positions(getattr(model, "config", None))
    if limit is not None and limit < max_length:
        raise ValueError(f"max_length {max_length} is more than the model's {limit} positions")


class _LayerReducer:
    """The probe callback: reduces each layer's maps into per-layer float64 sums on the device.

    ``routes`` names, per stack, the token side of its queries and of its keys (``"tokens"`` for a
    single-stack model; ``"encoder"``/``"decoder"`` for an encoder-decoder, ``cross`` being
    ``("decoder", "encoder")``).
    """

    def __init__(self, num_windows: int, map_size: int, routes: dict[Stack, tuple[str, str]]) -> None:
        self.num_windows = num_windows
        self.map_size = map_size
        self.routes = routes
        self.sums: dict[tuple[Stack, int], torch.Tensor] = {}  # (stack, layer) -> (head, F) float64
        self.maps: dict[tuple[Stack, int], torch.Tensor] = {}  # (stack, layer) -> (head, m_q, m_k) float32
        self.calls = 0
        self.sides: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # side -> (key_groups (batch, T), lengths)
        self.example_row: int | None = None  # row of the run's first sample in this batch
        self.weights: dict[tuple[str, str], ReductionWeights | CrossWeights] = {}  # route -> the batch's
        self.parts: dict[tuple[Any, ...], ReductionWeights | CrossWeights] = {}  # (route, start, stop) -> rows'
        self.cache = LengthWeightsCache()  # W_L, shared by batches with the same lengths

    def start_batch(self, sides: dict[str, tuple[torch.Tensor, torch.Tensor]], example_row: int | None) -> None:
        self.sides, self.example_row = sides, example_row
        self.weights = {}
        self.parts = {}

    def _weights(
        self, route: tuple[str, str], rows: int, count: int, dtype: torch.dtype, device: torch.device
    ) -> ReductionWeights | CrossWeights:
        """The weights of the call's rows (``count`` from batch row ``rows``): the batch's, built on the route's first
        call, sliced for a sub-batch."""
        weights = self.weights.get(route)
        if weights is None:  # built on the route's first layer, in the probs' dtype and device
            (query_groups, query_lengths), (key_groups, key_lengths) = self.sides[route[0]], self.sides[route[1]]
            if route[0] == route[1]:
                weights = build_weights(
                    key_groups, key_lengths, self.num_windows, dtype, device=device, cache=self.cache
                )
            else:
                weights = build_cross_weights(
                    query_groups, query_lengths, key_groups, key_lengths, self.num_windows, device=device
                )
            self.weights[route] = weights
        batch = int(self.sides[route[0]][1].shape[0])
        start, stop = rows, rows + count
        if (start, stop) == (0, batch):
            return weights
        part = self.parts.get((route, start, stop))
        if part is None:  # sliced once per batch, used by every layer
            part = self.parts[route, start, stop] = weights.rows(start, stop)
        return part

    def __call__(self, call: AttentionCall) -> None:
        probs, scores = call.probs, call.scores  # (rows, head, Tq, Tk) each: the batch's, or a sub-batch's
        if scores.dtype != probs.dtype:  # softmax(..., dtype=float32) over half-precision scores (Llama, ...)
            scores = scores.to(probs.dtype)  # exact: the softmax upcast them the same way
        route = self.routes.get(call.stack)
        if route is None:
            raise RuntimeError(f"the probe saw a {call.stack} attention module; this run expected {list(self.routes)}")
        weights = self._weights(route, call.rows, probs.shape[0], probs.dtype, probs.device)
        if isinstance(weights, CrossWeights):
            per_sample = reduce_cross_attention(probs, weights)  # (rows, head, F) float64
        else:
            per_sample = reduce_attention(probs, scores, weights)
        self._add(call.stack, call.layer, per_sample)
        row = None if self.example_row is None else self.example_row - call.rows
        if row is not None and 0 <= row < probs.shape[0]:
            self._example(call.stack, call.layer, route, probs[row])

    def _add(self, stack: Stack, layer: int, per_sample: torch.Tensor) -> None:
        total = per_sample.sum(0)  # (head, F)
        key = (stack, layer)
        if key in self.sums:
            self.sums[key] += total
        else:
            self.sums[key] = total
        self.calls += 1

    def _example(self, stack: Stack, layer: int, route: tuple[str, str], probs: torch.Tensor) -> None:
        """The example sample's maps ``(head, Tq, Tk)``, downsampled and kept."""
        assert self.example_row is not None
        rows = int(self.sides[route[0]][1][self.example_row])
        columns = int(self.sides[route[1]][1][self.example_row])
        example = probs[:, :rows, :columns].float()  # (head, Lq, Lk)
        side = (min(self.map_size, rows), min(self.map_size, columns))
        self.maps[stack, layer] = F.adaptive_avg_pool2d(example[None], side)[0]  # (head, m_q, m_k)

    def fused(self, call: FusedCall) -> torch.Tensor:
        """A layer's attention output, its statistics taken in the same pass (:func:`ingest.fused.attend`)."""
        route = self.routes.get(call.stack)
        if route is None or route[0] != route[1]:
            raise RuntimeError(f"the fused probe saw a {call.stack} attention module; this run has {list(self.routes)}")
        batch, heads = call.query.shape[:2]
        weights = self._weights(route, 0, batch, call.query.dtype, call.query.device)
        assert isinstance(weights, ReductionWeights)
        inputs = weights.kernel_inputs.get(heads)
        if inputs is None:  # the batch's first layer
            inputs = weights.kernel_inputs[heads] = _kernel_inputs(weights, heads)
        plan, _ = inputs
        example = None
        if self.example_row is not None:  # pooled in the same pass (no T x T map), as _example pools the maps path's
            rows = int(self.sides[route[0]][1][self.example_row])
            columns = int(self.sides[route[1]][1][self.example_row])
            side = (min(self.map_size, rows), min(self.map_size, columns))
            example = fused_kernel.Example(self.example_row, rows, columns, side)
        output, sums = fused_kernel.attend(
            call.query, call.key, call.value, call.mask,
            scale=call.scale, causal=call.causal, softcap=call.softcap, plan=plan, example=example,
        )  # fmt: skip
        assert sums is not None
        all_keys = sums.windows.view(batch, heads, -1)
        special = None
        if sums.special_windows is not None and sums.special_groups is not None and sums.sep_to_sep is not None:
            parts = (sums.special_windows, sums.special_groups, sums.sep_to_sep[:, None])
            special = torch.cat(parts, dim=-1).view(batch, heads, -1)  # (batch, head, N + 6), as _kernel_special's
        self._add(call.stack, call.layer, _combine(all_keys, special, sums.entropy.view(batch, heads), weights))
        if example is not None:
            assert example.maps is not None
            self.maps[call.stack, call.layer] = example.maps
        return output


def _text_config(module: nn.Module) -> Any:
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        return config.get_text_config()
    return config


def _start_token(module: nn.Module, tokenizer: Any) -> int | None:
    """The model's BOS id (its config's, else the tokenizer's), or None when it has none."""
    for source in (_text_config(module), tokenizer):
        value = getattr(source, "bos_token_id", None)
        if isinstance(value, int) and value >= 0:
            return value
    return None


def _adds_start_token(tokenizer: Any, bos: int) -> bool:
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and ids[0] == bos


def _prepend(encoded: Sequence[Encoded], token: int, max_length: int) -> list[Encoded]:
    """``token`` put before every sample's ids (the last id dropped where that would pass max_length)."""
    out = []
    for e in encoded:
        types = e.token_type_ids
        if types is not None:
            types = [types[0] if types else 0, *types][:max_length]
        out.append(Encoded([token, *e.input_ids][:max_length], types))
    return out


def _as_cls(special: SpecialTokens, token: int, tokenizer: Any) -> SpecialTokens:
    """``special`` with ``token`` in the ``cls`` group (and no other)."""
    ids = {group: [i for i in values if i != token] for group, values in special.ids.items()}
    ids["cls"] = sorted({*ids["cls"], token})
    tokens = {group: list(tokenizer.convert_ids_to_tokens(values)) for group, values in ids.items()}
    return SpecialTokens(ids=ids, tokens=tokens)


def decoder_start_token(module: nn.Module) -> int:
    """The id an encoder-decoder's decoder input starts with (``decoder_start_token_id``)."""
    config = getattr(module, "config", None)
    generation = getattr(module, "generation_config", None)
    sources = (config, getattr(config, "decoder", None), _text_config(module), generation)
    for source in sources:
        value = getattr(source, "decoder_start_token_id", None)
        if isinstance(value, int) and value >= 0:
            return value
    raise ValueError(f"{type(module).__name__}'s config names no decoder_start_token_id: cannot feed its decoder")


def encode_targets(tokenizer: Any, samples: Sequence[Sample], max_length: int, start_token: int) -> list[Encoded]:
    """The decoder's teacher-forced input of each sample (SPEC section 6).

    The target is ``text_pair`` when the sample has one, else ``text``, tokenized in the
    tokenizer's target form (``text_target=``), then shifted right as in training: the decoder
    reads ``[start, y_0, ..., y_{n-2}]`` where the labels are ``y_0 .. y_{n-1}``.
    """
    targets = [sample.text_pair if sample.text_pair is not None else sample.text for sample in samples]
    labels = tokenizer(text_target=targets, truncation=True, max_length=max_length)["input_ids"]
    return [Encoded([start_token, *ids[:-1]], None) for ids in labels]


def extract_features(
    model: LoadedModel | nn.Module,
    tokenizer: Any | None,
    samples: Iterable[Sample],
    config: FeatureConfig | None = None,
    *,
    progress: ProgressCallback | None = None,
) -> FeatureResult:
    """Distance features and scalars of every head of every stack, averaged over the first ``config.samples`` samples.

    ``model`` is a :class:`~ingest.loading.LoadedModel` (its tokenizer is used when ``tokenizer``
    is None) or a ``transformers`` model already on its device. ``progress(done, total)`` is
    called after each batch with the number of samples done.

    Encoder-decoders: the encoder reads each sample as an encoder-only model would and the
    decoder is teacher-forced on :func:`encode_targets`. Causal decoder-only models whose
    tokenizer adds no start token get the model's BOS prepended (``config.prepend_bos``), so
    position 0 is in the ``cls`` group; :attr:`FeatureResult.prepended_bos` records it.
    """
    config = config or FeatureConfig()
    if isinstance(model, LoadedModel):
        tokenizer = tokenizer if tokenizer is not None else model.tokenizer
        module: nn.Module = model.model
    else:
        module = model
    if tokenizer is None:
        raise ValueError("extract_features needs a tokenizer (or a LoadedModel, which has one)")
    _check_max_length(module, config.max_length)
    device = _model_device(module)
    present = {site.stack for site in attention_sites(module)}  # refuses an architecture it cannot see
    encoder_decoder = "cross" in present

    started = time.perf_counter()
    chosen = list(islice(samples, config.samples))
    if not chosen:
        raise ValueError("the corpus yielded no samples: nothing to compute features from")
    encoded = encode_samples(tokenizer, chosen, config.max_length)
    special = resolve_special_tokens(tokenizer)
    prepended_bos = False
    decoder_input: dict[str, Any] | None = None
    targets: list[Encoded] | None = None
    if encoder_decoder:
        start = decoder_start_token(module)
        targets = encode_targets(tokenizer, chosen, config.max_length, start)
        decoder_input = {
            "text": "text_pair when the sample has one, else text",
            "form": "tokenizer(text_target=...), shifted right",
            "decoder_start_token_id": start,
        }
        routes: dict[Stack, tuple[str, str]] = {
            "encoder": ("encoder", "encoder"),
            "decoder": ("decoder", "decoder"),
            "cross": ("decoder", "encoder"),
        }
    else:
        routes = dict.fromkeys(present, ("tokens", "tokens"))
        bos = _start_token(module, tokenizer) if present == {"decoder"} else None
        if config.prepend_bos and bos is not None and not _adds_start_token(tokenizer, bos):
            encoded = _prepend(encoded, bos, config.max_length)
            special = _as_cls(special, bos, tokenizer)
            prepended_bos = True
    lengths = [len(e.input_ids) for e in encoded]
    table = special.group_table(len(tokenizer))  # (vocab,), on the CPU: sizes are read on the host
    sep = SPECIAL_GROUPS.index("sep")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    pad_type_id = getattr(tokenizer, "pad_token_type_id", 0) or 0

    reducer = _LayerReducer(config.num_windows, config.map_size, routes)
    reduction, why = choose_reduction(module, device, present, config.max_length)
    logger.info("reduction: %s (%s)", reduction, why)
    fused = reducer.fused if reduction == "fused" else None
    sep_samples: dict[str, int] = {}  # side -> samples with a [SEP] token
    done = 0
    batches = _batches(lengths, config.batch_size)
    was_training = module.training
    module.eval()
    try:
        with torch.inference_mode(), AttentionProbe(module, reducer, max_map_bytes=_map_budget(device), fused=fused):
            for number, indexes in enumerate(batches):
                inputs, batch_lengths = _pad([encoded[i] for i in indexes], pad_id, pad_type_id)
                key_groups = torch.where(inputs["attention_mask"].bool(), table[inputs["input_ids"]], -1)  # (batch, T)
                sides = {"encoder" if encoder_decoder else "tokens": (key_groups, batch_lengths)}
                if targets is not None:
                    decoder, decoder_lengths = _pad([targets[i] for i in indexes], pad_id, pad_type_id)
                    inputs["decoder_input_ids"] = decoder["input_ids"]
                    inputs["decoder_attention_mask"] = decoder["attention_mask"]
                    decoder_groups = torch.where(decoder["attention_mask"].bool(), table[decoder["input_ids"]], -1)
                    sides["decoder"] = (decoder_groups, decoder_lengths)
                for side, (groups, _) in sides.items():
                    sep_samples[side] = sep_samples.get(side, 0) + int((groups == sep).any(1).sum())
                example_row = indexes.index(0) if 0 in indexes else None
                reducer.start_batch(sides, example_row)
                inputs = {name: tensor.to(device, non_blocking=True) for name, tensor in inputs.items()}
                calls_before = reducer.calls
                module(**inputs)
                if number == 0 and reducer.calls == calls_before:
                    raise RuntimeError(
                        f"{type(module).__name__} ran without calling headcat's attention probe: its "
                        "attention does not go through transformers' AttentionInterface"
                    )
                done += len(indexes)
                if progress is not None:
                    progress(done, len(encoded))
    finally:
        module.train(was_training)

    n_features = config.num_features
    stacks: dict[Stack, StackFeatures] = {}
    for stack in STACKS:
        layers = sorted(layer for name, layer in reducer.sums if name == stack)
        if not layers:
            continue
        if layers != list(range(len(layers))):
            raise RuntimeError(f"the probe saw {stack} layers {layers}; expected 0..{len(layers) - 1}")
        totals = torch.stack([reducer.sums[stack, layer] for layer in layers]).cpu().numpy()  # (layers, head, F)
        scalars: dict[str, np.ndarray] = {}
        for k, name in enumerate(SCALARS):
            count = sep_samples.get(routes[stack][0], 0) if name == "sep_to_sep" else len(encoded)
            scalars[name] = totals[..., n_features + k] / count if count else np.full(totals.shape[:2], np.nan)
        maps = torch.stack([reducer.maps[stack, layer] for layer in layers]).cpu().numpy().astype(np.float32)
        stacks[stack] = StackFeatures(stack, totals[..., :n_features] / len(encoded), scalars, maps)
    seconds = time.perf_counter() - started
    example_ids = encoded[0].input_ids
    parameter_dtype = next(module.parameters()).dtype
    result = FeatureResult(
        stacks=stacks,
        example_tokens=list(tokenizer.convert_ids_to_tokens(example_ids)),
        num_samples=len(encoded),
        num_tokens=int(sum(lengths)),
        special_token_ids=special.ids,
        special_tokens=special.tokens,
        device=str(device),
        dtype=str(parameter_dtype).removeprefix("torch."),
        seconds=seconds,
        config=dataclasses.replace(
            config,
            input_form={"prepended_bos": prepended_bos, "decoder_input": decoder_input},
            reduction=reduction,
        ),
        feature_names=feature_names(config.num_windows),
        prepended_bos=prepended_bos,
        decoder_input=decoder_input,
        decoder_example_tokens=(
            list(tokenizer.convert_ids_to_tokens(targets[0].input_ids)) if targets is not None else None
        ),
    )
    logger.info(
        "features of %s from %d samples (%d tokens) in %.1f s on %s",
        ", ".join(f"{name} {s.num_layers} layers x {s.num_heads} heads" for name, s in stacks.items()),
        result.num_samples,
        result.num_tokens,
        seconds,
        device,
    )
    return result
