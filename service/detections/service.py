"""Detection runs: validate a request, run it (a ``gpu`` job), store it in the job's final transaction, read it.

Checked before anything is queued (:func:`validate`): the model (in the catalog), the run's
parameters (copies >= 2, thresholds in [0, 1]) and what its config and tokenizer allow (a
sequence no longer than its positions, a length no more than its non-special tokens, at least
2 of them), read from the model's config and tokenizer without loading its weights.
"""

from __future__ import annotations

import logging
import math
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import insert
from sqlalchemy.orm import Session, sessionmaker

from service import current
from service.detections import repository
from service.detections.schemas import (
    DetectionCreate,
    DetectionRunRead,
    DetectionSettings,
    ExampleMap,
    HeadDetectionRead,
    ModelDetections,
)
from service.errors import InvalidInput, NotFound, load_refused
from service.jobs.runner import Progress, Writer
from service.models import repository as models
from service.orm import CatalogModel, DetectionRun, HeadDetection

if TYPE_CHECKING:
    from ingest.detectors import DetectionConfig

log = logging.getLogger(__name__)


def _field(message: str) -> str:
    """The request field a :class:`~ingest.detectors.DetectionError` message names."""
    head = message.split(":", 1)[0].split(" ", 1)[0].split(".", 1)[0]
    fields = ("sequences", "length", "copies", "seed", "thresholds", "batch_size", "corpus")
    return head if head in fields else "model"


def refusal(error: ValueError) -> InvalidInput:
    """A :class:`~ingest.detectors.DetectionError` as the request's error: its field, named once at the start
    (``length: length 22 is ...`` reads ``length 22 is ...``; a message naming no field is the model's)."""
    field = _field(str(error))
    return InvalidInput(f"{field}: {error}".replace(f"{field}: {field}", field), field=field)


def detection_config(request: DetectionCreate) -> DetectionConfig:
    from ingest.detectors import DetectionConfig, DetectionError

    try:
        return DetectionConfig(
            sequences=request.sequences, length=request.length, copies=request.copies, seed=request.seed,
            batch_size=request.batch_size, thresholds=dict(request.thresholds or {}), device=request.device,
            dtype=request.dtype,
        )  # fmt: skip
    except DetectionError as error:
        raise refusal(error) from error


