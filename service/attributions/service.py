"""Attribution runs: validate a request, run it (a ``gpu`` job), store it in the job's final transaction, read it.

Checked before anything is queued or computed (:func:`validate`): the model is in the catalog
with one attention stack (an encoder-decoder's heads read two embedding layers: refused), the
corpus can be read, and the numbers are in range (``queries >= 1``, ...). The job checks again,
loads the model and refuses one it cannot take gradients through
(:func:`ingest.attribution.check_model`) before reading a sample. ``torch`` is imported in the job only.
"""

from __future__ import annotations

import logging
import math
from datetime import UTC, datetime
from typing import Any

import numpy as np
from sqlalchemy import insert
from sqlalchemy.orm import Session, sessionmaker

from service import current
from service.attributions import repository
from service.attributions.schemas import (
    AttributionCreate,
    AttributionMaps,
    AttributionRunRead,
    HeadAttributionRead,
)
from service.errors import InvalidInput, NotFound
from service.ingests.service import _corpus_id
from service.jobs.runner import Progress, Writer
from service.models import repository as models
from service.orm import AttributionRun, CatalogModel, HeadAttribution

log = logging.getLogger(__name__)

SCALAR_NAMES = ("entropy", "prev_token", "next_token", "mean_distance", "sep_to_sep")


def feature_names(num_windows: int) -> list[str]:
    return [f"w{i}" for i in range(num_windows)] + ["self", "cls", "sep", "period", "comma"]


def single_stack(model: CatalogModel, field: str = "model") -> str:
    """The model's one attention stack; an encoder-decoder (several stacks) is refused."""
    stacks = list(model.stacks or {}) or ["encoder"]
    if len(stacks) != 1:
        raise InvalidInput(
            f"{field}: {model.name!r} has the stacks {', '.join(stacks)}: an encoder-decoder's heads read two "
            "embedding layers, and headcat attributes (and scores syntax) on single-stack models only",
            field=field,
        )
    return stacks[0]


def validate(session: Session, request: AttributionCreate) -> CatalogModel:
    from ingest.corpora import load_corpus

    model = models.require(session, request.model, field="model")
    single_stack(model)
    if request.max_length < 2:
        raise InvalidInput("max_length: must be >= 2", field="max_length")
    try:
        corpus = load_corpus(request.corpus)
        next(iter(corpus.samples(1)))
    except StopIteration:
        raise InvalidInput(f"corpus: {request.corpus!r} has no sample", field="corpus") from None
    except (ValueError, OSError) as error:
        raise InvalidInput(f"corpus: {error}", field="corpus") from error
    return model


def prepare(sessions: sessionmaker[Session], request: dict[str, Any], progress: Progress) -> Writer:
    """The job handler: check, load, attribute; the writer stores the run and its heads."""
    from ingest.attribution import AttributionConfig, AttributionError, attribute, check_model
    from ingest.corpora import load_corpus
    from ingest.loading import load_model

    spec = AttributionCreate.model_validate(request)
    with sessions() as session:
        model = validate(session, spec)
        model_id, name, source, revision = model.id, model.name, model.source, model.revision
    try:
        config = AttributionConfig(
            samples=spec.samples, max_length=spec.max_length, queries=spec.queries, probes=spec.probes,
            scheme=spec.scheme, num_windows=spec.num_windows, seed=spec.seed, device=spec.device, dtype=spec.dtype,
        )  # fmt: skip
    except AttributionError as error:
        field = str(error).split(":", 1)[0]
        raise InvalidInput(str(error), field=field) from error
    corpus = load_corpus(spec.corpus)
    try:
        loaded = load_model(source, device=spec.device, dtype=spec.dtype, revision=revision)
        check_model(loaded.model)
    except ValueError as error:
        raise InvalidInput(f"model: {error}".replace("model: model: ", "model: "), field="model") from error
    started = datetime.now(UTC)
    log.info("Attributing %s (%d x %d heads): %d samples of %s, %s, %s", name, loaded.num_layers, loaded.num_heads,
             spec.samples, corpus.source, "every query" if spec.queries is None else f"{spec.queries} queries",
             "exact" if spec.scheme == "exact" else f"{spec.probes} probes")  # fmt: skip
    try:
        result = attribute(loaded, None, corpus.samples(spec.samples), config, progress=progress)
    except AttributionError as error:
        field = str(error).split(":", 1)[0] if ":" in str(error) else "model"
        raise InvalidInput(str(error), field=field) from error

    def write(session: Session) -> dict[str, Any]:
        ids = repository.head_ids(session, model_id, result.stack)
        missing = [(layer, head) for layer in range(result.num_layers) for head in range(result.num_heads)
                   if (layer, head) not in ids]  # fmt: skip
        if missing:
            raise InvalidInput(f"model: {name!r} in the catalog has no {result.stack} head(s) {missing[:4]}; "
                               "ingest it again", field="model")  # fmt: skip
        run = AttributionRun(
            model_id=model_id, corpus_id=_corpus_id(session, corpus), status="complete", stack=result.stack,
            num_windows=spec.num_windows, max_length=spec.max_length, samples_requested=spec.samples,
            num_samples=result.num_samples, num_tokens=result.num_tokens,
            queries=spec.max_length if spec.queries is None else spec.queries,  # max_length: every query
            probes=result.tangents_per_position, seed=spec.seed, triples=result.triples, passes=result.passes,
            layer_discrepancy=result.layer_discrepancy(), config=result.config.to_json(),
            example_tokens=result.example_tokens, example_queries=result.example_queries, device=result.device,
            dtype=result.dtype, seconds=result.seconds, started_at=started, finished_at=datetime.now(UTC),
        )  # fmt: skip
        session.add(run)
        session.flush()
        current.completed(session, run)
        rows = []
        for layer in range(result.num_layers):
            for head in range(result.num_heads):
                rows.append(
                    {
                        "model_id": model_id,
                        "attribution_run_id": run.id,
                        "head_id": ids[layer, head],
                        "vector": result.global_vectors[layer, head].tolist(),
                        "local_vector": result.local_vectors[layer, head].tolist(),
                        **{k: _finite(v[layer, head]) for k, v in result.global_scalars.items()},
                        "discrepancy": float(result.discrepancy[layer, head]),
                        "example_attention": result.example_attention[layer, head].tolist(),
                        "example_attribution": result.example_attribution[layer, head].tolist(),
                    }
                )
        session.execute(insert(HeadAttribution), rows)
        log.info("Stored attribution run %d of %r (%s): %d rows from %d passes, %.1f s (%.0f rows/s)", run.id, name,
                 spec.scheme, result.rows, result.passes, result.seconds, result.rows_per_second)  # fmt: skip
        return {"attribution_run_id": run.id, "model": name, "scheme": spec.scheme, "rows": result.rows,
                "passes": result.passes, "triples": result.triples, "seconds": round(result.seconds, 3),
                "rows_per_second": round(result.rows_per_second, 1),
                "triples_per_second": round(result.triples_per_second, 1),
                "layer_discrepancy": [round(v, 4) for v in result.layer_discrepancy()]}  # fmt: skip

    return write


