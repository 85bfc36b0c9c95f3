"""Ingest jobs store one complete feature run, all at once, or nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from ingest.types import feature_names
from service.errors import Conflict, InvalidInput
from service.jobs.runner import run_inline
from service.orm import CatalogModel, FeatureRun, Head, HeadFeatures, Job
from tests.service.conftest import TINY, ingest_request


def test_ingest_stores_every_head_with_features_summing_to_one(session: Session, tiny_ingested: int) -> None:
    run = session.get_one(FeatureRun, tiny_ingested)
    model = session.get_one(CatalogModel, run.model_id)
    assert (model.name, model.architecture, model.num_layers, model.num_heads) == (TINY, "bert", 2, 4)
    assert run.status == "complete"
    assert run.num_samples == 48
    assert run.num_windows == 16
    assert run.max_length == 64
    assert run.config["num_windows"] == 16
    assert run.special_tokens["tokens"]["cls"] == ["[CLS]"]
    assert run.device == "cpu"
    assert run.dtype == "float32"
    rows = session.execute(
        select(Head.layer, Head.head, HeadFeatures.vector, HeadFeatures.entropy, HeadFeatures.example_map)
        .join(HeadFeatures, HeadFeatures.head_id == Head.id)
        .where(HeadFeatures.feature_run_id == run.id)
    ).all()
    assert sorted((r.layer, r.head) for r in rows) == [(la, h) for la in range(2) for h in range(4)]
    for row in rows:
        assert len(row.vector) == len(feature_names(16))
        assert sum(row.vector) == pytest.approx(1.0, abs=1e-5)
        assert row.entropy > 0
        assert np.asarray(row.example_map).ndim == 2


def test_a_taken_name_fails_before_any_compute_unless_a_new_run_is_asked_for(
    sessions: sessionmaker[Session], tiny_bert_path: Path, tiny_ingested: int
) -> None:
    with pytest.raises(Conflict, match="already in the catalog"):
        run_inline(sessions, "ingest", ingest_request(tiny_bert_path))
    with sessions() as session:
        failed = session.scalars(select(Job).where(Job.status == "failed")).one()
        assert "--add-run" in (failed.error or "")
    job = run_inline(sessions, "ingest", ingest_request(tiny_bert_path, add_run=True, samples=16))
    assert job.status == "succeeded"
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(FeatureRun)) == 2
        assert session.scalar(select(func.count()).select_from(Head)) == 8


def test_a_corpus_that_breaks_halfway_leaves_no_feature_run(
    sessions: sessionmaker[Session], tiny_bert_path: Path, tmp_path: Path
) -> None:
    corpus = tmp_path / "broken.jsonl"
    good = [json.dumps({"text": f"Sentence number {i} is fine.", "text_pair": "So is this one."}) for i in range(40)]
    corpus.write_text("\n".join([*good, "{not json", *good]) + "\n")
    with pytest.raises(InvalidInput, match="broken.jsonl"):
        run_inline(sessions, "ingest", ingest_request(tiny_bert_path, corpus=str(corpus), samples=80, batch_size=8))
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(FeatureRun)) == 0
        assert session.scalar(select(func.count()).select_from(CatalogModel)) == 0
        job = session.scalars(select(Job)).one()
        assert job.status == "failed"
        assert "broken.jsonl" in (job.error or "")


@pytest.mark.parametrize(
    ("override", "field"),
    [({"model": "/no/such/model"}, "model"), ({"corpus": "/no/such/corpus.jsonl"}, "corpus")],
)
def test_bad_sources_fail_with_the_field_named(
    sessions: sessionmaker[Session], tiny_bert_path: Path, override: dict[str, str], field: str
) -> None:
    with pytest.raises(InvalidInput) as error:
        run_inline(sessions, "ingest", ingest_request(tiny_bert_path, **override))
    assert error.value.message.startswith(f"{field}:")
