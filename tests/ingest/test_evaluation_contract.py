"""The metrics and the Evaluator of ``ingest/evaluation.py`` against values computed here, not by headcat.

- accuracy and F1 against ``sklearn.metrics``; KL and token cosine against numpy in float64;
- every task of the Evaluator on tiny random BERTs (the word-level tokenizer and model builder of
  ``test_architectures.py``): classification metrics from a plain forward pass per example and
  scikit-learn; SQuAD answers from a brute-force search over each window's top-n starts and ends
  of a plain forward pass (the ``run_qa`` recipe written as loops); every drift (class logits,
  per-token logits, start/end logits, last hidden states) from the hand-run of the surgery in
  ``tests/surgery.py``, one unpadded sample at a time;
- the padded batches, segments and caching written out by hand.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import transformers as tf
from sklearn import metrics as skm
from tokenizers import Regex, normalizers

from ingest import evaluation
from ingest.ablation import AblationSpec, HeadSelection, PlanRow
from ingest.evaluation import (
    Evaluator,
    Metrics,
    Outcome,
    classification_scores,
    kl_divergence,
    mean_token_cosine,
    run_plan,
    squad_scores,
)
from ingest.tasks import ClassificationExample, QAExample, TaskDataError
from tests.ingest.test_architectures import BERT_TEMPLATE, ENCODER, FAMILIES, VOCAB, Family, build, tokenizer
from tests.surgery import Ops, hand_run

# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_labels", [2, 3, 4])
def test_classification_scores_equal_sklearn(num_labels: int) -> None:
    rng = np.random.default_rng(num_labels)
    labels = rng.integers(0, num_labels, 40)
    predictions = np.where(rng.random(40) < 0.6, labels, rng.integers(0, num_labels, 40))
    if num_labels == 4:
        predictions[predictions == 3] = 0  # a class never predicted: its F1 is 0
    scores = classification_scores(predictions, labels, num_labels)
    assert scores["accuracy"] == pytest.approx(100 * skm.accuracy_score(labels, predictions))
    expected = (
        skm.f1_score(labels, predictions, pos_label=1, average="binary")
        if num_labels == 2
        else skm.f1_score(labels, predictions, labels=list(range(num_labels)), average="macro", zero_division=0)
    )
    assert scores["f1"] == pytest.approx(100 * expected)


def test_classification_scores_edge_cases() -> None:
    # two labels: the positive class is 1, whatever the counts of class 0
    assert classification_scores(np.array([0, 0, 1]), np.array([0, 1, 1]), 2) == pytest.approx(
        {"accuracy": 100 * 2 / 3, "f1": 100 * 2 / 3}
    )
    # never a true positive: F1 0, not a division by zero
    assert classification_scores(np.array([0, 0]), np.array([1, 1]), 2) == {"accuracy": 0.0, "f1": 0.0}
    # three labels, one absent from both: macro over all three (2/3 of the classes perfect)
    assert classification_scores(np.array([0, 1]), np.array([0, 1]), 3) == pytest.approx(
        {"accuracy": 100.0, "f1": 100 * 2 / 3}
    )
    assert classification_scores(np.array([], dtype=np.int64), np.array([], dtype=np.int64), 2) == {
        "accuracy": 0.0,
        "f1": 0.0,
    }
    assert squad_scores({"q": "x"}, []) == {"exact_match": 0.0, "f1": 0.0}


def test_a_missing_squad_prediction_scores_0() -> None:
    """As in evaluate-v1.1.py (a question without a prediction counts 0), even against a gold answer that
    normalises to nothing ("The"), which an empty prediction matches."""
    examples = [
        QAExample("q1", "?", "The", ("The",), (0,), "t", 0),
        QAExample("q2", "?", "x y", ("x y",), (0,), "t", 0),
    ]
    assert squad_scores({}, examples) == {"exact_match": 0.0, "f1": 0.0}
    assert squad_scores({"q2": "y"}, examples) == pytest.approx({"exact_match": 0.0, "f1": 100 / 3})  # the next counts
    # q1: "" and "The" both normalise to "" (exact, F1 0: no token); q2: F1 of "y" against "x y" is 2/3
    assert squad_scores({"q1": "", "q2": "y"}, examples) == pytest.approx({"exact_match": 50.0, "f1": 100 / 3})


def _kl_numpy(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    p = np.exp(p_logits - p_logits.max()) / np.exp(p_logits - p_logits.max()).sum()
    q = np.exp(q_logits - q_logits.max()) / np.exp(q_logits - q_logits.max()).sum()
    return float((p * np.log(p / q)).sum())


def test_kl_divergence_equals_numpy_in_float64() -> None:
    rng = np.random.default_rng(0)
    reference = rng.normal(size=(2, 3, 5)) * 2
    ablated = rng.normal(size=(2, 3, 5)) * 2
    found = kl_divergence(torch.from_numpy(reference), torch.from_numpy(ablated))
    assert found.dtype == torch.float32
    assert found.shape == (2, 3)
    expected = [[_kl_numpy(reference[b, i], ablated[b, i]) for i in range(3)] for b in range(2)]
    np.testing.assert_allclose(found.numpy(), expected, rtol=1e-5, atol=1e-7)
    # the same over a mask of entries (a different one per row); masked entries take no part
    mask = torch.from_numpy(rng.random((2, 3, 5)) < 0.7)
    mask[..., 0] = True
    found = kl_divergence(torch.from_numpy(reference), torch.from_numpy(ablated), mask)
    keep = mask.numpy()
    expected = [[_kl_numpy(reference[b, i][keep[b, i]], ablated[b, i][keep[b, i]]) for i in range(3)] for b in range(2)]
    np.testing.assert_allclose(found.numpy(), expected, rtol=1e-5, atol=1e-7)
    # low-precision logits are compared in float32 (bfloat16's own softmax is off by ~1e-2)
    low = kl_divergence(torch.from_numpy(reference).bfloat16(), torch.from_numpy(ablated).bfloat16())
    rounded = [
        [
            _kl_numpy(
                torch.from_numpy(reference[b, i]).bfloat16().double().numpy(),
                torch.from_numpy(ablated[b, i]).bfloat16().double().numpy(),
            )
            for i in range(3)
        ]
        for b in range(2)
    ]
    assert low.dtype == torch.float32
    np.testing.assert_allclose(low.numpy(), rounded, rtol=1e-5, atol=1e-6)


def test_mean_token_cosine_equals_numpy() -> None:
    rng = np.random.default_rng(1)
    reference = rng.normal(size=(3, 4, 6))
    ablated = reference + rng.normal(size=(3, 4, 6))
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # one real token; none
    found = mean_token_cosine(torch.from_numpy(reference), torch.from_numpy(ablated), torch.from_numpy(mask))
    assert found.dtype == torch.float32
    cosines = (reference * ablated).sum(-1) / np.linalg.norm(reference, axis=-1) / np.linalg.norm(ablated, axis=-1)
    expected = [cosines[0, :3].mean(), cosines[1, 0], 0.0]
    np.testing.assert_allclose(found.numpy(), expected, rtol=1e-6, atol=1e-7)


def test_metrics_and_outcome_to_dict() -> None:
    metrics = Metrics("classification", 3, {"accuracy": np.float32(50.0), "kl": 0.25})  # type: ignore[dict-item]
    baseline = Metrics("classification", 3, {"accuracy": 75.0, "kl": 0.0})
    assert metrics["kl"] == 0.25
    assert metrics.to_dict() == {"task": "classification", "n_examples": 3, "accuracy": 50.0, "kl": 0.25}
    assert type(metrics.to_dict()["accuracy"]) is float
    outcome = Outcome("prune.x", "Prune x", {"ops": {}}, metrics, baseline, 1.5, 3, paper_ref="T2.2")
    assert outcome.to_dict() == {
        "row_id": "prune.x",
        "label": "Prune x",
        "paper_ref": "T2.2",
        "spec": {"ops": {}},
        "metrics": {"task": "classification", "n_examples": 3, "accuracy": 50.0, "kl": 0.25},
        "baseline": {"task": "classification", "n_examples": 3, "accuracy": 75.0, "kl": 0.0},
        "seconds": 1.5,
        "n_examples": 3,
    }
    assert Outcome("a", "b", {}, metrics, baseline, 0.0, 3).to_dict()["paper_ref"] is None


# --------------------------------------------------------------------------------------------
# Tiny models over the word-level vocabulary
# --------------------------------------------------------------------------------------------


def bert(model_class: Any, **config: Any) -> Any:
    """A tiny random BERT of ``model_class`` (2 layers x 4 heads), eager, with peaked attention; its values,
    attention outputs and task head scaled up, so that its outputs differ between examples and move under
    an ablation (a random BERT's residual stream otherwise drowns what attention adds)."""
    model = build(
        Family("bert", lambda: model_class(tf.BertConfig(**{**ENCODER, **config})), BERT_TEMPLATE, {}, ("", 0, 0, ""))
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "attention.self.value." in name or "attention.output.dense." in name:
                parameter.mul_(10.0)
            elif name.startswith(("classifier.", "qa_outputs.")):
                parameter.mul_(30.0)
    return model


@pytest.fixture(scope="module")
def tok() -> Any:
    return tokenizer(BERT_TEMPLATE, type_ids=True)


@pytest.fixture(scope="module")
def qa_tok() -> Any:
    """The same, but leading spaces of a text become an [UNK] token (as a byte-level BPE gives them a token):
    a question's leading spaces, which the run_qa recipe strips, would change its tokens."""
    qa = tokenizer(BERT_TEMPLATE, type_ids=True)
    qa.backend_tokenizer.normalizer = normalizers.Replace(Regex("^ +"), "[UNK] ")
    return qa


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    Evaluator.clear_cache()
    yield
    Evaluator.clear_cache()


def encode(tok: Any, text: str, pair: str | None = None, max_length: int = 128) -> dict[str, torch.Tensor]:
    return dict(tok(text, pair, truncation=True, max_length=max_length, return_tensors="pt"))


def forward(model: Any, inputs: dict[str, torch.Tensor], ops: Ops | None) -> Any:
    """The plain model on one unpadded sample, or the hand-run surgery of ``ops``."""
    if not ops:
        with torch.no_grad():
            return model(**inputs)
    layers = model.encoder.layer if isinstance(model, tf.BertModel) else model.bert.encoder.layer
    return hand_run(model, layers, inputs, ops)


def kl_rows(base: torch.Tensor, edited: torch.Tensor) -> np.ndarray:
    """KL(softmax(base) || softmax(edited)) of each row, in float64."""
    b, e = base.double().numpy(), edited.double().numpy()
    return np.array([_kl_numpy(b[i], e[i]) for i in range(len(b))])


PRUNE: Ops = {(0, 1): "prune", (1, 2): "prune", (1, 3): "uniform"}
SPEC = AblationSpec.from_heads({(0, 1): "prune", (1, 2): "prune", (1, 3): "uniform"}, 2, 4)
DROP: Ops = {(0, h): "drop_inter" for h in range(4)} | {(1, h): "drop_intra" for h in range(2)}
DROP_SPEC = AblationSpec.from_heads(DROP, 2, 4)  # type: ignore[arg-type]
UNIFORM: Ops = {(layer, head): "uniform" for layer in range(2) for head in range(4)}
UNIFORM_SPEC = AblationSpec.from_heads(UNIFORM, 2, 4)  # type: ignore[arg-type]

WORDS = "the a cat dog sat on mat ran far away it was red blue big small and then".split()
PAIRS = [
    ClassificationExample("the cat sat on the mat .", "it was red .", 1),
    ClassificationExample("a dog ran far away", "then the dog was big , and then it ran", 0),
    ClassificationExample("it was small", "the small red cat sat on a mat", 1),
    ClassificationExample("then a big blue dog ran away .", "it ran", 2),
    ClassificationExample("the mat was red", "a cat", 0),
    ClassificationExample("a cat sat", "the dog sat , the cat ran . it was far away , and then it was big", 2),
    ClassificationExample("it ran far", "far", 1),
]


# --------------------------------------------------------------------------------------------
# Classification
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_labels", [2, 3])
def test_classification_metrics_and_kl_equal_plain_runs(tok: Any, num_labels: int) -> None:
    model = bert(tf.BertForSequenceClassification, num_labels=num_labels)
    data = [e._replace(label=e.label % num_labels) for e in PAIRS]
    evaluator = Evaluator.for_task("classification", model, tok, data, limit=6, batch_size=4, max_length=12)
    assert evaluator.n_examples == 6
    data = data[:6]
    for spec, ops in ((AblationSpec.empty(2, 4), None), (SPEC, PRUNE), (DROP_SPEC, DROP)):
        found = evaluator.run(spec)
        base = [forward(model, encode(tok, e.text, e.text_pair, 12), None).logits[0] for e in data]
        edited = [forward(model, encode(tok, e.text, e.text_pair, 12), ops).logits[0] for e in data]
        predicted = [int(logits.argmax()) for logits in edited]
        labels = [e.label for e in data]
        average = "binary" if num_labels == 2 else "macro"
        f1 = skm.f1_score(labels, predicted, labels=list(range(num_labels)), average=average, zero_division=0)
        expected = {"accuracy": 100 * skm.accuracy_score(labels, predicted), "f1": 100 * f1}
        expected["kl"] = float(kl_rows(torch.stack(base), torch.stack(edited)).mean())
        assert found.task == "classification"
        assert found.n_examples == 6
        assert dict(found.values) == pytest.approx(expected, rel=1e-4, abs=1e-6), ops
    assert len({int(logits.argmax()) for logits in base}) > 1  # the data tells predictions apart


def test_classification_truncates_at_128_tokens_by_default(tok: Any) -> None:
    model = bert(tf.BertForSequenceClassification, num_labels=2, max_position_embeddings=160)
    long = " ".join(WORDS[i % len(WORDS)] for i in range(140))
    data = [ClassificationExample(long, None, 1), ClassificationExample("the cat", None, 0)]
    found = Evaluator.for_task("classification", model, tok, data).run(SPEC)
    kls = [
        kl_rows(forward(model, encode(tok, text), None).logits, forward(model, encode(tok, text), PRUNE).logits)[0]
        for text in (long, "the cat")
    ]
    assert found["kl"] == pytest.approx(float(np.mean(kls)), rel=1e-4)


# --------------------------------------------------------------------------------------------
# Drift of every output kind
# --------------------------------------------------------------------------------------------

TEXTS = ["the cat sat on the mat .", "a dog", "it was red , and then it ran far away .", "big"]


def test_drift_of_class_logits_per_token_logits_spans_and_hidden_states(tok: Any) -> None:
    for model_class in (tf.BertForSequenceClassification, tf.BertForTokenClassification, tf.BertForQuestionAnswering):
        model = bert(model_class, num_labels=2 if model_class is tf.BertForQuestionAnswering else 3)
        found = Evaluator.for_task("drift", model, tok, TEXTS, batch_size=3).run(SPEC)
        kls = []
        for text in TEXTS:
            base, edited = forward(model, encode(tok, text), None), forward(model, encode(tok, text), PRUNE)
            if model_class is tf.BertForQuestionAnswering:
                start = kl_rows(base.start_logits, edited.start_logits)
                end = kl_rows(base.end_logits, edited.end_logits)
                kls.append(0.5 * (start[0] + end[0]))
            else:
                kls.append(kl_rows(base.logits.reshape(-1, 3), edited.logits.reshape(-1, 3)).mean())
        assert found.task == "drift"
        assert found.n_examples == 4
        assert dict(found.values) == pytest.approx({"kl": float(np.mean(kls))}, rel=1e-4), model_class.__name__
    model = bert(tf.BertModel)
    found = Evaluator.for_task("drift", model, tok, TEXTS, batch_size=3).run(SPEC)
    cosines = []
    for text in TEXTS:
        base, edited = forward(model, encode(tok, text), None), forward(model, encode(tok, text), PRUNE)
        b, e = base.last_hidden_state[0].double().numpy(), edited.last_hidden_state[0].double().numpy()
        cosines.append(((b * e).sum(-1) / np.linalg.norm(b, axis=-1) / np.linalg.norm(e, axis=-1)).mean())
    assert dict(found.values) == pytest.approx({"cosine": float(np.mean(cosines))}, rel=1e-5)
    assert found["cosine"] < 0.999


def test_drift_of_token_logits_over_one_real_token(tok: Any) -> None:
    """A tokenizer that adds no special token: a one-word text has one real token, its KL is that token's."""
    bare = tokenizer(None, type_ids=False)
    model = bert(tf.BertForTokenClassification, num_labels=3)
    texts = ["big", "the cat sat on the mat"]
    found = Evaluator.for_task("drift", model, bare, texts).run(SPEC)
    kls = []
    for text in texts:
        inputs = dict(bare(text, return_tensors="pt"))
        inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
        base, edited = forward(model, inputs, None), forward(model, inputs, PRUNE)
        kls.append(kl_rows(base.logits[0], edited.logits[0]).mean())
    assert len(bare("big")["input_ids"]) == 1
    assert found["kl"] == pytest.approx(float(np.mean(kls)), rel=1e-4)


def test_drift_of_text_pairs_drops_the_segments_of_the_token_types(tok: Any) -> None:
    model = bert(tf.BertModel)
    pairs = [(e.text, e.text_pair) for e in PAIRS[:4]]
    found = Evaluator.for_task("drift", model, tok, pairs, batch_size=3).run(DROP_SPEC)
    cosines = []
    for text, pair in pairs:
        base, edited = forward(model, encode(tok, text, pair), None), forward(model, encode(tok, text, pair), DROP)
        b, e = base.last_hidden_state[0].double().numpy(), edited.last_hidden_state[0].double().numpy()
        cosines.append(((b * e).sum(-1) / np.linalg.norm(b, axis=-1) / np.linalg.norm(e, axis=-1)).mean())
    assert found["cosine"] == pytest.approx(float(np.mean(cosines)), rel=1e-5)


# --------------------------------------------------------------------------------------------
# SQuAD: the run_qa recipe in loops
# --------------------------------------------------------------------------------------------

CONTEXT = "the cat sat on the mat . it was red , and then it ran far away . a big blue dog sat on a small mat ."
QUESTIONS = [
    QAExample("q0", "  what the cat", CONTEXT, ("the mat", "mat"), (15, 19), "t", 0),
    QAExample("q1", "a dog", "a big dog ran away .", ("a big dog",), (0,), "t", 0),
    QAExample("q2", "it ran", CONTEXT + " then it was big .", ("far away",), (54,), "t", 0),
    QAExample("q3", "red", "it was red", ("red",), (7,), "t", 0),
    QAExample("q4", "the mat", "the dog sat on the mat , and then the cat ran far away", ("the cat",), (0,), "t", 0),
]


def squad_reference(
    model: Any,
    tok: Any,
    examples: list[QAExample],
    ops: Ops | None,
    *,
    max_length: int,
    stride: int,
    n_best: int,
    max_answer_tokens: int,
) -> tuple[dict[str, str], float]:
    """Each question's answer (best top-n span over its windows, first window on ties) and the mean KL."""
    answers: dict[str, str] = {}
    kls: list[float] = []
    for example in examples:
        encoded = tok(example.question.lstrip(), example.context, truncation="only_second", max_length=max_length,
                      stride=stride, return_overflowing_tokens=True, return_offsets_mapping=True)  # fmt: skip
        best: tuple[float, str] | None = None
        for w in range(len(encoded["input_ids"])):
            inputs = {
                name: torch.tensor([encoded[name][w]]) for name in ("input_ids", "token_type_ids", "attention_mask")
            }
            base, out = forward(model, inputs, None), forward(model, inputs, ops)
            kl_start = kl_rows(base.start_logits, out.start_logits)[0]
            kls.append(0.5 * (kl_start + kl_rows(base.end_logits, out.end_logits)[0]))
            start, end = out.start_logits[0].tolist(), out.end_logits[0].tolist()
            in_context = [sid == 1 for sid in encoded.sequence_ids(w)]
            starts = sorted(range(len(start)), key=lambda t: -start[t])[:n_best]
            ends = sorted(range(len(end)), key=lambda t: -end[t])[:n_best]
            for s in starts:
                for e in ends:
                    if in_context[s] and in_context[e] and 0 <= e - s < max_answer_tokens:
                        score = start[s] + end[e]
                        if best is None or score > best[0]:
                            offsets = encoded["offset_mapping"][w]
                            best = (score, example.context[offsets[s][0] : offsets[e][1]])
        answers[example.id] = "" if best is None else best[1]
    return answers, float(np.mean(kls))


@pytest.mark.parametrize(("n_best", "max_answer_tokens"), [(3, 4), (1, 1)])
def test_squad_answers_and_scores_equal_the_recipe_in_loops(qa_tok: Any, n_best: int, max_answer_tokens: int) -> None:
    tok = qa_tok
    model = bert(tf.BertForQuestionAnswering)
    options: dict[str, Any] = {"max_length": 16, "stride": 5, "n_best": n_best, "max_answer_tokens": max_answer_tokens}
    evaluator = Evaluator.for_task("squad", model, tok, QUESTIONS, batch_size=3, **options)
    assert evaluator._prepared.n_features > len(QUESTIONS)  # long contexts span several windows
    baseline, _ = squad_reference(model, tok, QUESTIONS, None, **options)
    for spec, ops in ((None, None), (SPEC, PRUNE), (DROP_SPEC, DROP), (UNIFORM_SPEC, UNIFORM)):
        answers, kl = squad_reference(model, tok, QUESTIONS, ops, **options)
        assert evaluator.predictions(spec) == answers, ops
        found = evaluator.run(spec or AblationSpec.empty(2, 4))
        assert found.task == "squad"
        assert found.n_examples == 5
        expected = {**squad_scores(answers, QUESTIONS), "kl": kl if ops else 0.0}
        assert dict(found.values) == pytest.approx(expected, rel=1e-4, abs=1e-7)
    assert answers != baseline or n_best == 1  # uniform attention everywhere (the last spec) changes some answer
    if n_best == 1:
        assert "" in baseline.values()  # a question whose windows have no valid span
    assert any(len(a.split()) > 1 for a in baseline.values()) or max_answer_tokens == 1


class TableQA(tf.BertForQuestionAnswering):
    """A QA model whose start and end logits are looked up per token (:meth:`set_logits`); its BERT still runs,
    so the probe sees its attention. Answers written by hand."""

    table: torch.Tensor

    def set_logits(self, start: dict[str, float], end: dict[str, float]) -> TableQA:
        table = torch.zeros(2, self.config.vocab_size)
        for row, values in enumerate((start, end)):
            for word, value in values.items():
                table[row, VOCAB[word]] = value
        self.register_buffer("table", table)
        return self

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:  # type: ignore[override]
        output = super().forward(input_ids=input_ids, **kwargs)
        output.start_logits, output.end_logits = self.table[0][input_ids], self.table[1][input_ids]
        return output


def test_the_longest_span_and_ties_between_windows_by_hand(tok: Any) -> None:
    model = bert(TableQA).set_logits({"a": 5.0}, {"ran": 5.0, "red": 2.0})
    question = [QAExample("q", "it", "a big red dog ran", ("x",), (0,), "t", 0)]
    # "a big red dog ran" spans 5 tokens (end - start = 4): allowed below 5, not below 4
    assert Evaluator.for_task("squad", model, tok, question, max_answer_tokens=5).predictions() == {
        "q": "a big red dog ran"
    }
    assert Evaluator.for_task("squad", model, tok, question, max_answer_tokens=4).predictions() == {"q": "a big red"}
    # windows of 6 context tokens, 2 shared: "cat" only in the first, "dog" in the later two, both scoring 6
    tie = [QAExample("t", "it", "the cat sat on the mat . a big dog sat far", ("x",), (0,), "t", 0)]
    model = bert(TableQA).set_logits({"cat": 3.0, "dog": 3.0}, {"cat": 3.0, "dog": 3.0})
    evaluator = Evaluator.for_task("squad", model, tok, tie, max_length=10, stride=2)
    assert evaluator._prepared.n_features == 3
    assert evaluator.predictions() == {"t": "cat"}  # the first window wins a tie


def test_a_long_question_leaves_the_context_to_be_cut(tok: Any) -> None:
    """truncation="only_second": every window keeps the whole question and 16 - 8 - 3 = 5 context tokens."""
    model = bert(tf.BertForQuestionAnswering)
    long = [
        QAExample("l", "the big red dog sat on a mat", "it ran far away and then the cat sat", ("x",), (0,), "t", 0)
    ]
    evaluator = Evaluator.for_task("squad", model, tok, long, max_length=16, stride=2)
    assert evaluator._prepared.offsets is not None
    context = [[span for span in window if span[0] >= 0] for window in evaluator._prepared.offsets]
    words = [(0, 2), (3, 6), (7, 10), (11, 15), (16, 19), (20, 24), (25, 28), (29, 32), (33, 36)]
    assert context == [words[0:5], words[3:8], words[6:9]]


def test_squad_defaults_are_the_run_qa_recipe(qa_tok: Any) -> None:
    """max_length 384, stride 128, top 20, at most 30 tokens, on a context of about 500 tokens."""
    tok = qa_tok
    model = bert(tf.BertForQuestionAnswering, max_position_embeddings=400)
    context = " ".join(WORDS[(7 * i) % len(WORDS)] for i in range(500))
    examples = [QAExample("long", "the cat", context, ("a dog",), (0,), "t", 0), QUESTIONS[3]]
    evaluator = Evaluator.for_task("squad", model, tok, examples)
    answers, _ = squad_reference(model, tok, examples, None, max_length=384, stride=128, n_best=20,
                                 max_answer_tokens=30)  # fmt: skip
    assert evaluator._prepared.n_features == 3
    assert (evaluator.stride, evaluator.n_best, evaluator.max_answer_tokens) == (128, 20, 30)
    # the second window starts 128 tokens before the first one's end: 384 - 5 = 379 context words each
    words = context.split()
    assert evaluator._prepared.offsets is not None
    assert evaluator._prepared.offsets[1][4][0] == len(" ".join(words[: 379 - 128])) + 1
    assert evaluator._prepared.offsets[1][4 + 499 - 251][1] == len(" ".join(words[:500]))  # the last word
    assert evaluator.predictions() == answers


# --------------------------------------------------------------------------------------------
# Batches, segments, the cache, the errors
# --------------------------------------------------------------------------------------------


def test_batches_are_padded_longest_first_with_segments(tok: Any) -> None:
    model = bert(tf.BertModel)
    texts = [("a cat", "it ran"), ("the big dog sat", "red"), ("far", "away")]
    evaluator = Evaluator.for_task("drift", model, tok, texts, batch_size=2)
    first, second = evaluator._prepared.batches
    assert first.rows.tolist() == [1, 0]
    assert second.rows.tolist() == [2]
    # [CLS] the big dog sat [SEP] red [SEP] / [CLS] a cat [SEP] it ran [SEP] + padding
    assert first.inputs["input_ids"].tolist() == [[2, 7, 21, 10, 11, 3, 19, 3], [2, 8, 9, 3, 17, 14, 3, 0]]
    assert first.inputs["token_type_ids"].tolist() == [[0, 0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1, 1, 0]]
    assert first.inputs["attention_mask"].tolist() == [[1] * 8, [1] * 7 + [0]]
    assert first.segment_ids.tolist() == [[0, 0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1, 1, -1]]
    assert second.inputs["input_ids"].tolist() == [[2, 15, 3, 16, 3]]


def test_segments_without_token_types_come_from_the_separators(tok: Any) -> None:
    """A single text with a literal [SEP]: BERT's token types say one segment; a model with one token type
    (or a tokenizer without them) cuts at the separator; a tokenizer without a separator makes one segment."""
    texts = ["a cat [SEP] it ran", "red"]
    by_types = Evaluator.for_task("drift", bert(tf.BertModel), tok, texts)._prepared.batches[0]
    assert by_types.segment_ids.tolist() == [[0, 0, 0, 0, 0, 0, 0], [0, 0, 0, -1, -1, -1, -1]]
    one_type = bert(tf.BertModel, type_vocab_size=1)
    cut = Evaluator.for_task("drift", one_type, tok, texts)._prepared.batches[0]
    assert cut.segment_ids.tolist() == [[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, -1, -1, -1, -1]]
    no_types = ["input_ids", "attention_mask"]
    without = Evaluator.for_task("drift", bert(tf.BertModel), _Without(tok, model_input_names=no_types), texts)
    cut = without._prepared.batches[0]
    assert sorted(cut.inputs) == ["attention_mask", "input_ids"]
    assert cut.segment_ids.tolist() == [[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, -1, -1, -1, -1]]


class _Without:
    """A tokenizer seen without some of its parts (no separator, another pad id, no attention mask)."""

    def __init__(self, tok: Any, hide: tuple[str, ...] = (), **attributes: Any) -> None:
        self._tok, self._hide = tok, hide
        self.__dict__.update(attributes)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        encoded = self._tok(*args, **kwargs)
        if "attention_mask" not in getattr(self, "model_input_names", ["attention_mask"]):
            del encoded["attention_mask"]
        return encoded

    def __getattr__(self, name: str) -> Any:
        if name in self._hide:
            raise AttributeError(name)
        return getattr(self._tok, name)


def test_batches_without_separator_or_mask_and_with_another_pad_id(tok: Any) -> None:
    model = bert(tf.BertModel)
    plain = _Without(tok, sep_token_id=None, pad_token_id=4, model_input_names=["input_ids", "token_type_ids"])
    batch = Evaluator.for_task("drift", model, plain, ["a cat [SEP] it ran", "red"])._prepared.batches[0]
    assert batch.inputs["input_ids"].tolist() == [[2, 8, 9, 3, 17, 14, 3], [2, 19, 3, 4, 4, 4, 4]]
    assert batch.inputs["attention_mask"].tolist() == [[1] * 7, [1, 1, 1, 0, 0, 0, 0]]  # from the lengths
    assert batch.segment_ids.tolist() == [[0, 0, 0, 0, 0, 0, 0], [0, 0, 0, -1, -1, -1, -1]]
    no_types = _Without(tok, sep_token_id=None, model_input_names=["input_ids", "attention_mask"])
    batch = Evaluator.for_task("drift", model, no_types, ["a cat [SEP] it ran", "red"])._prepared.batches[0]
    assert batch.segment_ids.tolist() == [[0, 0, 0, 0, 0, 0, 0], [0, 0, 0, -1, -1, -1, -1]]
    # a tokenizer that names no model inputs: input ids and the attention mask
    unnamed = _Without(tok, hide=("model_input_names",))
    batch = Evaluator.for_task("drift", model, unnamed, [("a cat", "it ran"), ("red", "far")])._prepared.batches[0]
    assert sorted(batch.inputs) == ["attention_mask", "input_ids"]
    assert batch.inputs["attention_mask"].tolist() == [[1] * 7, [1, 1, 1, 1, 1, 0, 0]]
    assert batch.segment_ids.tolist() == [[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, -1, -1]]  # from the separators


def test_segments_of_a_model_without_token_types_in_its_config(tok: Any) -> None:
    """DistilBERT's config has no type_vocab_size: segments come from the separators."""
    distil = build(next(family for family in FAMILIES if family.name == "distilbert"))
    plain = _Without(tok, model_input_names=["input_ids", "attention_mask"])
    evaluator = Evaluator.for_task("drift", distil, plain, [("a cat", "it ran"), ("red", "far")])
    assert evaluator._prepared.batches[0].segment_ids.tolist() == [[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, -1, -1]]
    assert evaluator.run(DROP_SPEC)["cosine"] < 1.0


def test_default_batches_hold_32_examples(tok: Any) -> None:
    model = bert(tf.BertModel)
    texts = [f"{WORDS[i % 18]} {WORDS[(5 * i) % 18]}" for i in range(40)]
    assert [len(b.rows) for b in Evaluator.for_task("drift", model, tok, texts)._prepared.batches] == [32, 8]
    direct = Evaluator("drift", model, tok, texts)
    started = time.perf_counter()
    direct.prepare()
    assert 0 < direct.prepare_seconds_ <= time.perf_counter() - started
    assert [len(b.rows) for b in direct._prepared.batches] == [32, 8]


def test_for_task_caches_by_every_part_of_its_key(tok: Any) -> None:
    model = bert(tf.BertModel)
    other = bert(tf.BertModel)
    with pytest.raises(TaskDataError, match=r"^unknown task 'ner'; tasks: squad, classification, drift$"):
        Evaluator.for_task("ner", model, tok, TEXTS)  # type: ignore[arg-type]
    first = Evaluator.for_task("drift", model, tok, TEXTS)
    assert Evaluator.for_task("drift", model, tok, TEXTS) is first
    assert Evaluator.for_task("drift", model, tok, list(TEXTS)) is first  # equal data, another list
    # each part of the key alone makes another evaluator, and leaves the first one cached
    others: list[tuple[Any, Any, list[Any], dict[str, Any]]] = [
        (other, tok, TEXTS, {}),
        (model, tokenizer(BERT_TEMPLATE, type_ids=True), TEXTS, {}),
        (model, tok, TEXTS[:3], {}),
        (model, tok, [*TEXTS[:3], "a dog ran"], {}),  # as many texts, one other
        (model, tok, TEXTS, {"limit": 2}),
        (model, tok, TEXTS, {"batch_size": 2}),
        (model, tok, TEXTS, {"device": "cpu"}),
        (model, tok, TEXTS, {"max_length": 5}),
        (model, tok, TEXTS, {"stride": 3}),
    ]
    for m, t, data, options in others:
        Evaluator.clear_cache()
        first = Evaluator.for_task("drift", model, tok, TEXTS)
        assert Evaluator.for_task("drift", m, t, data, **options) is not first, options
        assert Evaluator.for_task("drift", model, tok, TEXTS) is first, options
    variants = [
        Evaluator.for_task("drift", other, tok, TEXTS),
        Evaluator.for_task("drift", model, tokenizer(BERT_TEMPLATE, type_ids=True), TEXTS),
        Evaluator.for_task("drift", model, tok, TEXTS[:3]),
        Evaluator.for_task("drift", model, tok, TEXTS, limit=2),
        Evaluator.for_task("drift", model, tok, TEXTS, batch_size=2),
        Evaluator.for_task("drift", model, tok, TEXTS, device="cpu"),
        Evaluator.for_task("drift", model, tok, TEXTS, max_length=5),
        Evaluator.for_task("drift", model, tok, TEXTS, stride=3),
    ]
    assert all(v is not first for v in variants)
    assert len({id(v) for v in variants}) == len(variants)
    assert variants[3].n_examples == 2
    assert variants[6]._prepared.batches[0].inputs["input_ids"].shape[1] == 5  # max_length reaches the tokenizer
    assert variants[7].stride == 3
    assert variants[5].device_ == torch.device("cpu")
    # only the last CACHE_SIZE (4) are kept, most recently used last
    assert list(evaluation._CACHE.values()) == variants[-4:]
    assert Evaluator.for_task("drift", model, tok, TEXTS, max_length=5) is variants[6]
    assert Evaluator.for_task("drift", model, tok, TEXTS, limit=2) is not variants[3]
    assert list(evaluation._CACHE.values())[-2] is variants[6]  # moved to the end when found
    assert len(evaluation._CACHE) == 4
    uncached = Evaluator.for_task("drift", model, tok, TEXTS, max_length=5, cache=False)
    assert uncached is not variants[6]
    assert uncached not in evaluation._CACHE.values()
    assert Evaluator.for_task("drift", model, tok, TEXTS, max_length=5) is variants[6]


def test_a_cached_entry_for_another_model_at_the_same_address_is_not_reused(tok: Any) -> None:
    model = bert(tf.BertModel)
    found = Evaluator.for_task("drift", model, tok, TEXTS)
    stale = next(iter(evaluation._CACHE))
    evaluation._CACHE[stale] = Evaluator("drift", bert(tf.BertModel), tok, TEXTS).prepare()  # same key, other model
    fresh = Evaluator.for_task("drift", model, tok, TEXTS)
    assert fresh is not found
    assert fresh.model is model
    assert evaluation._CACHE[stale] is fresh
    evaluation._CACHE[stale] = Evaluator("drift", model, tokenizer(BERT_TEMPLATE, type_ids=True), TEXTS).prepare()
    again = Evaluator.for_task("drift", model, tok, TEXTS)
    assert again is not fresh
    assert again.tokenizer is tok


def test_evaluator_errors_are_named(tok: Any) -> None:
    model = bert(tf.BertModel)
    with pytest.raises(TaskDataError, match=r"^no examples to evaluate$"):
        Evaluator.for_task("drift", model, tok, [])
    with pytest.raises(TaskDataError, match=r"^the squad task takes QAExample records \(ingest.tasks.read_squad\)$"):
        Evaluator.for_task("squad", model, tok, TEXTS)
    message = r"^the classification task takes ClassificationExample records \(ingest.tasks\)$"
    with pytest.raises(TaskDataError, match=message):
        Evaluator.for_task("classification", model, tok, TEXTS)
    with pytest.raises(TaskDataError, match=r"^mixed single texts and text pairs: evaluate them separately$"):
        Evaluator.for_task("drift", model, tok, ["a cat", ("a", "dog")])
    with pytest.raises(TaskDataError, match=r"^the squad task needs a question-answering head \(start/end logits\)$"):
        Evaluator.for_task("squad", model, tok, QUESTIONS[:1]).baseline()
    data = PAIRS[:2]
    message = r"^the classification task needs a sequence-classification head$"
    with pytest.raises(TaskDataError, match=message):
        Evaluator.for_task("classification", model, tok, data).baseline()
    with pytest.raises(TaskDataError, match=message):
        Evaluator.for_task("classification", bert(tf.BertForTokenClassification), tok, data).baseline()
    drift = Evaluator.for_task("drift", model, tok, TEXTS)
    with pytest.raises(TaskDataError, match=r"^predictions\(\) is for the squad task$"):
        drift.predictions()
    wrong = AblationSpec.from_heads({(0, 0): "prune"}, 3, 4)
    with pytest.raises(ValueError, match=r"^the spec is for encoder 3 x 4 heads, the model has encoder 2 x 4$"):
        drift.run(wrong)


def test_a_layer_that_never_calls_the_probe_is_named(tok: Any) -> None:
    model = bert(tf.BertModel)
    model.config.num_hidden_layers = 3  # the config promises a third layer the model does not run
    evaluator = Evaluator.for_task("drift", model, tok, TEXTS)
    evaluator.baseline()
    message = (
        "layers [('encoder', 2)] (stack, layer) never called the headcat attention: does this model's attention "
        "go through transformers' AttentionInterface?"
    )
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
        evaluator.run(AblationSpec.from_heads({(2, 0): "prune"}, 3, 4))


def test_a_failed_baseline_is_not_kept(tok: Any) -> None:
    model = bert(tf.BertForSequenceClassification, num_labels=2)
    evaluator = Evaluator.for_task("classification", model, tok, PAIRS[:3], batch_size=2)
    calls: list[int] = []

    class Interrupted(BaseException):  # not an Exception: as KeyboardInterrupt
        pass

    def fail_once(*_: Any) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise Interrupted  # an interrupted pass, in its second batch

    handle = model.register_forward_pre_hook(fail_once)
    try:
        with pytest.raises(Interrupted):
            evaluator.baseline()
        baseline = evaluator.baseline()
    finally:
        handle.remove()
    predicted = [int(forward(model, encode(tok, e.text, e.text_pair), None).logits.argmax()) for e in PAIRS[:3]]
    assert baseline["accuracy"] == pytest.approx(100 * skm.accuracy_score([e.label for e in PAIRS[:3]], predicted))
    assert baseline["kl"] == 0.0
    assert len(calls) == 4
    # the cached reference has one entry per batch: an ablated run compares batch with batch
    found = evaluator.run(SPEC)
    kls = [kl_rows(forward(model, encode(tok, e.text, e.text_pair), None).logits,
                   forward(model, encode(tok, e.text, e.text_pair), PRUNE).logits)[0] for e in PAIRS[:3]]  # fmt: skip
    assert found["kl"] == pytest.approx(float(np.mean(kls)), rel=1e-4)


# --------------------------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------------------------


def test_run_plan_rows_triples_progress_and_renormalize(tok: Any) -> None:
    model = bert(tf.BertModel)
    evaluator = Evaluator.for_task("drift", model, tok, TEXTS)
    row = PlanRow.of("prune.first", "Prune the first heads", {"prune": HeadSelection.explicit([(0, 1)])},
                     paper_ref="T9.9")  # fmt: skip
    with pytest.raises(ValueError, match=r"^plan row ids must be unique: \['prune.first'\]$"):
        run_plan(evaluator, [row, ("x", "x", SPEC), ("prune.first", "again", SPEC)])
    seen: list[tuple[int, int, str]] = []
    outcomes = run_plan(evaluator, [row, ("spec", "A spec", SPEC)], renormalize=True,
                        progress=lambda done, total, outcome: seen.append((done, total, outcome.row_id)))  # fmt: skip
    assert seen == [(1, 2, "prune.first"), (2, 2, "spec")]
    first, second = outcomes
    assert (first.row_id, first.label, first.paper_ref) == ("prune.first", "Prune the first heads", "T9.9")
    assert (second.row_id, second.label, second.paper_ref) == ("spec", "A spec", None)
    assert first.spec["renormalize"] is True
    assert first.spec["ops"] == {"prune": [["encoder", 0, 1]]}
    assert second.spec == SPEC.to_dict()
    assert first.baseline is evaluator.baseline()
    assert second.baseline is evaluator.baseline()
    assert first.n_examples == 4
    assert second.metrics == evaluator.run(SPEC)
    started = time.perf_counter()
    (plain,) = run_plan(evaluator, [row])
    assert 0 < plain.seconds <= time.perf_counter() - started
    assert plain.spec["renormalize"] is False  # the default


class _Bar:
    """Stands in for rich's Progress: records how run_plan drives it."""

    made: list[_Bar] = []

    def __init__(self, **options: Any) -> None:
        self.calls: list[tuple[Any, ...]] = [("init", options)]
        _Bar.made.append(self)

    def add_task(self, description: str, **options: Any) -> int:
        self.calls.append(("add_task", description, options))
        return 7

    def start(self) -> None:
        self.calls.append(("start",))

    def update(self, task_id: int, **options: Any) -> None:
        self.calls.append(("update", task_id, options))

    def stop(self) -> None:
        self.calls.append(("stop",))


def test_run_plan_drives_a_rich_progress_bar(tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import rich.progress

    evaluator = Evaluator.for_task("drift", bert(tf.BertModel), tok, TEXTS)
    monkeypatch.setattr(rich.progress, "Progress", _Bar)
    _Bar.made.clear()
    outcomes = run_plan(evaluator, [("a", "A", SPEC), ("b", "B", DROP_SPEC)], progress=True)
    assert [o.metrics for o in outcomes] == [evaluator.run(SPEC), evaluator.run(DROP_SPEC)]
    (bar,) = _Bar.made
    assert bar.calls == [
        ("init", {"transient": True}),
        ("add_task", "ablation plan", {"total": 2}),
        ("start",),
        ("update", 7, {"advance": 1, "description": "a"}),
        ("update", 7, {"advance": 1, "description": "b"}),
        ("stop",),
    ]
    wrong = AblationSpec.from_heads({(0, 0): "prune"}, 3, 4)
    with pytest.raises(ValueError, match="the spec is for encoder 3 x 4 heads"):
        run_plan(evaluator, [("a", "A", SPEC), ("w", "W", wrong)], progress=True)
    assert _Bar.made[-1].calls[-1] == ("stop",)  # stopped when a row fails too
    _Bar.made.clear()
    run_plan(evaluator, [("a", "A", SPEC)], progress=False)
    run_plan(evaluator, [("a", "A", SPEC)], progress=lambda *_: None)
    assert _Bar.made == []


# --------------------------------------------------------------------------------------------
# Written after the mutation run
# --------------------------------------------------------------------------------------------


def test_mean_token_cosine_of_a_float_mask_is_float32() -> None:
    """A mask given as float64 (ones and zeros) counts the same tokens, and the result stays float32."""
    rng = np.random.default_rng(2)
    reference = rng.normal(size=(2, 3, 4))
    ablated = reference + rng.normal(size=(2, 3, 4))
    mask = np.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    found = mean_token_cosine(torch.from_numpy(reference), torch.from_numpy(ablated), torch.from_numpy(mask))
    assert found.dtype == torch.float32
    cosines = (reference * ablated).sum(-1) / np.linalg.norm(reference, axis=-1) / np.linalg.norm(ablated, axis=-1)
    np.testing.assert_allclose(found.numpy(), [cosines[0, :2].mean(), cosines[1].mean()], rtol=1e-6)


def test_squad_windows_are_batched_longest_first_each_batch_padded_to_its_own_longest(tok: Any) -> None:
    """Dynamic padding for SQuAD windows too: sorted by length (equal lengths in their order, question by
    question, window by window), each batch padded to its own longest window, not to the longest of all."""
    model = bert(tf.BertForQuestionAnswering)
    evaluator = Evaluator.for_task("squad", model, tok, QUESTIONS, batch_size=3, max_length=16, stride=5)
    windows: list[tuple[list[int], list[int]]] = []  # (input ids, token types) of every window, in order
    for example in QUESTIONS:
        encoded = tok(example.question.lstrip(), example.context, truncation="only_second", max_length=16,
                      stride=5, return_overflowing_tokens=True)  # fmt: skip
        windows += list(zip(encoded["input_ids"], encoded["token_type_ids"], strict=True))
    order = sorted(range(len(windows)), key=lambda w: -len(windows[w][0]))  # a stable sort
    batches = evaluator._prepared.batches
    assert [batch.rows.tolist() for batch in batches] == [order[i : i + 3] for i in range(0, len(order), 3)]
    for batch in batches:
        width = max(len(windows[w][0]) for w in batch.rows)
        rows = [windows[w] for w in batch.rows]
        assert batch.inputs["input_ids"].tolist() == [ids + [0] * (width - len(ids)) for ids, _ in rows]
        assert batch.inputs["token_type_ids"].tolist() == [types + [0] * (width - len(types)) for _, types in rows]
        assert batch.inputs["attention_mask"].tolist() == [[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows]
    assert [batch.inputs["input_ids"].shape[1] for batch in batches] == [16, 16, 16, 14, 11]
    assert tok.pad_token_id == 0


def test_predictions_keep_the_padding_out_of_uniform_attention(tok: Any) -> None:
    """predictions() gives the ablation each batch's attention mask: a uniform head spreads over the real
    tokens of its window, not over the padding that a longer window of the same batch brings."""
    model = bert(tf.BertForQuestionAnswering)
    options: dict[str, Any] = {"max_length": 16, "stride": 5, "n_best": 3, "max_answer_tokens": 4}
    evaluator = Evaluator.for_task("squad", model, tok, QUESTIONS, **options)
    (batch,) = evaluator._prepared.batches  # windows of 7 to 16 tokens in one batch
    assert batch.inputs["attention_mask"].sum(-1).tolist()[-1] == 7
    for ops in ({(0, 0): "uniform"}, {(1, head): "uniform" for head in range(4)}):
        answers, _ = squad_reference(model, tok, QUESTIONS, ops, **options)
        assert evaluator.predictions(AblationSpec.from_heads(ops, 2, 4)) == answers, ops  # type: ignore[arg-type]
