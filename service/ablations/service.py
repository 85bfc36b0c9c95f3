"""Ablations (SPEC section 4, Guan et al. 2020 section 5): validate a plan, run it, store it, report it.

Everything a request names is checked before anything is queued or computed (:func:`validate`):
the model, its head (the task must fit it), the clustering (it must cover the model), every
row's selection (types known, layers and heads in range), and the data (readable; labels fit
the model's head). The job (:func:`prepare`) checks it all again, loads the model with its task
head, runs every row through one :class:`~ingest.evaluation.Evaluator` (tokenization and the
unablated pass shared) and returns the writer that stores the baseline, the run and its
outcomes in the job's final transaction: an interrupted ablation stores nothing.

The unablated metrics are stored once per (model, task, data, subset, limit, max length,
dtype) in ``ablation_baselines`` and shared by every run on that key. The unablated pass itself
is still run once per job (each row's drift is measured against its outputs), except when the
same worker process already holds that model and data: then it is reused from memory.

``torch`` is imported lazily: the plan is resolved with :mod:`ingest.ablation` (so the API checks
it with the very code the job runs), but nothing that only reads outcomes needs it.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeAlias

from sqlalchemy.orm import Session, sessionmaker

from ingest.types import HEAD_TYPES, Stack
from service.ablations import repository
from service.ablations.data import DataSet, ModelHead, choose_task, model_head, read_data
from service.ablations.schemas import (
    OPERATIONS,
    AblationCreate,
    AblationRunRead,
    BaselineRead,
    DataRead,
    OutcomeRead,
    Task,
)
from service.errors import InvalidInput, NotFound, known, load_refused
from service.jobs.runner import Progress, Writer
from service.models import repository as models
from service.orm import AblationOutcome, AblationRun, CatalogModel

if TYPE_CHECKING:
    from ingest.loading import LoadedModel
    from ingest.selection import PlanRow

log = logging.getLogger(__name__)

EVALUATOR_TASKS: dict[Task, str] = {"squad": "squad", "glue": "classification", "drift": "drift"}
UNTYPED = "untyped"


# --------------------------------------------------------------------------------------------
# Head types and the plan
# --------------------------------------------------------------------------------------------


Heads: TypeAlias = dict[tuple[Stack, int, int], str]  # (stack, layer, head) -> type


def _base_types(assignments: Heads) -> Heads:
    """Suffixed clusters (``diagonal_2``) count as their base type, as in the paper's tables."""
    from ingest.clustering import base_type

    return {head: base_type(name) or name for head, name in assignments.items()}


def head_types(
    session: Session, model: CatalogModel, clustering_id: int | None, *, required: bool
) -> tuple[int | None, Heads]:
    """The clustering to use and the model's ``{(stack, layer, head): type}`` in it."""
    chosen = clustering_id if clustering_id is not None else model.current_clustering_id
    if chosen is None:
        if required:
            raise InvalidInput(
                f"clustering: {model.name!r} has not been clustered, so its heads have no type; run "
                f"`headcat cluster {model.name}` first, or select heads by layer or (layer, head) lists",
                field="clustering",
            )
        return None, {}
    clustering = repository.get_clustering(session, chosen)
    if clustering is None:
        raise NotFound(f"clustering: no clustering with id {chosen}", field="clustering")
    if clustering.status != "complete":
        raise InvalidInput(f"clustering: clustering {chosen} is {clustering.status}, not complete", field="clustering")
    found = repository.assignments(session, model.id, chosen)
    if not found:
        raise InvalidInput(
            f"clustering: clustering {chosen} does not cover {model.name!r}; it clusters "
            f"{known(repository.clustered_models(session, chosen))}",
            field="clustering",
        )
    return chosen, _base_types(found)


def _uses_types(rule: Any) -> bool:
    if isinstance(rule, dict):
        if "union" in rule:
            return any(_uses_types(part) for part in rule["union"])
        return "types" in rule or "all_but_types" in rule
    return False


