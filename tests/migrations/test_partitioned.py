"""``bench/api_load.py --partition``: a catalog's copy with every head table hash-partitioned by ``model_id``.

The reference is the source catalog itself, read back from PostgreSQL's own catalogs and rows: the
copy must answer the same rows in every head table and view, carry the same named constraints
(keys, checks, foreign keys) and indexes on the parent tables, keep the views' comments and the
heads' id sequence, spread each table's rows over the partitions by ``model_id`` (never one model
over two partitions) and still enforce the composite foreign key and its cascade.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from sqlalchemy import Connection, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError

from service import db
from tests.migrations.test_model_id import HEAD_TABLES, VIEWS, _fill, _snapshot

ROOT = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("headcat_bench_api_load", ROOT / "bench" / "api_load.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _schema(connection: Connection) -> dict[str, Any]:
    """Named constraints and indexes on the head tables (not their partitions' copies), view comments."""
    tables = ["heads", *HEAD_TABLES]
    constraints = connection.execute(
        text(
            "SELECT conrelid::regclass::text, conname, contype::text, pg_get_constraintdef(oid) FROM pg_constraint "
            # conparentid = 0: not PostgreSQL's own per-partition copies of a foreign key
            "WHERE conrelid = ANY(CAST(:t AS regclass[])) AND conparentid = 0 AND contype IN ('p', 'u', 'c', 'f')"
        ),
        {"t": tables},
    ).all()
    indexes = connection.execute(
        text(
            "SELECT tablename, indexname, replace(indexdef, ' ON ONLY ', ' ON ') FROM pg_indexes "
            "WHERE tablename = ANY(:t)"
        ),
        {"t": tables},
    ).all()
    comments = connection.execute(
        text("SELECT c.relname, obj_description(c.oid, 'pg_class') FROM pg_class c WHERE c.relname = ANY(:v)"),
        {"v": list(VIEWS)},
    ).all()
    # a check's text is deparsed again (its array's casts move): its name here, its effect in the test
    named = {(t, n, k, None if k == "c" else d) for t, n, k, d in constraints}
    return {"constraints": named, "indexes": set(indexes), "comments": set(comments)}


def _hashed_partition(connection: Connection, table: str, model: int) -> str:
    """The partition of ``table`` (of 4) whose hash bound PostgreSQL says ``model`` satisfies."""
    return connection.scalar(
        text(
            "SELECT inhrelid::regclass::text FROM pg_inherits WHERE inhparent = CAST(:t AS regclass) "
            "AND satisfies_hash_partition(CAST(:t AS regclass), 4, "
            "CAST(substring(inhrelid::regclass::text from '_p([0-9]+)$') AS int), CAST(:m AS integer))"
        ),
        {"t": table, "m": model},
    )


def test_partition_keeps_rows_keys_views_and_spreads_models(empty_database: str) -> None:
    db.upgrade(empty_database)
    source = make_url(empty_database).database
    engine = create_engine(empty_database)
    with engine.begin() as connection:
        owner = _fill(connection)
        before, schema = _snapshot(connection), _schema(connection)
        filed = {t: sorted(connection.execute(text(f"SELECT * FROM {t}")).all()) for t in HEAD_TABLES}
    engine.dispose()
    assert len(owner) == 8

    server = make_url(empty_database).set(database="postgres").render_as_string(hide_password=False)
    target = _bench().partition(server, source, 4)
    assert target == f"{source}_p4"
    copy = create_engine(make_url(empty_database).set(database=target))
    try:
        with copy.connect() as connection:
            assert _snapshot(connection) == before
            for table in HEAD_TABLES:
                assert sorted(connection.execute(text(f"SELECT * FROM {table}")).all()) == filed[table], table
            assert _schema(connection) == schema
            for table in ("heads", *HEAD_TABLES):
                kind, strategy, key = connection.execute(
                    text(
                        "SELECT c.relkind::text, p.partstrat::text, a.attname FROM pg_class c "
                        "JOIN pg_partitioned_table p ON p.partrelid = c.oid "
                        "JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = p.partattrs[0] "
                        "WHERE c.oid = CAST(:t AS regclass)"
                    ),
                    {"t": table},
                ).one()
                assert (kind, strategy, key) == ("p", "h", "model_id"), table
                placed = connection.execute(
                    text(f"SELECT tableoid::regclass::text, model_id FROM {table}")
                ).all()  # fmt: skip
                parts = connection.scalars(
                    text("SELECT inhrelid::regclass::text FROM pg_inherits WHERE inhparent = CAST(:t AS regclass)"),
                    {"t": table},
                ).all()
                assert sorted(parts) == sorted(f"{table}_p{i}" for i in range(4))
                # each model's rows in one partition, and that partition is the one the hash names
                for model in set(owner.values()):
                    where = {p for p, m in placed if m == model}
                    assert len(where) == 1, (table, model, where)
                    assert where == {_hashed_partition(connection, table, model)}
            assert connection.scalar(text("SELECT pg_get_serial_sequence('heads', 'id')")) == "public.heads_id_seq"

        alpha_head = min(owner)
        beta = max(owner.values())
        with copy.connect() as connection, pytest.raises(IntegrityError, match="fk_importance_scores_model_id_heads"):
            connection.execute(
                text(
                    "INSERT INTO importance_scores (model_id, run_id, head_id, raw, normalized) "
                    "SELECT :beta, run_id, head_id, raw, normalized FROM importance_scores WHERE head_id = :head"
                ),
                {"beta": beta, "head": alpha_head},
            )
        with copy.connect() as connection, pytest.raises(IntegrityError, match="ck_heads_position"):
            connection.execute(text("INSERT INTO heads (model_id, stack, layer, head) VALUES (:m, 'encoder', -1, 0)"),
                               {"m": beta})  # fmt: skip
        with copy.begin() as connection:
            new = connection.scalar(
                text("INSERT INTO heads (model_id, stack, layer, head) VALUES (:m, 'decoder', 0, 0) RETURNING id"),
                {"m": beta},
            )
            assert new == max(owner) + 2  # the sequence carried on (the row the check refused took one)
            connection.execute(text("DELETE FROM heads WHERE model_id = :m"), {"m": beta})
            for table in HEAD_TABLES:
                left = connection.scalars(text(f"SELECT DISTINCT model_id FROM {table}")).all()
                assert left == [owner[alpha_head]], table
    finally:
        copy.dispose()
        admin = create_engine(server, isolation_level="AUTOCOMMIT")
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{target}" WITH (FORCE)'))
        admin.dispose()
