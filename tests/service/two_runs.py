"""A catalog in which every model has two complete runs of every kind, with different answers.

Three models: ``tiny`` (a BERT, one encoder stack), ``bart`` (encoder, decoder and cross stacks)
and ``plain`` (a BERT never clustered, so its heads come from its latest feature run). Each has
two feature runs, and ``tiny`` and ``bart`` share two joint clusterings (the first over the first
feature runs, the second, current, over the second) with two stability runs each, two importance,
attribution, syntax and detection runs; every kind with a status also has a third run that failed
(no rows, as a failed run leaves none). Every read must serve the second run (the latest complete
one), and :data:`Catalog.values` holds what the second runs stored, per head, as the reference.

The numbers are chosen, not computed: each quantity of the second runs takes a few exact binary
fractions, so that many heads share each value and a filter's bound can sit exactly on a stored
value; the first runs store other values on every head. Some values are NULL where the catalog
has them NULL: agreement of a few heads (a run stored before per-head agreement), margins of a
few assignments (an imported clustering), the induction and duplicate-token scores of cross heads,
and every fact of a stack a run did not cover (attribution and syntax runs cover the encoder).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, create_engine, select, update
from sqlalchemy.orm import Session, sessionmaker

from ingest.detectors import CROSS_DETECTORS, DETECTORS, DetectionConfig
from service import current
from service.orm import (
    AttributionRun,
    CatalogModel,
    Cluster,
    Clustering,
    Corpus,
    DetectionRun,
    FeatureRun,
    Head,
    HeadAssignment,
    HeadAttribution,
    HeadDetection,
    HeadSyntax,
    ImportanceRun,
    ImportanceScore,
    StabilityHead,
    StabilityRun,
    SyntaxBaseline,
    SyntaxRun,
    clustering_feature_runs,
)
from tests.service.synthetic import dirichlet, store_model

Key = tuple[str, str, int, int]  # (model, stack, layer, head)
SHAPES = {"tiny": ("encoder",), "bart": ("encoder", "decoder", "cross"), "plain": ("encoder",)}
CLUSTERED = ("tiny", "bart")
RELATION = "nsubj"
# The second runs' values cycle through these (exact in binary, so a bound given as text is the stored value).
GRID = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75)
OLDER = 0.0625  # the first runs store each value plus this: a different answer on every head
THRESHOLDS = dict.fromkeys(DETECTORS, 0.5)
NOW = datetime(2026, 11, 1, 12, tzinfo=UTC)


@dataclass
class Catalog:
    """The built catalog: ids of the runs by kind (first, second, failed third) and the second runs' values."""

    runs: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # model -> kind -> ids, oldest first
    clusterings: list[int] = field(default_factory=list)  # the two joint clusterings, oldest first
    stability: dict[int, list[int]] = field(default_factory=dict)  # clustering -> stability run ids, oldest first
    values: dict[Key, dict[str, Any]] = field(default_factory=dict)  # head -> quantity -> the second runs' value
    types: dict[Key, str] = field(default_factory=dict)  # head -> type in the current (second) clustering
    shapes: dict[str, int] = field(default_factory=dict)  # model -> num_layers

    def heads(self, model: str | None = None) -> list[Key]:
        return sorted(k for k in self.values if model is None or k[0] == model)


def value(k: int, run: int, shift: float = 0.0) -> float:
    """The ``k``-th head's value in run ``run`` (1 or 2)."""
    return GRID[k % len(GRID)] + shift + (OLDER if run == 1 else 0.0)


def _ids(session: Session, model_id: int) -> dict[tuple[str, int, int], int]:
    rows = session.execute(select(Head.stack, Head.layer, Head.head, Head.id).where(Head.model_id == model_id))
    return {(s, la, h): i for s, la, h, i in rows}


def _times(k: int) -> dict[str, Any]:
    """The ``k``-th run of a kind starts after the one before it has finished."""
    start = NOW + timedelta(hours=k)
    return {
        "started_at": start,
        "finished_at": start + timedelta(minutes=30),
        "device": "cpu",
        "dtype": "float32",
        "seconds": 1800.0,
    }