def _config_and_tokenizer(model: CatalogModel) -> tuple[Any, Any]:
    """The model's (text) config and tokenizer, without its weights."""
    from huggingface_hub import constants
    from transformers import AutoConfig, AutoTokenizer

    options = {"revision": model.revision, "trust_remote_code": False, "local_files_only": constants.HF_HUB_OFFLINE}
    try:
        config = AutoConfig.from_pretrained(model.source, **options)
        tokenizer = AutoTokenizer.from_pretrained(model.source, **options)
    except (OSError, ValueError, KeyError, ImportError, TypeError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise InvalidInput(
            f"model: {model.name!r}: its config or tokenizer cannot be read ({first})", field="model"
        ) from error
    return (config.get_text_config() if hasattr(config, "get_text_config") else config), tokenizer


def _texts(request: DetectionCreate) -> list[str] | None:
    """The causal check's corpus texts (None when the request names none)."""
    from ingest.corpora import load_corpus

    if request.corpus is None:
        return None
    try:
        texts = [sample.text for sample in load_corpus(request.corpus).samples(request.corpus_samples) if sample.text]
    except (ValueError, OSError) as error:
        raise InvalidInput(f"corpus: {error}", field="corpus") from error
    if not texts:
        raise InvalidInput(f"corpus: {request.corpus!r} has no text", field="corpus")
    return texts


def same_sequences(stored: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """A stored run asked what ``wanted`` asks: the same sequences (count, length, copies, seed) and thresholds."""
    keys = ("sequences", "length", "copies", "seed", "thresholds")
    return all(stored.get(key) == wanted.get(key) for key in keys)


def plan_series(
    session: Session, series: str, settings: DetectionSettings
) -> tuple[list[tuple[int, DetectionCreate]], list[tuple[int, str, int]]]:
    """Per step of ``series`` in step order, the request still to run, or (step, model, run id) when its current
    run asked the same sequences and thresholds: a failed or new checkpoint costs only its own step (SPEC 11).
    Every request is checked (:func:`validate`) before the first is run or queued."""
    from service.series import repository as series_repository

    found = series_repository.require(session, series, field="series")
    steps = series_repository.steps(session, found.id)
    if not steps:
        raise InvalidInput(f"series: {series!r} has no step; ingest its checkpoints first", field="series")
    todo, skipped = [], []
    for model in steps:
        step = cast(int, model.step)  # a model in a series has its step (the table's series_step constraint)
        request = DetectionCreate.model_validate({**settings.model_dump(), "model": model.name})
        served = current.current_run(session, model, "detections")
        if served is not None and same_sequences(served.config, detection_config(request).to_json()):
            skipped.append((step, model.name, served.id))
            continue
        validate(session, request)
        todo.append((step, request))
    return todo, skipped


def validate(session: Session, request: DetectionCreate) -> CatalogModel:
    from ingest.detectors import DetectionError, plan_for

    model = models.require(session, request.model, field="model")
    if model.task == "causal-lm" and request.check:
        _texts(request.model_copy(update={"corpus_samples": min(request.corpus_samples, 16)}))
    config = detection_config(request)
    text_config, tokenizer = _config_and_tokenizer(model)
    stacks = set(model.stacks or {}) or {"encoder"}
    try:
        plan_for(text_config, tokenizer, stacks, config)
    except DetectionError as error:
        raise refusal(error) from error
    return model


def prepare(sessions: sessionmaker[Session], request: dict[str, Any], progress: Progress) -> Writer:
    """The job handler: load the model (with its LM head where it is a causal LM), score every head."""
    from ingest.detectors import DetectionError, causal_check, detect_heads
    from ingest.loading import load_model

    spec = DetectionCreate.model_validate(request)
    with sessions() as session:
        model = validate(session, spec)
        model_id, name, source, task, revision = model.id, model.name, model.source, model.task, model.revision
    config = detection_config(spec)
    try:
        loaded = load_model(source, device=spec.device, dtype=spec.dtype,
                            task="causal-lm" if task == "causal-lm" else "base", revision=revision)  # fmt: skip
    except ValueError as error:
        raise load_refused(error) from error
    started = datetime.now(UTC)
    log.info("Detecting the heads of %s on %d sequences of %d ids x %d copies", name, config.sequences,
             config.length, config.copies)  # fmt: skip
    try:
        result = detect_heads(loaded.model, loaded.tokenizer, config, progress=progress)
    except DetectionError as error:
        raise refusal(error) from error
    checks: list[dict[str, Any]] = []
    if result.repeat_gain is not None and spec.check:
        try:
            checks = causal_check(loaded.model, loaded.tokenizer, result, list(dict.fromkeys(spec.check)),
                                  texts=_texts(spec))  # fmt: skip
        except DetectionError as error:
            raise refusal(error) from error

    def write(session: Session) -> dict[str, Any]:
        ids = repository.head_ids(session, model_id)
        wanted = [(stack, layer, head) for stack, values in result.scores.items()
                  for layer in range(values.shape[0]) for head in range(values.shape[1])]  # fmt: skip
        missing = [key for key in wanted if key not in ids]
        if missing:
            raise InvalidInput(f"model: {name!r} in the catalog lacks its head {missing[0]}; ingest it again",
                               field="model")  # fmt: skip
        size = next(iter(result.example_maps.values())).shape[-1]
        run = DetectionRun(
            model_id=model_id, status="complete", config=result.config.to_json(), sequences=result.metadata(),
            num_sequences=int(result.sequences.shape[0]), num_tokens=int(result.sequences.shape[1]),
            loss_first=result.loss_first, loss_later=result.loss_later, repeat_gain=result.repeat_gain, checks=checks,
            example_tokens={"tokens": result.example_tokens}, example_size=int(size), device=result.device,
            dtype=result.dtype, seconds=result.seconds, started_at=started, finished_at=datetime.now(UTC),
        )  # fmt: skip
        session.add(run)
        session.flush()
        current.completed(session, run)
        rows = []
        for stack, values in result.scores.items():
            roles = result.roles(stack)
            maps = result.example_maps[stack]
            for layer in range(values.shape[0]):
                for head in range(values.shape[1]):
                    scores = [None if math.isnan(v) else float(v) for v in values[layer, head]]
                    rows.append({
                        "model_id": model_id, "detection_run_id": run.id, "head_id": ids[stack, layer, head],
                        "induction": scores[0], "duplicate_token": scores[1], "previous_token": scores[2],
                        "sink": scores[3], "roles": roles[layer][head],
                        "example_map": maps[layer, head].reshape(-1).tolist(),
                    })  # fmt: skip
        session.execute(insert(HeadDetection), rows)
        log.info("Stored detection run %d of %r: %d heads, repeat gain %s, %.1f s", run.id, name, len(rows),
                 "n/a" if result.repeat_gain is None else f"{result.repeat_gain:.3f}", result.seconds)  # fmt: skip
        return {"detection_run_id": run.id, "model": name, "heads": len(rows), "repeat_gain": result.repeat_gain,
                "seconds": round(result.seconds, 3)}  # fmt: skip

    return write


def run_read(run: DetectionRun, name: str) -> DetectionRunRead:
    return DetectionRunRead(
        id=run.id, model=name, config=run.config, num_sequences=run.num_sequences, num_tokens=run.num_tokens,
        loss_first=run.loss_first, loss_later=run.loss_later, repeat_gain=run.repeat_gain, checks=run.checks,
        device=run.device,
        dtype=run.dtype, seconds=run.seconds, created_at=run.created_at,
    )  # fmt: skip


def _current(session: Session, name: str) -> tuple[CatalogModel, DetectionRun]:
    """The model and its current detection run (``service/current.py``)."""
    model = models.require(session, name, field="name")
    run = current.current_run(session, model, "detections")
    if run is None:
        raise NotFound(f"name: {name!r} has no detection run; run `headcat detect {name}` first", field="name")
    return model, run


def model_detections(session: Session, name: str) -> ModelDetections:
    model, run = _current(session, name)
    heads = [HeadDetectionRead(stack=r.stack, layer=r.layer, head=r.head, induction=r.induction,
                               duplicate_token=r.duplicate_token, previous_token=r.previous_token, sink=r.sink,
                               roles=list(r.roles))
             for r in repository.heads(session, model.id, run.id)]  # fmt: skip
    runs = [run_read(r, name) for r in repository.runs(session, model.id)]
    return ModelDetections(model=name, current_run_id=run.id, runs=runs, heads=heads)


def example_map(session: Session, name: str, stack: str, layer: int, head: int) -> ExampleMap:
    model, run = _current(session, name)
    values = repository.example_map(session, model.id, run.id, stack, layer, head)
    if values is None:
        raise NotFound(f"head: {name!r} has no {stack} head {layer}-{head} in its current detection run",
                       field="head")  # fmt: skip
    size = run.example_size
    rows = [values[i * size : (i + 1) * size] for i in range(len(values) // size)]
    tokens = list(run.example_tokens.get("tokens", []))
    return ExampleMap(model=name, detection_run_id=run.id, stack=stack, layer=layer, head=head,
                      tokens=tokens if len(tokens) == size else [], size=size, map=rows)  # fmt: skip
