"""``headcat db``: the catalog database (upgrade, url, psql)."""

from __future__ import annotations

import sys

import typer

from service import db
from service.cli.app import app, catalog, log
from service.errors import InvalidInput

db_app = typer.Typer(help="The catalog database.", no_args_is_help=True)
app.add_typer(db_app, name="db")


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
        if db.embedded_started_here():  # else another command (serve, worker) holds it: the URL keeps working
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
