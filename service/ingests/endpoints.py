"""``/ingests``: start an ingest job."""

from __future__ import annotations

from fastapi import APIRouter, Request, status

from service.deps import SessionDep
from service.ingests.schemas import IngestCreate
from service.ingests.service import check_name, check_sources
from service.jobs.endpoints import accept
from service.jobs.schemas import JobAccepted

router = APIRouter(tags=["ingests"])


@router.post("/ingests", status_code=status.HTTP_202_ACCEPTED, response_model=JobAccepted)
def create_ingest(body: IngestCreate, session: SessionDep, request: Request) -> JobAccepted:
    """Queue an ingest on the ``gpu`` queue; ``GET /jobs/{id}`` shows samples done of total."""
    check_name(session, body)
    check_sources(body)
    return accept(session, request, "ingest", body.model_dump())
