"""One place for configuration, read from the environment (and ``.env``)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import platformdirs
from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HEADCAT_", env_file=".env", extra="ignore")

    database_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("DATABASE_URL", "HEADCAT_DATABASE_URL"),
        description="PostgreSQL URL. Unset: headcat starts its embedded PostgreSQL under data_dir.",
    )
    data_dir: Path = Field(
        default_factory=lambda: platformdirs.user_data_path("headcat"),
        description="Per-user directory for the embedded database's files.",
    )
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "INFO"

    @property
    def embedded_pgdata(self) -> Path:
        return self.data_dir / "pgdata"


@lru_cache
def get_settings() -> Settings:
    return Settings()
