"""Features: the per-batch weights of the reduction, by hand (SPEC sections 1 and 6).

What the weights hold beyond the features they give: W_L's rows past the sample's length, the special keys'
slots in position order past the lengths a small sort keeps in order anyway, narrow integer groups widened to
long, the GPU's special-keys matrix in the weights' dtype and built once a batch, and the divisors of samples
that lack what a feature divides by (0 there, never 1). As in ``test_features_contract.py``, PyTorch's ``meta``
device stands in for a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ingest import features as features_module
from ingest.features import build_cross_weights, build_weights, offset_weights, reduce_attention
from ingest.types import SPECIAL_GROUPS

CLS, SEP, PERIOD, COMMA = (SPECIAL_GROUPS.index(group) for group in ("cls", "sep", "period", "comma"))
N = 4


def padded(rows: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([row + [-1] * (width - len(row)) for row in rows])


def test_offset_weights_are_zero_from_the_samples_length_on() -> None:
    """W_L of L = 3 in maps of T = 5, N = 4: row T - 1 + o holds offset o's columns w0..w3, self, previous, next,
    distance; |o| = 1 is window floor(4 / 3) = 1, |o| = 2 window floor(8 / 3) = 2, and |o| >= L = 3 (no real cell
    of the sample has it) is all zero, |o| = L included."""
    zero = [0.0] * 8
    expected = [
        zero,  # o = -4
        zero,  # o = -3: |o| = L
        [0, 0, 1, 0, 0, 0, 0, 2],  # o = -2
        [0, 1, 0, 0, 0, 1, 0, 1],  # o = -1: the previous token
        [0, 0, 0, 0, 1, 0, 0, 0],  # o = 0: self
        [0, 1, 0, 0, 0, 0, 1, 1],  # o = 1: the next token
        [0, 0, 1, 0, 0, 0, 0, 2],  # o = 2
        zero,  # o = 3: |o| = L
        zero,  # o = 4
    ]
    got = offset_weights(3, 5, N, torch.float64, torch.device("cpu"))
    assert got.dtype == torch.float64
    assert got.tolist() == expected


# Two samples of 20 and 18 tokens with many special keys (T = 20: a sort of 20 keys, past the 16 that an
# insertion sort keeps in order whether asked to be stable or not); the second one's padding holds groups.
LONG = [CLS, -1, PERIOD, COMMA, -1, PERIOD, -1, -1, COMMA, PERIOD, -1, COMMA, -1, -1, PERIOD, -1, COMMA, -1, -1, SEP]
SHORT = [CLS, COMMA, -1, PERIOD, -1, -1, COMMA, -1, PERIOD, -1, PERIOD, -1, -1, COMMA, -1, -1, -1, SEP, SEP, SEP]


def test_special_keys_are_in_position_order_in_long_samples() -> None:
    """The special keys' slots in increasing position, then 0 (positions) and -1 (groups) in unused slots."""
    weights = build_weights(torch.tensor([LONG, SHORT]), torch.tensor([20, 18]), N, torch.float64)
    long_positions = [0, 2, 3, 5, 8, 9, 11, 14, 16, 19]
    short_positions = [0, 1, 3, 6, 8, 10, 13, 17]
    assert weights.special_index[:, 0, 0, :].tolist() == [long_positions, short_positions + [0, 0]]
    assert weights.special_counts.tolist() == [10, 8]
    assert weights.slot_groups.tolist() == [
        [CLS, PERIOD, COMMA, PERIOD, COMMA, PERIOD, COMMA, PERIOD, COMMA, SEP],
        [CLS, COMMA, PERIOD, COMMA, PERIOD, PERIOD, COMMA, SEP, -1, -1],
    ]


