"""The web page (``/`` and its static files) and the read endpoints it needs.

The page is plain HTML, CSS and JavaScript served from ``static/``: nothing is fetched from
elsewhere at run time, and there is no build step.
"""

from __future__ import annotations

from pathlib import Path as FilePath
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Path, Query
from fastapi.responses import FileResponse, JSONResponse

from ingest.types import HEAD_TYPES, SCALARS, Stack, feature_names
from service.deps import SessionDep
from service.errors import InvalidInput, NotFound
from service.exports.service import HeadTable, Selection, resolve
from service.models import repository as models
from service.web import repository
from service.web.palette import palette
from service.web.schemas import ExampleMap, HeadDetail, TypeExample, TypeExamples, TypeHistoryItem

router = APIRouter()
page_router = APIRouter()  # the page and its files: no data, open even when reads need a key

STATIC = FilePath(__file__).parent / "static"
MEDIA_TYPES = {".html": "text/html", ".css": "text/css", ".js": "text/javascript", ".svg": "image/svg+xml",
               ".png": "image/png", ".ico": "image/x-icon"}  # fmt: skip
ASSETS = {p.name: p for p in STATIC.iterdir() if p.suffix in MEDIA_TYPES} if STATIC.is_dir() else {}

Name = Annotated[str, Path(max_length=200, description="the model's unique catalog name")]
ClusteringId = Annotated[
    int | None, Query(ge=1, le=2**31 - 1, description="clustering id; default: the model's current one")
]


@page_router.get("/", include_in_schema=False)
def page() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})


@page_router.get("/static/{filename}", include_in_schema=False)
def asset(filename: Annotated[str, Path(max_length=100)]) -> FileResponse:
    path = ASSETS.get(filename)  # only the files shipped in static/, never a path built from input
    if path is None:
        raise NotFound(f"filename: no static file {filename!r}", field="filename")
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers={"Cache-Control": "no-cache"})


@page_router.get("/palette.json", include_in_schema=False)
def palette_json() -> JSONResponse:
    return JSONResponse(palette())


@router.get("/models/{name}/heads/{layer}/{head}", response_model=HeadDetail, tags=["heads"])
def get_head(
    session: SessionDep,
    name: Name,
    layer: Annotated[int, Path(ge=0, le=100_000, description="0-based layer")],
    head: Annotated[int, Path(ge=0, le=100_000, description="0-based head")],
    clustering: ClusteringId = None,
    stack: Annotated[
        Stack | None,
        Query(description="encoder | decoder | cross; needed when the model has several stacks"),
    ] = None,
) -> HeadDetail:
    """One head of one stack: type, features, scalars, its cluster's centroid, stability, its type
    in every clustering it is in, its example attention map with the example's tokens, and the
    key/value head it shares with its group (grouped key/value heads)."""
    shapes = models.shapes(models.require(session, name, field="name"))
    if stack is None and len(shapes) > 1:
        raise InvalidInput(f"stack: {name!r} has the stacks {', '.join(shapes)}; say which with stack=", field="stack")
    chosen: Stack = next(iter(shapes)) if stack is None else stack
    table = resolve(session, name, Selection(clustering_id=clustering, stack=chosen))
    model = table.model
    num_layers, num_heads = table.shape
    if layer >= num_layers:
        raise InvalidInput(f"layer: {name!r} {chosen} has layers 0..{num_layers - 1}, not {layer}", field="layer")
    if head >= num_heads:
        raise InvalidInput(f"head: {name!r} {chosen} has heads 0..{num_heads - 1}, not {head}", field="head")
    kv_heads = kv_heads_of(model.stacks, chosen, num_heads)
    row = next((r for r in table.rows if (r.layer, r.head) == (layer, head)), None)
    if row is None:
        raise NotFound(f"head: {name!r} has no features for head {layer}:{head}", field="head")
    names = feature_names(row.num_windows)
    clustering_id = table.clustering_id
    typed = clustering_id is not None
    vector = np.asarray(row.vector, dtype=np.float64)
    centroid = np.asarray(row.centroid, dtype=np.float64) if typed else None
    stability = (
        repository.latest_stability(session, clustering_id, model.id, row.head_id)
        if clustering_id is not None
        else None
    )
    history = repository.type_history(session, model.id, row.head_id)
    joint = repository.clustering_models(session, [h.clustering_id for h in history])
    maps = repository.example_maps(session, model.id, row.feature_run_id, [row.head_id])
    return HeadDetail(
        model=model.name,
        stack=chosen,
        layer=layer,
        head=head,
        num_layers=num_layers,
        num_heads=num_heads,
        kv_heads=kv_heads,
        kv_head=None if kv_heads is None else head // (num_heads // kv_heads),
        type=row.type if typed else None,
        clustering_id=table.clustering_id,
        feature_run_id=row.feature_run_id,
        features=dict(zip(names, row.vector, strict=True)),
        scalars={s: getattr(row, s) for s in SCALARS},
        centroid=dict(zip(names, centroid.tolist(), strict=True)) if centroid is not None else None,
        centroid_distance=float(np.linalg.norm(vector - centroid)) if centroid is not None else None,
        stable=stability[1] if stability else None,
        stability_run_id=stability[0] if stability else None,
        history=[
            TypeHistoryItem(
                clustering_id=h.clustering_id,
                type=h.type,
                algorithm=h.algorithm,
                k=h.k,
                seed=h.seed,
                vector=h.vector,
                created_at=h.created_at,
                current=h.clustering_id == model.current_clustering_id,
                models=joint.get(h.clustering_id, []),
            )  # fmt: skip
            for h in history
        ],
        example=_example(session, row.feature_run_id, maps.get(row.head_id)),
    )


