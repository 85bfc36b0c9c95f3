"""The fused CPU kernel's statistics (:class:`ingest.kernels.WindowSums`), pattern accumulators
(:class:`ingest.fused.Cells`, SPEC 10's masses in the attention's pass) and pooled example map, against dense float64
references written here, with every map's rows in one block and in blocks of a few rows, its keys in one tile and in
tiles of a few keys (the block's edges: a causal block's last key, the window of a padded row, a row allowing no
key)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from ingest import fused, kernels

pytestmark = pytest.mark.skipif(fused.unavailable() is not None, reason="no compiler for the fused kernel")


def padded_mask(batch: int, length: int) -> torch.Tensor:
    """``(batch, 1, T, T)`` bool as sdpa_mask builds a padded causal batch: sample 0 whole, sample 1 right-padded
    (each row's allowed keys one run: the kernel's window path), sample 2 left-padded (its first rows allow no key)."""
    position = torch.arange(length)
    causal = position[None, :] <= position[:, None]
    runs = [causal, causal & (position[None, :] < length - 9), causal & (position[None, :] >= 5)]
    return torch.stack(runs[:batch])[:, None]


def dense(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, mask: torch.Tensor | None,
          softcap: float | None = None) -> torch.Tensor:  # fmt: skip
    """Every map's probabilities ``(batch, head, Tq, Tk)`` in float64 (soft-capped as Gemma-2 caps them)."""
    k = k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = q.double() @ k.transpose(-1, -2) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1)


