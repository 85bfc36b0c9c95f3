"""What a head is worth: importance scores and pruning curves (SPEC section 7, Michel et al. 2019).

A gate ``xi_h`` multiplies head ``h``'s context vector before the output projection. It lives in
headcat's own attention path (:class:`~ingest.attention.AttentionProbe`'s ``on_output``), so it
exists for every architecture and stack that path serves; a head is ``(stack, layer, head)``.
The gate is per example, ``(batch, head)`` per layer, created as a leaf the moment the layer
runs, so one backward pass gives every example's own gradient ``dLoss(x)/dxi_h``:

    I_h = mean over examples of |dLoss(x) / dxi_h|   at xi = 1

Losses (:data:`LossKind`):

- ``task``: cross-entropy on the label (classification), or on the start and end positions
  (SQuAD; each tokenized window is one example, ``(CE_start + CE_end) / 2`` as in the HF QA
  head, a window that cuts the first gold answer off targets ``[CLS]``).
- ``lm``: the model's own pre-training loss: masked LM with a seeded 15 % mask (each example's
  mask drawn from ``(seed, example index)``, so it does not depend on batching; masked tokens
  become ``[MASK]``), or next-token cross-entropy for causal LMs; mean over an example's tokens.
- ``sensitivity``: a bare encoder's ``||dH(x)/dxi_h||`` over its last hidden states (real
  tokens), estimated as ``sqrt(mean_k (d(r_k . H(x))/dxi_h)^2)`` over ``K`` seeded Rademacher
  probes ``r_k`` (``K`` backward passes per batch, one forward).

:func:`normalize_by_layer` is Michel's per-layer L2 normalisation. :func:`prune_order` turns
scores, head types or a seed into the order heads are removed in, and :func:`pruning_curve`
measures a task metric (through :class:`~ingest.evaluation.Evaluator` and the
:class:`~ingest.ablation.Ablator`'s ``prune``) at each step, every point against the one shared
baseline; ``iterative=True`` re-scores the remaining heads after each step, as Michel did.

Nothing here runs under ``torch.inference_mode()``: the scores need autograd. Parameters are
frozen for the duration (``requires_grad=False``); the gates are the only leaves with a gradient.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

import numpy as np
import torch
from torch import nn

from ingest.ablation import AblationSpec
from ingest.attention import AttentionProbe, OutputCall
from ingest.evaluation import Evaluator, Metrics
from ingest.tasks import TaskDataError
from ingest.types import Stack

logger = logging.getLogger(__name__)

LossKind = Literal["task", "lm", "sensitivity"]
LOSSES: tuple[LossKind, ...] = get_args(LossKind)
Ranking = Literal["importance", "type", "random", "-importance"]
RANKINGS: tuple[Ranking, ...] = get_args(Ranking)
StackHead = tuple[Stack, int, int]  # (stack, layer, head)

# The type ranking prunes heads whose attention goes to special tokens first (the "no-op" heads
# of Clark et al. 2019 and Kovaleva et al. 2019), positional (diagonal) heads last; heads of a
# type not listed here come after these; within a type, by layer then head.
TYPE_ORDER: tuple[str, ...] = ("vertical", "dense_vertical", "dense", "diagonal")

MLM_ARCHITECTURE_SUFFIXES = ("ForMaskedLM", "ForPreTraining")
CAUSAL_ARCHITECTURE_SUFFIXES = ("ForCausalLM", "LMHeadModel")


class ImportanceError(ValueError):
    """A loss the model cannot compute, or data it cannot be computed on."""


# --------------------------------------------------------------------------------------------
# Configuration and results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportanceConfig:
    """How the scores are computed; stored with them."""

    loss: LossKind = "task"
    seed: int = 0
    mask_probability: float = 0.15  # lm, masked LMs
    probes: int = 8  # sensitivity: Rademacher probes per batch

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ImportanceError(f"unknown loss {self.loss!r}; losses: {', '.join(LOSSES)}")
        if not 0.0 < self.mask_probability < 1.0:
            raise ImportanceError(f"mask_probability must lie in (0, 1), got {self.mask_probability}")
        if self.probes < 1:
            raise ImportanceError(f"probes must be at least 1, got {self.probes}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ImportanceResult:
    """Raw and per-layer normalised scores per stack, ``(layers, heads)`` arrays."""

    config: ImportanceConfig
    raw: dict[Stack, np.ndarray]
    normalized: dict[Stack, np.ndarray]
    n_examples: int
    mean_loss: float
    seconds: float

    def heads(self) -> Iterator[tuple[StackHead, float, float]]:
        """``((stack, layer, head), raw, normalised)`` for every head."""
        for stack, raw in self.raw.items():
            norm = self.normalized[stack]
            for layer in range(raw.shape[0]):
                for head in range(raw.shape[1]):
                    yield (stack, layer, head), float(raw[layer, head]), float(norm[layer, head])

    def single_stack(self) -> np.ndarray:
        """The normalised ``(layers, heads)`` scores of a single-stack model."""
        if len(self.normalized) != 1:
            raise ImportanceError(f"the model has stacks {sorted(self.normalized)}; pick one")
        return next(iter(self.normalized.values()))


def normalize_by_layer(scores: np.ndarray) -> np.ndarray:
    """Michel et al.'s normalisation: each layer's scores divided by their L2 norm (0 stays 0)."""
    scores = np.asarray(scores, dtype=np.float64)  # (layers, heads)
    norms = np.sqrt((scores**2).sum(axis=-1, keepdims=True))
    return np.divide(scores, norms, out=np.zeros_like(scores), where=norms > 0)


# --------------------------------------------------------------------------------------------
# The gate
# --------------------------------------------------------------------------------------------


class HeadGate:
    """``on_output`` callback: ``output * xi[:, None, :, None]`` with a per-example gate per layer.

    Each ``(stack, layer)``'s gate is a fresh ``(batch, head)`` leaf of ones that requires grad,
    made when the layer first runs in a forward pass (:meth:`reset` before each). ``fixed``
    maps ``(stack, layer)`` to a constant ``(head,)`` factor (0 for a pruned head) applied too.
    """

    def __init__(self, fixed: Mapping[tuple[Stack, int], torch.Tensor] | None = None) -> None:
        self.fixed = dict(fixed or {})
        self.gates: dict[tuple[Stack, int], torch.Tensor] = {}

    def reset(self) -> None:
        self.gates = {}

    def __call__(self, call: OutputCall) -> torch.Tensor:
        output = call.output  # (batch, q, head, head_dim)
        key = (call.stack, call.layer)
        if key in self.gates:
            raise RuntimeError(f"{call.stack} layer {call.layer} ran twice in one forward pass")
        gate = torch.ones(output.shape[0], output.shape[2], dtype=output.dtype, device=output.device,
                          requires_grad=True)  # fmt: skip
        self.gates[key] = gate
        factor = gate
        if key in self.fixed:
            factor = gate * self.fixed[key].to(device=output.device, dtype=output.dtype)[None, :]
        return output * factor[:, None, :, None]


def _no_attention(_: Any) -> None:
    return None


# --------------------------------------------------------------------------------------------
# Loss batches
# --------------------------------------------------------------------------------------------


@dataclass
class LossBatch:
    """Model inputs and what the loss needs: ``labels`` (batch,), ``start``/``end`` (batch,),
    or MLM ``lm_labels`` (batch, seq; -100 where not masked)."""

    inputs: dict[str, torch.Tensor]
    targets: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.inputs["input_ids"].shape[0])


def architectures(model: nn.Module) -> tuple[str, ...]:
    config: Any = model.config
    return tuple(config.architectures or ()) or (type(model).__name__,)


def lm_kind(model: nn.Module) -> Literal["masked", "causal"] | None:
    """Which pre-training loss the loaded model has the head for, from its class."""
    name = type(model).__name__
    if name.endswith(MLM_ARCHITECTURE_SUFFIXES):
        return "masked"
    if name.endswith(CAUSAL_ARCHITECTURE_SUFFIXES):
        return "causal"
    return None


def squad_positions(evaluator: Evaluator, rows: np.ndarray, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token start and end of each window's first gold answer; ``(0, 0)`` when the window cuts it off."""
    prepared = evaluator._prepared
    assert prepared.offsets is not None
    assert prepared.feature_example is not None
    starts, ends = [], []
    for feature in rows.tolist():
        example = evaluator.examples_[int(prepared.feature_example[feature])]
        start_char = example.answer_starts[0]
        end_char = start_char + len(example.answers[0])
        offsets = prepared.offsets[feature]
        context = [i for i, (a, _) in enumerate(offsets) if a >= 0]
        start = end = 0
        if context and offsets[context[0]][0] <= start_char and offsets[context[-1]][1] >= end_char:
            start = max(i for i in context if offsets[i][0] <= start_char)
            end = min(i for i in context if offsets[i][1] >= end_char)
        starts.append(min(start, seq - 1))
        ends.append(min(max(end, start), seq - 1))
    return torch.tensor(starts), torch.tensor(ends)


