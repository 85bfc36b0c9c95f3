"""Ingest: run a corpus through a model and store one feature run, all at once.

The model runs outside any transaction; the feature run, its heads and their features are
written in one transaction at the end, so an interrupted ingest leaves nothing behind.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import numpy as np
from sqlalchemy import insert, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session, sessionmaker

from service.errors import Conflict, InvalidInput
from service.models import repository as models
from service.orm import CatalogModel, Corpus, FeatureRun, Head, HeadFeatures

if TYPE_CHECKING:
    from ingest.corpora import Corpus as CorpusSource
    from ingest.features import FeatureResult
    from ingest.loading import LoadedModel

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class IngestRequest:
    source: str  # hub id or local directory
    name: str
    corpus: str = "builtin:wiki"
    samples: int = 1000
    max_length: int = 128
    batch_size: int = 32
    num_windows: int = 16
    device: str = "auto"
    dtype: str = "float32"
    add_run: bool = False  # add a feature run to a model already in the catalog

    def validate(self) -> None:
        for field, value, low in (
            ("samples", self.samples, 1),
            ("max_length", self.max_length, 8),
            ("batch_size", self.batch_size, 1),
            ("num_windows", self.num_windows, 1),
        ):
            if value < low:
                raise InvalidInput(f"{field}: must be at least {low}, got {value}", field=field)
        if not self.name or len(self.name) > 200:
            raise InvalidInput("name: must be 1 to 200 characters", field="name")


def check_name(session: Session, request: IngestRequest) -> CatalogModel | None:
    """Fail before any compute when the name is taken and no new run was asked for."""
    existing = models.get_by_name(session, request.name)
    if existing is not None and not request.add_run:
        raise Conflict(
            f"name: a model named {request.name!r} is already in the catalog "
            f"(source {existing.source}); pass --add-run to add a feature run to it, or choose another name",
            field="name",
        )
    return existing


def run_ingest(
    sessions: sessionmaker[Session], request: IngestRequest, *, progress: Progress | None = None
) -> int:
    """Load, extract, store. Returns the new feature run's id."""
    from ingest.corpora import load_corpus
    from ingest.features import FeatureConfig, extract_features
    from ingest.loading import load_model

    request.validate()
    with sessions() as session:
        check_name(session, request)
    try:
        corpus = load_corpus(request.corpus)
    except ValueError as error:
        raise InvalidInput(f"corpus: {error}", field="corpus") from error
    try:
        loaded = load_model(request.source, device=request.device, dtype=request.dtype)
    except ValueError as error:
        raise InvalidInput(f"model: {error}", field="model") from error
    config = FeatureConfig(
        num_windows=request.num_windows,
        max_length=request.max_length,
        batch_size=request.batch_size,
        samples=request.samples,
        device=request.device,
        dtype=request.dtype,
    )
    started = datetime.now(UTC)
    log.info(
        "Extracting features of %s (%d layers x %d heads) on %s, %d samples of %s",
        request.source, loaded.num_layers, loaded.num_heads, loaded.device, request.samples, corpus.source,
    )  # fmt: skip
    try:
        result = extract_features(
            loaded.model, loaded.tokenizer, corpus.samples(request.samples), config, progress=progress
        )
    except ValueError as error:
        raise InvalidInput(f"corpus: {error}", field="corpus") from error
    with sessions() as session, session.begin():
        run_id = store_feature_run(session, request, loaded, corpus, result, started)
    log.info("Stored feature run %d for %r (%d samples, %.1f s)", run_id, request.name,
             result.num_samples, result.seconds)  # fmt: skip
    return run_id


def store_feature_run(
    session: Session,
    request: IngestRequest,
    loaded: LoadedModel,
    corpus: CorpusSource,
    result: FeatureResult,
    started: datetime,
) -> int:
    """Write the model (if new), corpus, feature run, heads and features. Flushes, never commits."""
    model = check_name(session, request)
    if model is None:
        model = CatalogModel(
            name=request.name,
            source=loaded.source,
            revision=loaded.revision,
            architecture=loaded.architecture,
            num_layers=loaded.num_layers,
            num_heads=loaded.num_heads,
        )
        session.add(model)
        session.flush()
    elif (model.num_layers, model.num_heads) != (loaded.num_layers, loaded.num_heads):
        raise Conflict(
            f"name: {request.name!r} has {model.num_layers} x {model.num_heads} heads in the catalog, "
            f"but {loaded.source} has {loaded.num_layers} x {loaded.num_heads}",
            field="name",
        )

    corpus_id = _corpus_id(session, corpus)
    run = FeatureRun(
        model_id=model.id,
        corpus_id=corpus_id,
        status="complete",
        num_windows=request.num_windows,
        max_length=request.max_length,
        samples_requested=request.samples,
        num_samples=result.num_samples,
        num_tokens=result.num_tokens,
        special_tokens=result.special_tokens_json(),
        config=result.config.to_json(),
        example_tokens=list(result.example_tokens),
        device=result.device,
        dtype=result.dtype,
        seconds=result.seconds,
        started_at=started,
        finished_at=datetime.now(UTC),
    )
    session.add(run)
    session.flush()

    head_ids = _head_ids(session, model.id, loaded.num_layers, loaded.num_heads)
    rows: list[dict[str, Any]] = []
    for layer in range(loaded.num_layers):
        for head in range(loaded.num_heads):
            rows.append(
                {
                    "feature_run_id": run.id,
                    "head_id": head_ids[layer, head],
                    "vector": result.vectors[layer, head].tolist(),
                    **{name: _finite_or_none(values[layer, head]) for name, values in result.scalars.items()},
                    "example_map": result.example_maps[layer, head].tolist(),
                }
            )
    session.execute(insert(HeadFeatures), rows)
    return run.id


def _corpus_id(session: Session, corpus: CorpusSource) -> int:
    values = {"name": corpus.name, "kind": corpus.kind, "source": corpus.source, "sha256": corpus.sha256}
    session.execute(pg_insert(Corpus).values(**values).on_conflict_do_nothing())
    found = session.scalar(
        select(Corpus.id).where(
            Corpus.kind == corpus.kind,
            Corpus.source == corpus.source,
            Corpus.sha256.is_not_distinct_from(corpus.sha256),
        )
    )
    assert found is not None
    return found


def _head_ids(session: Session, model_id: int, layers: int, heads: int) -> dict[tuple[int, int], int]:
    session.execute(
        pg_insert(Head)
        .values(
            [{"model_id": model_id, "layer": la, "head": h} for la in range(layers) for h in range(heads)]
        )
        .on_conflict_do_nothing()
    )
    rows = session.execute(select(Head.layer, Head.head, Head.id).where(Head.model_id == model_id))
    return {(layer, head): head_id for layer, head, head_id in rows}


def _finite_or_none(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None
