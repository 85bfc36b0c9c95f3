"""``headcat serve``: the REST API (and the web page) over the catalog, with a job worker beside it."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer
from sqlalchemy import Engine

from service import db
from service.cli.app import app, catalog, log, refusals
from service.errors import InvalidInput
from service.settings import get_settings

# Seconds a job worker has to stop when the API stops; a job it is still running is then requeued
# by the next worker's stall check (service.jobs.queue), as for a worker that was killed.
WORKER_GRACE = 10.0


def check_port(host: str, port: int) -> None:
    """Refuse a port another process listens on, naming that process, before any work is done (uvicorn would only
    find out after the catalog was opened and the worker started)."""
    if not 0 < port < 65536:
        raise InvalidInput(f"--port: {port} is not a TCP port (1-65535)", field="port")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a TIME_WAIT port is free
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise InvalidInput(f"--host: cannot listen on {host}:{port}: {error.strerror}", field="host") from error
            raise InvalidInput(f"--port: {host}:{port} is already in use{port_holder(port)}; stop it or choose "
                               "another --port", field="port") from error  # fmt: skip


def port_holder(port: int) -> str:
    """`` by pid 123 (headcat serve ...)``: the process listening on ``port``, where the system tells."""
    import psutil

    try:
        listening = [c for c in psutil.net_connections(kind="inet") if c.laddr and c.laddr.port == port
                     and c.status == psutil.CONN_LISTEN and c.pid is not None]  # fmt: skip
        if not listening:
            return ""
        holder = psutil.Process(listening[0].pid)
        return f" by pid {holder.pid} ({' '.join(holder.cmdline())[:160] or holder.name()})"
    except psutil.Error:  # another user's process, where this one may not look
        return ""


@contextmanager
def job_worker(engine: Engine, enabled: bool = True) -> Iterator[subprocess.Popen[bytes] | None]:
    """A ``headcat worker`` process on ``engine``'s database while the block runs (none when not ``enabled``).

    A process of its own, not a thread: the API process never imports torch, and a job's compute
    never holds up an answer.
    """
    if not enabled:
        log.info("No job worker here (--no-worker): REST writes stay queued until a `headcat worker` runs.")
        yield None
        return
    env = {**os.environ, "DATABASE_URL": engine.url.render_as_string(hide_password=False)}
    process = subprocess.Popen([sys.executable, "-m", "service.cli", "worker"], env=env)
    log.info("A job worker (pid %d) runs the REST API's jobs; --no-worker leaves them to `headcat worker`.",
             process.pid)  # fmt: skip
    try:
        yield process
    finally:
        if process.poll() is None:
            log.info("Stopping the job worker (pid %d); a job it runs goes back on the queue", process.pid)
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=WORKER_GRACE)
            except subprocess.TimeoutExpired:
                log.warning("The job worker did not stop within %.0f s; killed (its job is requeued).", WORKER_GRACE)
                process.kill()
                process.wait()
        log.info("The job worker (pid %d) has stopped", process.pid)


def serve_catalog(engine: Engine, host: str, port: int, workers: int = 1, worker: bool = True) -> None:
    import uvicorn

    from service.app import create_app

    if workers > 1:
        db.check_connections(engine, workers)
    with job_worker(engine, worker):
        log.info("Serving the catalog on http://%s:%d (OpenAPI docs at /docs); Ctrl-C or SIGTERM stops.", host, port)
        # uvicorn stops serving on SIGINT and SIGTERM, then raises the signal again: headcat's handler
        # (service.cli.app.stop_on_signals) makes it the KeyboardInterrupt uvicorn.run swallows.
        if workers == 1:
            uvicorn.run(create_app(engine), host=host, port=port, log_level="warning")
        else:
            # Each API process builds the app from the environment: point it at this very database.
            os.environ["DATABASE_URL"] = engine.url.render_as_string(hide_password=False)
            log.info("%d API processes share the port, each with a pool of up to %d connections", workers,
                     get_settings().pool_size + get_settings().pool_overflow)  # fmt: skip
            uvicorn.run("service.app:create_app", factory=True, workers=workers, host=host, port=port,
                        log_level="warning")  # fmt: skip
        log.info("The API has stopped")


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="default: HEADCAT_HOST or 127.0.0.1")] = None,
    port: Annotated[int | None, typer.Option(help="default: HEADCAT_PORT or 8000")] = None,
    workers: Annotated[
        int, typer.Option(min=1, max=64, help="API processes behind the one port (job workers: see --worker)")
    ] = 1,
    worker: Annotated[
        bool,
        typer.Option(help="run a job worker beside the API so that REST writes run; --no-worker: `headcat worker`"),
    ] = True,
) -> None:
    """Serve the REST API, with a job worker beside it (unless --no-worker)."""
    settings = get_settings()
    host, port = host or settings.host, port or settings.port
    with refusals():
        check_port(host, port)
    with catalog() as engine:
        serve_catalog(engine, host, port, workers, worker)
