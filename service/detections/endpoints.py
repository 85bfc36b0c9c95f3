"""``/detections`` and ``/models/{name}/detections``: start detection runs and read the heads' roles."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Request, status

from service.auth.deps import KEY_RESPONSES, RequireKey
from service.deps import SessionDep
from service.detections import service
from service.detections.schemas import (
    DetectionCreate,
    DetectionSettings,
    ExampleMap,
    ModelDetections,
    SeriesDetectionsAccepted,
    SeriesStepJob,
    SeriesStepSkipped,
)
from service.jobs.endpoints import accept
from service.jobs.schemas import JobAccepted
from service.sources import data_file

router = APIRouter(tags=["detections"])

ModelName = Annotated[str, Path(description="the model's unique catalog name", max_length=200)]


@router.post(
    "/detections",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=JobAccepted,
    dependencies=[RequireKey],
    responses=KEY_RESPONSES,
)
def create_detection(body: DetectionCreate, session: SessionDep, request: Request) -> JobAccepted:
    """Queue a detection run on the ``gpu`` queue; ``GET /jobs/{id}`` shows sequences done of total.

    Checked before anything is queued: the model, copies >= 2, thresholds in [0, 1], and what the
    model's config and tokenizer allow (``length`` within its non-special tokens, the sequence
    within its positions). An identical request already queued or running is handed back.
    """
    if body.corpus is not None:
        body = body.model_copy(update={"corpus": data_file(body.corpus, request.app.state.settings, "corpus")})
    service.validate(session, body)
    return accept(session, request, "detection", body.model_dump(mode="json"))


@router.post(
    "/series/{name}/detections",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=SeriesDetectionsAccepted,
    dependencies=[RequireKey],
    responses=KEY_RESPONSES,
)
def create_series_detections(
    body: DetectionSettings,
    session: SessionDep,
    request: Request,
    name: Annotated[str, Path(description="the series' unique name", max_length=200)],
) -> SeriesDetectionsAccepted:
    """Queue one detection run per step of the series, in step order, with the same sequences (SPEC 11); a step
    whose current run already asked these sequences and thresholds is skipped, so adding a checkpoint and asking
    again queues only it. Every step is checked before any job is queued."""
    if body.corpus is not None:
        body = body.model_copy(update={"corpus": data_file(body.corpus, request.app.state.settings, "corpus")})
    todo, skipped = service.plan_series(session, name, body)
    jobs = [
        SeriesStepJob(step=step, model=step_request.model,
                      job=accept(session, request, "detection", step_request.model_dump(mode="json")))
        for step, step_request in todo
    ]  # fmt: skip
    return SeriesDetectionsAccepted(
        series=name,
        jobs=jobs,
        skipped=[SeriesStepSkipped(step=step, model=model, detection_run=run) for step, model, run in skipped],
    )


@router.get("/models/{name}/detections", response_model=ModelDetections)
def get_model_detections(session: SessionDep, name: ModelName) -> ModelDetections:
    """The model's detection runs (newest first: config, thresholds, repeat gain) and every head of the
    current one (PUT /models/{name}/current/detections) with its four scores and roles."""
    return service.model_detections(session, name)


@router.get("/models/{name}/detections/example", response_model=ExampleMap)
def get_example_map(
    session: SessionDep,
    name: ModelName,
    stack: Annotated[Literal["encoder", "decoder", "cross"], Query()],
    layer: Annotated[int, Query(ge=0, le=10_000)],
    head: Annotated[int, Query(ge=0, le=10_000)],
) -> ExampleMap:
    """One head's attention map on the current run's first sequence (the web page's example)."""
    return service.example_map(session, name, stack, layer, head)
