"""Migration 0009: every head table carries ``model_id`` and leads its primary key with it.

An existing catalog (two models, a row in each of the six head tables for every head) is upgraded
from 0008 and downgraded again: no row is lost, ``model_id`` is the model each head was inserted
under (kept in the test), the views answer the same rows, and the composite foreign key refuses a
row filed under another model. The schema test reads ``pg_constraint`` so that a head table added
later without ``model_id`` in its keys fails it.
"""

from __future__ import annotations

from typing import Any

import pytest
from alembic import command
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.exc import IntegrityError

from service import db

HEAD_TABLES = (
    "head_features",
    "head_assignments",
    "stability_heads",
    "importance_scores",
    "head_attributions",
    "head_syntax_scores",
)
VIEWS = ("head_types", "current_head_types", "head_importance", "head_attribution", "head_syntax", "syntax_best_heads")
_DUMMY = {"integer": 0, "bigint": 0, "double precision": 0.5, "real": 0.5, "boolean": False}


def _insert(connection: Connection, table: str, **given: Any) -> Any:
    """Insert a row with ``given`` and a plain value in every other NOT NULL column without a default."""
    columns = connection.execute(
        text(
            "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = :t "
            "AND is_nullable = 'NO' AND column_default IS NULL"
        ),
        {"t": table},
    ).all()
    row = dict(given)
    for name, kind in columns:
        if name not in row:
            row[name] = {"ARRAY": [], "jsonb": "{}", "timestamp with time zone": "2026-01-01T00:00:00Z"}.get(
                kind, _DUMMY.get(kind, "x")
            )
    casts = {name: "::jsonb" if kind == "jsonb" else "" for name, kind in columns}
    names = ", ".join(f'"{name}"' for name in row)
    values = ", ".join(f"CAST(:{name} AS jsonb)" if casts.get(name) else f":{name}" for name in row)
    statement = f"INSERT INTO {table} ({names}) VALUES ({values})"
    if table in (*HEAD_TABLES, "syntax_baselines"):
        connection.execute(text(statement), row)
        return None
    return connection.scalar(text(statement + " RETURNING id"), row)


def _fill(connection: Connection) -> dict[int, int]:
    """Two models of 2 x 2 heads, each with a row per head in every head table; returns head id -> model id."""
    owner: dict[int, int] = {}
    keyed = bool(connection.scalar(text("SELECT count(*) FROM information_schema.columns WHERE "
                                        "table_name = 'head_features' AND column_name = 'model_id'")))  # fmt: skip
    corpus = _insert(connection, "corpora", name="wiki", kind="builtin", source="wiki")
    clustering = _insert(connection, "clusterings", algorithm="kmeans", k=2, status="complete", num_heads=8)
    clusters = [
        _insert(connection, "clusters", clustering_id=clustering, index=i, name=name, centroid=[0.0] * 7)
        for i, name in enumerate(("vertical", "diagonal"))
    ]
    stability = _insert(connection, "stability_runs", clustering_id=clustering, seeds=[1], score=0.5)
    for m, name in enumerate(("alpha", "beta")):
        model = _insert(connection, "models", name=name, architecture="bert", num_layers=2, num_heads=2)
        run = _insert(connection, "feature_runs", model_id=model, corpus_id=corpus, status="complete", num_windows=2)
        connection.execute(text("INSERT INTO clustering_feature_runs VALUES (:c, :r)"), {"c": clustering, "r": run})
        importance = _insert(connection, "importance_runs", model_id=model, status="complete", loss="lm")
        attribution = _insert(
            connection, "attribution_runs", model_id=model, corpus_id=corpus, status="complete", stack="encoder",
            num_windows=2, example_tokens=["a"], example_queries=[0],
        )  # fmt: skip
        syntax = _insert(connection, "syntax_runs", model_id=model, status="complete", stack="encoder", parses="gold")
        _insert(connection, "syntax_baselines", syntax_run_id=syntax, relation="nsubj", offset=-1, accuracy=0.25)
        connection.execute(
            text("UPDATE models SET current_clustering_id = :c WHERE id = :m"), {"c": clustering, "m": model}
        )
        for layer in range(2):
            for head in range(2):
                head_id = _insert(connection, "heads", model_id=model, stack="encoder", layer=layer, head=head)
                owner[head_id] = model
                of = {"model_id": model} if keyed else {}  # from 0009 every writer names the model
                value = 10 * m + 2 * layer + head  # distinct per head, so the views' rows tell heads apart
                _insert(connection, "head_features", **of, feature_run_id=run, head_id=head_id,
                        vector=[float(value), 0.0, 0.0, 0.0, 0.0, 0.0, 1.0], entropy=value)  # fmt: skip
                _insert(connection, "head_assignments", **of, clustering_id=clustering, head_id=head_id,
                        cluster_id=clusters[head], feature_run_id=run)  # fmt: skip
                _insert(
                    connection, "stability_heads", **of, stability_run_id=stability, head_id=head_id, stable=head == 0
                )
                _insert(
                    connection,
                    "importance_scores",
                    **of,
                    run_id=importance,
                    head_id=head_id,
                    raw=value,
                    normalized=value,
                )
                _insert(connection, "head_attributions", **of, attribution_run_id=attribution, head_id=head_id,
                        vector=[float(value), 0.0, 0.0, 0.0, 0.0, 0.0, 1.0], local_vector=[0.0] * 7, discrepancy=value,
                        example_attention=[[0.0]], example_attribution=[[0.0]])  # fmt: skip
                for direction in ("dep2head", "head2dep"):
                    _insert(connection, "head_syntax_scores", **of, syntax_run_id=syntax, head_id=head_id,
                            relation="nsubj", direction=direction, correct=value, count=40,
                            accuracy=value / 40)  # fmt: skip
    return owner


