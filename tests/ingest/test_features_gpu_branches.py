"""Features: the torch branches a GPU runs (``_matmul``, ``_log_normalizer``, ``_expected_score``, ``_offset_sums``
and ``_skewed_sums``), called on CPU tensors with values written by hand or float64 numpy references.

Where a branch is taken on CUDA alone, PyTorch's ``meta`` device stands in for it: ``is_cuda`` is made to answer
True for meta tensors, whose ``bmm`` has the ``out_dtype`` variant that the CPU's lacks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ingest import features as features_module
from ingest.features import (
    _expected_score,
    _log_normalizer,
    _matmul,
    _skewed_sums,
    build_weights,
    reduce_attention,
)
from ingest.types import SPECIAL_GROUPS
from tests.ingest.test_features import assert_matches_reference, masked_batch

CLS, SEP, PERIOD, COMMA = (SPECIAL_GROUPS.index(group) for group in ("cls", "sep", "period", "comma"))
N = 8
TINY = torch.finfo(torch.float32).tiny  # 2 ** -126


def offset_sums_reference(maps: torch.Tensor, lengths: list[int], heads: int) -> np.ndarray:
    """``(maps, 2T - 1)``: ``D[o] = sum_s A[s, s + o]`` over each map's real query rows ``s < L``, by np.trace."""
    length = maps.shape[-1]
    out = []
    for m in range(maps.shape[0]):
        rows = maps[m, : lengths[m // heads]].double().numpy()  # (L, T)
        out.append([np.trace(rows, offset=o) for o in range(1 - length, length)])
    return np.array(out)


# --- _matmul: float32 products of half-precision maps on CUDA -------------------------------------------------


def test_half_products_come_back_in_float32_on_cuda_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """float16 / bfloat16 products are asked in float32 (``bmm``'s ``out_dtype``) on CUDA, and on CUDA alone: meta
    has the variant too, but is not CUDA, so it gets the plain product in the inputs' dtype."""
    a = torch.empty(2, 3, 4, dtype=torch.float16, device="meta")
    b = torch.empty(2, 4, 5, dtype=torch.float16, device="meta")
    assert _matmul(a, b).dtype == torch.float16
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self.device.type == "meta"))
    assert a.is_cuda
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        out = _matmul(a.to(dtype), b.to(dtype))
        assert (out.dtype, tuple(out.shape), out.device.type) == (torch.float32, (2, 3, 5), "meta"), dtype
    # a backend without the variant (here the CPU, told it is CUDA): the plain product, in float16
    left = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]], dtype=torch.float16)
    right = torch.tensor([[[0.5, 0.0], [0.25, 1.0]]], dtype=torch.float16)
    plain = _matmul(left, right)
    assert plain.dtype == torch.float16
    assert plain.tolist() == [[[1.0, 2.0], [2.5, 4.0]]]


# --- _log_normalizer: which key each row's lse is read off ---------------------------------------------------


@pytest.mark.parametrize("gpu_branches", [True, False], ids=["gpu-branches", "cpu-rows"])
def test_lse_is_read_off_the_diagonal_unless_it_is_within_1024_tiny(
    gpu_branches: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lse = scores[s, r] - log A[s, r]``: ``r = s`` where ``A[s, s] > 1024 * tiny`` or the query is padding,
    else the row's largest key. These maps are not a softmax of the (zero) scores, so the key read shows in lse:
    ``-log A[s, s]`` or ``-log max_t A[s, t]``. Row 0: a normal diagonal of 1/4 (not the largest); row 1: exactly
    1024 * tiny, not trusted; row 2: 1025 * tiny, trusted; row 3: a padding query's 2 ** -120 diagonal, trusted.
    Each row on its own: the untrusted row 1 puts none of the others on their largest key. The CPU's rows are
    redone in place, float64 values written into the (float64) copy of the float32 scores' diagonal."""
    monkeypatch.setattr(features_module, "GPU_BRANCHES_ON_CPU", gpu_branches)
    probs = torch.tensor(
        [
            [0.25, 0.5, 0.125, 0.125],
            [0.5, 1024 * TINY, 0.25, 0.25],
            [0.5, 0.25, 1025 * TINY, 0.25],
            [0.5, 0.25, 0.25, 2.0**-120],
        ],
        dtype=torch.float32,
    )[None, None]  # (1, 1, 4, 4)
    assert float(probs[0, 0, 1, 1]) == 2.0**-116  # exact: 1024 * tiny
    assert float(probs[0, 0, 2, 2]) == 1025 * 2.0**-126
    scores = torch.zeros(1, 1, 4, 4, dtype=torch.float32)
    query_mask = torch.tensor([[True, True, True, False]])
    rounded, remainder = _log_normalizer(probs, scores, query_mask)
    assert (rounded.dtype, remainder.dtype, tuple(rounded.shape)) == (torch.float32, torch.float64, (1, 1, 4))
    expected = [math.log(4.0), math.log(2.0), 126 * math.log(2.0) - math.log(1025.0), 120 * math.log(2.0)]
    lse = (rounded.double() + remainder)[0, 0].numpy()
    np.testing.assert_allclose(lse, expected, rtol=1e-15, atol=0)
    assert abs(float(remainder[0, 0, 0])) <= 2.0**-24 * math.log(4.0)  # below the rounded lse's last bit


# --- _expected_score: rows' sums in float64 ---------------------------------------------------------------


def test_expected_score_sums_the_rows_in_float64() -> None:
    """float32 products, summed over the real queries in float64: one-hot rows read ``scores - lse`` at one key, 1.0
    and 2 ** -30, whose float32 sum would be 1.0; the padding query (large scores) is left out."""
    probs = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float32)[None, None]
    scores = torch.tensor([[1.5, 0.0, 0.0], [0.0, 2.0**-30, 0.0], [0.0, 0.0, 1e6]], dtype=torch.float32)[None, None]
    lse = torch.tensor([[[0.5, 0.0, 0.0]]], dtype=torch.float32)  # (1, 1, 3), rounded as _log_normalizer gives it
    weights = build_weights(torch.tensor([[-1, -1, -1]]), torch.tensor([2]), N, torch.float32)
    out = _expected_score(probs, scores, lse, weights)
    assert (out.dtype, tuple(out.shape)) == (torch.float64, (1, 1))
    assert float(out[0, 0]) == 1.0 + 2.0**-30
    assert float(torch.tensor([1.0, 2.0**-30]).sum()) == 1.0  # what float32 would have kept


