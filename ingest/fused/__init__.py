"""Attention and head statistics in one pass on the CPU: no ``T x T`` map is ever held (issue 33).

Every statistic headcat stores per head is linear in the probabilities (SPEC 1's windows, self and
special-token features, the previous / next / distance scalars, SPEC 10's pattern scores) or is the
entropy ``H_s = logsumexp_s - sum_t A[s, t] scores[s, t]``. :func:`attend` computes a layer's attention
output a block of query rows at a time (``scale Q K^T`` and ``P V`` by BLAS, the softmax of each row in
cache) and, while a tile of a row's exps is in cache, adds it into the row's accumulators: its sums over each
window of distances, itself, its neighbours and its distances (the features' offset columns), its special keys
by window and group, a ``[SEP]`` row's mass on ``[SEP]`` keys; with the entropy, what the features take from
the sums :func:`ingest.kernels.reduce_maps` takes from a stored map (:class:`ingest.kernels.WindowSums`). The
accumulators are rescaled with the row's output as its largest score rises, and divided by its sum at its end.
:func:`attend_cells` instead adds each row's probabilities on listed cells into a few accumulators per map
(:class:`Cells`: SPEC 10's pattern scores, the detectors' masses; the same cells for every sample).
A block of query rows (:func:`block_rows`) takes its keys a tile at a time (:func:`tile_keys`: :data:`TILE_BYTES`
of scores), the output rescaled online as FlashAttention rescales it; the statistics, the example's column bins and
the pattern cells are read from each tile as it passes, so no row's exps are kept past their tile.

What it expresses (:func:`attend`'s arguments): scaling, soft-capping, a boolean mask (padding, causal,
sliding windows: as ``transformers``' ``sdpa_mask`` builds it) or none with ``causal``, grouped key/value
heads; rotary embeddings are applied to ``q`` and ``k`` before attention is called. float32 only.

The kernel is C++ (``kernel.cpp`` beside this file), compiled on first use (seconds: it includes ATen's vector
headers only and is called through ctypes) and kept in :func:`cache_dir`. :func:`kernel` returns None when it cannot
be built (no compiler): callers then run the maps path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from ingest import kernels

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernel.cpp")
# A block of query rows holds BLOCK_BYTES of scores where its keys are few, and at least ROWS_PER_DIM rows a float of a
# head's vectors, up to LEAST_ROWS (MIN_BLOCK_ROWS where that is set): at long contexts a thinner block reads every key
# and value again for a few rows (16k tokens, one call: 0.28x SDPA's time at 4 rows a block), and 2 x dim rows read
# them at 4 bytes a score; a thicker block keeps more exps beyond the cache. So 64 rows for MiniLM's heads of 32 and
# 128 for heads of 64 and 128: at 4k tokens no other of 32 to 256 rows took the statistics faster (docs/performance.md).
# Its keys go in tiles of TILE_BYTES of scores (a core's L2 on the machine it was measured on), or of TILE_KEYS keys
# where that is set.
BLOCK_BYTES = 256 << 10
ROWS_PER_DIM = 2
LEAST_ROWS = 128
MIN_BLOCK_ROWS: int | None = None
TILE_BYTES = 256 << 10
TILE_KEYS: int | None = None
# kernel.cpp's kRowPad: a tile's rows of scores lie up to this many floats more than its keys apart.
ROW_PAD = 32
# A key/value head's rows strided in memory (the model's (batch, T, head, d) layout) are copied into contiguous rows
# before its maps where they are read at least this many times (blocks of query rows x query heads sharing them):
# a random MiniLM-shaped BERT at 4k tokens (32 reads), the extraction about 3 % faster; at MiniLM's 384 tokens (3 reads)
# the copy costs more than it saves, the extraction about 1.6 % slower (docs/performance.md).
KV_COPY_READS = 32
# With more than one thread, a call's maps go to torch's own threads in this many ranges a thread, taken as each frees
# up (dynamic scheduling).
CHUNKS_PER_WORKER = 4

_lock = threading.Lock()
_module: Any = None
_failed: str | None = None


def _flags() -> list[str]:
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-ffp-contract=fast"]
    # ATen's vector types for the CPU torch itself dispatches to (the flags torch builds its own kernels with)
    if capability == "AVX512":
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY_AVX512",
                  "-DCPU_CAPABILITY=AVX512"]  # fmt: skip
    elif capability == "AVX2":
        flags += ["-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return flags


def cache_dir() -> Path:
    """Where the built kernel is kept: ``HEADCAT_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/headcat`` (``~/.cache``)."""
    if chosen := os.environ.get("HEADCAT_KERNEL_CACHE"):
        return Path(chosen)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "headcat"


def _compiled(compiler: list[str], flags: list[str]) -> Path:
    """``kernel.cpp`` compiled with ``flags`` into the cache (see :func:`_build`); raises where the compiler fails."""
    import subprocess
    import tempfile

    source = SOURCE.read_text()
    digest = hashlib.sha256("\0".join([source, *compiler, *flags, torch.__version__]).encode()).hexdigest()[:16]
    target = cache_dir() / f"headcat_fused_{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        logger.info("building headcat's fused CPU kernel into %s", target)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            done = subprocess.run([*compiler, str(SOURCE), "-o", str(built), *flags], capture_output=True, text=True)
            if done.returncode != 0:
                lines = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
                raise RuntimeError(f"{compiler[0]} failed: {lines[0].strip() if lines else done.returncode}")
            os.replace(built, target)
    return target


def _build() -> ctypes.CDLL:
    """``kernel.cpp`` compiled into a shared library (seconds: it includes ATen's vector headers only, not
    ``torch/extension.h``, and is called through ctypes), linked to torch's own CPU library for its BLAS, and loaded.
    The library's name is the digest of its source, flags, compiler and torch, so a change builds a new one; it is
    written under another name and moved into place, so processes building at once never read half a file.

    With OpenMP (``-fopenmp``: the libgomp torch loads), a call's maps run on torch's own threads; a compiler without
    it (Apple's clang) builds the kernel without, and the maps go to a pool of headcat's threads (:func:`_attend`)."""
    import shlex

    from torch.utils.cpp_extension import include_paths

    compiler = shlex.split(os.environ.get("CXX") or "c++")
    library = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = [*_flags(), "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             *(f"-I{path}" for path in include_paths()), f"-L{library}", "-ltorch_cpu", "-lc10",
             f"-Wl,-rpath,{library}"]  # fmt: skip
    try:
        target = _compiled(compiler, ["-fopenmp", *flags])
    except RuntimeError as error:
        logger.info("building headcat's fused CPU kernel without OpenMP (%s)", error)
        target = _compiled(compiler, flags)
    module = ctypes.CDLL(str(target))
    module.headcat_attend.argtypes = [ctypes.POINTER(_Call), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    module.headcat_attend.restype = ctypes.c_int
    module.headcat_attend_threads.argtypes = [ctypes.POINTER(_Call), ctypes.c_void_p, *[ctypes.c_int64] * 4]
    module.headcat_attend_threads.restype = ctypes.c_int
    module.headcat_parallel.restype = ctypes.c_int
    module.headcat_call_size.restype = ctypes.c_int64
    if module.headcat_call_size() != ctypes.sizeof(_Call):
        raise RuntimeError(f"kernel.cpp's Call is {module.headcat_call_size()} bytes, _Call {ctypes.sizeof(_Call)}")
    module.headcat_row_pad.restype = ctypes.c_int64
    if module.headcat_row_pad() != ROW_PAD:
        raise RuntimeError(f"kernel.cpp pads rows of scores by {module.headcat_row_pad()} floats, ROW_PAD by {ROW_PAD}")
    return module


_P, _I, _D, _B = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_bool


class _Stats(ctypes.Structure):
    _fields_ = [("on", _B), ("lengths", _P), ("positions", _P), ("counts", _P), ("slot_sep", _P), ("groups", _P),
                ("query_sep", _P), ("slots", _I), ("windows", _I), ("group_count", _I), ("sums", _P), ("entropy", _P),
                ("special", _P), ("special_groups", _P), ("seps", _P)]  # fmt: skip


class _Cells(ctypes.Structure):
    _fields_ = [("on", _B), ("rows", _P), ("keys", _P), ("kinds", _P), ("count", _I), ("masses", _P)]


class _Pooled(ctypes.Structure):
    _fields_ = [("on", _B), ("sample", _I), ("rows", _I), ("side_rows", _I), ("side_columns", _I), ("row_bins", _P),
                ("column_bins", _P), ("maps", _P)]  # fmt: skip


class _Call(ctypes.Structure):
    """``kernel.cpp``'s ``Call`` (and its ``Stats``, ``Cells`` and ``Pooled``): the same fields in the same order
    (:func:`_build` checks the size)."""

    _fields_ = [
        ("q", _P), ("k", _P), ("v", _P), ("out", _P),
        ("heads", _I), ("tq", _I), ("dim", _I), ("kv_heads", _I), ("tk", _I),
        ("q_strides", _I * 3), ("k_strides", _I * 3), ("v_strides", _I * 3), ("out_strides", _I * 3),
        ("mask", _P), ("mask_batch_stride", _I), ("mask_row_stride", _I), ("causal", _I),
        ("scale", _D), ("softcap", _D), ("block_rows", _I), ("block_keys", _I), ("copy_kv", _I),
        ("stats", _Stats), ("cells", _Cells), ("pooled", _Pooled),
    ]  # fmt: skip


def kernel() -> Any:
    """The compiled kernel, built on first use; None (and the reason logged once) where it cannot be."""
    global _module, _failed
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        try:
            _module = _build()
        except Exception as error:  # no compiler, no headers: the maps path runs instead
            _failed = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
            logger.warning("headcat's fused CPU kernel could not be built (%s): the maps path runs", _failed)
        return _module


def unavailable() -> str | None:
    """Why the kernel cannot run here (it is built first if it was not), or None when it can."""
    kernel()
    return _failed


# Tests only: send CPU tensors to the Triton kernel too (run it with TRITON_INTERPRET=1 set before triton is
# imported), so that the CUDA path of extraction and detection is exercised on a machine without a GPU.
TRITON_ON_CPU = False


def triton_unavailable() -> str | None:
    """Why the Triton kernel cannot run here (triton does not import), or None when it can."""
    try:
        import triton  # noqa: F401
    except Exception as error:  # not installed, or no driver it can load
        return f"{type(error).__name__}: {error}"
    return None


@dataclass(frozen=True)
class Cells:
    """Sparse cells of a ``Tq x Tk`` map, the same for every sample, each added into one of ``count`` accumulators.

    Query row ``s`` reads entries ``rows[s]`` to ``rows[s + 1] - 1``: key ``keys[e]`` into accumulator
    ``kinds[e]``; key -1 stands for the row's whole mass (the sum of its probabilities)."""

    rows: torch.Tensor  # (Tq + 1,) int64, CSR pointers
    keys: torch.Tensor  # (n,) int64, in [-1, Tk)
    kinds: torch.Tensor  # (n,) int64, in [0, count)
    count: int

    @classmethod
    def from_masks(cls, masks: torch.Tensor, whole: torch.Tensor | None = None) -> Cells:
        """The cells of ``masks`` ``(Tq, Tk, count)`` bool (accumulator ``c`` sums the cells where
        ``masks[..., c]``); ``whole`` ``(Tq,)`` bool adds one more accumulator, last: the whole mass of those rows."""
        tq = masks.shape[0]
        count = masks.shape[-1]
        rows, keys, kinds = masks.cpu().nonzero(as_tuple=True)  # row-major: sorted by row
        if whole is not None:
            chosen = whole.cpu().nonzero(as_tuple=True)[0]
            rows = torch.cat([rows, chosen])
            keys = torch.cat([keys, torch.full_like(chosen, -1)])
            kinds = torch.cat([kinds, torch.full_like(chosen, count)])
            order = torch.sort(rows, stable=True).indices
            rows, keys, kinds = rows[order], keys[order], kinds[order]
            count += 1
        pointers = torch.zeros(tq + 1, dtype=torch.int64)
        pointers[1:] = torch.bincount(rows, minlength=tq).cumsum(0)
        return cls(pointers, keys.long().contiguous(), kinds.long().contiguous(), count)


@dataclass
class Example:
    """One sample's maps, average-pooled as :func:`pooled_example` pools them, taken in the attention's own pass
    (the catalog's example map: recomputing it afterwards cost as much as the attention itself at 4k tokens).

    ``row``: the sample; its first ``rows`` query rows and ``columns`` keys are pooled to ``side``. :func:`attend`
    and :func:`attend_cells` fill ``maps`` ``(head, *side)`` float32."""

    row: int
    rows: int
    columns: int
    side: tuple[int, int]
    maps: torch.Tensor | None = None

    def bins(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(side[0], 2)`` and ``(side[1], 2)`` int64: each bin's start and stop, as adaptive pooling takes them."""
        return tuple(  # type: ignore[return-value]
            torch.tensor([[(i * size) // side, -(-((i + 1) * size) // side)] for i in range(side)], dtype=torch.int64)
            for size, side in ((self.rows, self.side[0]), (self.columns, self.side[1]))
        )


def attend(
    query: torch.Tensor,  # (batch, head, Tq, d) float32 on the CPU
    key: torch.Tensor,  # (batch, kv_head, Tk, d)
    value: torch.Tensor,  # (batch, kv_head, Tk, d)
    mask: torch.Tensor | None,  # (batch or 1, 1, Tq, Tk) bool, True where a query attends; None: all (or causal)
    *,
    scale: float,
    causal: bool = False,  # with no mask: key t > query s is not attended
    softcap: float | None = None,
    plan: kernels.Plan | None = None,  # statistics of these maps (Tq == Tk), summed by the plan's num_windows
    example: Example | None = None,  # filled: one sample's pooled maps
) -> tuple[torch.Tensor, kernels.WindowSums | None]:
    """The attention output ``(batch, Tq, head, d)`` (``softmax(scale q k^T [+ mask]) v`` per query head) and,
    with ``plan``, the maps' statistics (:class:`ingest.kernels.WindowSums`: windows, entropy, special keys).
    CUDA tensors go to the Triton kernel (``triton_kernel.py``) where triton imports, with the same result."""
    if plan is not None and plan.num_windows is None:
        raise ValueError("the fused kernel sums each map by window: make its plan with num_windows")
    if (triton := _triton(query)) is not None:
        _pool_after(example, query, key, mask, scale, causal, softcap)
        output, sums = triton.attend(query, key, value, mask, scale=scale, causal=causal, softcap=softcap, plan=plan)
        return output, kernels.window_sums(sums, plan) if sums is not None and plan is not None else None
    output, sums, _ = _attend(query, key, value, mask, scale, causal, softcap, plan, None, example)
    return output, sums


def _triton(query: torch.Tensor) -> Any:
    """The Triton kernel's module where it takes these tensors (CUDA, or the CPU with :data:`TRITON_ON_CPU`) and
    triton imports; None where the C++ kernel runs."""
    if (query.device.type == "cuda" or TRITON_ON_CPU) and triton_unavailable() is None:
        from ingest.fused import triton_kernel

        return triton_kernel
    return None


def _pool_after(example: Example | None, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
                scale: float, causal: bool, softcap: float | None) -> None:  # fmt: skip
    """``example`` (where one is asked for) by :func:`pooled_example`, for a kernel that does not take it in its pass
    (Triton's)."""
    if example is None:
        return
    call = SimpleNamespace(query=query, key=key, mask=mask, scale=scale, causal=causal, softcap=softcap)
    example.maps = pooled_example(call, example.row, example.rows, example.columns, example.side)


def attend_cells(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scale: float,
    causal: bool = False,
    softcap: float | None = None,
    cells: Cells,
    example: Example | None = None,  # filled: one sample's pooled maps
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend`'s output and, per map, the probability mass on each accumulator's cells:
    ``(batch, head, cells.count)`` float64 (the sums of float32 probabilities, in double). CUDA tensors go to the
    Triton kernel's pass (:func:`ingest.fused.triton_kernel.attend_cells`) where triton imports."""
    tq, tk = query.shape[2], key.shape[2]
    if cells.rows.shape != (tq + 1,) or cells.keys.shape != cells.kinds.shape:
        raise ValueError(f"the cells are for {cells.rows.shape[0] - 1} query rows, not {tq}")
    if len(cells.keys) and (int(cells.keys.max()) >= tk or int(cells.kinds.max()) >= cells.count):
        raise ValueError(f"a cell lies beyond the {tk} keys or the {cells.count} accumulators")
    if len(cells.keys) and (int(cells.keys.min()) < -1 or int(cells.kinds.min()) < 0):
        raise ValueError("a cell's key is below -1 or its accumulator below 0")
    if int(cells.rows[0]) != 0 or int(cells.rows[-1]) != len(cells.keys) or bool((cells.rows.diff() < 0).any()):
        raise ValueError(f"the cells' row pointers do not rise from 0 to their {len(cells.keys)} entries")
    if (triton := _triton(query)) is not None:
        _pool_after(example, query, key, mask, scale, causal, softcap)
        return triton.attend_cells(query, key, value, mask, scale=scale, causal=causal, softcap=softcap, cells=cells)
    output, _, masses = _attend(query, key, value, mask, scale, causal, softcap, None, cells, example)
    assert masses is not None
    return output, masses.view(query.shape[0], query.shape[1], cells.count)


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool,
    softcap: float | None,
    plan: kernels.Plan | None,
    cells: Cells | None,
    example: Example | None = None,
) -> tuple[torch.Tensor, kernels.WindowSums | None, torch.Tensor | None]:
    module = kernel()
    if module is None:
        raise RuntimeError(f"the fused kernel is not available: {_failed}")
    query, key, value, mask, causal = checked_inputs(query, key, value, mask, causal, torch.device("cpu"))
    batch, heads, tq, dim = query.shape
    tk = key.shape[2]
    out = query.new_empty(batch, tq, heads, dim)
    maps = batch * heads
    rows = block_rows(tq, tk, dim)
    copy_kv = copies_kv(query, key, value, rows)
    call = _Call(heads=heads, tq=tq, dim=dim, kv_heads=key.shape[1], tk=tk, causal=int(causal), scale=float(scale),
                 softcap=float(softcap or 0.0), block_rows=rows, block_keys=tile_keys(rows),
                 copy_kv=int(copy_kv))  # fmt: skip
    held: list[torch.Tensor] = []  # every tensor the call points into, alive until it returns

    def point(tensor: torch.Tensor, dtype: torch.dtype = torch.float32) -> int:
        """The address the kernel reads, of a CPU tensor of the type it reads there (a pointer carries no type)."""
        if tensor.dtype != dtype or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"the fused kernel reads a contiguous CPU {dtype} here, not {tensor.dtype} on "
                             f"{tensor.device}{'' if tensor.is_contiguous() else ', strided'}")  # fmt: skip
        held.append(tensor)
        return tensor.data_ptr()

    for name, tensor in (("q", query), ("k", key), ("v", value), ("out", out)):
        held.append(tensor)  # strided (checked_inputs: last dim unit-stride, float32 on the CPU)
        setattr(call, name, tensor.data_ptr())
        getattr(call, f"{name}_strides")[:] = tensor.stride()[:3]
    if mask is not None:
        call.mask = point(mask, torch.bool)
        call.mask_batch_stride = mask.stride(0) if mask.shape[0] > 1 else 0
        call.mask_row_stride = mask.stride(2)
    if plan is not None:
        if tq != tk or plan.length != tq or plan.maps != maps or plan.heads != heads:
            raise ValueError(f"the plan is for {plan.maps} maps of {plan.length} tokens, not {maps} of {tq} x {tk}")
        assert plan.num_windows is not None  # attend checked it
        windows, groups = plan.num_windows, plan.group_count
        buffers = [torch.empty(maps, windows + 4, dtype=torch.float64), torch.empty(maps, dtype=torch.float64),
                   torch.empty(maps, windows + 1, dtype=torch.float64), torch.empty(maps, groups, dtype=torch.float64),
                   torch.empty(maps, dtype=torch.float64)]  # fmt: skip
        stats = call.stats
        stats.sums, stats.entropy, stats.special, stats.special_groups, stats.seps = (point(x, torch.float64)
                                                                                      for x in buffers)  # fmt: skip
        # each sample's used slots in key order (the kernel walks a tile's), unused ones after them
        slots = plan.positions.shape[1]
        order = np.argsort(np.where(np.arange(slots) < plan.counts[:, None], plan.positions, tq), axis=1, kind="stable")
        given = [np.take_along_axis(x, order, 1) for x in (plan.positions, plan.slot_sep, plan.groups)]
        stats.lengths, stats.counts, stats.query_sep = (
            point(torch.from_numpy(np.ascontiguousarray(x)), dtype)
            for x, dtype in ((plan.lengths[::heads], torch.int64), (plan.counts, torch.int64),
                             (plan.query_sep, torch.bool))
        )  # fmt: skip
        stats.positions, stats.slot_sep, stats.groups = (
            point(torch.from_numpy(np.ascontiguousarray(x)), dtype)
            for x, dtype in zip(given, (torch.int64, torch.bool, torch.int64), strict=True)
        )
        stats.on, stats.slots, stats.windows, stats.group_count = True, slots, windows, groups
        sums: kernels.WindowSums | None = kernels.WindowSums(*buffers)
    else:
        sums = None
    if cells is not None:
        masses = torch.empty(maps, cells.count, dtype=torch.float64)
        pattern = call.cells
        listed = (cells.rows, cells.keys, cells.kinds)
        pattern.rows, pattern.keys, pattern.kinds = (point(x.contiguous(), torch.int64) for x in listed)
        pattern.on, pattern.count, pattern.masses = True, cells.count, point(masses, torch.float64)
    else:
        masses = None
    if example is not None:
        if not (0 <= example.row < batch and 0 < example.side[0] <= example.rows <= tq
                and 0 < example.side[1] <= example.columns <= tk):  # fmt: skip
            raise ValueError(f"the example {example.row}, {example.rows} x {example.columns} to {example.side} does "
                             f"not fit {batch} samples of {tq} x {tk}")  # fmt: skip
        pooled_maps = torch.zeros(heads, *example.side, dtype=torch.float64)
        row_bins, column_bins = example.bins()
        pooled = call.pooled
        pooled.on, pooled.sample, pooled.rows = True, example.row, example.rows
        pooled.side_rows, pooled.side_columns = example.side
        pooled.row_bins, pooled.column_bins = point(row_bins, torch.int64), point(column_bins, torch.int64)
        pooled.maps = point(pooled_maps, torch.float64)

    # a thread's scores from torch's allocator, so that its memory profiler counts them, as kernel.cpp reads them: a
    # tile's (rows x (tile keys + ROW_PAD)); then where copy_kv is on, a key/value head's rows
    floats = max(1, min(rows, tq)) * (max(1, min(tk, call.block_keys)) + ROW_PAD) + (2 * tk * dim if copy_kv else 0)

    def run(start: int, stop: int) -> int:
        scores = torch.empty(floats)
        return int(module.headcat_attend(ctypes.byref(call), scores.data_ptr(), start, stop))

    workers = min(torch.get_num_threads(), maps)
    # Several ranges a worker, taken as workers free up: on a shared host one slowed worker does not hold up the call
    # while the others wait (SDPA's own threads balance the same way).
    step = -(-maps // (workers * CHUNKS_PER_WORKER))
    if workers <= 1:
        failed = run(0, maps)
    elif module.headcat_parallel():  # on torch's own threads
        scores = torch.empty(workers * floats)
        failed = module.headcat_attend_threads(ctypes.byref(call), scores.data_ptr(), floats, maps, step, workers)
    else:  # a kernel built without OpenMP: on a pool of ours
        futures = [kernels.pool(workers).submit(run, start, min(start + step, maps)) for start in range(0, maps, step)]
        failed = max(future.result() for future in futures)
    if failed:
        raise MemoryError("the fused kernel ran out of memory")
    if example is not None:
        example.maps = pooled_maps.float()
    if sums is not None and not plan.with_specials:  # type: ignore[union-attr]
        sums = kernels.WindowSums(sums.windows, sums.entropy, None, None, None)
    return out, sums, masses


def copies_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: int) -> bool:
    """Whether the kernel copies each key/value head's rows into contiguous rows before its maps: where they are
    strided (a model's ``(batch, T, head, d)`` layout) and read at least :data:`KV_COPY_READS` times (the blocks of
    ``rows`` query rows, times the query heads that share a key/value head)."""
    heads, tq, dim = query.shape[1:]
    strided = key.stride(2) != dim or value.stride(2) != dim
    return strided and heads // key.shape[1] * -(-tq // rows) >= KV_COPY_READS


def tile_keys(rows: int) -> int:
    """Keys a tile of the kernel holds for a block of ``rows`` query rows: :data:`TILE_BYTES` of scores, or
    :data:`TILE_KEYS` where that is set."""
    return TILE_KEYS or max(1, TILE_BYTES // (4 * max(rows, 1)))


def block_rows(tq: int, tk: int, dim: int) -> int:
    """Query rows a block of the kernel holds for heads of ``dim``: :data:`BLOCK_BYTES` of scores and at least
    :data:`ROWS_PER_DIM` x ``dim`` rows up to :data:`LEAST_ROWS` (:data:`MIN_BLOCK_ROWS` where set), then as many
    blocks of even size (384 rows as 3 blocks of 128, not 170, 170 and 44)."""
    least = min(LEAST_ROWS, ROWS_PER_DIM * dim) if MIN_BLOCK_ROWS is None else MIN_BLOCK_ROWS
    rows = max(least, BLOCK_BYTES // (4 * max(tk, 1)), 1)
    blocks = max(1, -(-tq // rows))
    return max(1, -(-tq // blocks))


def pooled_example(call: Any, row: int, rows: int, columns: int, side: tuple[int, int]) -> torch.Tensor:
    """:func:`example_maps`' first ``rows x columns`` cells, average-pooled to ``side`` as
    ``adaptive_avg_pool2d`` pools them, computed a bin of query rows at a time: never a whole ``T x T`` map
    (at 4k tokens that is 64 MiB a head). Each output cell is the mean of a rectangle of probabilities, so the
    mean over its rows of the rows' column-bin means."""
    heads = call.query.shape[1]
    out = call.query.new_empty(heads, *side)
    for i in range(side[0]):
        start, stop = (i * rows) // side[0], -(-((i + 1) * rows) // side[0])
        block = example_maps(call, row, slice(start, stop))[:, :, :columns]  # (head, stop - start, columns)
        out[:, i] = torch.nn.functional.adaptive_avg_pool1d(block.mean(1, keepdim=True), side[1])[:, 0]
    return out


def example_maps(call: Any, row: int, queries: slice | None = None) -> torch.Tensor:
    """One sample's probabilities ``(head, Tq, Tk)`` as the eager attention computes them (the catalog keeps a
    downsampled copy of one sample's maps): ``call`` is an :class:`ingest.attention.FusedCall`."""
    queries = queries or slice(0, call.query.shape[2])
    query, key = call.query[row, :, queries], call.key[row]  # (head, q, d), (kv_head, Tk, d)
    key = key.repeat_interleave(query.shape[0] // key.shape[0], 0)
    scores = torch.matmul(query, key.transpose(-1, -2)) * call.scale
    if call.softcap:
        scores = torch.tanh(scores / call.softcap) * call.softcap
    lowest = torch.finfo(scores.dtype).min
    if call.mask is not None:
        allowed = call.mask[row if call.mask.shape[0] > 1 else 0, 0, queries]  # (q, Tk)
        scores = scores + torch.where(allowed, 0.0, lowest)
    elif call.causal:  # key t > query s masked, for these rows only: never a T x T mask
        rows = torch.arange(call.query.shape[2], device=scores.device)[queries]
        later = torch.arange(scores.shape[-1], device=scores.device)[None, :] > rows[:, None]
        scores = scores + torch.where(later, lowest, 0.0)
    return torch.softmax(scores, dim=-1)


def checked_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:
    """:func:`attend`'s arguments checked (4-d float32 on ``device``, shapes that fit, a ``(batch or 1, 1, Tq, Tk)``
    bool mask), each made unit-stride in its last dimension; with a mask, ``causal`` is the mask's business."""
    batch, heads, tq, dim = query.shape
    kv_heads, tk = key.shape[1], key.shape[2]
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.dtype != torch.float32 or tensor.device.type != device.type or tensor.dim() != 4:
            raise ValueError(
                f"fused attention takes 4-d float32 tensors on {device}; {name} is {tensor.dtype} on {tensor.device}"
            )
    if key.shape != value.shape or key.shape[0] != batch or key.shape[3] != dim or heads % kv_heads:
        raise ValueError(
            f"fused attention: query {list(query.shape)} does not fit key {list(key.shape)} / value {list(value.shape)}"
        )
    if causal and tq != tk:
        raise ValueError("fused attention: a causal call without a mask needs as many queries as keys")
    query, key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
    if mask is not None:
        if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2:] != (tq, tk):
            raise ValueError(
                f"fused attention takes a (batch, 1, Tq, Tk) bool mask, not {mask.dtype} {tuple(mask.shape)}"
            )
        if mask.shape[0] not in (1, batch):
            raise ValueError(f"the mask's batch {mask.shape[0]} is neither 1 nor {batch}")
        mask = mask.contiguous()
        causal = False
    return query, key, value, mask, causal
