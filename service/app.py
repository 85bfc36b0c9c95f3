"""The FastAPI application."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from service.ablations.endpoints import router as ablations_router
from service.auth.deps import ReadAccess
from service.clusterings.endpoints import router as clusterings_router
from service.compare.endpoints import router as compare_router
from service.db import get_engine, session_factory
from service.errors import HeadcatError
from service.exports.endpoints import router as exports_router
from service.heads.endpoints import router as heads_router
from service.ingests.endpoints import router as ingests_router
from service.jobs.endpoints import router as jobs_router
from service.limits import BodyLimit
from service.models.endpoints import router as models_router
from service.settings import Settings, get_settings
from service.web.endpoints import page_router
from service.web.endpoints import router as web_router

log = logging.getLogger(__name__)


UNAVAILABLE = "the catalog database is unavailable; retry shortly"


def create_app(engine: Engine | None = None, settings: Settings | None = None) -> FastAPI:
    """The API over ``engine`` (default: the configured or embedded database).

    ``settings`` (default: from the environment) decide who may read, which files and models a
    job request may name, and the largest request body.
    """
    settings = settings or get_settings()
    app = FastAPI(
        title="headcat",
        summary="A catalog of the attention heads of transformer models.",
        version="0.1.0",
    )
    app.state.settings = settings
    app.state.engine = engine or get_engine()
    app.state.session_factory = session_factory(app.state.engine)

    @app.exception_handler(HeadcatError)
    async def domain_error(_: Request, error: HeadcatError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if error.status_code == 401 else None
        return JSONResponse(
            {"detail": error.message, "field": error.field}, status_code=error.status_code, headers=headers
        )

    @app.exception_handler(DBAPIError)
    async def database_error(_: Request, error: DBAPIError) -> JSONResponse:
        # A server that is down, restarting or unreachable: refused connections (OperationalError),
        # connections that died under a request (invalidated, or InterfaceError). The pool's
        # pre-ping replaces dead connections, so the API recovers by itself when the server is back.
        if isinstance(error, OperationalError | InterfaceError) or error.connection_invalidated:
            log.warning("database unavailable: %s", error.orig)
            return JSONResponse({"detail": UNAVAILABLE}, status_code=503, headers={"Retry-After": "5"})
        raise error

    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)

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
        app.include_router(router, dependencies=[ReadAccess])
    app.include_router(page_router)  # the page itself stays open; its data calls send a key when asked for one
    return app
