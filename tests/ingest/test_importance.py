"""Head importance against independent references: finite differences of the loss through a hook
on the output projection (plain eager transformers, no headcat gate), Michel's normalisation by
hand, and pruning checked by a hook that sees what reaches the output projection."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ingest.ablation import Ablator
from ingest.evaluation import Evaluator
from ingest.importance import (
    TYPE_ORDER,
    ImportanceConfig,
    ImportanceError,
    LossBatch,
    head_importance,
    loss_batches,
    normalize_by_layer,
    prune_order,
    prune_spec,
    pruning_curve,
    score_evaluator,
    step_counts,
)
from ingest.tasks import ClassificationExample, QAExample

LAYERS, HEADS = 2, 4
EPS = 1e-4  # central differences in float64: truncation ~EPS**2, rounding ~1e-16 / EPS

SENTENCES = [
    ("the film is a joy from start to finish .", 1),
    ("dull , flat and far too long", 0),
    ("a sharp , funny script with real heart", 1),
    ("nothing here works , not even the music", 0),
    ("it looks great", 1),
]


def _config(**kw):
    from transformers import BertConfig

    return BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=HEADS,  # type: ignore[call-arg]
                      intermediate_size=64, max_position_embeddings=512, attn_implementation="eager",
                      **kw)  # fmt: skip


def _sharpen(model: torch.nn.Module) -> torch.nn.Module:
    """Scale the query and key weights so that heads attend differently (default init is near uniform)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".attention.self.query." in name or ".attention.self.key." in name:
                param.mul_(6.0)
    return model.double().eval().requires_grad_(False)


@pytest.fixture(scope="module")
def tokenizer(minilm_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path)


@pytest.fixture(scope="module")
def classifier():
    from transformers import BertForSequenceClassification

    torch.manual_seed(1)
    return _sharpen(BertForSequenceClassification(_config(num_labels=2)))


@pytest.fixture(scope="module")
def qa_model():
    from transformers import BertForQuestionAnswering

    torch.manual_seed(2)
    return _sharpen(BertForQuestionAnswering(_config()))


@pytest.fixture(scope="module")
def mlm():
    from transformers import BertForMaskedLM

    torch.manual_seed(3)
    return _sharpen(BertForMaskedLM(_config()))


@pytest.fixture(scope="module")
def encoder():
    from transformers import BertModel

    torch.manual_seed(4)
    return _sharpen(BertModel(_config()))


def _examples() -> list[ClassificationExample]:
    return [ClassificationExample(text, None, label) for text, label in SENTENCES]


# --------------------------------------------------------------------------------------------
# The independent reference: scale one head's slice of the output projection's input
# --------------------------------------------------------------------------------------------


def _scaled_head(model, layer: int, head: int, factor: float):
    """A forward pre-hook on layer ``layer``'s attention output projection scaling head ``head``'s
    context (its ``head_dim`` columns): the eager model, no headcat code involved."""
    bert = model.base_model
    dense = bert.encoder.layer[layer].attention.output.dense
    width = model.config.hidden_size // model.config.num_attention_heads

    def hook(_module, args):
        (x,) = args
        x = x.clone()
        x[..., head * width : (head + 1) * width] *= factor
        return (x,)

    return dense.register_forward_pre_hook(hook)


def _fd_importance(model, batches: list[LossBatch], loss_of) -> np.ndarray:
    """mean over examples of |(loss(1 + eps) - loss(1 - eps)) / 2 eps|, one example at a time."""
    out = np.zeros((LAYERS, HEADS))
    n = 0
    for batch in batches:
        for j in range(batch.size):
            real = batch.inputs["attention_mask"][j].bool()
            one = LossBatch(
                {name: value[j : j + 1, real] for name, value in batch.inputs.items()},
                {name: (value[j : j + 1, real] if value.dim() == 2 else value[j : j + 1])
                 for name, value in batch.targets.items()},
            )  # fmt: skip
            n += 1
            for layer in range(LAYERS):
                for head in range(HEADS):
                    values = []
                    for factor in (1 + EPS, 1 - EPS):
                        handle = _scaled_head(model, layer, head, factor)
                        try:
                            with torch.no_grad():
                                values.append(float(loss_of(model(**one.inputs), one)))
                        finally:
                            handle.remove()
                    out[layer, head] += abs(values[0] - values[1]) / (2 * EPS)
    return out / n


