"""Attribution requests and results."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from service.errors import RequestBody


class AttributionCreate(RequestBody):
    """Every head's gradient attribution to the input tokens (Pascual et al. 2021), by forward mode: ``probes``
    Rademacher tangents per input position (``scheme="forward"``), or the hidden size's unit vectors, which give
    ``G`` exactly (``scheme="exact"``). Every query of every sample is scored unless ``queries`` asks for fewer."""

    model: str = Field(min_length=1, max_length=200, description="the model's catalog name (ingested first)")
    corpus: str = Field(
        default="builtin:wiki",
        min_length=1,
        max_length=500,
        description="builtin:wiki | builtin:lee | SQuAD .json | GLUE .tsv | .jsonl | .txt | hub:NAME",
    )
    samples: int = Field(default=32, ge=1, le=100_000)
    max_length: int = Field(default=64, ge=8, le=8192)
    queries: int | None = Field(
        default=None, ge=1, le=8192, description="query positions per sample, a seeded subsample; null: every query"
    )
    probes: int = Field(default=4, ge=1, le=1024, description="P Rademacher tangents per input position (forward)")
    scheme: Literal["forward", "exact"] = Field(
        default="forward",
        description="forward: the probes' unbiased estimate of G^2; exact: the hidden size's unit vectors, G itself "
        "(tokens x hidden size passes per sample)",
    )
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
    queries: int | None = Field(description="query positions per sample; null: every query")
    probes: int = Field(description="tangents per input position (the hidden size when exact)")
    scheme: str = Field(description="forward | exact (vjp: a run of the scheme forward mode replaced)")
    seed: int
    triples: int = Field(description="(layer, head, query, tangent) estimates")
    passes: int = Field(description="forward-mode passes: one per input position and tangent")
    triples_per_second: float
    rows_per_second: float = Field(description="attribution rows (layer, head, query) per second")
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
