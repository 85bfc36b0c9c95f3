"""The catalog at scale: a model's task, and the indexes of the cross-model head queries.

``models.task`` is the head the model was saved with (``base``, ``sequence-classification``,
``question-answering``, ``causal-lm``, ...; see :func:`ingest.types.model_task`); NULL where it is
not known (models stored before this revision). ``GET /heads`` walks the models in name order,
optionally narrowed by architecture or task, and each model's heads through
``uq_heads_model_id_stack_layer_head``: the two model indexes make those walks index scans.
``ix_models_current_clustering_id`` serves the known head types and a clustering's ETag.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23 14:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "models",
        sa.Column(
            "task",
            sa.String(length=32),
            nullable=True,
            comment="the model's head: base, sequence-classification, question-answering, causal-lm, ...",
        ),
    )
    op.create_index("ix_models_architecture_name", "models", ["architecture", "name"])
    op.create_index("ix_models_task_name", "models", ["task", "name"])
    op.create_index("ix_models_current_clustering_id", "models", ["current_clustering_id"])


def downgrade() -> None:
    op.drop_index("ix_models_current_clustering_id", table_name="models")
    op.drop_index("ix_models_task_name", table_name="models")
    op.drop_index("ix_models_architecture_name", table_name="models")
    op.drop_column("models", "task")
