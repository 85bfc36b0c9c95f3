"""``headcat serve``: the REST API (and the web page) over the catalog."""

from __future__ import annotations

import os
from typing import Annotated

import typer
from sqlalchemy import Engine

from service import db
from service.cli.app import app, catalog, log
from service.settings import get_settings


def serve_catalog(engine: Engine, host: str, port: int, workers: int = 1) -> None:
    import uvicorn

    from service.app import create_app

    log.info("Serving the catalog on http://%s:%d (OpenAPI docs at /docs); Ctrl-C stops.", host, port)
    if workers == 1:
        uvicorn.run(create_app(engine), host=host, port=port, log_level="warning")
        return
    db.check_connections(engine, workers)
    # Each worker process builds the app from the environment: point it at this very database.
    os.environ["DATABASE_URL"] = engine.url.render_as_string(hide_password=False)
    log.info("%d worker processes share the port, each with a pool of up to %d connections", workers,
             get_settings().pool_size + get_settings().pool_overflow)  # fmt: skip
    uvicorn.run("service.app:create_app", factory=True, workers=workers, host=host, port=port, log_level="warning")


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="default: HEADCAT_HOST or 127.0.0.1")] = None,
    port: Annotated[int | None, typer.Option(help="default: HEADCAT_PORT or 8000")] = None,
    workers: Annotated[int, typer.Option(min=1, max=64, help="API processes behind the one port")] = 1,
) -> None:
    """Serve the REST API."""
    settings = get_settings()
    with catalog() as engine:
        serve_catalog(engine, host or settings.host, port or settings.port, workers)
