"""The FastAPI application."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

from service.ablations.endpoints import router as ablations_router
from service.clusterings.endpoints import router as clusterings_router
from service.compare.endpoints import router as compare_router
from service.db import get_engine, session_factory
from service.errors import HeadcatError
from service.exports.endpoints import router as exports_router
from service.heads.endpoints import router as heads_router
from service.ingests.endpoints import router as ingests_router
from service.jobs.endpoints import router as jobs_router
from service.models.endpoints import router as models_router
from service.web.endpoints import router as web_router

log = logging.getLogger(__name__)


def create_app(engine: Engine | None = None) -> FastAPI:
    """The API over ``engine`` (default: the configured or embedded database)."""
    app = FastAPI(
        title="headcat",
        summary="A catalog of the attention heads of transformer models.",
        version="0.1.0",
    )
    app.state.engine = engine or get_engine()
    app.state.session_factory = session_factory(app.state.engine)

    @app.exception_handler(HeadcatError)
    async def domain_error(_: Request, error: HeadcatError) -> JSONResponse:
        return JSONResponse({"detail": error.message, "field": error.field}, status_code=error.status_code)

    @app.exception_handler(OperationalError)
    async def database_unavailable(_: Request, error: OperationalError) -> JSONResponse:
        log.warning("database unavailable: %s", error.orig)
        return JSONResponse({"detail": "the catalog database is unavailable; retry shortly"}, status_code=503)

    @app.get("/health", tags=["health"])
    def health() -> dict[str, str]:
        with app.state.engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        return {"status": "ok", "database": "ok"}

    for router in (
        models_router,
        heads_router,
        ingests_router,
        clusterings_router,
        ablations_router,
        jobs_router,
        exports_router,
        compare_router,
        web_router,
    ):
        app.include_router(router)
    return app
