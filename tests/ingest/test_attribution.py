"""Attribution (SPEC 8): the batched probe estimator against the exact Jacobian on models small enough for it."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
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


QUERIES = torch.tensor([0, 3, 7])


def exact_jacobians(model: BertModel, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """``(layers, heads, Q, d, T, D)``: d z_h(s) / d e by ``torch.autograd.functional.jacobian``."""
    embedder = embedding_module(model)
    with torch.no_grad():
        e0 = model.embeddings(input_ids=inputs["input_ids"])

    def heads_at_queries(e: torch.Tensor) -> torch.Tensor:
        outputs: dict[int, torch.Tensor] = {}

        def tap(call):  # type: ignore[no-untyped-def]
            outputs[call.layer] = call.output[0, QUERIES].transpose(0, 1)  # (heads, Q, d)

        hook = embedder.register_forward_hook(lambda *_: e)
        try:
            with AttentionProbe(model, lambda _: None, on_output=tap):
                model(**inputs)
        finally:
            hook.remove()
        return torch.stack([outputs[layer] for layer in range(LAYERS)])  # (layers, heads, Q, d)

    return torch.autograd.functional.jacobian(heads_at_queries, e0)[..., 0, :, :].double()


@pytest.fixture(scope="module")
def jacobians(sharp_bert: BertModel, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return exact_jacobians(sharp_bert, inputs)


def test_all_sign_vectors_give_the_exact_frobenius_norm(sharp_bert, inputs, jacobians) -> None:
    """Over all 2^d sign vectors E[u u^T] = I holds exactly, so the estimate is ||J||_F^2 exactly."""
    signs = torch.tensor(list(itertools.product([-1.0, 1.0], repeat=HEAD_DIM)), dtype=torch.float64)  # (16, d)
    exact = jacobians.pow(2).sum((3, 5))  # (layers, heads, Q, T)
    for scheme in ("replicate", "vjp"):
        found = attribute_sample(sharp_bert, inputs, QUERIES, signs, rows_per_pass=97, scheme=scheme)
        assert found.squares.shape == exact.shape
        torch.testing.assert_close(found.squares, exact, rtol=1e-4, atol=1e-6 * float(exact.max()))
    # attention rows are the eager model's own
    eager = sharp_bert(**inputs, output_attentions=True).attentions
    expected = torch.stack([layer[0][:, QUERIES] for layer in eager]).double()
    torch.testing.assert_close(found.attention, expected)
    # heads really differ: their normalised attribution rows are far apart
    rows = found.attribution
    assert float(total_variation(rows[1, 0], rows[1, 1]).max()) > 0.05


def test_four_rademacher_probes_are_within_the_estimators_error(sharp_bert, inputs, jacobians) -> None:
    """K = 4 seeded probes: each G^2 within 6 standard deviations of the estimator, computed from J."""
    probes = rademacher((LAYERS, HEADS, len(QUERIES), 4, HEAD_DIM), torch.Generator().manual_seed(3))
    found = attribute_sample(sharp_bert, inputs, QUERIES, probes).squares
    m = torch.einsum("lhqitd,lhqjtd->lhqtij", jacobians, jacobians)  # (layers, heads, Q, T, d, d): J_t J_t^T
    exact = m.diagonal(dim1=-2, dim2=-1).sum(-1)
    variance = 2 * (m.pow(2).sum((-2, -1)) - m.diagonal(dim1=-2, dim2=-1).pow(2).sum(-1))  # one probe
    error = (found - exact).abs()
    assert bool((error <= 6 * (variance / 4).sqrt() + 1e-6 * exact.max()).all())
    assert float(error.max()) > 1e-6 * float(exact.max())  # four probes are an estimate, not the exact value


def test_many_probes_converge(sharp_bert, inputs, jacobians) -> None:
    probes = rademacher((LAYERS, HEADS, len(QUERIES), 400, HEAD_DIM), torch.Generator().manual_seed(1))
    found = attribute_sample(sharp_bert, inputs, QUERIES, probes, rows_per_pass=4096)
    exact = jacobians.pow(2).sum((3, 5))
    assert float(((found.squares - exact).abs().sum(-1) / exact.sum(-1)).max()) < 0.1


@pytest.mark.parametrize("scheme", ["vjp", "replicate"])
def test_rows_per_pass_changes_nothing(sharp_bert, inputs, scheme) -> None:
    """One triple per pass (the naive way) and many per pass give the same gradients, in either scheme."""
    probes = rademacher((LAYERS, HEADS, len(QUERIES), 2, HEAD_DIM), torch.Generator().manual_seed(0))
    one = attribute_sample(sharp_bert, inputs, QUERIES, probes, rows_per_pass=1, scheme="replicate")
    many = attribute_sample(sharp_bert, inputs, QUERIES, probes, rows_per_pass=17, scheme=scheme)
    assert one.passes == one.triples == LAYERS * HEADS * len(QUERIES) * 2
    assert many.passes == LAYERS * -(-(HEADS * len(QUERIES) * 2) // 17)  # chunks never span two layers
    torch.testing.assert_close(one.squares, many.squares, rtol=1e-5, atol=1e-7)


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
    loaded = load_model(str(tiny_bert_path), device="cpu")
    samples = [Sample("The quick brown fox jumps over the lazy dog."), Sample("A bird, a plane. It flies!")]
    config = AttributionConfig(samples=2, max_length=16, queries=5, probes=2, map_size=6, rows_per_pass=64)
    seen: list[tuple[int, int]] = []
    result = attribute(loaded, None, samples, config, progress=lambda done, total: seen.append((done, total)))
    assert result.global_vectors.shape == result.local_vectors.shape == (2, 4, 21)
    assert abs(result.global_vectors.sum(-1) - 1).max() < 1e-9
    assert abs(result.local_vectors.sum(-1) - 1).max() < 1e-6  # float32 attention rows
    assert ((result.discrepancy >= 0) & (result.discrepancy <= 1)).all()
    assert result.example_attribution.shape == result.example_attention.shape == (2, 4, 5, 6)
    assert result.triples == 2 * 4 * 5 * 2 * 2
    assert seen[-1] == (result.triples, result.triples)
    assert len(result.layer_discrepancy()) == 2
    again = attribute(loaded, None, samples, config)  # seeded: the same numbers
    assert (again.global_vectors == result.global_vectors).all()


def test_bad_parameters_and_models_are_refused_before_any_compute() -> None:
    with pytest.raises(AttributionError, match="queries"):
        AttributionConfig(queries=0)
    with pytest.raises(AttributionError, match="probes"):
        AttributionConfig(probes=0)
    from transformers import T5Config, T5Model

    t5 = T5Model(T5Config(vocab_size=32, d_model=8, d_kv=2, d_ff=16, num_layers=1, num_heads=4))
    with pytest.raises(AttributionError, match="encoder-decoder"):
        check_model(t5)
    with pytest.raises(AttributionError, match="encoder-decoder"):
        attribute(t5, object(), iter(()), AttributionConfig())  # refused before the corpus is read