def build(session: Session, paths: dict[str, Path]) -> Catalog:
    """The catalog in ``session``'s transaction (``paths``: bert and bart model directories)."""
    rng = np.random.default_rng(32)
    catalog = Catalog()
    model_ids: dict[str, int] = {}
    head_ids: dict[str, dict[tuple[str, int, int], int]] = {}
    feature_runs: dict[str, list[int]] = {}
    for name, stacks in SHAPES.items():
        path = paths["bart" if name == "bart" else "bert"]
        first = store_model(session, path, name, {s: dirichlet(rng, 2, 4) for s in stacks})
        second = store_model(session, path, name, {s: dirichlet(rng, 2, 4) for s in stacks}, add_run=True)
        model_ids[name] = session.scalars(select(CatalogModel.id).where(CatalogModel.name == name)).one()
        failed = FeatureRun(
            model_id=model_ids[name], corpus_id=session.get_one(FeatureRun, second).corpus_id, status="failed",
            num_windows=16, max_length=64, samples_requested=4, num_samples=0, num_tokens=0, special_tokens={},
            config={}, example_tokens=None, **_times(3),
        )  # fmt: skip
        session.add(failed)
        session.flush()
        feature_runs[name] = [first, second, failed.id]
        head_ids[name] = _ids(session, model_ids[name])
        catalog.runs[name] = {"feature": feature_runs[name]}
        catalog.shapes[name] = 2
        for k, (stack, layer, head) in enumerate(sorted(head_ids[name])):
            catalog.values[name, stack, layer, head] = {"k": k, "feature_run_id": second}
    _clusterings(session, catalog, model_ids, head_ids, feature_runs)
    for key in catalog.heads("plain"):
        catalog.values[key].update(margin=None, agreement=None)
    corpus = session.scalars(select(Corpus.id).limit(1)).one()
    for name in SHAPES:
        model_id, ids = model_ids[name], head_ids[name]
        catalog.runs[name]["importance"] = _importance(session, catalog, name, model_id, ids)
        catalog.runs[name]["attribution"] = _attribution(session, catalog, name, model_id, ids, corpus)
        catalog.runs[name]["syntax"] = _syntax(session, catalog, name, model_id, ids)
        catalog.runs[name]["detection"] = _detection(session, catalog, name, model_id, ids)
    session.flush()
    # As each run's job does when it completes (service/current.py): the later complete run becomes current.
    for run_type in (FeatureRun, StabilityRun, ImportanceRun, AttributionRun, SyntaxRun, DetectionRun):
        complete = select(run_type).order_by(run_type.id)
        if hasattr(run_type, "status"):
            complete = complete.where(run_type.status == "complete")
        for run in session.scalars(complete):
            current.completed(session, run)
    session.flush()
    return catalog