def _mlm_mask(input_ids: torch.Tensor, special: torch.Tensor, rows: np.ndarray, seed: int, p: float) -> torch.Tensor:
    """(batch, seq) bool: each example's seeded ``p`` share of its maskable tokens (at least one)."""
    chosen = torch.zeros_like(input_ids, dtype=torch.bool)
    for j, row in enumerate(rows.tolist()):
        candidates = torch.nonzero(~special[j]).flatten().numpy()
        if len(candidates) == 0:
            continue
        rng = np.random.default_rng([seed, int(row)])
        picked = candidates[rng.random(len(candidates)) < p]
        if len(picked) == 0:
            picked = candidates[[int(rng.integers(len(candidates)))]]
        chosen[j, torch.from_numpy(picked)] = True
    return chosen


def loss_batches(evaluator: Evaluator, config: ImportanceConfig) -> list[LossBatch]:
    """The evaluator's tokenized batches with the targets ``config.loss`` needs (checked here)."""
    model = evaluator.model
    prepared = evaluator._prepared
    out: list[LossBatch] = []
    if config.loss == "task":
        if evaluator.task not in ("classification", "squad"):
            raise ImportanceError("the task loss needs labelled data (classification or SQuAD)")
        for batch in prepared.batches:
            targets: dict[str, torch.Tensor] = {}
            if evaluator.task == "classification":
                assert prepared.labels is not None
                targets["labels"] = torch.from_numpy(prepared.labels[batch.rows]).to(evaluator.device_)
            else:
                start, end = squad_positions(evaluator, batch.rows, batch.inputs["input_ids"].shape[1])
                targets["start"], targets["end"] = start.to(evaluator.device_), end.to(evaluator.device_)
            out.append(LossBatch(batch.inputs, targets))
        return out
    if config.loss == "lm" and lm_kind(model) == "masked":
        tokenizer = evaluator.tokenizer
        if tokenizer.mask_token_id is None:
            raise ImportanceError("the masked-LM loss needs a tokenizer with a mask token")
        special_ids = torch.tensor(sorted(set(tokenizer.all_special_ids)))
        for batch in prepared.batches:
            ids = batch.inputs["input_ids"]
            special = torch.isin(ids.cpu(), special_ids) | (batch.inputs["attention_mask"].cpu() == 0)
            chosen = _mlm_mask(ids.cpu(), special, batch.rows, config.seed, config.mask_probability).to(ids.device)
            inputs = dict(batch.inputs)
            inputs["input_ids"] = ids.masked_fill(chosen, tokenizer.mask_token_id)
            out.append(LossBatch(inputs, {"lm_labels": ids.masked_fill(~chosen, -100)}))
        return out
    return [LossBatch(batch.inputs) for batch in prepared.batches]


