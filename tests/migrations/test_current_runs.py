"""Migration 0014: each model's current run per lens (and each clustering's current stability run) is
backfilled with its latest complete run, so the views answer the same rows as before; from then on the
views read those columns (a run chosen over a newer one is what they serve); the downgrade gives the
views back as they were and drops the columns."""

from __future__ import annotations

from typing import Any

from alembic import command
from sqlalchemy import Connection, create_engine, text

from service import db
from tests.migrations.test_model_id import VIEWS, _fill, _insert

ALL_VIEWS = (*VIEWS, "head_detections")
LENS_COLUMNS = {
    "current_feature_run_id": "feature_runs",
    "current_importance_run_id": "importance_runs",
    "current_attribution_run_id": "attribution_runs",
    "current_syntax_run_id": "syntax_runs",
    "current_detection_run_id": "detection_runs",
}


def _views(connection: Connection) -> dict[str, Any]:
    return {
        view: sorted(map(repr, connection.execute(text(f"SELECT * FROM {view}")).mappings().all()))
        for view in ALL_VIEWS
    }


def _more_runs(connection: Connection) -> dict[str, int]:
    """For alpha: a second complete importance run (newer, other scores), a failed syntax run (the newest id, never
    served), a detection run; for the clustering a second stability run. Returns their ids."""
    alpha = connection.scalar(text("SELECT id FROM models WHERE name = 'alpha'"))
    heads = connection.scalars(text("SELECT id FROM heads WHERE model_id = :m ORDER BY id"), {"m": alpha}).all()
    clustering = connection.scalar(text("SELECT id FROM clusterings"))
    made = {
        "importance": _insert(connection, "importance_runs", model_id=alpha, status="complete", loss="lm"),
        "failed_syntax": _insert(
            connection, "syntax_runs", model_id=alpha, status="failed", stack="encoder", parses="gold"
        ),  # fmt: skip
        "detection": _insert(connection, "detection_runs", model_id=alpha, status="complete"),
        "stability": _insert(connection, "stability_runs", clustering_id=clustering, seeds=[2], score=0.9),
    }
    for i, head in enumerate(heads):
        _insert(connection, "importance_scores", model_id=alpha, run_id=made["importance"], head_id=head,
                raw=100.0 + i, normalized=100.0 + i)  # fmt: skip
        connection.execute(
            text("INSERT INTO head_detector_scores (model_id, detection_run_id, head_id, induction, roles, "
                 "example_map) VALUES (:m, :r, :h, :v, '{}', '{0}')"),
            {"m": alpha, "r": made["detection"], "h": head, "v": 0.1 * i},
        )  # fmt: skip
        _insert(connection, "stability_heads", model_id=alpha, stability_run_id=made["stability"], head_id=head,
                stable=True, agreement=0.5)  # fmt: skip
    return made


def test_0014_backfills_the_latest_complete_runs_and_the_views_read_them(empty_database: str) -> None:
    db.upgrade(empty_database, "0013")
    engine = create_engine(empty_database)
    try:
        with engine.begin() as connection:
            _fill(connection)
            made = _more_runs(connection)
            before = _views(connection)
        assert len(before["head_importance"]) == 8
        assert len(before["head_detections"]) == 4

        db.upgrade(empty_database, "0014")
        with engine.begin() as connection:
            assert _views(connection) == before
            for column, table in LENS_COLUMNS.items():
                rows = connection.execute(text(
                    f"SELECT m.{column}, (SELECT max(r.id) FROM {table} r WHERE r.model_id = m.id "
                    "AND r.status = 'complete') FROM models m")).all()  # fmt: skip
                assert all(current == latest for current, latest in rows), column
            alpha = connection.execute(text("SELECT * FROM models WHERE name = 'alpha'")).mappings().one()
            assert alpha["current_importance_run_id"] == made["importance"]
            assert alpha["current_syntax_run_id"] != made["failed_syntax"]
            assert alpha["current_syntax_run_id"] is not None
            assert alpha["current_detection_run_id"] == made["detection"]
            beta = connection.execute(text("SELECT * FROM models WHERE name = 'beta'")).mappings().one()
            assert beta["current_detection_run_id"] is None
            assert connection.scalar(text("SELECT current_stability_run_id FROM clusterings")) == made["stability"]

            # the views serve the chosen run, not the newest
            older = connection.scalar(
                text("SELECT min(id) FROM importance_runs WHERE model_id = :m"), {"m": alpha["id"]}
            )
            connection.execute(text("UPDATE models SET current_importance_run_id = :r WHERE name = 'alpha'"),
                               {"r": older})  # fmt: skip
            served = connection.execute(text("SELECT DISTINCT importance_run_id FROM head_importance "
                                             "WHERE model = 'alpha'")).scalars().all()  # fmt: skip
            assert served == [older]
            first = connection.scalar(text("SELECT min(id) FROM stability_runs"))
            connection.execute(text("UPDATE clusterings SET current_stability_run_id = :r"), {"r": first})
            agreements = connection.execute(
                text("SELECT DISTINCT agreement FROM current_head_types WHERE model = 'alpha'")
            ).scalars()
            assert list(agreements) == [None]  # the first run's heads have no agreement; the second's are 0.5

        command.downgrade(db.alembic_config(empty_database), "0013")
        with engine.connect() as connection:
            assert _views(connection) == before
            columns = connection.execute(text("SELECT * FROM models LIMIT 0")).keys()
            assert not any(column.startswith("current_") and column != "current_clustering_id" for column in columns)
            comment = connection.scalar(text("SELECT obj_description('head_importance'::regclass)"))
            assert "latest complete" in comment
    finally:
        engine.dispose()
