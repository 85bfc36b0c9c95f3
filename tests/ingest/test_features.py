"""Distance features: hand-built maps with known answers, a brute-force SPEC reference, real models."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from ingest import features as features_module
from ingest import kernels
from ingest.corpora import Sample, load_corpus
from ingest.features import (
    FeatureConfig,
    build_weights,
    encode_samples,
    extract_features,
    reduce_attention,
    resolve_special_tokens,
)
from ingest.loading import load_model
from ingest.types import SCALARS, SPECIAL_GROUPS

N = 16
F = N + 5  # distance features; the SCALARS follow them in reduce_attention's output
CLS, SEP, PERIOD, COMMA = (SPECIAL_GROUPS.index(group) for group in ("cls", "sep", "period", "comma"))

# One sample's key groups: [CLS] w w . w , w w [SEP] w w . [SEP]  (L = 13, -1 = ordinary token)
GROUPS = [CLS, -1, -1, PERIOD, -1, COMMA, -1, -1, SEP, -1, -1, PERIOD, SEP]
L = len(GROUPS)


@pytest.fixture(params=["compiled", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each reduction implementation in turn: the CPU's compiled kernel (ingest.kernels), and the torch ops
    the GPU runs (the skewed copy or row loop for the offset sums, one einsum for the entropy's product).
    Gives the list of the kernel's calls, so that a test can check which one it ran."""
    calls: list[int] = []
    original = kernels.reduce_maps

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kernels, "reduce_maps", counted)
    monkeypatch.setattr(features_module, "GPU_BRANCHES_ON_CPU", request.param == "torch")
    return calls


def scalar(values: torch.Tensor, name: str) -> float:
    return float(values[..., F + SCALARS.index(name)])


def reduce_one(matrix: list[list[float]], groups: list[int], *, with_scores: bool = False) -> torch.Tensor:
    """The features of one sample with attention ``matrix`` (every head the same): (F + 5,)."""
    probs = torch.tensor(matrix, dtype=torch.float64)[None, None]  # (1, 1, L, L)
    weights = build_weights(torch.tensor([groups]), torch.tensor([len(groups)]), N, torch.float64)
    scores = probs.log().clamp(min=torch.finfo(torch.float64).min) if with_scores else None
    return reduce_attention(probs, scores, weights)[0, 0]


def reference(matrix: list[list[float]], groups: list[int], num_windows: int = N) -> list[float]:
    """SPEC section 1 for one sample and head, in plain Python loops."""
    length = len(groups)
    features = [0.0] * (num_windows + 5)
    for s in range(length):
        for t in range(length):
            a = matrix[s][t]
            if groups[t] >= 0:  # a special key counts only in its group
                features[num_windows + 1 + groups[t]] += a
            elif s == t:
                features[num_windows] += a
            else:
                d = abs(s - t)
                features[min(num_windows - 1, math.floor(d * num_windows / length))] += a
    features = [value / length for value in features]
    entropy = sum(-a * math.log(a) for row in matrix[:length] for a in row[:length] if a > 0) / length
    previous = sum(matrix[s][s - 1] for s in range(1, length)) / (length - 1)
    following = sum(matrix[s][s + 1] for s in range(length - 1)) / (length - 1)
    distance = sum(matrix[s][t] * abs(s - t) for s in range(length) for t in range(length)) / length
    seps = [s for s in range(length) if groups[s] == SEP]
    sep_to_sep = sum(matrix[s][t] for s in seps for t in seps) / len(seps) if seps else 0.0
    return [*features, entropy, previous, following, distance, sep_to_sep]