# --------------------------------------------------------------------------------------------
# Per-example losses
# --------------------------------------------------------------------------------------------


def _wide(x: torch.Tensor) -> torch.Tensor:
    """float32 for half-precision logits; float64 stays float64."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def per_example_loss(model: nn.Module, output: Any, batch: LossBatch, loss: LossKind) -> torch.Tensor:  # (batch,)
    """Each example's own loss (their sum is what is differentiated)."""
    ce = nn.functional.cross_entropy
    if loss == "task":
        if "labels" in batch.targets:
            logits = getattr(output, "logits", None)
            if logits is None or logits.dim() != 2:
                raise ImportanceError("the task loss needs a sequence-classification head")
            return ce(_wide(logits), batch.targets["labels"], reduction="none")
        if getattr(output, "start_logits", None) is None:
            raise ImportanceError("the SQuAD loss needs a question-answering head")
        start = ce(_wide(output.start_logits), batch.targets["start"], reduction="none")
        end = ce(_wide(output.end_logits), batch.targets["end"], reduction="none")
        return (start + end) / 2
    if loss == "lm":
        logits = _wide(output.logits)  # (batch, seq, vocab)
        if "lm_labels" in batch.targets:
            labels = batch.targets["lm_labels"]
        else:  # causal: token t predicts token t + 1
            labels = batch.inputs["input_ids"].masked_fill(batch.inputs["attention_mask"] == 0, -100)
            logits, labels = logits[:, :-1], labels[:, 1:]
        token = ce(logits.transpose(1, 2), labels, reduction="none", ignore_index=-100)  # (batch, seq)
        counted = (labels != -100).to(token.dtype)
        return (token * counted).sum(-1) / counted.sum(-1).clamp_min(1)
    raise ImportanceError(f"no per-example loss for {loss!r}")


