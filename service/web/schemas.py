"""What the page's read endpoints answer: one head in detail, and example maps per type."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field


class ExampleMap(BaseModel):
    feature_run_id: int
    tokens: list[str] = Field(description="the tokens of the feature run's example (its first sample)")
    labels: list[str] = Field(
        description="per row (query) and column (key) of the map: the tokens averaged into that cell, space-separated"
    )
    map: list[list[float]] = Field(description="(m, m) attention probabilities, rows = queries, downsampled by mean")


class TypeHistoryItem(BaseModel):
    clustering_id: int
    type: str
    algorithm: str
    k: int
    seed: int
    vector: str = Field(description="what was clustered: local (attention features) | global (attribution vectors)")
    created_at: datetime
    current: bool = Field(description="whether this is the model's current clustering")
    models: list[str] = Field(description="models clustered jointly in this clustering")


class HeadDetail(BaseModel):
    model: str
    stack: str = Field(description="encoder | decoder | cross; layers count within the stack")
    layer: int = Field(description="0-based, as in transformers")
    head: int = Field(description="0-based, as in transformers")
    num_layers: int = Field(description="layers of the head's stack")
    num_heads: int = Field(description="query heads per layer of the head's stack")
    kv_heads: int | None = Field(default=None, description="key/value heads per layer of the stack, when grouped")
    kv_head: int | None = Field(
        default=None, description="the key/value head this query head shares with the others of its group"
    )
    type: str | None = Field(description="type in the clustering used; null before any clustering")
    clustering_id: int | None
    feature_run_id: int
    features: dict[str, float] = Field(description="w0..w{N-1}, self, cls, sep, period, comma (SPEC section 1)")
    scalars: dict[str, float | None]
    centroid: dict[str, float] | None = Field(description="the centroid of the head's cluster, by feature name")
    centroid_distance: float | None = Field(description="Euclidean distance of the head's vector to that centroid")
    stable: bool | None = Field(description="kept its type in all fits of the clustering's current stability run")
    stability_run_id: int | None
    history: list[TypeHistoryItem] = Field(description="the head's type in every clustering it is in, oldest first")
    example: ExampleMap | None


class TypeExample(BaseModel):
    stack: str
    layer: int
    head: int
    centroid_distance: float
    map: list[list[float]]


class TypeExamples(BaseModel):
    model: str
    clustering_id: int | None
    feature_run_id: int | None
    tokens: list[str]
    labels: list[str]
    types: dict[str, list[TypeExample]] = Field(
        description="per type (cluster order): the heads nearest their centroid, with their example maps"
    )
