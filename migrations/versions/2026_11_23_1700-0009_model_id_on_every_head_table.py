"""Every head table carries ``model_id`` and leads its primary key with it: the distribution column.

A head belongs to one model for its life, so ``model_id`` is the column by which Citus
(``create_distributed_table(..., 'model_id')``, co-located) or native ``PARTITION BY HASH
(model_id)`` can take every head table as it is (README, "Scaling out"):

- ``heads``: primary key ``(model_id, id)`` (a partitioned table's unique constraints must hold
  the partition key), a plain index on ``id`` for lookups by id; ``uq (model_id, stack, layer,
  head)`` as before.
- ``head_features``, ``head_assignments``, ``stability_heads``, ``importance_scores``,
  ``head_attributions``, ``head_syntax_scores``: ``model_id`` (NOT NULL, backfilled from
  ``heads``) leads the primary key; the foreign key to ``heads`` is ``(model_id, head_id) ->
  heads (model_id, id)`` ON DELETE CASCADE; the per-head index is ``(model_id, head_id)``
  (``importance_scores``: ``(model_id, head_id, run_id)``; ``head_syntax_scores``: none, as
  before, its primary key serves the probes, which know the run). ``stability_heads`` gains an
  index on ``stability_run_id`` (a joint clustering's run spans models); ``head_assignments``
  keeps ``(clustering_id, cluster_id)`` and ``head_syntax_scores`` its relation index.
- The views join on both columns (``x.model_id = h.model_id AND x.head_id = h.id``): co-located
  joins. Their columns are unchanged.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23 17:00:00.000000
"""

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# table -> (primary key before this revision, its per-head index before: (name, columns) or None)
_BEFORE: dict[str, tuple[list[str], tuple[str, list[str]] | None]] = {
    "head_features": (["feature_run_id", "head_id"], ("ix_head_features_head_id", ["head_id"])),
    "head_assignments": (["clustering_id", "head_id"], ("ix_head_assignments_head_id", ["head_id"])),
    "stability_heads": (["stability_run_id", "head_id"], None),
    "importance_scores": (["run_id", "head_id"], ("ix_importance_scores_head_id", ["head_id", "run_id"])),
    "head_attributions": (["attribution_run_id", "head_id"], ("ix_head_attributions_head_id", ["head_id"])),
    "head_syntax_scores": (["syntax_run_id", "head_id", "relation", "direction"], None),
}
# table -> its per-head index from this revision (name, columns) or None
_AFTER_INDEX: dict[str, tuple[str, list[str]] | None] = {
    "head_features": ("ix_head_features_model_id_head_id", ["model_id", "head_id"]),
    "head_assignments": ("ix_head_assignments_model_id_head_id", ["model_id", "head_id"]),
    "stability_heads": ("ix_stability_heads_stability_run_id", ["stability_run_id"]),
    "importance_scores": ("ix_importance_scores_model_id_head_id", ["model_id", "head_id", "run_id"]),
    "head_attributions": ("ix_head_attributions_model_id_head_id", ["model_id", "head_id"]),
    "head_syntax_scores": None,  # the primary key (model_id, syntax_run_id, head_id, ...) serves its probes
}


def _revision(stem: str) -> ModuleType:
    """An earlier revision's module, for the text of the views it created (those files do not change)."""
    path = next(Path(__file__).parent.glob(f"*-{stem}.py"))
    spec = importlib.util.spec_from_file_location(f"headcat_revision_{stem}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# (the view as the earlier revision wrote it, and the join conditions this revision adds to it)
_JOINS: dict[str, tuple[str, ...]] = {
    "head_types": (
        "JOIN heads h ON h.id = a.head_id",
        "JOIN head_features f ON f.feature_run_id = a.feature_run_id AND f.head_id = a.head_id",
    ),
    "head_importance": ("JOIN heads h ON h.id = s.head_id",),
    "head_attribution": ("JOIN heads h ON h.id = a.head_id",),
    "head_syntax": ("JOIN heads h ON h.id = s.head_id",),
}


def _colocated(join: str) -> str:
    """``JOIN heads h ON h.id = a.head_id`` -> ``... ON h.model_id = a.model_id AND h.id = a.head_id``."""
    table_alias, condition = join.split(" ON ", 1)
    left, right = (side.split(".")[0] for side in condition.split(" AND ")[-1].split(" = "))
    return f"{table_alias} ON {left}.model_id = {right}.model_id AND {condition}"


def _views() -> dict[str, str]:
    """Each view's CREATE statement as before this revision (without the CREATE)."""
    stacks, importance = _revision("0005_stacks"), _revision("0006_importance")
    attribution = _revision("0007_attribution_and_syntax")
    statements = [stacks._head_types_view(with_stack=True), importance.HEAD_IMPORTANCE_VIEW, *attribution.VIEWS]
    views = {}
    for statement in statements:
        text = statement.strip()
        if text.startswith("CREATE VIEW"):
            name = text.split()[2]
            views[name] = text.removeprefix("CREATE ")
    return views


def _replace_views(colocated: bool) -> None:
    for name, text in _views().items():
        for join in _JOINS.get(name, ()):
            assert join in text, (name, join)
            if colocated:
                text = text.replace(join, _colocated(join))
        if name in _JOINS:
            op.execute(f"CREATE OR REPLACE {text}")


def upgrade() -> None:
    for table in _BEFORE:
        op.add_column(table, sa.Column("model_id", sa.Integer(), nullable=True))
        op.execute(f"UPDATE {table} x SET model_id = h.model_id FROM heads h WHERE h.id = x.head_id")
        op.alter_column(table, "model_id", nullable=False)
        op.drop_constraint(f"fk_{table}_head_id_heads", table, type_="foreignkey")
    op.drop_constraint("pk_heads", "heads", type_="primary")
    op.create_primary_key("pk_heads", "heads", ["model_id", "id"])
    op.create_index("ix_heads_id", "heads", ["id"])
    for table, (primary_key, index) in _BEFORE.items():
        if index is not None:
            op.drop_index(index[0], table_name=table)
        op.drop_constraint(f"pk_{table}", table, type_="primary")
        op.create_primary_key(f"pk_{table}", table, ["model_id", *primary_key])
        op.create_foreign_key(
            f"fk_{table}_model_id_heads",
            table,
            "heads",
            ["model_id", "head_id"],
            ["model_id", "id"],
            ondelete="CASCADE",
        )
        if (after := _AFTER_INDEX[table]) is not None:
            op.create_index(after[0], table, after[1])
    _replace_views(colocated=True)


def downgrade() -> None:
    _replace_views(colocated=False)
    for table, (primary_key, index) in _BEFORE.items():
        if (after := _AFTER_INDEX[table]) is not None:
            op.drop_index(after[0], table_name=table)
        op.drop_constraint(f"fk_{table}_model_id_heads", table, type_="foreignkey")
        op.drop_constraint(f"pk_{table}", table, type_="primary")
        op.create_primary_key(f"pk_{table}", table, primary_key)
        if index is not None:
            op.create_index(index[0], table, index[1])
    op.drop_index("ix_heads_id", table_name="heads")
    op.drop_constraint("pk_heads", "heads", type_="primary")
    op.create_primary_key("pk_heads", "heads", ["id"])
    for table in _BEFORE:
        op.create_foreign_key(f"fk_{table}_head_id_heads", table, "heads", ["head_id"], ["id"], ondelete="CASCADE")
        op.drop_column(table, "model_id")
