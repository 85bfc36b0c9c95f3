"""``/attributions`` and ``/models/{name}/attributions``: start attribution jobs and read their results."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, status

from service.attributions import repository, service
from service.attributions.schemas import AttributionCreate, AttributionMaps, AttributionRunRead
from service.auth.deps import KEY_RESPONSES, RequireKey
from service.deps import SessionDep
from service.jobs.endpoints import accept
from service.jobs.schemas import JobAccepted
from service.models import repository as models
from service.sources import data_file

router = APIRouter(tags=["attributions"])

Id = Annotated[int, Path(ge=1, le=2**31 - 1)]
ModelName = Annotated[str, Path(description="the model's unique catalog name", max_length=200)]
Index = Annotated[int, Query(ge=0, le=100_000)]


@router.post(
    "/attributions",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=JobAccepted,
    dependencies=[RequireKey],
    responses=KEY_RESPONSES,
)
def create_attribution(body: AttributionCreate, session: SessionDep, request: Request) -> JobAccepted:
    """Queue an attribution run on the ``gpu`` queue; ``GET /jobs/{id}`` shows passes done of total.

    Checked before anything is queued: the model (in the catalog, one attention stack), the
    corpus (readable, under the server's data directories) and the numbers (``queries >= 1``...).
    The job's result names the stored run, its cost (rows, passes, seconds) and the per-layer discrepancy.
    """
    body = body.model_copy(update={"corpus": data_file(body.corpus, request.app.state.settings, "corpus")})
    service.validate(session, body)
    return accept(session, request, "attribution", body.model_dump(mode="json"))


@router.get("/models/{name}/attributions", response_model=list[AttributionRunRead])
def list_model_attributions(
    session: SessionDep,
    name: ModelName,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
) -> list[AttributionRunRead]:
    """The model's attribution runs, newest first, with the mean discrepancy per layer (no per-head rows)."""
    model = models.require(session, name, field="name")
    return [service.run_read(session, run) for run in repository.runs(session, model.id, limit, offset)]


@router.get("/attributions/{run_id}", response_model=AttributionRunRead)
def get_attribution(session: SessionDep, run_id: Id) -> AttributionRunRead:
    """One run with every head: discrepancy, global and local features, global scalars."""
    return service.run_read(session, service.get_run(session, run_id), with_heads=True)


@router.get("/attributions/{run_id}/maps", response_model=AttributionMaps)
def get_attribution_maps(session: SessionDep, run_id: Id, layer: Index, head: Index) -> AttributionMaps:
    """One head's example rows: attention and attribution side by side (keys downsampled)."""
    return service.maps(session, service.get_run(session, run_id), layer, head)


@router.get("/models/{name}/attribution-maps", response_model=AttributionMaps)
def get_latest_attribution_maps(session: SessionDep, name: ModelName, layer: Index, head: Index) -> AttributionMaps:
    """The same from the model's current attribution run (what the web page draws)."""
    return service.maps(session, service.latest_run(session, name), layer, head)
