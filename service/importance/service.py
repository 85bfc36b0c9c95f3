"""Importance runs and pruning curves (SPEC section 7): validate, run, store, read.

Everything a request names is checked before anything is queued or computed (:func:`validate_importance`,
:func:`validate_curves`): the model; the loss it can compute (``task`` needs a classification or
QA head, ``lm`` a masked- or causal-LM head, read from its config without loading weights); the
data (readable, labels fit the head: the ablation readers); the head types when the type ranking
is asked for; stored scores when named. The jobs (:func:`prepare_importance`,
:func:`prepare_curves`) check it all again, compute outside any transaction and return the writer
that stores the outcome in the job's final transaction: an interrupted job stores nothing.

``torch`` is imported lazily, in the jobs only.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session, sessionmaker

from service import current
from service.ablations import repository as ablations
from service.ablations.data import DataSet, ModelHead, choose_task, model_head, read_data
from service.ablations.schemas import AblationCreate, Task
from service.ablations.service import head_types
from service.errors import InvalidInput, NotFound, load_refused
from service.importance import repository
from service.importance.schemas import (
    DataRead,
    HeadScoreRead,
    ImportanceCreate,
    ImportanceRunRead,
    Loss,
    PointRead,
    PruningCurveCreate,
    PruningCurveRead,
    RankingCurveRead,
)
from service.jobs.runner import Progress, Writer
from service.models import repository as models
from service.orm import CatalogModel, ImportanceRun, ImportanceScore, PruningCurve, PruningPoint

if TYPE_CHECKING:
    from ingest.evaluation import Evaluator
    from ingest.importance import ImportanceResult
    from ingest.loading import LoadedModel

log = logging.getLogger(__name__)

EVALUATOR_TASKS: dict[str, str] = {"squad": "squad", "glue": "classification", "drift": "drift"}
TASK_HEADS = ("sequence-classification", "question-answering")
# The type ranking's order (ingest.importance.TYPE_ORDER), repeated here so the API needs no torch.
TYPE_ORDER: tuple[str, ...] = ("vertical", "dense_vertical", "dense", "diagonal")


# --------------------------------------------------------------------------------------------
# Which loss, which model class
# --------------------------------------------------------------------------------------------


def lm_kind(head: ModelHead) -> str | None:
    """``masked-lm`` / ``causal-lm`` when the config's architecture has that head, else None."""
    for name in head.architectures:
        if name.endswith(("ForMaskedLM", "ForPreTraining")):
            return "masked-lm"
        if name.endswith(("ForCausalLM", "LMHeadModel")):
            return "causal-lm"
    return None


def choose_loss(requested: Loss | None, head: ModelHead, name: str) -> Loss:
    """The loss asked for, or the one the head implies; one the model cannot compute is refused."""
    what = ", ".join(head.architectures) or "no architecture in its config"
    if requested is None:
        return "task" if head.kind in TASK_HEADS else ("lm" if lm_kind(head) else "sensitivity")
    if requested == "task" and head.kind not in TASK_HEADS:
        raise InvalidInput(
            f"loss: the task loss needs a classification or question-answering head, but {name!r} has {what}; "
            "use lm (a model with an LM head) or sensitivity",
            field="loss",
        )
    if requested == "lm" and lm_kind(head) is None:
        raise InvalidInput(
            f"loss: the lm loss needs a masked- or causal-LM head, but {name!r} has {what}; "
            f"use {'task' if head.kind in TASK_HEADS else 'sensitivity'}",
            field="loss",
        )
    return requested


def load_kind(loss: Loss, head: ModelHead) -> str:
    """The ``ingest.loading`` task the model is loaded as for ``loss``."""
    if loss == "task":
        return head.kind
    if loss == "lm":
        kind = lm_kind(head)
        assert kind is not None
        return kind
    return "base"  # sensitivity: the encoder's own last hidden states, whatever head the checkpoint has


def _as_ablation_request(request: ImportanceCreate | PruningCurveCreate, task: Task) -> AblationCreate:
    """The fields the ablation data reader looks at (its checks and subsets are the same)."""
    return AblationCreate.model_construct(
        model=request.model, data=request.data, task=task, articles=request.articles, limit=request.limit,
        sample=request.sample,
    )  # fmt: skip