# --------------------------------------------------------------------------------------------
# Gradient = finite difference
# --------------------------------------------------------------------------------------------


def test_task_importance_is_the_finite_difference_of_the_loss(classifier, tokenizer) -> None:
    evaluator = Evaluator.for_task("classification", classifier, tokenizer, _examples(), batch_size=2, cache=False)
    config = ImportanceConfig("task")
    result = score_evaluator(evaluator, config)
    batches = loss_batches(evaluator, config)

    def loss_of(output, batch):
        return torch.nn.functional.cross_entropy(output.logits, batch.targets["labels"])

    expected = _fd_importance(classifier, batches, loss_of)
    got = result.raw["encoder"]
    assert got.shape == (LAYERS, HEADS)
    assert result.n_examples == len(SENTENCES)
    assert expected.std() > 0.1 * expected.mean()  # the heads really differ
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-12)
    # the absolute value is taken per example: |mean gradient| would be smaller for some head
    signed = []
    for batch in batches:
        from ingest.attention import AttentionProbe
        from ingest.importance import HeadGate

        gate = HeadGate()
        with torch.enable_grad(), AttentionProbe(classifier, lambda _: None, on_output=gate):
            output = classifier(**batch.inputs)
            loss = torch.nn.functional.cross_entropy(output.logits, batch.targets["labels"], reduction="sum")
            grads = torch.autograd.grad(loss, list(gate.gates.values()))
        signed.append(torch.stack([g.sum(0) for g in grads]))
    assert (torch.stack(signed).sum(0).abs().numpy() / len(SENTENCES) < got - 1e-9).any()


def test_squad_importance_is_the_finite_difference_of_the_loss(qa_model, tokenizer) -> None:
    context = "The cat sat on the mat near the red door of the old house."
    examples = [
        QAExample("a", "Where did the cat sit?", context, ("on the mat",), (context.index("on the mat"),), "t", 0),
        QAExample("b", "What colour was the door?", context, ("red",), (context.index("red"),), "t", 0),
        QAExample("c", "Which house?", context, ("the old house",), (context.index("the old house"),), "t", 0),
    ]
    evaluator = Evaluator.for_task("squad", qa_model, tokenizer, examples, batch_size=2, cache=False)
    config = ImportanceConfig("task")
    batches = loss_batches(evaluator, config)
    answers = {
        tokenizer.decode(row[s : e + 1])
        for b in batches
        for row, s, e in zip(b.inputs["input_ids"].tolist(), b.targets["start"], b.targets["end"], strict=True)
    }
    assert answers == {"on the mat", "red", "the old house"}  # the positions point at the gold answers

    def loss_of(output, batch):
        ce = torch.nn.functional.cross_entropy
        return (ce(output.start_logits, batch.targets["start"]) + ce(output.end_logits, batch.targets["end"])) / 2

    expected = _fd_importance(qa_model, batches, loss_of)
    np.testing.assert_allclose(score_evaluator(evaluator, config).raw["encoder"], expected, rtol=1e-6, atol=1e-12)


def test_masked_lm_importance_is_the_finite_difference_of_the_loss(mlm, tokenizer) -> None:
    texts = [text for text, _ in SENTENCES]
    evaluator = Evaluator.for_task("drift", mlm, tokenizer, texts, batch_size=2, cache=False)
    config = ImportanceConfig("lm", seed=7)
    batches = loss_batches(evaluator, config)
    masked = torch.cat([(b.targets["lm_labels"] != -100).flatten() for b in batches])
    real = torch.cat([(b.inputs["attention_mask"] == 1).flatten() for b in batches])
    assert 0 < masked.sum() < real.sum()
    # the mask is the example's own, whatever the batching
    again = loss_batches(Evaluator.for_task("drift", mlm, tokenizer, texts, batch_size=5, cache=False), config)
    assert int(masked.sum()) == int((again[0].targets["lm_labels"] != -100).sum())

    def loss_of(output, batch):
        labels = batch.targets["lm_labels"]
        return torch.nn.functional.cross_entropy(output.logits[labels != -100], labels[labels != -100])

    expected = _fd_importance(mlm, batches, loss_of)
    np.testing.assert_allclose(score_evaluator(evaluator, config).raw["encoder"], expected, rtol=1e-6, atol=1e-12)


