"""API keys: only the SHA-256 of each secret, its display prefix, and when it was made, used and revoked.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-21 22:04:15.877550
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False, comment="who or what holds it"),
        sa.Column(
            "prefix", sa.String(length=16), nullable=False, comment="the secret's first characters, to recognise it"
        ),
        sa.Column("key_hash", sa.String(length=64), nullable=False, comment="hex SHA-256 of the whole secret"),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )


def downgrade() -> None:
    op.drop_table("api_keys")
