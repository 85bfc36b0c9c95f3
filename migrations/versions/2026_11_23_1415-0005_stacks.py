"""Stacks (SPEC section 6): every head is (stack, layer, head); models record their stacks and key/value heads.

Existing catalogs keep their heads: a causal model's heads become ``decoder``, every other
model's ``encoder``. The head_types views gain a ``stack`` column after ``model``.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 14:15:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# model_type values of the causal (decoder-only) architectures headcat could store before stacks.
_CAUSAL = (
    "gpt2", "gpt_neo", "gpt_neox", "gptj", "llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2",
    "gemma3_text", "phi", "phi3", "opt", "falcon", "olmo", "olmo2", "starcoder2", "cohere", "stablelm",
)  # fmt: skip

_WINDOWS = ",\n".join(f"       CASE WHEN fr.num_windows > {i} THEN f.vector[{i + 1}] END AS w{i}" for i in range(16))


def _head_types_view(with_stack: bool) -> str:
    stack = "       h.stack,\n" if with_stack else ""
    return f"""
CREATE VIEW head_types AS
SELECT m.name AS model,
{stack}       h.layer,
       h.head,
       c.name AS type,
       a.clustering_id,
       a.clustering_id IS NOT DISTINCT FROM m.current_clustering_id AS is_current,
       a.feature_run_id,
{_WINDOWS},
       f.vector[fr.num_windows + 1] AS self,
       f.vector[fr.num_windows + 2] AS cls,
       f.vector[fr.num_windows + 3] AS sep,
       f.vector[fr.num_windows + 4] AS period,
       f.vector[fr.num_windows + 5] AS comma,
       f.entropy,
       f.prev_token,
       f.next_token,
       f.mean_distance,
       f.sep_to_sep,
       a.tsne_x,
       a.tsne_y,
       m.id AS model_id,
       h.id AS head_id
FROM head_assignments a
JOIN heads h ON h.id = a.head_id
JOIN models m ON m.id = h.model_id
JOIN clusters c ON c.id = a.cluster_id
JOIN feature_runs fr ON fr.id = a.feature_run_id
JOIN head_features f ON f.feature_run_id = a.feature_run_id AND f.head_id = a.head_id
"""


def _views(with_stack: bool) -> None:
    op.execute("DROP VIEW current_head_types")
    op.execute("DROP VIEW head_types")
    op.execute(_head_types_view(with_stack))
    op.execute("CREATE VIEW current_head_types AS SELECT * FROM head_types WHERE is_current")
    op.execute("COMMENT ON VIEW head_types IS 'one row per head and clustering: type and features by name'")
    op.execute("COMMENT ON VIEW current_head_types IS 'head_types for each model''s current clustering'")


def upgrade() -> None:
    op.add_column(
        "heads",
        sa.Column(
            "stack",
            sa.String(length=8),
            server_default="encoder",
            nullable=False,
            comment="encoder (bidirectional self-attention) | decoder (causal self-attention) | cross",
        ),
    )
    causal = ", ".join(f"'{name}'" for name in _CAUSAL)
    op.execute(
        f"UPDATE heads SET stack = 'decoder' FROM models m WHERE m.id = heads.model_id AND m.architecture IN ({causal})"
    )
    op.alter_column("heads", "stack", server_default=None)
    op.create_check_constraint(op.f("ck_heads_stack"), "heads", "stack IN ('encoder', 'decoder', 'cross')")
    op.drop_constraint("uq_heads_model_id_layer_head", "heads", type_="unique")
    op.create_unique_constraint(
        op.f("uq_heads_model_id_stack_layer_head"), "heads", ["model_id", "stack", "layer", "head"]
    )

    op.add_column(
        "models",
        sa.Column(
            "num_key_value_heads",
            sa.Integer(),
            nullable=True,
            comment="key/value heads per layer (grouped-query attention); NULL when equal to num_heads",
        ),
    )
    op.add_column(
        "models",
        sa.Column(
            "stacks",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
            comment="stack -> {layers, heads, kv_heads}: the model's attention stacks",
        ),
    )
    op.execute(
        f"""UPDATE models SET stacks = jsonb_build_object(
                CASE WHEN architecture IN ({causal}) THEN 'decoder' ELSE 'encoder' END,
                jsonb_build_object('layers', num_layers, 'heads', num_heads, 'kv_heads', num_heads))"""
    )
    _views(with_stack=True)


def downgrade() -> None:
    _views(with_stack=False)
    op.drop_column("models", "stacks")
    op.drop_column("models", "num_key_value_heads")
    op.execute("DELETE FROM heads WHERE stack = 'cross'")
    op.drop_constraint(op.f("uq_heads_model_id_stack_layer_head"), "heads", type_="unique")
    op.create_unique_constraint(op.f("uq_heads_model_id_layer_head"), "heads", ["model_id", "layer", "head"])
    op.drop_constraint(op.f("ck_heads_stack"), "heads", type_="check")
    op.drop_column("heads", "stack")
