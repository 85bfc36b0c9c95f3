"""Load on ``GET /heads``: catalogs of 10^6 and 10^7 heads, the paper's filters and cross-model ones.

    python bench/api_load.py [--heads 1000000] [--duration 30] [--connections 1 2 4] [--mix both]
                             [--profile] [--keep | --fill-only]
    python bench/api_load.py --reuse DB_1E6 DB_1E7 --mix paper --connections 1 2 4 --profile
    python bench/api_load.py --paired DB_1E6 DB_1E7 --connections 1 2 4 --profile [--prewarm]
    python bench/api_load.py --partition DB_1E6 --partitions 16      # makes DB_1E6_p16 (see partition())
    python bench/api_load.py --explain DB_1E6 DB_1E6_p16             # plans and buffers of five pages

1. Makes a scratch database on the PostgreSQL of ``--server-url`` (default: ``DATABASE_URL``, else
   ``postgresql://postgres@127.0.0.1:5432/postgres``), applies the migrations and fills it with
   synthetic models of real shapes (BERT-base 12 x 12, BERT-large 24 x 16, and one small model to
   make the count exact; six architectures and tasks) by COPY: per model a feature run, 21
   features and 5 scalars per head, a k = 4 clustering (current) with its clusters and one
   assignment per head. The COPYs run without foreign-key triggers; one join at the end checks
   that every head has its features, assignment and cluster.
   Example attention maps are left out: they live out of line (TOAST) and ``/heads`` never reads them.
2. Serves the API with uvicorn in a subprocess on 127.0.0.1 (a free port), as ``headcat serve`` does.
3. Drives ``GET /heads`` from another process for ``--duration`` seconds (at most ``--requests``)
   at each of ``--connections``, over keep-alive connections, with a seeded mix (``--mix``) of
   the SPEC's per-model filters (``model=X&type=vertical&layer_gt=N``, ``type=..&layer_le``,
   ``layer_ge/layer_lt``, ``head``) and the cross-model ones (``num_layers_ge=24&...``,
   ``architecture=``, ``task=``, ``stack=``) from a random point of the catalog (``after=``),
   and prints requests/s, p50, p90, p99 and max latency and the error count, then one table row
   per run.
4. With ``--profile``, asks the server for its own split of each request's time through
   ``X-Headcat-Timing``: SQL (statement execution, summed, and the number of statements), Python
   in the endpoint, response validation and JSON, and the rest (dependencies: session, key check;
   threadpool hops; middleware), and prints the mean and p99 of each, and server time over SQL.
   The client's latency minus the server's total is the HTTP server loop and the client.

The scratch database is dropped at the end unless ``--keep`` or ``--fill-only``; ``--reuse NAME
[NAME ...]`` drives kept catalogs in turn without filling. ``--paired A B`` serves two kept catalogs
at once and every connection asks them in turn, request by request, so that both see the same
seconds of a shared machine: the ratio of their p99s is then about the catalogs, not about what
else ran meanwhile. ``--prewarm`` first reads the catalogs into the OS page cache (``pg_prewarm``):
a catalog server whose memory holds its tables; without it, pages not yet cached come from disk.
The server is the stack ``headcat serve`` runs (uvloop and httptools); ``--server-stack
asyncio-h11`` measures it on the pure-Python pair instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TYPES = ("dense", "diagonal", "dense_vertical", "vertical")
ARCHITECTURES = ("bert", "bert", "roberta", "electra", "deberta-v2", "xlm-roberta")  # bert twice: the most common
TASKS = ("base", "base", "sequence-classification", "question-answering", "token-classification", "masked-lm")
SHAPES = (("bert-base", 12, 12), ("bert-large", 24, 16))


def plan_models(total: int) -> list[tuple[str, int, int]]:
    """(architecture label, layers, heads) per model, summing to ``total`` heads: about 30 % of the
    heads in BERT-base shapes, the rest BERT-large, and one small model for the remainder."""
    base = round(total * 0.3 / 144)
    large = (total - base * 144) // 384
    models = [SHAPES[0]] * base + [SHAPES[1]] * large
    rest = total - base * 144 - large * 384
    while rest >= 144:
        models.append(SHAPES[0])
        rest -= 144
    if rest:
        heads = 16 if rest % 16 == 0 else next(h for h in (12, 8, 4, 2, 1) if rest % h == 0)
        models.append(("small", rest // heads, heads))
    random.Random(0).shuffle(models)
    return models


def type_of(rng: random.Random, layer: int, layers: int) -> int:
    """Where the paper finds them: diagonal and dense_vertical low, vertical in the middle, dense high."""
    depth = layer / max(1, layers - 1)
    weights = (0.15 + 0.5 * depth, 0.35 * (1 - depth) + 0.05, 0.3 * (1 - depth) + 0.05, 0.25)
    return rng.choices(range(4), weights)[0]


def fill(url: str, total: int) -> list[tuple[str, int, int]]:
    """COPY the synthetic catalog into the (migrated, empty) database at ``url``."""
    import psycopg

    from service.jobs.queue import conninfo

    rng = random.Random(0)
    models = plan_models(total)
    started = time.perf_counter()
    named: list[tuple[str, int, int]] = []
    with psycopg.connect(conninfo(url)) as connection, connection.cursor() as cursor:
        # The rows are generated consistent; the foreign keys' per-row triggers (queued to the end
        # of each COPY, each an index probe) would otherwise take most of a 10^7-row fill.
        cursor.execute("SET session_replication_role = replica")
        cursor.execute("INSERT INTO corpora (id, name, kind, source) VALUES (1, 'wiki', 'builtin', 'wiki')")
        with cursor.copy(
            "COPY models (id, name, source, architecture, task, num_layers, num_heads, stacks) FROM STDIN"
        ) as copy:
            for m, (shape, layers, heads) in enumerate(models, 1):
                name = f"synth-{m:05d}-{shape}"
                named.append((name, layers, heads))
                stacks = json.dumps({"encoder": {"layers": layers, "heads": heads, "kv_heads": heads}})
                copy.write_row((m, name, "synthetic", rng.choice(ARCHITECTURES), rng.choice(TASKS), layers, heads,
                                stacks))  # fmt: skip
        with cursor.copy(
            "COPY feature_runs (id, model_id, corpus_id, status, num_windows, max_length, samples_requested, "
            "num_samples, num_tokens, special_tokens, config, device, dtype, seconds, started_at, finished_at) "
            "FROM STDIN"
        ) as copy:
            for m in range(1, len(models) + 1):
                copy.write_row((m, m, 1, "complete", 16, 128, 1000, 1000, 60000, "{}", "{}", "cpu", "float32",
                                1.0, "2026-01-01T00:00:00Z", "2026-01-01T00:00:01Z"))  # fmt: skip
        with cursor.copy(
            "COPY clusterings (id, algorithm, k, seed, num_windows, params, status, num_heads) FROM STDIN"
        ) as copy:
            for m, (_, layers, heads) in enumerate(models, 1):
                copy.write_row((m, "kmeans", 4, 0, 16, "{}", "complete", layers * heads))
        with cursor.copy("COPY clustering_feature_runs (clustering_id, feature_run_id) FROM STDIN") as copy:
            for m in range(1, len(models) + 1):
                copy.write_row((m, m))
        with cursor.copy("COPY clusters (id, clustering_id, index, name, centroid, size, share) FROM STDIN") as copy:
            for m in range(1, len(models) + 1):
                for i, name in enumerate(TYPES):
                    centroid = [round(rng.random() / 21, 4) for _ in range(21)]
                    copy.write_row((4 * (m - 1) + i + 1, m, i, name, centroid, 0, 0.25))
        print(f"  models, runs, clusterings: {len(models)} models ({time.perf_counter() - started:.1f} s)")

        head_id = 0
        assignments: list[tuple[int, int, int]] = []  # (head id, model, type index)
        with cursor.copy("COPY heads (id, model_id, stack, layer, head) FROM STDIN") as copy:
            for m, (_, layers, heads) in enumerate(models, 1):
                for layer in range(layers):
                    for head in range(heads):
                        head_id += 1
                        copy.write_row((head_id, m, "encoder", layer, head))
                        assignments.append((head_id, m, type_of(rng, layer, layers)))
        print(f"  heads: {head_id} ({time.perf_counter() - started:.1f} s)")
        with cursor.copy(
            "COPY head_features (model_id, feature_run_id, head_id, vector, entropy, prev_token, next_token, "
            "mean_distance, sep_to_sep) FROM STDIN"
        ) as copy:
            for hid, m, _ in assignments:
                vector = "{" + ",".join(f"{rng.random() / 21:.4f}" for _ in range(21)) + "}"
                copy.write(f"{m}\t{m}\t{hid}\t{vector}\t{rng.uniform(0.5, 4):.4f}\t{rng.random():.4f}\t"
                           f"{rng.random():.4f}\t{rng.uniform(1, 40):.3f}\t{rng.random():.4f}\n")  # fmt: skip
        print(f"  head_features ({time.perf_counter() - started:.1f} s)")
        with cursor.copy(
            "COPY head_assignments (model_id, clustering_id, head_id, cluster_id, feature_run_id, tsne_x, tsne_y) "
            "FROM STDIN"
        ) as copy:
            for hid, m, t in assignments:
                copy.write(
                    f"{m}\t{m}\t{hid}\t{4 * (m - 1) + t + 1}\t{m}\t{rng.gauss(0, 20):.3f}\t{rng.gauss(0, 20):.3f}\n"
                )
        print(f"  head_assignments ({time.perf_counter() - started:.1f} s)")
        cursor.execute("UPDATE models SET current_clustering_id = id, current_feature_run_id = id")
        cursor.execute(
            "UPDATE clusters c SET size = s.n, share = s.n::float / cl.num_heads FROM "
            "(SELECT cluster_id, count(*) AS n FROM head_assignments GROUP BY cluster_id) s, clusterings cl "
            "WHERE c.id = s.cluster_id AND cl.id = c.clustering_id"
        )
        orphans = cursor.execute(
            "SELECT (SELECT count(*) FROM heads) - (SELECT count(*) FROM head_features f JOIN heads h "
            "ON h.model_id = f.model_id AND h.id = f.head_id JOIN head_assignments a ON a.model_id = h.model_id "
            "AND a.head_id = h.id AND a.feature_run_id = f.feature_run_id "
            "JOIN clusters c ON c.id = a.cluster_id AND c.clustering_id = a.clustering_id)"
        ).fetchone()
        assert orphans == (0,), f"the fill is inconsistent: {orphans}"
        for table in ("models", "corpora", "feature_runs", "clusterings", "clusters", "heads"):
            cursor.execute(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), (SELECT max(id) FROM {table}))")
        connection.commit()
    with psycopg.connect(conninfo(url), autocommit=True) as connection:
        connection.execute("VACUUM ANALYZE")
    print(f"  filled and analysed in {time.perf_counter() - started:.1f} s")
    return named


# Every head table, ``heads`` first: the tables hash-partitioned by ``model_id`` (README, "Scaling out").
HEAD_TABLES = ("heads", "head_features", "head_assignments", "stability_heads", "importance_scores",
               "head_attributions", "head_syntax_scores")  # fmt: skip


def partition(server_url: str, source: str, partitions: int) -> str:
    """Copy the kept catalog ``source`` to ``{source}_p{partitions}`` and hash-partition its head tables there.

    In the copy (``CREATE DATABASE ... TEMPLATE source STRATEGY FILE_COPY``), each of :data:`HEAD_TABLES` becomes a
    ``PARTITION BY HASH (model_id)`` table of ``partitions`` partitions (``{table}_p{i}``) with the
    same columns (defaults, column comments), constraints under their names (primary key, unique,
    checks, and the foreign keys: PostgreSQL 12+ takes them between partitioned tables, validated
    when added), the other indexes by their definitions, the table comment and ``heads``' id
    sequence. The rows are moved by ``INSERT ... SELECT`` before the indexes are built; the old
    tables are dropped, and the views that read them (transitively) are dropped first and recreated
    from their ``pg_views`` definitions, with their comments. One transaction, then ``ANALYZE``.
    Returns the new database's name.
    """
    import psycopg
    from psycopg import sql
    from sqlalchemy.engine import make_url

    from service.jobs.queue import conninfo

    log = logging.getLogger("api_load.partition")
    target = f"{source}_p{partitions}"
    started = time.perf_counter()
    admin = make_url(server_url).render_as_string(hide_password=False)
    with psycopg.connect(conninfo(admin), autocommit=True) as connection:
        log.info("creating %s from the template %s (no session may be connected to it)", target, source)
        # FILE_COPY: the files copied after a checkpoint, not every block through the WAL (PostgreSQL 15's
        # default), for a catalog of gigabytes
        created = sql.SQL("CREATE DATABASE {} TEMPLATE {} STRATEGY FILE_COPY")
        connection.execute(created.format(sql.Identifier(target), sql.Identifier(source)))
    url = make_url(server_url).set(database=target).render_as_string(hide_password=False)
    try:
        with psycopg.connect(conninfo(url)) as connection, connection.cursor() as cursor:
            cursor.execute("SET LOCAL maintenance_work_mem = '256MB'")
            oids = [r[0] for r in cursor.execute("SELECT unnest(%s::regclass[])::oid", (list(HEAD_TABLES),))]
            # What depends on the tables, read before anything is dropped.
            constraints = cursor.execute(
                "SELECT c.conrelid::regclass::text, c.conname, c.contype, pg_get_constraintdef(c.oid) "
                "FROM pg_constraint c WHERE (c.conrelid = ANY(%s) OR c.confrelid = ANY(%s)) AND c.contype IN "
                "('p', 'u', 'c', 'f', 'x') ORDER BY position(c.contype::text IN 'pucxf'), c.conrelid, c.conname",
                (oids, oids),
            ).fetchall()
            indexes = cursor.execute(
                "SELECT i.indexrelid::regclass::text, pg_get_indexdef(i.indexrelid) FROM pg_index i "
                "WHERE i.indrelid = ANY(%s) AND NOT EXISTS (SELECT FROM pg_constraint c WHERE c.conindid = "
                "i.indexrelid AND c.conrelid = i.indrelid) ORDER BY i.indrelid, 1",
                (oids,),
            ).fetchall()
            comments = cursor.execute(
                "SELECT c.oid::regclass::text, obj_description(c.oid, 'pg_class') FROM pg_class c "
                "WHERE c.oid = ANY(%s) AND obj_description(c.oid, 'pg_class') IS NOT NULL",
                (oids,),
            ).fetchall()
            sequences = cursor.execute(
                "SELECT d.objid::regclass::text, t.relname, a.attname FROM pg_depend d "
                "JOIN pg_class t ON t.oid = d.refobjid JOIN pg_attribute a ON a.attrelid = t.oid "
                "AND a.attnum = d.refobjsubid JOIN pg_class s ON s.oid = d.objid AND s.relkind = 'S' "
                "WHERE d.refobjid = ANY(%s) AND d.deptype = 'a'",
                (oids,),
            ).fetchall()
            # Views reading the tables, and views reading those, with their direct view dependencies.
            views = cursor.execute(
                "WITH RECURSIVE uses(view, used) AS ("
                "  SELECT DISTINCT r.ev_class, d.refobjid FROM pg_depend d JOIN pg_rewrite r ON r.oid = d.objid "
                "  WHERE d.classid = 'pg_rewrite'::regclass AND d.refobjid <> r.ev_class "
                "), reading(view) AS ("
                "  SELECT view FROM uses WHERE used = ANY(%s) UNION SELECT u.view FROM uses u JOIN reading r "
                "  ON u.used = r.view"
                ") SELECT c.oid, c.relname, pg_get_viewdef(c.oid), c.reloptions, obj_description(c.oid, 'pg_class'), "
                "  array(SELECT u.used FROM uses u WHERE u.view = c.oid), "
                "  array(SELECT json_build_array(a.attname, col_description(c.oid, a.attnum)) FROM pg_attribute a "
                "        WHERE a.attrelid = c.oid AND a.attnum > 0 AND col_description(c.oid, a.attnum) IS NOT NULL) "
                "FROM pg_class c WHERE c.oid IN (SELECT view FROM reading) AND c.relkind = 'v'",
                (oids,),
            ).fetchall()
            kinds = cursor.execute(
                "SELECT count(*) FROM pg_depend d JOIN pg_rewrite r ON r.oid = d.objid JOIN pg_class c "
                "ON c.oid = r.ev_class WHERE d.refobjid = ANY(%s) AND c.relkind = 'm'",
                (oids,),
            ).fetchone()
            assert kinds == (0,), "materialized views read the head tables: not handled"
            ordered, placed = [], set()  # the views in an order where each comes after the views it reads
            pending = {v[0]: v for v in views}
            while pending:
                ready = [v for oid, v in pending.items() if not (set(v[5]) & set(pending) - {oid})]
                assert ready, "the views depend on each other in a cycle"
                for v in sorted(ready, key=lambda v: v[1]):
                    ordered.append(v)
                    placed.add(v[0])
                    del pending[v[0]]
            log.info("%s: %d constraints, %d other indexes, %d views (%s) to carry over", target,
                     len(constraints), len(indexes), len(ordered), ", ".join(v[1] for v in ordered))  # fmt: skip

            for table in HEAD_TABLES:  # new tables under a temporary name, filled
                new = sql.Identifier(f"{table}__partitioned")
                cursor.execute(sql.SQL(
                    "CREATE TABLE {} (LIKE {} INCLUDING DEFAULTS INCLUDING GENERATED INCLUDING STORAGE "
                    "INCLUDING COMPRESSION INCLUDING COMMENTS) PARTITION BY HASH (model_id)"
                ).format(new, sql.Identifier(table)))  # fmt: skip
                for i in range(partitions):
                    cursor.execute(sql.SQL("CREATE TABLE {} PARTITION OF {} FOR VALUES WITH (MODULUS {}, REMAINDER {})")
                                   .format(sql.Identifier(f"{table}_p{i}"), new, sql.Literal(partitions),
                                           sql.Literal(i)))  # fmt: skip
                columns = [r[0] for r in cursor.execute(
                    "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
                    "AND NOT attisdropped ORDER BY attnum", (table,)).fetchall()]  # fmt: skip
                listed = sql.SQL(", ").join(map(sql.Identifier, columns))
                moved = sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {}")
                cursor.execute(moved.format(new, listed, listed, sql.Identifier(table)))
                log.info("%s: %d rows moved into %d partitions (%.1f s)", table, cursor.rowcount, partitions,
                         time.perf_counter() - started)  # fmt: skip

            for view in reversed(ordered):
                cursor.execute(sql.SQL("DROP VIEW {}").format(sql.Identifier(view[1])))
            for table, name, kind, _ in constraints:  # foreign keys from other tables would hold the old ones
                if kind == "f" and table not in HEAD_TABLES:
                    dropped = sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}")
                    cursor.execute(dropped.format(sql.Identifier(table), sql.Identifier(name)))
            for sequence, _, _ in sequences:  # else dropping the table drops its serial's sequence
                cursor.execute(sql.SQL("ALTER SEQUENCE {} OWNED BY NONE").format(sql.SQL(sequence)))
            cursor.execute(sql.SQL("DROP TABLE {}").format(sql.SQL(", ").join(map(sql.Identifier, HEAD_TABLES))))
            for table in HEAD_TABLES:
                cursor.execute(sql.SQL("ALTER TABLE {} RENAME TO {}").format(sql.Identifier(f"{table}__partitioned"),
                                                                             sql.Identifier(table)))  # fmt: skip
            log.info("old tables dropped, new ones renamed (%.1f s)", time.perf_counter() - started)
            for table, name, kind, definition in constraints:  # keys and checks, then indexes, then foreign keys
                if kind != "f":
                    cursor.execute(sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} {}").format(
                        sql.Identifier(table), sql.Identifier(name), sql.SQL(definition)))  # fmt: skip
                    log.info("%s: %s (%.1f s)", table, name, time.perf_counter() - started)
            for name, definition in indexes:
                cursor.execute(definition)
                log.info("%s (%.1f s)", name, time.perf_counter() - started)
            for table, name, kind, definition in constraints:
                if kind == "f":
                    cursor.execute(sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} {}").format(
                        sql.Identifier(table), sql.Identifier(name), sql.SQL(definition)))  # fmt: skip
                    log.info("%s: %s, validated (%.1f s)", table, name, time.perf_counter() - started)
            for sequence, table, column in sequences:
                cursor.execute(sql.SQL("ALTER SEQUENCE {} OWNED BY {}.{}").format(
                    sql.SQL(sequence), sql.Identifier(table), sql.Identifier(column)))  # fmt: skip
            for table, comment in comments:
                cursor.execute(sql.SQL("COMMENT ON TABLE {} IS {}").format(sql.Identifier(table), sql.Literal(comment)))
            for _, name, definition, options, comment, _, column_comments in ordered:
                with_options = sql.SQL(" WITH ({})").format(sql.SQL(", ".join(options))) if options else sql.SQL("")
                cursor.execute(sql.SQL("CREATE VIEW {}{} AS {}").format(sql.Identifier(name), with_options,
                                                                         sql.SQL(definition)))  # fmt: skip
                if comment is not None:
                    cursor.execute(sql.SQL("COMMENT ON VIEW {} IS {}").format(sql.Identifier(name),
                                                                               sql.Literal(comment)))  # fmt: skip
                for column, text in column_comments:
                    cursor.execute(sql.SQL("COMMENT ON COLUMN {}.{} IS {}").format(
                        sql.Identifier(name), sql.Identifier(column), sql.Literal(text)))  # fmt: skip
            log.info("views recreated; committing (%.1f s)", time.perf_counter() - started)
            connection.commit()
        with psycopg.connect(conninfo(url), autocommit=True) as connection:
            for table in HEAD_TABLES:  # a partitioned table's ANALYZE samples its partitions too
                connection.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(table)))
        log.info("%s: %s hash-partitioned by model_id into %d, analysed (%.1f s)", target, ", ".join(HEAD_TABLES),
                 partitions, time.perf_counter() - started)  # fmt: skip
    except BaseException:
        log.error("partitioning failed; dropping %s", target)
        with psycopg.connect(conninfo(admin), autocommit=True) as connection:
            connection.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(target)))
        raise
    return target


def explain(url: str) -> list[tuple[str, str, str]]:
    """``EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF)`` of five pages of ``GET /heads`` on the
    catalog at ``url``, warm (each statement run once before): a paper query, a cross-model query, a
    cross-model page deep in the catalog (the paper query on the first BERT-large model, synth-00001 at
    10^6; the deep cursor at the first BERT-large model past 89.6 % of the ids, synth-03500 at 10^6),
    and two cross-model pages that walk more models, from the middle (synth-02000 at 10^6).
    Then each statement 25 times planned every time and 25 times prepared (psycopg's ``prepare=True``;
    the app's connections prepare a statement text from its 5th run), the median ms of the last 20,
    and whether PostgreSQL's plan cache chose its generic plan (it does after 5 custom ones when the
    generic plan's estimate is no worse; a generic plan prunes partitions at run time).
    Returns (label, query string, plan and timings) each."""
    from sqlalchemy import create_engine, text

    from service.heads.query import Cursor, HeadQuery, page_sql

    engine = create_engine(url)
    with engine.connect() as connection:
        models = connection.execute(text("SELECT count(*) FROM models")).scalar_one()
        first, deep = (connection.execute(text("SELECT name FROM models WHERE id >= :k AND num_layers = 24 "
                                               "ORDER BY id LIMIT 1"), {"k": k}).scalar_one()
                       for k in (1, int(0.896 * models)))  # fmt: skip
        middle = connection.execute(text("SELECT name FROM models WHERE id >= :k ORDER BY id LIMIT 1"),
                                    {"k": int(0.512 * models)}).scalar_one()  # fmt: skip
        asked = (
            ("paper", f"model={first}&type=vertical&layer_gt=18", HeadQuery(models=[first], type="vertical",
                                                                            layer_gt=18)),
            ("cross", "num_layers_ge=24&type=vertical&layer_gt=18", HeadQuery(num_layers_ge=24, type="vertical",
                                                                              layer_gt=18)),
            ("cross, deep page", f"architecture=roberta&type=vertical&after=<{deep}, encoder, 3, 0>",
             HeadQuery(architectures=["roberta"], type="vertical", after=Cursor(deep, "encoder", 3, 0))),
            # two pages of the load's cross mix that walk more models (few heads each)
            ("cross, one head a layer", f"stack=encoder&type=dense&layer_ge=5&head=3&after=<{middle}, encoder, 3, 0>",
             HeadQuery(stack="encoder", type="dense", layer_ge=5, head=3, after=Cursor(middle, "encoder", 3, 0))),
            ("cross, by task", f"task=masked-lm&layer_le=3&type=diagonal&after=<{middle}, encoder, 3, 0>",
             HeadQuery(tasks=["masked-lm"], layer_le=3, type="diagonal", after=Cursor(middle, "encoder", 3, 0))),
        )  # fmt: skip
        out = []
        for label, shown, q in asked:
            statement, bind = page_sql(q)
            connection.execute(text(statement), bind).all()  # warm
            plan = connection.execute(text("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) " + statement), bind)
            compiled = text(statement).bindparams(**bind).compile(dialect=connection.dialect)
            raw = connection.connection.driver_connection
            assert raw is not None
            medians = []
            for prepare in (False, True):
                times = []
                for _ in range(25):
                    started = time.perf_counter()
                    raw.execute(compiled.string, compiled.params, prepare=prepare).fetchall()
                    times.append(1000 * (time.perf_counter() - started))
                medians.append(statistics.median(times[5:]))
            (plans,) = raw.execute("SELECT generic_plans, custom_plans FROM pg_prepared_statements").fetchall()
            raw.execute("DEALLOCATE ALL")
            timing = (f"median of 20 runs: {medians[0]:.2f} ms planned each time, {medians[1]:.2f} ms prepared "
                      f"(plan cache: {plans[0]} generic, {plans[1]} custom plans)")  # fmt: skip
            out.append((label, shown, "\n".join(r[0] for r in plan) + "\n" + timing))
        connection.rollback()
    engine.dispose()
    return out


def models_of(url: str) -> list[tuple[str, int, int]]:
    import psycopg

    from service.jobs.queue import conninfo

    with psycopg.connect(conninfo(url)) as connection:
        return [tuple(r) for r in connection.execute("SELECT name, num_layers, num_heads FROM models ORDER BY id")]


def queries(models: list[tuple[str, int, int]], count: int, seed: int = 1, mix: str = "both") -> list[str]:
    """The paper-style filters over random models (``model=X&type=vertical&layer_gt=N`` and its kin)
    and, with ``mix`` cross or both, the cross-model ones (``num_layers_ge=24&type=vertical&layer_gt=18``,
    ``architecture=roberta``, ``task=...``, ``stack=encoder``), each starting at a random point of the
    catalog through an ``after=`` cursor as a client deep in its pages would."""
    from service.heads.query import Cursor

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        name, layers, heads = rng.choice(models)
        kind = rng.random()
        t = rng.choice(TYPES)
        if mix == "cross" or (mix == "both" and kind < 0.5):
            kind = rng.random()
            if kind < 0.4:
                q = "num_layers_ge=24&type=vertical&layer_gt=18"
            elif kind < 0.6:
                q = f"architecture={rng.choice(ARCHITECTURES[2:])}&type={t}"
            elif kind < 0.8:
                q = f"task={rng.choice(TASKS[2:])}&layer_le=3&type={t}"
            else:
                q = f"stack=encoder&type={t}&layer_ge={rng.randrange(12)}&head={rng.randrange(12)}"
            after = Cursor(name, "encoder", rng.randrange(layers), rng.randrange(heads)).encode()
            out.append(f"/heads?{q}&limit=100&after={after}")
            continue
        if kind < 0.4:
            q = f"model={name}&type={t}&layer_gt={rng.randrange(layers)}"
        elif kind < 0.6:
            q = f"model={name}&type={t}&layer_le={rng.randrange(layers)}"
        elif kind < 0.8:
            lo = rng.randrange(layers)
            q = f"model={name}&layer_ge={lo}&layer_lt={rng.randint(lo + 1, layers)}"
        elif kind < 0.9:
            q = f"model={name}&head={rng.randrange(heads)}"
        else:
            q = f"model={name}&type={t}"
        out.append(f"/heads?{q}")
    return out


def drive(
    targets: list[tuple[str, list[str]]], duration: float, connections: int, profile: bool
) -> list[dict[str, Any]]:
    """Closed loop: each connection sends its next request when the last one is answered.

    With several targets (``(base URL, paths)``, one per served catalog), every connection takes them
    in turn, request by request, so that each sees the same seconds of the machine: a load that
    comes and goes on a shared host moves all of them alike, and their ratios compare like with like.
    One result per target.
    """
    import threading

    import httpx

    latencies: list[list[float]] = [[] for _ in targets]
    timings: list[list[dict[str, float]]] = [[] for _ in targets]
    errors: list[list[str]] = [[] for _ in targets]
    lock = threading.Lock()
    deadline = time.perf_counter() + duration
    position = iter(range(min(len(paths) for _, paths in targets)))
    headers = {"X-Headcat-Timing": "1"} if profile else {}

    def run() -> None:
        clients = [httpx.Client(base_url=base, timeout=10, headers=headers) for base, _ in targets]
        try:
            for client in clients:
                client.get("/health")
            while time.perf_counter() < deadline:
                with lock:
                    i = next(position, None)
                if i is None:
                    return
                for t, client in enumerate(clients):
                    path = targets[t][1][i]
                    start = time.perf_counter()
                    try:
                        response = client.get(path)
                        ok = response.status_code == 200 and "items" in response.json()
                    except httpx.HTTPError as error:
                        response, ok = None, False
                        with lock:
                            errors[t].append(repr(error))
                    elapsed = time.perf_counter() - start
                    with lock:
                        latencies[t].append(elapsed)
                        if response is not None and not ok:
                            errors[t].append(f"{response.status_code} {path}: {response.text[:200]}")
                        if profile and response is not None and "X-Headcat-Timing" in response.headers:
                            timings[t].append(json.loads(response.headers["X-Headcat-Timing"]))
        finally:
            for client in clients:
                client.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=run) for _ in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return [summarize(latencies[t], timings[t], errors[t], wall) for t in range(len(targets))]


def summarize(
    latencies: list[float], timings: list[dict[str, float]], errors: list[str], wall: float
) -> dict[str, Any]:
    """requests/s, latency percentiles, errors, and the server's split of its time (mean and p99 of each part)."""
    ordered = sorted(latencies)

    def pct(p: float) -> float:
        return 1000 * ordered[min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1)]

    result: dict[str, Any] = {
        "requests": len(ordered),
        "seconds": round(wall, 1),
        "rps": round(len(ordered) / wall, 1),
        "p50_ms": round(pct(50), 2),
        "p90_ms": round(pct(90), 2),
        "p99_ms": round(pct(99), 2),
        "max_ms": round(1000 * ordered[-1], 2),
        "mean_ms": round(1000 * statistics.fmean(ordered), 2),
        "errors": len(errors),
        "first_errors": errors[:3],
    }
    if timings:
        for part in timings[0]:
            values = sorted(t[part] for t in timings)
            unit = "" if part == "statements" else "_ms"  # a count, not a duration
            result[f"server_{part}_mean{unit}"] = round(statistics.fmean(values), 2)
            result[f"server_{part}_p99{unit}"] = round(values[math.ceil(0.99 * len(values)) - 1], 2)
    return result


