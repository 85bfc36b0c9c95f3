"""The FastAPI application."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from sqlalchemy import Engine, text
from sqlalchemy.exc import DataError, DBAPIError, InterfaceError, OperationalError

from service.ablations.endpoints import router as ablations_router
from service.auth.deps import ReadAccess
from service.clusterings.endpoints import router as clusterings_router
from service.compare.endpoints import router as compare_router
from service.db import get_engine, session_factory
from service.errors import HeadcatError
from service.exports.endpoints import router as exports_router
from service.heads.endpoints import router as heads_router
from service.importance.endpoints import router as importance_router
from service.ingests.endpoints import router as ingests_router
from service.jobs.endpoints import router as jobs_router
from service.limits import BodyLimit, reject_nul
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
        dependencies=[Depends(reject_nul)],
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
        if isinstance(error, DataError):  # a value PostgreSQL cannot hold (NUL in a JSON string, out of range)
            message = str(error.orig).splitlines()[0] if error.orig is not None else "invalid value"
            return JSONResponse({"detail": f"body: a value the database cannot take: {message}", "field": "body"},
                                status_code=422)  # fmt: skip
        raise error

    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.openapi = lambda: _document_domain_errors(app)  # type: ignore[method-assign]

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
        importance_router,
        jobs_router,
        exports_router,
        compare_router,
        web_router,
    ):
        app.include_router(router, dependencies=[ReadAccess])
    app.include_router(page_router)  # the page itself stays open; its data calls send a key when asked for one
    return app


def _document_domain_errors(app: FastAPI) -> dict[str, Any]:
    """The 422 answers are FastAPI's validation errors (``detail`` a list) or headcat's domain
    errors (``detail`` a message, ``field`` the parameter): say so in the schema."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        validation = schema.get("components", {}).get("schemas", {}).get("HTTPValidationError")
        if validation is not None:
            listed = validation["properties"]["detail"]
            validation["properties"]["detail"] = {
                "anyOf": [{k: v for k, v in listed.items() if k != "title"}, {"type": "string"}],
                "title": "Detail",
                "description": "validation errors, or a message that names the field",
            }
            validation["properties"]["field"] = {"anyOf": [{"type": "string"}, {"type": "null"}], "title": "Field"}
        app.openapi_schema = schema
    return app.openapi_schema
