"""``GET /compare``: which heads change type between models (pre-trained vs fine-tuned)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from ingest.types import Stack
from service.compare.schemas import Comparison
from service.compare.service import compare
from service.deps import SessionDep
from service.exports.service import split_names

router = APIRouter(tags=["compare"])


@router.get("/compare", response_model=Comparison)
def compare_models(
    session: SessionDep,
    models: Annotated[
        list[str],
        Query(
            max_length=2000,
            description="two or more catalog names, comma separated or repeated; the first is the baseline",
        ),
    ],
    clustering: Annotated[
        int | None,
        Query(ge=1, le=2**31 - 1, description="a clustering that includes every model; default: each one's current"),
    ] = None,
    stack: Annotated[
        Stack | None,
        Query(description="the stack to compare (encoder | decoder | cross); default: the first model's first stack"),
    ] = None,
) -> Comparison:
    """Per-head types of each model, the heads whose type differs from the first model's, and
    counts per model: changed heads, per layer, and a baseline-type x model-type table.

    One stack is compared (`stack`; by default the first model's first stack: `encoder`, or
    `decoder` for decoder-only models); it must have the same number of layers and heads in every
    model. Cluster them jointly (`headcat cluster base tuned-1 tuned-2`) so that one set of
    centroids names every head;
    `joint` says whether that is the case."""
    return compare(session, split_names(models), clustering, stack)
