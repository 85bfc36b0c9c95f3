"""Ingest: run a corpus through a model and store one feature run, all at once.

The model runs outside any transaction; the feature run, its heads and their features are
written in one transaction at the end, so an interrupted ingest leaves nothing behind.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from sqlalchemy import insert, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session, sessionmaker

from ingest.types import default_max_length, model_task, positions
from service import current
from service.errors import Conflict, InvalidInput
from service.ingests.schemas import IngestCreate
from service.jobs.runner import Progress, Writer
from service.models import repository as models
from service.orm import CatalogModel, Corpus, FeatureRun, Head, HeadFeatures, Series
from service.sources import is_hub_id

if TYPE_CHECKING:
    from ingest.corpora import Corpus as CorpusSource
    from ingest.features import FeatureResult
    from ingest.loading import LoadedModel

log = logging.getLogger(__name__)


def check_name(session: Session, request: IngestCreate) -> CatalogModel | None:
    """Fail before any compute when the name is taken and no new run was asked for."""
    existing = models.get_by_name(session, request.name)
    if existing is not None and not request.add_run:
        raise Conflict(
            f"name: a model named {request.name!r} is already in the catalog "
            f"(source {existing.source}); pass --add-run to add a feature run to it, or choose another name",
            field="name",
        )
    if existing is not None and request.series is not None:
        series = session.get(Series, existing.series_id) if existing.series_id is not None else None
        if series is None or series.name != request.series or existing.step != request.step:
            where = "no series" if series is None else f"step {existing.step} of series {series.name!r}"
            raise Conflict(f"name: {request.name!r} is {where} in the catalog, not step {request.step} of "
                           f"{request.series!r}", field="name")  # fmt: skip
    if request.series is not None:
        taken = session.scalar(
            select(CatalogModel.name).join(Series, Series.id == CatalogModel.series_id)
            .where(Series.name == request.series, CatalogModel.step == request.step)
        )  # fmt: skip
        if taken is not None and taken != request.name:
            raise Conflict(f"step: step {request.step} of series {request.series!r} is already {taken!r}",
                           field="step")  # fmt: skip
    return existing


def loaded_stacks(loaded: LoadedModel) -> dict[str, dict[str, int]]:
    """``stack -> {layers, heads, kv_heads}`` of a loaded model, as ``models.stacks`` and ``series.stacks`` hold it."""
    return {
        name: {"layers": layers, "heads": heads, "kv_heads": _kv_heads(loaded, heads)}
        for name, (layers, heads) in loaded.stacks.items()
    }


def check_series(
    session: Session, request: IngestCreate, loaded: LoadedModel, tokenizer_sha256: str, *, create: bool = True
) -> Series | None:
    """The request's series (made by its first step unless ``create`` is false), refusing a checkpoint whose
    architecture, attention stacks or tokenizer differ from the series' (SPEC 11)."""
    if request.series is None:
        return None
    stacks = loaded_stacks(loaded)
    series = session.scalar(select(Series).where(Series.name == request.series).with_for_update())
    if series is None and not create:
        return None
    if series is None:
        session.execute(
            pg_insert(Series)
            .values(name=request.series, architecture=loaded.architecture, stacks=stacks,
                    tokenizer_sha256=tokenizer_sha256)
            .on_conflict_do_nothing()
        )  # fmt: skip
        series = session.scalar(select(Series).where(Series.name == request.series).with_for_update())
        assert series is not None
    differences = []
    if series.architecture != loaded.architecture:
        differences.append(f"architecture {loaded.architecture!r}, not {series.architecture!r}")
    if series.stacks != stacks:
        differences.append(f"stacks {_describe(stacks)}, not {_describe(series.stacks)}")
    if series.tokenizer_sha256 != tokenizer_sha256:
        differences.append("another tokenizer (its vocabulary or special tokens differ)")
    if differences:
        raise Conflict(f"series: {loaded.source} has {'; '.join(differences)}: every step of series "
                       f"{request.series!r} shares them", field="series")  # fmt: skip
    return series


