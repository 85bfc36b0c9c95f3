"""One place for configuration, read from the environment (and ``.env``)."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

import platformdirs
from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


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
    progress_interval: float = Field(
        default=15.0, gt=0, description="seconds between progress lines when the output is not a terminal"
    )
    reads_require_key: bool = Field(
        default=False, description="true: every data endpoint (reads too) needs an API key, not just the writes"
    )
    data_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="directories REST job requests may read corpora and evaluation data from (none: no files)",
    )
    model_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="directories REST job requests may load local models from (the packaged MiniLM always)",
    )
    allow_hub: bool = Field(default=True, description="REST job requests may name hub models and data sets")
    max_body_bytes: int = Field(default=1 << 20, description="larger request bodies are refused with 413")
    pool_size: int = Field(default=5, ge=1, description="database connections each API process keeps open")
    pool_overflow: int = Field(default=5, ge=0, description="connections a process may open beyond pool_size")

    @field_validator("data_roots", "model_roots", mode="before")
    @classmethod
    def _path_list(cls, value: Any) -> Any:
        """``/a:/b`` (os.pathsep-separated, like PATH) or a JSON list, from the environment."""
        if isinstance(value, str):
            value = value.strip()
            if value.startswith("["):
                import json

                return json.loads(value)
            return [part for part in value.split(os.pathsep) if part.strip()]
        return value

    @property
    def embedded_pgdata(self) -> Path:
        return self.data_dir / "pgdata"


@lru_cache
def get_settings() -> Settings:
    return Settings()