SERVER = """
import sys, time, json, uvicorn
from sqlalchemy import event
from service.app import create_app
from service.db import get_engine
url, port, profile = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
engine = get_engine(url)
app = create_app(engine)
if profile:  # X-Headcat-Timing: where a request's time goes inside the app
    import contextvars
    import fastapi.routing as routing
    box = contextvars.ContextVar("box", default=None)  # copied into the threadpool with the context

    def add(part, seconds):
        b = box.get()
        if b is not None:
            b[part] = b.get(part, 0.0) + 1000 * seconds

    @event.listens_for(engine, "before_cursor_execute")
    def _before(conn, cursor, statement, parameters, context, executemany):
        context._bench_started = time.perf_counter()

    @event.listens_for(engine, "after_cursor_execute")
    def _after(conn, cursor, statement, parameters, context, executemany):
        add("sql", time.perf_counter() - context._bench_started)
        add("statements", 0.001)  # add() counts in ms: one statement = 1

    run_endpoint, serialize = routing.run_endpoint_function, routing.serialize_response

    async def timed_endpoint(**kwargs):
        started = time.perf_counter()
        try:
            return await run_endpoint(**kwargs)
        finally:
            add("endpoint", time.perf_counter() - started)

    async def timed_serialize(**kwargs):
        started = time.perf_counter()
        try:
            return await serialize(**kwargs)
        finally:
            add("serialize", time.perf_counter() - started)

    routing.run_endpoint_function, routing.serialize_response = timed_endpoint, timed_serialize

    class Timing:  # pure ASGI, so that the measuring adds next to nothing to what it measures
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http" or (b"x-headcat-timing", b"1") not in scope["headers"]:
                await self.app(scope, receive, send)
                return
            b = {}
            box.set(b)
            started = time.perf_counter()

            async def timed_send(message):
                if message["type"] == "http.response.start":
                    total = 1000 * (time.perf_counter() - started)
                    sql, endpoint, ser = b.get("sql", 0.0), b.get("endpoint", 0.0), b.get("serialize", 0.0)
                    split = json.dumps({
                        "total": total, "sql": sql, "statements": round(b.get("statements", 0.0)),
                        "python_in_endpoint": endpoint - sql, "validate_and_serialize": ser,
                        "dependencies_and_framework": total - endpoint - ser})
                    message["headers"] = [*message.get("headers", []), (b"x-headcat-timing", split.encode())]
                await send(message)

            await self.app(scope, receive, timed_send)

    app.add_middleware(Timing)
loop, http = ("auto", "auto") if sys.argv[4] == "auto" else ("asyncio", "h11")
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, loop=loop, http=http)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--server-url", default=os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    parser.add_argument("--heads", type=int, default=1_000_000)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--connections", type=int, nargs="+", default=[1], help="one run per value")
    parser.add_argument(
        "--mix",
        choices=("paper", "cross", "both"),
        default="both",
        help="the paper's per-model filters, the cross-model ones, or half and half",
    )
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of requests before measuring")
    parser.add_argument("--profile", action="store_true", help="the server's own split: SQL, validation, rest")
    parser.add_argument("--keep", action="store_true", help="keep the scratch database")
    parser.add_argument("--reuse", nargs="+", help="existing scratch databases (--keep) to drive in turn, no fill")
    parser.add_argument("--fill-only", action="store_true", help="fill (and keep) the database, serve nothing")
    parser.add_argument(
        "--paired",
        nargs=2,
        metavar=("DB_A", "DB_B"),
        help="serve two kept catalogs at once and drive them request by request in turn: their ratios "
        "(p99 of B over A) come from the same seconds of the machine",
    )
    parser.add_argument(
        "--prewarm",
        action="store_true",
        help="read every relation of the driven catalogs into the OS page cache first (pg_prewarm, 'read' mode): "
        "the state of a catalog server whose memory holds its tables; without it, what is not cached comes from disk",
    )
    parser.add_argument(
        "--server-stack",
        choices=("auto", "asyncio-h11"),
        default="auto",
        help="uvicorn's event loop and HTTP parser: auto (uvloop and httptools, headcat's dependencies) "
        "or the pure-Python asyncio and h11, to measure what the first pair saves",
    )
    parser.add_argument(
        "--partition",
        metavar="SRC_DB",
        help="copy the kept catalog SRC_DB to SRC_DB_pN, its head tables hash-partitioned by model_id",
    )
    parser.add_argument("--partitions", type=int, default=16, help="N for --partition")
    parser.add_argument(
        "--explain",
        nargs="+",
        metavar="DB",
        help="EXPLAIN (ANALYZE, BUFFERS) of a paper page and four cross-model ones, per DB",
    )
    parser.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)  # internal: the client, spec on stdin
    args = parser.parse_args()

    if args.drive:
        spec = json.loads(sys.stdin.read())
        results = drive([tuple(t) for t in spec["targets"]], spec["duration"], spec["connections"], spec["profile"])
        sys.stdout.write(json.dumps(results) + "\n")
        return

    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from service import db

    server_url = db.sqlalchemy_url(args.server_url)
    if args.partition:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        target = partition(server_url, args.partition, args.partitions)
        print(f'Partitioned copy {target}: --reuse {args.partition} {target}; drop it with DROP DATABASE "{target}"')
        return
    if args.explain:
        for name in args.explain:
            for label, shown, plan in explain(make_url(server_url).set(database=name).render_as_string(False)):
                print(f"\n== {name}: {label}: {shown}\n{plan}")
        return
    if args.paired:
        urls = [make_url(server_url).set(database=name).render_as_string(hide_password=False) for name in args.paired]
        print_rows(
            serve_and_drive(
                args, [catalog(name, url, models_of(url)) for name, url in zip(args.paired, urls, strict=True)]
            )
        )
        return
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    rows: list[str] = []
    try:
        for name in args.reuse or [f"headcat_load_{uuid.uuid4().hex[:8]}"]:
            url = make_url(server_url).set(database=name).render_as_string(hide_password=False)
            fresh, keep = not args.reuse, args.keep or args.fill_only
            if fresh:
                with admin.connect() as connection:
                    connection.execute(text(f'CREATE DATABASE "{name}"'))
            try:
                if fresh:
                    db.upgrade(url)
                    print(f"Filling {name} with {args.heads} heads ...")
                    models = fill(url, args.heads)
                else:
                    models = models_of(url)
                described = catalog(name, url, models)
                if not args.fill_only:
                    rows.extend(serve_and_drive(args, [described]))
            except BaseException:
                keep = False  # a half-filled catalog is of no use
                raise
            finally:
                if fresh and keep:
                    print(f"Kept the database {name}: --reuse {name}")
                elif fresh:
                    _drop(admin, name)
    finally:
        admin.dispose()
    print_rows(rows)


def catalog(name: str, url: str, models: list[tuple[str, int, int]]) -> tuple[str, list[tuple[str, int, int]], int]:
    """``(url, models, heads)`` of a catalog, said on the way."""
    heads = sum(layers * per_layer for _, layers, per_layer in models)
    print(f"Catalog {name}: {len(models)} models, {heads} heads")
    return url, models, heads


def print_rows(rows: list[str]) -> None:
    if rows:
        print("\n| heads | queries | connections | requests/s | p50 | p99 | errors | server / SQL per request |")
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(rows))


def _drop(admin: Any, name: str) -> None:
    from sqlalchemy import text

    from service import db

    db.get_engine.cache_clear()
    with admin.connect() as connection:
        connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def prewarm(url: str) -> None:
    """Read the catalog's tables, indexes and TOAST into the OS page cache (``pg_prewarm``, which
    ships with PostgreSQL's contrib modules; the extension is created in the catalog if missing)."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    started = time.perf_counter()
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            connection.execute(text("CREATE EXTENSION IF NOT EXISTS pg_prewarm"))
            pages = connection.execute(
                text(
                    "SELECT coalesce(sum(pg_prewarm(c.oid, 'read')), 0) FROM pg_class c "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE n.nspname IN ('public', 'pg_toast') AND c.relkind IN ('r', 'i', 't', 'm')"
                )
            ).scalar_one()
    finally:
        engine.dispose()
    name = make_url(url).database
    print(f"Prewarmed {name}: {pages:,} pages ({pages * 8 / 1024**2:.1f} GiB) in {time.perf_counter() - started:.0f} s")


