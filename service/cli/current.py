"""``headcat current``: which run each lens of a model serves, and choosing another."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from service import db
from service.cli.app import app, catalog, log


@app.command("current")
def current_command(
    name: Annotated[str, typer.Argument(help="catalog name of the model")],
    lens: Annotated[
        str | None,
        typer.Argument(help="features | clustering | stability | importance | attribution | syntax | detections"),
    ] = None,
    run_id: Annotated[int | None, typer.Argument(help="the run (clustering, ...) to serve from now on")] = None,
) -> None:
    """Show the run each lens of a model serves, or make RUN_ID the one LENS serves.

    A run becomes current when it completes; this chooses an earlier one (for instance `headcat current
    minilm clustering 1` makes clustering 1 its current clustering again, without fitting a new one). The
    run must be complete and the model's own (a clustering or stability run must cover the model).
    """
    from service import current
    from service.models import repository

    if lens is not None:
        if lens not in current.LENSES:
            raise typer.BadParameter(f"no lens {lens!r}; lenses: {', '.join(current.LENSES)}", param_hint="LENS")
        if run_id is None:
            raise typer.BadParameter(f"give the run id to serve for {lens}", param_hint="RUN_ID")
    with catalog() as engine, db.session_scope(engine) as session:
        model = repository.require(session, name, field="name")
        if lens is not None and run_id is not None:
            runs = current.choose(session, model, lens, run_id)
            log.info("%s now serves %s %d.", name, current.LENSES[lens].noun, run_id)
        else:
            runs = current.current_runs(session, model)
    table = Table("lens", "current run", title=f"{name}: the run each lens serves")
    for key, value in runs.items():
        table.add_row(key, "-" if value is None else str(value))
    Console().print(table)
