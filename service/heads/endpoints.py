"""``/heads``: "all vertical heads above layer 18 in the MNLI model", and across models:
"all vertical heads above layer 18 in any model with at least 24 layers", "in every RoBERTa"."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request, Response

from ingest.types import ROLES, Role
from service.deps import SessionDep
from service.errors import InvalidInput, NotFound, known
from service.heads import repository
from service.heads.query import MAX_NAMED_MODELS, ORDERS, Cursor, HeadQuery, PageResult, page
from service.heads.schemas import HeadPage
from service.models import repository as models

router = APIRouter(tags=["heads"])

MAX_LAYER = 100_000
LayerBound = Annotated[int | None, Query(ge=-1, le=MAX_LAYER)]
ShapeBound = Annotated[int | None, Query(ge=0, le=MAX_LAYER)]
Names = Annotated[list[str] | None, Query(max_length=MAX_NAMED_MODELS)]
Score = Annotated[float | None, Query(description="a detector score (current detection run) beyond this")]

PARAMETERS = frozenset({
    "model", "model_prefix", "architecture", "task", "num_layers_ge", "num_layers_le", "num_heads_ge",
    "num_heads_le", "stack", "type", "layer_gt", "layer_ge", "layer_lt", "layer_le", "head", "clustering",
    "after", "limit", "offset", "total", "importance_run", "importance_lt", "importance_gt", "discrepancy_lt",
    "discrepancy_gt", "relation", "direction", "syntax_accuracy_gt", "order", "margin_ge", "margin_lt",
    "agreement_ge", "agreement_lt", "role", "series", "step",
    *(f"{name}_{op}" for name in ROLES for op in ("gt", "lt")),
})  # fmt: skip
ORDER_VALUES = sorted([*ORDERS, *(f"-{name}" for name in ORDERS)])


async def reject_unknown_parameters(request: Request) -> None:
    """A misspelt filter (``layer_gte=18``) must not silently widen the answer: 422 naming it.
    (``async``: no I/O, so no thread hop.)"""
    unknown = sorted(set(request.query_params) - PARAMETERS)
    if unknown:
        raise InvalidInput(
            f"{unknown[0]}: unknown query parameter; GET /heads takes {', '.join(sorted(PARAMETERS))}",
            field=unknown[0],
        )


@router.get("/heads", response_model=HeadPage, dependencies=[Depends(reject_unknown_parameters)])
def list_heads(
    session: SessionDep,
    model: Annotated[Names, Query(description="catalog name of a model; repeat for several; none: every model")] = None,
    model_prefix: Annotated[
        str | None, Query(min_length=1, max_length=200, description="models whose name starts so")
    ] = None,
    architecture: Annotated[Names, Query(description="transformers model_type, e.g. roberta; repeatable")] = None,
    task: Annotated[Names, Query(description="the model's head, e.g. sequence-classification; repeatable")] = None,
    num_layers_ge: ShapeBound = None,
    num_layers_le: ShapeBound = None,
    num_heads_ge: ShapeBound = None,
    num_heads_le: ShapeBound = None,
    stack: Annotated[Literal["encoder", "decoder", "cross"] | None, Query()] = None,
    type: Annotated[str | None, Query(max_length=64, description="head type (cluster name)")] = None,
    layer_gt: LayerBound = None,
    layer_ge: LayerBound = None,
    layer_lt: LayerBound = None,
    layer_le: LayerBound = None,
    head: Annotated[int | None, Query(ge=0, le=MAX_LAYER)] = None,
    clustering: Annotated[
        int | None, Query(ge=1, le=2**31 - 1, description="clustering id; default: each model's current one")
    ] = None,
    after: Annotated[str | None, Query(min_length=1, max_length=1000, description="a page's `next` cursor")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
    total: Annotated[bool | None, Query(description="count the matches; default: only when model= is given")] = None,
    importance_run: Annotated[
        int | None, Query(ge=1, le=2**31 - 1, description="importance scores of this run; default: the current one")
    ] = None,
    importance_lt: Annotated[float | None, Query(description="normalised importance below this")] = None,
    importance_gt: Annotated[float | None, Query(description="normalised importance above this")] = None,
    discrepancy_lt: Annotated[float | None, Query(description="attention-attribution discrepancy below this")] = None,
    discrepancy_gt: Annotated[float | None, Query(description="attention-attribution discrepancy above this")] = None,
    relation: Annotated[
        str | None, Query(min_length=1, max_length=64, description="dependency relation: adds syntax_accuracy")
    ] = None,
    direction: Annotated[
        Literal["dep2head", "head2dep"] | None, Query(description="with relation: one direction; default: the better")
    ] = None,
    syntax_accuracy_gt: Annotated[float | None, Query(description="with relation: accuracy above this")] = None,
    margin_ge: Annotated[
        float | None, Query(ge=-1, le=1, description="type margin at least this: (d2 - d1) / max(d1, d2), in [-1, 1]")
    ] = None,
    margin_lt: Annotated[float | None, Query(ge=-1, le=1, description="type margin below this")] = None,
    agreement_ge: Annotated[
        float | None,
        Query(ge=0, le=1, description="share of the current stability run's fits giving the head its type, at least"),
    ] = None,
    agreement_lt: Annotated[float | None, Query(ge=0, le=1, description="stability agreement below this")] = None,
    role: Annotated[
        list[Role] | None, Query(max_length=4, description="a role in the current detection run; repeat: any of them")
    ] = None,
    induction_gt: Score = None,
    induction_lt: Score = None,
    duplicate_token_gt: Score = None,
    duplicate_token_lt: Score = None,
    previous_token_gt: Score = None,
    previous_token_lt: Score = None,
    sink_gt: Score = None,
    sink_lt: Score = None,
    series: Annotated[
        str | None, Query(min_length=1, max_length=200, description="the steps of this series (SPEC 11)")
    ] = None,
    step: Annotated[int | None, Query(ge=0, le=2**31 - 1, description="with series: the model of this step")] = None,
    order: Annotated[
        str | None,
        Query(
            max_length=32,
            description="importance, discrepancy, syntax_accuracy, margin, agreement, induction, duplicate_token, "
            "previous_token or sink, '-' first for descending "
            "(NULLs last); page such answers with offset",
        ),
    ] = None,
) -> Response:
    """Heads with stack, layer, head, type, the distance features by name and the scalars, in the
    order (model, stack, layer, head).

    Model filters (``model``, ``model_prefix``, ``architecture``, ``task``, ``num_layers_*``,
    ``num_heads_*``) choose the models, head filters their heads. Without ``clustering`` each
    model's current clustering gives the types; a model that has not been clustered yet lists its
    heads with the current feature run and no type. Page with ``after=`` (the previous page's
    ``next``): unlike ``offset`` it reads no skipped rows, and no head is missed or repeated while
    models are added.
    """
    extra = {"importance_run": importance_run, "importance_lt": importance_lt, "importance_gt": importance_gt,
             "discrepancy_lt": discrepancy_lt, "discrepancy_gt": discrepancy_gt, "relation": relation,
             "direction": direction, "syntax_accuracy_gt": syntax_accuracy_gt, "margin_ge": margin_ge,
             "margin_lt": margin_lt, "agreement_ge": agreement_ge, "agreement_lt": agreement_lt,
             "role": list(dict.fromkeys(role)) if role else None, "induction_gt": induction_gt,
             "induction_lt": induction_lt, "duplicate_token_gt": duplicate_token_gt,
             "duplicate_token_lt": duplicate_token_lt, "previous_token_gt": previous_token_gt,
             "previous_token_lt": previous_token_lt, "sink_gt": sink_gt, "sink_lt": sink_lt}  # fmt: skip
    model = _series_models(session, series, step, model)
    _check_sources(session, extra, order, after, model or ())
    names = list(dict.fromkeys(model or ()))
    for name in names:
        if not 0 < len(name) <= 200:
            raise InvalidInput("model: a model name has 1 to 200 characters", field="model")
    query = HeadQuery(
        models=names, model_prefix=model_prefix, architectures=architecture or (), tasks=task or (),
        num_layers_ge=num_layers_ge, num_layers_le=num_layers_le, num_heads_ge=num_heads_ge,
        num_heads_le=num_heads_le, clustering_id=clustering, stack=stack, type=type, layer_gt=layer_gt,
        layer_ge=layer_ge, layer_lt=layer_lt, layer_le=layer_le, head=head,
        after=Cursor.decode(after) if after is not None else None, limit=limit, offset=offset,
        total=bool(names) if total is None else total, extra=extra, order=order,
    )  # fmt: skip
    result = page(session, query)
    _explain_failure(session, query, result)
    next_cursor = f'"{result.last.encode()}"' if result.last is not None else "null"
    count = "null" if result.total is None else str(result.total)
    body = f'{{"total":{count},"limit":{limit},"offset":{offset},"next":{next_cursor},"items":{result.items_json}}}'
    return Response(content=body, media_type="application/json")


def _series_models(
    session: SessionDep, series: str | None, step: int | None, names: list[str] | None
) -> list[str] | None:
    """``series=`` (with ``step=``: one step) as the models it names; refused beside ``model=``."""
    if series is None:
        if step is not None:
            raise InvalidInput("step: a step is a series' step; give series= too", field="step")
        return names
    if names:
        raise InvalidInput("series: give series= or model=, not both", field="series")
    from service.series import repository as series_repository

    found = series_repository.require(session, series, field="series")
    if step is not None:
        return [series_repository.step_model(session, found, step).name]
    steps = [m.name for m in series_repository.steps(session, found.id)]
    if len(steps) > MAX_NAMED_MODELS:
        raise InvalidInput(f"series: {series!r} has {len(steps)} steps; ask for one with step=", field="series")
    return steps


def _check_sources(
    session: SessionDep, extra: Mapping[str, object], order: str | None, after: str | None, names: Sequence[str]
) -> None:
    """The per-head sources' parameters that cannot work, before the query runs."""
    if order is not None:
        if order not in ORDER_VALUES:
            raise InvalidInput(f"order: unknown order {order!r}; known orders: {known(ORDER_VALUES)}", field="order")
        if order.removeprefix("-") == "syntax_accuracy" and extra["relation"] is None:
            raise InvalidInput("order: syntax_accuracy is per relation; give relation= (e.g. dobj)", field="order")
        if after is not None:
            raise InvalidInput("after: cursors page the default order; with order=, page with offset", field="after")
    for name in ("direction", "syntax_accuracy_gt"):
        if extra[name] is not None and extra["relation"] is None:
            raise InvalidInput(f"{name}: needs relation= (e.g. dobj)", field=name)
    run_id = extra["importance_run"]
    if run_id is not None:
        from service.orm import CatalogModel, ImportanceRun

        run = session.get(ImportanceRun, run_id)
        if run is None or run.status != "complete":
            raise NotFound(f"importance_run: no complete importance run with id {run_id}", field="importance_run")
        owner = session.get_one(CatalogModel, run.model_id).name
        if set(names) != {owner}:
            raise InvalidInput(f"importance_run: run {run_id} scores {owner!r}; ask for model={owner} with it",
                               field="importance_run")  # fmt: skip