@dataclass(frozen=True)
class Checked:
    model_id: int
    model_name: str
    source: str
    revision: str | None  # the hub commit the catalog's features came from (None: a local directory)
    num_layers: int
    num_heads: int
    head: ModelHead
    loss: Loss
    task: Task  # the data's task: squad | glue | drift
    data: DataSet
    max_length: int | None

    @property
    def evaluator_max_length(self) -> int:
        return self.max_length or (384 if self.task == "squad" else 128)


def _model(session: Session, name: str) -> tuple[CatalogModel, ModelHead]:
    model = models.require(session, name, field="model")
    return model, model_head(model.source, model.revision)


def validate_importance(session: Session, request: ImportanceCreate, *, load_hub: bool = True) -> Checked:
    """Check everything an importance request names, in the order a user would fix it; read the data."""
    model, head = _model(session, request.model)
    loss = choose_loss(request.loss, head, model.name)
    if loss == "task":
        task: Task = choose_task(request.task, head, model.name)
    elif request.task is not None:
        raise InvalidInput(f"task: only the task loss reads task data; the {loss} loss reads any texts", field="task")
    else:
        task = "drift"
    data = read_data(_as_ablation_request(request, task), task, head, load_hub=load_hub)
    return Checked(model.id, model.name, model.source, model.revision, model.num_layers, model.num_heads, head, loss,
                   task, data, request.max_length)  # fmt: skip


@dataclass(frozen=True)
class CheckedCurves:
    checked: Checked
    clustering_id: int | None
    types: dict[tuple[int, int], str]
    stored_scores: dict[tuple[int, int], float] | None  # normalised, from importance_run


def validate_curves(session: Session, request: PruningCurveCreate, *, load_hub: bool = True) -> CheckedCurves:
    """Check a pruning-curve request: model, task, rankings' inputs (types, scores), data."""
    model, head = _model(session, request.model)
    if len(model.stacks or {}) > 1:
        raise InvalidInput(f"model: {model.name!r} has stacks {sorted(model.stacks)}; pruning curves prune "
                           "single-stack models", field="model")  # fmt: skip
    task = choose_task(request.task, head, model.name)
    needs_scores = any(r in ("importance", "-importance") for r in request.rankings)
    if request.loss == "task" and task == "drift":
        raise InvalidInput("loss: the task loss needs labelled data (task squad or glue), not drift", field="loss")
    loss = choose_loss(request.loss, head, model.name) if request.loss or needs_scores else "task"
    if loss == "task" and task == "drift":
        loss = "lm" if lm_kind(head) else "sensitivity"
    clustering_id: int | None = None
    types: dict[tuple[int, int], str] = {}
    if "type" in request.rankings:
        clustering_id, typed = head_types(session, model, request.clustering, required=True)
        types = {(layer, head): name for (_, layer, head), name in typed.items()}  # one stack (checked above)
        missing = model.num_layers * model.num_heads - len(types)
        if missing:
            raise InvalidInput(f"clustering: {missing} heads of {model.name!r} have no type in clustering "
                               f"{clustering_id}", field="clustering")  # fmt: skip
    elif request.clustering is not None:
        raise InvalidInput("clustering: only the type ranking uses a clustering", field="clustering")
    stored = None
    if request.importance_run is not None:
        if not needs_scores:
            raise InvalidInput("importance_run: only the importance rankings use stored scores",
                               field="importance_run")  # fmt: skip
        if request.iterative:
            raise InvalidInput("importance_run: an iterative curve re-scores as it goes; give no stored scores",
                               field="importance_run")  # fmt: skip
        run = repository.get_importance_run(session, request.importance_run)
        if run is None or run.status != "complete":
            raise NotFound(f"importance_run: no complete importance run with id {request.importance_run}",
                           field="importance_run")  # fmt: skip
        if run.model_id != model.id:
            raise InvalidInput(f"importance_run: run {run.id} scores {repository.model_name(session, run.model_id)!r}, "
                               f"not {model.name!r}", field="importance_run")  # fmt: skip
        stored = {(layer, head): norm for stack, layer, head, _, norm in repository.scores(session, run.id)}
    data = read_data(_as_ablation_request(request, task), task, head, load_hub=load_hub)
    checked = Checked(model.id, model.name, model.source, model.revision, model.num_layers, model.num_heads, head,
                      loss, task, data, request.max_length)  # fmt: skip
    return CheckedCurves(checked, clustering_id, types, stored)


