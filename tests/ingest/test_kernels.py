"""The compiled reduction kernel against plain float64 loops over the same cells.

(What the features made from these sums mean is checked against the SPEC's cell-by-cell reference in
test_features.py, on both this kernel and the torch branches.)"""

from __future__ import annotations

import math
import multiprocessing

import numpy as np
import pytest
import torch

from ingest import kernels
from tests.waiting import PATIENCE

HEADS = 2


def loop_reference(probs: np.ndarray, lengths: list[int], specials: kernels.Specials) -> list[np.ndarray]:
    """Offset sums over real rows and keys; -sum A log A over real rows (every key); the used special slots'
    cells by offset and by column, and [SEP] rows' mass on [SEP] slots."""
    count, length, _ = probs.shape
    slots = specials.positions.shape[1]
    sums, entropy, special = np.zeros((count, 2 * length - 1)), np.zeros(count), np.zeros((count, 2 * length - 1))
    columns, seps = np.zeros((count, slots)), np.zeros(count)
    for m, real in enumerate(lengths):
        sample = m // HEADS
        used = int(specials.counts[sample])
        for s in range(real):
            for t in range(real):
                sums[m, length - 1 + t - s] += probs[m, s, t]
            entropy[m] -= sum(a * math.log(a) for a in probs[m, s] if a > 0)
            for j in range(used):
                key = int(specials.positions[sample, j])
                special[m, length - 1 + key - s] += probs[m, s, key]
                columns[m, j] += probs[m, s, key]
                if specials.query_sep[sample, s] and specials.slot_sep[sample, j]:
                    seps[m] += probs[m, s, key]
    return [sums, entropy, special, columns, seps]


