"""Syntax runs: validate a request, run it (a ``gpu`` job), store it in the job's final transaction, read it.

Checked before anything is queued (:func:`validate`): the model (in the catalog, one stack), and
the parses: a CoNLL-U file is read whole and a malformed line is answered with its number; for
text, the ``[syntax]`` extra must be installed and the corpus must have a sentence of two words.
spaCy itself (which imports torch) is only loaded by the job, which refuses a corpus in which
spaCy finds no parseable sentence before the model is loaded.
"""

from __future__ import annotations

import hashlib
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import insert
from sqlalchemy.orm import Session, sessionmaker

from service import current
from service.attributions.service import single_stack
from service.errors import InvalidInput, NotFound, load_refused
from service.jobs.runner import Progress, Writer
from service.models import repository as models
from service.orm import CatalogModel, HeadSyntax, SyntaxBaseline, SyntaxRun
from service.syntax import repository
from service.syntax.schemas import BaselineRead, BestHead, ModelSyntax, SyntaxCreate, SyntaxRunRead

if TYPE_CHECKING:
    from ingest.syntax import ParsedSentence

log = logging.getLogger(__name__)

TEXTS_CHECKED = 1000  # corpus samples the API looks at for a sentence of two words


def validate(session: Session, request: SyntaxCreate) -> tuple[CatalogModel, list[ParsedSentence] | None]:
    """The model, and the gold sentences when the request names a CoNLL-U file (None for text)."""
    from ingest.extras import SPACY_MISSING, has_spacy

    model = models.require(session, request.model, field="model")
    single_stack(model)
    if request.parses is None and not has_spacy():  # before ingest.syntax imports torch
        raise InvalidInput(f"corpus: {SPACY_MISSING}", field="corpus")
    from ingest.syntax import SyntaxDataError, has_parseable_text, read_conllu

    if request.parses is not None:
        try:
            return model, read_conllu(request.parses)
        except SyntaxDataError as error:
            raise InvalidInput(f"parses: {error}", field="parses") from error
    texts = _texts(request, min(request.samples, TEXTS_CHECKED))
    if not has_parseable_text(texts):
        raise InvalidInput(f"corpus: {request.corpus!r} has no parseable sentence (none of two words)", field="corpus")
    return model, None


def _texts(request: SyntaxCreate, limit: int) -> list[str]:
    from ingest.corpora import load_corpus

    try:
        corpus = load_corpus(request.corpus)
        return [text for sample in corpus.samples(limit) for text in sample if text]
    except (ValueError, OSError) as error:
        raise InvalidInput(f"corpus: {error}", field="corpus") from error