@router.get("/models/{name}/type-examples", response_model=TypeExamples, tags=["heads"])
def type_examples(
    session: SessionDep,
    name: Name,
    per_type: Annotated[int, Query(ge=1, le=20, description="heads per type")] = 3,
    clustering: ClusteringId = None,
) -> TypeExamples:
    """Real attention maps per type: the ``per_type`` heads of the model nearest their cluster's
    centroid (the most typical ones), each with its downsampled map of the run's example sample.
    A model without a clustering has no types, so ``types`` is empty."""
    table = resolve(session, name, Selection(clustering_id=clustering))
    if table.clustering_id is None or not table.rows:
        return TypeExamples(model=name, clustering_id=None, feature_run_id=None, tokens=[], labels=[], types={})
    picks = _most_typical(table, per_type)
    run_id = table.rows[0].feature_run_id
    heads = [row.head_id for rows in picks.values() for row, _ in rows]
    maps = repository.example_maps(session, table.model.id, run_id, heads)
    example = _example(session, run_id, next(iter(maps.values()), None))
    return TypeExamples(
        model=name,
        clustering_id=table.clustering_id,
        feature_run_id=run_id,
        tokens=example.tokens if example else [],
        labels=example.labels if example else [],
        types={
            kind: [
                TypeExample(
                    stack=row.stack, layer=row.layer, head=row.head, centroid_distance=distance, map=maps[row.head_id]
                )
                for row, distance in rows
                if row.head_id in maps
            ]
            for kind, rows in picks.items()
        },
    )


def _most_typical(table: HeadTable, per_type: int) -> dict[str, list[tuple[Any, float]]]:
    by_type: dict[str, list[tuple[Any, float]]] = {}
    for row in table.rows:
        distance = float(np.linalg.norm(np.asarray(row.vector) - np.asarray(row.centroid)))
        by_type.setdefault(row.type, []).append((row, distance))
    order = sorted(by_type, key=type_order)
    return {kind: sorted(by_type[kind], key=lambda r: r[1])[:per_type] for kind in order}


def kv_heads_of(stacks: dict[str, Any] | None, stack: str, num_heads: int) -> int | None:
    """Key/value heads per layer of ``stack`` when grouped (fewer than ``num_heads``), else None.

    Query head ``h`` of a layer reads key/value head ``h // (num_heads // kv_heads)``, as
    transformers' ``repeat_kv`` lays them out.
    """
    kv = (stacks or {}).get(stack, {}).get("kv_heads")
    if not isinstance(kv, int) or kv <= 0 or kv >= num_heads or num_heads % kv:
        return None
    return kv


def type_order(name: str) -> tuple[int, str]:
    """The four named types in the paper's order, then any other cluster name alphabetically."""
    return (HEAD_TYPES.index(name), "") if name in HEAD_TYPES else (len(HEAD_TYPES), name)  # type: ignore[arg-type]


def _example(session: SessionDep, feature_run_id: int, example_map: list[list[float]] | None) -> ExampleMap | None:
    if example_map is None:
        return None
    tokens = repository.example_tokens(session, feature_run_id) or []
    return ExampleMap(
        feature_run_id=feature_run_id, tokens=tokens, labels=bin_labels(tokens, len(example_map)), map=example_map
    )


def bin_labels(tokens: list[str], bins: int) -> list[str]:
    """The tokens ``adaptive_avg_pool2d`` averages into each of ``bins`` cells, space-separated."""
    n = len(tokens)
    if n == 0 or bins == 0:
        return []
    return [" ".join(tokens[(i * n) // bins : -(-((i + 1) * n) // bins)]) for i in range(bins)]