def _uses_roles(rule: Any) -> bool:
    if isinstance(rule, dict):
        if "union" in rule:
            return any(_uses_roles(part) for part in rule["union"])
        return "roles" in rule
    return False


def head_roles(session: Session, model: CatalogModel, *, field: str = "plan") -> dict[tuple[str, int, int], list[str]]:
    """The roles of the model's heads in its latest detection run (SPEC 10), for selections by role."""
    from service.detections.repository import latest_heads

    found = latest_heads(session, model.id)
    if not found:
        raise InvalidInput(f"{field}: a selection by role needs a detection run of {model.name!r}; run "
                           f"`headcat detect {model.name}` first", field=field)  # fmt: skip
    return {head: roles for head, (_, roles) in found.items()}


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "._+-:[]," else "_" for ch in text.replace(" ", ""))[:200]


def plan_rows(
    request: AblationCreate,
    assignments: Heads,
    shapes: dict[Stack, tuple[int, int]],
    roles: dict[tuple[str, int, int], list[str]] | None = None,
) -> list[PlanRow]:
    """The plan's rows, each checked against the model's stacks and types (the baseline first).

    A rule naming no stack covers every stack of the model (``ingest.selection``); the paper
    plan's rules name none, so on an encoder-decoder it ablates each type in every stack.
    """
    from ingest.selection import AblationSpecError, HeadSelection, PlanRow, paper_plan

    if request.plan == "paper":
        rows = paper_plan(sorted(set(assignments.values())))
        if len(rows) < 2:
            raise InvalidInput(
                f"plan: the paper plan needs heads of the types {', '.join(HEAD_TYPES)}; this clustering names "
                f"{known(sorted(set(assignments.values())))}",
                field="plan",
            )
    else:
        rows = [PlanRow("baseline", "Baseline (no ablation)", (), "T2.1")]
        for i, item in enumerate(request.plan):
            try:
                ordered = sorted(item.ops.items(), key=lambda pair: OPERATIONS.index(pair[0]))  # JSONB reorders keys
                ops = tuple((op, HeadSelection.from_dict(rule)) for op, rule in ordered)
            except AblationSpecError as error:
                raise InvalidInput(f"plan: row {i}: {error}", field="plan") from error
            described = [f"{op}.{selection.describe()}" for op, selection in ops]
            titles = {"prune": "Prune", "uniform": "Uniform 1/L for", "drop_intra": "Drop intra-segment attention of",
                      "drop_inter": "Drop inter-segment attention of"}  # fmt: skip
            label = item.label or "; ".join(f"{titles[op]} {selection.describe()}" for op, selection in ops)
            rows.append(PlanRow(item.id or _slug("+".join(described)), label, ops, None))  # type: ignore[arg-type]
    ids = Counter(row.id for row in rows)
    twice = [row_id for row_id, count in ids.items() if count > 1]
    if twice:
        raise InvalidInput(f"plan: row ids must be unique; {known(twice)} appear(s) twice (give rows an id)",
                           field="plan")  # fmt: skip
    for i, row in enumerate(rows):
        try:
            row.to_spec(assignments or None, shapes=shapes, roles=roles)  # type: ignore[arg-type]
        except AblationSpecError as error:
            where = f"row {i - 1} ({row.id})" if request.plan != "paper" else f"row {row.id}"
            raise InvalidInput(f"plan: {where}: {error}", field="plan") from error
    return rows


# --------------------------------------------------------------------------------------------
# Validation (API and job alike)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Validated:
    request: AblationCreate
    model_id: int
    model_name: str
    source: str
    revision: str | None  # the hub commit the catalog's features came from (None: a local directory)
    shapes: dict[Stack, tuple[int, int]]
    clustering_id: int | None
    assignments: Heads
    head: ModelHead
    task: Task
    rows: list[PlanRow]
    data: DataSet
    roles: dict[tuple[str, int, int], list[str]] | None = None

    @property
    def type_sizes(self) -> dict[str, int]:
        return dict(Counter(self.assignments.values()))

    @property
    def max_length(self) -> int:
        return self.request.max_length or (384 if self.task == "squad" else 128)