# --------------------------------------------------------------------------------------------
# The jobs
# --------------------------------------------------------------------------------------------


def _load(checked: Checked, request: ImportanceCreate | PruningCurveCreate) -> LoadedModel:
    from ingest.loading import load_model

    try:
        loaded = load_model(checked.source, device=request.device, dtype=request.dtype, revision=checked.revision,
                            task=load_kind(checked.loss, checked.head))  # type: ignore[arg-type]  # fmt: skip
    except ValueError as error:
        raise load_refused(error) from error
    if (loaded.num_layers, loaded.num_heads) != (checked.num_layers, checked.num_heads):
        raise InvalidInput(
            f"model: {checked.source} now has {loaded.num_layers} x {loaded.num_heads} heads, the catalog "
            f"{checked.num_layers} x {checked.num_heads}; ingest it again under a new name",
            field="model",
        )
    return loaded


def _evaluator(checked: Checked, loaded: LoadedModel, batch_size: int) -> Evaluator:
    from ingest.evaluation import Evaluator
    from ingest.tasks import TaskDataError

    try:
        return Evaluator.for_task(
            EVALUATOR_TASKS[checked.task],  # type: ignore[arg-type]
            loaded.model, loaded.tokenizer, checked.data.examples, batch_size=batch_size, device=loaded.device,
            max_length=checked.evaluator_max_length, cache=False,
        )  # fmt: skip
    except TaskDataError as error:
        raise InvalidInput(f"data: {error}", field="data") from error


def _score(evaluator: Evaluator, checked: Checked, request: Any, progress: Progress | None = None) -> ImportanceResult:
    from ingest.importance import ImportanceConfig, ImportanceError, score_evaluator

    config = ImportanceConfig(
        checked.loss,
        seed=request.seed,
        mask_probability=getattr(request, "mask_probability", 0.15),
        probes=getattr(request, "probes", 8),
    )
    try:
        return score_evaluator(evaluator, config, progress=progress)
    except ImportanceError as error:
        raise InvalidInput(f"loss: {error}", field="loss") from error


def _importance_row(
    checked: Checked, request: Any, result: ImportanceResult, device: str, started_at: datetime, seconds: float
) -> ImportanceRun:
    return ImportanceRun(
        model_id=checked.model_id, status="complete", loss=checked.loss,
        task=checked.task if checked.loss == "task" else None, data_kind=checked.data.kind,
        data_source=checked.data.source, data_sha256=checked.data.sha256, data_subset=checked.data.subset,
        data_size=checked.data.size, limit=request.limit, n_examples=result.n_examples, seed=request.seed,
        mean_loss=None if math.isnan(result.mean_loss) else result.mean_loss,
        config={**request.model_dump(mode="json"), "importance": result.config.to_dict(),
                "max_length": checked.evaluator_max_length},
        device=device, dtype=request.dtype, seconds=seconds, started_at=started_at, finished_at=datetime.now(UTC),
    )  # fmt: skip


def _store_scores(session: Session, run: ImportanceRun, checked: Checked, result: ImportanceResult) -> int:
    ids = repository.head_ids(session, checked.model_id)
    stored = 0
    for key, raw, normalized in result.heads():
        head_id = ids.get(key)
        if head_id is None:
            raise InvalidInput(f"model: head {key} of {checked.model_name!r} is not in the catalog; ingest it again",
                               field="model")  # fmt: skip
        session.add(
            ImportanceScore(model_id=checked.model_id, run_id=run.id, head_id=head_id, raw=raw, normalized=normalized)
        )
        stored += 1
    return stored