def window_sums(probs: torch.Tensor, lengths: torch.Tensor, windows: int,
                specials: kernels.Specials | None = None, group_count: int = 0) -> list[torch.Tensor]:  # fmt: skip
    """What a map's statistics are, summed cell by cell over the float64 maps ``(batch, head, T, T)``: per map its
    windows, self, previous, next and distance ``(maps, N + 4)`` over the real cells (a cell at distance d of a sample
    of L real tokens lies in window ``min(d N // L, N - 1)``, or self where d = 0), the entropy, and with special keys
    their part of the windows and self ``(maps, N + 1)``, their mass by group ``(maps, G)`` and [SEP] to [SEP]."""
    batch, heads = probs.shape[:2]
    sums = torch.zeros(batch, heads, windows + 4, dtype=torch.float64)
    special = torch.zeros(batch, heads, windows + 1, dtype=torch.float64)
    groups = torch.zeros(batch, heads, group_count, dtype=torch.float64)
    entropy, seps = torch.zeros(batch, heads, dtype=torch.float64), torch.zeros(batch, heads, dtype=torch.float64)
    for b in range(batch):
        real = int(lengths[b])
        rows = probs[b, :, :real, :real]  # (head, L, L): real rows, real keys
        position = torch.arange(real)
        offset = position[None, :] - position[:, None]  # t - s
        distance = offset.abs()
        window = torch.where(distance == 0, windows, torch.clamp(distance * windows // real, max=windows - 1))
        for g in range(windows + 1):
            sums[b, :, g] = rows[:, window == g].sum(-1)
        sums[b, :, windows + 1] = rows[:, offset == -1].sum(-1)
        sums[b, :, windows + 2] = rows[:, offset == 1].sum(-1)
        sums[b, :, windows + 3] = (rows * distance).sum((-1, -2))
        entropy[b] = -(probs[b, :, :real] * probs[b, :, :real].clamp_min(1e-300).log()).sum((-1, -2))
        if specials is None:
            continue
        for j in range(int(specials.counts[b])):
            key = int(specials.positions[b, j])
            column = rows[:, :, key]  # (head, L)
            for g in range(windows + 1):
                special[b, :, g] += column[:, window[:, key] == g].sum(-1)
            if specials.groups is not None and int(specials.groups[b, j]) >= 0:
                groups[b, :, int(specials.groups[b, j])] += column.sum(-1)
            if specials.slot_sep[b, j]:
                seps[b] += column[:, specials.query_sep[b, :real]].sum(-1)
    maps = batch * heads
    return [sums.view(maps, -1), entropy.view(maps), special.view(maps, -1), groups.view(maps, -1), seps.view(maps)]


@pytest.fixture(params=["one block, one tile", "one block, tiles of 16 keys", "blocks of 5 rows, tiles of 7 keys",
                        "blocks of 1 row, tiles of 1 key"])  # fmt: skip
def blocks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each map's query rows in one block (the sizes these tests use are far below a block), or in blocks of a few;
    each block's keys in one tile, or in tiles of a few (the online rescaling of the output, each tile's exps rescaled
    to the row's largest score where the statistics read them; a causal or padded row's tiles past its last key)."""
    rows, keys = request.param.split(", ")
    if rows != "one block":
        monkeypatch.setattr(fused, "BLOCK_BYTES", 0)
        monkeypatch.setattr(fused, "MIN_BLOCK_ROWS", int(rows.split()[2]))
    monkeypatch.setattr(fused, "TILE_KEYS", 1 << 20 if keys == "one tile" else int(keys.split()[2]))


@dataclasses.dataclass(frozen=True)
class Layout:
    lay: Callable[[torch.Tensor], torch.Tensor]  # the same values in this layout
    copied: bool  # whether the kernel copies the key/value rows


@pytest.fixture(params=["contiguous", "model layout", "model layout, copied"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Layout:
    """q, k and v as made (each head's rows contiguous), or as a model hands them over (``(batch, T, head, d)``
    transposed: each head's rows strided), the key/value rows read where they are or copied into contiguous rows first
    (:func:`ingest.fused.copies_kv`, whatever the reads)."""
    if request.param == "contiguous":
        return Layout(lambda x: x, copied=False)
    copied = request.param.endswith("copied")
    monkeypatch.setattr(fused, "KV_COPY_READS", 0 if copied else 1 << 30)
    return Layout(lambda x: x.transpose(1, 2).contiguous().transpose(1, 2), copied=copied)


@pytest.mark.parametrize("length", [29, 150])  # 150: a row's passes by several vectors at once, and their tails
@pytest.mark.parametrize("form", ["causal", "masked", "padded", "plain"])
def test_statistics_equal_the_dense_maps_sums(form: str, length: int, blocks: None, layout: Layout) -> None:
    """Windows, self, neighbours and distance, entropy, the special keys' windows, groups and [SEP] to [SEP], and the
    pooled example, from the float64 maps."""
    torch.manual_seed(5)
    batch, heads, kv_heads, dim = 3, 4, 2, 8
    q, k, v = torch.randn(batch, heads, length, dim), *torch.randn(2, batch, kv_heads, length, dim)
    q, k, v = map(layout.lay, (q, k, v))
    assert fused.copies_kv(q, k, v, fused.block_rows(length, length, dim)) is layout.copied
    mask = {"masked": (torch.rand(batch, 1, length, length) < 0.7) | torch.eye(length, dtype=torch.bool),
            "padded": padded_mask(batch, length)}.get(form)  # fmt: skip
    lengths = torch.tensor([length, length - 9, length])  # real tokens: sample 1 is right-padded
    # used slots first, not in key order (the kernel walks them in key order); a key in two slots counts twice
    positions = torch.tensor([[length - 1, 0, 4, 4], [0, length - 10, 0, 0], [2, 0, 0, 0]])
    counts = torch.tensor([4, 2, 1])
    slot_sep = torch.tensor([[True, False, False, False], [False, True, False, False], [True, False, False, False]])
    groups = torch.tensor([[1, 0, 2, -1], [0, 1, 3, 3], [1, 2, 2, 2]])  # unused slots' groups are not read
    query_sep = torch.zeros(batch, length, dtype=torch.bool)
    query_sep[0, length - 1] = query_sep[1, length - 10] = query_sep[2, 2] = True
    specials = kernels.Specials(positions, counts, slot_sep, query_sep, groups)
    plan = kernels.plan(lengths, length, heads, specials, num_windows=5, group_count=4)
    probs = dense(q, k, 0.5, form == "causal", mask).nan_to_num(1.0 / length)  # (batch, head, T, T)
    want = window_sums(probs, lengths, 5, specials._replace(groups=torch.where(counts[:, None] > torch.arange(4),
                                                                               groups, -1)), 4)  # fmt: skip
    assert all(float(x.abs().sum()) > 0 for x in want)  # every statistic holds mass here
    values = v.double().repeat_interleave(2, 1)
    # With the catalog's example pooled in the same pass (its column bins read a tile as the statistics do), and
    # without: bins that overlap (20 rows to 6, 20 columns to 7), bins of one cell, and few wide bins.
    for row, side in ((1, (6, 7)), (0, (length, length)), (2, (2, 3)), (None, None)):
        example = None if row is None else fused.Example(row, int(lengths[row]), int(lengths[row]), side)
        output, sums = fused.attend(q, k, v, mask, scale=0.5, causal=form == "causal", plan=plan, example=example)
        assert sums is not None
        for name, given, expected in zip(kernels.WindowSums._fields, sums, want, strict=True):
            assert given is not None
            assert given.dtype == torch.float64, name
            atol = length * 4e-6 if name == "entropy" else 1e-5  # a sum of rows
            rtol = 1e-6 if name == "windows" else 0  # the distances' sums run to thousands
            torch.testing.assert_close(given, expected, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(output.double(), (probs @ values).transpose(1, 2), rtol=0, atol=1e-5)
        if example is not None:
            real = int(lengths[row])
            expected_map = torch.nn.functional.adaptive_avg_pool2d(probs[row, :, :real, :real], side)
            assert example.maps is not None
            torch.testing.assert_close(example.maps.double(), expected_map, rtol=0, atol=1e-6)
    # The example without the statistics (as a detection run pools it): each bin's keys summed on their own (75 at
    # 150 tokens: four running sums and a tail).
    example = fused.Example(2, length, length, (2, 2))
    output, _ = fused.attend(q, k, v, mask, scale=0.5, causal=form == "causal", plan=None, example=example)
    assert example.maps is not None
    expected_map = torch.nn.functional.adaptive_avg_pool2d(probs[2], (2, 2))
    torch.testing.assert_close(example.maps.double(), expected_map, rtol=0, atol=1e-6)
    torch.testing.assert_close(output.double(), (probs @ values).transpose(1, 2), rtol=0, atol=1e-5)


@pytest.mark.parametrize("form", ["causal", "padded"])
def test_many_special_keys_a_tile_are_summed_as_a_few_are(form: str, blocks: None) -> None:
    """A special key every third token (a row reads 16 or more of them in one tile where its tile is long: gathered
    and summed by window runs and group weights; fewer one at a time), in several groups and some [SEP], in key order
    in one sample and shuffled in the other, against the cell-by-cell sums."""
    torch.manual_seed(17)
    batch, heads, length, dim = 2, 2, 150, 8
    q, k, v = torch.randn(batch, heads, length, dim), *torch.randn(2, batch, 1, length, dim)
    lengths = torch.tensor([length, length - 9])
    keys = torch.arange(0, length - 9, 3)  # 47 slots, real keys of both samples
    positions = torch.stack([keys, keys[torch.randperm(len(keys))]])
    counts = torch.tensor([len(keys), len(keys) - 5])
    groups = (positions // 3) % 5 - 1  # -1 (none) and 0..3 in turn
    slot_sep = positions % 4 == 0
    query_sep = torch.zeros(batch, length, dtype=torch.bool)
    query_sep[:, keys[keys % 4 == 0]] = True
    specials = kernels.Specials(positions, counts, slot_sep, query_sep, groups)
    plan = kernels.plan(lengths, length, heads, specials, num_windows=6, group_count=4)
    mask = padded_mask(batch, length) if form == "padded" else None
    probs = dense(q, k, 0.5, form == "causal", mask).nan_to_num(1.0 / length)
    used = counts[:, None] > torch.arange(len(keys))
    want = window_sums(probs, lengths, 6, specials._replace(groups=torch.where(used, groups, -1)), 4)
    _, sums = fused.attend(q, k, v, mask, scale=0.5, causal=form == "causal", plan=plan)
    assert sums is not None
    for name, given, expected in zip(kernels.WindowSums._fields, sums, want, strict=True):
        assert given is not None
        atol = length * 4e-6 if name == "entropy" else 1e-5
        torch.testing.assert_close(given, expected, rtol=1e-6, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("windows", [1, 2, 7, 40])  # 40 > the 23 real tokens: windows no distance falls in
def test_every_window_count_splits_the_distances_as_the_features_do(windows: int, blocks: None) -> None:
    """A window holds the distances d with ``min(d N // L, N - 1)`` its index: with one window, with a few, and with
    more windows than real tokens (some hold no distance), on a causal and a plain right-padded batch."""
    torch.manual_seed(11)
    batch, heads, length, dim = 2, 2, 30, 8
    q, k, v = torch.randn(batch, heads, length, dim), *torch.randn(2, batch, heads, length, dim)
    lengths = torch.tensor([length, 23])
    plan = kernels.plan(lengths, length, heads, num_windows=windows)
    for causal in (True, False):
        probs = dense(q, k, 0.4, causal, None)
        output, sums = fused.attend(q, k, v, None, scale=0.4, causal=causal, plan=plan)
        assert sums is not None
        assert (sums.special_windows, sums.special_groups, sums.sep_to_sep) == (None, None, None)
        want = window_sums(probs, lengths, windows)
        torch.testing.assert_close(sums.windows, want[0], rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(sums.entropy, want[1], rtol=0, atol=length * 4e-6)


def test_a_plan_without_windows_is_refused_before_any_compute() -> None:
    """The kernel sums each map by window: a plan made without them is named, not summed some other way."""
    q = torch.randn(1, 2, 8, 4)
    plan = kernels.plan(torch.tensor([8]), 8, 2)
    with pytest.raises(ValueError, match="num_windows"):
        fused.attend(q, q, q, None, scale=0.5, plan=plan)


@pytest.mark.parametrize("threads", [2, 3])
def test_torchs_threads_compute_every_map_as_one_thread_does(threads: int) -> None:
    """With several threads a call's maps go to torch's own (its OpenMP team), a few at a time as each frees up: each
    map is still computed whole by one of them, so the output, every statistic and the example are the same bits as on
    one thread, with more threads than cores too, and match the maps."""
    torch.manual_seed(7)
    batch, heads, length, dim = 3, 4, 40, 8
    q, k, v = torch.randn(batch, heads, length, dim), *torch.randn(2, batch, 2, length, dim)
    slots = torch.tensor([[0, 9]] * batch), torch.tensor([2] * batch), torch.tensor([[False, True]] * batch)
    specials = kernels.Specials(*slots, torch.zeros(batch, length, dtype=torch.bool), torch.tensor([[0, 1]] * batch))
    plan = kernels.plan(torch.full((batch,), length), length, heads, specials, num_windows=6)
    previous = torch.get_num_threads()
    runs = []
    try:
        for count in (1, threads):
            torch.set_num_threads(count)
            example = fused.Example(1, length, length, (4, 5))
            output, sums = fused.attend(q, k, v, None, scale=0.3, causal=True, plan=plan, example=example)
            assert sums is not None
            runs.append([output, *sums, example.maps])
    finally:
        torch.set_num_threads(previous)
    for one, several in zip(*runs, strict=True):
        assert torch.equal(one, several)
    probs = dense(q, k, 0.3, True, None)
    torch.testing.assert_close(runs[1][0].double(), (probs @ v.double().repeat_interleave(2, 1)).transpose(1, 2),
                               rtol=0, atol=1e-5)  # fmt: skip


def test_a_rows_largest_score_is_found_exactly_among_large_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scores in the thousands (whole numbers, exact in float32): exps taken from less than a row's largest score
    overflow, so the output and statistics match the maps only where every row's largest is found, in each running
    maximum and the tail of its pass (150 keys a tile: two rounds of four vectors, a vector, the last keys)."""
    monkeypatch.setattr(fused, "TILE_KEYS", 1 << 20)
    generator = torch.Generator().manual_seed(13)
    batch, heads, length, dim = 2, 3, 150, 8
    q = torch.randint(-40, 41, (batch, heads, length, dim), generator=generator).float()
    k, v = torch.randint(-8, 9, (2, batch, heads, length, dim), generator=generator).float()
    top = (q @ k.transpose(-1, -2)).topk(2).values
    assert ((top[..., 0] - top[..., 1]) > 100).float().mean() > 0.2  # exp(100) overflows float32
    probs = dense(q, k, 1.0, False, None)
    plan = kernels.plan(torch.full((batch,), length), length, heads, num_windows=16)
    output, sums = fused.attend(q, k, v, None, scale=1.0, causal=False, plan=plan)
    assert sums is not None
    torch.testing.assert_close(output.double(), (probs @ v.double()).transpose(1, 2), rtol=0, atol=1e-5)
    want = window_sums(probs, torch.full((batch,), length), 16)
    torch.testing.assert_close(sums.windows, want[0], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("form", ["causal", "masked", "padded", "plain"])
def test_cell_masses_equal_the_dense_maps_sums(form: str, blocks: None, layout: Layout) -> None:
    torch.manual_seed(3)
    batch, heads, kv_heads, length, dim = 3, 4, 2, 37, 8
    q, k, v = torch.randn(batch, heads, length, dim), *torch.randn(2, batch, kv_heads, length, dim)
    q, k, v = map(layout.lay, (q, k, v))
    assert fused.copies_kv(q, k, v, fused.block_rows(length, length, dim)) is layout.copied
    mask = None
    if form == "masked":
        mask = (torch.rand(batch, 1, length, length) < 0.7) | torch.eye(length, dtype=torch.bool)
    if form == "padded":
        mask = padded_mask(batch, length)
    masks = torch.rand(length, length, 3) < 0.25
    whole = torch.arange(length) % 3 != 0
    cells = fused.Cells.from_masks(masks, whole=whole)
    assert cells.count == 4
    output, masses = fused.attend_cells(q, k, v, mask, scale=0.5, causal=form == "causal", cells=cells)
    probs = dense(q, k, 0.5, form == "causal", mask).nan_to_num(1.0 / length)  # a row allowing no key: eager's uniform
    want = torch.stack(
        [(probs * masks[..., c]).sum((-1, -2)) for c in range(3)] + [probs[:, :, whole].sum((-1, -2))], -1
    )
    assert masses.shape == (batch, heads, 4)
    assert masses.dtype == torch.float64
    torch.testing.assert_close(masses, want, rtol=0, atol=1e-5)
    values = v.double().repeat_interleave(2, 1)
    torch.testing.assert_close(output.double(), (probs @ values).transpose(1, 2), rtol=0, atol=1e-5)
    reference, _ = fused.attend(q, k, v, mask, scale=0.5, causal=form == "causal")
    torch.testing.assert_close(output, reference, rtol=0, atol=0)  # the accumulators do not change the output


def test_cells_beyond_the_keys_are_refused() -> None:
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    wide = fused.Cells.from_masks(torch.zeros(5, 6, 1, dtype=torch.bool).index_fill_(1, torch.tensor([5]), True))
    with pytest.raises(ValueError, match="beyond the 5 keys"):
        fused.attend_cells(q, k, k, None, scale=1.0, cells=wide)
    with pytest.raises(ValueError, match="for 4 query rows, not 5"):
        fused.attend_cells(
            q, k, k, None, scale=1.0, cells=fused.Cells.from_masks(torch.ones(4, 5, 1, dtype=torch.bool))
        )


def test_cells_the_kernel_would_misread_are_refused_by_name() -> None:
    """The kernel reads the cells through bare pointers: their type and their row pointers are checked first."""
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    cells = fused.Cells.from_masks(torch.eye(5, dtype=torch.bool)[:, :, None])
    narrow = dataclasses.replace(cells, keys=cells.keys.int())
    with pytest.raises(ValueError, match="reads a contiguous CPU torch.int64 here, not torch.int32"):
        fused.attend_cells(q, k, k, None, scale=1.0, cells=narrow)
    short = dataclasses.replace(cells, rows=cells.rows.clone().index_fill_(0, torch.tensor([5]), 4))
    with pytest.raises(ValueError, match="row pointers do not rise from 0 to their 5 entries"):
        fused.attend_cells(q, k, k, None, scale=1.0, cells=short)
    falling = dataclasses.replace(cells, rows=torch.tensor([0, 2, 1, 3, 4, 5]))
    with pytest.raises(ValueError, match="row pointers"):
        fused.attend_cells(q, k, k, None, scale=1.0, cells=falling)
    below = dataclasses.replace(cells, keys=cells.keys.clone().index_fill_(0, torch.tensor([0]), -2))
    with pytest.raises(ValueError, match="key is below -1"):
        fused.attend_cells(q, k, k, None, scale=1.0, cells=below)
    output, masses = fused.attend_cells(q, k, k, None, scale=1.0, cells=cells)  # the cells as made: read
    assert masses.shape == (1, 2, 1)


@pytest.mark.parametrize("form", ["causal", "masked", "padded", "plain"])
def test_the_pooled_example_equals_the_whole_map_pooled(form: str, blocks: None) -> None:
    """Pooled afterwards a bin of rows at a time (pooled_example, the Triton path's) and in the kernel's own pass
    (Example), both against the whole float64 map pooled."""
    torch.manual_seed(4)
    q, k = torch.randn(3, 4, 77, 8), torch.randn(3, 2, 77, 8)
    mask = (torch.rand(3, 1, 77, 77) < 0.8) | torch.eye(77, dtype=torch.bool) if form == "masked" else None
    mask = padded_mask(3, 77) if form == "padded" else mask
    call = SimpleNamespace(query=q, key=k, mask=mask, causal=form == "causal", scale=0.4, softcap=None)
    for row in (1, 2):
        whole = dense(q, k, 0.4, form == "causal", mask)[row].nan_to_num(1.0 / 77)  # (head, T, T)
        for rows, columns, side in ((77, 77, (32, 32)), (70, 60, (32, 17)), (20, 20, (20, 20))):
            want = torch.nn.functional.adaptive_avg_pool2d(whole[None, :, :rows, :columns], side)[0]
            got = fused.pooled_example(call, row, rows, columns, side)
            torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
            example = fused.Example(row, rows, columns, side)
            fused.attend(q, k, k, mask, scale=0.4, causal=form == "causal", example=example)
            assert example.maps is not None
            assert example.maps.dtype == torch.float32
            torch.testing.assert_close(example.maps.double(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("form", ["masked", "padded", "plain"])
def test_soft_capped_scores_over_more_keys_than_queries(form: str, blocks: None) -> None:
    """Gemma-2's soft-capping (scaled, then capped, then masked, as eager does it) with more keys than queries (a
    decoder reading an encoder's keys): the output against the float64 maps, in every block and tile size."""
    torch.manual_seed(6)
    q, k, v = torch.randn(3, 4, 13, 8) * 3, torch.randn(3, 2, 29, 8) * 3, torch.randn(3, 2, 29, 8)
    position = torch.arange(29)
    runs = torch.stack([position < 29, position < 20, position >= 5])[:, None, None].expand(3, 1, 13, 29)
    mask = {"masked": (torch.rand(3, 1, 13, 29) < 0.6) | (position == 3), "padded": runs}.get(form)
    probs = dense(q, k, 0.7, False, mask, softcap=5.0)
    output, _ = fused.attend(q, k, v, mask, scale=0.7, softcap=5.0)
    want = (probs @ v.double().repeat_interleave(2, 1)).transpose(1, 2)
    torch.testing.assert_close(output.double(), want, rtol=0, atol=1e-5)


def test_key_value_rows_are_copied_where_strided_and_read_often() -> None:
    """A model's layout (each head's rows strided) at 4k tokens, 4 query heads a key/value head: 32 blocks x 4 reads,
    copied; at 384 tokens with a key/value head a query head (MiniLM): 3 reads, read in place; contiguous rows: read
    in place. At the bound (KV_COPY_READS reads exactly) copied, one fewer not."""

    def model(batch: int, heads: int, length: int, dim: int) -> torch.Tensor:
        return torch.empty(batch, length, heads, dim).transpose(1, 2)

    q, kv = model(1, 8, 4096, 64), model(1, 2, 4096, 64)
    assert fused.copies_kv(q, kv, kv, fused.block_rows(4096, 4096, 64))
    assert not fused.copies_kv(q, kv.contiguous(), kv.contiguous(), fused.block_rows(4096, 4096, 64))
    assert fused.copies_kv(q, kv.contiguous(), kv, fused.block_rows(4096, 4096, 64))  # values strided alone: copied
    q, kv = model(32, 12, 384, 32), model(32, 12, 384, 32)
    assert not fused.copies_kv(q, kv, kv, fused.block_rows(384, 384, 32))
    q, kv = model(1, 8, 100, 8), model(1, 2, 100, 8)
    assert fused.copies_kv(q, kv, kv, -(-100 // (fused.KV_COPY_READS // 4)))  # 8 blocks x 4 heads: at the bound
    assert not fused.copies_kv(q, kv, kv, -(-100 // (fused.KV_COPY_READS // 4 - 1)))  # 7 blocks x 4 heads


def test_a_maps_rows_go_in_blocks_of_even_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """256 KiB of scores and at least 2 rows a float of the heads' vectors, up to 128 (MIN_BLOCK_ROWS where set), a
    block, then as many blocks cut evenly."""
    assert fused.block_rows(512, 512, 64) == 128  # 256 KiB of 512 scores
    assert fused.block_rows(512, 512, 32) == 128  # the bytes, above 64 rows
    assert fused.block_rows(384, 384, 64) == 128  # 170 rows of 384 scores: 3 blocks, of 128 (not 170, 170 and 44)
    assert fused.block_rows(16384, 16384, 64) == 128  # 4 rows of 256 KiB: at least 2 x 64
    assert fused.block_rows(4096, 4096, 32) == 64  # at least 2 x 32
    assert fused.block_rows(4096, 4096, 128) == 128  # 2 x 128, held to 128
    assert fused.block_rows(252, 4096, 63) == 126  # 2 x 63: two blocks
    assert fused.block_rows(300, 300, 64) == 150  # 218 rows: 2 blocks
    assert fused.block_rows(29, 29, 64) == 29  # one block
    monkeypatch.setattr(fused, "BLOCK_BYTES", 0)
    assert fused.block_rows(4096, 4096, 1) == 2  # heads of 1: 2 rows
    monkeypatch.setattr(fused, "MIN_BLOCK_ROWS", 5)
    assert [fused.block_rows(rows, 29, 64) for rows in (29, 7, 5, 1)] == [5, 4, 5, 1]
    monkeypatch.setattr(fused, "MIN_BLOCK_ROWS", 256)  # set: the least, above 128 too
    assert fused.block_rows(4096, 4096, 64) == 256


def test_a_blocks_keys_go_in_tiles_of_its_bytes() -> None:
    """A tile of a block's scores is 256 KiB: 512 keys for the 128 rows of a long map's block of heads of 64, the whole
    map's keys at 384 tokens (3 blocks of 128 rows) and below."""
    assert fused.tile_keys(128) == 512
    assert fused.tile_keys(fused.block_rows(16384, 16384, 64)) == 512
    assert fused.tile_keys(fused.block_rows(384, 384, 64)) >= 384
    assert fused.tile_keys(fused.block_rows(29, 29, 64)) >= 29
    assert fused.tile_keys(1 << 20) == 1  # at least one key
