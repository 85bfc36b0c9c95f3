"""Attribution (SPEC 8): forward mode against the exact Jacobian on models small enough for it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertModel

from ingest.attention import AttentionProbe
from ingest.attribution import (
    AttributionConfig,
    AttributionError,
    attribute,
    attribute_sample,
    check_model,
    embedding_module,
    rademacher,
    row_features,
    tangents_per_batch,
    total_variation,
)
from ingest.corpora import Sample
from ingest.features import FeatureConfig, extract_features, resolve_special_tokens
from ingest.loading import load_model

HIDDEN, HEADS, LAYERS = 16, 4, 2
HEAD_DIM = HIDDEN // HEADS


@pytest.fixture(scope="module")
def sharp_bert() -> BertModel:
    """A random 2 x 4 BERT whose heads really differ (``initializer_range=0.5``: peaked attention)."""
    torch.manual_seed(0)
    eager: dict[str, Any] = {"attn_implementation": "eager"}  # a kwarg transformers 5.24's typed config does not list
    config = BertConfig(vocab_size=60, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        intermediate_size=32, max_position_embeddings=32, initializer_range=0.5, **eager)  # fmt: skip
    return BertModel(config).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def inputs() -> dict[str, torch.Tensor]:
    ids = torch.tensor([[2, 17, 40, 5, 33, 8, 51, 3]])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


LENGTH = 8
QUERIES = torch.tensor([0, 3, 7])


def exact_jacobians(model: BertModel, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """``(layers, heads, T, d, T, D)``: d z_h(s) / d e at every query, by ``torch.autograd.functional.jacobian``."""
    embedder = embedding_module(model)
    with torch.no_grad():
        e0 = model.embeddings(input_ids=inputs["input_ids"])

    def heads_at_queries(e: torch.Tensor) -> torch.Tensor:
        outputs: dict[int, torch.Tensor] = {}

        def tap(call):  # type: ignore[no-untyped-def]
            outputs[call.layer] = call.output[0].transpose(0, 1)  # (heads, T, d)

        hook = embedder.register_forward_hook(lambda *_: e)
        try:
            with AttentionProbe(model, lambda _: None, on_output=tap):
                model(**inputs)
        finally:
            hook.remove()
        return torch.stack([outputs[layer] for layer in range(LAYERS)])  # (layers, heads, T, d)

    return torch.autograd.functional.jacobian(heads_at_queries, e0)[..., 0, :, :].double()


@pytest.fixture(scope="module")
def jacobians(sharp_bert: BertModel, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return exact_jacobians(sharp_bert, inputs)


def moments(jacobians: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``G^2`` and the variance of one Rademacher tangent's estimate ``||J v||^2``, ``(layers, heads, T, T)`` each.

    With ``A = J^T J`` (``D x D``, ``J = d z_h(s) / d e_t``): ``E ||J v||^2 = tr A`` and
    ``Var = 2 sum_{i != j} A_ij^2 = 2 (||A||_F^2 - sum_i A_ii^2)``.
    """
    a = torch.einsum("lhsitd,lhsite->lhstde", jacobians, jacobians)  # (layers, heads, s, t, D, D)
    diagonal = a.diagonal(dim1=-2, dim2=-1)
    return diagonal.sum(-1), 2 * (a.pow(2).sum((-2, -1)) - diagonal.pow(2).sum(-1))


def test_exact_mode_is_the_jacobian_at_every_query(sharp_bert, inputs) -> None:
    """Identity tangents give ``||d z_h(s) / d e_t||_F^2`` itself: to 1e-6 of autograd's Jacobian in float64,
    every layer, head, query and key."""
    model = copy.deepcopy(sharp_bert).double()
    exact = exact_jacobians(model, inputs).pow(2).sum((3, 5))  # (layers, heads, T, T)
    found = attribute_sample(model, inputs)
    assert found.squares.shape == exact.shape == (LAYERS, HEADS, LENGTH, LENGTH)
    torch.testing.assert_close(found.squares, exact, rtol=1e-6, atol=1e-12 * float(exact.max()))
    assert found.passes == LENGTH * HIDDEN
    # in float32 as well, to float32's precision
    found32 = attribute_sample(sharp_bert, inputs, QUERIES)
    torch.testing.assert_close(found32.squares, exact[:, :, QUERIES], rtol=1e-4, atol=1e-6 * float(exact.max()))
    # attention rows are the eager model's own
    eager = sharp_bert(**inputs, output_attentions=True).attentions
    expected = torch.stack([layer[0][:, QUERIES] for layer in eager]).double()
    torch.testing.assert_close(found32.attention, expected)
    # heads really differ: their normalised attribution rows are far apart, and so are queries of one head
    rows = found.attribution
    assert float(total_variation(rows[1, 0], rows[1, 1]).max()) > 0.05
    assert float(total_variation(rows[1, 2, 0], rows[1, 2, 5])) > 0.05


