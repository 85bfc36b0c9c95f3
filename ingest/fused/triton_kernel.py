"""The fused attention of :mod:`ingest.fused` on a GPU, as a Triton kernel (issue 33).

:func:`attend` takes the arguments of :func:`ingest.fused.attend` and returns the same output and the same
statistics (:class:`ingest.kernels.MapSums`, same layout and dtypes) for CUDA tensors; no ``T x T`` map is held.
Each program takes one map (sample ``b``, query head ``h``, key/value head ``h // (H / Hkv)``) and a block of
``BLOCK_M`` query rows, and passes twice over the keys, ``BLOCK_N`` at a time:

1. the row's maximum ``m`` and sum ``l = sum_t exp(s_t - m)`` with the online rescaling FlashAttention uses
   (``s = scale q k^T``, soft-capped, ``finfo.min`` added where the mask forbids, as the eager mask does);
2. the probabilities ``p = exp(s - m) / l`` of each block of keys, exact: the output ``sum_t p_t v_t``, the
   entropy ``log l - sum_t p_t (s_t - m)`` and, for real rows (``s < L``), the offset sums
   ``D[T - 1 - s + t] += p`` (real keys), added to the map's sums with atomics (blocks of rows share cells).

The special keys' cells (their offsets, columns and the ``[SEP]`` rows' mass on ``[SEP]`` keys) are read after
the second pass: one score per row and used slot, ``q_s . k_key``, normalised by the row's ``m`` and ``l``.
A detection run's pattern cells (:func:`attend_cells`, SPEC 10) are read the same way, after the kernel: it stores
each row's ``m`` and ``l``, and each listed cell's score is gathered and normalised by them.

Products run on the tensor cores as three TF32 products each (``input_precision="tf32x3"``: float32's accuracy,
not TF32's; ``PRECISION``), so the statistics equal the eager ``output_attentions`` reference within 1e-5 as the
CPU kernel's do; the sums are added in float32 (offsets) and
float64 (entropy, special columns, ``[SEP]`` mass) as there. The correctness tests run it on the CPU under
``TRITON_INTERPRET=1`` (tests/ingest/test_fused_triton.py); its speed is measured by bench/gpu.sh.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ingest import kernels
from ingest.fused import Cells

# The float32 the eager mask adds to a forbidden score (torch.finfo(torch.float32).min); a constexpr, since a
# compiled kernel reads no other global (the interpreter does, so only a GPU's compile caught it).
LOWEST = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def _tanh(x):
    # tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2 |x|): no overflow, no cancellation near 0 beyond float32's
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _scores(
    q, k_base, skt, mask_base, sms, rows, keys, dims, tq, tk, dim, scale, softcap,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """A block of scores (BLOCK_M x BLOCK_N) as the eager attention makes them; -inf for keys never read."""
    k = tl.load(
        k_base + keys[None, :] * skt + dims[:, None], mask=(keys[None, :] < tk) & (dims[:, None] < dim), other=0.0
    )
    s = tl.dot(q, k, input_precision=PRECISION) * scale
    if SOFTCAP:
        s = _tanh(s / softcap) * softcap
    if HAS_MASK:
        allowed = tl.load(
            mask_base + rows[:, None] * sms + keys[None, :], mask=(rows[:, None] < tq) & (keys[None, :] < tk), other=1
        )
        s = tl.where(allowed != 0, s, s + LOWEST)
    read = keys[None, :] < tk
    if CAUSAL:
        read = read & (keys[None, :] <= rows[:, None])
    return tl.where(read, s, float("-inf"))


@triton.jit
def _attend_kernel(
    Q, K, V, Mask, Out,
    Lengths, Positions, Counts, SlotSep, QuerySep,
    Offsets, Entropy, SpecialOffsets, Columns, Seps, Top, Total,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, sot, soh, smb, sms,
    heads, group, tq, tk, dim, slots, scale, softcap,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, STATS: tl.constexpr,
    SPECIALS: tl.constexpr, ROWS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)  # 64-bit offsets: a batch of long maps passes 2**31 elements
    b = m // heads
    h = m % heads
    kvh = h // group
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(
        Q + b * sqb + h * sqh + rows[:, None] * sqt + dims[None, :],
        mask=(rows[:, None] < tq) & (dims[None, :] < dim),
        other=0.0,
    )
    k_base = K + b * skb + kvh * skh
    v_base = V + b * svb + kvh * svh
    mask_base = Mask + b * smb
    if CAUSAL:
        end = tl.minimum(tk, (block + 1) * BLOCK_M)
    else:
        end = tk

    # 1. each row's maximum and sum of exps (online)
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    for first in range(0, end, BLOCK_N):
        keys = first + tl.arange(0, BLOCK_N)
        s = _scores(q, k_base, skt, mask_base, sms, rows, keys, dims, tq, tk, dim, scale, softcap,
                    HAS_MASK, CAUSAL, SOFTCAP, PRECISION)  # fmt: skip
        new_top = tl.maximum(top, tl.max(s, 1))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(s - new_top[:, None]), 1)
        top = new_top
    inverse = 1.0 / total
    if ROWS:  # each row's maximum and sum, for scores read afterwards (attend_cells' cells)
        tl.store(Top + m * tq + rows, top, mask=rows < tq)
        tl.store(Total + m * tq + rows, total, mask=rows < tq)

    # 2. the exact probabilities: output, entropy and offset sums
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dot = tl.zeros([BLOCK_M], tl.float32)
    if STATS:
        real = tl.load(Lengths + b)
        real_row = rows < real
    for first in range(0, end, BLOCK_N):
        keys = first + tl.arange(0, BLOCK_N)
        s = _scores(q, k_base, skt, mask_base, sms, rows, keys, dims, tq, tk, dim, scale, softcap,
                    HAS_MASK, CAUSAL, SOFTCAP, PRECISION)  # fmt: skip
        read = s > float("-inf")
        shifted = tl.where(read, s - top[:, None], 0.0)
        e = tl.where(read, tl.exp(shifted), 0.0)
        dot += tl.sum(e * shifted, 1)
        p = e * inverse[:, None]
        v = tl.load(
            v_base + keys[:, None] * svt + dims[None, :], mask=(keys[:, None] < tk) & (dims[None, :] < dim), other=0.0
        )
        acc += tl.dot(p, v, input_precision=PRECISION)
        if STATS:
            cells = real_row[:, None] & (keys[None, :] < real) & read
            tl.atomic_add(Offsets + m * (2 * tk - 1) + (tk - 1) - rows[:, None] + keys[None, :], p, mask=cells)
    tl.store(
        Out + b * sob + h * soh + rows[:, None] * sot + dims[None, :],
        acc,
        mask=(rows[:, None] < tq) & (dims[None, :] < dim),
    )
    if STATS:
        total64 = total.to(tl.float64)
        row_entropy = tl.log(total64) - dot.to(tl.float64) / total64
        tl.atomic_add(Entropy + m, tl.sum(tl.where(real_row, row_entropy, 0.0), 0))

    # 3. the special keys' cells: one score per row and used slot
    if SPECIALS:
        used = tl.load(Counts + b)
        query_sep = tl.load(QuerySep + b * tq + rows, mask=rows < tq, other=0) != 0
        sep = tl.zeros([BLOCK_M], tl.float64)
        for j in range(0, used):
            key = tl.load(Positions + b * slots + j)
            k = tl.load(k_base + key * skt + dims, mask=dims < dim, other=0.0)
            s = tl.sum(q * k[None, :], 1) * scale
            if SOFTCAP:
                s = _tanh(s / softcap) * softcap
            if HAS_MASK:
                allowed = tl.load(mask_base + rows * sms + key, mask=rows < tq, other=1)
                s = tl.where(allowed != 0, s, s + LOWEST)
            p = tl.exp(s - top) * inverse
            cells = real_row
            if CAUSAL:
                cells = cells & (key <= rows)
            p = tl.where(cells, p, 0.0)
            tl.atomic_add(Columns + m * slots + j, tl.sum(p.to(tl.float64), 0))
            tl.atomic_add(SpecialOffsets + m * (2 * tk - 1) + (tk - 1) + key - rows, p, mask=cells)
            slot_sep = tl.load(SlotSep + b * slots + j) != 0
            sep += tl.where(query_sep & slot_sep, p, 0.0).to(tl.float64)
        tl.atomic_add(Seps + m, tl.sum(sep, 0))


# Fused multiply-adds in the compiled kernel: triton's default up to 3.9, said here since 3.10 changes it.
FP_FUSION = True

# The launch: query rows and keys a program takes at once, warps a program, software-pipelining stages (None:
# triton's default) and the products' precision ("ieee": float32 on the CUDA cores; "tf32x3": three TF32 products on
# the tensor cores, float32's accuracy). bench/fused_triton.py --sweep measures the choices; on an H200 (2026-11-28,
# docs/performance.md) 64 rows, 32 keys, 4 warps and tf32x3 were fastest of 20 for both shapes and lengths it times,
# 1.96x to 2.22x the first choice (64, 64, 4, ieee), the largest difference from the eager reference 1.1e-6.
BLOCK_ROWS = 64
BLOCK_KEYS = 32
NUM_WARPS = 4
NUM_STAGES: int | None = None
PRECISION = "tf32x3"
# Most query rows (and keys) a program takes at once; the tests lower it to run several blocks on short maps.
MAX_BLOCK = 128


def _blocks(tq: int, tk: int, dim: int) -> tuple[int, int, int]:
    """Rows, keys and head dims a program takes: powers of two, at least 16 (tl.dot's least), at most BLOCK_ROWS
    and BLOCK_KEYS (and MAX_BLOCK)."""
    block_m = min(MAX_BLOCK, BLOCK_ROWS, max(16, triton.next_power_of_2(tq)))
    block_n = min(MAX_BLOCK, BLOCK_KEYS, max(16, triton.next_power_of_2(tk)))
    return block_m, block_n, max(16, triton.next_power_of_2(dim))


def attend(
    query: torch.Tensor,  # (batch, head, Tq, d) float32
    key: torch.Tensor,  # (batch, kv_head, Tk, d)
    value: torch.Tensor,  # (batch, kv_head, Tk, d)
    mask: torch.Tensor | None,  # (batch or 1, 1, Tq, Tk) bool, True where a query attends; None: all (or causal)
    *,
    scale: float,
    causal: bool = False,
    softcap: float | None = None,
    plan: kernels.Plan | None = None,
) -> tuple[torch.Tensor, kernels.MapSums | None]:
    """:func:`ingest.fused.attend` by the Triton kernel: the same arguments, output and statistics; the tensors on
    one device (a GPU, or the CPU under ``TRITON_INTERPRET=1``)."""
    output, sums, _ = _launch(query, key, value, mask, scale, causal, softcap, plan, rows=False)
    return output, sums


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ingest.fused.attend_cells` on the Triton kernel's pass: the output, and per map the probability mass
    on each accumulator's cells ``(batch, head, cells.count)`` float64.

    The kernel's pass also stores each row's maximum ``m`` and sum of exps ``l``; a cell's probability is then one
    score, ``exp(s - m) / l`` with ``s`` made as the kernel makes it (scaled, soft-capped, ``finfo.min`` added where
    the mask forbids; a key after the query of a causal call is never read: 0), gathered for the listed cells
    alone (``O(cells * d)``, a few per query row). A whole row's mass (key -1) is its probabilities' sum: 1."""
    output, _, extremes = _launch(query, key, value, mask, scale, causal, softcap, None, rows=True)
    assert extremes, "_launch returns each row's maximum and sum of exps when rows is True"
    top, total = extremes
    causal = causal and mask is None  # with a mask, causality is the mask's (as the kernel reads it)
    return output, cell_masses(query, key, mask, scale, causal, softcap, cells, top, total)


# Scores gathered at once by cell_masses: (batch x head x cells) x head dim float32 elements, 128 MiB.
CELL_ELEMENTS = 1 << 25


def cell_masses(
    query: torch.Tensor,
    key: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool,
    softcap: float | None,
    cells: Cells,
    top: torch.Tensor,  # (batch, head, Tq) float32: each row's largest score
    total: torch.Tensor,  # (batch, head, Tq) float32: each row's sum of exp(s - top)
) -> torch.Tensor:
    """``(batch, head, cells.count)`` float64: the probabilities on ``cells`` summed per accumulator, each the
    softmax of its one score against its row's ``top`` and ``total`` (see :func:`attend_cells`)."""
    batch, heads, tq, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    device = query.device
    masses = torch.zeros(batch, heads, cells.count, dtype=torch.float64, device=device)
    rows = torch.repeat_interleave(torch.arange(tq), cells.rows.diff().cpu()).to(device)
    keys, kinds = cells.keys.to(device), cells.kinds.to(device)
    whole = keys < 0
    # a whole row's probabilities sum to one, exactly (rounding aside, as the eager sum of its probabilities)
    masses += torch.bincount(kinds[whole], minlength=cells.count).to(masses.dtype)
    rows, keys, kinds = rows[~whole], keys[~whole], kinds[~whole]
    step = max(1, CELL_ELEMENTS // max(1, batch * heads * dim))
    for first in range(0, len(keys), step):
        r, k, c = rows[first : first + step], keys[first : first + step], kinds[first : first + step]
        q = query[:, :, r].view(batch, kv_heads, group, len(r), dim)
        s = (q * key[:, :, k][:, :, None]).sum(-1).view(batch, heads, len(r)) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if mask is not None:
            allowed = mask[:, 0, r, k][:, None]  # (batch or 1, 1, n)
            s = torch.where(allowed, s, s + LOWEST.value)
        p = torch.exp(s - top[:, :, r]) * (1.0 / total[:, :, r])
        if causal:  # a key after its query is never read
            p = torch.where(k <= r, p, 0.0)
        masses.index_add_(2, c, p.double())
    return masses


def _launch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool,
    softcap: float | None,
    plan: kernels.Plan | None,
    rows: bool,
) -> tuple[torch.Tensor, kernels.MapSums | None, tuple[torch.Tensor, torch.Tensor] | tuple[()]]:
    """The kernel over every map: the output, the plan's statistics, and with ``rows`` each row's maximum and sum of
    exps, ``(batch, head, Tq)`` float32 each."""
    from ingest.fused import checked_inputs

    device = query.device
    if any(tensor.device != device for tensor in (key, value)):
        raise ValueError(f"fused attention takes its tensors on one device; query is on {device}, key on "
                         f"{key.device}, value on {value.device}")  # fmt: skip
    query, key, value, mask, causal = checked_inputs(query, key, value, mask, causal, device)
    batch, heads, tq, dim = query.shape
    kv_heads, tk = key.shape[1], key.shape[2]
    if mask is not None:
        mask = mask.to(device).contiguous().view(torch.uint8)
    maps = batch * heads
    out = query.new_empty(batch, tq, heads, dim)
    nothing = torch.zeros(1, device=device)
    sums: kernels.MapSums | None = None
    if plan is not None:
        if tq != tk or plan.length != tq or plan.maps != maps or plan.heads != heads:
            raise ValueError(f"the plan is for {plan.maps} maps of {plan.length} tokens, not {maps} of {tq} x {tk}")
        slots = plan.positions.shape[1]
        sums = kernels.MapSums(
            torch.zeros(maps, 2 * tq - 1, device=device),
            torch.zeros(maps, dtype=torch.float64, device=device),
            torch.zeros(maps, 2 * tq - 1, device=device),
            torch.zeros(maps, slots, dtype=torch.float64, device=device),
            torch.zeros(maps, dtype=torch.float64, device=device),
        )
        indices = (
            torch.from_numpy(plan.lengths[::heads].copy()).to(device),
            torch.from_numpy(plan.positions).to(device),
            torch.from_numpy(plan.counts).to(device),
            torch.from_numpy(plan.slot_sep).to(device).view(torch.uint8),
            torch.from_numpy(plan.query_sep).to(device).view(torch.uint8),
        )
        with_specials = plan.with_specials
    else:
        slots = 0
        indices = (nothing.long(), nothing.long(), nothing.long(), nothing.byte(), nothing.byte())
        with_specials = False
    outputs = (
        tuple(sums) if sums is not None else (nothing, nothing.double(), nothing, nothing.double(), nothing.double())
    )
    row_stats = (query.new_empty(batch, heads, tq), query.new_empty(batch, heads, tq)) if rows else ()
    mask_arg = mask if mask is not None else nothing.byte()
    mask_batch_stride = mask.stride(0) if mask is not None and mask.shape[0] > 1 else 0
    mask_row_stride = mask.stride(2) if mask is not None else 0
    block_m, block_n, block_d = _blocks(tq, tk, dim)
    grid = (triton.cdiv(tq, block_m), maps)
    _attend_kernel[grid](
        query, key, value, mask_arg, out, *indices, *outputs, *(row_stats or (nothing, nothing)),
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), out.stride(0), out.stride(1), out.stride(2),
        mask_batch_stride, mask_row_stride,
        heads, heads // kv_heads, tq, tk, dim, slots, float(scale), float(softcap or 0.0),
        HAS_MASK=mask is not None, CAUSAL=causal, SOFTCAP=bool(softcap), STATS=plan is not None,
        SPECIALS=with_specials, ROWS=rows, PRECISION=PRECISION, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        enable_fp_fusion=FP_FUSION, num_warps=NUM_WARPS, **({} if NUM_STAGES is None else {"num_stages": NUM_STAGES}),
    )  # fmt: skip
    if sums is not None and not with_specials:
        sums = kernels.MapSums(sums.offsets, sums.entropy, None, None, None)
    return out, sums, row_stats