def _snapshot(connection: Connection) -> dict[str, Any]:
    """Every head table's rows (without model_id) and every view's rows, sorted."""
    found: dict[str, Any] = {}
    for table in (*HEAD_TABLES, *VIEWS):
        rows = connection.execute(text(f"SELECT * FROM {table}")).mappings().all()
        keep = [{k: v for k, v in row.items() if not (table in HEAD_TABLES and k == "model_id")} for row in rows]
        found[table] = sorted(keep, key=repr)
    return found


def _primary_key(connection: Connection, table: str) -> list[str]:
    return list(
        connection.scalars(
            text(
                "SELECT a.attname FROM pg_constraint c CROSS JOIN unnest(c.conkey) WITH ORDINALITY k(attnum, i) "
                "JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.attnum "
                "WHERE c.conrelid = CAST(:t AS regclass) AND c.contype = 'p' ORDER BY k.i"
            ),
            {"t": table},
        )
    )


def _foreign_keys_to_heads(connection: Connection, table: str) -> list[tuple[list[str], list[str], str]]:
    """``(columns, heads' columns, on delete)`` of each of the table's foreign keys to ``heads``."""
    rows = connection.execute(
        text(
            "SELECT (SELECT array_agg(a.attname ORDER BY k.i) FROM unnest(c.conkey) WITH ORDINALITY k(attnum, i) "
            "        JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.attnum), "
            "       (SELECT array_agg(a.attname ORDER BY k.i) FROM unnest(c.confkey) WITH ORDINALITY k(attnum, i) "
            "        JOIN pg_attribute a ON a.attrelid = c.confrelid AND a.attnum = k.attnum), "
            "       c.confdeltype "
            "FROM pg_constraint c WHERE c.conrelid = CAST(:t AS regclass) AND c.contype = 'f' "
            "AND c.confrelid = 'heads'::regclass"
        ),
        {"t": table},
    ).all()
    return [(list(a), list(b), str(d)) for a, b, d in rows]


def _downgrade(url: str, revision: str) -> None:
    command.downgrade(db.alembic_config(url), revision)