def test_four_rademacher_tangents_are_within_the_estimators_error(sharp_bert, inputs, jacobians) -> None:
    """P = 4 seeded tangents: each G^2 within 6 standard deviations of the estimator, computed from J."""
    exact, variance = moments(jacobians)
    tangents = rademacher((LENGTH, 4, HIDDEN), torch.Generator().manual_seed(3))
    found = attribute_sample(sharp_bert, inputs, None, tangents)
    assert found.passes == LENGTH * 4
    error = (found.squares - exact).abs()
    assert bool((error <= 6 * (variance / 4).sqrt() + 1e-5 * exact.max()).all())
    assert float(error.max()) > 1e-3 * float(exact.max())  # four tangents are an estimate, not the exact value


def test_the_estimator_is_unbiased_and_its_spread_is_the_jacobians(sharp_bert, inputs, jacobians) -> None:
    """Over N = 100 seeds the 4-tangent estimates average to G^2 (within 5 standard errors of the mean, each
    entry) and their variance is Var / 4, the variance computed from J (0.85 to 1.15 overall; a Gaussian
    tangent's 2 ||A||_F^2, or a mean over the wrong count, falls outside)."""
    exact, variance = moments(jacobians)
    draws = torch.stack([
        attribute_sample(sharp_bert, inputs, None, rademacher((LENGTH, 4, HIDDEN), torch.Generator().manual_seed(s)))
        .squares for s in range(100)
    ])  # fmt: skip
    mean, spread = draws.mean(0), draws.var(0)
    assert bool(((mean - exact).abs() <= 5 * (variance / 4 / 100).sqrt() + 1e-5 * exact.max()).all())
    ratio = float(spread.sum() / (variance / 4).sum())
    assert 0.85 < ratio < 1.15, ratio
    informative = variance > 1e-3 * variance.max()  # entry by entry where the variance is not negligible
    assert float((spread[informative] / (variance[informative] / 4)).median()) == pytest.approx(1, abs=0.15)