def prepare(sessions: sessionmaker[Session], request: dict[str, Any], progress: Progress) -> Writer:
    """The job handler: load the model, extract features, and return the writer that stores them."""
    from ingest.corpora import load_corpus
    from ingest.features import FeatureConfig, extract_features
    from ingest.loading import load_model
    from ingest.series import tokenizer_sha256

    spec = IngestCreate.model_validate(request)
    with sessions() as session:
        check_name(session, spec)
    try:
        corpus = load_corpus(spec.corpus, refuse_malformed=spec.refuse_malformed)
    except ValueError as error:
        raise InvalidInput(f"corpus: {error}", field="corpus") from error
    try:
        loaded = load_model(spec.model, device=spec.device, dtype=spec.dtype, device_map=spec.device_map,
                            revision=spec.revision)  # fmt: skip
    except ValueError as error:
        raise InvalidInput(f"model: {error}", field="model") from error
    if spec.max_length is None:  # none asked: 128, or the model's positions where it has fewer; stored as used
        spec = spec.model_copy(update={"max_length": default_max_length(loaded.model.config)})
    assert spec.max_length is not None
    fingerprint = tokenizer_sha256(loaded.tokenizer)
    if spec.series is not None:  # refused before any compute; checked again when it is written
        with sessions() as session:
            check_series(session, spec, loaded, fingerprint, create=False)
    config = FeatureConfig(
        num_windows=spec.num_windows,
        max_length=spec.max_length,
        batch_size=spec.batch_size,
        samples=spec.samples,
        device=spec.device,
        dtype=spec.dtype,
        prepend_bos=spec.prepend_bos,
    )
    started = datetime.now(UTC)
    log.info(
        "Extracting features of %s (%d layers x %d heads) on %s: %d samples of %s",
        spec.model, loaded.num_layers, loaded.num_heads, loaded.device, spec.samples, corpus.source,
    )  # fmt: skip
    try:
        result = extract_features(
            loaded.model, loaded.tokenizer, corpus.samples(spec.samples), config, progress=progress
        )
    except ValueError as error:
        raise InvalidInput(f"corpus: {error}", field="corpus") from error

    def write(session: Session) -> dict[str, Any]:
        run_id = store_feature_run(session, spec, loaded, corpus, result, started, fingerprint)
        log.info("Stored feature run %d of %r (%d samples, %.1f s)", run_id, spec.name, result.num_samples,
                 result.seconds)  # fmt: skip
        return {"feature_run_id": run_id, "model": spec.name}

    return write