def _clusterings(
    session: Session,
    catalog: Catalog,
    model_ids: dict[str, int],
    head_ids: dict[str, dict[tuple[str, int, int], int]],
    feature_runs: dict[str, list[int]],
) -> None:
    """Two joint clusterings of ``tiny`` and ``bart`` (types a/b of the first, c/d of the second), two stability
    runs of each; the second clustering is current, and a third that failed is not."""
    heads = [key for key in catalog.heads() if key[0] in CLUSTERED]
    for run, names in ((1, ("a", "b")), (2, ("c", "d")), (3, ())):
        clustering = Clustering(algorithm="kmeans", k=2, seed=run, num_windows=16, params={},
                                status="complete" if names else "failed", num_heads=len(heads), seconds=0.5,
                                vector="local", created_at=NOW + timedelta(hours=run),
                                finished_at=NOW + timedelta(hours=run, minutes=30))  # fmt: skip
        session.add(clustering)
        session.flush()
        catalog.clusterings.append(clustering.id)
        if not names:
            continue
        session.execute(
            clustering_feature_runs.insert(),
            [{"clustering_id": clustering.id, "feature_run_id": feature_runs[m][run - 1]} for m in CLUSTERED],
        )
        clusters = []
        for index, name in enumerate(names):
            cluster = Cluster(clustering_id=clustering.id, index=index, name=name,
                              centroid=[1 / 21] * 21, size=len(heads) // 2, share=0.5)  # fmt: skip
            session.add(cluster)
            clusters.append(cluster)
        session.flush()
        for key in heads:
            model, stack, layer, head = key
            k = catalog.values[key]["k"]
            margin = None if k % 7 == 3 else value(k, run, shift=-0.25)  # NULL: assignments of an imported clustering
            cluster = clusters[(k + run) % 2]
            session.add(HeadAssignment(model_id=model_ids[model], clustering_id=clustering.id,
                                       head_id=head_ids[model][stack, layer, head], cluster_id=cluster.id,
                                       feature_run_id=feature_runs[model][run - 1], margin=margin))  # fmt: skip
            if run == 2:
                catalog.values[key]["margin"] = margin
                catalog.types[key] = cluster.name
        session.flush()
        catalog.stability[clustering.id] = []
        for stability in (1, 2):
            row = StabilityRun(clustering_id=clustering.id, n_runs=3, fraction=0.8, random_state=stability,
                               seeds=[1, 2, 3], score=0.5, num_heads=len(heads), seconds=0.1,
                               created_at=NOW + timedelta(hours=run, minutes=10 * stability))  # fmt: skip
            session.add(row)
            session.flush()
            catalog.stability[clustering.id].append(row.id)
            for key in heads:
                model, stack, layer, head = key
                k = catalog.values[key]["k"]
                # the latest run of the current clustering is 2 of 2; older runs differ on every head
                latest = run == 2 and stability == 2
                agreement = None if k % 5 == 2 else value(k, 2 if latest else 1, shift=0.125 * (run - 1))
                session.add(StabilityHead(model_id=model_ids[model], stability_run_id=row.id,
                                          head_id=head_ids[model][stack, layer, head], stable=bool(k % 2),
                                          agreement=agreement))  # fmt: skip
                if latest:
                    catalog.values[key]["agreement"] = agreement
                    catalog.values[key]["stable"] = bool(k % 2)
    for model in CLUSTERED:
        session.execute(update(CatalogModel).where(CatalogModel.id == model_ids[model])
                        .values(current_clustering_id=catalog.clusterings[1]))  # fmt: skip
    session.flush()


def _importance(session: Session, catalog: Catalog, name: str, model_id: int, ids: dict[Any, int]) -> list[int]:
    made = []
    for run in (1, 2, 3):
        row = ImportanceRun(model_id=model_id, status="complete" if run < 3 else "failed", loss="sensitivity",
                            task=None, data_kind="builtin", data_source="builtin:wiki", data_sha256=None,
                            data_subset=None, data_size=4, limit=None, n_examples=4, seed=run, mean_loss=None,
                            config={}, **_times(run))  # fmt: skip
        session.add(row)
        session.flush()
        made.append(row.id)
        if run == 3:
            continue
        for (stack, layer, head), head_id in ids.items():
            key = (name, stack, layer, head)
            normalized = value(catalog.values[key]["k"], run)
            session.add(ImportanceScore(model_id=model_id, run_id=row.id, head_id=head_id, raw=2 * normalized,
                                        normalized=normalized))  # fmt: skip
            if run == 2:
                catalog.values[key].update(importance=normalized, importance_raw=2 * normalized,
                                           importance_run_id=row.id)  # fmt: skip
    return made


def _attribution(
    session: Session, catalog: Catalog, name: str, model_id: int, ids: dict[Any, int], corpus: int
) -> list[int]:
    """Attribution runs of the encoder: the other stacks' heads have no discrepancy (NULL)."""
    made = []
    encoder = {key: head_id for key, head_id in ids.items() if key[0] == "encoder"}
    for run in (1, 2, 3):
        row = AttributionRun(
            model_id=model_id, corpus_id=corpus, status="complete" if run < 3 else "failed", stack="encoder",
            num_windows=16, max_length=16, samples_requested=2, num_samples=2, num_tokens=20, queries=4, probes=2,
            seed=run, triples=8, passes=1, layer_discrepancy=[0.5, 0.5], config={}, example_tokens=["a", "b"],
            example_queries=[0], **_times(run),
        )  # fmt: skip
        session.add(row)
        session.flush()
        made.append(row.id)
        if run == 3:
            continue
        for (stack, layer, head), head_id in encoder.items():
            key = (name, stack, layer, head)
            discrepancy = value(catalog.values[key]["k"], run)
            vector = np.full(21, 1 / 21)
            vector[run] += 0.01  # the runs' global vectors differ too
            vector /= vector.sum()
            session.add(
                HeadAttribution(
                    model_id=model_id,
                    attribution_run_id=row.id,
                    head_id=head_id,
                    vector=vector.tolist(),
                    local_vector=vector.tolist(),
                    discrepancy=discrepancy,
                    example_attention=[[0.5, 0.5]],
                    example_attribution=[[run / 4, 1 - run / 4]],
                )
            )
            if run == 2:
                catalog.values[key].update(discrepancy=discrepancy, global_vector=vector.tolist())
    for key in catalog.heads(name):
        catalog.values[key].setdefault("discrepancy", None)
    return made


def _syntax(session: Session, catalog: Catalog, name: str, model_id: int, ids: dict[Any, int]) -> list[int]:
    """Syntax runs of the encoder: accuracy correct / 8 for one relation, the better direction kept."""
    made = []
    for run in (1, 2, 3):
        row = SyntaxRun(model_id=model_id, status="complete" if run < 3 else "failed", stack="encoder",
                        parses="gold", source="/x.conllu", sha256="ab" * 32, parser=None, num_sentences=3,
                        num_skipped=0, num_words=20, config={}, **_times(run))  # fmt: skip
        session.add(row)
        session.flush()
        made.append(row.id)
        if run == 3:
            continue
        session.add(SyntaxBaseline(syntax_run_id=row.id, relation=RELATION, count=8, offset=1, accuracy=0.25 * run))
        for (stack, layer, head), head_id in ids.items():
            if stack != "encoder":
                continue
            key = (name, stack, layer, head)
            accuracy = value(catalog.values[key]["k"], run)
            for direction, share in (("dep2head", accuracy), ("head2dep", accuracy - 0.125)):
                session.add(
                    HeadSyntax(
                        model_id=model_id,
                        syntax_run_id=row.id,
                        head_id=head_id,
                        relation=RELATION,
                        direction=direction,
                        correct=int(share * 16),
                        count=16,
                        accuracy=share,
                    )
                )
            if run == 2:
                catalog.values[key]["syntax_accuracy"] = accuracy
    for key in catalog.heads(name):
        catalog.values[key].setdefault("syntax_accuracy", None)
    return made


def _detection(session: Session, catalog: Catalog, name: str, model_id: int, ids: dict[Any, int]) -> list[int]:
    """Detection runs at thresholds of 0.5: a head's roles are the detectors it reaches; cross heads have no
    induction or duplicate-token score."""
    made = []
    config = DetectionConfig(sequences=2, length=3, thresholds=THRESHOLDS, device="cpu").to_json()
    for run in (1, 2, 3):
        row = DetectionRun(
            model_id=model_id, status="complete" if run < 3 else "failed", config=config,
            sequences={"sequences": [[5, 6, 7, 5, 6, 7]] * 2, "prefix": [], "suffix": [], "prefix_source": "none",
                       "pool_size": 100},
            num_sequences=2, num_tokens=6, loss_first=None, loss_later=None, repeat_gain=None, checks=[],
            example_tokens={"tokens": ["a", "b", "c", "a", "b", "c"]}, example_size=2, **_times(run),
        )  # fmt: skip
        session.add(row)
        session.flush()
        made.append(row.id)
        if run == 3:
            continue
        for (stack, layer, head), head_id in ids.items():
            key = (name, stack, layer, head)
            k = catalog.values[key]["k"]
            scores = {
                detector: None if stack == "cross" and detector not in CROSS_DETECTORS else value(k + d, run)
                for d, detector in enumerate(DETECTORS)
            }
            roles = [d for d in DETECTORS if scores[d] is not None and scores[d] >= THRESHOLDS[d]]
            session.add(HeadDetection(model_id=model_id, detection_run_id=row.id, head_id=head_id, roles=roles,
                                      example_map=[run / 4, 1 - run / 4, 0.5, 0.5], **scores))  # fmt: skip
            if run == 2:
                catalog.values[key].update(scores, roles=roles)
    return made


def committed(engine: Engine, bert: Path, bart: Path) -> Catalog:
    """:func:`build` in a committed transaction of ``engine`` (a module's own database)."""
    with sessionmaker(bind=engine, expire_on_commit=False)() as session, session.begin():
        return build(session, {"bert": bert, "bart": bart})


# --- the module fixtures of the tests that read this catalog (import them: engine, catalog, api) ---------------


@pytest.fixture(scope="module")
def engine(committed_database_url: str) -> Iterator[Engine]:
    engine = create_engine(committed_database_url)
    yield engine
    engine.dispose()


@pytest.fixture(scope="module")
def catalog(engine: Engine, tiny_bert_path: Path, bart_path: Path) -> Catalog:
    return committed(engine, tiny_bert_path, bart_path)


@pytest.fixture(scope="module")
def api(engine: Engine, catalog: Catalog) -> Iterator[TestClient]:
    from service.app import create_app
    from tests.conftest import grant_key

    key = grant_key(sessionmaker(bind=engine))
    with TestClient(create_app(engine), headers={"Authorization": f"Bearer {key}"}) as client:
        yield client
