"""Catalog imports (issue 26): where an imported model came from.

- ``catalog_imports``: one row per archive imported (``headcat catalog import``, ``POST
  /catalog/imports``): its checksum (the SHA-256 of its ``manifest.json``, which holds every
  file's), where it came from (a directory, ``hub:<repo>``, an upload), the renames applied, the
  archive's format and headcat versions, the models it brought and when. The same archive
  imported with the same renames is one row: importing it again changes nothing.
- ``models.import_id``: the import that brought the model (NULL: ingested here).
- ``jobs.kind`` gains ``catalog_import``. The constraint is rebuilt from the kinds it holds now,
  so this revision stays right whichever revisions before it added kinds.

Revision ID: 0011
Revises: 0009
Create Date: 2026-11-26 01:00:00.000000
"""

import re
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_KIND = "catalog_import"


def _job_kinds() -> list[str]:
    definition = op.get_bind().scalar(
        sa.text("SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = 'ck_jobs_kind'")
    )
    return re.findall(r"'([a-z_]+)'", definition or "")


def _set_job_kinds(kinds: list[str]) -> None:
    op.drop_constraint(op.f("ck_jobs_kind"), "jobs", type_="check")
    listed = ", ".join(f"'{kind}'" for kind in kinds)
    op.create_check_constraint(op.f("ck_jobs_kind"), "jobs", f"kind IN ({listed})")


def upgrade() -> None:
    op.create_table(
        "catalog_imports",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column(
            "archive_sha256", sa.String(length=64), nullable=False, comment="SHA-256 of the archive's manifest.json"
        ),
        sa.Column("origin", sa.String(), nullable=False, comment="where it came from: a directory, hub:<repo>, ..."),
        sa.Column(
            "renames",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
            comment="archive name -> catalog name of the models renamed on import",
        ),
        sa.Column("format_version", sa.Integer(), nullable=False),
        sa.Column("headcat_version", sa.String(), nullable=False, comment="the headcat that exported it"),
        sa.Column("exported_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("models", postgresql.ARRAY(sa.String()), nullable=False, comment="catalog names of its models"),
        sa.Column("rows", sa.BigInteger(), nullable=False, comment="rows the archive holds, all files together"),
        sa.Column("imported_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_catalog_imports")),
        sa.UniqueConstraint("archive_sha256", "renames", name=op.f("uq_catalog_imports_archive_sha256_renames")),
    )
    op.add_column("models", sa.Column("import_id", sa.Integer(), nullable=True))
    op.create_foreign_key(
        op.f("fk_models_import_id_catalog_imports"), "models", "catalog_imports", ["import_id"], ["id"],
        ondelete="SET NULL",
    )  # fmt: skip
    _set_job_kinds([*[k for k in _job_kinds() if k != _KIND], _KIND])


def downgrade() -> None:
    op.execute(f"DELETE FROM jobs WHERE kind = '{_KIND}'")
    _set_job_kinds([k for k in _job_kinds() if k != _KIND])
    op.drop_constraint(op.f("fk_models_import_id_catalog_imports"), "models", type_="foreignkey")
    op.drop_column("models", "import_id")
    op.drop_table("catalog_imports")
