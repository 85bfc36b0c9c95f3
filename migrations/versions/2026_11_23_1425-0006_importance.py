"""Head importance (SPEC section 7): importance runs with per-head raw and normalised scores,
pruning curves with their points and shared baseline, and the ``head_importance`` view.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 15:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_KINDS_BEFORE = "kind IN ('ingest', 'clustering', 'stability', 'ablation')"
_KINDS_AFTER = "kind IN ('ingest', 'clustering', 'stability', 'ablation', 'importance', 'pruning')"

HEAD_IMPORTANCE_VIEW = """
CREATE VIEW head_importance AS
SELECT DISTINCT ON (s.head_id)
       s.head_id,
       m.name AS model,
       h.stack,
       h.layer,
       h.head,
       s.normalized AS importance,
       s.raw AS importance_raw,
       r.id AS importance_run_id,
       r.loss,
       r.task,
       r.data_source,
       r.n_examples,
       r.finished_at,
       m.id AS model_id
FROM importance_scores s
JOIN importance_runs r ON r.id = s.run_id
JOIN heads h ON h.id = s.head_id
JOIN models m ON m.id = h.model_id
WHERE r.status = 'complete'
ORDER BY s.head_id, r.id DESC
"""


def upgrade() -> None:
    op.drop_constraint(op.f("ck_jobs_kind"), "jobs", type_="check")
    op.create_check_constraint(op.f("ck_jobs_kind"), "jobs", _KINDS_AFTER)

    op.create_table(
        "importance_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("loss", sa.String(length=16), nullable=False, comment="task | lm | sensitivity"),
        sa.Column("task", sa.String(length=16), nullable=True, comment="squad | glue (task loss); NULL otherwise"),
        sa.Column("data_kind", sa.String(length=16), nullable=False),
        sa.Column("data_source", sa.String(), nullable=False),
        sa.Column("data_sha256", sa.String(), nullable=True),
        sa.Column("data_subset", sa.String(), nullable=True),
        sa.Column("data_size", sa.Integer(), nullable=False),
        sa.Column("limit", sa.Integer(), nullable=True),
        sa.Column("n_examples", sa.Integer(), nullable=False, comment="examples scored (SQuAD: windows)"),
        sa.Column("seed", sa.Integer(), nullable=False, comment="MLM mask / Rademacher probes"),
        sa.Column("mean_loss", sa.Double(), nullable=True, comment="mean per-example loss; NULL for sensitivity"),
        sa.Column("config", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("device", sa.String(), nullable=False),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("seconds", sa.Double(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("status IN ('running', 'complete', 'failed')", name=op.f("ck_importance_runs_status")),
        sa.CheckConstraint("loss IN ('task', 'lm', 'sensitivity')", name=op.f("ck_importance_runs_loss")),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_importance_runs_model_id_models"), ondelete="CASCADE"
        ),  # fmt: skip
        sa.PrimaryKeyConstraint("id", name=op.f("pk_importance_runs")),
    )
    op.create_index("ix_importance_runs_model_latest", "importance_runs", ["model_id", "id"])
    op.create_table(
        "importance_scores",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("head_id", sa.BigInteger(), nullable=False),
        sa.Column("raw", sa.Double(), nullable=False, comment="mean over examples of |dLoss/dxi_h|"),
        sa.Column("normalized", sa.Double(), nullable=False, comment="raw / L2 norm of its layer's raw scores"),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["importance_runs.id"],
            name=op.f("fk_importance_scores_run_id_importance_runs"),
            ondelete="CASCADE",
        ),  # fmt: skip
        sa.ForeignKeyConstraint(
            ["head_id"], ["heads.id"], name=op.f("fk_importance_scores_head_id_heads"), ondelete="CASCADE"
        ),  # fmt: skip
        sa.PrimaryKeyConstraint("run_id", "head_id", name=op.f("pk_importance_scores")),
    )
    op.create_index("ix_importance_scores_head_id", "importance_scores", ["head_id", "run_id"])

    op.create_table(
        "pruning_curves",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("baseline_id", sa.Integer(), nullable=False),
        sa.Column("importance_run_id", sa.Integer(), nullable=True, comment="the scores the importance rankings used"),
        sa.Column("clustering_id", sa.Integer(), nullable=True, comment="the head types of the type ranking"),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("task", sa.String(length=16), nullable=False),
        sa.Column("metric", sa.String(length=32), nullable=False, comment="the metric the curves are drawn in"),
        sa.Column("rankings", postgresql.ARRAY(sa.String()), nullable=False),
        sa.Column("iterative", sa.Boolean(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("max_share", sa.Double(), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=False, comment="the random ranking's seed"),
        sa.Column("type_order", postgresql.ARRAY(sa.String()), nullable=False, comment="types pruned first to last"),
        sa.Column(
            "orders",
            postgresql.JSONB(astext_type=sa.Text()),
            nullable=False,
            comment="ranking -> [[layer, head], ...] in the order pruned",
        ),  # fmt: skip
        sa.Column(
            "baseline",
            postgresql.JSONB(astext_type=sa.Text()),
            nullable=False,
            comment="the shared unpruned metrics every point is measured against",
        ),  # fmt: skip
        sa.Column("data_kind", sa.String(length=16), nullable=False),
        sa.Column("data_source", sa.String(), nullable=False),
        sa.Column("data_sha256", sa.String(), nullable=True),
        sa.Column("data_subset", sa.String(), nullable=True),
        sa.Column("data_size", sa.Integer(), nullable=False),
        sa.Column("limit", sa.Integer(), nullable=True),
        sa.Column("n_examples", sa.Integer(), nullable=False),
        sa.Column("config", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("device", sa.String(), nullable=False),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("seconds", sa.Double(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("status IN ('running', 'complete', 'failed')", name=op.f("ck_pruning_curves_status")),
        sa.CheckConstraint("task IN ('squad', 'glue', 'drift')", name=op.f("ck_pruning_curves_task")),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_pruning_curves_model_id_models"), ondelete="CASCADE"
        ),  # fmt: skip
        sa.ForeignKeyConstraint(
            ["baseline_id"],
            ["ablation_baselines.id"],
            name=op.f("fk_pruning_curves_baseline_id_ablation_baselines"),
            ondelete="CASCADE",
        ),  # fmt: skip
        sa.ForeignKeyConstraint(
            ["importance_run_id"],
            ["importance_runs.id"],
            name=op.f("fk_pruning_curves_importance_run_id_importance_runs"),
            ondelete="SET NULL",
        ),  # fmt: skip
        sa.ForeignKeyConstraint(
            ["clustering_id"],
            ["clusterings.id"],
            name=op.f("fk_pruning_curves_clustering_id_clusterings"),
            ondelete="SET NULL",
        ),  # fmt: skip
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pruning_curves")),
    )
    op.create_index("ix_pruning_curves_model_latest", "pruning_curves", ["model_id", "id"])
    op.create_table(
        "pruning_points",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("curve_id", sa.Integer(), nullable=False),
        sa.Column("ranking", sa.String(length=32), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False, comment="0 is the shared baseline"),
        sa.Column("pruned", sa.Integer(), nullable=False, comment="heads pruned"),
        sa.Column("share", sa.Double(), nullable=False, comment="of all the model's heads"),
        sa.Column("metrics", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "heads",
            postgresql.JSONB(astext_type=sa.Text()),
            nullable=False,
            comment="[[layer, head], ...] pruned at this point",
        ),  # fmt: skip
        sa.Column("seconds", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["curve_id"],
            ["pruning_curves.id"],
            name=op.f("fk_pruning_points_curve_id_pruning_curves"),
            ondelete="CASCADE",
        ),  # fmt: skip
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pruning_points")),
        sa.UniqueConstraint("curve_id", "ranking", "step", name=op.f("uq_pruning_points_curve_id_ranking_step")),
    )
    op.execute(HEAD_IMPORTANCE_VIEW)
    op.execute("COMMENT ON VIEW head_importance IS 'each head''s latest complete importance scores (SPEC 7)'")


def downgrade() -> None:
    op.execute("DROP VIEW head_importance")
    op.drop_table("pruning_points")
    op.drop_index("ix_pruning_curves_model_latest", table_name="pruning_curves")
    op.drop_table("pruning_curves")
    op.drop_index("ix_importance_scores_head_id", table_name="importance_scores")
    op.drop_table("importance_scores")
    op.drop_index("ix_importance_runs_model_latest", table_name="importance_runs")
    op.drop_table("importance_runs")
    op.execute("DELETE FROM jobs WHERE kind IN ('importance', 'pruning')")
    op.drop_constraint(op.f("ck_jobs_kind"), "jobs", type_="check")
    op.create_check_constraint(op.f("ck_jobs_kind"), "jobs", _KINDS_BEFORE)
