"""``headcat keys``: API keys for the REST API's writes (create, list, revoke)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.table import Table

from service import db
from service.cli.app import app, catalog, log, make_console

keys_app = typer.Typer(help="API keys for the REST API's writes (see the README's Security section).",
                       no_args_is_help=True)  # fmt: skip
app.add_typer(keys_app, name="keys")


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
        make_console().print(table)


@keys_app.command("revoke")
def keys_revoke(
    key: Annotated[str, typer.Argument(help="the key's id, or the start of its secret (hc_xxxx...)")],
) -> None:
    """Revoke a key: requests with it answer 403 from now on."""
    from service.auth import repository

    with catalog() as engine, db.session_scope(engine) as session:
        found = repository.revoke(session, repository.find(session, key))
        log.info("Key %d (%s, %s...) is revoked.", found.id, found.name, found.prefix)