def test_head_attending_to_itself() -> None:
    values = reduce_one([[float(s == t) for t in range(L)] for s in range(L)], GROUPS)
    # Special queries attend to themselves, so they count in their own group, not in self.
    assert float(values[N]) == pytest.approx(7 / L)  # 7 ordinary tokens
    assert float(values[N + 1 + CLS]) == pytest.approx(1 / L)
    assert float(values[N + 1 + SEP]) == pytest.approx(2 / L)
    assert float(values[N + 1 + PERIOD]) == pytest.approx(2 / L)
    assert float(values[N + 1 + COMMA]) == pytest.approx(1 / L)
    assert values[:N].abs().max() == 0
    assert scalar(values, "entropy") == pytest.approx(0, abs=1e-12)
    assert scalar(values, "prev_token") == scalar(values, "next_token") == 0
    assert scalar(values, "mean_distance") == 0
    assert scalar(values, "sep_to_sep") == pytest.approx(1)


def test_head_attending_to_cls() -> None:
    values = reduce_one([[float(t == 0) for t in range(L)] for _ in range(L)], GROUPS, with_scores=True)
    assert float(values[N + 1 + CLS]) == pytest.approx(1)
    assert float(values[:F].sum()) == pytest.approx(1)
    assert scalar(values, "entropy") == pytest.approx(0, abs=1e-9)
    assert scalar(values, "prev_token") == pytest.approx(1 / (L - 1))  # only query 1's previous is [CLS]
    assert scalar(values, "mean_distance") == pytest.approx(sum(range(L)) / L)
    assert scalar(values, "sep_to_sep") == 0


def test_uniform_head() -> None:
    values = reduce_one([[1 / L] * L for _ in range(L)], GROUPS, with_scores=True)
    ordinary = [t for t in range(L) if GROUPS[t] < 0]
    for i in range(N):  # window shares, counted cell by cell from the SPEC definition
        cells = sum(1 for s in range(L) for t in ordinary if s != t and min(N - 1, math.floor(abs(s - t) * N / L)) == i)
        assert float(values[i]) == pytest.approx(cells / L / L), f"w{i}"
    assert float(values[N]) == pytest.approx(len(ordinary) / L / L)
    assert float(values[N + 1 + PERIOD]) == pytest.approx(2 / L)  # two period keys, each 1/L of every row
    assert float(values[:F].sum()) == pytest.approx(1)
    assert scalar(values, "entropy") == pytest.approx(math.log(L))
    assert scalar(values, "prev_token") == pytest.approx(1 / L)
    assert scalar(values, "next_token") == pytest.approx(1 / L)
    assert scalar(values, "sep_to_sep") == pytest.approx(2 / L)


def test_previous_and_next_token_heads() -> None:
    previous = reduce_one([[float(t == max(s - 1, 0)) for t in range(L)] for s in range(L)], GROUPS)
    following = reduce_one([[float(t == min(s + 1, L - 1)) for t in range(L)] for s in range(L)], GROUPS)
    assert scalar(previous, "prev_token") == pytest.approx(1)
    assert scalar(previous, "next_token") == 0
    assert scalar(following, "next_token") == pytest.approx(1)
    assert scalar(following, "mean_distance") == pytest.approx((L - 1) / L)
    # Distance 1 is window floor(16 / 13) = 1 for ordinary keys.
    assert float(previous[1]) > 0
    assert float(previous[0]) == 0


