"""``headcat models``: the models in the catalog."""

from __future__ import annotations

from rich.table import Table

from service import db
from service.cli.app import app, catalog, make_console


@app.command("models")
def list_models() -> None:
    """List the models in the catalog."""
    from service.models import repository

    with catalog() as engine, db.session_scope(engine) as session:
        table = Table("name", "architecture", "layers x heads", "source", "current clustering", "imported from")
        for m in repository.list_all(session):
            imported = m.catalog_import.origin if m.catalog_import is not None else "-"
            table.add_row(m.name, m.architecture, f"{m.num_layers} x {m.num_heads}", m.source,
                          str(m.current_clustering_id or "-"), imported)  # fmt: skip
        make_console().print(table)