def random_maps(lengths: list[int], length: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax maps as a model makes them (padding keys masked to finfo.min, so 0), garbage in the padding
    query rows, which nothing may read; in some rows the diagonal is masked (A[s, s] = 0) or so small that
    the row's log normalizer must be read off its largest key instead."""
    generator = torch.Generator().manual_seed(seed)
    count = len(lengths)
    scores = 4 * torch.randn(count, length, length, generator=generator, dtype=torch.float64)
    low = torch.finfo(dtype).min
    for m, real in enumerate(lengths):
        scores[m, :, real:] = low
        if real > 3:
            scores[m, 1, 1] = low  # A[1, 1] == 0
            scores[m, 2, 2] -= 90 if dtype == torch.float32 else 705  # 0 < A[2, 2] < 1024 * tiny
    scores = scores.to(dtype)
    probs = scores.softmax(-1)
    for m, real in enumerate(lengths):
        probs[m, real:] = 1e3  # padding query rows
        scores[m, real:] = float("nan")
    if lengths[0] > 3:
        assert probs[0, 1, 1] == 0
        assert 0 < probs[0, 2, 2] < 1024 * torch.finfo(dtype).tiny
    return probs, scores


def random_specials(lengths: list[int], length: int, seed: int) -> kernels.Specials:
    """Up to 4 special keys a sample among its real keys, some slots unused (garbage positions there)."""
    generator = torch.Generator().manual_seed(seed)
    real = lengths[::HEADS]
    counts = torch.tensor([min(4, value, index + 1) for index, value in enumerate(real)])
    positions = torch.full((len(real), 4), length + 99)  # unused slots: out of range, never read
    for sample, value in enumerate(real):
        positions[sample, : counts[sample]] = torch.randperm(value, generator=generator)[: counts[sample]]
    slot_sep = torch.rand(len(real), 4, generator=generator) < 0.5
    query_sep = (torch.rand(len(real), length, generator=generator) < 0.3) & (
        torch.arange(length) < torch.tensor(real)[:, None]
    )
    return kernels.Specials(positions, counts, slot_sep, query_sep)


@pytest.mark.parametrize("threads", [1, 3])  # 3 threads over 10 maps: parts that split a sample's heads
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_reduce_maps_matches_loops(threads: int, dtype: torch.dtype) -> None:
    lengths = [37, 37, 20, 20, 30, 30, 1, 1, 0, 0]
    probs, scores = random_maps(lengths, 37, dtype, seed=1)
    specials = random_specials(lengths, 37, seed=2)
    assert specials.counts.tolist() == [1, 2, 3, 1, 0]
    assert bool(specials.query_sep.any())
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = kernels.reduce_maps(probs, kernels.plan(torch.tensor(lengths[::HEADS]), 37, HEADS, specials), scores)
        bare = kernels.reduce_maps(probs, kernels.plan(torch.tensor(lengths[::HEADS]), 37, HEADS))
    finally:
        torch.set_num_threads(previous)
    want = loop_reference(probs.double().numpy(), lengths, specials)
    rtol = 1e-12 if dtype == torch.float64 else 2e-6
    assert full.offsets.dtype == dtype
    assert full.special_offsets is not None
    assert full.special_offsets.dtype == dtype
    for name, given, expect in zip(full._fields, full, want, strict=True):
        assert given is not None, name
        # the entropy from the scores against -sum A log A of the rounded maps: equal to the maps' rounding
        tolerance = (1e-10 if dtype == torch.float64 else 1e-5) if name == "entropy" else rtol
        np.testing.assert_allclose(given.double().numpy(), expect, rtol=tolerance, atol=tolerance, err_msg=name)
    assert bare.entropy is None
    assert bare.special_offsets is None
    assert bare.special_columns is None
    assert torch.equal(bare.offsets, full.offsets)  # the same cells in the same order


def test_reduce_maps_of_strided_maps_equal_the_contiguous() -> None:
    lengths = [30, 12]
    probs, scores = random_maps(lengths, 30, torch.float32, seed=2)
    strided = probs.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous()
    plan = kernels.plan(torch.tensor(lengths), 30)
    expect = kernels.reduce_maps(probs, plan, scores)
    given = kernels.reduce_maps(strided, plan, scores)
    assert torch.equal(given.offsets, expect.offsets)
    assert given.entropy is not None
    assert expect.entropy is not None
    assert torch.equal(given.entropy, expect.entropy)


def test_reduce_maps_refuses_what_it_cannot_index() -> None:
    """The kernel has no bounds checks: every index it would follow is checked before it runs."""
    lengths = [4, 4, 3, 3]
    probs, scores = random_maps(lengths, 4, torch.float32, seed=3)
    specials = kernels.Specials(
        torch.tensor([[0, 3], [2, 9]]),
        torch.tensor([2, 1]),
        torch.tensor([[True, False], [True, True]]),
        torch.zeros(2, 4, dtype=torch.bool),
    )
    plan = kernels.plan(torch.tensor([4, 3]), 4, 2, specials)
    kernels.reduce_maps(probs, plan, scores)  # as given, accepted
    # an unused slot's group is not read (made -1), the count is the largest used group's plus one unless given
    grouped = specials._replace(groups=torch.tensor([[0, 1], [2, 7]]))
    assert kernels.plan(torch.tensor([4, 3]), 4, 2, grouped).groups.tolist() == [[0, 1], [2, -1]]
    assert kernels.plan(torch.tensor([4, 3]), 4, 2, grouped).group_count == 3
    assert kernels.plan(torch.tensor([4, 3]), 4, 2, grouped, group_count=4).group_count == 4
    map_cases: list[tuple[dict[str, object], str]] = [
        ({"probs": probs.half()}, "float16"),
        ({"probs": probs[:2]}, r"the plan is for maps of shape \(4, 4, 4\), not \(2, 4, 4\)"),
        ({"scores": scores.double()}, "scores of the maps' shape and dtype"),
        ({"scores": scores[:, :3]}, "scores of the maps' shape and dtype"),
    ]
    for change, message in map_cases:
        arguments = {"probs": probs, "plan": plan, "scores": scores} | change
        with pytest.raises(ValueError, match=message):
            kernels.reduce_maps(**arguments)  # type: ignore[arg-type]
    plan_cases: list[tuple[dict[str, object], str]] = [
        ({"lengths": torch.tensor([5, 3])}, r"one length in 0\.\.4 per sample, not \[5, 3\]"),
        ({"lengths": torch.tensor([[4, 3]])}, r"one length in 0\.\.4 per sample"),
        ({"heads": 0}, "heads must be at least 1, not 0"),
        ({"specials": specials._replace(counts=torch.tensor([3, 1]))}, r"counts must be in 0\.\.2"),
        (
            {"specials": specials._replace(positions=torch.tensor([[0, 4], [2, 9]]))},
            "must be real keys of their sample",
        ),
        (
            {"specials": specials._replace(positions=torch.tensor([[0, 3], [3, 9]]))},
            "must be real keys of their sample",
        ),
        (
            {"specials": specials._replace(positions=torch.tensor([[0, -1], [2, 9]]))},
            "must be real keys of their sample",
        ),
        ({"specials": specials._replace(query_sep=torch.zeros(2, 3, dtype=torch.bool))}, r"query_sep \(samples, T\)"),
        ({"specials": specials._replace(slot_sep=torch.zeros(2, 3, dtype=torch.bool))}, r"slot_sep \(samples, J\)"),
        ({"specials": specials._replace(counts=torch.tensor([2]))}, r"counts \(samples,\)"),
        ({"num_windows": 0}, "num_windows must be at least 1, not 0"),
        ({"specials": specials._replace(groups=torch.tensor([[0, 1]]))}, r"groups need shape \(2, 2\), not \(1, 2\)"),
        ({"specials": specials._replace(groups=torch.tensor([[0, -2], [1, 0]]))}, r"groups must be in -1\.\.1"),
        ({"specials": specials._replace(groups=torch.tensor([[0, 3], [1, 0]])), "group_count": 3}, r"in -1\.\.2"),
    ]
    for change, message in plan_cases:
        arguments = {"lengths": torch.tensor([4, 3]), "length": 4, "heads": 2, "specials": specials} | change
        with pytest.raises(ValueError, match=message):
            kernels.plan(**arguments)  # type: ignore[arg-type]


def _reduce_in_child(queue: multiprocessing.Queue, probs: torch.Tensor, scores: torch.Tensor) -> None:  # type: ignore[type-arg]
    # (the maps come from the parent: torch's own OpenMP ops, softmax here, would hang in a forked child)
    result = kernels.reduce_maps(probs, kernels.plan(torch.tensor([9, 9, 9, 9]), 9), scores)
    queue.put(result.offsets.sum().item())


def test_a_forked_child_reduces_with_threads_of_its_own() -> None:
    """A pool started before a fork has no threads in the child: the child starts its own instead of waiting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        probs, scores = random_maps([9, 9, 9, 9], 9, torch.float64, seed=5)
        expected = kernels.reduce_maps(probs, kernels.plan(torch.tensor([9, 9, 9, 9]), 9), scores)
        assert kernels._pools  # the parent's pool exists before the fork
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        child = context.Process(target=_reduce_in_child, args=(queue, probs, scores))
        child.start()
        child.join(timeout=PATIENCE)  # a deadlock would hang here: bounded (tests.waiting)
        if child.is_alive():
            child.kill()
        assert child.exitcode == 0
        assert queue.get(timeout=PATIENCE) == pytest.approx(expected.offsets.sum().item(), rel=1e-12)
    finally:
        torch.set_num_threads(previous)
