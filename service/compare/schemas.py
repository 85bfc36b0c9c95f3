"""What ``GET /compare`` answers."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ComparedModel(BaseModel):
    name: str
    num_layers: int
    num_heads: int
    clustering_id: int = Field(description="the clustering whose types are compared")


class ChangedHead(BaseModel):
    layer: int
    head: int
    types: dict[str, str] = Field(description="model -> type of this head")


class ModelChanges(BaseModel):
    model: str
    changed: int = Field(description="heads whose type differs from the baseline's")
    total: int
    by_layer: list[int] = Field(description="changed heads per layer")
    transitions: dict[str, dict[str, int]] = Field(
        description="baseline type -> this model's type -> heads (unchanged heads on the diagonal)"
    )


class Comparison(BaseModel):
    baseline: str = Field(description="the first model named; the others are compared with it")
    stack: str = Field(description="the stack compared (encoder | decoder | cross); layers count within it")
    models: list[ComparedModel]
    joint: bool = Field(
        description="true when all models' types come from one (joint) clustering; otherwise each model's types "
        "come from its own clustering, named by the same rule (SPEC section 2)"
    )
    types: dict[str, list[list[str]]] = Field(description="model -> [layer][head] -> type")
    changed: list[ChangedHead] = Field(description="heads whose type differs between the baseline and any other model")
    counts: list[ModelChanges] = Field(description="one entry per model after the baseline")