def check_loss(model: nn.Module, loss: LossKind) -> None:
    """Refuse a loss the loaded model cannot compute (before any forward pass)."""
    name = type(model).__name__
    if loss == "task" and not name.endswith(("ForSequenceClassification", "ForQuestionAnswering")):
        raise ImportanceError(f"the task loss needs a classification or QA head; {name} has none")
    if loss == "lm" and lm_kind(model) is None:
        raise ImportanceError(f"the lm loss needs a masked- or causal-LM head; {name} has none")


# --------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------


class _Frozen:
    """Parameters without gradients for the duration (restored after)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __enter__(self) -> None:
        self._flags = [p.requires_grad for p in self.model.parameters()]
        self.model.requires_grad_(False)

    def __exit__(self, *exc: object) -> None:
        for p, flag in zip(self.model.parameters(), self._flags, strict=True):
            p.requires_grad_(flag)


def _stack_arrays(sums: Mapping[tuple[Stack, int], torch.Tensor]) -> dict[Stack, np.ndarray]:
    out: dict[Stack, np.ndarray] = {}
    for stack in dict.fromkeys(key[0] for key in sums):
        layers = sorted(layer for s, layer in sums if s == stack)
        if layers != list(range(len(layers))):
            raise RuntimeError(f"{stack} layers {layers} are not 0..n-1: did every layer run through the gate?")
        out[stack] = np.stack([sums[(stack, layer)].double().cpu().numpy() for layer in layers])
    return out


def head_importance(
    model: nn.Module,
    batches: Sequence[LossBatch],
    config: ImportanceConfig,
    *,
    pruned: Iterable[StackHead] = (),
    progress: Callable[[int, int], None] | None = None,
) -> ImportanceResult:
    """Importance of every head over ``batches`` (SPEC 7); ``pruned`` heads are gated to 0 (their score is 0)."""
    started = time.perf_counter()
    if config.loss != "sensitivity":
        check_loss(model, config.loss)
    fixed: dict[tuple[Stack, int], torch.Tensor] = {}
    pruned = list(pruned)
    gate = HeadGate()
    sums: dict[tuple[Stack, int], torch.Tensor] = {}
    total_loss, n = 0.0, 0
    generator = torch.Generator(device="cpu").manual_seed(config.seed)
    was_training = model.training
    model.eval()
    try:
        with _Frozen(model), torch.enable_grad(), AttentionProbe(model, _no_attention, on_output=gate):
            for b, batch in enumerate(batches):
                if b == 0 and pruned:
                    fixed = _fixed_factors(model, batch, pruned)
                    gate.fixed = fixed
                gate.reset()
                output = model(**batch.inputs)
                if not gate.gates:
                    raise ImportanceError(
                        f"{type(model).__name__}'s attention never reached headcat's attention path: no gate"
                    )
                gates = list(gate.gates.values())
                if config.loss == "sensitivity":
                    grads_abs = _sensitivity(output, batch, gates, config.probes, generator)
                    losses = None
                else:
                    losses = per_example_loss(model, output, batch, config.loss)
                    grads = torch.autograd.grad(losses.sum(), gates, allow_unused=True)
                    grads_abs = [
                        torch.zeros_like(g) if d is None else d.abs() for g, d in zip(gates, grads, strict=True)
                    ]
                for key, value in zip(gate.gates, grads_abs, strict=True):
                    summed = value.detach().double().sum(dim=0)  # (head,)
                    sums[key] = summed if key not in sums else sums[key] + summed
                if losses is not None:
                    total_loss += float(losses.detach().double().sum())
                n += batch.size
                if progress is not None:
                    progress(b + 1, len(batches))
    finally:
        model.train(was_training)
    if n == 0:
        raise ImportanceError("no examples to score")
    raw = {stack: scores / n for stack, scores in _stack_arrays(sums).items()}
    normalized = {stack: normalize_by_layer(scores) for stack, scores in raw.items()}
    seconds = time.perf_counter() - started
    logger.info("importance (%s) of %d heads over %d examples in %.2f s", config.loss,
                sum(s.size for s in raw.values()), n, seconds)  # fmt: skip
    return ImportanceResult(config, raw, normalized, n, total_loss / n if config.loss != "sensitivity" else math.nan,
                            seconds)  # fmt: skip


def _fixed_factors(
    model: nn.Module, batch: LossBatch, pruned: list[StackHead]
) -> dict[tuple[Stack, int], torch.Tensor]:
    """``(stack, layer) -> (head,)`` factors with 0 on the pruned heads (head counts from one probe pass)."""
    counts: dict[tuple[Stack, int], int] = {}

    def count(call: OutputCall) -> None:
        counts[(call.stack, call.layer)] = int(call.output.shape[2])

    one = {name: value[:1] for name, value in batch.inputs.items()}
    with torch.inference_mode(), AttentionProbe(model, _no_attention, on_output=count):
        model(**one)
    fixed: dict[tuple[Stack, int], torch.Tensor] = {}
    for stack, layer, head in pruned:
        if (stack, layer) not in counts or not 0 <= head < counts[(stack, layer)]:
            raise ImportanceError(f"head {(stack, layer, head)} is not a head of the model")
        fixed.setdefault((stack, layer), torch.ones(counts[(stack, layer)]))[head] = 0.0
    return fixed


def _sensitivity(
    output: Any,
    batch: LossBatch,
    gates: list[torch.Tensor],
    probes: int,
    generator: torch.Generator,
) -> list[torch.Tensor]:
    """Per example and head, ``sqrt(mean_k (d(r_k . H)/dxi)^2)`` over Rademacher probes on real tokens."""
    hidden = getattr(output, "last_hidden_state", None)
    if hidden is None:
        raise ImportanceError("the sensitivity loss needs a bare encoder's last hidden states")
    real = batch.inputs["attention_mask"].to(hidden.dtype)[:, :, None]  # (batch, seq, 1)
    squares = [torch.zeros_like(g) for g in gates]
    for k in range(probes):
        r = (torch.randint(0, 2, hidden.shape, generator=generator).to(hidden) * 2 - 1) * real
        grads = torch.autograd.grad((r * hidden).sum(), gates, retain_graph=k < probes - 1, allow_unused=True)
        for i, d in enumerate(grads):
            if d is not None:
                squares[i] = squares[i] + d.detach() ** 2
    return [(s / probes).sqrt() for s in squares]


def score_evaluator(
    evaluator: Evaluator,
    config: ImportanceConfig,
    *,
    pruned: Iterable[StackHead] = (),
    progress: Callable[[int, int], None] | None = None,
) -> ImportanceResult:
    """:func:`head_importance` over an evaluator's prepared data."""
    if config.loss != "sensitivity":
        check_loss(evaluator.model, config.loss)
    try:
        batches = loss_batches(evaluator, config)
    except TaskDataError as error:
        raise ImportanceError(str(error)) from error
    return head_importance(evaluator.model, batches, config, pruned=pruned, progress=progress)


