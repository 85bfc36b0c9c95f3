"""A catalog written with arrays the test chooses: feature runs through the ingest writer
(``store_feature_run``) and attribution runs as rows, so what a job reads back is known exactly.

The model directories are real (``load_model`` reads them for the catalog's record); only the
head arrays are drawn here, from a seeded generator, instead of extracted.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from ingest.types import SCALARS, feature_names

Vectors = dict[str, np.ndarray]  # stack -> (layers, heads, num_windows + 5)


def dirichlet(rng: np.random.Generator, layers: int, heads: int, num_windows: int = 16) -> np.ndarray:
    """``(layers, heads, num_windows + 5)`` rows on the simplex with no cluster structure to speak of."""
    return rng.dirichlet(np.ones(num_windows + 5), size=(layers, heads))


def feature_result(vectors: Vectors, num_windows: int = 16, seed: int = 0) -> Any:
    """A :class:`~ingest.features.FeatureResult` holding ``vectors``; scalars and maps drawn from ``seed``."""
    from ingest.features import FeatureConfig, FeatureResult, StackFeatures

    rng = np.random.default_rng(seed)
    stacks: dict[Any, Any] = {}
    for name, array in vectors.items():
        layers, heads = array.shape[:2]
        scalars = {s: rng.random((layers, heads)) for s in SCALARS}
        maps = rng.random((layers, heads, 3, 3)).astype(np.float32)
        stacks[name] = StackFeatures(name, array, scalars, maps)  # type: ignore[arg-type]
    return FeatureResult(
        stacks=stacks, example_tokens=["[CLS]", "a", "[SEP]"], num_samples=4, num_tokens=40,
        special_token_ids={"cls": [101], "sep": [102]}, special_tokens={"cls": ["[CLS]"], "sep": ["[SEP]"]},
        device="cpu", dtype="float32", seconds=0.1, config=FeatureConfig(num_windows=num_windows),
        feature_names=feature_names(num_windows),
    )  # fmt: skip


def store_model(
    session: Session, path: Path, name: str, vectors: Vectors, *, num_windows: int = 16, add_run: bool = False
) -> int:
    """Store ``vectors`` as a feature run of the model at ``path`` named ``name``; returns the run id."""
    from ingest.corpora import load_corpus
    from ingest.loading import load_model
    from service.ingests.schemas import IngestCreate
    from service.ingests.service import store_feature_run

    loaded = load_model(str(path), device="cpu")
    request = IngestCreate(model=str(path), name=name, samples=4, num_windows=num_windows, add_run=add_run)
    result = feature_result(vectors, num_windows, seed=len(name))
    return store_feature_run(session, request, loaded, load_corpus("builtin:wiki"), result, datetime.now(UTC))


def store_attribution(session: Session, model: str, vectors: np.ndarray, *, num_windows: int = 16) -> int:
    """A complete attribution run of ``model``'s encoder whose global vectors are ``vectors`` ``(layers, heads, d)``."""
    from service import current
    from service.orm import AttributionRun, CatalogModel, Corpus, Head, HeadAttribution

    model_id = session.scalars(select(CatalogModel.id).where(CatalogModel.name == model)).one()
    corpus_id = session.scalars(select(Corpus.id).limit(1)).one()
    layers, heads = vectors.shape[:2]
    run = AttributionRun(
        model_id=model_id, corpus_id=corpus_id, status="complete", stack="encoder", num_windows=num_windows,
        max_length=16, samples_requested=2, num_samples=2, num_tokens=20, queries=4, probes=2, seed=0,
        triples=layers * heads * 16, passes=1, layer_discrepancy=[0.5] * layers, config={}, example_tokens=["a"],
        example_queries=[0], device="cpu", dtype="float32", seconds=0.1, started_at=datetime.now(UTC),
        finished_at=datetime.now(UTC),
    )  # fmt: skip
    session.add(run)
    session.flush()
    current.completed(session, run)  # as the attribution job does
    ids = {(layer, head): head_id for layer, head, head_id in session.execute(
        select(Head.layer, Head.head, Head.id).where(Head.model_id == model_id, Head.stack == "encoder"))}  # fmt: skip
    session.add_all(
        HeadAttribution(
            model_id=model_id,
            attribution_run_id=run.id,
            head_id=ids[layer, head],
            vector=vectors[layer, head].tolist(),
            local_vector=vectors[layer, head].tolist(),
            discrepancy=0.5,
            example_attention=[[1.0]],
            example_attribution=[[1.0]],
        )  # fmt: skip
        for layer in range(layers)
        for head in range(heads)
    )
    session.flush()
    return run.id
