"""Detection-run requests and results."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from service.errors import RequestBody
from service.jobs.schemas import JobAccepted


class DetectionSettings(RequestBody):
    """How every head is scored (SPEC 10): the body of ``POST /series/{name}/detections``, for every step."""

    sequences: int = Field(default=32, ge=1, le=100_000, description="seeded random sequences")
    length: int = Field(default=24, ge=2, le=100_000, description="distinct random ids per copy")
    copies: int = Field(default=2, ge=2, le=1_000, description="copies of the ids in each sequence")
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    thresholds: dict[str, float] | None = Field(
        default=None,
        description="detector -> threshold in [0, 1] for its role (defaults: induction, duplicate_token and "
        "previous_token 0.4, sink 0.3)",
    )
    check: list[Literal["induction", "duplicate_token", "previous_token", "sink"]] = Field(
        default=["induction"],
        max_length=4,
        description="causal LMs: roles whose heads are pruned to measure the repeat gain without them",
    )
    corpus: str | None = Field(
        default="builtin:wiki",
        min_length=1,
        max_length=500,
        description="causal LMs: text whose next-token loss the causal check measures with and without each "
        "role's heads (builtin:wiki | .txt | .jsonl | ...); null: the repeat gain only",
    )
    corpus_samples: int = Field(default=64, ge=1, le=100_000, description="texts of the corpus read")
    batch_size: int = Field(default=32, ge=1, le=4096)
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?|mps)$")
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"


class DetectionCreate(DetectionSettings):
    """Score every head as an induction, duplicate-token, previous-token and sink head (SPEC 10)."""

    model: str = Field(min_length=1, max_length=200, description="the model's catalog name (ingested first)")


class SeriesStepJob(BaseModel):
    step: int
    model: str
    job: JobAccepted


class SeriesStepSkipped(BaseModel):
    step: int
    model: str
    detection_run: int = Field(description="the step's current run, which asked the same sequences and thresholds")


class SeriesDetectionsAccepted(BaseModel):
    series: str
    jobs: list[SeriesStepJob] = Field(description="one detection job per step still to detect, in step order")
    skipped: list[SeriesStepSkipped] = Field(description="steps whose current run already answers the request")


class DetectionRunRead(BaseModel):
    id: int
    model: str
    config: dict[str, Any]
    num_sequences: int
    num_tokens: int
    loss_first: float | None
    loss_later: float | None
    repeat_gain: float | None = Field(description="loss_first - loss_later (nats); null without a causal LM head")
    checks: list[dict[str, Any]] = Field(
        description="the causal check: per role, its heads and {loss_first, loss_later, repeat_gain, corpus_loss} "
        "with and without them (without: null when no head has the role)"
    )
    device: str
    dtype: str
    seconds: float
    created_at: datetime


class HeadDetectionRead(BaseModel):
    stack: str
    layer: int
    head: int
    induction: float | None
    duplicate_token: float | None
    previous_token: float | None
    sink: float | None
    roles: list[str]


class ModelDetections(BaseModel):
    """A model's detection runs (newest first) and every head of its current one."""

    model: str
    current_run_id: int = Field(description="the run served (PUT /models/{name}/current/detections chooses it)")
    runs: list[DetectionRunRead]
    heads: list[HeadDetectionRead] = Field(description="the current run's heads, by stack, layer and head")


class ExampleMap(BaseModel):
    """One head's map of the current run's first sequence."""

    model: str
    detection_run_id: int
    stack: str
    layer: int
    head: int
    tokens: list[str]
    size: int = Field(description="side of the map (the sequence's tokens, or fewer when pooled)")
    map: list[list[float]]
