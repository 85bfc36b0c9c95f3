"""The run each model serves, per lens, decided once: ``models.current_<lens>_run_id``.

- ``models`` gains ``current_feature_run_id``, ``current_detection_run_id``,
  ``current_importance_run_id``, ``current_attribution_run_id`` and ``current_syntax_run_id``, and
  ``clusterings`` gains ``current_stability_run_id`` (a stability run belongs to a clustering, which
  may span models), as ``models.current_clustering_id`` already was for clusterings. A run becomes
  current when its job completes; the user can choose an earlier one (``PUT
  /models/{name}/current/{lens}``, ``headcat current``); an import makes its run current only when it
  is newer (``service/current.py``). Each is backfilled with the latest complete run (the highest
  id), which is what every read served before this revision.
- The views that served "the latest complete run" (``head_importance``, ``head_attribution``,
  ``head_syntax``, ``head_detections``, and ``head_types.agreement``) read these columns instead.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-28 10:00:00.000000
"""

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _comment(lens: str, path: str) -> str:
    return (
        f"the {lens} run served (GET /heads, the views, the page, exports): the latest to complete, "
        f"one chosen with PUT {path}, or an imported newer one"
    )


# models column -> (run table, comment)
MODEL_COLUMNS: dict[str, tuple[str, str]] = {
    "current_feature_run_id": ("feature_runs", _comment("feature", "/models/{name}/current/features")),
    "current_detection_run_id": ("detection_runs", _comment("detection", "/models/{name}/current/detections")),
    "current_importance_run_id": ("importance_runs", _comment("importance", "/models/{name}/current/importance")),
    "current_attribution_run_id": ("attribution_runs", _comment("attribution", "/models/{name}/current/attribution")),
    "current_syntax_run_id": ("syntax_runs", _comment("syntax", "/models/{name}/current/syntax")),
}
STABILITY_COMMENT = _comment("stability", "/models/{name}/current/stability")


def _revision(stem: str) -> ModuleType:
    """An earlier revision's module, for the text of the views it created (those files do not change)."""
    path = next(Path(__file__).parent.glob(f"*-{stem}.py"))
    spec = importlib.util.spec_from_file_location(f"headcat_revision_{stem}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _replace(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


# view -> (the text 0013 left, "VIEW name AS ..."), and the condition that picked the latest run -> the current one
_LATEST = {
    "head_importance": ("WHERE r.status = 'complete'", "WHERE r.id = m.current_importance_run_id"),
    "head_attribution": (
        "WHERE r.id = (SELECT max(r2.id) FROM attribution_runs r2 WHERE r2.model_id = r.model_id AND r2.status = "
        "'complete')",
        "WHERE r.id = m.current_attribution_run_id",
    ),
    "head_syntax": (
        "WHERE r.id = (SELECT max(r2.id) FROM syntax_runs r2 WHERE r2.model_id = r.model_id AND r2.status = "
        "'complete')",
        "WHERE r.id = m.current_syntax_run_id",
    ),
    "head_detections": (
        "WHERE r.id = (SELECT max(r2.id) FROM detection_runs r2 WHERE r2.model_id = r.model_id AND r2.status = "
        "'complete')",
        "WHERE r.id = m.current_detection_run_id",
    ),
    "head_types": (
        "(SELECT max(sr.id) FROM stability_runs sr\n                                     WHERE sr.clustering_id = "
        "a.clustering_id)",
        "(SELECT cs.current_stability_run_id FROM clusterings cs WHERE cs.id = a.clustering_id)",
    ),
}

# view -> (its comment now, before)
_COMMENTS = {
    "head_importance": (
        "each head''s scores in its model''s current importance run (SPEC 7)",
        "each head''s latest complete importance scores (SPEC 7)",
    ),
    "head_attribution": (
        "each head of each model''s current attribution run: discrepancy and the global (attribution) features by name",
        "each head of each model''s latest complete attribution run: discrepancy and the global (attribution) "
        "features by name",
    ),
    "head_syntax": (
        "each head, relation and direction of each model''s current syntax run, with the relation''s fixed-offset "
        "baseline",
        "each head, relation and direction of each model''s latest complete syntax run, with the relation''s "
        "fixed-offset baseline",
    ),
    "head_detections": (
        "each head of each model''s current detection run: induction, duplicate_token, previous_token and sink "
        "scores, its roles and the run''s thresholds (SPEC 10)",
        "each head of each model''s latest complete detection run: induction, duplicate_token, previous_token and "
        "sink scores, its roles and the run''s thresholds (SPEC 10)",
    ),
}


def views_before() -> dict[str, str]:
    """Each view this revision changes, as ``VIEW name AS ...`` the way revision 0013 left it."""
    colocated = _revision("0009_model_id_on_every_head_table")
    views = {}
    for name, text in colocated._views().items():
        if name in ("head_importance", "head_attribution", "head_syntax"):
            for join in colocated._JOINS[name]:
                text = _replace(text, join, colocated._colocated(join))
            views[name] = text
    detections = _revision("0010_detections").VIEWS[0].strip()
    views["head_detections"] = detections.removeprefix("CREATE ")
    views["head_types"] = _revision("0012_head_confidence")._head_types_0012().strip().removeprefix("CREATE ")
    return views


def views_after() -> dict[str, str]:
    return {name: _replace(text, *_LATEST[name]) for name, text in views_before().items()}


def upgrade() -> None:
    for column, (table, comment) in MODEL_COLUMNS.items():
        op.add_column("models", sa.Column(column, sa.Integer(), nullable=True, comment=comment))
        op.create_foreign_key(f"fk_models_{column}_{table}", "models", table, [column], ["id"], ondelete="SET NULL")
        op.create_index(f"ix_models_{column}", "models", [column])
        op.execute(
            f"UPDATE models m SET {column} = "
            f"(SELECT max(r.id) FROM {table} r WHERE r.model_id = m.id AND r.status = 'complete')"
        )
    op.add_column(
        "clusterings", sa.Column("current_stability_run_id", sa.Integer(), nullable=True, comment=STABILITY_COMMENT)
    )
    op.create_foreign_key("fk_clusterings_current_stability_run_id_stability_runs", "clusterings", "stability_runs",
                          ["current_stability_run_id"], ["id"], ondelete="SET NULL")  # fmt: skip
    op.create_index("ix_clusterings_current_stability_run_id", "clusterings", ["current_stability_run_id"])
    op.execute("UPDATE clusterings c SET current_stability_run_id = "
               "(SELECT max(r.id) FROM stability_runs r WHERE r.clustering_id = c.id)")  # fmt: skip
    for name, text in views_after().items():
        op.execute(f"CREATE OR REPLACE {text}")
        if name in _COMMENTS:
            op.execute(f"COMMENT ON VIEW {name} IS '{_COMMENTS[name][0]}'")


def downgrade() -> None:
    for name, text in views_before().items():
        op.execute(f"CREATE OR REPLACE {text}")
        if name in _COMMENTS:
            op.execute(f"COMMENT ON VIEW {name} IS '{_COMMENTS[name][1]}'")
    op.drop_index("ix_clusterings_current_stability_run_id", table_name="clusterings")
    op.drop_constraint("fk_clusterings_current_stability_run_id_stability_runs", "clusterings", type_="foreignkey")
    op.drop_column("clusterings", "current_stability_run_id")
    for column, (table, _) in MODEL_COLUMNS.items():
        op.drop_index(f"ix_models_{column}", table_name="models")
        op.drop_constraint(f"fk_models_{column}_{table}", "models", type_="foreignkey")
        op.drop_column("models", column)
