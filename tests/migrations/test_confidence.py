"""Migration 0012: ``head_assignments.margin`` is backfilled from the stored vectors and centroids
(attention vectors for local clusterings, the attribution vectors of ``params.attribution_run_ids``
for global ones), ``stability_heads.agreement`` starts NULL, the head_types views gain both
columns; the downgrade gives the views back as they were."""

from __future__ import annotations

import json

import numpy as np
from alembic import command
from sqlalchemy import Connection, Engine, create_engine, text

from service import db
from tests.migrations.test_model_id import _fill, _insert, _snapshot


def _randomise(connection: Connection, rng: np.random.Generator) -> int:
    """Distinct vectors and centroids, and a global clustering of 3 clusters over every head whose
    assignments ignore geometry (so some margins are negative); returns its id."""
    for table, key in (("head_features", "feature_run_id"), ("head_attributions", "attribution_run_id")):
        for head_id, run in connection.execute(text(f"SELECT head_id, {key} FROM {table}")).all():
            connection.execute(
                text(f"UPDATE {table} SET vector = :v WHERE head_id = :h AND {key} = :r"),
                {"v": rng.random(7).tolist(), "h": head_id, "r": run},
            )
    for (cluster_id,) in connection.execute(text("SELECT id FROM clusters")).all():
        connection.execute(text("UPDATE clusters SET centroid = :c WHERE id = :i"), {"c": rng.random(7).tolist(),
                                                                                     "i": cluster_id})  # fmt: skip
    runs = [r for (r,) in connection.execute(text("SELECT id FROM attribution_runs ORDER BY id")).all()]
    clustering = _insert(connection, "clusterings", algorithm="kmeans", k=3, status="complete", num_heads=8)
    connection.execute(
        text("UPDATE clusterings SET vector = 'global', params = CAST(:p AS jsonb) WHERE id = :c"),
        {"p": json.dumps({"attribution_run_ids": runs}), "c": clustering},
    )
    clusters = [
        _insert(
            connection, "clusters", clustering_id=clustering, index=i, name=f"c{i}", centroid=rng.random(7).tolist()
        )
        for i in range(3)
    ]
    heads = connection.execute(text("SELECT model_id, head_id, feature_run_id FROM head_assignments")).all()
    for i, (model_id, head_id, run) in enumerate(heads):
        _insert(connection, "head_assignments", model_id=model_id, clustering_id=clustering, head_id=head_id,
                cluster_id=clusters[i % 3], feature_run_id=run)  # fmt: skip
    return int(clustering)


def _expected(connection: Connection) -> dict[tuple[int, int], float]:
    """(clustering, head) -> the margin by numpy from plain reads."""
    found = {}
    rows = connection.execute(
        text(
            "SELECT a.clustering_id, a.head_id, a.cluster_id, cl.vector, f.vector, at.vector FROM head_assignments a"
            " JOIN clusterings cl ON cl.id = a.clustering_id"
            " JOIN head_features f ON f.head_id = a.head_id AND f.feature_run_id = a.feature_run_id"
            " JOIN head_attributions at ON at.head_id = a.head_id"
        )
    ).all()
    for clustering, head, cluster, kind, local, global_ in rows:
        centroids: dict[int, list[float]] = dict(
            connection.execute(
                text("SELECT id, centroid FROM clusters WHERE clustering_id = :c"), {"c": clustering}
            ).all()
        )
        x = np.array(local if kind == "local" else global_)
        own = np.linalg.norm(x - np.array(centroids[cluster]))
        other = min(np.linalg.norm(x - np.array(c)) for i, c in centroids.items() if i != cluster)
        found[(clustering, head)] = float((other - own) / max(own, other))
    return found


def test_0012_backfills_margins_and_adds_the_view_columns(empty_database: str) -> None:
    db.upgrade(empty_database, "0009")
    engine: Engine = create_engine(empty_database)
    try:
        with engine.begin() as connection:
            _fill(connection)
            _randomise(connection, np.random.default_rng(0))
            before = _snapshot(connection)
            expected = _expected(connection)
        assert len(expected) == 16
        assert min(expected.values()) < 0 < max(expected.values())

        db.upgrade(empty_database, "0012")
        with engine.connect() as connection:
            got = {(c, h): m for c, h, m in connection.execute(
                text("SELECT clustering_id, head_id, margin FROM head_assignments"))}  # fmt: skip
            assert got.keys() == expected.keys()
            np.testing.assert_allclose([got[k] for k in expected], list(expected.values()), atol=1e-12)
            assert (
                connection.execute(text("SELECT count(*) FROM stability_heads WHERE agreement IS NOT NULL")).one()[0]
                == 0
            )
            view = connection.execute(text("SELECT head_id, clustering_id, margin, agreement FROM current_head_types"))
            rows = view.all()
            assert len(rows) == 8
            assert all(r.agreement is None and r.margin == got[(r.clustering_id, r.head_id)] for r in rows)
            connection.execute(text("UPDATE stability_heads SET agreement = 0.25"))
            assert {r[0] for r in connection.execute(text("SELECT agreement FROM head_types"))} == {0.25, None}

        command.downgrade(db.alembic_config(empty_database), "0009")
        with engine.connect() as connection:
            assert _snapshot(connection) == before
    finally:
        engine.dispose()
