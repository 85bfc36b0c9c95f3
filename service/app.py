"""The FastAPI application."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy import Engine
from sqlalchemy.exc import DataError, DBAPIError, InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.ablations.endpoints import router as ablations_router
from service.attributions.endpoints import router as attributions_router
from service.auth.deps import ReadAccess
from service.catalogs.endpoints import router as catalog_router
from service.clusterings.endpoints import router as clusterings_router
from service.compare.endpoints import router as compare_router
from service.db import get_engine, read_session_factory, session_factory
from service.detections.endpoints import router as detections_router
from service.errors import ERROR_SCHEMA, HeadcatError, validation_error
from service.exports.endpoints import router as exports_router
from service.heads.endpoints import router as heads_router
from service.importance.endpoints import router as importance_router
from service.ingests.endpoints import router as ingests_router
from service.jobs.endpoints import router as jobs_router
from service.jobs.repository import live_workers
from service.jobs.schemas import NO_WORKER
from service.limits import BodyLimit, JsonBodies, reject_nul
from service.models.endpoints import router as models_router
from service.series.endpoints import router as series_router
from service.settings import Settings, get_settings
from service.syntax.endpoints import router as syntax_router
from service.web.endpoints import page_router
from service.web.endpoints import router as web_router

log = logging.getLogger(__name__)


UNAVAILABLE = "the catalog database is unavailable; retry shortly"


def body_model(request: Request) -> type[BaseModel] | None:
    """The pydantic model of the matched route's JSON body, if it takes one."""
    dependant = getattr(request.scope.get("route"), "dependant", None)
    for param in getattr(dependant, "body_params", ()):
        annotation = param.field_info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return annotation
    return None


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
    app.state.read_session_factory = read_session_factory(app.state.engine)

    @app.exception_handler(HeadcatError)
    async def domain_error(_: Request, error: HeadcatError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if error.status_code == 401 else None
        return JSONResponse(
            {"detail": error.message, "field": error.field}, status_code=error.status_code, headers=headers
        )

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        # FastAPI's own checks (a query parameter that is not an integer, a body field of the wrong
        # type, an unknown body field) answer in headcat's one shape: a message that names the field, and the field.
        message, field = validation_error(error.errors(), body_model(request))
        return JSONResponse({"detail": message, "field": field}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        # Unknown paths (404), wrong methods (405), a body over the limit (413): the same shape.
        return JSONResponse({"detail": error.detail, "field": getattr(error, "field", None)},
                            status_code=error.status_code, headers=error.headers)  # fmt: skip

    @app.exception_handler(DBAPIError)
    async def database_error(_: Request, error: DBAPIError) -> JSONResponse:
        # A server that is down, restarting or unreachable: refused connections (OperationalError),
        # connections that died under a request (invalidated, or InterfaceError). The pool replaces
        # connections the server closed (service.db.replace_closed_connections), so the API recovers by itself
        # when the server is back.
        if isinstance(error, OperationalError | InterfaceError) or error.connection_invalidated:
            log.warning("database unavailable: %s", error.orig)
            return JSONResponse({"detail": UNAVAILABLE, "field": None}, status_code=503, headers={"Retry-After": "5"})
        if isinstance(error, DataError):  # a value PostgreSQL cannot hold (NUL in a JSON string, out of range)
            message = str(error.orig).splitlines()[0] if error.orig is not None else "invalid value"
            return JSONResponse({"detail": f"body: a value the database cannot take: {message}", "field": "body"},
                                status_code=422)  # fmt: skip
        raise error

    app.add_middleware(JsonBodies)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)  # added last: runs first
    app.openapi = lambda: _document_domain_errors(app)  # type: ignore[method-assign]

    @app.get("/health", tags=["health"])
    def health() -> dict[str, str | int]:
        """The API and its database answer; ``workers``: how many job workers are alive (0: a queued job
        waits until one starts, see ``warning``)."""
        with app.state.read_session_factory() as session:
            workers = live_workers(session)
        answer: dict[str, str | int] = {"status": "ok", "database": "ok", "workers": workers}
        if not workers:
            answer["warning"] = NO_WORKER
        return answer

    for router in (
        models_router,
        heads_router,
        ingests_router,
        clusterings_router,
        ablations_router,
        attributions_router,
        syntax_router,
        detections_router,
        series_router,
        importance_router,
        jobs_router,
        exports_router,
        catalog_router,
        compare_router,
        web_router,
    ):
        app.include_router(router, dependencies=[ReadAccess])
    app.include_router(page_router)  # the page itself stays open; its data calls send a key when asked for one
    return app


def _document_domain_errors(app: FastAPI) -> dict[str, Any]:
    """Every 4xx answer is ``{"detail": message naming the field, "field": the field or null}``,
    FastAPI's own validation errors included: say so in the schema (its ``HTTPValidationError``)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        components = schema.get("components", {}).get("schemas", {})
        if "HTTPValidationError" in components:
            components["HTTPValidationError"] = ERROR_SCHEMA
            components.pop("ValidationError", None)  # FastAPI's list items, no longer answered
        error = {"application/json": {"schema": {"$ref": "#/components/schemas/HTTPValidationError"}}}
        for item in schema.get("paths", {}).values():
            for operation in item.values():
                for status, answer in operation.get("responses", {}).items():
                    if status.startswith("4") and "content" not in answer:
                        answer["content"] = error  # 401, 403, 404, 409, 413 ... have the same body
        app.openapi_schema = schema
    return app.openapi_schema