# --------------------------------------------------------------------------------------------
# Rankings and pruning curves
# --------------------------------------------------------------------------------------------


def prune_order(
    ranking: Ranking,
    num_layers: int,
    num_heads: int,
    *,
    scores: np.ndarray | None = None,  # (layers, heads), normalised importance
    types: Mapping[tuple[int, int], str] | None = None,
    seed: int = 0,
) -> list[tuple[int, int]]:
    """Every ``(layer, head)`` in the order it is pruned.

    ``importance``: ascending score (ties by layer, head); ``-importance``: descending;
    ``random``: a permutation from ``seed``; ``type``: :data:`TYPE_ORDER`, then other types by
    name, each by layer then head.
    """
    heads = [(layer, head) for layer in range(num_layers) for head in range(num_heads)]
    if ranking in ("importance", "-importance"):
        if scores is None or scores.shape != (num_layers, num_heads):
            raise ImportanceError(f"the {ranking} ranking needs a ({num_layers}, {num_heads}) score array")
        sign = 1.0 if ranking == "importance" else -1.0
        return sorted(heads, key=lambda h: (sign * float(scores[h]), h))
    if ranking == "random":
        permutation = np.random.default_rng(seed).permutation(len(heads))
        return [heads[i] for i in permutation]
    if ranking == "type":
        if not types:
            raise ImportanceError("the type ranking needs the heads' types (a clustering of the model)")
        missing = [h for h in heads if h not in types]
        if missing:
            raise ImportanceError(f"the type ranking needs a type for every head; {len(missing)} have none")
        rank = {name: i for i, name in enumerate(TYPE_ORDER)}
        return sorted(heads, key=lambda h: (rank.get(types[h], len(TYPE_ORDER)), types[h], h))
    raise ImportanceError(f"unknown ranking {ranking!r}; rankings: {', '.join(RANKINGS)}")


