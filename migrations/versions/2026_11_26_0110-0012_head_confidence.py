"""Per-head confidence in a head's type: ``head_assignments.margin`` and ``stability_heads.agreement``.

- ``head_assignments.margin``: ``(d2 - d1) / max(d1, d2)`` with ``d1`` the Euclidean distance of the
  head's clustered vector to its own cluster's centroid and ``d2`` to the nearest other centroid
  (:func:`ingest.clustering.margins`): 1 on the centroid, 0 exactly between two, negative only
  where a mixture gave the head to a centroid that is not its nearest. Written by the clustering
  job; existing assignments are backfilled here from the stored vectors and centroids (the
  attention vectors of the assignment's feature run, or for ``vector = 'global'`` clusterings the
  attribution vectors of the runs in ``params.attribution_run_ids``).
- ``stability_heads.agreement``: the share of the stability run's R fits (aligned to the
  clustering's centroids) that give the head the clustering's type. Written by the stability
  job; NULL for runs stored before this revision (their per-fit labels were not kept).
- The ``head_types`` view (and ``current_head_types``) gain ``margin`` and ``agreement`` (that of
  the clustering's latest stability run) as their last columns.

Revision ID: 0012
Revises: 0009 (0010 and 0011 come from other branches; the chain is re-linked when they merge)
Create Date: 2026-11-26 01:10:00.000000
"""

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_MARGIN = (
    "(d2 - d1) / max(d1, d2): d1 = distance of the head to its own cluster's centroid, d2 = to the "
    "nearest other centroid; 1 on the centroid, 0 exactly between two"
)
_AGREEMENT = "share of the run's R fits (aligned to the clustering) that give the head the clustering's type"

# Every assignment's margin from the stored vectors and centroids, in SQL (one statement).
_BACKFILL = """
UPDATE head_assignments a SET margin = m.margin
FROM (
    SELECT d.model_id, d.clustering_id, d.head_id,
           CASE WHEN greatest(d.own, d.other) > 0
                THEN (d.other - d.own) / greatest(d.own, d.other) ELSE 0 END AS margin
    FROM (
        SELECT x.model_id, x.clustering_id, x.head_id,
               min(x.dist) FILTER (WHERE x.is_own) AS own,
               min(x.dist) FILTER (WHERE NOT x.is_own) AS other
        FROM (
            SELECT a.model_id, a.clustering_id, a.head_id, c.id = a.cluster_id AS is_own,
                   (SELECT sqrt(sum((u.x - u.y) * (u.x - u.y))) FROM unnest(hv.vector, c.centroid) AS u(x, y)) AS dist
            FROM head_assignments a
            JOIN clusterings cl ON cl.id = a.clustering_id
            JOIN LATERAL (
                SELECT f.vector FROM head_features f
                WHERE cl.vector = 'local' AND f.model_id = a.model_id AND f.feature_run_id = a.feature_run_id
                  AND f.head_id = a.head_id
                UNION ALL
                SELECT ha.vector FROM head_attributions ha
                WHERE cl.vector = 'global' AND ha.model_id = a.model_id AND ha.head_id = a.head_id
                  AND ha.attribution_run_id IN (
                      SELECT jsonb_array_elements_text(cl.params -> 'attribution_run_ids')::integer)
                LIMIT 1) hv ON true
            JOIN clusters c ON c.clustering_id = a.clustering_id
        ) x
        GROUP BY x.model_id, x.clustering_id, x.head_id
    ) d
    WHERE d.other IS NOT NULL
) m
WHERE a.model_id = m.model_id AND a.clustering_id = m.clustering_id AND a.head_id = m.head_id
"""

_CONFIDENCE_COLUMNS = """,
       a.margin,
       (SELECT sh.agreement FROM stability_heads sh
        WHERE sh.model_id = a.model_id AND sh.head_id = a.head_id
          AND sh.stability_run_id = (SELECT max(sr.id) FROM stability_runs sr
                                     WHERE sr.clustering_id = a.clustering_id)) AS agreement
FROM head_assignments a"""


def _revision(stem: str) -> ModuleType:
    """An earlier revision's module, for the text of the view it created (those files do not change)."""
    path = next(Path(__file__).parent.glob(f"*-{stem}.py"))
    spec = importlib.util.spec_from_file_location(f"headcat_revision_{stem}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _head_types_0009() -> str:
    """``VIEW head_types AS ...`` as revision 0009 left it (co-located joins)."""
    before = _revision("0009_model_id_on_every_head_table")
    text = before._views()["head_types"]
    for join in before._JOINS["head_types"]:
        assert join in text, join
        text = text.replace(join, before._colocated(join))
    return str(text)


def _head_types_0012() -> str:
    text = _head_types_0009().rstrip()
    assert text.count("\nFROM head_assignments a") == 1
    return text.replace("\nFROM head_assignments a", _CONFIDENCE_COLUMNS, 1)


def upgrade() -> None:
    op.add_column("head_assignments", sa.Column("margin", sa.Double(), nullable=True, comment=_MARGIN))
    op.add_column("stability_heads", sa.Column("agreement", sa.Double(), nullable=True, comment=_AGREEMENT))
    op.execute(_BACKFILL)
    op.execute(f"CREATE OR REPLACE {_head_types_0012()}")
    op.execute("CREATE OR REPLACE VIEW current_head_types AS SELECT * FROM head_types WHERE is_current")


def downgrade() -> None:
    op.execute("DROP VIEW current_head_types")
    op.execute("DROP VIEW head_types")
    op.execute(f"CREATE {_head_types_0009()}")
    op.execute("CREATE VIEW current_head_types AS SELECT * FROM head_types WHERE is_current")
    op.execute("COMMENT ON VIEW head_types IS 'one row per head and clustering: type and features by name'")
    op.execute("COMMENT ON VIEW current_head_types IS 'head_types for each model''s current clustering'")
    op.drop_column("stability_heads", "agreement")
    op.drop_column("head_assignments", "margin")