def validate(session: Session, request: AblationCreate, *, load_hub: bool = True) -> Validated:
    """Check everything a request names, in the order a user would fix it; read the data.

    ``load_hub=False`` (the API) leaves a hub data set unread: the job reads and checks it.
    """
    model = models.require(session, request.model, field="model")
    head = model_head(model.source, model.revision)
    task = choose_task(request.task, head, model.name)
    needs_types = request.plan == "paper" or any(_uses_types(rule) for row in request.plan for rule in row.ops.values())
    clustering_id, assignments = head_types(session, model, request.clustering, required=needs_types)
    shapes = models.shapes(model)
    needs_roles = request.plan != "paper" and any(
        _uses_roles(rule) for row in request.plan for rule in row.ops.values()
    )
    roles = head_roles(session, model) if needs_roles else None
    rows = plan_rows(request, assignments, shapes, roles)
    if "cross" in shapes:
        raise InvalidInput(
            f"model: {model.name!r} is an encoder-decoder (stacks {', '.join(shapes)}); the ablation evaluators "
            "run encoders and decoder-only models and cannot feed its decoder yet, so no ablation is run",
            field="model",
        )
    data = read_data(request, task, head, load_hub=load_hub)
    return Validated(request, model.id, model.name, model.source, model.revision, shapes, clustering_id, assignments,
                     head, task, rows, data, roles)  # fmt: skip


# --------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------

# The last loaded model, so a worker running plans on one model in a row loads it (and, through
# the Evaluator's own cache, tokenizes the data and runs the unablated pass) once.
_MODELS: OrderedDict[tuple[str, str | None, str, str, str], LoadedModel] = OrderedDict()
_MODEL_CACHE_SIZE = 1
_BASELINED: weakref.WeakSet[Any] = weakref.WeakSet()


def _load(source: str, revision: str | None, task: str, device: str, dtype: str) -> LoadedModel:
    from ingest.loading import load_model

    key = (source, revision, task, device, dtype)
    if key in _MODELS:
        _MODELS.move_to_end(key)
        return _MODELS[key]
    while len(_MODELS) >= _MODEL_CACHE_SIZE:  # let go of the old model before loading the new one
        _MODELS.popitem(last=False)
    try:
        loaded = load_model(source, device=device, dtype=dtype, task=task, revision=revision)  # type: ignore[arg-type]
    except ValueError as error:
        raise load_refused(error) from error
    _MODELS[key] = loaded
    return loaded


def clear_model_cache() -> None:
    _MODELS.clear()


def type_ops(spec: dict[str, Any], assignments: Heads) -> dict[str, dict[str, int]]:
    """``{type: {operation: heads}}`` of one resolved spec (heads ``[stack, layer, head]``)."""
    out: dict[str, Counter[str]] = {}
    for op, heads in spec.get("ops", {}).items():
        for stack, layer, head in heads:
            out.setdefault(assignments.get((stack, layer, head), UNTYPED), Counter())[op] += 1
    return {name: dict(counts) for name, counts in sorted(out.items())}


