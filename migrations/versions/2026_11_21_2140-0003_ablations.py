"""Ablations (SPEC section 4): shared baselines, runs (one per ablation job) and their outcomes (one per plan row).

Runs and outcomes are written in the job's final transaction only, so nothing here is half done;
``ablation_outcomes.types`` (GIN) answers "the outcomes that ablate vertical heads".

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21 21:40:40.043180
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "ablation_baselines",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("task", sa.String(length=16), nullable=False),
        sa.Column("data_key", sa.String(), nullable=False, comment="sha256:<hex> of the file, or hub:<spec>"),
        sa.Column("data_subset", sa.String(), nullable=True, comment="e.g. 'articles 24-47', 'spread'"),
        sa.Column("limit", sa.Integer(), nullable=True),
        sa.Column("max_length", sa.Integer(), nullable=False),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("n_examples", sa.Integer(), nullable=False),
        sa.Column("metrics", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("seconds", sa.Double(), nullable=False, comment="time of the unablated pass that measured it"),
        sa.Column("device", sa.String(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("task IN ('squad', 'glue', 'drift')", name=op.f("ck_ablation_baselines_task")),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_ablation_baselines_model_id_models"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ablation_baselines")),
        sa.UniqueConstraint(
            "model_id",
            "task",
            "data_key",
            "data_subset",
            "limit",
            "max_length",
            "dtype",
            name="uq_ablation_baselines_key",
            postgresql_nulls_not_distinct=True,
        ),
    )
    op.create_table(
        "ablation_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column(
            "clustering_id", sa.Integer(), nullable=True, comment="the head types; none for head/layer lists only"
        ),
        sa.Column("baseline_id", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("task", sa.String(length=16), nullable=False),
        sa.Column(
            "data_kind", sa.String(length=16), nullable=False, comment="squad | glue | jsonl | text | builtin | hub"
        ),
        sa.Column(
            "data_source",
            sa.String(),
            nullable=False,
            comment="absolute file path, builtin:NAME or hub:NAME[:CONFIG][:SPLIT]",
        ),
        sa.Column("data_sha256", sa.String(), nullable=True),
        sa.Column("data_subset", sa.String(), nullable=True),
        sa.Column(
            "data_size",
            sa.Integer(),
            nullable=False,
            comment="examples in the data (after the subset), before the limit",
        ),
        sa.Column("limit", sa.Integer(), nullable=True),
        sa.Column("n_examples", sa.Integer(), nullable=False, comment="examples evaluated"),
        sa.Column("plan", sa.String(length=16), nullable=False, comment="paper | custom"),
        sa.Column(
            "types",
            postgresql.JSONB(astext_type=sa.Text()),
            nullable=False,
            comment="head type -> number of the model's heads of it",
        ),
        sa.Column(
            "config",
            postgresql.JSONB(astext_type=sa.Text()),
            nullable=False,
            comment="the request: batch size, max length, device, ...",
        ),
        sa.Column("device", sa.String(), nullable=False),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("seconds", sa.Double(), nullable=False, comment="whole plan, model load and tokenization included"),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("status IN ('running', 'complete', 'failed')", name=op.f("ck_ablation_runs_status")),
        sa.CheckConstraint("task IN ('squad', 'glue', 'drift')", name=op.f("ck_ablation_runs_task")),
        sa.ForeignKeyConstraint(
            ["baseline_id"],
            ["ablation_baselines.id"],
            name=op.f("fk_ablation_runs_baseline_id_ablation_baselines"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["clustering_id"],
            ["clusterings.id"],
            name=op.f("fk_ablation_runs_clustering_id_clusterings"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_ablation_runs_model_id_models"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ablation_runs")),
    )
    op.create_index("ix_ablation_runs_model_latest", "ablation_runs", ["model_id", "id"], unique=False)
    op.create_table(
        "ablation_outcomes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("row_id", sa.String(length=200), nullable=False),
        sa.Column("label", sa.String(), nullable=False),
        sa.Column(
            "paper_ref", sa.String(length=32), nullable=True, comment="e.g. T2.3: Guan et al. 2020, Table 2, row 3"
        ),
        sa.Column("operations", postgresql.ARRAY(sa.String()), nullable=False, comment="operations the row applies"),
        sa.Column(
            "selection",
            postgresql.JSONB(astext_type=sa.Text()),
            nullable=False,
            comment="operation -> head selection rule",
        ),
        sa.Column(
            "spec",
            postgresql.JSONB(astext_type=sa.Text()),
            nullable=False,
            comment="the resolved AblationSpec: operation -> [layer, head]",
        ),
        sa.Column(
            "types", postgresql.ARRAY(sa.String()), nullable=False, comment="head types with at least one ablated head"
        ),
        sa.Column(
            "type_ops",
            postgresql.JSONB(astext_type=sa.Text()),
            nullable=False,
            comment="head type -> operation -> heads of it ablated",
        ),
        sa.Column("heads", sa.Integer(), nullable=False, comment="heads ablated"),
        sa.Column("metrics", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("baseline", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("n_examples", sa.Integer(), nullable=False),
        sa.Column("seconds", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["ablation_runs.id"], name=op.f("fk_ablation_outcomes_run_id_ablation_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ablation_outcomes")),
        sa.UniqueConstraint("run_id", "position", name=op.f("uq_ablation_outcomes_run_id_position")),
        sa.UniqueConstraint("run_id", "row_id", name=op.f("uq_ablation_outcomes_run_id_row_id")),
    )
    op.create_index("ix_ablation_outcomes_types", "ablation_outcomes", ["types"], unique=False, postgresql_using="gin")


def downgrade() -> None:
    op.drop_index("ix_ablation_outcomes_types", table_name="ablation_outcomes", postgresql_using="gin")
    op.drop_table("ablation_outcomes")
    op.drop_index("ix_ablation_runs_model_latest", table_name="ablation_runs")
    op.drop_table("ablation_runs")
    op.drop_table("ablation_baselines")
