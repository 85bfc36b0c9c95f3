"""Compiled CPU kernel of the feature reduction (numba): one pass over each attention map.

:func:`reduce_maps` reads every real query row of a map once and, while the row is in L1, adds it
into the map's per-offset (diagonal) sums, takes its entropy from the scores when they are given
(``sum_t A (lse - scores)``, ``lse`` read off the diagonal: see :func:`_row_entropy`), and reads its
special-key cells: their per-offset sums (the windows and self that
:func:`ingest.features.reduce_attention` takes out of the map's), each special column's sum (its
group) and the ``[SEP]``-to-``[SEP]`` mass. Torch has no fused op for any of these: its ways were a
skewed copy and a column sum for the offsets, the diagonals' ``lse`` and a product written to a
buffer and summed for the entropy, and a gather and a product for the special keys, six to eight
passes over the maps. A row's addition into the offset sums is a shifted vector add
(:func:`_add_into`, a function of its own so that LLVM sees two non-overlapping 1-d views and
vectorises it). Sums are taken as torch's were: offsets in the maps' dtype, a row's product in its
dtype and rows' entropies in float64; special columns in float64.

The kernel has no bounds checks: :func:`reduce_maps` checks every index it would follow first. It
releases the GIL, and :func:`reduce_maps` splits the maps over up to ``torch.get_num_threads()``
threads. Compiled on first use (about a second) and cached beside this file (``__pycache__``) where
that is writable.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import numba
import numpy as np
import torch

# Reassociation (vectorised sums) and fused multiply-add; no assumption about NaN, infinities or signed zeros.
_FASTMATH = {"reassoc", "contract"}
SUPPORTED_DTYPES = (torch.float32, torch.float64)


@numba.njit(fastmath=_FASTMATH, nogil=True, cache=True)
def _add_into(target: np.ndarray, row: np.ndarray) -> None:  # pragma: no cover - compiled
    for t in range(row.shape[0]):
        target[t] += row[t]


@numba.njit(fastmath=_FASTMATH, nogil=True, cache=True)
def _dot_shifted(row: np.ndarray, logits: np.ndarray, shift: float) -> float:  # pragma: no cover - compiled
    product = row.dtype.type(0)
    for t in range(row.shape[0]):
        product += row[t] * (logits[t] - shift)
    return product


@numba.njit(nogil=True, cache=True)
def _row_entropy(row: np.ndarray, logits: np.ndarray, s: int, floor: float) -> float:  # pragma: no cover - compiled
    """``-sum_t A log A`` of one row from its scores: ``sum_t A (lse - scores)``, ``lse`` read off a reference key
    (``lse = scores[r] - log A[r]``: the diagonal, or the row's largest ``A`` where the diagonal underflowed),
    rounded to the row's dtype for the product (small where ``A`` is large), its remainder added in float64
    (``sum_t A = 1`` to far below float32 precision). Every key: padding keys hold 0 after the mask."""
    reference = s
    if not row[s] > floor:
        for t in range(row.shape[0]):
            if row[t] > row[reference]:
                reference = t
    lse = np.float64(logits[reference]) - np.log(np.float64(row[reference]))
    rounded = row.dtype.type(lse)
    return (lse - np.float64(rounded)) - _dot_shifted(row, logits, rounded)


@numba.njit(fastmath=_FASTMATH, nogil=True, cache=True)
def _reduce_kernel(
    probs: np.ndarray,  # (maps, T, T)
    lengths: np.ndarray,  # (maps,)
    scores: np.ndarray,  # (maps, T, T), or any array when not with_scores
    with_scores: bool,
    floor: float,  # a diagonal A[s, s] above this gives the row's log normalizer (else the row's largest A)
    heads: int,  # maps per sample: map m is sample (first + m) // heads's
    first: int,  # the batch index of map 0
    positions: np.ndarray,  # (samples, J) special key positions, the used slots first
    counts: np.ndarray,  # (samples,) used slots
    slot_sep: np.ndarray,  # (samples, J) the slot's key is [SEP]
    query_sep: np.ndarray,  # (samples, T) the query is [SEP]
    sums: np.ndarray,  # out (maps, 2T - 1)
    entropy: np.ndarray,  # out (maps,) float64
    special_sums: np.ndarray,  # out (maps, 2T - 1)
    columns: np.ndarray,  # out (maps, J) float64
    seps: np.ndarray,  # out (maps,) float64
) -> None:  # pragma: no cover - compiled
    count, length, _ = probs.shape
    for m in range(count):
        real, sample = lengths[m], (first + m) // heads
        used = counts[sample]
        target, special, column = sums[m], special_sums[m], columns[m]
        target[:] = 0
        special[:] = 0
        column[:] = 0
        total = 0.0
        sep = 0.0
        for s in range(real):
            row = probs[m, s]
            _add_into(target[length - 1 - s : length - 1 - s + real], row[:real])
            if with_scores:
                total += _row_entropy(row, scores[m, s], s, floor)
            for j in range(used):  # the special keys, read while the row is in L1
                key = positions[sample, j]
                value = row[key]
                column[j] += value
                special[length - 1 + key - s] += value
            if query_sep[sample, s]:
                for j in range(used):
                    if slot_sep[sample, j]:
                        sep += row[positions[sample, j]]
        entropy[m] = total
        seps[m] = sep


class Specials(NamedTuple):
    """The special keys of a batch's samples, as :func:`ingest.features.build_weights` finds them."""

    positions: torch.Tensor  # (samples, J) int64: key positions, the sample's used slots first
    counts: torch.Tensor  # (samples,) int64: used slots
    slot_sep: torch.Tensor  # (samples, J) bool: the slot's key is [SEP]
    query_sep: torch.Tensor  # (samples, T) bool: the query is a real [SEP]
    # (samples, J) int64: the slot's group (ingest.types.SPECIAL_GROUPS' index), -1 for none; None: none has one
    groups: torch.Tensor | None = None


class MapSums(NamedTuple):
    offsets: torch.Tensor  # (maps, 2T - 1), the maps' dtype: D[T - 1 + o] = sum_s A[s, s + o], real rows and keys
    entropy: torch.Tensor | None  # (maps,) float64: -sum_s sum_t A log A over real rows, from the scores
    special_offsets: torch.Tensor | None  # (maps, 2T - 1): the part of D in the special keys' columns
    special_columns: torch.Tensor | None  # (maps, J) float64: each used slot's column, summed over real rows
    sep_to_sep: torch.Tensor | None  # (maps,) float64: [SEP] queries' mass on [SEP] keys


class WindowSums(NamedTuple):
    """What the features take from a map's :class:`MapSums`, summed row by row where no map is held (the fused CPU
    kernel's statistics): the per-offset sums through :func:`offset_columns`, the special keys' columns by group."""

    windows: torch.Tensor  # (maps, N + 4) float64: D's windows, self, previous, next and distance (offset_columns)
    entropy: torch.Tensor  # (maps,) float64
    special_windows: torch.Tensor | None  # (maps, N + 1) float64: the special keys' part of the windows and self
    special_groups: torch.Tensor | None  # (maps, G) float64: the special keys' mass by the slots' group
    sep_to_sep: torch.Tensor | None  # (maps,) float64


def offset_columns(offset: torch.Tensor, length: int, num_windows: int, dtype: torch.dtype) -> torch.Tensor:
    """``(..., N + 4)``: the columns of a real cell at offset ``o = t - s`` of a sample of ``length`` real tokens,
    zero where ``|o| >= length``: window ``min(|o| N / length, N - 1)`` (``|o| >= 1``), self (``o = 0``), previous
    (``o = -1``), next (``o = 1``) and the distance ``|o|``."""
    n = num_windows
    distance = offset.abs()
    group = torch.where(distance == 0, n, torch.clamp(distance * n // max(length, 1), max=n - 1))
    real = distance < length
    columns = torch.zeros(*offset.shape, n + 4, dtype=dtype, device=offset.device)
    columns[..., : n + 1] = (group[..., None] == torch.arange(n + 1, device=offset.device)) & real[..., None]
    columns[..., n + 1] = (offset == -1) & real
    columns[..., n + 2] = (offset == 1) & real
    columns[..., n + 3] = distance * real
    return columns


def window_sums(sums: MapSums, plan: Plan) -> WindowSums:
    """``sums`` as :class:`WindowSums` (a kernel that sums by offset, Triton's): the offsets through
    :func:`offset_columns` of each map's length, the special columns by the plan's slot groups."""
    if plan.num_windows is None or sums.entropy is None:
        raise ValueError("window sums need the plan's num_windows and the maps' entropy")
    length = plan.length
    offsets = torch.arange(-(length - 1), length)
    lengths = torch.from_numpy(plan.lengths)
    windows = torch.empty(plan.maps, plan.num_windows + 4, dtype=torch.float64)
    special = torch.empty(plan.maps, plan.num_windows + 1, dtype=torch.float64)
    for value in lengths.unique().tolist():
        chosen = lengths == value
        columns = offset_columns(offsets, value, plan.num_windows, torch.float64)
        windows[chosen] = sums.offsets[chosen].double() @ columns
        if sums.special_offsets is not None:
            special[chosen] = sums.special_offsets[chosen].double() @ columns[:, : plan.num_windows + 1]
    if sums.special_offsets is None or sums.special_columns is None or sums.sep_to_sep is None:
        return WindowSums(windows, sums.entropy, None, None, None)
    groups = torch.from_numpy(plan.groups).repeat_interleave(plan.heads, 0)  # (maps, J)
    one_hot = torch.nn.functional.one_hot(groups + 1, plan.group_count + 1)[..., 1:].double()  # -1: none
    by_group = (sums.special_columns[:, None, :] @ one_hot)[:, 0]
    return WindowSums(windows, sums.entropy, special, by_group, sums.sep_to_sep)


@dataclass(frozen=True)
class Plan:
    """What :func:`reduce_maps` needs about a batch's maps besides the maps, checked once (:func:`plan`)."""

    length: int  # T
    heads: int  # maps per sample: map m belongs to sample m // heads
    lengths: np.ndarray  # (maps,) int64
    positions: np.ndarray  # (samples, J) int64
    counts: np.ndarray  # (samples,) int64
    slot_sep: np.ndarray  # (samples, J) bool
    query_sep: np.ndarray  # (samples, T) bool
    with_specials: bool
    groups: np.ndarray  # (samples, J) int64: each slot's group, -1 for none
    group_count: int  # G
    num_windows: int | None  # N, where the maps are summed by window (WindowSums)

    @property
    def maps(self) -> int:
        return int(self.lengths.shape[0])


def plan(
    lengths: torch.Tensor,
    length: int,
    heads: int = 1,
    specials: Specials | None = None,
    *,
    num_windows: int | None = None,
    group_count: int | None = None,
) -> Plan:
    """Checks every index the kernel would follow (it has no bounds checks) and keeps them as arrays.

    ``lengths``: ``(samples,)`` real tokens of each sample (rows and keys past it are padding); its
    ``heads`` maps follow one another. ``num_windows``: the features' N, where the maps are summed by window
    (:class:`WindowSums`); ``group_count``: the special slots' groups (default: the largest given, plus one)."""
    real = lengths.to(torch.int64).contiguous()
    samples = int(real.shape[0]) if real.dim() == 1 else -1
    if samples < 0 or (samples and not 0 <= int(real.min()) <= int(real.max()) <= length):
        raise ValueError(f"the kernel needs one length in 0..{length} per sample, not {lengths.tolist()}")
    if heads < 1:
        raise ValueError(f"heads must be at least 1, not {heads}")
    if specials is None:
        specials = Specials(
            torch.zeros(samples, 0, dtype=torch.int64),
            torch.zeros(samples, dtype=torch.int64),
            torch.zeros(samples, 0, dtype=torch.bool),
            torch.zeros(samples, length, dtype=torch.bool),
        )
    if num_windows is not None and num_windows < 1:
        raise ValueError(f"num_windows must be at least 1, not {num_windows}")
    positions, counts, slot_sep, query_sep, groups = specials
    slots = positions.shape[1] if positions.dim() == 2 else -1
    if groups is None:
        groups = torch.full((samples, max(slots, 0)), -1, dtype=torch.int64)
    shapes = [tuple(x.shape) for x in (positions, counts, slot_sep, query_sep)]
    if shapes != [(samples, slots), (samples,), (samples, slots), (samples, length)]:
        raise ValueError(
            f"special keys need positions (samples, J), counts (samples,), slot_sep (samples, J) and "
            f"query_sep (samples, T) for {samples} samples of {length} tokens, not {shapes}"
        )
    if samples and not 0 <= int(counts.min()) <= int(counts.max()) <= slots:
        raise ValueError(f"special key counts must be in 0..{slots}")
    used = torch.arange(slots)[None, :] < counts[:, None]  # (samples, J)
    if bool(((positions < 0) | (positions >= real[:, None]))[used].any()):
        raise ValueError("special key positions must be real keys of their sample")
    if tuple(groups.shape) != (samples, slots):
        raise ValueError(f"special slot groups need shape {(samples, slots)}, not {tuple(groups.shape)}")
    groups = torch.where(used, groups.to(torch.int64), -1)
    count = int(groups.max()) + 1 if groups.numel() else 0
    group_count = count if group_count is None else group_count
    if bool((groups < -1).any()) or count > group_count:
        raise ValueError(f"special slot groups must be in -1..{group_count - 1}")
    return Plan(
        length=length,
        heads=heads,
        lengths=real.repeat_interleave(heads).numpy(),
        positions=positions.to(torch.int64).contiguous().numpy(),
        counts=counts.to(torch.int64).contiguous().numpy(),
        slot_sep=slot_sep.to(torch.bool).contiguous().numpy(),
        query_sep=query_sep.to(torch.bool).contiguous().numpy(),
        with_specials=slots > 0,
        groups=groups.contiguous().numpy(),
        group_count=group_count,
        num_windows=num_windows,
    )


def reduce_maps(
    probs: torch.Tensor,  # (maps, T, T) CPU, float32 or float64
    plan: Plan,
    scores: torch.Tensor | None = None,  # (maps, T, T), the probabilities' dtype
) -> MapSums:
    """One pass over each map: its offset sums, with ``scores`` the entropy's product, with the plan's special
    keys their sums (see :class:`MapSums`)."""
    count, length = plan.maps, plan.length
    if probs.device.type != "cpu" or probs.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"reduce_maps takes CPU float32 or float64 maps, not {probs.dtype} on {probs.device}")
    if probs.shape != (count, length, length):
        raise ValueError(f"the plan is for maps of shape {(count, length, length)}, not {tuple(probs.shape)}")
    if scores is not None and (scores.shape != probs.shape or scores.dtype != probs.dtype):
        raise ValueError("reduce_maps needs scores of the maps' shape and dtype")
    probs_np = probs.contiguous().numpy()
    scores_np = scores.contiguous().numpy() if scores is not None else probs_np
    floor = float(torch.finfo(probs.dtype).tiny) * 1024
    result = MapSums(
        torch.empty(count, 2 * length - 1, dtype=probs.dtype),
        torch.empty(count, dtype=torch.float64),
        torch.empty(count, 2 * length - 1, dtype=probs.dtype),
        torch.empty(count, plan.positions.shape[1], dtype=torch.float64),
        torch.empty(count, dtype=torch.float64),
    )
    out = [tensor.numpy() for tensor in result if tensor is not None]

    def run(start: int, stop: int) -> None:  # maps start:stop
        _reduce_kernel(
            probs_np[start:stop], plan.lengths[start:stop], scores_np[start:stop],
            scores is not None, floor, plan.heads, start, plan.positions, plan.counts, plan.slot_sep, plan.query_sep,
            *(array[start:stop] for array in out),
        )  # fmt: skip

    workers = min(torch.get_num_threads(), count)
    if workers <= 1:
        run(0, count)
    else:
        step = -(-count // workers)
        for future in [pool(workers).submit(run, start, min(start + step, count)) for start in range(0, count, step)]:
            future.result()
    entropy = result.entropy if scores is not None else None
    if not plan.with_specials:
        return MapSums(result.offsets, entropy, None, None, None)
    return result._replace(entropy=entropy)


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _forget_pools() -> None:  # a forked child has none of its parent's threads: it starts its own pools
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)


def pool(workers: int) -> ThreadPoolExecutor:
    """A process's pool of ``workers`` threads for headcat's compiled loops (they release the GIL), made once and kept;
    a forked child makes its own."""
    with _pools_lock:
        pool = _pools.get(workers)
        if pool is None:
            pool = _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="headcat-loops")
        return pool
