"""``/importance``, ``/pruning-curves`` and their ``/models/{name}/...`` lists: start jobs, read results."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, status

from service.auth.deps import KEY_RESPONSES, RequireKey
from service.deps import SessionDep
from service.importance import service
from service.importance.schemas import ImportanceCreate, ImportanceRunRead, Loss, PruningCurveCreate, PruningCurveRead
from service.jobs.endpoints import accept
from service.jobs.schemas import JobAccepted
from service.sources import data_file

router = APIRouter(tags=["importance"])

Id = Annotated[int, Path(ge=1, le=2**31 - 1)]
ModelName = Annotated[str, Path(description="the model's unique catalog name", max_length=200)]


@router.post(
    "/importance",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=JobAccepted,
    dependencies=[RequireKey],
    responses=KEY_RESPONSES,
)
def create_importance(body: ImportanceCreate, session: SessionDep, request: Request) -> JobAccepted:
    """Queue an importance run on the ``gpu`` queue (SPEC 7): one forward and one backward per batch.

    Checked before anything is queued: the model, the loss it can compute (``task`` needs a
    classification or QA head, ``lm`` an LM head), the data (a file under the server's data
    directories, readable, labels fit the head). The job's result names the stored run
    (``GET /importance/{importance_run_id}``).
    """
    body = body.model_copy(update={"data": data_file(body.data, request.app.state.settings, "data")})
    service.validate_importance(session, body, load_hub=False)
    return accept(session, request, "importance", body.model_dump(mode="json"))


@router.post(
    "/pruning-curves",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=JobAccepted,
    dependencies=[RequireKey],
    responses=KEY_RESPONSES,
)
def create_pruning_curves(body: PruningCurveCreate, session: SessionDep, request: Request) -> JobAccepted:
    """Queue pruning curves on the ``gpu`` queue: for each ranking, the task metric as heads are pruned.

    Checked before anything is queued: the model and task, the rankings (at least one; ``type``
    needs a clustering that types every head; ``importance_run`` must score this model), steps
    and share, and the data. The result names the stored curves (``GET /pruning-curves/{id}``).
    """
    body = body.model_copy(update={"data": data_file(body.data, request.app.state.settings, "data")})
    service.validate_curves(session, body, load_hub=False)
    return accept(session, request, "pruning", body.model_dump(mode="json"))


@router.get("/importance/{run_id}", response_model=ImportanceRunRead)
def get_importance(session: SessionDep, run_id: Id) -> ImportanceRunRead:
    """One importance run: its configuration and every head's raw and per-layer normalised score."""
    return service.get_importance(session, run_id)


@router.get("/models/{name}/importance", response_model=list[ImportanceRunRead])
def list_model_importance(
    session: SessionDep,
    name: ModelName,
    loss: Loss | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
) -> list[ImportanceRunRead]:
    """The model's importance runs, newest first."""
    return service.list_importance(session, name, loss=loss, limit=limit, offset=offset)


@router.get("/pruning-curves/{curve_id}", response_model=PruningCurveRead)
def get_pruning_curves(session: SessionDep, curve_id: Id) -> PruningCurveRead:
    """One pruning-curve job: per ranking, the order heads were pruned in and every point with its delta."""
    return service.get_curve(session, curve_id)


@router.get("/models/{name}/pruning-curves", response_model=list[PruningCurveRead])
def list_model_pruning_curves(
    session: SessionDep,
    name: ModelName,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
) -> list[PruningCurveRead]:
    """The model's pruning curves, newest first."""
    return service.list_curves(session, name, limit=limit, offset=offset)