def step_counts(total: int, steps: int, max_share: float = 0.5) -> list[int]:
    """Heads pruned at each point: 0 (the baseline), then ``steps`` even steps up to ``max_share``."""
    if steps < 1:
        raise ImportanceError(f"steps must be at least 1, got {steps}")
    if not 0.0 < max_share <= 1.0:
        raise ImportanceError(f"max_share must lie in (0, 1], got {max_share}")
    return [0] + [round(i * max_share * total / steps) for i in range(1, steps + 1)]


def prune_spec(heads: Iterable[tuple[int, int]], num_layers: int, num_heads: int) -> AblationSpec:
    return AblationSpec.from_heads({tuple(h): "prune" for h in heads}, num_layers, num_heads)  # type: ignore[misc]


@dataclass(frozen=True)
class CurvePoint:
    step: int
    pruned: int  # heads pruned
    share: float  # of all heads
    metrics: Mapping[str, float]
    heads: tuple[tuple[int, int], ...]  # every head pruned at this point
    seconds: float


@dataclass(frozen=True)
class Curve:
    ranking: Ranking
    iterative: bool
    order: tuple[tuple[int, int], ...]  # the order heads were pruned in (up to the last point)
    points: tuple[CurvePoint, ...]
    baseline: Metrics

    def metric(self, name: str) -> list[float]:
        return [float(p.metrics[name]) for p in self.points]