def _explain_failure(session: SessionDep, q: HeadQuery, result: PageResult) -> None:
    """Turn what the page's statement found out into the 4xx it means (only on those paths do
    further statements run)."""
    if result.models_found < len(q.models):
        for name in q.models:
            models.require(session, name)  # the 404 listing known names
    if result.clustering_found is False:
        raise NotFound(f"clustering: no clustering with id {q.clustering_id}", field="clustering")
    if result.models_uncovered:
        raise InvalidInput(
            f"clustering: clustering {q.clustering_id} does not include "
            f"{'this model' if len(q.models) == 1 else 'every named model'}",
            field="clustering",
        )
    if result.count or q.after is not None or q.offset:
        return
    if len(q.models) == 1 and q.clustering_id is None:
        catalog_model = models.require(session, q.models[0])
        if catalog_model.current_clustering_id is None:
            if models.current_run(session, catalog_model) is None:
                raise NotFound(f"model: {catalog_model.name!r} has no complete feature run yet", field="model")
            if q.type is not None:
                raise InvalidInput(
                    f"type: {catalog_model.name!r} has not been clustered yet, so its heads have no type; "
                    f"run `headcat cluster {catalog_model.name}` first",
                    field="type",
                )
    if q.type is not None:
        names = repository.type_names(session, q.clustering_id)
        if q.type not in names:
            raise InvalidInput(f"type: unknown head type {q.type!r}; known types: {known(names)}", field="type")
