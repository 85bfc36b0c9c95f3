"""Column comments that say what the columns hold now, and none missing.

- ``attribution_runs.probes``, ``triples`` and ``passes`` were described for the vjp scheme that
  forward mode replaced (issue 24): K probes per (head, query), backward passes of
  ``rows_per_pass`` triples. They now hold the tangents per input position, the (layer, head,
  query, tangent) estimates and the forward-mode passes; a run's ``config.scheme`` says which
  scheme stored it (``vjp`` for the runs before forward mode).
- ``models.num_layers`` and ``num_heads`` had their comments in ``service/orm.py`` only.

From this revision on ``tests/migrations/test_model_id.py`` compares comments too, so the ORM's
and the database's cannot drift apart again.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26 04:00:00.000000
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (table, column) -> (the comment now, the comment before this revision)
_COMMENTS: dict[tuple[str, str], tuple[str, str | None]] = {
    ("attribution_runs", "probes"): (
        "tangents per input position: P Rademacher probes (scheme forward), the hidden size (exact); "
        "for vjp runs, K probes per (head, query)",
        "K Rademacher probes per (head, query)",
    ),
    ("attribution_runs", "triples"): (
        "(layer, head, query, tangent) estimates",
        "(head, query, probe) triples estimated",
    ),
    ("attribution_runs", "passes"): (
        "forward-mode passes, one per input position and tangent; for vjp runs, backward passes",
        "forward/backward passes run (rows_per_pass triples each)",
    ),
    ("models", "num_layers"): ("layers of the model's first stack (encoder, else decoder)", None),
    ("models", "num_heads"): ("query heads per layer of the first stack", None),
}


def _comment(table: str, column: str, comment: str | None) -> None:
    value = "NULL" if comment is None else "'" + comment.replace("'", "''") + "'"
    op.execute(f"COMMENT ON COLUMN {table}.{column} IS {value}")


def upgrade() -> None:
    for (table, column), (now, _) in _COMMENTS.items():
        _comment(table, column, now)


def downgrade() -> None:
    for (table, column), (_, before) in _COMMENTS.items():
        _comment(table, column, before)
