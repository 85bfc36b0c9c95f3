"""Attribution (SPEC section 8): the contract line by line (issue 14, the mutants of ``ingest/attribution.py``).

Every expectation is written by hand, computed here with plain PyTorch / numpy on the same input
(the head's context vectors read from BERT's own self-attention module, their Jacobian by
``torch.autograd.functional.jacobian``, itself checked against central finite differences, the
attention rows from ``output_attentions=True``, the features by the SPEC section 1 rule as a
plain loop), or an error message in full.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from torch import nn
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2Model,
    MPNetConfig,
    MPNetModel,
    T5Config,
    T5Model,
)

from ingest.attribution import (
    AttributionConfig,
    AttributionError,
    AttributionResult,
    SampleAttribution,
    attribute,
    attribute_sample,
    check_model,
    choose_queries,
    embedding_module,
    rademacher,
    row_features,
    total_variation,
)
from ingest.corpora import Sample
from ingest.loading import LoadedModel, load_model
from tests.ingest.test_attribution import QUERIES, inputs, jacobians, sharp_bert  # noqa: F401 (fixtures)

GROUPS = ("cls", "sep", "period", "comma")  # SPEC section 1 order
SCALARS = ("entropy", "prev_token", "next_token", "mean_distance", "sep_to_sep")
LAYERS, HEADS, HIDDEN = 2, 4, 16
HEAD_DIM = HIDDEN // HEADS


def _error(call: Any, kind: type[Exception] = AttributionError) -> str:
    with pytest.raises(kind) as err:
        call()
    return str(err.value)


# -- the SPEC section 1 rule, by hand -------------------------------------------------------------


def hand_row_features(rows: np.ndarray, queries: list[int], groups: list[int], n: int) -> np.ndarray:
    """``(N + 10,)``: the means over the rows ``(Q, T)`` of the features and scalars, as plain loops."""
    length = rows.shape[1]
    features = np.zeros(n + 5)
    entropy, distance, previous, following, sep_to_sep = [], [], [], [], []
    for row, s in zip(rows, queries, strict=True):
        for t, mass in enumerate(row):
            if groups[t] >= 0:  # special beats self and windows
                features[n + 1 + groups[t]] += mass
            elif t == s:
                features[n] += mass
            else:
                features[min(n - 1, abs(s - t) * n // length)] += mass
        entropy.append(-sum(p * math.log(p) for p in row if p > 0))
        distance.append(sum(p * abs(s - t) for t, p in enumerate(row)))
        if s >= 1:
            previous.append(row[s - 1])
        if s + 1 < length:
            following.append(row[s + 1])
        if groups[s] == 1:
            sep_to_sep.append(sum(p for t, p in enumerate(row) if groups[t] == 1))

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else math.nan

    scalars = [mean(entropy), mean(previous), mean(following), mean(distance), mean(sep_to_sep)]
    return np.concatenate([features / len(queries), scalars])


def test_row_features_of_some_queries_against_the_rule_by_hand() -> None:
    rng = np.random.default_rng(4)
    length, n = 9, 4
    groups = [0, -1, 3, -1, 1, -1, 2, -1, 1]  # [CLS] . , [SEP] at 0, 2 (a query: special beats self), 6, 4 and 8
    rows = rng.dirichlet(np.ones(length) * 0.7, size=(2, 3, 5))  # (2, 3, Q, T): any leading axes
    for queries in ([0, 2, 5, 7, 8], [1, 3, 4, 6, 7]):  # with the first and last position; the second sees no end
        found = row_features(torch.from_numpy(rows), torch.tensor(queries), torch.tensor(groups), n)
        assert found.shape == (2, 3, n + 10)
        assert found.dtype == torch.float64
        for index in np.ndindex(2, 3):
            expected = hand_row_features(rows[index], queries, groups, n)
            np.testing.assert_allclose(found[index].numpy(), expected, rtol=1e-12, atol=1e-15)
    # a row set without the context each scalar needs: NaN, not 0
    only_first = row_features(torch.from_numpy(rows[0, 0, :1]), torch.tensor([0]), torch.tensor(groups), n)
    expected = hand_row_features(rows[0, 0, :1], [0], groups, n)
    assert math.isnan(expected[n + 6])
    assert math.isnan(expected[n + 9])
    np.testing.assert_allclose(only_first.numpy(), expected, rtol=1e-12, atol=1e-15)
    only_last = row_features(torch.from_numpy(rows[0, 0, :1]), torch.tensor([length - 1]), torch.tensor(groups), n)
    np.testing.assert_allclose(
        only_last.numpy(), hand_row_features(rows[0, 0, :1], [length - 1], groups, n), rtol=1e-12, atol=1e-15
    )
    assert math.isnan(float(only_last[n + 7]))  # no next token after the last
    # float32 rows are reduced in float64
    single = torch.from_numpy(rows[0, 0]).float()
    found = row_features(single, torch.tensor([0, 2, 5, 7, 8]), torch.tensor(groups), n)
    assert found.dtype == torch.float64
    expected = hand_row_features(single.double().numpy(), [0, 2, 5, 7, 8], groups, n)
    np.testing.assert_allclose(found.numpy(), expected, rtol=1e-12, atol=1e-15)


def test_total_variation_by_hand() -> None:
    a = torch.tensor([[0.5, 0.5, 0.0], [0.25, 0.25, 0.5]])
    b = torch.tensor([[0.0, 0.5, 0.5], [0.25, 0.25, 0.5]])
    found = total_variation(a, b)
    assert found.dtype == torch.float64
    assert found.tolist() == [0.5, 0.0]
    third = torch.tensor([1 / 3, 2 / 3], dtype=torch.float32)  # float32 rows: the sum is taken in float64
    found = total_variation(third, torch.tensor([0.0, 1.0], dtype=torch.float32))
    assert found.dtype == torch.float64
    assert float(found) == 0.5 * (float(third[0]) + (1 - float(third[1])))


# -- parameters, the small helpers ------------------------------------------------------------------


def test_config_refuses_each_bad_parameter_with_its_message() -> None:
    for name in ("samples", "queries", "probes", "batch_bytes", "num_windows", "map_size"):
        zero: dict[str, Any] = {name: 0}
        assert _error(lambda zero=zero: AttributionConfig(**zero)) == f"{name}: must be >= 1, not 0"
        assert getattr(AttributionConfig(**{**zero, name: 1}), name) == 1  # 1 is allowed
    assert _error(lambda: AttributionConfig(max_length=1)) == "max_length: must be >= 2, not 1"
    assert AttributionConfig(max_length=2).max_length == 2
    assert _error(lambda: AttributionConfig(seed=-1)) == "seed: must be >= 0, not -1"
    assert AttributionConfig(seed=0).seed == 0
    assert _error(lambda: AttributionConfig(scheme="vjp")) == "scheme: 'vjp' is not one of forward, exact"  # type: ignore[arg-type]
    assert AttributionConfig(scheme="exact").scheme == "exact"
    assert AttributionConfig().queries is None  # every query
    assert AttributionConfig().batch_bytes is None  # the device's budget
    assert AttributionConfig().num_features == 21
    assert AttributionConfig(num_windows=3).num_features == 8
    assert AttributionConfig(samples=5, queries=3, seed=7).to_json() == {
        "samples": 5,
        "max_length": 64,
        "queries": 3,
        "probes": 4,
        "scheme": "forward",
        "batch_bytes": None,
        "num_windows": 16,
        "map_size": 32,
        "seed": 7,
        "device": "auto",
        "dtype": "float32",
    }


def test_rademacher_draws_plus_and_minus_one_from_the_generator() -> None:
    found = rademacher((3, 50), torch.Generator().manual_seed(5))
    bits = torch.randint(0, 2, (3, 50), generator=torch.Generator().manual_seed(5))
    assert found.dtype == torch.float64
    assert torch.equal(found, torch.where(bits == 1, 1.0, -1.0).double())
    assert set(found.flatten().tolist()) == {-1.0, 1.0}


def test_choose_queries_all_positions_or_a_seeded_subset() -> None:
    assert choose_queries(7, None, seed=3, sample_index=1).tolist() == list(range(7))  # every query
    assert choose_queries(5, 5, seed=3, sample_index=1).tolist() == [0, 1, 2, 3, 4]
    assert choose_queries(4, 9, seed=3, sample_index=1).tolist() == [0, 1, 2, 3]
    for seed, index in ((0, 0), (2, 1), (1, 3)):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + index)  # the stored seed's rule
        expected = sorted(torch.randperm(12, generator=generator)[:5].tolist())
        assert choose_queries(12, 5, seed=seed, sample_index=index).tolist() == expected
    # each sample and each seed draws its own positions
    draws = {tuple(choose_queries(40, 6, seed=s, sample_index=i).tolist()) for s in (0, 1) for i in (0, 1)}
    assert len(draws) == 4


def _bert_config(**settings: Any) -> BertConfig:
    """A 2 x 4 BERT of hidden size 16 in eager attention (``output_attentions`` gives its maps)."""
    shape: dict[str, Any] = {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS}
    shape |= {"intermediate_size": 32, "attn_implementation": "eager"}
    return BertConfig(**(shape | settings))


def _bert(**extra: Any) -> BertModel:
    torch.manual_seed(0)
    return BertModel(_bert_config(vocab_size=60, max_position_embeddings=32, **extra)).eval()


class _NoEmbeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)


class _AbstractEmbeddings(_NoEmbeddings):
    def get_input_embeddings(self) -> nn.Module:
        raise NotImplementedError


class _EmbeddingTable(_NoEmbeddings):
    """An ``embeddings`` attribute that is a bare table (or a list): not the embedding layer."""

    def __init__(self, table: nn.Module) -> None:
        super().__init__()
        self.embeddings = table
        self.tokens = nn.Embedding(5, 2)

    def get_input_embeddings(self) -> nn.Module:
        return self.tokens


def test_embedding_module_of_each_kind_of_model() -> None:
    bert = _bert()
    assert embedding_module(bert) is bert.embeddings
    from transformers import BertForSequenceClassification

    classifier = BertForSequenceClassification(bert.config)
    assert embedding_module(classifier) is classifier.bert.embeddings  # through the base model
    gpt2 = GPT2Model(GPT2Config(vocab_size=30, n_embd=8, n_layer=1, n_head=2, n_positions=16))
    assert embedding_module(gpt2) is gpt2.wte  # no embeddings layer: the input embeddings
    for table in (nn.Embedding(3, 2), nn.ModuleList([nn.Embedding(3, 2)])):
        model = _EmbeddingTable(table)
        assert embedding_module(model) is model.tokens
    for bare in (_NoEmbeddings(), _AbstractEmbeddings()):
        assert _error(lambda bare=bare: embedding_module(bare)) == (
            f"model: {type(bare).__name__} has no embedding layer headcat can find, so it cannot take "
            "gradients with respect to the input tokens"
        )


def test_check_model_refusals_in_full() -> None:
    t5 = T5Model(T5Config(vocab_size=32, d_model=8, d_kv=2, d_ff=16, num_layers=1, num_heads=4))
    assert _error(lambda: check_model(t5)) == (
        "model: T5Model is an encoder-decoder; its heads read two embedding layers (source and target), and "
        "headcat attributes to one input only (encoder-only and decoder-only models)"
    )
    quantized = _bert()
    quantized.embeddings.word_embeddings.weight = nn.Parameter(torch.zeros(60, HIDDEN, dtype=torch.int8),
                                                               requires_grad=False)  # fmt: skip
    assert _error(lambda: check_model(quantized)) == (
        "model: BertModel's weights are not floating point (quantized?), so headcat cannot take gradients through it"
    )
    empty = nn.Module()
    assert _error(lambda: check_model(empty)) == (
        "model: Module's weights are not floating point (quantized?), so headcat cannot take gradients through it"
    )
    assert _error(lambda: check_model(_NoEmbeddings())).startswith("model: _NoEmbeddings has no embedding layer")
    check_model(_bert())  # a plain float encoder passes


def test_attribution_rows_are_the_square_roots_normalised_by_hand() -> None:
    squares = torch.tensor([[[[4.0, 0.0, 1.0], [0.0, 0.0, 0.0], [-1e-12, 9.0, 0.0]]]], dtype=torch.float64)
    found = SampleAttribution("encoder", torch.tensor([0, 1, 2]), squares, squares, 1, 1).attribution
    expected = [[2 / 3, 0.0, 1 / 3], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]]  # a zero row stays 0; a tiny negative is 0
    torch.testing.assert_close(found[0, 0], torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-15)


# -- attribute_sample's refusals ----------------------------------------------------------------------


class _EmbeddingsOnly(BertModel):
    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None, **_: Any) -> Any:
        return self.embeddings(input_ids=input_ids)


class _NoEmbeddingCall(BertModel):
    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None, **_: Any) -> Any:
        return self.encoder(torch.zeros(1, input_ids.shape[1], HIDDEN))


class _SecondLayerOnly(BertModel):
    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None, **_: Any) -> Any:
        return self.encoder.layer[1](self.embeddings(input_ids=input_ids))


def test_attribute_sample_refusals_in_full() -> None:
    bert = _bert()
    ids = torch.tensor([[2, 17, 40, 3]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    queries = torch.tensor([0, 2])
    tangents = torch.ones(1, HIDDEN)
    assert _error(lambda: attribute_sample(bert, batch, queries, torch.ones(3, 2, HIDDEN))) == (
        f"tangents: shape (3, 2, {HIDDEN}), expected (4, K, {HIDDEN}) or (K, {HIDDEN})"
    )
    assert _error(lambda: attribute_sample(bert, batch, queries, torch.ones(2, 5))) == (
        f"tangents: shape (4, 2, 5), expected (4, K, {HIDDEN}) or (K, {HIDDEN})"
    )
    assert _error(lambda: attribute_sample(bert, batch, queries, torch.ones(HIDDEN))) == (
        f"tangents: shape ({HIDDEN},), expected (4, K, {HIDDEN}) or (K, {HIDDEN})"
    )
    for kind in (_EmbeddingsOnly, _NoEmbeddingCall):
        torch.manual_seed(0)
        model = kind(bert.config).eval()
        assert _error(lambda model=model: attribute_sample(model, batch, queries, tangents)) == (
            f"model: {kind.__name__} ran without calling headcat's attention probe or its embedding layer, so "
            "headcat cannot take gradients through it"
        )
    skipping = _SecondLayerOnly(bert.config).eval()
    assert _error(lambda: attribute_sample(skipping, batch, queries, tangents), RuntimeError) == (
        "the probe saw layers [1]; expected 0..0"
    )
    decoder = _bert(is_decoder=True, add_cross_attention=True)
    crossed = {**batch, "encoder_hidden_states": torch.randn(1, 3, HIDDEN)}
    assert _error(lambda: attribute_sample(decoder, crossed, queries, tangents)) == (
        "model: attention in 2 stacks (cross, decoder); one only"
    )


def test_attribute_sample_defaults_and_query_dtype() -> None:
    """Every query and the exact scheme by default; the same tangents at every position when given ``(K, D)``;
    queries of any integer-valued dtype are positions."""
    bert = _bert()
    ids = torch.tensor([[2, 17, 40, 3]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    exact = attribute_sample(bert, batch)
    assert exact.queries.tolist() == [0, 1, 2, 3]
    assert exact.squares.shape == (LAYERS, HEADS, 4, 4)
    assert exact.passes == 4 * HIDDEN
    assert exact.batches == 1  # 64 tangents of 4 tokens fit in the CPU's 128 MiB
    signs = rademacher((3, HIDDEN), torch.Generator().manual_seed(0))
    shared = attribute_sample(bert, batch, None, signs)
    spelled = attribute_sample(bert, batch, None, signs.expand(4, 3, HIDDEN))
    assert shared.passes == 12
    torch.testing.assert_close(shared.squares, spelled.squares, rtol=0, atol=0)
    as_float = attribute_sample(bert, batch, torch.tensor([0.0, 2.0]), signs)
    assert as_float.queries.dtype == torch.long
    assert as_float.queries.tolist() == [0, 2]
    torch.testing.assert_close(as_float.squares, shared.squares[:, :, [0, 2]], rtol=0, atol=0)
    eager = bert(**batch, output_attentions=True).attentions
    torch.testing.assert_close(as_float.attention, torch.stack([layer[0][:, [0, 2]] for layer in eager]).double())


def test_tangents_of_any_scale_are_averaged(sharp_bert, inputs, jacobians) -> None:  # noqa: F811 (imported fixtures)
    """Given tangents are averaged: ``sqrt(D)`` times the unit vectors give ``||J||_F^2`` exactly, half that a
    quarter of it."""
    exact = jacobians[:, :, QUERIES].pow(2).sum((3, 5))  # (layers, heads, Q, T)
    unit = torch.eye(HIDDEN, dtype=torch.float64)
    for scale, share in ((HIDDEN**0.5, 1.0), (HIDDEN**0.5 / 2, 0.25)):
        found = attribute_sample(sharp_bert, inputs, QUERIES, scale * unit)
        torch.testing.assert_close(found.squares, share * exact, rtol=1e-4, atol=1e-6 * float(exact.max()))


def _forward_batches(model: BertModel, call: Any) -> tuple[list[int], int]:
    """The batch sizes of the model's forwards while ``call()`` runs, and how often its pooler ran."""
    model_batches: list[int] = []
    pooled: list[int] = []

    def on_model(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        model_batches.append(int(kwargs["input_ids"].shape[0]))

    handles = [
        model.register_forward_pre_hook(on_model, with_kwargs=True),
        cast(nn.Module, model.pooler).register_forward_pre_hook(lambda *_: pooled.append(1)),
    ]
    try:
        call()
    finally:
        for handle in handles:
            handle.remove()
    return model_batches, len(pooled)


def test_each_batch_is_one_forward_stopped_after_the_last_heads() -> None:
    """The plain forward (attention rows), then one forward per batch of tangents (vmap: the model sees one
    sample); only the plain one reaches the pooler."""
    bert = _bert()
    ids = torch.tensor([[2, 17, 40, 3]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    per_tangent = 4 * 4 * (6 * HIDDEN + 2 * 32 + 4 * HEADS * 4 + LAYERS * HIDDEN)  # float32, 4 tokens
    tangents = torch.ones(2, HIDDEN)  # 4 positions x 2 tangents = 8 passes, 3 a batch: 3 + 3 + 2
    run = lambda: attribute_sample(bert, batch, None, tangents, batch_bytes=3 * per_tangent)  # noqa: E731
    assert _forward_batches(bert, run) == ([1, 1, 1, 1], 1)
    assert run().batches == 3


# -- a whole run against the hand reference ---------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_bert_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_bert_path)


@pytest.fixture(scope="module")
def sharp(tokenizer: Any) -> BertModel:
    """A random 2 x 4 BERT over the real WordPiece vocabulary, with peaked heads (``initializer_range=0.5``)."""
    torch.manual_seed(1)
    config = _bert_config(vocab_size=len(tokenizer), max_position_embeddings=40, initializer_range=0.5)
    return BertModel(config).eval()


def context_jacobian(model: BertModel, batch: dict[str, torch.Tensor], queries: list[int]) -> torch.Tensor:
    """``(layers, heads, Q, d, T, D)``: d z_h(s) / d e, ``z`` read from BERT's own self-attention module."""
    with torch.no_grad():
        e0 = model.embeddings(input_ids=batch["input_ids"], token_type_ids=batch.get("token_type_ids"))
    return torch.autograd.functional.jacobian(lambda e: contexts(model, batch, queries, e), e0, vectorize=True)[
        ..., 0, :, :
    ]


def contexts(model: BertModel, batch: dict[str, torch.Tensor], queries: list[int], e: torch.Tensor) -> torch.Tensor:
    """``(layers, heads, Q, d)``: each head's context vector at the queries, the embeddings replaced by ``e``."""
    found: dict[int, torch.Tensor] = {}
    heads = model.config.num_attention_heads
    handles = [model.embeddings.register_forward_hook(lambda *_: e)]
    blocks: Any = model.encoder.layer
    for layer, block in enumerate(blocks):

        def keep(_module: Any, _args: Any, output: Any, layer: int = layer) -> None:
            context = output[0][0]  # (T, hidden): the heads' contexts, concatenated, before the projection
            found[layer] = context.view(context.shape[0], heads, -1)[queries].transpose(0, 1)  # (heads, Q, d)

        handles.append(block.attention.self.register_forward_hook(keep))
    try:
        model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack([found[layer] for layer in range(len(model.encoder.layer))])


def test_the_context_jacobian_is_the_finite_differences(sharp: BertModel, tokenizer: Any) -> None:
    """The reference's own check: autograd's Jacobian of the contexts against central differences (float64)."""
    model = copy.deepcopy(sharp).double()
    batch = dict(tokenizer("A cat, a dog.", return_tensors="pt"))
    queries = [0, 3, 5]
    jacobian = context_jacobian(model, batch, queries)  # (L, H, Q, d, T, D)
    with torch.no_grad():
        e0 = model.embeddings(**{k: v for k, v in batch.items() if k != "attention_mask"})
    generator = torch.Generator().manual_seed(0)
    eps = 1e-6
    for _ in range(3):
        direction = torch.randn(e0.shape, generator=generator, dtype=torch.float64)
        with torch.no_grad():
            plus = contexts(model, batch, queries, e0 + eps * direction)
            minus = contexts(model, batch, queries, e0 - eps * direction)
        numeric = (plus - minus) / (2 * eps)
        analytic = torch.einsum("lhqitd,td->lhqi", jacobian, direction[0])
        torch.testing.assert_close(analytic, numeric, rtol=1e-6, atol=1e-7)


def hand_run(model: Any, tokenizer: Any, samples: list[Sample], config: AttributionConfig) -> dict[str, Any]:
    """What ``attribute`` must give, from the SPEC: per sample, the seeded queries (every one unless asked) and
    Rademacher tangents ``(T, P, D)`` (the stored seed's rule), ``G^2`` as their mean of ``||J_t v||^2`` from the
    exact Jacobian (or ``||J_t||_F^2`` itself, exact scheme), rows normalised, features by hand, means."""
    n = config.num_windows
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    hidden = model.config.hidden_size
    k = hidden if config.scheme == "exact" else config.probes
    ids_of = {tokenizer.cls_token_id: 0, tokenizer.sep_token_id: 1}
    ids_of |= {tokenizer.convert_tokens_to_ids("."): 2, tokenizer.convert_tokens_to_ids(","): 3}
    per_sample, examples, lengths, passes = [], [], [], []
    for index, sample in enumerate(samples):
        batch = dict(tokenizer(sample.text, sample.text_pair, truncation=True, max_length=config.max_length,
                                return_tensors="pt"))  # fmt: skip
        ids = batch["input_ids"][0].tolist()
        length = len(ids)
        groups = [ids_of.get(i, -1) for i in ids]
        generator = torch.Generator().manual_seed(config.seed * 1_000_003 + index)
        if config.queries is None or config.queries >= length:
            queries = list(range(length))
        else:
            queries = sorted(torch.randperm(length, generator=generator)[: config.queries].tolist())
        jacobian = context_jacobian(model, batch, queries).double()  # (L, H, Q, d, T, D)
        if config.scheme == "exact":
            squares = jacobian.pow(2).sum((3, 5))  # (L, H, Q, T)
        else:
            generator = torch.Generator().manual_seed(config.seed * 1_000_003 + index)
            bits = torch.randint(0, 2, (length, k, hidden), generator=generator)
            tangents = torch.where(bits == 1, 1.0, -1.0).double()  # (T, P, D)
            pushed = torch.einsum("lhqitd,tkd->lhqtki", jacobian, tangents)  # (L, H, Q, T, P, d)
            squares = pushed.pow(2).sum(-1).mean(-1)  # (L, H, Q, T)
        norms = squares.sqrt()
        attribution = (norms / norms.sum(-1, keepdim=True)).numpy()
        with torch.no_grad():
            eager = model(**batch, output_attentions=True).attentions
        attention = torch.stack([layer[0][:, queries] for layer in eager]).double().numpy()  # (L, H, Q, T)
        local = np.zeros((layers, heads, n + 10))
        glob = np.zeros((layers, heads, n + 10))
        discrepancy = np.zeros((layers, heads))
        for layer, head in np.ndindex(layers, heads):
            local[layer, head] = hand_row_features(attention[layer, head], queries, groups, n)
            glob[layer, head] = hand_row_features(attribution[layer, head], queries, groups, n)
            discrepancy[layer, head] = np.mean(0.5 * np.abs(attention[layer, head] - attribution[layer, head]).sum(-1))
        per_sample.append((local, glob, discrepancy))
        examples.append((ids, queries, attention, attribution))
        lengths.append(length)
        passes.append(length * k)
    with np.errstate(invalid="ignore"):  # NaN where no sample defines a scalar
        local = np.nanmean(np.stack([s[0] for s in per_sample]), axis=0)
        glob = np.nanmean(np.stack([s[1] for s in per_sample]), axis=0)
    return {
        "local": local,
        "global": glob,
        "discrepancy": np.mean([s[2] for s in per_sample], axis=0),
        "example": examples[0],
        "lengths": lengths,
        "passes": passes,
        "per_sample": per_sample,
    }


def pooled_by_hand(rows: np.ndarray, side: int) -> np.ndarray:
    """``adaptive_avg_pool1d`` over the last axis, by its windows ``[floor(i T / m), ceil((i + 1) T / m))``."""
    length = rows.shape[-1]
    columns = [rows[..., (i * length) // side : -(-((i + 1) * length) // side)].mean(-1) for i in range(side)]
    return np.stack(columns, axis=-1)


SAMPLES = [
    Sample("The cat sat on the mat, and it purred.", "Then it slept, quietly."),  # a pair: token types matter
    Sample("A dog. It ran!"),
    Sample("Never read: the run is limited to two samples."),
]


def test_a_run_against_the_hand_reference(sharp: BertModel, tokenizer: Any) -> None:
    config = AttributionConfig(samples=2, max_length=24, queries=8, probes=3, map_size=5, num_windows=6, seed=4)
    expected = hand_run(sharp, tokenizer, SAMPLES[:2], config)
    assert expected["lengths"][0] > config.queries >= expected["lengths"][1]  # one subsampled, one whole
    sep_rows = [s[1][..., config.num_windows + 9] for s in expected["per_sample"]]  # sep_to_sep: in one sample only
    assert np.isnan(sep_rows[0]).all()
    assert not np.isnan(sep_rows[1]).any()
    seen: list[tuple[int, int]] = []
    sharp.train()  # attribute evaluates in eval mode (no dropout), then restores the mode
    try:
        started = time.perf_counter()
        result = attribute(sharp, tokenizer, iter(SAMPLES), config, progress=lambda *p: seen.append(p))
        elapsed = time.perf_counter() - started
        assert sharp.training
    finally:
        sharp.eval()
    features = config.num_features
    np.testing.assert_allclose(result.local_vectors, expected["local"][..., :features], rtol=0, atol=1e-7)
    np.testing.assert_allclose(result.global_vectors, expected["global"][..., :features], rtol=0, atol=1e-6)
    assert list(result.global_scalars) == list(SCALARS)
    for k, name in enumerate(SCALARS):
        np.testing.assert_allclose(result.global_scalars[name], expected["global"][..., features + k], rtol=1e-6,
                                   atol=1e-6, err_msg=name)  # fmt: skip
    np.testing.assert_allclose(result.discrepancy, expected["discrepancy"], rtol=0, atol=1e-6)
    ids, queries, attention, attribution = expected["example"]
    assert result.example_queries == queries
    assert result.example_tokens == tokenizer.convert_ids_to_tokens(ids)
    np.testing.assert_allclose(result.example_attention, pooled_by_hand(attention, 5), rtol=0, atol=1e-6)
    np.testing.assert_allclose(result.example_attribution, pooled_by_hand(attribution, 5), rtol=0, atol=1e-5)
    assert result.example_attention.dtype == result.example_attribution.dtype == np.float32
    total = sum(expected["passes"])  # a pass per position and tangent, every query or not
    assert total == sum(expected["lengths"]) * config.probes
    assert (result.num_samples, result.num_tokens, result.passes) == (2, sum(expected["lengths"]), total)
    assert seen == [(0, total), (expected["passes"][0], total), (total, total)]  # one batch a sample (128 MiB)
    assert result.rows == LAYERS * HEADS * (config.queries + expected["lengths"][1])
    assert result.triples == result.rows * config.probes
    assert (result.device, result.dtype, result.stack, result.config) == ("cpu", "float32", "encoder", config)
    assert result.feature_names == [f"w{i}" for i in range(6)] + ["self", *GROUPS]
    assert (result.num_layers, result.num_heads) == (LAYERS, HEADS)
    assert result.layer_discrepancy() == pytest.approx(expected["discrepancy"].mean(1).tolist(), abs=1e-6)
    assert 0 < result.seconds <= elapsed


def test_short_samples_keep_every_query_and_map_column(sharp: BertModel, tokenizer: Any) -> None:
    """Fewer tokens than ``queries`` and ``map_size``: every position is a query and a map column."""
    config = AttributionConfig(samples=3, max_length=12, queries=30, probes=2, map_size=40)
    samples = [Sample("Hello, world."), Sample("Yes.")]
    expected = hand_run(sharp, tokenizer, samples, config)
    result = attribute(sharp, tokenizer, samples, config)
    ids, queries, attention, attribution = expected["example"]
    assert result.example_queries == list(range(len(ids)))
    assert result.example_attention.shape == (LAYERS, HEADS, len(ids), len(ids))
    np.testing.assert_allclose(result.example_attention, attention, rtol=0, atol=1e-6)
    np.testing.assert_allclose(result.example_attribution, attribution, rtol=0, atol=1e-5)  # float32 maps
    np.testing.assert_allclose(result.global_vectors, expected["global"][..., :21], rtol=0, atol=1e-6)
    assert result.num_samples == 2
    assert result.passes == 2 * sum(expected["lengths"])
    assert result.rows == LAYERS * HEADS * sum(expected["lengths"])


def test_a_loaded_model_brings_its_tokenizer(tiny_bert_path: Path) -> None:
    loaded = load_model(str(tiny_bert_path), device="cpu")
    config = AttributionConfig(samples=1, max_length=8, queries=3, probes=1)
    result = attribute(loaded, None, [Sample("One two three four five six.")], config)
    expected = hand_run(loaded.model, loaded.tokenizer, [Sample("One two three four five six.")], config)
    np.testing.assert_allclose(result.discrepancy, expected["discrepancy"], rtol=0, atol=1e-6)
    assert isinstance(loaded, LoadedModel)


def test_a_run_passes_its_scheme_and_works_on_one_layer(tokenizer: Any) -> None:
    """A 1-layer model (layer 0 is the only one) in the ``exact`` scheme, against the hand run."""
    torch.manual_seed(2)
    one = BertModel(_bert_config(vocab_size=len(tokenizer), max_position_embeddings=16, num_hidden_layers=1,
                                 initializer_range=0.5)).eval()  # fmt: skip
    config = AttributionConfig(samples=1, max_length=16, queries=3, probes=2, scheme="exact")
    samples = [Sample("Short, but not too short.")]
    # the shape probe, the sample, one batch of tangents (the pooler only in the first two)
    assert _forward_batches(one, lambda: attribute(one, tokenizer, samples, config)) == ([1, 1, 1], 2)
    result = attribute(one, tokenizer, samples, config)
    expected = hand_run(one, tokenizer, samples, config)
    length = len(tokenizer(samples[0].text)["input_ids"])
    assert result.passes == length * HIDDEN  # the exact scheme: the hidden size per position, not the probes
    assert result.triples == HEADS * 3 * HIDDEN
    assert result.global_vectors.shape == (1, HEADS, 21)
    np.testing.assert_allclose(result.global_vectors, expected["global"][..., :21], rtol=0, atol=1e-6)
    np.testing.assert_allclose(result.discrepancy, expected["discrepancy"], rtol=0, atol=1e-6)


def test_an_explicit_tokenizer_wins_over_the_loaded_models(tiny_bert_path: Path) -> None:
    loaded = load_model(str(tiny_bert_path), device="cpu")
    cased = AutoTokenizer.from_pretrained(tiny_bert_path, do_lower_case=False)  # "Hello" is not in the vocabulary
    config = AttributionConfig(samples=1, max_length=8, queries=2, probes=1)
    assert attribute(loaded, cased, [Sample("Hello World.")], config).example_tokens == [
        "[CLS]",
        "[UNK]",
        "[UNK]",
        ".",
        "[SEP]",
    ]
    assert attribute(loaded, None, [Sample("Hello World.")], config).example_tokens == [
        "[CLS]",
        "hello",
        "world",
        ".",
        "[SEP]",
    ]


class _Bare(nn.Module):
    """A plain module around an MPNet (a headcat adapter, no AttentionInterface): no ``config``, no
    ``base_model``, its embedding layer an attribute."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.embeddings = inner.embeddings

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None, token_type_ids: Any = None) -> Any:
        return self.inner(input_ids=input_ids, attention_mask=attention_mask)


def test_a_model_without_a_config_or_base_model(tokenizer: Any) -> None:
    torch.manual_seed(3)
    shape: dict[str, Any] = {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS}
    mpnet = MPNetModel(
        MPNetConfig(vocab_size=len(tokenizer), intermediate_size=32, max_position_embeddings=40, **shape)
    )
    bare = _Bare(mpnet).eval()
    assert embedding_module(bare) is mpnet.embeddings
    config = AttributionConfig(samples=1, max_length=16, queries=16, probes=1, map_size=16)
    result = attribute(bare, tokenizer, [Sample("A cat sat on it.")], config)  # no position limit to check
    batch = tokenizer("A cat sat on it.", return_tensors="pt")
    with torch.no_grad():
        eager = mpnet(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_attentions=True)
    expected = torch.stack([layer[0] for layer in eager.attentions]).numpy()  # every query, every key
    np.testing.assert_allclose(result.example_attention, expected, rtol=0, atol=1e-6)


def test_a_run_refuses_before_any_compute(sharp: BertModel, tokenizer: Any) -> None:
    assert _error(lambda: attribute(sharp, None, [Sample("x")]), ValueError) == (
        "attribute needs a tokenizer (or a LoadedModel, which has one)"
    )
    assert _error(lambda: attribute(sharp, tokenizer, [Sample("x")], AttributionConfig(max_length=41))) == (
        "max_length: 41 is more than the model's 40 positions"
    )
    assert attribute(sharp, tokenizer, [Sample("x")], AttributionConfig(max_length=40, queries=1, probes=1)).num_samples
    assert _error(lambda: attribute(sharp, tokenizer, iter(()), AttributionConfig(max_length=16))) == (
        "corpus: the corpus yielded no samples: nothing to attribute"
    )
    skipping = _EmbeddingsOnly(sharp.config).eval()
    assert _error(lambda: attribute(skipping, tokenizer, [Sample("x")], AttributionConfig(max_length=16))) == (
        "model: _EmbeddingsOnly ran without calling headcat's attention probe, so headcat cannot take gradients "
        "through its heads"
    )


def test_metadata_and_rates_of_a_result() -> None:
    config = AttributionConfig(samples=3)
    result = AttributionResult(
        stack="encoder",
        global_vectors=np.zeros((2, 3, 21)),
        global_scalars={},
        local_vectors=np.zeros((2, 3, 21)),
        discrepancy=np.array([[0.1, 0.2, 0.3], [0.5, 0.5, 0.8]]),
        example_attention=np.zeros((2, 3, 1, 1), dtype=np.float32),
        example_attribution=np.zeros((2, 3, 1, 1), dtype=np.float32),
        example_tokens=["[CLS]", "[SEP]"],
        example_queries=[0, 1],
        num_samples=3,
        num_tokens=40,
        rows=60,
        triples=120,
        passes=12,
        seconds=4.0,
        device="cpu",
        dtype="float32",
        config=config,
        feature_names=["w0"],
    )
    assert result.triples_per_second == 30.0
    assert result.rows_per_second == 15.0
    assert math.isnan(dataclasses.replace(result, seconds=0.0).triples_per_second)
    assert math.isnan(dataclasses.replace(result, seconds=0.0).rows_per_second)
    layer = result.layer_discrepancy()
    assert layer == pytest.approx([0.2, 0.6], abs=1e-15)
    assert all(type(v) is float for v in layer)
    assert result.metadata() == {
        "config": config.to_json(),
        "stack": "encoder",
        "feature_names": ["w0"],
        "num_samples": 3,
        "num_tokens": 40,
        "rows": 60,
        "triples": 120,
        "passes": 12,
        "seconds": 4.0,
        "rows_per_second": 15.0,
        "triples_per_second": 30.0,
        "layer_discrepancy": layer,
        "example_tokens": ["[CLS]", "[SEP]"],
        "example_queries": [0, 1],
        "device": "cpu",
        "dtype": "float32",
    }


class _FirstLayerInForwardMode(BertModel):
    """Both layers in its first two forwards (the shape probe, the attention rows); then layer 0 only."""

    calls = 0

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None, **_: Any) -> Any:
        self.calls += 1
        if self.calls <= 2:
            return super().forward(input_ids=input_ids, attention_mask=attention_mask)
        return self.encoder.layer[0](self.embeddings(input_ids=input_ids))


def test_a_forward_mode_pass_that_misses_a_layer_is_refused_in_full() -> None:
    """The plain forward sees both layers; the forward-mode pass never reaches layer 1's heads: the error names it."""
    torch.manual_seed(0)
    model = _FirstLayerInForwardMode(_bert_config(vocab_size=60, max_position_embeddings=32)).eval()
    ids = torch.tensor([[2, 17, 40, 3]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    model.calls = 1  # the plain forward is the second
    found = _error(lambda: attribute_sample(model, batch, None, torch.ones(1, HIDDEN)), RuntimeError)
    assert found == "no head output reached layers [1] in the forward-mode pass"


class _MaskReader(BertModel):
    """A BERT whose forward needs its attention mask (no default) and records the mask of each call."""

    seen: list[tuple[list[int], list[int]]]

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: Any = None, **_: Any
    ) -> Any:
        self.seen.append((list(input_ids.shape), attention_mask.flatten().tolist()))
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)


def test_every_forward_of_a_run_is_given_an_all_ones_mask(sharp: BertModel, tokenizer: Any) -> None:
    """The shape probe (2 tokens), the sample's forward and the forward-mode pass: each with a mask of ones."""
    reader = _MaskReader(sharp.config).eval()
    reader.seen = []
    config = AttributionConfig(samples=1, max_length=16, queries=2, probes=1)
    attribute(reader, tokenizer, [Sample("A cat sat.")], config)
    length = len(tokenizer("A cat sat.")["input_ids"])  # [CLS] a cat sat . [SEP]
    assert reader.seen == [([1, 2], [1, 1]), ([1, length], [1] * length), ([1, length], [1] * length)]
