"""``/heads``: "all vertical heads above layer 18 in the MNLI model"."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any

from fastapi import APIRouter, Query
from sqlalchemy import Row

from ingest.types import SCALARS, feature_names
from service.deps import SessionDep
from service.errors import InvalidInput, NotFound, known
from service.heads import repository
from service.heads.repository import HeadFilter
from service.heads.schemas import HeadPage, HeadRead
from service.models import repository as models
from service.orm import Clustering

router = APIRouter(tags=["heads"])

MAX_LAYER = 100_000
LayerBound = Annotated[int | None, Query(ge=-1, le=MAX_LAYER)]


@router.get("/heads", response_model=HeadPage)
def list_heads(
    session: SessionDep,
    model: Annotated[str | None, Query(max_length=200, description="catalog name of the model")] = None,
    type: Annotated[str | None, Query(max_length=64, description="head type (cluster name)")] = None,
    layer_gt: LayerBound = None,
    layer_ge: LayerBound = None,
    layer_lt: LayerBound = None,
    layer_le: LayerBound = None,
    head: Annotated[int | None, Query(ge=0, le=MAX_LAYER)] = None,
    clustering: Annotated[
        int | None, Query(ge=1, le=2**31 - 1, description="clustering id; default: the model's current one")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
) -> HeadPage:
    """Heads with layer, head, type, the distance features by name and the scalars.

    Without ``clustering`` each model's current clustering gives the types. A model that has
    not been clustered yet lists its heads with the latest feature run and no type.
    """
    filters = HeadFilter(
        type=type, layer_gt=layer_gt, layer_ge=layer_ge, layer_lt=layer_lt, layer_le=layer_le, head=head
    )
    model_id = types_from = None
    if model is not None:
        catalog_model = models.require(session, model)
        model_id, types_from = catalog_model.id, catalog_model.current_clustering_id
        filters = replace(filters, model_id=model_id)
        if clustering is None and catalog_model.current_clustering_id is None:
            run = models.latest_complete_run(session, model_id)
            if run is None:
                raise NotFound(f"model: {model!r} has no complete feature run yet", field="model")
            if type is not None:
                raise InvalidInput(
                    f"type: {model!r} has not been clustered yet, so its heads have no type; "
                    f"run `headcat cluster {model}` first",
                    field="type",
                )
            filters = replace(filters, feature_run_id=run.id)
    if clustering is not None:
        _require_clustering(session, clustering, model_id)
        filters = replace(filters, clustering_id=clustering)
        types_from = clustering
    if type is not None:
        names = repository.type_names(session, types_from)
        if type not in names:
            raise InvalidInput(f"type: unknown head type {type!r}; known types: {known(names)}", field="type")

    rows = repository.page(session, filters, limit=limit, offset=offset)
    return HeadPage(
        total=repository.count(session, filters),
        limit=limit,
        offset=offset,
        items=[_head(row) for row in rows],
    )


def _require_clustering(session: SessionDep, clustering_id: int, model_id: int | None) -> None:
    if session.get(Clustering, clustering_id) is None:
        raise NotFound(f"clustering: no clustering with id {clustering_id}", field="clustering")
    if model_id is not None and not repository.clustering_covers_model(session, clustering_id, model_id):
        raise InvalidInput(f"clustering: clustering {clustering_id} does not include this model", field="clustering")


def _head(row: Row[Any]) -> HeadRead:
    return HeadRead(
        model=row.model,
        layer=row.layer,
        head=row.head,
        type=getattr(row, "name", None),
        clustering_id=getattr(row, "clustering_id", None),
        feature_run_id=row.feature_run_id,
        features=dict(zip(feature_names(row.num_windows), row.vector, strict=True)),
        scalars={name: getattr(row, name) for name in SCALARS},
    )
