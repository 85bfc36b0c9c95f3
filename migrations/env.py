"""Alembic environment: the catalog's schema, generated from ``service.orm``."""

from __future__ import annotations

from alembic import context
from sqlalchemy import engine_from_config, pool

from service.orm import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is None:
        connectable = engine_from_config(
            config.get_section(config.config_ini_section, {}), prefix="sqlalchemy.", poolclass=pool.NullPool
        )
        with connectable.connect() as connection:
            _run(connection)
    else:
        _run(connectable)


def _ours(name: str | None, type_: str, parent_names: object) -> bool:
    """procrastinate's tables are created from its own schema file, not from our models."""
    return not (type_ == "table" and name is not None and name.startswith("procrastinate_"))


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(connection=connection, target_metadata=target_metadata, compare_type=True, include_name=_ours)
    with context.begin_transaction():
        # Several processes (API, workers, CLI) may upgrade at once: serialise them.
        connection.exec_driver_sql("SELECT pg_advisory_xact_lock(7262000)")
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