def prepare_importance(sessions: sessionmaker[Session], request: dict[str, Any], progress: Progress) -> Writer:
    """The importance job: check, load, score every head; the writer stores the run and its scores."""
    spec = ImportanceCreate.model_validate(request)
    with sessions() as session:
        checked = validate_importance(session, spec)
    started_at, started = datetime.now(UTC), time.perf_counter()
    loaded = _load(checked, spec)
    log.info("Scoring the heads of %s with the %s loss on %d examples of %s", checked.model_name, checked.loss,
             len(checked.data.examples), checked.data.source)  # fmt: skip
    evaluator = _evaluator(checked, loaded, spec.batch_size)
    result = _score(evaluator, checked, spec, progress)
    seconds = time.perf_counter() - started

    def write(session: Session) -> dict[str, Any]:
        run = _importance_row(checked, spec, result, str(loaded.device), started_at, seconds)
        session.add(run)
        session.flush()
        current.completed(session, run)
        heads = _store_scores(session, run, checked, result)
        session.flush()
        log.info("Stored importance run %d of %r: %d heads, %.1f s", run.id, checked.model_name, heads, seconds)
        return {"importance_run_id": run.id, "model": checked.model_name, "heads": heads, "loss": checked.loss}

    return write


def prepare_curves(sessions: sessionmaker[Session], request: dict[str, Any], progress: Progress) -> Writer:
    """The pruning-curve job: baseline once, scores when a ranking needs them, one curve per ranking."""
    import numpy as np

    from ingest.importance import TYPE_ORDER as INGEST_TYPE_ORDER
    from ingest.importance import ImportanceConfig, ImportanceError, primary_metric, pruning_curve
    from ingest.tasks import TaskDataError

    assert INGEST_TYPE_ORDER == TYPE_ORDER
    spec = PruningCurveCreate.model_validate(request)
    with sessions() as session:
        validated = validate_curves(session, spec)
    checked = validated.checked
    started_at, started = datetime.now(UTC), time.perf_counter()
    loaded = _load(checked, spec)
    evaluator = _evaluator(checked, loaded, spec.batch_size)
    total = len(spec.rankings) * spec.steps
    progress(0, total)
    try:
        baseline_started = time.perf_counter()
        baseline = evaluator.baseline()
        baseline_seconds = time.perf_counter() - baseline_started
        metric = primary_metric(evaluator.task, baseline.values)
        needs_scores = any(r in ("importance", "-importance") for r in spec.rankings)
        result = None
        scores = None
        if validated.stored_scores is not None:
            scores = np.zeros((checked.num_layers, checked.num_heads))
            for (layer, head), value in validated.stored_scores.items():
                scores[layer, head] = value
        elif needs_scores:
            result = _score(evaluator, checked, spec)
            scores = result.single_stack()
        config = ImportanceConfig(checked.loss, seed=spec.seed)
        curves = []
        for i, ranking in enumerate(spec.rankings):

            def report(done: int, _total: int, offset: int = i * spec.steps) -> None:
                progress(offset + done, total)

            curves.append(
                pruning_curve(
                    evaluator,
                    ranking,
                    steps=spec.steps,
                    max_share=spec.max_share,
                    iterative=spec.iterative,
                    scores=scores,
                    types=validated.types,
                    seed=spec.seed,
                    importance=config,
                    progress=report,
                )  # fmt: skip
            )
    except TaskDataError as error:
        raise InvalidInput(f"data: {error}", field="data") from error
    except ImportanceError as error:
        raise InvalidInput(f"rankings: {error}", field="rankings") from error
    seconds = time.perf_counter() - started
    finished_at = datetime.now(UTC)

    def write(session: Session) -> dict[str, Any]:
        baseline_values = dict(baseline.values)
        baseline_id, _ = ablations.baseline_id(
            session,
            {
                "model_id": checked.model_id, "task": checked.task, "data_key": checked.data.key,
                "data_subset": checked.data.subset, "limit": spec.limit, "max_length": checked.evaluator_max_length,
                "dtype": spec.dtype, "n_examples": baseline.n_examples, "metrics": baseline_values,
                "seconds": baseline_seconds, "device": str(loaded.device),
            },
        )  # fmt: skip
        importance_run_id = spec.importance_run
        if result is not None:
            run = _importance_row(checked, spec, result, str(loaded.device), started_at, result.seconds)
            session.add(run)
            session.flush()
            current.completed(session, run)
            _store_scores(session, run, checked, result)
            importance_run_id = run.id
        row = PruningCurve(
            model_id=checked.model_id, baseline_id=baseline_id, importance_run_id=importance_run_id,
            clustering_id=validated.clustering_id, status="complete", task=checked.task, metric=metric,
            rankings=list(spec.rankings), iterative=spec.iterative, steps=spec.steps, max_share=spec.max_share,
            seed=spec.seed, type_order=list(TYPE_ORDER),
            orders={curve.ranking: [list(h) for h in curve.order] for curve in curves}, baseline=baseline_values,
            data_kind=checked.data.kind, data_source=checked.data.source, data_sha256=checked.data.sha256,
            data_subset=checked.data.subset, data_size=checked.data.size, limit=spec.limit,
            n_examples=evaluator.n_examples,
            config={**spec.model_dump(mode="json"), "loss": checked.loss,
                    "max_length": checked.evaluator_max_length},
            device=str(loaded.device), dtype=spec.dtype, seconds=seconds, started_at=started_at,
            finished_at=finished_at,
        )  # fmt: skip
        session.add(row)
        session.flush()
        for curve in curves:
            for point in curve.points:
                session.add(
                    PruningPoint(
                        curve_id=row.id,
                        ranking=curve.ranking,
                        step=point.step,
                        pruned=point.pruned,
                        share=point.share,
                        metrics=dict(point.metrics),
                        heads=[list(h) for h in point.heads],
                        seconds=point.seconds,
                    )  # fmt: skip
                )
        session.flush()
        log.info("Stored pruning curves %d of %r: %s, %d steps, %.1f s", row.id, checked.model_name,
                 ", ".join(spec.rankings), spec.steps, seconds)  # fmt: skip
        return {"pruning_curve_id": row.id, "model": checked.model_name, "metric": metric, "baseline_id": baseline_id,
                "importance_run_id": importance_run_id}  # fmt: skip

    return write


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def importance_read(session: Session, run: ImportanceRun) -> ImportanceRunRead:
    return ImportanceRunRead(
        id=run.id, model=repository.model_name(session, run.model_id), status=run.status, loss=run.loss,
        task=run.task,
        data=DataRead(kind=run.data_kind, source=run.data_source, sha256=run.data_sha256, subset=run.data_subset,
                      size=run.data_size),
        limit=run.limit, n_examples=run.n_examples, seed=run.seed, mean_loss=run.mean_loss, config=run.config,
        device=run.device, dtype=run.dtype, seconds=run.seconds, started_at=run.started_at,
        finished_at=run.finished_at,
        scores=[HeadScoreRead(stack=stack, layer=layer, head=head, raw=raw, normalized=norm)
                for stack, layer, head, raw, norm in repository.scores(session, run.id)],
    )  # fmt: skip