def prepare(sessions: sessionmaker[Session], request: dict[str, Any], progress: Progress) -> Writer:
    """The job handler: parse (or read) the sentences, load the model, score every head."""
    from ingest.loading import load_model
    from ingest.syntax import SPACY_PIPELINE, SyntaxConfig, SyntaxDataError, load_spacy, silver_parses, syntax_accuracy

    spec = SyntaxCreate.model_validate(request)
    with sessions() as session:
        model, gold = validate(session, spec)
        model_id, name, source, revision = model.id, model.name, model.source, model.revision
    parser = None
    if gold is not None:
        sentences = gold
    else:
        try:
            nlp = load_spacy()
            parser = f"spacy {_version('spacy')}, {SPACY_PIPELINE} {nlp.meta.get('version', '?')}"
            sentences = silver_parses(_texts(spec, spec.samples), limit=spec.samples, nlp=nlp)
        except SyntaxDataError as error:
            raise InvalidInput(f"corpus: {error}".replace("corpus: corpus: ", "corpus: "), field="corpus") from error
    try:
        loaded = load_model(source, device=spec.device, dtype=spec.dtype, revision=revision)
    except ValueError as error:
        raise load_refused(error) from error
    config = SyntaxConfig(samples=spec.samples, max_length=spec.max_length, batch_size=spec.batch_size,
                          device=spec.device, dtype=spec.dtype)  # fmt: skip
    started = datetime.now(UTC)
    log.info("Scoring the heads of %s on %d %s sentences", name, min(len(sentences), spec.samples),
             "gold" if gold is not None else "silver")  # fmt: skip
    try:
        result = syntax_accuracy(loaded.model, loaded.tokenizer, sentences, config, progress=progress)
    except SyntaxDataError as error:
        raise InvalidInput(str(error), field=str(error).split(":", 1)[0]) from error
    except ValueError as error:
        raise InvalidInput(f"model: {error}", field="model") from error
    where = spec.parses if spec.parses is not None else spec.corpus
    digest = _sha256(Path(where)) if spec.parses is not None else None

    def write(session: Session) -> dict[str, Any]:
        ids = repository.head_ids(session, model_id, result.stack)
        layers, heads = result.correct.shape[:2]
        if any((layer, head) not in ids for layer in range(layers) for head in range(heads)):
            raise InvalidInput(f"model: {name!r} in the catalog lacks some of its {result.stack} heads; ingest it "
                               "again", field="model")  # fmt: skip
        run = SyntaxRun(
            model_id=model_id, status="complete", stack=result.stack,
            parses="gold" if spec.parses is not None else "silver", source=where, sha256=digest, parser=parser,
            num_sentences=result.num_sentences, num_skipped=result.num_skipped, num_words=result.num_words,
            config=result.config.to_json(), device=result.device, dtype=result.dtype, seconds=result.seconds,
            started_at=started, finished_at=datetime.now(UTC),
        )  # fmt: skip
        session.add(run)
        session.flush()
        current.completed(session, run)
        session.execute(
            insert(SyntaxBaseline),
            [
                {
                    "syntax_run_id": run.id,
                    "relation": relation,
                    "count": int(result.counts[r]),
                    "offset": result.baseline_offset[r],
                    "accuracy": float(result.baseline_accuracy[r]),
                }  # fmt: skip
                for r, relation in enumerate(result.relations)
            ],
        )
        accuracy = result.accuracy
        session.execute(
            insert(HeadSyntax),
            [
                {
                    "model_id": model_id,
                    "syntax_run_id": run.id,
                    "head_id": ids[layer, head],
                    "relation": relation,
                    "direction": direction,
                    "correct": int(result.correct[layer, head, r, d]),
                    "count": int(result.counts[r]),
                    "accuracy": float(accuracy[layer, head, r, d]),
                }  # fmt: skip
                for layer in range(layers)
                for head in range(heads)
                for r, relation in enumerate(result.relations)
                for d, direction in enumerate(("dep2head", "head2dep"))
            ],
        )
        log.info("Stored syntax run %d of %r: %d sentences, %d relations, %.1f s", run.id, name,
                 result.num_sentences, len(result.relations), result.seconds)  # fmt: skip
        return {"syntax_run_id": run.id, "model": name, "sentences": result.num_sentences,
                "relations": len(result.relations), "seconds": round(result.seconds, 3)}  # fmt: skip

    return write


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def run_read(session: Session, run: SyntaxRun) -> SyntaxRunRead:
    return SyntaxRunRead(
        id=run.id, model=repository.model_name(session, run.model_id), stack=run.stack, parses=run.parses,
        source=run.source, parser=run.parser, num_sentences=run.num_sentences, num_skipped=run.num_skipped,
        num_words=run.num_words, config=run.config, device=run.device, dtype=run.dtype, seconds=run.seconds,
        created_at=run.created_at,
        baselines=[BaselineRead(relation=b.relation, count=b.count, offset=b.offset, accuracy=b.accuracy)
                   for b in repository.baselines(session, run.id)],
    )  # fmt: skip


def get_run(session: Session, run_id: int) -> SyntaxRunRead:
    run = repository.get_run(session, run_id)
    if run is None or run.status != "complete":
        raise NotFound(f"run_id: no syntax run with id {run_id}", field="run_id")
    return run_read(session, run)


def model_syntax(session: Session, name: str, *, min_count: int = 1) -> ModelSyntax:
    """The current run's best head per relation against its baseline, and the heat-map matrix."""
    model = models.require(session, name, field="name")
    run = repository.current_run(session, model)
    if run is None:
        raise NotFound(f"name: {name!r} has no syntax run; run `headcat syntax {name}` first", field="name")
    best = [
        BestHead(
            relation=row.relation,
            count=row.count,
            stack=row.stack,
            layer=row.layer,
            head=row.head,
            direction=row.direction,
            accuracy=row.accuracy,
            baseline=row.baseline,
            baseline_offset=row.baseline_offset,
        )  # fmt: skip
        for row in repository.best_heads(session, run.id, min_count)
    ]
    shape = (model.stacks or {}).get(run.stack) or {"layers": model.num_layers, "heads": model.num_heads}
    layers, heads = int(shape["layers"]), int(shape["heads"])
    matrix: dict[str, list[list[float]]] = {}
    for relation, layer, head, accuracy in repository.matrix(session, run.id, min_count):
        grid = matrix.setdefault(relation, [[0.0] * heads for _ in range(layers)])
        grid[layer][head] = float(accuracy)
    return ModelSyntax(run=run_read(session, run), best=best, layers=layers, heads=heads, matrix=matrix)
