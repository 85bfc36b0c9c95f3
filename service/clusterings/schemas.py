"""Clustering and stability requests and results."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.errors import RequestBody

Algorithm = Literal["kmeans", "gmm"]
Vector = Literal["local", "global"]


class ClusteringCreate(RequestBody):
    """Cluster the heads of the models' current feature runs (or of explicit runs), jointly."""

    models: list[str] = Field(default=[], max_length=100, description="catalog names; clustered jointly")
    series: str | None = Field(
        default=None,
        max_length=200,
        description="every step of this series, with the models named: one set of centroids over the steps, so a "
        "head's type at one step and at another are comparable (SPEC 11)",
    )
    feature_runs: list[Annotated[int, Field(ge=1, le=2**31 - 1)]] = Field(
        default=[], max_length=100, description="explicit feature run ids"
    )
    algorithm: Algorithm = "kmeans"
    k: int = Field(default=4, ge=2, le=1000, description="number of clusters")
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    stacks: list[Literal["encoder", "decoder", "cross"]] | None = Field(
        default=None,
        max_length=3,
        description="the stacks whose heads are clustered (jointly, one set of centroids); default: every stack "
        "of the named models. Stored in the clustering's params.",
    )

    @field_validator("stacks")
    @classmethod
    def _unique_stacks(cls, stacks: list[str] | None) -> list[str] | None:
        if stacks is not None and not stacks:
            raise ValueError("name at least one stack, or leave stacks out for every stack")
        return None if stacks is None else [s for s in ("encoder", "decoder", "cross") if s in stacks]

    vector: Vector = Field(
        default="local",
        description="local: attention features (the model's current types) | global: attribution features of "
        "each model's current attribution run (SPEC 8); a global clustering does not become current",
    )


class StabilityCreate(RequestBody):
    n_runs: int = Field(default=10, ge=2, le=1000, description="R: fits on random subsets")
    fraction: float = Field(default=0.5, gt=0.0, le=1.0, description="share of heads in each subset")
    seed: int = Field(default=0, ge=0, le=2**31 - 1)


class ClusteringItem(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    algorithm: str
    k: int
    seed: int
    num_heads: int
    created_at: datetime


class ClusterRead(BaseModel):
    index: int
    name: str
    centroid: dict[str, float]
    size: int
    share: float


class ModelShares(BaseModel):
    model: str
    feature_run_id: int
    heads: int
    shares: dict[str, float]
    layers: list[dict[str, int]] = Field(
        description="per layer of the model's first clustered stack: heads of each type (Guan et al. Fig. 3)"
    )
    stacks: dict[str, list[dict[str, int]]] = Field(
        default={}, description="per clustered stack, per layer: heads of each type"
    )


class HeadPoint(BaseModel):
    model: str
    stack: str
    layer: int
    head: int
    type: str
    x: float | None
    y: float | None


class StabilitySummary(BaseModel):
    id: int
    score: float
    n_runs: int
    fraction: float
    created_at: datetime


class ClusteringRead(BaseModel):
    id: int
    algorithm: str
    k: int
    seed: int
    num_windows: int
    num_heads: int
    params: dict[str, Any]
    seconds: float | None
    created_at: datetime
    current_for: list[str] = Field(description="models whose current clustering this is")
    clusters: list[ClusterRead]
    models: list[ModelShares]
    tsne: list[HeadPoint]
    stability: list[StabilitySummary] = Field(description="its stability runs, oldest first")
    current_stability_run_id: int | None = Field(
        description="the stability run served (agreement in GET /heads, the page): the latest to complete, or "
        "one chosen with PUT /models/{name}/current/stability"
    )


class ClusteringCurrent(BaseModel):
    id: int
    current_for: list[str] = Field(description="models whose current clustering this is now")


class StableHead(BaseModel):
    model: str
    stack: str
    layer: int
    head: int
    type: str
    stable: bool
    agreement: float | None = Field(
        description="share of the run's fits giving the head this type (after Hungarian alignment); "
        "null for runs stored before per-head agreement"
    )
    margin: float | None = Field(
        description="(d2 - d1) / max(d1, d2): d1 = distance to the head's own centroid, d2 = to the nearest other"
    )


class StabilityRunRead(BaseModel):
    id: int
    clustering_id: int
    score: float
    n_runs: int
    fraction: float
    random_state: int
    seeds: list[int]
    num_heads: int
    seconds: float
    created_at: datetime
    heads: list[StableHead]
