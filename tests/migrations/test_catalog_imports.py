"""Migration 0011: catalog imports, ``models.import_id`` and the ``catalog_import`` job kind, up and down."""

from __future__ import annotations

import re

import pytest
from alembic import command
from sqlalchemy import create_engine, text
from sqlalchemy.exc import IntegrityError

from service import db


def _kinds(connection: object) -> set[str]:
    """The job kinds ``ck_jobs_kind`` allows (a set: a later migration may rebuild it in another order)."""
    definition = connection.execute(  # type: ignore[attr-defined]
        text("SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = 'ck_jobs_kind'")
    ).scalar_one()
    return set(re.findall(r"'(\w+)'::", definition))


def test_0011_adds_imports_and_the_job_kind_and_keeps_the_kinds_before_it(empty_database: str) -> None:
    db.upgrade(empty_database, "0009")
    engine = create_engine(empty_database)
    try:
        with engine.connect() as connection:
            before = _kinds(connection)
        db.upgrade(empty_database, "0011")
        with engine.begin() as connection:
            after = _kinds(connection)
            for kind in ("ingest", "clustering", "stability", "ablation", "attribution", "syntax", "importance",
                         "pruning", "detection", "catalog_import"):  # fmt: skip
                assert kind in after, kind
            import_id = connection.execute(
                text(
                    "INSERT INTO catalog_imports (archive_sha256, origin, format_version, headcat_version, models, "
                    "rows) VALUES (:s, '/x', 1, '0.1.0', '{a}', 3) RETURNING id"
                ),  # fmt: skip
                {"s": "a" * 64},
            ).scalar_one()
            connection.execute(
                text(
                    "INSERT INTO models (name, source, architecture, num_layers, num_heads, import_id) "
                    "VALUES ('a', '/m', 'bert', 1, 1, :i)"
                ),  # fmt: skip
                {"i": import_id},
            )
            connection.execute(text("INSERT INTO jobs (kind, queue, status, request, dedupe_key) "
                                    "VALUES ('catalog_import', 'cpu', 'succeeded', '{}', 'k')"))  # fmt: skip
        with engine.begin() as connection, pytest.raises(IntegrityError, match="uq_catalog_imports"):
            connection.execute(
                text(
                    "INSERT INTO catalog_imports (archive_sha256, origin, format_version, headcat_version, models, "
                    "rows) VALUES (:s, '/y', 1, '0.1.0', '{}', 3)"
                ),  # fmt: skip
                {"s": "a" * 64},
            )
        command.downgrade(db.alembic_config(empty_database), "0009")
        with engine.connect() as connection:
            assert _kinds(connection) == before
            assert "import_id" not in connection.execute(text("SELECT * FROM models LIMIT 0")).keys()
            assert connection.execute(text("SELECT count(*) FROM jobs")).scalar_one() == 0
            assert connection.execute(text("SELECT to_regclass('catalog_imports')")).scalar_one() is None
    finally:
        engine.dispose()
