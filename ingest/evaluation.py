"""Task metrics and label-free drift of a model under an ablation (SPEC section 4).

- SQuAD v1.1: the Hugging Face ``run_qa`` recipe. Question and context are tokenized with
  ``truncation="only_second"``, ``max_length=384``, ``stride=128`` (overlapping windows); each
  window proposes its best span among the top 20 start and top 20 end logits (span inside the
  context, at most 30 tokens); a question's answer is its best-scoring span over all its
  windows. Exact match and F1 use the official v1.1 normalisation and the best gold answer.
- GLUE-style classification: accuracy, and F1 of the positive class (label id 1, e.g. MRPC's
  ``equivalent``) for two labels, macro F1 for more.
- Drift, for any encoder: mean KL(unablated || ablated) of the output distributions where the
  model has a head (class logits; start and end logits over the real tokens of a QA window),
  else the mean cosine similarity of the last hidden states over real tokens.

An :class:`Evaluator` tokenizes its data once, batches it (sorted by length, dynamic padding)
and caches the unablated run, so a plan of many rows pays for tokenization and the baseline
once::

    evaluator = Evaluator.for_task("classification", model, tokenizer, examples, batch_size=64)
    outcomes = run_plan(evaluator, paper_plan(types), assignments=assignments)

Everything runs under ``torch.inference_mode()``, through the ``headcat`` attention (eager
attention, op for op), for the baseline too, so unablated layers are bit-for-bit the same in
both runs.
"""

from __future__ import annotations

import logging
import re
import string
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import numpy as np
import torch
from torch import nn

from ingest.ablation import (
    AblationSpec,
    Ablator,
    Assignments,
    PlanRow,
    describe_shapes,
    model_shapes,
    segments_from_separators,
    segments_from_token_types,
)
from ingest.selection import Roles
from ingest.tasks import ClassificationExample, QAExample, TaskDataError, check_labels

logger = logging.getLogger(__name__)

TaskKind = Literal["squad", "classification", "drift"]
TASKS: tuple[TaskKind, ...] = ("squad", "classification", "drift")
TextInput: TypeAlias = "str | tuple[str, str] | ClassificationExample"


# --------------------------------------------------------------------------------------------
# SQuAD v1.1 scoring (official evaluate-v1.1.py)
# --------------------------------------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, drop punctuation, drop ``a``/``an``/``the``, squeeze whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match_score(prediction: str, ground_truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def f1_score(prediction: str, ground_truth: str) -> float:
    """Token-overlap F1 of the normalised strings (0 when nothing is shared, as in v1.1)."""
    prediction_tokens = normalize_answer(prediction).split()
    truth_tokens = normalize_answer(ground_truth).split()
    common = Counter(prediction_tokens) & Counter(truth_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(prediction_tokens)
    recall = same / len(truth_tokens)
    return 2 * precision * recall / (precision + recall)


def max_over_ground_truths(metric: Callable[[str, str], float], prediction: str, truths: Iterable[str]) -> float:
    return max(metric(prediction, truth) for truth in truths)


def squad_scores(predictions: Mapping[str, str], examples: Sequence[QAExample]) -> dict[str, float]:
    """``{"exact_match", "f1"}`` in percent over ``examples``; a missing prediction scores 0."""
    if not examples:
        return {"exact_match": 0.0, "f1": 0.0}
    em = f1 = 0.0
    for example in examples:
        prediction = predictions.get(example.id)
        if prediction is None:
            continue  # scores 0, as in evaluate-v1.1.py (an empty string would match a gold answer such as "The")
        em += max_over_ground_truths(exact_match_score, prediction, example.answers)
        f1 += max_over_ground_truths(f1_score, prediction, example.answers)
    return {"exact_match": 100.0 * em / len(examples), "f1": 100.0 * f1 / len(examples)}


# --------------------------------------------------------------------------------------------
# Classification and drift scoring
# --------------------------------------------------------------------------------------------


def classification_scores(predictions: np.ndarray, labels: np.ndarray, num_labels: int) -> dict[str, float]:
    """Accuracy and F1 (positive class 1 for two labels, macro over classes otherwise), percent."""
    if len(labels) == 0:
        return {"accuracy": 0.0, "f1": 0.0}
    accuracy = float((predictions == labels).mean())
    classes = [1] if num_labels == 2 else list(range(num_labels))
    f1s = []
    for c in classes:
        tp = float(((predictions == c) & (labels == c)).sum())
        fp = float(((predictions == c) & (labels != c)).sum())
        fn = float(((predictions != c) & (labels == c)).sum())
        f1s.append(0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn))
    return {"accuracy": 100.0 * accuracy, "f1": 100.0 * float(np.mean(f1s))}


