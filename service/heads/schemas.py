"""What the API says about heads."""

from __future__ import annotations

from pydantic import BaseModel, Field


class HeadRead(BaseModel):
    model: str
    stack: str = Field(description="encoder | decoder | cross; layers count within the stack")
    layer: int = Field(description="0-based, as in transformers")
    head: int = Field(description="0-based, as in transformers")
    type: str | None = Field(description="cluster name in the clustering used; null before any clustering")
    clustering_id: int | None
    feature_run_id: int
    features: dict[str, float] = Field(description="w0..w{N-1}, self, cls, sep, period, comma (SPEC section 1)")
    scalars: dict[str, float | None] = Field(description="entropy, prev_token, next_token, mean_distance, sep_to_sep")
    importance: float | None = Field(
        default=None, description="normalised importance (SPEC 7) of the current run, or of importance_run"
    )
    importance_raw: float | None = Field(default=None, description="mean |dLoss/dxi_h| before normalisation")
    importance_run_id: int | None = None
    discrepancy: float | None = Field(
        default=None, description="mean total variation between attention and attribution rows (SPEC 8)"
    )
    global_features: dict[str, float] | None = Field(
        default=None, description="the 21 features of the head's attribution rows (its global vector)"
    )
    syntax_accuracy: float | None = Field(
        default=None, description="with relation=: accuracy for that relation in the current syntax run (SPEC 9)"
    )
    margin: float | None = Field(
        default=None,
        description="how far the head sits from its cluster's border: (d2 - d1) / max(d1, d2), d1 = distance to "
        "its own centroid, d2 = to the nearest other; 1 on the centroid, 0 exactly between two (< 0: nearer another)",
    )
    agreement: float | None = Field(
        default=None,
        description="share of the clustering's current stability run's fits (Hungarian-aligned) that give the head "
        "this type; null without a stability run",
    )


class HeadPage(BaseModel):
    total: int | None = Field(
        description="heads matching the filters, the same on every page (after= and offset say where a page "
        "starts, not what is counted); counted when the query names its models (model=), "
        "else only with total=true, since a count over every model reads every matching head"
    )
    limit: int
    offset: int
    next: str | None = Field(description="cursor of the next page (pass as after=); null on the last page")
    items: list[HeadRead]
