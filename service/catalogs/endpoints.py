"""``/catalog``: the catalog as a Parquet archive (a tar stream), and imports of other catalogs' archives."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, status
from fastapi.responses import StreamingResponse

from service.auth.deps import KEY_RESPONSES, RequireKey
from service.catalogs.schemas import CatalogImportCreate
from service.catalogs.service import check_archive, export_tar
from service.deps import SessionDep
from service.errors import InvalidInput
from service.jobs.endpoints import accept
from service.jobs.schemas import JobAccepted
from service.sources import data_file

router = APIRouter(prefix="/catalog", tags=["catalog"])


@router.get(
    "/export",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-tar": {}}, "description": "the archive directory as a tar"}},
)
def export_archive(
    request: Request,
    model: Annotated[
        list[str] | None, Query(max_length=1000, description="export these models (repeat); default: every model")
    ] = None,
) -> StreamingResponse:
    """The catalog (or the models named) as the archive `headcat catalog export` writes: Parquet
    files and manifest.json under ``catalog/``, streamed as a tar. Unknown models answer 404."""
    chunks = export_tar(request.app.state.engine, model)
    return StreamingResponse(
        chunks, media_type="application/x-tar", headers={"Content-Disposition": 'attachment; filename="catalog.tar"'}
    )


@router.post(
    "/imports",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=JobAccepted,
    dependencies=[RequireKey],
    responses=KEY_RESPONSES,
)
def create_import(body: CatalogImportCreate, session: SessionDep, request: Request) -> JobAccepted:
    """Queue an import on the ``cpu`` queue. The job checks the whole archive (manifest, checksums,
    schemas, values, references) before it writes anything, then writes it in one transaction;
    a damaged archive fails the job with a message naming the file and the row."""
    settings = request.app.state.settings
    archive = data_file(body.archive, settings, "archive", corpus=False)
    check_archive(archive, body.models)
    for old, new in body.renames.items():
        if not old or not new or len(new) > 200:
            raise InvalidInput(f"renames: {old!r} -> {new!r} is not a rename to a 1 to 200 character name",
                               field="renames")  # fmt: skip
    return accept(session, request, "catalog_import", body.model_copy(update={"archive": archive}).model_dump())
