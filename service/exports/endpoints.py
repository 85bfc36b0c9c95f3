"""``GET /models/{name}/export``: a selection of heads for pruning tools."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query
from fastapi.responses import JSONResponse, Response

from ingest.types import Stack
from service.deps import SessionDep
from service.exports.schemas import (
    DEFAULT_SCORE,
    FORMAT_DESCRIPTION,
    SCORE_DESCRIPTION,
    SELECTION_DESCRIPTION,
    ExportFormat,
)
from service.exports.service import Selection, export, parse_heads, split_names

router = APIRouter(tags=["exports"])

MAX_INDEX = 100_000
Layer = Annotated[int | None, Query(ge=-1, le=MAX_INDEX)]
Types = Annotated[list[str] | None, Query(max_length=64)]

EXAMPLES = {
    "prune_heads": {"summary": "prune_heads", "value": {"0": [3, 7], "5": [1]}},
    "head_mask": {"summary": "head_mask (1 = keep)", "value": [[1, 1, 0, 1], [0, 1, 1, 1]]},
    "scores": {"summary": "scores (null outside the selection)", "value": [[0.12, 0.4], [None, 0.93]]},
    "pairs": {"summary": "pairs", "value": [[0, 3], [0, 7], [5, 1]]},
}


@router.get(
    "/models/{name}/export",
    description=SELECTION_DESCRIPTION,
    responses={
        200: {
            "description": "the export, in the requested form",
            "content": {
                "application/json": {"examples": EXAMPLES},
                "application/x-npy": {"schema": {"type": "string", "format": "binary"}},
                "text/csv": {"schema": {"type": "string"}},
            },
        },
        404: {"description": "no such model or clustering"},
        422: {"description": "bad input; `field` names the parameter"},
    },
)
def export_heads(
    session: SessionDep,
    name: Annotated[str, Path(max_length=200, description="the model's unique catalog name")],
    format: Annotated[ExportFormat, Query(description=FORMAT_DESCRIPTION)] = "prune_heads",
    type: Annotated[
        Types, Query(description="select heads of these types (repeat, or a comma list: type=dense,vertical)")
    ] = None,
    exclude_type: Annotated[Types, Query(description="leave out heads of these types (repeat, or comma list)")] = None,
    layer_gt: Layer = None,
    layer_ge: Layer = None,
    layer_lt: Layer = None,
    layer_le: Layer = None,
    head: Annotated[int | None, Query(ge=0, le=MAX_INDEX, description="select this head index in each layer")] = None,
    heads: Annotated[
        str | None,
        Query(
            max_length=100_000,
            description="explicit heads, comma separated: LAYER:HEAD (in every covered stack) or STACK:LAYER:HEAD, "
            "e.g. 0:1,decoder:5:11",
        ),
    ] = None,
    stack: Annotated[
        Stack | None,
        Query(description="export this stack only (encoder | decoder | cross); default: every stack of the model"),
    ] = None,
    clustering: Annotated[
        int | None, Query(ge=1, le=2**31 - 1, description="clustering id for the types; default: the current one")
    ] = None,
    min_agreement: Annotated[
        float | None,
        Query(ge=0, le=1, description="only heads whose type agreement (current stability run) is at least this"),
    ] = None,
    min_margin: Annotated[
        float | None, Query(ge=-1, le=1, description="select only heads whose type margin is at least this")
    ] = None,
    role: Annotated[
        Types, Query(description="select heads with any of these roles in the current detection run (SPEC 10)")
    ] = None,
    score: Annotated[str, Query(max_length=64, description=SCORE_DESCRIPTION)] = DEFAULT_SCORE,
    lowest: Annotated[
        str | None,
        Query(
            max_length=16,
            description="of the selected heads, this count (12) or share of all heads (30%) lowest "
            "by `score`; with score=importance, the heads to prune first (Michel et al.)",
        ),
    ] = None,
) -> Response:
    selection = Selection(
        types=split_names(type),
        exclude_types=split_names(exclude_type),
        layer_gt=layer_gt,
        layer_ge=layer_ge,
        layer_lt=layer_lt,
        layer_le=layer_le,
        head=head,
        heads=parse_heads(heads),
        clustering_id=clustering,
        stack=stack,
        lowest=lowest,
        min_agreement=min_agreement,
        min_margin=min_margin,
        roles=split_names(role),
    )
    result = export(session, name, selection, format, score)
    headers = {
        "X-Headcat-Clustering": str(result.clustering_id) if result.clustering_id is not None else "none",
        "X-Headcat-Selected": str(result.selected),
    }
    if isinstance(result.content, bytes | str):
        headers["Content-Disposition"] = f'attachment; filename="{result.filename}"'
        return Response(result.content, media_type=result.media_type, headers=headers)
    return JSONResponse(result.content, headers=headers)
