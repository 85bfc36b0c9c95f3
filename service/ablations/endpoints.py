"""``/ablations`` and ``/models/{name}/ablations``: start ablation jobs and read their outcomes."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, status
from fastapi.responses import PlainTextResponse

from service.ablations import service
from service.ablations.report import markdown_report
from service.ablations.schemas import AblationCreate, AblationRunRead, Task
from service.auth.deps import KEY_RESPONSES, RequireKey
from service.deps import SessionDep
from service.jobs.endpoints import accept
from service.jobs.schemas import JobAccepted
from service.sources import data_file

router = APIRouter(tags=["ablations"])

Id = Annotated[int, Path(ge=1, le=2**31 - 1)]
ModelName = Annotated[str, Path(description="the model's unique catalog name", max_length=200)]


@router.post(
    "/ablations",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=JobAccepted,
    dependencies=[RequireKey],
    responses=KEY_RESPONSES,
)
def create_ablation(body: AblationCreate, session: SessionDep, request: Request) -> JobAccepted:
    """Queue an ablation plan on the ``gpu`` queue; ``GET /jobs/{id}`` shows rows done of total.

    Checked before anything is queued: the model and its head (the task must fit it), the
    clustering (it must cover the model), every row's selection (known types, layers and heads
    in range) and the data (a file under the server's data directories, readable, labels fit
    the head; hub sets only when hub access is on). The job's result names the stored
    run (``GET /ablations/{ablation_run_id}``).
    """
    body = body.model_copy(update={"data": data_file(body.data, request.app.state.settings, "data")})
    service.validate(session, body, load_hub=False)
    return accept(session, request, "ablation", body.model_dump(mode="json"))


@router.get("/models/{name}/ablations", response_model=list[AblationRunRead])
def list_model_ablations(
    session: SessionDep,
    name: ModelName,
    type: Annotated[
        str | None, Query(max_length=64, description="only outcomes that ablate heads of this type")
    ] = None,
    task: Task | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
) -> list[AblationRunRead]:
    """The model's ablation runs, newest first: each row's operations per type, metrics, baseline and deltas."""
    return service.list_runs(session, name, type_name=type, task=task, limit=limit, offset=offset)


@router.get("/ablations/{run_id}", response_model=AblationRunRead)
def get_ablation(session: SessionDep, run_id: Id) -> AblationRunRead:
    return service.get_run(session, run_id)


@router.get("/ablations/{run_id}/report", response_class=PlainTextResponse)
def get_ablation_report(session: SessionDep, run_id: Id) -> PlainTextResponse:
    """Guan et al. Tables 2 and 3 for this run, as markdown (what `headcat report` prints)."""
    report = markdown_report(service.get_run(session, run_id))
    return PlainTextResponse(report, media_type="text/markdown; charset=utf-8")
