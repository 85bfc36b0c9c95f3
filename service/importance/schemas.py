"""Importance and pruning-curve requests (validated up front) and what the API says about stored runs."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal, get_args

from pydantic import BaseModel, Field, field_validator

from service.ablations.schemas import Sample, Task
from service.errors import RequestBody

Loss = Literal["task", "lm", "sensitivity"]
Ranking = Literal["importance", "type", "random", "-importance"]
RANKINGS: tuple[Ranking, ...] = get_args(Ranking)

_DATA = "SQuAD .json | GLUE .tsv | .jsonl (text/text_pair[/label]) | .txt or builtin:NAME (lm, sensitivity)"


class _Run(RequestBody):
    """What an importance run and a pruning curve share: the model, the data and how to run it."""

    model: str = Field(min_length=1, max_length=200, description="catalog name of the model")
    data: str = Field(min_length=1, max_length=1000, description=_DATA)
    articles: str | None = Field(
        default=None,
        pattern=r"^\s*(all|\d+\s*(-\s*\d+)?)\s*$",
        description="SQuAD articles, e.g. 24-47 or all; default: a fine-tuned model's held-out articles",
    )
    limit: int | None = Field(default=None, ge=1, le=10_000_000, description="use this many examples")
    sample: Sample = "first"
    batch_size: int = Field(default=32, ge=1, le=4096)
    max_length: int | None = Field(default=None, ge=16, le=8192, description="default: 384 for SQuAD, 128 otherwise")
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?|mps)$")
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    seed: int = Field(default=0, ge=0, le=2**31 - 1, description="MLM mask, Rademacher probes, random ranking")


class ImportanceCreate(_Run):
    """Score every head of a catalog model (SPEC 7): mean over examples of |dLoss/dxi_h|."""

    loss: Loss | None = Field(
        default=None,
        description="task (labelled data, a classification or QA head) | lm (the model's own masked- or causal-LM "
        "loss) | sensitivity (a bare encoder's hidden states); default: task for a task model, else lm where the "
        "model has an LM head, else sensitivity",
    )
    task: Literal["squad", "glue"] | None = Field(
        default=None, description="the task loss's data; default from the head"
    )
    probes: int = Field(default=8, ge=1, le=256, description="sensitivity: Rademacher probes per batch")
    mask_probability: float = Field(default=0.15, gt=0, lt=1, description="lm (masked LMs): share of tokens masked")


class PruningCurveCreate(_Run):
    """Prune heads in the order of each ranking and measure the task metric at each step."""

    task: Task | None = Field(default=None, description="squad | glue | drift; default from the model's head")
    rankings: list[Ranking] = Field(
        default=list(RANKINGS),
        description="importance (ascending), type (the README's type order), random (seeded), -importance",
    )
    steps: int = Field(default=10, ge=1, le=200, description="points after the baseline, evenly up to max_share")
    max_share: float = Field(default=0.5, gt=0, le=1, description="share of all heads pruned at the last point")
    iterative: bool = Field(default=False, description="re-score the remaining heads after each step (Michel)")
    clustering: int | None = Field(default=None, ge=1, le=2**31 - 1, description="head types for the type ranking")
    importance_run: int | None = Field(
        default=None, ge=1, le=2**31 - 1, description="stored scores for the importance rankings; default: score now"
    )
    loss: Loss | None = Field(
        default=None, description="the importance rankings' loss; default: task, else lm/sensitivity"
    )

    @field_validator("rankings", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("rankings")
    @classmethod
    def _some(cls, value: list[Ranking]) -> list[Ranking]:
        if not value:
            raise ValueError("give at least one ranking: importance, type, random, -importance")
        return list(dict.fromkeys(value))


class DataRead(BaseModel):
    kind: str
    source: str
    sha256: str | None
    subset: str | None
    size: int


class HeadScoreRead(BaseModel):
    stack: str
    layer: int
    head: int
    raw: float
    normalized: float


class ImportanceRunRead(BaseModel):
    id: int
    model: str
    status: str
    loss: str
    task: str | None
    data: DataRead
    limit: int | None
    n_examples: int
    seed: int
    mean_loss: float | None
    config: dict[str, Any]
    device: str
    dtype: str
    seconds: float
    started_at: datetime
    finished_at: datetime | None
    scores: list[HeadScoreRead]


class PointRead(BaseModel):
    step: int
    pruned: int
    share: float
    metrics: dict[str, Any]
    delta: float = Field(description="the curve's metric minus the shared baseline's")
    heads: list[list[int]]
    seconds: float


class RankingCurveRead(BaseModel):
    ranking: str
    order: list[list[int]] = Field(description="[layer, head] in the order pruned")
    points: list[PointRead]


class PruningCurveRead(BaseModel):
    id: int
    model: str
    status: str
    task: str
    metric: str
    baseline: dict[str, Any]
    baseline_id: int
    rankings: list[str]
    iterative: bool
    steps: int
    max_share: float
    seed: int
    type_order: list[str]
    importance_run_id: int | None
    clustering_id: int | None
    data: DataRead
    limit: int | None
    n_examples: int
    config: dict[str, Any]
    device: str
    dtype: str
    seconds: float
    started_at: datetime
    finished_at: datetime | None
    curves: list[RankingCurveRead]