def test_batches_change_nothing_but_their_number(sharp_bert, inputs) -> None:
    """One tangent per batch (the naive way) and all of them in one batch give the same G^2."""
    tangents = rademacher((LENGTH, 3, HIDDEN), torch.Generator().manual_seed(0))
    per_tangent = tangents_per_batch(LENGTH, HIDDEN, 32, HEADS, LAYERS, 4, 1 << 30)
    one = attribute_sample(sharp_bert, inputs, QUERIES, tangents, batch_bytes=1)
    many = attribute_sample(sharp_bert, inputs, QUERIES, tangents, batch_bytes=1 << 30)
    assert one.passes == many.passes == LENGTH * 3
    assert one.batches == LENGTH * 3
    assert many.batches == -(-LENGTH * 3 // per_tangent) == 1
    torch.testing.assert_close(one.squares, many.squares, rtol=1e-5, atol=1e-7)
    budget = 5 * 4 * LENGTH * (6 * HIDDEN + 2 * 32 + 4 * HEADS * LENGTH + LAYERS * HIDDEN)  # five tangents' bytes
    assert tangents_per_batch(LENGTH, HIDDEN, 32, HEADS, LAYERS, 4, budget) == 5
    assert tangents_per_batch(LENGTH, HIDDEN, 32, HEADS, LAYERS, 4, budget - 1) == 4
    assert attribute_sample(sharp_bert, inputs, QUERIES, tangents, batch_bytes=budget).batches == -(-24 // 5)


def test_row_features_of_every_attention_row_are_the_feature_run(tiny_bert_path: Path) -> None:
    """All queries + attention rows: row_features is extract_features of that one sample."""
    loaded = load_model(str(tiny_bert_path), device="cpu")
    sample = Sample("The cat sat on the mat, and it purred.", "Then it slept.")
    config = FeatureConfig(samples=1, max_length=32, map_size=4)
    expected = extract_features(loaded.model, loaded.tokenizer, [sample], config)
    encoded = loaded.tokenizer(sample.text, sample.text_pair, return_tensors="pt")
    rows = loaded.model(**encoded, output_attentions=True).attentions
    probs = torch.stack([layer[0] for layer in rows])  # (layers, heads, T, T)
    length = probs.shape[-1]
    groups = resolve_special_tokens(loaded.tokenizer).group_table(len(loaded.tokenizer))[encoded["input_ids"][0]]
    found = row_features(probs, torch.arange(length), groups, 16).numpy()
    torch.testing.assert_close(torch.from_numpy(found[..., :21]), torch.from_numpy(expected.vectors), rtol=0, atol=1e-6)
    for k, name in enumerate(("entropy", "prev_token", "next_token", "mean_distance", "sep_to_sep")):
        torch.testing.assert_close(
            torch.from_numpy(found[..., 21 + k]), torch.from_numpy(expected.scalars[name]), rtol=1e-5, atol=1e-5
        )


def test_a_run_gives_global_vectors_discrepancy_and_example_maps(tiny_bert_path: Path) -> None:
    """Every query by default; progress counts passes (tangents), from (0, total) on, once per batch."""
    loaded = load_model(str(tiny_bert_path), device="cpu")
    samples = [Sample("The quick brown fox jumps over the lazy dog."), Sample("A bird, a plane. It flies!")]
    config = AttributionConfig(samples=2, max_length=16, probes=2, map_size=6, batch_bytes=200_000)
    seen: list[tuple[int, int]] = []
    result = attribute(loaded, None, samples, config, progress=lambda done, total: seen.append((done, total)))
    lengths = [len(loaded.tokenizer(s.text)["input_ids"]) for s in samples]
    assert result.global_vectors.shape == result.local_vectors.shape == (2, 4, 21)
    assert abs(result.global_vectors.sum(-1) - 1).max() < 1e-9
    assert abs(result.local_vectors.sum(-1) - 1).max() < 1e-6  # float32 attention rows
    assert ((result.discrepancy >= 0) & (result.discrepancy <= 1)).all()
    assert result.example_queries == list(range(lengths[0]))  # every query
    assert result.example_attribution.shape == result.example_attention.shape == (2, 4, lengths[0], 6)
    assert result.passes == 2 * sum(lengths)
    assert result.rows == 2 * 4 * sum(lengths)
    assert result.triples == result.rows * 2
    assert seen[0] == (0, result.passes)
    assert seen[-1] == (result.passes, result.passes)
    assert len(seen) > 3  # several batches per sample (the budget holds a few tangents)
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)
    assert len(result.layer_discrepancy()) == 2
    again = attribute(loaded, None, samples, config)  # seeded: the same numbers
    assert (again.global_vectors == result.global_vectors).all()


class _NoEmbeddingLayer(nn.Module):
    """A model with weights and a config but no embedding layer headcat can find; it counts its forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.forwards = 0

    def forward(self, **_: Any) -> Any:
        self.forwards += 1


def _untouched() -> Any:
    raise AssertionError("the corpus was read")
    yield  # a generator that fails when the run reads it


def test_bad_parameters_and_models_are_refused_before_any_compute() -> None:
    with pytest.raises(AttributionError, match="queries"):
        AttributionConfig(queries=0)
    with pytest.raises(AttributionError, match="probes"):
        AttributionConfig(probes=0)
    with pytest.raises(AttributionError, match="scheme"):
        AttributionConfig(scheme="vjp")  # type: ignore[arg-type]
    from transformers import T5Config, T5Model

    t5 = T5Model(T5Config(vocab_size=32, d_model=8, d_kv=2, d_ff=16, num_layers=1, num_heads=4))
    forwards: list[int] = []
    t5.register_forward_pre_hook(lambda *_: forwards.append(1))
    with pytest.raises(AttributionError, match="encoder-decoder"):
        check_model(t5)
    for scheme in ("forward", "exact"):
        with pytest.raises(AttributionError, match="encoder-decoder"):
            attribute(t5, object(), _untouched(), AttributionConfig(scheme=scheme))  # type: ignore[arg-type]
    bare = _NoEmbeddingLayer()
    with pytest.raises(AttributionError, match="no embedding layer"):
        attribute(bare, object(), _untouched(), AttributionConfig())
    with pytest.raises(AttributionError, match="no embedding layer"):
        attribute_sample(bare, {"input_ids": torch.ones(1, 3, dtype=torch.long)})
    assert forwards == []  # no forward ran
    assert bare.forwards == 0