def test_0009_keeps_every_row_and_files_it_under_its_model(empty_database: str) -> None:
    db.upgrade(empty_database, "0008")
    engine: Engine = create_engine(empty_database)
    try:
        with engine.begin() as connection:
            owner = _fill(connection)
            before = _snapshot(connection)
        assert len(owner) == 8
        assert len(before["head_syntax_scores"]) == 16
        assert len(before["current_head_types"]) == 8
        assert len(before["head_syntax"]) == 16

        db.upgrade(empty_database, "0009")
        with engine.connect() as connection:
            assert _snapshot(connection) == before
            for table in HEAD_TABLES:
                filed = connection.execute(text(f"SELECT head_id, model_id FROM {table}")).all()
                assert len(filed) in (8, 16)
                assert all(model_id == owner[head_id] for head_id, model_id in filed), table
                assert _primary_key(connection, table)[0] == "model_id"
            assert _primary_key(connection, "heads") == ["model_id", "id"]
            # a head of alpha filed under beta is refused by the composite foreign key
            alpha_head = min(owner)
            beta = max(owner.values())
            assert owner[alpha_head] != beta
            with pytest.raises(IntegrityError, match="fk_importance_scores_model_id_heads"):
                connection.execute(
                    text(
                        "INSERT INTO importance_scores (model_id, run_id, head_id, raw, normalized) "
                        "SELECT :beta, run_id, head_id, raw, normalized FROM importance_scores "
                        "WHERE head_id = :head"
                    ),
                    {"beta": beta, "head": alpha_head},
                )

        _downgrade(empty_database, "0008")
        with engine.connect() as connection:
            assert _snapshot(connection) == before
            for table in HEAD_TABLES:
                columns = connection.execute(text(f"SELECT * FROM {table} LIMIT 0")).keys()
                assert "model_id" not in columns
                assert _foreign_keys_to_heads(connection, table) == [(["head_id"], ["id"], "c")]
            assert _primary_key(connection, "heads") == ["id"]
            assert _primary_key(connection, "head_features") == ["feature_run_id", "head_id"]
    finally:
        engine.dispose()


def test_every_head_table_is_keyed_by_model_id(connection: Connection) -> None:
    """Every table with a ``head_id`` leads its primary key with ``model_id`` and reaches ``heads``
    through ``(model_id, head_id) -> heads (model_id, id)`` ON DELETE CASCADE, and nothing else."""
    tables = set(
        connection.scalars(
            text(
                "SELECT c.relname FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE a.attname = 'head_id' AND NOT a.attisdropped AND c.relkind IN ('r', 'p') "
                "AND n.nspname = 'public'"
            )
        )
    )
    assert tables >= set(HEAD_TABLES)
    assert _primary_key(connection, "heads") == ["model_id", "id"]
    for table in sorted(tables):
        key = _primary_key(connection, table)
        assert key[0] == "model_id", (table, key)
        assert "head_id" in key, (table, key)
        assert _foreign_keys_to_heads(connection, table) == [(["model_id", "head_id"], ["model_id", "id"], "c")], table
        nullable = connection.scalar(
            text(
                "SELECT is_nullable FROM information_schema.columns WHERE table_name = :t AND column_name = 'model_id'"
            ),
            {"t": table},
        )
        assert nullable == "NO", table


def test_deleting_a_head_deletes_its_rows_in_every_head_table(connection: Connection) -> None:
    owner = _fill(connection)
    gone = min(owner)
    connection.execute(text("DELETE FROM heads WHERE id = :h"), {"h": gone})
    for table in HEAD_TABLES:
        left = connection.scalar(text(f"SELECT count(*) FROM {table} WHERE head_id = :h"), {"h": gone})
        others = connection.scalar(text(f"SELECT count(DISTINCT head_id) FROM {table}"))
        assert (left, others) == (0, 7), table


def test_the_orm_is_the_migrated_schema(connection: Connection) -> None:
    """Alembic's autogenerate finds nothing to do between ``service/orm.py`` and the migrated
    database, column comments included (they are what someone querying by hand reads), and every
    table's primary key has the ORM's columns in the ORM's order (autogenerate does not compare
    primary keys)."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from service.orm import Base

    def ours(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        table = obj if type_ == "table" else getattr(obj, "table", None)
        return not (name or "").startswith("procrastinate") and not (
            table is not None and table.name.startswith("procrastinate")
        )

    context = MigrationContext.configure(connection, opts={"compare_type": True, "include_object": ours})
    assert compare_metadata(context, Base.metadata) == []
    for table in Base.metadata.sorted_tables:
        assert _primary_key(connection, table.name) == [c.name for c in table.primary_key.columns], table.name


@pytest.mark.parametrize(
    "view", ["head_types", "head_importance", "head_attribution", "head_syntax", "head_detections"]
)
def test_the_views_join_heads_on_model_and_head(connection: Connection, view: str) -> None:
    definition = " ".join(connection.scalar(text("SELECT pg_get_viewdef(CAST(:v AS regclass))"), {"v": view}).split())
    joins = [part.split(")))")[0] for part in definition.split("JOIN ")[1:] if part.startswith(("heads ", "head_"))]
    assert joins, definition
    for join in joins:
        assert "head_id" in join, join
        assert "model_id = " in join, join