def test_narrow_integer_groups_and_lengths_are_widened_to_long() -> None:
    """int32 groups and lengths (as a caller's table might give them) make the weights of the same long inputs:
    long slots and groups, and the same features from the CPU's compiled pass."""
    groups = [[CLS, -1, PERIOD, -1, SEP], [CLS, COMMA, SEP]]
    key_groups, lengths = padded(groups, 5), torch.tensor([5, 3])
    wide = build_weights(key_groups, lengths, N, torch.float64)
    narrow = build_weights(key_groups.int(), lengths.int(), N, torch.float64)
    for name in ("special_index", "special_counts", "slot_groups"):
        assert getattr(narrow, name).dtype == torch.long, name
        assert torch.equal(getattr(narrow, name), getattr(wide, name)), name
    generator = torch.Generator().manual_seed(21)
    scores = torch.randn(2, 2, 5, 5, generator=generator, dtype=torch.float64)
    padding = torch.arange(5)[None, :] >= lengths[:, None]  # (batch, T) keys
    probs = scores.masked_fill(padding[:, None, None, :], -torch.inf).softmax(-1)
    assert torch.equal(reduce_attention(probs, None, narrow), reduce_attention(probs, None, wide))


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [(torch.float64, torch.float64), (torch.float32, torch.float32), (torch.float16, torch.float32)],
)
def test_special_matrix_off_the_cpu_is_in_the_weights_summing_dtype(dtype: torch.dtype, expected: torch.dtype) -> None:
    """Built with the weights where the maps are (meta), in the dtype the sums are taken in: the weights' own,
    float32 for half precision; (batch, T * J, N + 6)."""
    key_groups = padded([[CLS, -1, PERIOD, -1, SEP], [CLS, COMMA, SEP]], 5)
    weights = build_weights(key_groups, torch.tensor([5, 3]), N, dtype, device="meta")
    matrix = weights.special_matrix
    assert matrix is not None
    assert (matrix.device.type, matrix.dtype, tuple(matrix.shape)) == ("meta", expected, (2, 5 * 3, N + 6))


def test_special_matrix_off_the_cpu_is_built_once_a_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the CPU (meta) the special keys' matrix is built with the batch's weights and every layer's reduction
    takes it from there: two layers, no other build."""
    calls: list[int] = []
    original = features_module._special_matrix

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(features_module, "_special_matrix", counted)
    key_groups = torch.tensor([[CLS, -1, PERIOD, -1, SEP], [CLS, COMMA, -1, -1, SEP]])  # no padding to check
    weights = build_weights(key_groups, torch.tensor([5, 5]), N, torch.float64, device="meta")
    assert calls == [1]
    for _ in range(2):
        out = reduce_attention(torch.empty(2, 2, 5, 5, dtype=torch.float64, device="meta"), None, weights)
        assert (out.device.type, out.dtype, tuple(out.shape)) == ("meta", torch.float64, (2, 2, N + 10))
    assert calls == [1]


def test_an_empty_sample_has_no_divisors() -> None:
    """A sample with no real token: every divisor's reciprocal is 0 (not 1), beside a 3-token one's 1/L, 1/(L - 1)
    and 1/[SEP] queries."""
    weights = build_weights(padded([[CLS, -1, SEP], []], 3), torch.tensor([3, 0]), N, torch.float64)
    expected = [[1 / 3] * (N + 5) + [1 / 3, 1 / 2, 1 / 2, 1 / 3, 1.0], [0.0] * (N + 10)]
    np.testing.assert_allclose(weights.scale.numpy(), expected, rtol=1e-15, atol=0)
    assert weights.has_sep.tolist() == [True, False]


def test_cross_divisors_are_zero_where_nothing_is_counted() -> None:
    """Cross maps' divisors (SPEC 6): real decoder queries Lq for the features, entropy and distance; the real
    queries whose key s - 1 (s + 1) is a real encoder key for previous (next); the decoder's [SEP] queries for
    sep_to_sep; 0 where a count is 0.

    - Lq = 3 over Lk = 4: previous s = 1, 2; next s = 0, 1, 2; one [SEP] query.
    - Lq = 3 over a single key: previous s = 1 only; no next key; no [SEP] query.
    - no real query over Lk = 2: nothing at all.
    """
    query_groups = padded([[CLS, SEP, -1], [-1, -1, -1], []], 3)
    key_groups = padded([[CLS, -1, SEP, -1], [SEP], [-1, -1]], 4)
    weights = build_cross_weights(query_groups, torch.tensor([3, 3, 0]), key_groups, torch.tensor([4, 1, 2]), N)
    third = 1 / 3
    expected = [
        [third] * (N + 5) + [third, 1 / 2, third, third, 1.0],
        [third] * (N + 5) + [third, 1.0, 0.0, third, 0.0],
        [0.0] * (N + 10),
    ]
    np.testing.assert_allclose(weights.scale.numpy(), expected, rtol=1e-15, atol=0)
    assert weights.has_sep.tolist() == [True, False, False]