def pruning_curve(
    evaluator: Evaluator,
    ranking: Ranking,
    *,
    steps: int = 10,
    max_share: float = 0.5,
    iterative: bool = False,
    scores: np.ndarray | None = None,
    types: Mapping[tuple[int, int], str] | None = None,
    seed: int = 0,
    importance: ImportanceConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Curve:
    """Metrics as heads are pruned in ``ranking`` order; point 0 is the evaluator's shared baseline.

    One-shot: the order is fixed up front (``scores`` for the importance rankings). Iterative
    (importance rankings only; the others do not change between steps): after each step the
    remaining heads are re-scored with the pruned ones gated to 0 (``importance``, default the
    task loss on the evaluator's data) and the next heads are the lowest (highest) of those.
    """
    num_layers, num_heads = evaluator.num_layers_, evaluator.num_heads_
    total = num_layers * num_heads
    counts = step_counts(total, steps, max_share)
    baseline = evaluator.baseline()
    iterate = iterative and ranking in ("importance", "-importance")
    if iterate:
        config = importance or ImportanceConfig("task", seed=seed)
        if scores is None:
            scores = score_evaluator(evaluator, config).single_stack()
        order: list[tuple[int, int]] = []
    else:
        order = prune_order(ranking, num_layers, num_heads, scores=scores, types=types, seed=seed)
    points = [CurvePoint(0, 0, 0.0, dict(baseline.values), (), 0.0)]
    for step, count in enumerate(counts[1:], start=1):
        started = time.perf_counter()
        if iterate:
            if step > 1:
                stack = _only_stack(evaluator)
                scores = score_evaluator(evaluator, config, pruned=[(stack, *h) for h in order]).single_stack()
            assert scores is not None
            remaining = [h for h in prune_order(ranking, num_layers, num_heads, scores=scores) if h not in set(order)]
            order.extend(remaining[: count - len(order)])
        chosen = tuple(sorted(order[:count]))
        metrics = baseline if count == 0 else evaluator.run(prune_spec(chosen, num_layers, num_heads))
        points.append(CurvePoint(step, count, count / total, dict(metrics.values), chosen,
                                 time.perf_counter() - started))  # fmt: skip
        logger.info("%s%s: %d heads pruned: %s", ranking, " (iterative)" if iterate else "", count, metrics.to_dict())
        if progress is not None:
            progress(step, len(counts) - 1)
    last = counts[-1]
    return Curve(ranking, iterate, tuple(order[:last]), tuple(points), baseline)


def _only_stack(evaluator: Evaluator) -> Stack:
    found: set[Stack] = set()

    def see(call: OutputCall) -> None:
        found.add(call.stack)

    batch = evaluator._prepared.batches[0]
    with torch.inference_mode(), AttentionProbe(evaluator.model, _no_attention, on_output=see):
        evaluator.model(**{name: value[:1] for name, value in batch.inputs.items()})
    if len(found) != 1:
        raise ImportanceError(f"pruning curves prune one stack; the model has {sorted(found)}")
    return next(iter(found))


def primary_metric(task: str, values: Mapping[str, float]) -> str:
    """The metric a curve is drawn in: accuracy (classification), F1 (SQuAD), else the drift."""
    for name in {"classification": ("accuracy",), "squad": ("f1",)}.get(task, ()) + ("cosine", "kl"):
        if name in values:
            return name
    return next(iter(values))
