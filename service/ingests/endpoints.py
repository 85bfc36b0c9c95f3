"""``/ingests``: start an ingest job."""

from __future__ import annotations

from fastapi import APIRouter, Request, status

from service.auth.deps import KEY_RESPONSES, RequireKey
from service.deps import SessionDep
from service.ingests.schemas import IngestCreate
from service.ingests.service import check_name, check_sources
from service.jobs.endpoints import accept
from service.jobs.schemas import JobAccepted
from service.sources import data_file, model_source

router = APIRouter(tags=["ingests"])


@router.post(
    "/ingests",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=JobAccepted,
    dependencies=[RequireKey],
    responses=KEY_RESPONSES,
)
def create_ingest(body: IngestCreate, session: SessionDep, request: Request) -> JobAccepted:
    """Queue an ingest on the ``gpu`` queue; ``GET /jobs/{id}`` shows samples done of total.

    A local model must lie under the server's model directories and a corpus file under its data
    directories (both resolved first); hub ids only when hub access is on. Never remote code.
    """
    settings = request.app.state.settings
    body = body.model_copy(
        update={
            "model": model_source(body.model, settings, "model"),
            "corpus": data_file(body.corpus, settings, "corpus"),
        }
    )
    check_name(session, body)
    check_sources(body)
    return accept(session, request, "ingest", body.model_dump())
