"""Syntax-run requests and results."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from service.errors import RequestBody


class SyntaxCreate(RequestBody):
    """Score every head on dependency relations (Clark et al. 2019): gold CoNLL-U or spaCy silver parses."""

    model: str = Field(min_length=1, max_length=200, description="the model's catalog name (ingested first)")
    corpus: str = Field(
        default="builtin:wiki",
        min_length=1,
        max_length=500,
        description="text to parse with spaCy (silver): builtin:wiki | builtin:lee | .txt | .jsonl | ...",
    )
    parses: str | None = Field(
        default=None, min_length=1, max_length=500, description="a CoNLL-U file of gold parses (instead of corpus)"
    )
    samples: int = Field(default=500, ge=1, le=1_000_000, description="sentences scored at most")
    max_length: int = Field(default=128, ge=8, le=8192, description="longer sentences (in tokens) are left out")
    batch_size: int = Field(default=32, ge=1, le=4096)
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?|mps)$")
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"


class BaselineRead(BaseModel):
    relation: str
    count: int
    offset: int = Field(description="the best fixed head - dependent offset")
    accuracy: float


class BestHead(BaseModel):
    """Clark et al. Fig. 5 as data: a relation's most accurate head against its fixed-offset baseline."""

    relation: str
    count: int
    stack: str
    layer: int
    head: int
    direction: str = Field(description="dep2head (dependent attends to its head) | head2dep")
    accuracy: float
    baseline: float
    baseline_offset: int


class SyntaxRunRead(BaseModel):
    id: int
    model: str
    stack: str
    parses: str = Field(description="gold | silver")
    source: str
    parser: str | None
    num_sentences: int
    num_skipped: int
    num_words: int
    config: dict[str, Any]
    device: str
    dtype: str
    seconds: float
    created_at: datetime
    baselines: list[BaselineRead]


class ModelSyntax(BaseModel):
    """A model's current syntax run: the best head per relation, and the relations x heads accuracy matrix."""

    run: SyntaxRunRead
    best: list[BestHead]
    layers: int
    heads: int
    matrix: dict[str, list[list[float]]] = Field(
        description="relation -> [layer][head] accuracy (the better direction), for the heat map"
    )
