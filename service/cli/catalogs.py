"""``headcat catalog export`` and ``headcat catalog import``: the catalog as a Parquet archive others can read."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Annotated, Any

import typer

from service.cli.app import app, catalog, console, log, refusals, run_job
from service.errors import SHOWN, listed

catalog_app = typer.Typer(help="Export the catalog as Parquet files, import another catalog's.", no_args_is_help=True)
app.add_typer(catalog_app, name="catalog")


@catalog_app.command("export")
def catalog_export(
    output: Annotated[Path, typer.Option("--output", "-o", help="the archive directory to write")],
    model: Annotated[list[str] | None, typer.Option("--model", "-m", help="export this model (repeat)")] = None,
) -> None:
    """Write the catalog (or the models named) as Parquet files, one per table, and manifest.json.

    The files name models, heads (stack, layer, head) and runs (a key made of the run's columns),
    never internal ids: DuckDB, pandas or any Parquet reader can query them without headcat.
    """
    from service.catalogs.export import export_catalog

    if output.exists() and any(output.iterdir()):
        console.print(f"[bold red]error:[/] output: {output} is not empty")
        raise typer.Exit(2)
    with catalog() as engine, engine.connect() as connection, connection.begin():
        manifest = export_catalog(connection, output, model)
    rows = sum(f["rows"] for f in manifest["files"].values())
    size = sum(f["bytes"] for f in manifest["files"].values())
    log.info("Wrote %s: %d models, %d rows in %d files, %.1f MB", output, len(manifest["models"]), rows,
             len(manifest["files"]), size / 1e6)  # fmt: skip


@catalog_app.command("import")
def catalog_import(
    archive: Annotated[
        str, typer.Argument(help="an archive directory, a tar of one (GET /catalog/export), or hub:OWNER/NAME[@REV]")
    ],
    rename: Annotated[
        list[str] | None, typer.Option(help="OLD=NEW: import the archive's model OLD as NEW (repeat)")
    ] = None,
    model: Annotated[
        list[str] | None, typer.Option("--model", "-m", help="import only this model of the archive (repeat)")
    ] = None,
    enqueue: Annotated[bool, typer.Option(help="queue the import for a worker (cpu queue) instead")] = False,
) -> None:
    """Check the whole archive, then write it in one transaction; a damaged archive writes nothing.

    Importing the same archive again changes nothing. A model already in this catalog from another
    source or commit is refused unless renamed with --rename. With --model, only those models are
    imported, with the clusterings all of whose models come along; the log says what was left out.
    """
    from service.catalogs.importer import parse_renames
    from service.catalogs.service import check_archive

    renames = parse_renames(rename)
    spec = archive if archive.startswith("hub:") else str(Path(archive).expanduser().resolve())
    models = list(dict.fromkeys(model or []))
    with refusals():
        check_archive(spec, models)  # before the catalog is opened or a job row written
    with catalog() as engine:
        request: dict[str, object] = {"archive": spec, "renames": renames, "models": models}
        result = run_job(engine, "catalog_import", request, enqueue=enqueue, progress="rows")
    if result.get("already"):
        log.info("Archive %s was imported already (import %d); nothing changed.", result["archive_sha256"][:12],
                 result["import_id"])  # fmt: skip
    elif result:
        log.info("Imported %s: models %s (%d in all; import %d).", archive, listed(result["models"]),
                 len(result["models"]), result["import_id"])  # fmt: skip
        if result.get("left_out"):
            left = result["left_out"]
            log.info("Left out: models %s; clusterings %s.", listed(left["models"]),
                     listed(left["clusterings"]) or "none")  # fmt: skip
        _say_current(result.get("current_runs") or {})


def _say_current(decided: dict[str, list[dict[str, Any]]]) -> None:
    """Whether each imported run is now the one its lens serves (``service/current.py``): a line per run when they
    are at most :data:`~service.errors.SHOWN`, else a line per lens and outcome with its count and reasons."""
    became, kept = decided.get("became_current", []), decided.get("not_current", [])
    if len(became) + len(kept) <= SHOWN:
        for entry in became:
            why = (
                "its source catalog served it"
                if entry.get("by") == "source"
                else f"it is newer than {'none' if entry['replaced'] is None else 'run ' + str(entry['replaced'])}"
            )
            log.info("%s: %s run %d is now current (%s).", _owner(entry), entry["lens"], entry["run_id"], why)
        for entry in kept:
            why = "its source catalog served that one" if entry.get("by") == "source" else "it is newer"
            log.info("%s: %s run %d is not current: run %d is (%s).", _owner(entry), entry["lens"],
                     entry["run_id"], entry["current_run_id"], why)  # fmt: skip
        return
    reasons = {
        True: {"source": "their source catalog served them", "newest": "newer than the run served before"},
        False: {"source": "their source catalog served another", "newest": "another run is newer"},
    }
    groups: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for current, entries in ((True, became), (False, kept)):
        for entry in entries:
            groups.setdefault((entry["lens"], current), []).append(entry)
    for (lens, current), entries in sorted(groups.items(), key=lambda item: (item[0][0], not item[0][1])):
        counts = Counter(entry.get("by", "newest") for entry in entries)
        why = ", ".join(f"{counts[by]} {reasons[current][by]}" for by in ("source", "newest") if counts[by])
        runs = listed(f"{_owner(entry)} run {entry['run_id']}" for entry in entries)
        verb = ("is" if len(entries) == 1 else "are") + (" now current" if current else " not current")
        log.info("%s: %d imported %s %s (%s): %s.", lens, len(entries), "run" if len(entries) == 1 else "runs", verb,
                 why, runs)  # fmt: skip


def _owner(entry: dict[str, Any]) -> str:
    return entry["model"] if "model" in entry else f"clustering {entry['clustering_id']}"