def serve_and_drive(args: argparse.Namespace, catalogs: list[tuple[str, list[tuple[str, int, int]], int]]) -> list[str]:
    """Serve each catalog (``(url, models, heads)``) in a server process of its own and drive them
    together (:func:`drive`) at each of ``args.connections``; one summary line per catalog and run,
    and with two catalogs a line of their ratios."""
    import httpx

    if args.prewarm:
        for url, _, _ in catalogs:
            prewarm(url)
    servers, bases = [], []
    for url, _, _ in catalogs:
        port = free_port()
        servers.append(
            subprocess.Popen(
                [sys.executable, "-c", SERVER, url, str(port), "1" if args.profile else "0", args.server_stack],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
        )
        bases.append(f"http://127.0.0.1:{port}")
    lines = []
    try:
        for base in bases:
            for _ in range(100):
                try:
                    if httpx.get(base + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
        for connections in args.connections:
            if args.warmup:
                warm = {"targets": [[base, queries(models, 5000, seed=2, mix=args.mix)]
                                    for base, (_, models, _) in zip(bases, catalogs, strict=True)],
                        "duration": args.warmup, "connections": connections, "profile": False}  # fmt: skip
                subprocess.run([sys.executable, __file__, "--drive"], input=json.dumps(warm), check=True,
                               capture_output=True, text=True)  # fmt: skip
            spec = {"targets": [[base, queries(models, args.requests, mix=args.mix)]
                                for base, (_, models, _) in zip(bases, catalogs, strict=True)],
                    "duration": args.duration, "connections": connections, "profile": args.profile}  # fmt: skip
            print(f"Driving GET /heads ({args.mix}) of {len(bases)} catalog(s) for {args.duration:.0f} s over "
                  f"{connections} connection(s) ...")  # fmt: skip
            done = subprocess.run([sys.executable, __file__, "--drive"], input=json.dumps(spec), check=True,
                                  capture_output=True, text=True)  # fmt: skip
            results = json.loads(done.stdout)
            for (_, _, heads), r in zip(catalogs, results, strict=True):
                print(json.dumps(r, indent=2))
                line = (f"| {heads:,} | {args.mix} | {connections} | {r['rps']} | {r['p50_ms']} ms | {r['p99_ms']} ms "
                        f"| {r['errors']} |")  # fmt: skip
                if "server_total_mean_ms" in r:
                    ratio = r["server_total_mean_ms"] / max(r["server_sql_mean_ms"], 1e-9)
                    line += (f" {r['server_total_mean_ms']} ms / {r['server_sql_mean_ms']} ms SQL "
                             f"({r['server_statements_mean']} statements) = {ratio:.2f}x |")  # fmt: skip
                lines.append(line)
            if len(results) == 2:
                a, b = results
                lines.append(f"| B / A | | {connections} | | {b['p50_ms'] / a['p50_ms']:.2f}x "
                             f"| **{b['p99_ms'] / a['p99_ms']:.2f}x** | | |")  # fmt: skip
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=30)
    return lines


if __name__ == "__main__":
    main()