@pytest.mark.slow
def test_sensitivity_estimates_the_norm_of_the_hidden_state_jacobian(encoder, tokenizer) -> None:
    texts = [text for text, _ in SENTENCES[:3]]
    evaluator = Evaluator.for_task("drift", encoder, tokenizer, texts, batch_size=3, cache=False)
    result = score_evaluator(evaluator, ImportanceConfig("sensitivity", probes=400, seed=0))
    expected = np.zeros((LAYERS, HEADS))
    for text in texts:
        one = tokenizer(text, return_tensors="pt")
        for layer in range(LAYERS):
            for head in range(HEADS):
                states = []
                for factor in (1 + EPS, 1 - EPS):
                    handle = _scaled_head(encoder, layer, head, factor)
                    with torch.no_grad():
                        states.append(encoder(**one).last_hidden_state)
                    handle.remove()
                expected[layer, head] += float(((states[0] - states[1]) / (2 * EPS)).norm()) / len(texts)
    # a Monte Carlo estimate: K = 400 probes give about 3.5 % relative spread per example
    np.testing.assert_allclose(result.raw["encoder"], expected, rtol=0.12)


# --------------------------------------------------------------------------------------------
# Normalisation, rankings, steps
# --------------------------------------------------------------------------------------------


def test_normalisation_is_per_layer_l2() -> None:
    scores = np.array([[3.0, 4.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    got = normalize_by_layer(scores)
    np.testing.assert_allclose(got[0], [0.6, 0.8, 0.0])
    np.testing.assert_allclose(got[1], [1 / np.sqrt(3)] * 3)
    np.testing.assert_array_equal(got[2], [0.0, 0.0, 0.0])  # a silent layer stays 0, no NaN


def test_result_normalised_scores_are_the_raw_ones_per_layer(classifier, tokenizer) -> None:
    evaluator = Evaluator.for_task("classification", classifier, tokenizer, _examples(), batch_size=5, cache=False)
    result = score_evaluator(evaluator, ImportanceConfig("task"))
    raw, norm = result.raw["encoder"], result.normalized["encoder"]
    for layer in range(LAYERS):
        np.testing.assert_allclose(norm[layer], raw[layer] / np.sqrt((raw[layer] ** 2).sum()))
        np.testing.assert_allclose((norm[layer] ** 2).sum(), 1.0)


def test_rankings() -> None:
    scores = np.array([[0.5, 0.1], [0.9, 0.3]])
    assert prune_order("importance", 2, 2, scores=scores) == [(0, 1), (1, 1), (0, 0), (1, 0)]
    assert prune_order("-importance", 2, 2, scores=scores) == [(1, 0), (0, 0), (1, 1), (0, 1)]
    random = prune_order("random", 2, 2, seed=3)
    assert sorted(random) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert random == prune_order("random", 2, 2, seed=3)
    assert any(prune_order("random", 2, 2, seed=s) != random for s in range(4, 10))
    types = {(0, 0): "diagonal", (0, 1): "dense", (1, 0): "vertical", (1, 1): "vertical"}
    assert prune_order("type", 2, 2, types=types) == [(1, 0), (1, 1), (0, 1), (0, 0)]
    assert TYPE_ORDER[0] == "vertical"
    assert TYPE_ORDER[-1] == "diagonal"
    with pytest.raises(ImportanceError, match="type"):
        prune_order("type", 2, 2, types={(0, 0): "dense"})
    with pytest.raises(ImportanceError, match="score"):
        prune_order("importance", 2, 2)


def test_the_random_and_type_rankings_ignore_the_scores_the_job_passes() -> None:
    """The pruning job hands every ranking the importance scores; only the importance rankings may read them.
    With scores at hand, ``random`` is still the seed's permutation (not the importance order) and ``type``
    still the type order."""
    scores = np.arange(12, dtype=np.float64)[::-1].reshape(3, 4) / 12  # descending: ascending order is reversed
    ascending = prune_order("importance", 3, 4, scores=scores)
    for seed in range(5):
        random = prune_order("random", 3, 4, seed=seed)
        assert prune_order("random", 3, 4, scores=scores, seed=seed) == random
        assert prune_order("random", 3, 4, scores=-scores, seed=seed) == random
        assert random != ascending
    types = {(layer, head): TYPE_ORDER[(layer + head) % 4] for layer in range(3) for head in range(4)}
    assert prune_order("type", 3, 4, scores=scores, types=types) == prune_order("type", 3, 4, types=types)


def test_step_counts() -> None:
    assert step_counts(72, 10) == [0, 4, 7, 11, 14, 18, 22, 25, 29, 32, 36]
    assert step_counts(8, 1, 1.0) == [0, 8]
    with pytest.raises(ImportanceError, match="steps"):
        step_counts(72, 0)


# --------------------------------------------------------------------------------------------
# Pruning really removes the head
# --------------------------------------------------------------------------------------------


def test_a_ranking_that_prunes_x_first_zeroes_x(classifier, tokenizer) -> None:
    target = (1, 2)
    scores = np.ones((LAYERS, HEADS))
    scores[target] = 0.0
    order = prune_order("importance", LAYERS, HEADS, scores=scores)
    assert order[0] == target
    spec = prune_spec(order[:1], LAYERS, HEADS)
    seen: dict[int, torch.Tensor] = {}
    width = classifier.config.hidden_size // HEADS
    handles = [
        classifier.base_model.encoder.layer[layer].attention.output.dense.register_forward_pre_hook(
            lambda _m, args, layer=layer: seen.__setitem__(layer, args[0].detach().clone())
        )
        for layer in range(LAYERS)
    ]
    batch = tokenizer([text for text, _ in SENTENCES], padding=True, return_tensors="pt")
    try:
        with torch.no_grad():
            classifier(**batch)
            before = {k: v.clone() for k, v in seen.items()}
            with Ablator(classifier, spec) as ablator:
                ablator.set_batch(batch["attention_mask"])
                classifier(**batch)
    finally:
        for handle in handles:
            handle.remove()
    layer, head = target
    columns = slice(head * width, (head + 1) * width)
    assert before[layer][..., columns].abs().max() > 1e-3
    assert torch.count_nonzero(seen[layer][..., columns]) == 0
    other = [h for h in range(HEADS) if h != head]
    for h in other:  # the other heads of that layer are untouched
        torch.testing.assert_close(seen[layer][..., h * width : (h + 1) * width],
                                   before[layer][..., h * width : (h + 1) * width], rtol=0, atol=0)  # fmt: skip
    torch.testing.assert_close(seen[0], before[0], rtol=0, atol=0)


def test_pruning_curve_points_share_the_baseline(classifier, tokenizer) -> None:
    evaluator = Evaluator.for_task("classification", classifier, tokenizer, _examples(), batch_size=5, cache=False)
    scores = score_evaluator(evaluator, ImportanceConfig("task")).normalized["encoder"]
    curve = pruning_curve(evaluator, "importance", steps=2, max_share=0.5, scores=scores)
    assert [p.pruned for p in curve.points] == [0, 2, 4]
    assert curve.points[0].metrics == dict(evaluator.baseline().values)
    assert list(curve.order) == prune_order("importance", LAYERS, HEADS, scores=scores)[:4]
    assert set(curve.points[1].heads) == set(curve.order[:2])
    assert curve.points[2].metrics == dict(evaluator.run(prune_spec(curve.order[:4], LAYERS, HEADS)).values)
    iterative = pruning_curve(evaluator, "importance", steps=2, max_share=0.5, scores=scores, iterative=True)
    assert iterative.iterative
    assert iterative.order[:2] == curve.order[:2]
    assert len(set(iterative.order)) == 4
    # the re-scored importance of pruned heads is 0
    again = score_evaluator(evaluator, ImportanceConfig("task"), pruned=[("encoder", *h) for h in iterative.order[:2]])
    for layer, head in iterative.order[:2]:
        assert again.raw["encoder"][layer, head] == 0.0


def test_losses_the_model_cannot_compute_are_refused(encoder, classifier, tokenizer) -> None:
    texts = [text for text, _ in SENTENCES]
    evaluator = Evaluator.for_task("drift", encoder, tokenizer, texts, cache=False)
    with pytest.raises(ImportanceError, match="task loss"):
        score_evaluator(evaluator, ImportanceConfig("task"))
    with pytest.raises(ImportanceError, match="LM head"):
        score_evaluator(evaluator, ImportanceConfig("lm"))
    on_classifier = Evaluator.for_task("drift", classifier, tokenizer, texts, cache=False)
    with pytest.raises(ImportanceError, match="labelled"):
        score_evaluator(on_classifier, ImportanceConfig("task"))
    with pytest.raises(ImportanceError):
        ImportanceConfig("nope")  # type: ignore[arg-type]
    with pytest.raises(ImportanceError, match="no examples"):
        head_importance(classifier, [], ImportanceConfig("task"))
