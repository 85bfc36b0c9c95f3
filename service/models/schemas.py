"""What the API says about models and their feature runs."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict


class CorpusRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    name: str
    kind: str
    source: str
    sha256: str | None


class FeatureRunRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    status: str
    corpus: CorpusRead
    num_windows: int
    max_length: int
    samples_requested: int | None
    num_samples: int
    num_tokens: int
    device: str
    dtype: str
    seconds: float
    started_at: datetime
    finished_at: datetime | None
    special_tokens: dict[str, Any]
    config: dict[str, Any]


class ModelRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    name: str
    source: str
    revision: str | None
    architecture: str
    num_layers: int
    num_heads: int
    current_clustering_id: int | None
    created_at: datetime


class ClusterShare(BaseModel):
    name: str
    size: int
    share: float


class ClusteringSummary(BaseModel):
    id: int
    algorithm: str
    k: int
    seed: int
    clusters: list[ClusterShare]


class LayerTypes(BaseModel):
    layer: int
    counts: dict[str, int]


class ModelDetail(ModelRead):
    feature_runs: list[FeatureRunRead]
    clustering: ClusteringSummary | None
    layers: list[LayerTypes]


class ModelDeleted(BaseModel):
    name: str
    heads: int
    clusterings: int