def random_batch(
    groups: list[list[int]], heads: int, seed: int, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random attention as a model makes it: key padding masked to finfo.min, query padding garbage."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([len(g) for g in groups])
    length = int(lengths.max())
    key_groups = torch.tensor([g + [-1] * (length - len(g)) for g in groups])  # (batch, T)
    logits = 3 * torch.randn(len(groups), heads, length, length, generator=generator, dtype=dtype)
    key_real = torch.arange(length)[None, :] < lengths[:, None]  # (batch, T)
    scores = logits.masked_fill(~key_real[:, None, None, :], torch.finfo(dtype).min)
    return scores.softmax(-1), scores, key_groups, lengths


def random_groups(rng: random.Random, length: int) -> list[int]:
    middle = [rng.choice([-1, -1, -1, -1, PERIOD, COMMA, SEP]) for _ in range(length - 2)]
    return [CLS, *middle, SEP]


@pytest.mark.parametrize("strided", [False, True])  # non-contiguous maps: the special keys are gathered, not selected
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("with_scores", [True, False])
@pytest.mark.parametrize("num_windows", [16, 3])
def test_fast_path_matches_brute_force_reference(
    with_scores: bool, num_windows: int, batched: bool, strided: bool, path: list[int]
) -> None:
    rng = random.Random(num_windows)
    groups = [random_groups(rng, length) for length in (5, 17, 17, 40, 33, 33, 33, 2)]
    probs, scores, key_groups, lengths = random_batch(groups, heads=3, seed=1)
    if strided:  # the same values, keys along a strided axis
        probs = probs.transpose(2, 3).contiguous().transpose(2, 3)
        assert not probs.is_contiguous()
    weights = build_weights(key_groups, lengths, num_windows, torch.float64, batched=batched)
    assert len(weights.runs) == 5
    assert (weights.per_sample is not None) == batched
    fast = reduce_attention(probs, scores if with_scores else None, weights)  # (batch, head, F)
    for b, sample_groups in enumerate(groups):
        for h in range(3):
            expected = reference(probs[b, h].tolist(), sample_groups, num_windows)
            assert fast[b, h].tolist() == pytest.approx(expected, rel=1e-9, abs=1e-9), (b, h)
    compiled = not batched and not features_module.GPU_BRANCHES_ON_CPU  # the batched product has no offset sums
    assert bool(path) == compiled


def test_float32_fast_path_and_sum_to_one() -> None:
    rng = random.Random(3)
    groups = [random_groups(rng, length) for length in (128, 64, 9)]
    probs, scores, key_groups, lengths = random_batch(groups, heads=4, seed=2, dtype=torch.float32)
    weights = build_weights(key_groups, lengths, N, torch.float32)
    fast = reduce_attention(probs, scores, weights)
    assert fast[..., :F].sum(-1).numpy() == pytest.approx(1, abs=1e-5)
    exact = reduce_attention(probs.double(), scores.double(), build_weights(key_groups, lengths, N, torch.float64))
    assert fast.numpy() == pytest.approx(exact.numpy(), rel=1e-4, abs=1e-5)


def test_padding_does_not_change_a_sample() -> None:
    rng = random.Random(4)
    groups = [random_groups(rng, 11), random_groups(rng, 30)]
    probs, scores, key_groups, lengths = random_batch(groups, heads=2, seed=5)
    batched = reduce_attention(probs, scores, build_weights(key_groups, lengths, N, torch.float64))
    alone_weights = build_weights(key_groups[:1, :11], lengths[:1], N, torch.float64)
    alone = reduce_attention(probs[:1, :, :11, :11], scores[:1, :, :11, :11], alone_weights)
    assert batched[0].numpy() == pytest.approx(alone[0].numpy(), rel=1e-12, abs=1e-12)


def test_sep_to_sep_is_undefined_without_sep() -> None:
    probs, scores, key_groups, lengths = random_batch([[CLS, -1, -1, PERIOD]], heads=1, seed=6)
    weights = build_weights(key_groups, lengths, N, torch.float64)
    assert not bool(weights.has_sep[0])
    assert scalar(reduce_attention(probs, scores, weights)[0, 0], "sep_to_sep") == 0


def test_config_round_trips_and_validates() -> None:
    config = FeatureConfig(num_windows=8, samples=10)
    assert FeatureConfig(**config.to_json()) == config
    assert config.num_features == 13
    with pytest.raises(ValueError, match="batch_size"):
        FeatureConfig(batch_size=0)


# --- long maps: the per-offset sums against a cell-by-cell reference ---------------------------


def cell_reference(matrix: np.ndarray, groups: list[int], num_windows: int = N) -> np.ndarray:
    """SPEC section 1 for one sample and head, ``matrix`` (L, L) float64: each cell's group spelled out."""
    length = len(groups)
    s, t = np.meshgrid(np.arange(length), np.arange(length), indexing="ij")
    distance = np.abs(s - t)
    key_group = np.asarray(groups)[t]
    window = np.minimum(num_windows - 1, distance * num_windows // length)  # floor(d * N / L) in integers
    cell = np.where(key_group >= 0, num_windows + 1 + key_group, np.where(distance == 0, num_windows, window))
    features = np.bincount(cell.ravel(), weights=matrix.ravel(), minlength=num_windows + 5) / length
    positive = matrix[matrix > 0]
    entropy = -(positive * np.log(positive)).sum() / length
    pairs = max(length - 1, 1)
    seps = np.asarray(groups) == SEP
    sep_to_sep = matrix[np.ix_(seps, seps)].sum() / seps.sum() if seps.any() else 0.0
    scalars = [
        entropy,
        np.trace(matrix, -1) / pairs,
        np.trace(matrix, 1) / pairs,
        (matrix * distance).sum() / length,
        sep_to_sep,
    ]
    return np.concatenate([features, scalars])


def long_groups(rng: random.Random, length: int) -> list[int]:
    """[CLS] ... [SEP] with many special keys, some of them adjacent (their diagonal cells are special)."""
    if length <= 2:
        return [CLS, SEP][:length]
    middle = [rng.choice([-1, -1, -1, PERIOD, COMMA, SEP]) for _ in range(length - 2)]
    middle[: min(3, len(middle))] = [PERIOD, PERIOD, COMMA][: len(middle)]
    return [CLS, *middle, SEP]


def masked_batch(
    groups: list[list[int]], heads: int, seed: int, *, causal: bool = False, key_mask: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Like ``random_batch``, optionally causal, and with ``key_mask`` added to padding keys instead of finfo.min."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([len(g) for g in groups])
    length = int(lengths.max())
    key_groups = torch.tensor([g + [-1] * (length - len(g)) for g in groups])
    scores = 3 * torch.randn(len(groups), heads, length, length, generator=generator, dtype=torch.float64)
    position = torch.arange(length)
    padding = position[None, :] >= lengths[:, None]  # (batch, T) keys
    low = torch.finfo(torch.float64).min
    scores = (
        scores.masked_fill(padding[:, None, None, :], low)
        if key_mask is None
        else scores + padding[:, None, None, :] * key_mask
    )
    if causal:
        scores = scores.masked_fill(position[None, :] > position[:, None], low)  # future keys: exactly 0
    return scores.softmax(-1), scores, key_groups, lengths


def assert_matches_reference(
    fast: torch.Tensor, probs: torch.Tensor, groups: list[list[int]], num_windows: int, *, entropy: bool = True
) -> None:
    columns = [i for i in range(num_windows + 10) if entropy or i != num_windows + 5 + SCALARS.index("entropy")]
    for b, sample_groups in enumerate(groups):
        real = len(sample_groups)
        for h in range(probs.shape[1]):
            expected = cell_reference(probs[b, h, :real, :real].double().numpy(), sample_groups, num_windows)
            np.testing.assert_allclose(
                fast[b, h, columns].numpy(), expected[columns], rtol=1e-9, atol=1e-9, err_msg=f"{b, h}"
            )


def test_cell_reference_agrees_with_the_loop_reference() -> None:
    probs, _, _, _ = random_batch([GROUPS], heads=1, seed=11)
    matrix = probs[0, 0].numpy()
    assert cell_reference(matrix, GROUPS) == pytest.approx(reference(matrix.tolist(), GROUPS), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize(
    "lengths",
    [
        (512, 512, 500, 384, 383, 2, 1),  # sorted, as extract_features makes batches: L < T, N not dividing L
        (384, 7, 512, 384, 129),  # unsorted: run by run
    ],
)
@pytest.mark.parametrize("num_windows", [16, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_long_maps_match_the_cell_reference(
    lengths: tuple[int, ...], num_windows: int, causal: bool, path: list[int]
) -> None:
    rng = random.Random(sum(lengths) + num_windows)
    groups = [long_groups(rng, length) for length in lengths]
    probs, scores, key_groups, lengths_tensor = masked_batch(groups, heads=2, seed=7, causal=causal)
    weights = build_weights(key_groups, lengths_tensor, num_windows, torch.float64)
    assert_matches_reference(reduce_attention(probs, scores, weights), probs, groups, num_windows)


@pytest.mark.parametrize("rows", [(0, 1), (1, 4), (3, 7), (6, 7)])  # within a run, across runs, the last sample
def test_sub_batch_weights_match_the_cell_reference(rows: tuple[int, int]) -> None:
    """A sub-batch's maps (the probe's one-sample calls on the CPU), reduced with the batch's weights for its rows."""
    lengths = (512, 512, 500, 384, 383, 2, 1)
    rng = random.Random(5)
    groups = [long_groups(rng, length) for length in lengths]
    probs, scores, key_groups, lengths_tensor = masked_batch(groups, heads=2, seed=3)
    weights = build_weights(key_groups, lengths_tensor, N, torch.float64)
    start, stop = rows
    part = reduce_attention(probs[start:stop], scores[start:stop], weights.rows(start, stop))
    assert_matches_reference(part, probs[start:stop], groups[start:stop], N)


@pytest.mark.parametrize("maps_per_copy", [1, 2, 5])  # copies that split samples' heads, and the last one short
def test_offset_sums_copied_in_chunks_match_the_cell_reference(
    maps_per_copy: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The skewed copies of a few maps at a time: query rows past each sample's end left out, also when a
    copy holds part of a sample; the buffer reused from layer to layer (its unwritten cells stay zero)."""
    lengths = (40, 40, 33, 17, 2, 1)
    groups = [long_groups(random.Random(length), length) for length in lengths]
    width = 16 * 5 + 1  # the buffer's row length at T = 40 (R - 1 = 80, the odd multiple of 16 above 2T - 2)
    monkeypatch.setattr(features_module, "_CACHE_BYTES", maps_per_copy * 40 * width * 8)
    monkeypatch.setattr(features_module, "GPU_BRANCHES_ON_CPU", True)  # the skewed copy is the GPU's way
    probs, scores, key_groups, lengths_tensor = masked_batch(groups, heads=3, seed=9)
    weights = build_weights(key_groups, lengths_tensor, N, torch.float64)
    for layer in range(2):  # the second layer's maps go through the same buffer
        layer_probs = probs if layer == 0 else probs.flip(1)  # other heads, other sums
        assert_matches_reference(reduce_attention(layer_probs, None, weights), layer_probs, groups, N, entropy=False)


def test_window_boundaries_at_long_lengths() -> None:
    """Queries attending at exactly distance d: their mass in window floor(d * N / L), either side of a boundary."""
    length = 500  # 16 does not divide it: boundaries at d = 31.25 i
    for d in (31, 32, 62, 63, 468, 469, 499):
        targets = [s + d if s + d < length else s - d if s >= d else None for s in range(length)]
        matrix = [[float(t == target) for t in range(length)] for target in targets]
        share = sum(target is not None for target in targets) / length
        values = reduce_one(matrix, [-1] * length)
        assert float(values[min(N - 1, d * N // length)]) == pytest.approx(share, abs=1e-12), d
        assert float(values[:F].sum()) == pytest.approx(share, abs=1e-12), d
        assert scalar(values, "mean_distance") == pytest.approx(d * share, abs=1e-9)


def test_key_padding_with_mass_still_counts_only_real_cells(path: list[int]) -> None:
    """A soft padding mask (padding keys keep mass) must not leak into the features of a sorted batch."""
    rng = random.Random(12)
    groups = [long_groups(rng, length) for length in (384, 300, 300, 17)]
    probs, scores, key_groups, lengths = masked_batch(groups, heads=2, seed=8, key_mask=-2.0)
    assert float(probs[1, :, :300, 300:].sum()) > 1  # the padding keys do hold mass
    weights = build_weights(key_groups, lengths, N, torch.float64)
    # Entropy is that of each query's whole row (padding keys included), so it is left out here.
    assert_matches_reference(reduce_attention(probs, None, weights), probs, groups, N, entropy=False)


def test_sorted_and_unsorted_batches_agree(path: list[int]) -> None:
    rng = random.Random(13)
    groups = [long_groups(rng, length) for length in (512, 400, 400, 90)]
    probs, scores, key_groups, lengths = masked_batch(groups, heads=3, seed=9)
    sorted_result = reduce_attention(probs, scores, build_weights(key_groups, lengths, N, torch.float64))
    order = torch.tensor([3, 1, 0, 2])
    shuffled = reduce_attention(
        probs[order], scores[order], build_weights(key_groups[order], lengths[order], N, torch.float64)
    )
    assert shuffled.numpy() == pytest.approx(sorted_result[order].numpy(), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_lower_precision_maps_at_long_lengths(dtype: torch.dtype, path: list[int]) -> None:
    """Sums are taken in float32 (half-precision maps) and float64 at the end: every linear feature
    matches the reference on the same (rounded) values to float32 accuracy."""
    rng = random.Random(14)
    groups = [long_groups(rng, length) for length in (512, 384, 100)]
    probs64, scores64, key_groups, lengths = masked_batch(groups, heads=2, seed=10)
    # a float32 model's mask, then rounded (finfo.min + logit may round to -inf in half precision)
    probs, scores = probs64.to(dtype), scores64.clamp(min=torch.finfo(torch.float32).min).to(dtype)
    fast = reduce_attention(probs, scores, build_weights(key_groups, lengths, N, dtype))  # (batch, head, F + 5)
    entropy = F + SCALARS.index("entropy")
    for b, sample_groups in enumerate(groups):
        real = len(sample_groups)
        for h in range(2):
            expected = cell_reference(probs[b, h, :real, :real].double().numpy(), sample_groups)
            linear = [i for i in range(len(expected)) if i != entropy]
            np.testing.assert_allclose(fast[b, h, linear].numpy(), expected[linear], rtol=1e-4, atol=1e-5)
            # lse from the rounded diagonal: the entropy is as good as the maps' own rounding
            tolerance = 1e-4 if dtype == torch.float32 else 8 * torch.finfo(dtype).eps * max(1, abs(expected[entropy]))
            assert float(fast[b, h, entropy]) == pytest.approx(expected[entropy], abs=tolerance)


# --- real models ------------------------------------------------------------------------------

SAMPLES = [
    Sample("The cat sat on the mat.", "It was warm, and it purred."),
    Sample("A short one"),
    Sample("Paris is the capital of France, and Berlin is the capital of Germany.", "Both are large."),
    Sample("Who wrote the book?", "The book, published in 1851, was written by Herman Melville."),
    Sample("Commas, periods. And more, many more, tokens here to make this one the longest sample."),
    Sample("x", "y"),
    Sample("The end."),
]


@pytest.fixture(scope="module")
def tiny_bert(tiny_bert_path: Path):
    return load_model(str(tiny_bert_path), device="cpu")


def naive_features(loaded, samples: list[Sample], config: FeatureConfig) -> np.ndarray:
    """``output_attentions=True`` on one sample at a time, every layer's map held, then reduced."""
    tokenizer, model = loaded.tokenizer, loaded.model
    table = resolve_special_tokens(tokenizer).group_table(len(tokenizer))
    per_sample = []
    with torch.inference_mode():
        for encoded in encode_samples(tokenizer, samples, config.max_length):
            ids = torch.tensor([encoded.input_ids])
            types = torch.tensor([encoded.token_type_ids])
            maps = model(input_ids=ids, token_type_ids=types, output_attentions=True).attentions
            weights = build_weights(table[ids], torch.tensor([ids.shape[1]]), config.num_windows)
            per_sample.append(torch.stack([reduce_attention(a, None, weights)[0] for a in maps]).numpy())
    return np.mean(per_sample, axis=0)


def test_special_tokens_of_a_wordpiece_tokenizer(tiny_bert) -> None:
    special = resolve_special_tokens(tiny_bert.tokenizer)
    assert special.tokens == {"cls": ["[CLS]"], "sep": ["[SEP]"], "period": ["."], "comma": [","]}
    assert special.ids == {"cls": [101], "sep": [102], "period": [1012], "comma": [1010]}


def test_tiny_bert_end_to_end(tiny_bert) -> None:
    calls: list[tuple[int, int]] = []
    config = FeatureConfig(batch_size=4, map_size=8)
    result = extract_features(tiny_bert, None, iter(SAMPLES), config, progress=lambda *a: calls.append(a))
    assert result.vectors.shape == (2, 4, F)
    assert np.isfinite(result.vectors).all()
    assert result.vectors.sum(-1) == pytest.approx(1, abs=1e-5)
    assert set(result.scalars) == set(SCALARS)
    assert all(values.shape == (2, 4) and np.isfinite(values).all() for values in result.scalars.values())
    assert calls == [(4, 7), (7, 7)]
    assert result.num_samples == 7
    tokens = tiny_bert.tokenizer(SAMPLES[0].text, SAMPLES[0].text_pair)["input_ids"]
    assert result.example_tokens == tiny_bert.tokenizer.convert_ids_to_tokens(tokens)
    assert result.example_maps.shape == (2, 4, 8, 8)
    assert result.example_maps.dtype == np.float32
    assert result.feature_names[N:] == ["self", "cls", "sep", "period", "comma"]
    assert result.metadata()["special_tokens"]["sep"] == ["[SEP]"]
    assert (result.device, result.dtype) == ("cpu", "float32")

    one_by_one = extract_features(tiny_bert, None, SAMPLES, FeatureConfig(batch_size=1, map_size=8))
    assert one_by_one.vectors == pytest.approx(result.vectors, abs=1e-5)
    for name in SCALARS:
        assert one_by_one.scalars[name] == pytest.approx(result.scalars[name], abs=1e-5)
    assert one_by_one.example_maps == pytest.approx(result.example_maps, abs=1e-5)

    naive = naive_features(tiny_bert, SAMPLES, config)
    assert result.vectors == pytest.approx(naive[..., :F], abs=1e-5)
    for k, name in enumerate(SCALARS):
        assert result.scalars[name] == pytest.approx(naive[..., F + k], abs=1e-5), name


def test_limit_and_empty_corpus(tiny_bert) -> None:
    result = extract_features(tiny_bert, None, SAMPLES, FeatureConfig(samples=3))
    assert result.num_samples == 3
    with pytest.raises(ValueError, match="no samples"):
        extract_features(tiny_bert, None, [], FeatureConfig())


def test_max_length_beyond_positions_is_refused(tiny_bert) -> None:
    with pytest.raises(ValueError, match="positions"):
        extract_features(tiny_bert, None, SAMPLES, FeatureConfig(max_length=1024))


def test_model_bypassing_the_probe_is_refused(tiny_bert) -> None:
    from transformers import XLNetConfig, XLNetModel

    config = XLNetConfig(vocab_size=30522, d_model=32, n_layer=1, n_head=2, d_inner=32)
    with pytest.raises(RuntimeError, match="architecture 'xlnet'.*AttentionInterface"):
        extract_features(XLNetModel(config), tiny_bert.tokenizer, SAMPLES, FeatureConfig())


@pytest.mark.slow
def test_minilm_matches_the_naive_path(minilm_path: Path) -> None:
    loaded = load_model(str(minilm_path), device="cpu")
    samples = list(load_corpus("builtin:wiki").samples(6))
    config = FeatureConfig(batch_size=3)
    result = extract_features(loaded, None, samples, config)
    assert result.vectors.shape == (6, 12, F)
    naive = naive_features(loaded, samples, config)
    assert result.vectors == pytest.approx(naive[..., :F], abs=1e-5)
    for k, name in enumerate(SCALARS):
        assert result.scalars[name] == pytest.approx(naive[..., F + k], abs=1e-5, rel=1e-6), name


@pytest.mark.parametrize("shift", [0.0, 1000.0])
def test_float32_entropy_holds_at_large_logits(shift: float) -> None:
    """Softmax ignores a constant added to a row's logits; the entropy taken from float32 scores of ~1000
    must too (there ``lse``'s float32 rounding alone is ~3e-5 a row: its remainder has to be put back)."""
    rng = random.Random(7)
    groups = [random_groups(rng, length) for length in (48, 31)]
    _, scores64, key_groups, lengths = random_batch(groups, heads=3, seed=8)
    real_keys = torch.arange(scores64.shape[-1])[None, :] < lengths[:, None]
    mask = torch.finfo(torch.float32).min  # as a float32 model masks
    scores32 = (scores64 + shift).float().masked_fill(~real_keys[:, None, None, :], mask)
    weights = build_weights(key_groups, lengths, N, torch.float32)
    entropy = reduce_attention(scores32.softmax(-1), scores32, weights)[..., F]  # (batch, head), per real query
    for b, length in enumerate(lengths.tolist()):
        rows = scores32[b, :, :length, :length].double().softmax(-1)  # float64 from the same float32 logits
        expected = -(rows * rows.log()).sum(-1).mean(-1)  # -sum A log A, mean over the real queries
        assert entropy[b].numpy() == pytest.approx(expected.numpy(), abs=2e-6), b


@pytest.mark.parametrize("gpu_branches", [False, True], ids=["cpu", "gpu-branches"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_entropy_where_a_diagonal_underflows(
    gpu_branches: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows whose A[s, s] is 0 (the diagonal masked) or below the trusted floor read lse off the row's largest
    key instead; the GPU's branches (where-fallback everywhere, one einsum) give the same entropy on the CPU."""
    monkeypatch.setattr(features_module, "GPU_BRANCHES_ON_CPU", gpu_branches)
    rng = random.Random(3)
    groups = [random_groups(rng, length) for length in (20, 13)]
    _, scores, key_groups, lengths = random_batch(groups, heads=2, seed=4)
    low = torch.finfo(dtype).min
    scores = scores.to(dtype).clamp(min=low)  # float64's padding mask is -inf in float32: the model's is finite
    scores[0, 0, 3, 3] = low  # A[3, 3] == 0 exactly
    scores[0, 1, 5, 5] -= 200  # exp(-200): 0 in float32, below 1024 * tiny in float64
    scores[1, 0, 0, 0] = low
    probs = scores.softmax(-1)
    assert probs[0, 0, 3, 3] == 0
    assert probs[1, 0, 0, 0] == 0
    weights = build_weights(key_groups, lengths, N, dtype)
    given = (probs.clone(), scores.clone())
    entropy = reduce_attention(probs, scores, weights)[..., F]  # (batch, head), per real query
    assert torch.equal(probs, given[0])  # the model's tensors are read, never written
    assert torch.equal(scores, given[1])  # (float64 scores' diagonal was once overwritten by the fallback)
    for b, length in enumerate(lengths.tolist()):
        rows = scores[b, :, :length, :length].double().softmax(-1)
        expected = torch.special.entr(rows).sum(-1).mean(-1)  # -sum A log A, mean over the real queries
        tolerance = 1e-9 if dtype == torch.float64 else 2e-6
        assert entropy[b].numpy() == pytest.approx(expected.numpy(), abs=tolerance), b