def kl_divergence(
    reference: torch.Tensor,  # (batch, ..., n) logits of the unablated model
    ablated: torch.Tensor,  # same shape
    mask: torch.Tensor | None = None,  # (batch, ..., n) bool: entries that are part of the distribution
) -> torch.Tensor:  # (batch, ...)
    """KL(softmax(reference) || softmax(ablated)) over the last dimension, restricted to ``mask``."""
    reference = reference.float()
    ablated = ablated.float()
    if mask is not None:
        reference = reference.masked_fill(~mask, float("-inf"))
        ablated = ablated.masked_fill(~mask, float("-inf"))
    log_p = reference.log_softmax(dim=-1)
    log_q = ablated.log_softmax(dim=-1)
    terms = log_p.exp() * (log_p - log_q)
    if mask is not None:
        terms = torch.where(mask, terms, torch.zeros_like(terms))
    return terms.sum(dim=-1)


def mean_token_cosine(
    reference: torch.Tensor,  # (batch, seq, hidden)
    ablated: torch.Tensor,  # (batch, seq, hidden)
    attention_mask: torch.Tensor,  # (batch, seq)
) -> torch.Tensor:  # (batch,)
    """Per sample, the mean cosine similarity of the hidden states over its real tokens."""
    cosine = nn.functional.cosine_similarity(reference.float(), ablated.float(), dim=-1)  # (batch, seq)
    real = attention_mask.to(cosine.dtype)
    return (cosine * real).sum(dim=-1) / real.sum(dim=-1).clamp_min(1)


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Metrics:
    """One evaluation: the task, how many examples (questions, sentences, texts) and the values."""

    task: TaskKind
    n_examples: int
    values: Mapping[str, float]

    def __getitem__(self, name: str) -> float:
        return self.values[name]

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "n_examples": self.n_examples, **{k: float(v) for k, v in self.values.items()}}


@dataclass(frozen=True)
class Outcome:
    """One plan row's result, stored beside its baseline."""

    row_id: str
    label: str
    spec: dict[str, Any]
    metrics: Metrics
    baseline: Metrics
    seconds: float
    n_examples: int
    paper_ref: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "row_id": self.row_id,
            "label": self.label,
            "paper_ref": self.paper_ref,
            "spec": self.spec,
            "metrics": self.metrics.to_dict(),
            "baseline": self.baseline.to_dict(),
            "seconds": self.seconds,
            "n_examples": self.n_examples,
        }


# --------------------------------------------------------------------------------------------
# The evaluator
# --------------------------------------------------------------------------------------------


@dataclass
class _Batch:
    inputs: dict[str, torch.Tensor]  # model inputs, (batch, seq), on the device
    segment_ids: torch.Tensor  # (batch, seq), -1 on padding
    rows: np.ndarray  # feature indices (windows / examples) of this batch's rows
    context: torch.Tensor | None = None  # (batch, seq) bool, SQuAD: token lies in the context


@dataclass
class _Prepared:
    batches: list[_Batch]
    n_features: int
    # SQuAD
    feature_example: np.ndarray | None = None  # (features,) example index of each window
    offsets: list[list[tuple[int, int]]] | None = None  # per window, per token: char span (-1, -1) off context
    # classification
    labels: np.ndarray | None = None


@dataclass
class _Baseline:
    metrics: Metrics
    reference: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per batch, outputs kept for drift


