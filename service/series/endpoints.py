"""``/series``: a model's checkpoints as one series, and its heads' trajectories (SPEC 11)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Query, Request

from service.deps import SessionDep
from service.errors import InvalidInput
from service.series import service
from service.series.schemas import SeriesDetail, SeriesHeads, SeriesRead

router = APIRouter(prefix="/series", tags=["series"])

SeriesName = Path(description="the series' unique name", max_length=200)


HEAD_PARAMETERS = frozenset({"score", "stack", "layer", "head", "order"})


async def reject_unknown_parameters(request: Request) -> None:
    """A misspelt parameter (``lyer=1``) must not silently widen the answer: 422 naming it."""
    allowed = HEAD_PARAMETERS if request.url.path.endswith("/heads") else frozenset()
    unknown = sorted(set(request.query_params) - allowed)
    if unknown:
        takes = ", ".join(sorted(allowed)) or "no parameters"
        raise InvalidInput(f"{unknown[0]}: unknown query parameter; this takes {takes}", field=unknown[0])


@router.get("", response_model=list[SeriesRead], dependencies=[Depends(reject_unknown_parameters)])
def list_series(session: SessionDep) -> list[SeriesRead]:
    """Every series with its step count and first and last step."""
    return service.list_series(session)


@router.get("/{name}", response_model=SeriesDetail, dependencies=[Depends(reject_unknown_parameters)])
def get_series(session: SessionDep, name: str = SeriesName) -> SeriesDetail:
    """The series' steps in order: each step's model, revision, current feature and detection runs (repeat gain)
    and current clustering."""
    return service.series_detail(session, name)


@router.get("/{name}/heads", response_model=SeriesHeads, dependencies=[Depends(reject_unknown_parameters)])
def series_heads(
    session: SessionDep,
    name: str = SeriesName,
    score: Annotated[str, Query(max_length=32, description=f"one of {', '.join(service.SCORES)}")] = "induction",
    stack: Annotated[Literal["encoder", "decoder", "cross"] | None, Query()] = None,
    layer: Annotated[int | None, Query(ge=0, le=100_000)] = None,
    head: Annotated[int | None, Query(ge=0, le=100_000)] = None,
    order: Annotated[
        str | None, Query(max_length=16, description="formed_at or -formed_at: by the score's formation step")
    ] = None,
) -> SeriesHeads:
    """Each head's ``score`` by step, its type and margin by step, and per role its formation step: the first
    step from which it has the role at every later step (null when it does not hold to the end)."""
    return service.series_heads(session, name, score=score, stack=stack, layer=layer, head=head, order=order)