def store_feature_run(
    session: Session,
    request: IngestCreate,
    loaded: LoadedModel,
    corpus: CorpusSource,
    result: FeatureResult,
    started: datetime,
    tokenizer_sha256: str | None = None,
) -> int:
    """Write the model (if new, as its series' step where it has one), corpus, feature run, heads and
    features. Flushes, never commits."""
    model = check_name(session, request)
    series = None
    if request.series is not None:
        assert tokenizer_sha256 is not None, "a series step needs its tokenizer's fingerprint"
        series = check_series(session, request, loaded, tokenizer_sha256)
    stacks: dict[str, dict[str, int]] = {
        name: {"layers": part.num_layers, "heads": part.num_heads, "kv_heads": _kv_heads(loaded, part.num_heads)}
        for name, part in result.stacks.items()
    }
    first = next(iter(result.stacks.values()))
    kv_heads = _kv_heads(loaded, first.num_heads)
    if model is None:
        model = CatalogModel(
            name=request.name,
            source=loaded.source,
            revision=loaded.revision,
            architecture=loaded.architecture,
            task=model_task(loaded.model.config),
            num_layers=first.num_layers,
            num_heads=first.num_heads,
            num_key_value_heads=None if kv_heads == first.num_heads else kv_heads,
            stacks=stacks,
            series_id=None if series is None else series.id,
            step=request.step if series is not None else None,
            requested_revision=request.revision,
        )
        session.add(model)
        session.flush()
    elif model.stacks != stacks:
        raise Conflict(
            f"name: {request.name!r} has the stacks {_describe(model.stacks)} in the catalog, "
            f"but {loaded.source} has {_describe(stacks)}",
            field="name",
        )

    corpus_id = _corpus_id(session, corpus)
    run = FeatureRun(
        model_id=model.id,
        corpus_id=corpus_id,
        status="complete",
        num_windows=request.num_windows,
        max_length=request.max_length if request.max_length is not None else default_max_length(loaded.model.config),
        samples_requested=request.samples,
        num_samples=result.num_samples,
        num_tokens=result.num_tokens,
        special_tokens={"ids": result.special_token_ids, "tokens": result.special_tokens},
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
    current.completed(session, run)

    head_ids = _head_ids(session, model.id, stacks)
    rows: list[dict[str, Any]] = []
    for name, part in result.stacks.items():
        for layer in range(part.num_layers):
            for head in range(part.num_heads):
                rows.append(
                    {
                        "model_id": model.id,
                        "feature_run_id": run.id,
                        "head_id": head_ids[name, layer, head],
                        "vector": part.vectors[layer, head].tolist(),
                        **{key: _finite_or_none(values[layer, head]) for key, values in part.scalars.items()},
                        "example_map": part.example_maps[layer, head].tolist(),
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


def _head_ids(session: Session, model_id: int, stacks: dict[str, dict[str, int]]) -> dict[tuple[str, int, int], int]:
    """The ids of every ``(stack, layer, head)`` of the model, made where missing."""
    session.execute(
        pg_insert(Head)
        .values(
            [
                {"model_id": model_id, "stack": name, "layer": layer, "head": head}
                for name, shape in stacks.items()
                for layer in range(shape["layers"])
                for head in range(shape["heads"])
            ]
        )
        .on_conflict_do_nothing()
    )
    rows = session.execute(select(Head.stack, Head.layer, Head.head, Head.id).where(Head.model_id == model_id))
    return {(stack, layer, head): head_id for stack, layer, head, head_id in rows}


def _kv_heads(loaded: LoadedModel, num_heads: int) -> int:
    """Key/value heads per layer: the config's ``num_key_value_heads`` where it has one, else ``num_heads``."""
    value = getattr(loaded, "num_key_value_heads", None)
    return value if isinstance(value, int) and value > 0 else num_heads


def _describe(stacks: Mapping[str, Any]) -> str:
    return ", ".join(f"{name} {shape['layers']} x {shape['heads']}" for name, shape in stacks.items())


def _finite_or_none(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None


def hub_offline() -> bool:
    """Whether the hub is off for this process (``HF_HUB_OFFLINE``, or transformers' ``TRANSFORMERS_OFFLINE``)."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))  # fmt: skip


def hub_cached(repo_id: str) -> bool:
    """Whether the hub cache holds ``repo_id``'s config (all a load needs to start offline); no download."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def check_max_length(request: IngestCreate, config_file: Path) -> None:
    """An explicit ``max_length`` above a local model's positions, refused before a job is queued."""
    import json

    try:
        limit = positions(json.loads(config_file.read_text()))
    except (OSError, ValueError):
        return  # an unreadable config is the model load's to refuse, with its own message
    if request.max_length is not None and limit is not None and request.max_length > limit:
        raise InvalidInput(f"max_length: {request.max_length} is more than the model's {limit} positions "
                           f"({request.model}); leave it out for {min(limit, 128)}", field="max_length")  # fmt: skip


def check_sources(request: IngestCreate) -> None:
    """Cheap checks of the model and corpus before a job is queued: no model is loaded, torch is
    not imported. A local model must be a directory with ``config.json``; anything that cannot be
    a hub id (``org/name``) is taken as a path and must exist."""
    from ingest.corpora import load_corpus

    if (request.series is None) != (request.step is None):
        missing = "step" if request.step is None else "series"
        raise InvalidInput(f"{missing}: a checkpoint of a series needs both --series and --step", field=missing)
    source = Path(request.model).expanduser()
    looks_local = request.model.startswith((".", "/", "~", "\\")) or not is_hub_id(request.model)
    if request.revision is not None and (source.exists() or looks_local):
        raise InvalidInput(f"revision: {request.model} is a local directory, which is one checkpoint; --revision "
                           "names a revision of a hub id (e.g. EleutherAI/pythia-70m --revision step1000)",
                           field="revision")  # fmt: skip
    if request.revision is not None:
        _check_revision_reachable(request.model, request.revision)
    if source.exists() or looks_local:
        if not source.exists():
            raise InvalidInput(f"model: {request.model} does not exist (a local model directory, or a hub id "
                               "such as sentence-transformers/all-MiniLM-L6-v2)", field="model")  # fmt: skip
        if not (source / "config.json").is_file():
            raise InvalidInput(f"model: {request.model} is not a transformers model directory (no config.json)",
                               field="model")  # fmt: skip
        check_max_length(request, source / "config.json")
    elif hub_offline() and not hub_cached(request.model):
        raise InvalidInput(
            f"model: {request.model} is not in the local hub cache, and the hub is off (HF_HUB_OFFLINE): "
            "download it once online, or give a local directory",
            field="model",
        )
    try:
        load_corpus(request.corpus, refuse_malformed=request.refuse_malformed)
    except ValueError as error:
        raise InvalidInput(f"corpus: {error}", field="corpus") from error


def _check_revision_reachable(model: str, revision: str) -> None:
    """Offline (``HF_HUB_OFFLINE``), a hub revision must be in the local cache: refused here, before a job."""
    from huggingface_hub import constants, try_to_load_from_cache

    if not constants.HF_HUB_OFFLINE:
        return
    if not isinstance(try_to_load_from_cache(model, "config.json", revision=revision), str):
        raise InvalidInput(
            f"revision: {model!r} at revision {revision!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE "
            "is set: download that revision where the hub is reachable, or give a local checkpoint directory",
            field="revision",
        )