# Prepared evaluators, most recent last. Bounded: an evaluator holds its model, tokenized data
# and baseline outputs, so an unbounded cache would keep every model ever evaluated alive.
_CACHE: OrderedDict[tuple[Any, ...], Evaluator] = OrderedDict()
CACHE_SIZE = 4


class Evaluator:
    """Scores a model on fixed data, unablated (cached) and under any :class:`AblationSpec`.

    Use :meth:`for_task`: it tokenizes once and reuses one evaluator per (model, tokenizer,
    task, data, limit, batching); the last :data:`CACHE_SIZE` evaluators are kept
    (:meth:`clear_cache` drops them). Changing the model's weights in place between calls is not
    detected: clear the cache, or pass ``cache=False``.
    """

    def __init__(
        self,
        task: TaskKind,
        model: nn.Module,
        tokenizer: Any,
        data: Sequence[Any],
        *,
        limit: int | None = None,
        batch_size: int = 32,
        device: str | torch.device | None = None,
        max_length: int | None = None,
        stride: int = 128,
        n_best: int = 20,
        max_answer_tokens: int = 30,
    ) -> None:
        self.task = task
        self.model = model
        self.tokenizer = tokenizer
        self.data = data
        self.limit = limit
        self.batch_size = batch_size
        self.device = device
        self.max_length = max_length
        self.stride = stride
        self.n_best = n_best
        self.max_answer_tokens = max_answer_tokens

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def for_task(
        cls,
        task: TaskKind,
        model: nn.Module,
        tokenizer: Any,
        data: Sequence[Any],
        *,
        limit: int | None = None,
        batch_size: int = 32,
        device: str | torch.device | None = None,
        max_length: int | None = None,
        cache: bool = True,
        **kwargs: Any,
    ) -> Evaluator:
        """A prepared evaluator (data tokenized and batched), shared per model and data.

        ``task``: ``"squad"`` (data: :class:`QAExample`), ``"classification"``
        (:class:`ClassificationExample`) or ``"drift"`` (texts, text pairs or examples; no labels).
        ``limit`` keeps the first examples. ``max_length`` defaults to 384 for SQuAD, 128 otherwise.
        """
        if task not in TASKS:
            raise TaskDataError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
        key = (
            task,
            id(model),
            id(tokenizer),
            len(data),
            hash(tuple(data)),
            limit,
            batch_size,
            str(device),
            max_length,
            tuple(sorted(kwargs.items())),
        )
        if cache:
            found = _CACHE.get(key)
            if found is not None and found.model is model and found.tokenizer is tokenizer:
                _CACHE.move_to_end(key)
                return found
        evaluator = cls(
            task,
            model,
            tokenizer,
            data,
            limit=limit,
            batch_size=batch_size,
            device=device,
            max_length=max_length,
            **kwargs,
        ).prepare()
        if cache:
            _CACHE[key] = evaluator
            while len(_CACHE) > CACHE_SIZE:
                _CACHE.popitem(last=False)
        return evaluator

    @staticmethod
    def clear_cache() -> None:
        _CACHE.clear()

    def prepare(self) -> Evaluator:
        """Check the data against the model, tokenize once and build the padded batches."""
        started = time.perf_counter()
        if self.device is not None:
            self.model.to(self.device)
        self.device_ = next(self.model.parameters()).device
        self.model.eval()
        self.shapes_ = model_shapes(self.model)
        self.num_layers_, self.num_heads_ = next(iter(self.shapes_.values()))
        examples = list(self.data if self.limit is None else self.data[: self.limit])
        if not examples:
            raise TaskDataError("no examples to evaluate")
        self.examples_ = examples
        if self.task == "squad":
            self._prepared = self._prepare_squad(examples)
        elif self.task == "classification":
            self._prepared = self._prepare_classification(examples)
        else:
            self._prepared = self._prepare_texts(examples)
        self._baseline: _Baseline | None = None
        self.prepare_seconds_ = time.perf_counter() - started
        logger.info(
            "%s evaluator: %d examples, %d features, %d batches, prepared in %.2f s",
            self.task,
            len(examples),
            self._prepared.n_features,
            len(self._prepared.batches),
            self.prepare_seconds_,
        )
        return self

    @property
    def n_examples(self) -> int:
        return len(self.examples_)

    def _model_inputs(self) -> list[str]:
        names = list(getattr(self.tokenizer, "model_input_names", ["input_ids", "attention_mask"]))
        return [name for name in names if name in ("input_ids", "token_type_ids", "attention_mask")]

    def _segments(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None, mask: torch.Tensor
    ) -> torch.Tensor:
        uses_types = int(getattr(self.model.config, "type_vocab_size", 0) or 0) > 1
        if token_type_ids is not None and uses_types:
            return segments_from_token_types(token_type_ids, mask)
        sep = self.tokenizer.sep_token_id
        if sep is None:
            return torch.zeros_like(input_ids).masked_fill(mask == 0, -1)
        return segments_from_separators(input_ids, sep, mask)

    def _batch(self, encoded: Mapping[str, Sequence[Sequence[int]]], rows: np.ndarray) -> _Batch:
        names = [name for name in self._model_inputs() if name in encoded]
        length = max(len(encoded["input_ids"][i]) for i in rows)
        pad = {"input_ids": self.tokenizer.pad_token_id or 0, "token_type_ids": 0, "attention_mask": 0}
        inputs = {}
        for name in names:
            block = np.full((len(rows), length), pad[name], dtype=np.int64)
            for j, i in enumerate(rows):
                values = encoded[name][i]
                block[j, : len(values)] = values
            inputs[name] = torch.from_numpy(block)
        if "attention_mask" not in inputs:
            block = np.zeros((len(rows), length), dtype=np.int64)
            for j, i in enumerate(rows):
                block[j, : len(encoded["input_ids"][i])] = 1
            inputs["attention_mask"] = torch.from_numpy(block)
        segments = self._segments(inputs["input_ids"], inputs.get("token_type_ids"), inputs["attention_mask"])
        return _Batch(
            {name: tensor.to(self.device_) for name, tensor in inputs.items()}, segments.to(self.device_), rows
        )

    def _batches(self, encoded: Mapping[str, Sequence[Sequence[int]]]) -> list[_Batch]:
        lengths = np.array([len(ids) for ids in encoded["input_ids"]])
        order = np.argsort(-lengths, kind="stable")  # longest first: memory errors show at once
        return [self._batch(encoded, order[i : i + self.batch_size]) for i in range(0, len(order), self.batch_size)]

    def _prepare_squad(self, examples: list[QAExample]) -> _Prepared:
        if not all(isinstance(example, QAExample) for example in examples):
            raise TaskDataError("the squad task takes QAExample records (ingest.tasks.read_squad)")
        encoded = self.tokenizer(
            [example.question.lstrip() for example in examples],
            [example.context for example in examples],
            truncation="only_second",
            max_length=self.max_length or 384,
            stride=self.stride,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
            padding=False,
        )
        offsets: list[list[tuple[int, int]]] = []
        for i, window in enumerate(encoded["offset_mapping"]):
            sequence_ids = encoded.sequence_ids(i)
            offsets.append(
                [tuple(span) if sid == 1 else (-1, -1) for span, sid in zip(window, sequence_ids, strict=True)]
            )
        prepared = _Prepared(self._batches(encoded), len(offsets))
        for batch in prepared.batches:
            context = torch.zeros(batch.inputs["input_ids"].shape, dtype=torch.bool)
            for j, row in enumerate(batch.rows):
                context[j, : len(offsets[row])] = torch.tensor([span[0] >= 0 for span in offsets[row]])
            batch.context = context
        prepared.feature_example = np.asarray(encoded["overflow_to_sample_mapping"], dtype=np.int64)
        prepared.offsets = offsets
        return prepared

    def _prepare_classification(self, examples: list[ClassificationExample]) -> _Prepared:
        if not all(isinstance(example, ClassificationExample) for example in examples):
            raise TaskDataError("the classification task takes ClassificationExample records (ingest.tasks)")
        check_labels(examples, self.model.config)
        prepared = self._prepare_texts(examples)
        prepared.labels = np.array([example.label for example in examples], dtype=np.int64)
        return prepared

    def _prepare_texts(self, examples: Sequence[TextInput]) -> _Prepared:
        texts: list[str] = []
        pairs: list[str | None] = []
        for example in examples:
            if isinstance(example, str):
                texts.append(example)
                pairs.append(None)
            else:
                texts.append(example[0])
                pairs.append(example[1])
        has_pair = [pair is not None for pair in pairs]
        if any(has_pair) and not all(has_pair):
            raise TaskDataError("mixed single texts and text pairs: evaluate them separately")
        encoded = self.tokenizer(
            texts,
            pairs if all(has_pair) else None,
            truncation=True,
            max_length=self.max_length or 128,
            padding=False,
        )
        return _Prepared(self._batches(encoded), len(texts))

    # -- running -----------------------------------------------------------------------------

    def baseline(self) -> Metrics:
        """The unablated metrics (computed once)."""
        if self._baseline is None:
            started = time.perf_counter()
            self._baseline = _Baseline(metrics=None)  # type: ignore[arg-type]  # filled by _evaluate(keep=True)
            try:
                self._baseline.metrics = self._evaluate(AblationSpec.empty(shapes=self.shapes_), keep=True)
            except BaseException:
                self._baseline = None  # a failed or interrupted pass must not be cached as the baseline
                raise
            logger.info("baseline %s in %.2f s", self._baseline.metrics.to_dict(), time.perf_counter() - started)
        return self._baseline.metrics

    def run(self, spec: AblationSpec) -> Metrics:
        """Metrics under ``spec`` (drift against the cached baseline); the empty spec is the baseline."""
        if spec.stack_shapes != self.shapes_:
            raise ValueError(
                f"the spec is for {describe_shapes(spec.stack_shapes)} heads, the model has "
                f"{describe_shapes(self.shapes_)}"
            )
        if spec.is_empty:
            return self.baseline()
        self.baseline()
        return self._evaluate(spec, keep=False)

    def _evaluate(self, spec: AblationSpec, *, keep: bool) -> Metrics:
        prepared = self._prepared
        reference = None if keep else self._baseline.reference  # type: ignore[union-attr]
        drift: list[torch.Tensor] = []
        per_feature: list[tuple[np.ndarray, torch.Tensor]] = []
        with torch.inference_mode(), Ablator(self.model, spec) as ablator:
            for b, batch in enumerate(prepared.batches):
                mask = batch.inputs["attention_mask"]
                ablator.set_batch(mask, segment_ids=batch.segment_ids)
                output = self.model(**batch.inputs)
                if b == 0:
                    missing = set(spec.by_layer()) - ablator.layers_seen
                    if missing:
                        raise RuntimeError(
                            f"layers {sorted(missing)} (stack, layer) never called the headcat attention: does this "
                            "model's attention go through transformers' AttentionInterface?"
                        )
                kept = self._outputs(output)
                if keep:
                    self._baseline.reference.append(kept)  # type: ignore[union-attr]
                    base = kept
                else:
                    base = reference[b]  # type: ignore[index]
                drift.append(self._drift(base, kept, mask))
                per_feature.append((batch.rows, self._predict(kept, mask, batch)))
        values = self._score(per_feature)
        drift_all = torch.cat(drift).float()
        values["cosine" if "last_hidden_state" in kept else "kl"] = float(drift_all.mean()) if len(drift_all) else 0.0
        return Metrics(self.task, self.n_examples, values)

    def _outputs(self, output: Any) -> dict[str, torch.Tensor]:
        if self.task == "squad":
            if getattr(output, "start_logits", None) is None:
                raise TaskDataError("the squad task needs a question-answering head (start/end logits)")
            return {"start_logits": output.start_logits, "end_logits": output.end_logits}
        logits = getattr(output, "logits", None)
        if self.task == "classification":
            if logits is None or logits.dim() != 2:
                raise TaskDataError("the classification task needs a sequence-classification head")
            return {"logits": logits}
        if logits is not None:
            return {"logits": logits}
        if getattr(output, "start_logits", None) is not None:
            return {"start_logits": output.start_logits, "end_logits": output.end_logits}
        return {"last_hidden_state": output.last_hidden_state}

    @staticmethod
    def _drift(base: Mapping[str, torch.Tensor], kept: Mapping[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        if "last_hidden_state" in kept:
            return mean_token_cosine(base["last_hidden_state"], kept["last_hidden_state"], mask).cpu()
        if "start_logits" in kept:
            real = mask.bool()
            start = kl_divergence(base["start_logits"], kept["start_logits"], real)
            end = kl_divergence(base["end_logits"], kept["end_logits"], real)
            return (0.5 * (start + end)).cpu()
        logits = kept["logits"]
        if logits.dim() == 3:  # token classification: mean over real tokens
            real = mask.to(torch.float32)
            per_token = kl_divergence(base["logits"], logits)
            return ((per_token * real).sum(-1) / real.sum(-1).clamp_min(1)).cpu()
        return kl_divergence(base["logits"], logits).cpu()

    def _predict(self, kept: Mapping[str, torch.Tensor], mask: torch.Tensor, batch: _Batch) -> torch.Tensor:
        if self.task == "classification":
            return kept["logits"].argmax(dim=-1).cpu()
        if self.task == "squad":
            return self._best_spans(kept["start_logits"], kept["end_logits"], mask, batch)
        return torch.empty(0)

    def _best_spans(
        self,
        start_logits: torch.Tensor,  # (batch, seq)
        end_logits: torch.Tensor,  # (batch, seq)
        mask: torch.Tensor,  # (batch, seq)
        batch: _Batch,
    ) -> torch.Tensor:  # (batch, 3): score, start token, end token; score -inf when no valid span
        """Each window's best span among the top-n starts and ends (vectorised n-best)."""
        context = batch.context
        assert context is not None
        seq = start_logits.shape[1]
        real = mask.bool().cpu()
        start_logits = start_logits.float().cpu().masked_fill(~real, float("-inf"))
        end_logits = end_logits.float().cpu().masked_fill(~real, float("-inf"))
        k = min(self.n_best, seq)
        start_values, start_index = start_logits.topk(k, dim=-1)  # (batch, k)
        end_values, end_index = end_logits.topk(k, dim=-1)
        length = end_index[:, None, :] - start_index[:, :, None]  # (batch, k, k)
        valid = (
            context.gather(1, start_index)[:, :, None]
            & context.gather(1, end_index)[:, None, :]
            & (length >= 0)
            & (length < self.max_answer_tokens)
        )
        scores = (start_values[:, :, None] + end_values[:, None, :]).masked_fill(~valid, float("-inf"))
        best, flat = scores.flatten(1).max(dim=-1)
        return torch.stack(
            [
                best,
                start_index.gather(1, (flat // k)[:, None])[:, 0].float(),
                end_index.gather(1, (flat % k)[:, None])[:, 0].float(),
            ],
            dim=-1,
        )

    def _score(self, per_feature: list[tuple[np.ndarray, torch.Tensor]]) -> dict[str, float]:
        prepared = self._prepared
        if self.task == "classification":
            predictions = np.empty(prepared.n_features, dtype=np.int64)
            for rows, predicted in per_feature:
                predictions[rows] = predicted.numpy()
            assert prepared.labels is not None
            config: Any = self.model.config
            return classification_scores(predictions, prepared.labels, int(config.num_labels))
        if self.task == "squad":
            spans = np.empty((prepared.n_features, 3), dtype=np.float64)
            for rows, best in per_feature:
                spans[rows] = best.numpy()
            return squad_scores(self._answers(spans), self.examples_)
        return {}

    def _answers(self, spans: np.ndarray) -> dict[str, str]:
        """Each question's best span over its windows, as context text."""
        prepared = self._prepared
        assert prepared.feature_example is not None
        assert prepared.offsets is not None
        best: dict[int, tuple[float, int]] = {}
        for feature, example in enumerate(prepared.feature_example.tolist()):
            score = spans[feature, 0]
            if np.isfinite(score) and (example not in best or score > best[example][0]):
                best[example] = (score, feature)
        answers: dict[str, str] = {}
        for index, example in enumerate(self.examples_):
            if index not in best:
                answers[example.id] = ""
                continue
            feature = best[index][1]
            start, end = int(spans[feature, 1]), int(spans[feature, 2])
            offsets = prepared.offsets[feature]
            answers[example.id] = example.context[offsets[start][0] : offsets[end][1]]
        return answers

    def predictions(self, spec: AblationSpec | None = None) -> dict[str, str]:
        """SQuAD only: ``{question id: predicted answer}`` (unablated by default), for inspection."""
        if self.task != "squad":
            raise TaskDataError("predictions() is for the squad task")
        spec = spec or AblationSpec.empty(shapes=self.shapes_)
        spans = np.empty((self._prepared.n_features, 3), dtype=np.float64)
        with torch.inference_mode(), Ablator(self.model, spec) as ablator:
            for batch in self._prepared.batches:
                mask = batch.inputs["attention_mask"]
                ablator.set_batch(mask, segment_ids=batch.segment_ids)
                output = self.model(**batch.inputs)
                spans[batch.rows] = self._best_spans(output.start_logits, output.end_logits, mask, batch).numpy()
        return self._answers(spans)


# --------------------------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------------------------

PlanItem: TypeAlias = "PlanRow | tuple[str, str, AblationSpec]"
Progress: TypeAlias = Callable[[int, int, Outcome], None]


def run_plan(
    evaluator: Evaluator,
    plan: Iterable[PlanItem],
    *,
    assignments: Assignments | None = None,
    renormalize: bool = False,
    progress: Progress | bool | None = None,
    roles: Roles | None = None,
) -> list[Outcome]:
    """Run every row of ``plan`` through one evaluator (tokenization and baseline shared).

    Rows are :class:`~ingest.ablation.PlanRow` (resolved against ``assignments``, and ``roles`` for
    selections by role) or
    ``(id, label, AblationSpec)`` triples. Every row is validated before anything runs.
    ``progress`` is a callback ``(done, total, outcome)`` or ``True`` for a ``rich`` bar.
    """
    resolved: list[tuple[str, str, AblationSpec, str | None]] = []
    for item in plan:
        if isinstance(item, PlanRow):
            spec = item.to_spec(assignments, shapes=evaluator.shapes_, renormalize=renormalize, roles=roles)
            resolved.append((item.id, item.label, spec, item.paper_ref))
        else:
            row_id, label, spec = item
            resolved.append((row_id, label, spec, None))
    ids = [row[0] for row in resolved]
    duplicated = sorted({i for i in ids if ids.count(i) > 1})
    if duplicated:
        raise ValueError(f"plan row ids must be unique: {duplicated}")

    bar = None
    if progress is True:
        from rich.progress import Progress as RichProgress

        bar = RichProgress(transient=True)
        task_id = bar.add_task("ablation plan", total=len(resolved))
        bar.start()
    try:
        baseline = evaluator.baseline()
        outcomes: list[Outcome] = []
        for done, (row_id, label, spec, ref) in enumerate(resolved, start=1):
            started = time.perf_counter()
            metrics = evaluator.run(spec)
            outcome = Outcome(
                row_id=row_id,
                label=label,
                spec=spec.to_dict(),
                metrics=metrics,
                baseline=baseline,
                seconds=time.perf_counter() - started,
                n_examples=evaluator.n_examples,
                paper_ref=ref,
            )
            outcomes.append(outcome)
            logger.info("%s: %s (%.2f s)", row_id, metrics.to_dict(), outcome.seconds)
            if bar is not None:
                bar.update(task_id, advance=1, description=row_id)
            elif callable(progress):
                progress(done, len(resolved), outcome)
    finally:
        if bar is not None:
            bar.stop()
    return outcomes
