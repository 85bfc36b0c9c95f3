"""Head detectors (SPEC 10): detection runs, per-head scores and roles, and the view that serves them.

- ``detection_runs``: a model's run on seeded repeated random sequences: its config (sequences,
  length, copies, seed, thresholds), the sequences' ids, the repeat gain of a causal LM and the
  causal check (the gain with each checked role's heads pruned).
- ``head_detector_scores``: per head of a run, induction, duplicate_token, previous_token and sink
  (NULL where the stack has no such score: cross attention's induction and duplicate), its roles,
  and the first sequence's map. ``model_id`` leads the primary key (the distribution column).
- ``head_detections``: each head of each model's latest complete detection run.
- ``jobs.kind`` gains ``detection``.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26 01:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KINDS = "'ingest', 'clustering', 'stability', 'ablation', 'attribution', 'syntax', 'importance', 'pruning'"

VIEWS = (
    """
CREATE VIEW head_detections AS
SELECT m.name AS model,
       h.stack,
       h.layer,
       h.head,
       s.induction,
       s.duplicate_token,
       s.previous_token,
       s.sink,
       s.roles,
       r.repeat_gain,
       r.config -> 'thresholds' AS thresholds,
       r.id AS detection_run_id,
       m.id AS model_id,
       h.id AS head_id
FROM head_detector_scores s
JOIN detection_runs r ON r.id = s.detection_run_id
JOIN heads h ON h.model_id = s.model_id AND h.id = s.head_id
JOIN models m ON m.id = h.model_id
WHERE r.id = (SELECT max(r2.id) FROM detection_runs r2 WHERE r2.model_id = r.model_id AND r2.status = 'complete')
""",
    "COMMENT ON VIEW head_detections IS 'each head of each model''s latest complete detection run: induction, "
    "duplicate_token, previous_token and sink scores, its roles and the run''s thresholds (SPEC 10)'",
)


def upgrade() -> None:
    op.create_table(
        "detection_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("config", postgresql.JSONB(astext_type=sa.Text()), nullable=False,
                  comment="sequences, length, copies, seed, batch_size, thresholds {detector: threshold}, device, "
                  "dtype"),
        sa.Column("sequences", postgresql.JSONB(astext_type=sa.Text()), nullable=False,
                  comment="ids [[...]] (every sequence, special tokens included), prefix, suffix, prefix_source, "
                  "pool_size"),
        sa.Column("num_sequences", sa.Integer(), nullable=False),
        sa.Column("num_tokens", sa.Integer(), nullable=False, comment="tokens per sequence, special tokens included"),
        sa.Column("loss_first", sa.Double(), nullable=True, comment="mean next-token loss on the first copy (nats)"),
        sa.Column("loss_later", sa.Double(), nullable=True, comment="mean next-token loss on the later copies"),
        sa.Column("repeat_gain", sa.Double(), nullable=True,
                  comment="loss_first - loss_later; NULL for a model without a causal LM head"),
        sa.Column("checks", postgresql.JSONB(astext_type=sa.Text()), nullable=False,
                  comment="the causal check: per role, its heads and the losses and gain with and without them"),
        sa.Column("example_tokens", postgresql.JSONB(astext_type=sa.Text()), nullable=False,
                  comment="{tokens: [...]}: the first sequence, as tokens"),
        sa.Column("example_size", sa.Integer(), nullable=False,
                  comment="side of the stored example maps (pooled when the sequence is longer)"),
        sa.Column("device", sa.String(), nullable=False),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("seconds", sa.Double(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("status IN ('running', 'complete', 'failed')", name=op.f("ck_detection_runs_status")),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_detection_runs_model_id_models"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_detection_runs")),
    )  # fmt: skip
    op.create_index("ix_detection_runs_model_latest", "detection_runs", ["model_id", "status", "id"], unique=False)
    op.create_table(
        "head_detector_scores",
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("detection_run_id", sa.Integer(), nullable=False),
        sa.Column("head_id", sa.BigInteger(), nullable=False),
        sa.Column("induction", sa.Double(), nullable=True),
        sa.Column("duplicate_token", sa.Double(), nullable=True),
        sa.Column("previous_token", sa.Double(), nullable=True),
        sa.Column("sink", sa.Double(), nullable=True),
        sa.Column("roles", postgresql.ARRAY(sa.String(length=16)), nullable=False,
                  comment="detectors whose score reaches the run's threshold"),
        sa.Column("example_map", postgresql.ARRAY(sa.REAL()), nullable=False,
                  comment="the first sequence's map, row-major, example_size x example_size"),
        sa.ForeignKeyConstraint(
            ["detection_run_id"], ["detection_runs.id"],
            name=op.f("fk_head_detector_scores_detection_run_id_detection_runs"), ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["model_id", "head_id"], ["heads.model_id", "heads.id"],
            name=op.f("fk_head_detector_scores_model_id_heads"), ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("model_id", "detection_run_id", "head_id", name=op.f("pk_head_detector_scores")),
    )  # fmt: skip
    op.drop_constraint(op.f("ck_jobs_kind"), "jobs", type_="check")
    op.create_check_constraint(op.f("ck_jobs_kind"), "jobs", f"kind IN ({KINDS}, 'detection')")
    for statement in VIEWS:
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP VIEW head_detections")
    op.execute("DELETE FROM jobs WHERE kind = 'detection'")
    op.drop_constraint(op.f("ck_jobs_kind"), "jobs", type_="check")
    op.create_check_constraint(op.f("ck_jobs_kind"), "jobs", f"kind IN ({KINDS})")
    op.drop_table("head_detector_scores")
    op.drop_index("ix_detection_runs_model_latest", table_name="detection_runs")
    op.drop_table("detection_runs")