def get_importance(session: Session, run_id: int) -> ImportanceRunRead:
    run = repository.get_importance_run(session, run_id)
    if run is None:
        raise NotFound(f"run_id: no importance run with id {run_id}", field="run_id")
    return importance_read(session, run)


def list_importance(
    session: Session, name: str, *, loss: str | None = None, limit: int = 20, offset: int = 0
) -> list[ImportanceRunRead]:
    model = models.require(session, name, field="name")
    runs = repository.importance_runs(session, model.id, loss=loss, limit=limit, offset=offset)
    return [importance_read(session, run) for run in runs]


def curve_read(session: Session, curve: PruningCurve) -> PruningCurveRead:
    base = curve.baseline.get(curve.metric)
    lines: dict[str, list[PointRead]] = {ranking: [] for ranking in curve.rankings}
    for point in curve.points:
        value = point.metrics.get(curve.metric)
        delta = float(value) - float(base) if isinstance(value, int | float) and isinstance(base, int | float) else 0.0
        lines.setdefault(point.ranking, []).append(
            PointRead(
                step=point.step,
                pruned=point.pruned,
                share=point.share,
                metrics=point.metrics,
                delta=delta,
                heads=point.heads,
                seconds=point.seconds,
            )  # fmt: skip
        )
    return PruningCurveRead(
        id=curve.id, model=repository.model_name(session, curve.model_id), status=curve.status, task=curve.task,
        metric=curve.metric, baseline=curve.baseline, baseline_id=curve.baseline_id, rankings=curve.rankings,
        iterative=curve.iterative, steps=curve.steps, max_share=curve.max_share, seed=curve.seed,
        type_order=curve.type_order, importance_run_id=curve.importance_run_id, clustering_id=curve.clustering_id,
        data=DataRead(kind=curve.data_kind, source=curve.data_source, sha256=curve.data_sha256,
                      subset=curve.data_subset, size=curve.data_size),
        limit=curve.limit, n_examples=curve.n_examples, config=curve.config, device=curve.device, dtype=curve.dtype,
        seconds=curve.seconds, started_at=curve.started_at, finished_at=curve.finished_at,
        curves=[RankingCurveRead(ranking=ranking, order=curve.orders.get(ranking, []),
                                 points=sorted(points, key=lambda p: p.step))
                for ranking, points in lines.items()],
    )  # fmt: skip