def _finite(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None


def _none_if_nan(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else value


def run_read(session: Session, run: AttributionRun, *, with_heads: bool = False) -> AttributionRunRead:
    name, corpus = repository.names(session, run)
    names = feature_names(run.num_windows)
    heads = []
    if with_heads:
        for stack, layer, head, row in repository.heads(session, run.id):
            heads.append(
                HeadAttributionRead(
                    stack=stack,
                    layer=layer,
                    head=head,
                    discrepancy=row.discrepancy,
                    global_features=dict(zip(names, row.vector, strict=True)),
                    local_features=dict(zip(names, row.local_vector, strict=True)),
                    global_scalars={k: _none_if_nan(getattr(row, k)) for k in SCALAR_NAMES},
                )  # fmt: skip
            )
    config = run.config or {}
    rows = run.triples // run.probes if run.probes else 0  # every scheme estimates each row with `probes` tangents
    return AttributionRunRead(
        id=run.id, model=name, stack=run.stack, corpus=corpus, num_samples=run.num_samples,
        num_tokens=run.num_tokens, queries=config["queries"] if "queries" in config else run.queries,
        probes=run.probes, scheme=str(config.get("scheme", "vjp")), seed=run.seed, triples=run.triples,
        passes=run.passes, triples_per_second=run.triples / run.seconds if run.seconds > 0 else 0.0,
        rows_per_second=rows / run.seconds if run.seconds > 0 else 0.0,
        layer_discrepancy=list(run.layer_discrepancy), config=run.config, device=run.device, dtype=run.dtype,
        seconds=run.seconds, created_at=run.created_at, heads=heads,
    )  # fmt: skip


def get_run(session: Session, run_id: int) -> AttributionRun:
    run = repository.get_run(session, run_id)
    if run is None or run.status != "complete":
        raise NotFound(f"run_id: no attribution run with id {run_id}", field="run_id")
    return run


def latest_run(session: Session, name: str, field: str = "name") -> AttributionRun:
    """The model's current attribution run (``service/current.py``)."""
    model = models.require(session, name, field=field)
    run = current.current_run(session, model, "attribution")
    if run is None:
        raise NotFound(f"{field}: {name!r} has no attribution run; run `headcat attribute {name}` first", field=field)
    return run


def maps(session: Session, run: AttributionRun, layer: int, head: int, stack: str | None = None) -> AttributionMaps:
    stack = stack or run.stack
    row = repository.head(session, run.id, stack, layer, head)
    if row is None:
        raise NotFound(f"head: attribution run {run.id} has no {stack} head ({layer}, {head})", field="head")
    return AttributionMaps(
        run_id=run.id, stack=stack, layer=layer, head=head, tokens=list(run.example_tokens),
        queries=[int(q) for q in run.example_queries], key_bins=len(row.example_attention[0]) if row.example_attention
        else 0, attention=row.example_attention, attribution=row.example_attribution, discrepancy=row.discrepancy,
    )  # fmt: skip
