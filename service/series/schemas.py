"""Series (SPEC 11): a model's checkpoints, in step order, and its heads' trajectories."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field


class SeriesRead(BaseModel):
    name: str
    architecture: str = Field(description="transformers model_type every step shares")
    stacks: dict[str, Any] = Field(description="stack -> {layers, heads, kv_heads}, shared by every step")
    steps: int = Field(description="checkpoints in the catalog")
    first_step: int | None
    last_step: int | None
    created_at: datetime


class DetectionSummary(BaseModel):
    id: int
    repeat_gain: float | None = Field(description="nats; null for a model without a causal LM head")
    loss_first: float | None
    loss_later: float | None
    config: dict[str, Any]


class SeriesStep(BaseModel):
    step: int
    model: str = Field(description="the step's catalog model (every lens, query and export works on it)")
    source: str
    revision: str | None = Field(description="the hub commit it resolved to, when known")
    requested_revision: str | None = Field(description="the hub revision asked for, e.g. step1000")
    feature_run: int | None = Field(description="the step's current feature run")
    detection_run: DetectionSummary | None = Field(description="the step's current detection run")
    clustering: int | None = Field(description="the model's current clustering (the series' joint one once fitted)")


class SeriesDetail(SeriesRead):
    items: list[SeriesStep]


class TrajectoryPoint(BaseModel):
    step: int
    value: float | None = Field(description="the score at this step; null where the step has no such value")
    roles: list[str] | None = Field(description="the head's roles at this step; null without a detection run")
    type: str | None
    margin: float | None


class HeadTrajectory(BaseModel):
    stack: str
    layer: int
    head: int
    formed_at: dict[str, int | None] = Field(
        description="role -> the first step from which the head has the role at every later step (SPEC 11); "
        "null: it does not hold to the last step"
    )
    values: list[TrajectoryPoint]


class SeriesHeads(BaseModel):
    series: str
    score: str
    steps: list[int] = Field(description="the steps with a complete detection run, which formation reads")
    items: list[HeadTrajectory]