def get_curve(session: Session, curve_id: int) -> PruningCurveRead:
    curve = repository.get_curve(session, curve_id)
    if curve is None:
        raise NotFound(f"curve_id: no pruning curve with id {curve_id}", field="curve_id")
    return curve_read(session, curve)


def list_curves(session: Session, name: str, *, limit: int = 20, offset: int = 0) -> list[PruningCurveRead]:
    model = models.require(session, name, field="name")
    return [curve_read(session, curve) for curve in repository.curves(session, model.id, limit=limit, offset=offset)]


REPORT_SHARES = (0.1, 0.3, 0.5)


def report_columns(curve: PruningCurveRead, shares: tuple[float, ...] = REPORT_SHARES) -> list[tuple[int, float]]:
    """The measured points ``headcat report`` shows, as (heads pruned, share): per wanted share, the measured
    point nearest it (the smaller on a tie), each once, in order; the baseline (0 pruned) is the table's own line.

    The curve is measured at the same head counts in every ranking, so a column is one count, named by it.
    """
    measured = sorted({(p.pruned, p.share) for line in curve.curves for p in line.points if p.pruned > 0})
    chosen = {min(measured, key=lambda m: (abs(m[1] - share), m[0])) for share in shares} if measured else set()
    return sorted(chosen)


def kept_at(curve: PruningCurveRead, columns: list[tuple[int, float]]) -> dict[str, dict[int, float | None]]:
    """Per ranking, the metric measured with each column's number of heads pruned (None: measured, not a number);
    a column the ranking has no point at is left out. Never a neighbouring point's value."""
    out: dict[str, dict[int, float | None]] = {}
    for line in curve.curves:
        at = {p.pruned: p.metrics.get(curve.metric) for p in line.points}
        out[line.ranking] = {
            pruned: float(v) if isinstance(v := at[pruned], int | float) else None
            for pruned, _ in columns
            if pruned in at
        }
    return out


def _share_text(share: float) -> str:
    """A share as a percentage with the digits it needs (12.5 %, 50 %, 9.7 %)."""
    text = f"{100 * share:.1f}".removesuffix(".0")
    return f"{text} %"


MISSING = object()


def curves_table(curve: PruningCurveRead) -> str:
    """``headcat report``'s curves table: per ranking, the metric at the measured points nearest 10/30/50 % of
    heads pruned, each column named by the heads pruned and their share there; "not measured" where a ranking
    has no point at that count, "-" where the metric is not a number."""
    columns = report_columns(curve)
    kept = kept_at(curve, columns)
    base = curve.baseline.get(curve.metric)
    lines = [
        f"## Pruning curves {curve.id}: {curve.metric} as heads are pruned ({curve.task}, {curve.n_examples} examples"
        f"{', iterative' if curve.iterative else ''})",
        "",
        f"Baseline (nothing pruned): {base:.2f}" if isinstance(base, int | float) else "Baseline: -",
        "",
    ]
    if not columns:
        lines.append("No point past the baseline was measured.")
    else:
        lines += [
            "| ranking | " + " | ".join(f"{n} pruned ({_share_text(s)})" for n, s in columns) + " |",
            "|---|" + "---:|" * len(columns),
        ]
    for ranking, row in kept.items() if columns else ():
        values = [row.get(pruned, MISSING) for pruned, _ in columns]
        cells = [
            "not measured" if v is MISSING else "-" if not isinstance(v, float)
            else f"{v:.2f} ({v - base:+.2f})" if isinstance(base, int | float) else f"{v:.2f}"
            for v in values
        ]  # fmt: skip
        lines.append(f"| {ranking} | " + " | ".join(cells) + " |")
    if "type" in curve.rankings:
        lines += ["", f"Type ranking order: {' > '.join(curve.type_order)} (then other types; by layer, head)."]
    return "\n".join(lines) + "\n"
