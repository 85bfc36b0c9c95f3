"""What the API says about jobs."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, computed_field


class JobRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    kind: str
    queue: str
    status: str = Field(description="queued | running | succeeded | failed")
    request: dict[str, Any]
    attempts: int
    progress_done: int | None
    progress_total: int | None
    result: dict[str, Any] | None = Field(description="ids of what the job made, once it succeeded")
    error: str | None
    runner: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def seconds(self) -> float | None:
        """Run time so far (running) or in all (finished)."""
        if self.started_at is None:
            return None
        end = self.finished_at or datetime.now(self.started_at.tzinfo)
        return (end - self.started_at).total_seconds()


class JobAccepted(BaseModel):
    job_id: int
    status: str
    duplicate: bool = Field(description="an identical request was already queued or running: this is that job")
    url: str
    workers: int = Field(description="workers alive now (a heartbeat within the last 30 s)")
    warning: str | None = Field(None, description="set when no worker is alive: the job waits until one starts")


NO_WORKER = (
    "no worker is running: the job stays queued until one starts (`headcat serve` runs one unless given "
    "--no-worker; `headcat worker` runs one on its own)"
)
