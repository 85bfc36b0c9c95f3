"""Series (SPEC 11): a model's checkpoints as one ordered set, and every head's trajectory over them.

- ``series``: a training run's checkpoints under one name, with what every step must share: the
  architecture (``model_type``), the attention stacks and the tokenizer (SHA-256 of its vocabulary
  and special tokens).
- ``models.series_id`` and ``models.step``: the checkpoint's series and its integer step (both or
  neither; a step is in its series once); ``models.requested_revision``: the hub revision asked
  for (``--revision step1000``), beside ``models.revision``, the commit it resolved to.
- ``head_trajectories``: one row per head of every series step: its current detection run's scores
  and roles, its current feature run's features and its current type and margin (the series' joint
  clustering when one was fitted).

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-28 09:45:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

HEAD_TRAJECTORIES = """
CREATE VIEW head_trajectories AS
SELECT s.name AS series,
       m.step,
       m.name AS model,
       h.stack,
       h.layer,
       h.head,
       d.induction,
       d.duplicate_token,
       d.previous_token,
       d.sink,
       d.roles,
       r.config -> 'thresholds' AS thresholds,
       r.repeat_gain,
       f.entropy,
       f.prev_token,
       f.next_token,
       f.mean_distance,
       f.sep_to_sep,
       f.vector AS features,
       c.name AS type,
       a.margin,
       a.clustering_id,
       r.id AS detection_run_id,
       fr.id AS feature_run_id,
       s.id AS series_id,
       m.id AS model_id,
       h.id AS head_id
FROM models m
JOIN series s ON s.id = m.series_id
JOIN heads h ON h.model_id = m.id
LEFT JOIN detection_runs r ON r.id = m.current_detection_run_id
LEFT JOIN head_detector_scores d ON d.model_id = m.id AND d.detection_run_id = r.id AND d.head_id = h.id
LEFT JOIN feature_runs fr ON fr.id = m.current_feature_run_id
LEFT JOIN head_features f ON f.model_id = m.id AND f.feature_run_id = fr.id AND f.head_id = h.id
LEFT JOIN head_assignments a ON a.model_id = m.id AND a.clustering_id = m.current_clustering_id AND a.head_id = h.id
LEFT JOIN clusters c ON c.id = a.cluster_id
"""
COMMENT = (
    "COMMENT ON VIEW head_trajectories IS 'one row per head of every step of every series (SPEC 11): the "
    "current detection run''s scores and roles, the current feature run''s features, the current type "
    "and margin'"
)


def upgrade() -> None:
    op.create_table(
        "series",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("architecture", sa.String(), nullable=False,
                  comment="transformers model_type every step shares, e.g. gpt2"),
        sa.Column("stacks", postgresql.JSONB(astext_type=sa.Text()), nullable=False,
                  comment="stack -> {layers, heads, kv_heads}: the attention layout every step shares"),
        sa.Column("tokenizer_sha256", sa.String(length=64), nullable=False,
                  comment="SHA-256 of the tokenizer's vocabulary and special tokens, which every step shares"),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_series")),
        sa.UniqueConstraint("name", name=op.f("uq_series_name")),
    )  # fmt: skip
    op.add_column(
        "models",
        sa.Column(
            "series_id",
            sa.Integer(),
            nullable=True,
            comment="the series this checkpoint is a step of; NULL for a lone model",
        ),
    )
    op.add_column(
        "models", sa.Column("step", sa.Integer(), nullable=True, comment="the checkpoint's training step in its series")
    )
    op.add_column("models", sa.Column("requested_revision", sa.String(), nullable=True,
                                      comment="the hub revision asked for (branch, tag or commit, e.g. step1000); "
                                      "revision holds the commit it resolved to"))  # fmt: skip
    op.create_foreign_key(op.f("fk_models_series_id_series"), "models", "series", ["series_id"], ["id"])
    op.create_unique_constraint(op.f("uq_models_series_id_step"), "models", ["series_id", "step"])
    op.create_check_constraint(op.f("ck_models_series_step"), "models", "(series_id IS NULL) = (step IS NULL)")
    op.execute(HEAD_TRAJECTORIES)
    op.execute(COMMENT)


def downgrade() -> None:
    op.execute("DROP VIEW head_trajectories")
    op.drop_constraint(op.f("ck_models_series_step"), "models", type_="check")
    op.drop_constraint(op.f("uq_models_series_id_step"), "models", type_="unique")
    op.drop_constraint(op.f("fk_models_series_id_series"), "models", type_="foreignkey")
    op.drop_column("models", "requested_revision")
    op.drop_column("models", "step")
    op.drop_column("models", "series_id")
    op.drop_table("series")