# --- _offset_sums / _skewed_sums: the skewed copy ---------------------------------------------------------


def test_a_sorted_batch_with_ties_takes_the_skewed_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches come sorted by decreasing length, equal lengths side by side (``_batches``): such a batch, whose key
    padding holds no mass, is summed by one skewed copy, not row by row; its features are the cell reference's."""
    monkeypatch.setattr(features_module, "GPU_BRANCHES_ON_CPU", True)
    calls: list[list[int]] = []
    original = features_module._skewed_sums

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(list(args[1]))  # type: ignore[call-overload]
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(features_module, "_skewed_sums", counted)
    for groups in (
        [[CLS, -1, PERIOD, -1, SEP], [CLS, COMMA, -1, -1, SEP]],  # two of 5 tokens
        [[CLS, -1, -1, -1, SEP], [CLS, -1, COMMA, -1, SEP], [CLS, -1, SEP]],  # 5, 5, 3
    ):
        calls.clear()
        probs, _, key_groups, lengths = masked_batch(groups, heads=2, seed=len(groups))
        out = reduce_attention(probs, None, build_weights(key_groups, lengths, N, torch.float64))
        assert calls == [[len(g) for g in groups]], groups
        assert_matches_reference(out, probs, groups, N, entropy=False)


def test_skewed_sums_copies_a_chunk_of_maps_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Five float64 maps of T = 12 (R = 49) with a budget of two maps a copy: three strided copies (2, 2, 1 maps),
    each map copied once; the sums are the maps' own (np.trace)."""
    monkeypatch.setattr(features_module, "_CACHE_BYTES", 2 * 12 * 49 * 8)
    copies: list[int] = []
    original = torch.Tensor.copy_

    def counted(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        copies.append(int(self.shape[0]))
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    maps = torch.rand(5, 12, 12, generator=torch.Generator().manual_seed(21), dtype=torch.float64)
    maps[3:, :, 10:] = 0  # the last two samples: 10 real tokens
    lengths = [12, 12, 12, 10, 10]
    monkeypatch.setattr(torch.Tensor, "copy_", counted)
    sums = _skewed_sums(maps, lengths, 1, torch.float64, {})
    monkeypatch.undo()
    assert copies == [2, 2, 1]
    np.testing.assert_allclose(sums.numpy(), offset_sums_reference(maps, lengths, 1), rtol=1e-12, atol=1e-12)


def test_skewed_sums_ascending_copies_past_the_first_keep_later_samples_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One-head maps, two a copy (T = 8: R = 17), lengths 5, 8, 8, 8 (ascending): the second copy holds two 8-token
    maps, whose rows 5..7 are real; the 5-token sample's rows past its end are left out of its own map alone."""
    monkeypatch.setattr(features_module, "_CACHE_BYTES", 2 * 8 * 17 * 8)
    maps = torch.rand(4, 8, 8, generator=torch.Generator().manual_seed(22), dtype=torch.float64)
    maps[0, :, 5:] = 0  # the 5-token sample's padding keys hold no mass (its padding queries do)
    lengths = [5, 8, 8, 8]
    scratch: dict[tuple[int, ...], torch.Tensor] = {}
    sums = _skewed_sums(maps, lengths, 1, torch.float64, scratch)
    assert list(scratch) == [(2, 8, 17, -1)]
    np.testing.assert_allclose(sums.numpy(), offset_sums_reference(maps, lengths, 1), rtol=1e-12, atol=1e-12)
