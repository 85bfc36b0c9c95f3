"""What the API says about models and their feature runs."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from service.errors import RequestBody


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


class StackShape(BaseModel):
    layers: int
    heads: int = Field(description="query heads per layer")
    kv_heads: int | None = Field(default=None, description="key/value heads per layer (fewer than heads: grouped)")


class ImportedFrom(BaseModel):
    """Where an imported model came from (``headcat catalog import``)."""

    model_config = ConfigDict(from_attributes=True)

    id: int = Field(description="the import")
    origin: str = Field(description="the archive's directory, or hub:OWNER/NAME@COMMIT")
    archive_sha256: str = Field(description="SHA-256 of the archive's manifest.json (which holds every file's)")
    headcat_version: str = Field(description="the headcat that exported it")
    exported_at: datetime | None
    imported_at: datetime
    renames: dict[str, str] = Field(description="archive name -> catalog name of the models renamed on import")


class ModelRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    name: str
    source: str
    revision: str | None = Field(description="the hub commit it was loaded from (resolved from requested_revision); "
                                 "null for a local directory")  # fmt: skip
    requested_revision: str | None = Field(
        default=None, description="the hub revision asked for (branch, tag or commit, e.g. step1000); null: none"
    )
    series: str | None = Field(
        default=None,
        validation_alias=AliasChoices("series_name", "series"),
        description="the series this model is a step of (GET /series/{name}); null for a lone model",
    )
    step: int | None = Field(default=None, description="its training step in its series; null for a lone model")
    architecture: str
    num_layers: int = Field(description="layers of the first stack (encoder, else decoder)")
    num_heads: int = Field(description="query heads per layer of the first stack")
    num_key_value_heads: int | None = Field(
        description="key/value heads per layer when fewer than the query heads (grouped), else null"
    )
    stacks: dict[str, StackShape] = Field(description="encoder | decoder | cross -> its shape (SPEC section 6)")
    current_clustering_id: int | None
    created_at: datetime
    imported: ImportedFrom | None = Field(
        default=None,
        validation_alias=AliasChoices("catalog_import", "imported"),
        description="null: ingested in this catalog; else the archive it was imported from",
    )


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
    stack: str
    layer: int = Field(description="0-based within its stack")
    counts: dict[str, int]


class ModelDetail(ModelRead):
    feature_runs: list[FeatureRunRead]
    current_runs: dict[str, int | None] = Field(
        description="lens -> the run served (features, clustering, stability of the current clustering, importance, "
        "attribution, syntax, detections; null: none yet); PUT /models/{name}/current/{lens} chooses one"
    )
    clustering: ClusteringSummary | None
    layers: list[LayerTypes]


class ModelDeleted(BaseModel):
    name: str
    heads: int
    clusterings: int


LensName = Literal["features", "clustering", "stability", "importance", "attribution", "syntax", "detections"]


class CurrentRuns(BaseModel):
    """The run each lens of a model serves (``service/current.py``); null: none yet."""

    model: str
    features: int | None = Field(description="feature run (the features of an unclustered model's heads)")
    clustering: int | None = Field(description="clustering: the heads' types (a clustering of its attention)")
    stability: int | None = Field(description="stability run of the current clustering: agreement")
    importance: int | None = Field(description="importance run (SPEC 7)")
    attribution: int | None = Field(description="attribution run (SPEC 8)")
    syntax: int | None = Field(description="syntax run (SPEC 9)")
    detections: int | None = Field(description="detection run (SPEC 10)")


class CurrentChoice(RequestBody):
    """Which run the lens serves from now on."""

    run_id: int = Field(
        ge=1, le=2**31 - 1, description="a complete run of the model (a clustering or stability run covering it)"
    )