def prepare(sessions: sessionmaker[Session], request: dict[str, Any], progress: Progress) -> Writer:
    """The job handler: check, load, run every row; the writer stores baseline, run and outcomes."""
    from ingest.evaluation import Evaluator, Outcome, run_plan
    from ingest.tasks import TaskDataError

    spec = AblationCreate.model_validate(request)
    with sessions() as session:
        checked = validate(session, spec)
    started_at, started = datetime.now(UTC), time.perf_counter()
    loaded = _load(checked.source, checked.revision, checked.head.kind, spec.device, spec.dtype)
    from ingest.selection import describe_shapes, model_shapes

    now = model_shapes(loaded.model)
    if now != checked.shapes:
        raise InvalidInput(
            f"model: {checked.source} now has {describe_shapes(now)} heads, the catalog "
            f"{describe_shapes(checked.shapes)}; ingest it again under a new name",
            field="model",
        )
    log.info("Ablating %s (%s) on %d of %d examples of %s: %d rows", checked.model_name, checked.task,
             len(checked.data.examples), checked.data.size, checked.data.source, len(checked.rows))  # fmt: skip
    try:
        evaluator = Evaluator.for_task(
            EVALUATOR_TASKS[checked.task],  # type: ignore[arg-type]
            loaded.model,
            loaded.tokenizer,
            checked.data.examples,
            batch_size=spec.batch_size,
            device=loaded.device,
            max_length=checked.max_length,
        )
        reused = evaluator in _BASELINED
        baseline_started = time.perf_counter()
        baseline = evaluator.baseline()
        baseline_seconds = time.perf_counter() - baseline_started
        _BASELINED.add(evaluator)
        if reused:
            log.info("Unablated pass reused from memory (same model and data in this process)")

        def report(done: int, total: int, outcome: Outcome) -> None:
            progress(done, total)

        progress(0, len(checked.rows))
        outcomes = run_plan(
            evaluator, checked.rows, assignments=checked.assignments or None, renormalize=spec.renormalize,
            progress=report, roles=checked.roles,  # type: ignore[arg-type]
        )  # fmt: skip
    except TaskDataError as error:
        raise InvalidInput(f"data: {error}", field="data") from error
    seconds = time.perf_counter() - started
    finished_at = datetime.now(UTC)
    rows = {row.id: row for row in checked.rows}

    def write(session: Session) -> dict[str, Any]:
        baseline_values = dict(baseline.values)
        baseline_id, created = repository.baseline_id(
            session,
            {
                "model_id": checked.model_id, "task": checked.task, "data_key": checked.data.key,
                "data_subset": checked.data.subset, "limit": spec.limit, "max_length": checked.max_length,
                "dtype": spec.dtype, "n_examples": baseline.n_examples, "metrics": baseline_values,
                "seconds": baseline_seconds, "device": str(loaded.device),
            },
        )  # fmt: skip
        if not created:
            stored = repository.get_baseline(session, baseline_id).metrics
            differ = {k: v for k, v in baseline_values.items() if abs(stored.get(k, math.inf) - v) > 1e-4}
            if differ:
                log.warning("The unablated metrics differ from the stored baseline %d (other device?): %s",
                            baseline_id, {k: (stored.get(k), v) for k, v in differ.items()})  # fmt: skip
        run = AblationRun(
            model_id=checked.model_id,
            clustering_id=checked.clustering_id,
            baseline_id=baseline_id,
            status="complete",
            task=checked.task,
            data_kind=checked.data.kind,
            data_source=checked.data.source,
            data_sha256=checked.data.sha256,
            data_subset=checked.data.subset,
            data_size=checked.data.size,
            limit=spec.limit,
            n_examples=evaluator.n_examples,
            plan="paper" if spec.plan == "paper" else "custom",
            types=checked.type_sizes,
            config={
                **spec.model_dump(mode="json"),
                "max_length": checked.max_length,
                "baseline_reused_in_memory": reused,
            },  # fmt: skip
            device=str(loaded.device),
            dtype=spec.dtype,
            seconds=seconds,
            started_at=started_at,
            finished_at=finished_at,
        )
        session.add(run)
        session.flush()
        for position, outcome in enumerate(outcomes):
            row = rows[outcome.row_id]
            ops = type_ops(outcome.spec, checked.assignments)
            session.add(
                AblationOutcome(
                    run_id=run.id,
                    position=position,
                    row_id=outcome.row_id,
                    label=outcome.label,
                    paper_ref=outcome.paper_ref,
                    operations=sorted(outcome.spec.get("ops", {})),
                    selection=row.to_dict()["ops"],
                    spec=outcome.spec,
                    types=[name for name in ops if name != UNTYPED],
                    type_ops=ops,
                    heads=sum(len(heads) for heads in outcome.spec.get("ops", {}).values()),
                    metrics=dict(outcome.metrics.values),
                    baseline=baseline_values,
                    n_examples=outcome.n_examples,
                    seconds=outcome.seconds,
                )
            )
        session.flush()
        log.info("Stored ablation run %d of %r: %d rows in %.1f s", run.id, checked.model_name, len(outcomes),
                 seconds)  # fmt: skip
        return {"ablation_run_id": run.id, "model": checked.model_name, "rows": len(outcomes),
                "baseline_id": baseline_id, "baseline": baseline_values}  # fmt: skip

    return write


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _deltas(metrics: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float]:
    return {
        name: float(value) - float(baseline[name])
        for name, value in metrics.items()
        if isinstance(value, int | float) and isinstance(baseline.get(name), int | float)
    }


