"""Attribution requests and results."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field


class AttributionCreate(BaseModel):
    """Estimate every head's gradient attribution to the input tokens (Pascual et al. 2021)."""

    model: str = Field(min_length=1, max_length=200, description="the model's catalog name (ingested first)")
    corpus: str = Field(
        default="builtin:wiki",
        min_length=1,
        max_length=500,
        description="builtin:wiki | builtin:lee | SQuAD .json | GLUE .tsv | .jsonl | .txt | hub:NAME",
    )
    samples: int = Field(default=32, ge=1, le=100_000)
    max_length: int = Field(default=64, ge=8, le=8192)
    queries: int = Field(default=16, ge=1, le=8192, description="query positions per sample (seeded subsample)")
    probes: int = Field(default=4, ge=1, le=1024, description="K Rademacher probes per (head, query)")
    rows_per_pass: int = Field(default=16, ge=1, le=65_536, description="(head, query, probe) triples per backward")
    num_windows: int = Field(default=16, ge=1, le=249)
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?|mps)$")
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"


class HeadAttributionRead(BaseModel):
    stack: str
    layer: int
    head: int
    discrepancy: float
    global_features: dict[str, float] = Field(description="section 1 features of the attribution rows")
    local_features: dict[str, float] = Field(description="the same of the attention rows at the same queries")
    global_scalars: dict[str, float | None]


class AttributionRunRead(BaseModel):
    id: int
    model: str
    stack: str
    corpus: str
    num_samples: int
    num_tokens: int
    queries: int
    probes: int
    seed: int
    triples: int
    passes: int
    triples_per_second: float
    layer_discrepancy: list[float] = Field(description="mean discrepancy of each layer's heads (Pascual's figure)")
    config: dict[str, Any]
    device: str
    dtype: str
    seconds: float
    created_at: datetime
    heads: list[HeadAttributionRead] = Field(default=[], description="every head (GET /attributions/{id} only)")


class AttributionMaps(BaseModel):
    """One head's example rows: attention beside attribution, at the run's example queries."""

    run_id: int
    stack: str
    layer: int
    head: int
    tokens: list[str] = Field(description="the example sample's tokens")
    queries: list[int] = Field(description="the query position of each row")
    key_bins: int = Field(description="keys are averaged into this many bins")
    attention: list[list[float]]
    attribution: list[list[float]]
    discrepancy: float