def run_read(session: Session, run: AblationRun, outcome_ids: set[int] | None = None) -> AblationRunRead:
    return AblationRunRead(
        id=run.id,
        model=repository.model_name(session, run.model_id),
        clustering_id=run.clustering_id,
        status=run.status,
        task=run.task,
        data=DataRead(
            kind=run.data_kind,
            source=run.data_source,
            sha256=run.data_sha256,
            subset=run.data_subset,
            size=run.data_size,
        ),  # fmt: skip
        limit=run.limit,
        n_examples=run.n_examples,
        plan=run.plan,
        types=run.types,
        config=run.config,
        device=run.device,
        dtype=run.dtype,
        seconds=run.seconds,
        started_at=run.started_at,
        finished_at=run.finished_at,
        baseline=BaselineRead.model_validate(run.baseline),
        outcomes=[
            OutcomeRead(
                row_id=o.row_id,
                label=o.label,
                paper_ref=o.paper_ref,
                operations=o.operations,
                selection=o.selection,
                types=o.types,
                type_ops=o.type_ops,
                heads=o.heads,
                metrics=o.metrics,
                baseline=o.baseline,
                deltas=_deltas(o.metrics, o.baseline),
                n_examples=o.n_examples,
                seconds=o.seconds,
            )  # fmt: skip
            for o in run.outcomes
            if outcome_ids is None or o.id in outcome_ids
        ],
    )


def list_runs(
    session: Session,
    name: str,
    *,
    type_name: str | None = None,
    task: str | None = None,
    limit: int = 20,
    offset: int = 0,
    field: str = "name",
) -> list[AblationRunRead]:
    """A model's stored runs, newest first; with ``type_name`` only the outcomes that ablate that type."""
    model = models.require(session, name, field=field)
    runs = repository.runs(session, model.id, task=task, limit=limit, offset=offset)
    if type_name is None:
        return [run_read(session, run) for run in runs]
    names = repository.known_types(session, model.id)
    if runs and type_name not in names:
        raise InvalidInput(f"type: unknown head type {type_name!r}; the runs of {name!r} know {known(names)}",
                           field="type")  # fmt: skip
    ids = repository.outcome_ids_with_type(session, [run.id for run in runs], type_name)
    reads = [run_read(session, run, ids) for run in runs]
    return [read for read in reads if read.outcomes]


def get_run(session: Session, run_id: int) -> AblationRunRead:
    run = repository.get_run(session, run_id)
    if run is None:
        raise NotFound(f"run_id: no ablation run with id {run_id}", field="run_id")
    return run_read(session, run)


def latest_run(session: Session, name: str, *, run_id: int | None = None, task: str | None = None) -> AblationRunRead:
    """One run of the model for a report: ``run_id``, else its newest (of ``task``)."""
    if run_id is not None:
        read = get_run(session, run_id)
        if read.model != name:
            raise InvalidInput(f"run: ablation run {run_id} is of {read.model!r}, not {name!r}", field="run")
        return read
    runs = list_runs(session, name, task=task, limit=1)
    if not runs:
        raise NotFound(f"name: {name!r} has no stored ablation run{f' for {task}' if task else ''}; "
                       f"run `headcat ablate {name} ...` first", field="name")  # fmt: skip
    return runs[0]
