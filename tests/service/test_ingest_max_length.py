"""Ingest's ``max_length`` when none is asked: 128, or the model's positions where it has fewer; an explicit one
above them is refused before a job is queued."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from ingest.types import default_max_length, positions
from service.errors import InvalidInput
from service.ingests.schemas import IngestCreate
from service.ingests.service import check_sources
from service.jobs.runner import run_inline
from service.orm import FeatureRun
from tests.service.conftest import ingest_request


@pytest.fixture(scope="module")
def short_bert_path(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> Path:
    """A random 1-layer BERT with 64 positions (MiniLM's tokenizer)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64)  # fmt: skip
    path = tmp_path_factory.mktemp("short-bert")
    BertModel(config).eval().save_pretrained(path)
    AutoTokenizer.from_pretrained(minilm_path).save_pretrained(path)
    return path


def test_the_default_is_128_or_fewer_positions() -> None:
    assert default_max_length({"max_position_embeddings": 64}) == 64
    assert default_max_length({"max_position_embeddings": 128}) == 128
    assert default_max_length({"max_position_embeddings": 512}) == 128
    assert default_max_length({"max_position_embeddings": -1}) == 128  # unbounded
    assert default_max_length({}) == 128
    assert positions({"max_position_embeddings": 64}) == 64


def test_an_ingest_without_max_length_of_a_64_position_model_runs_at_64(
    sessions: sessionmaker[Session], short_bert_path: Path
) -> None:
    request = ingest_request(short_bert_path, name="short", samples=6)
    del request["max_length"]
    job = run_inline(sessions, "ingest", request)
    assert job.status == "succeeded", job.error
    with sessions() as session:
        run = session.get_one(FeatureRun, job.result["feature_run_id"])  # type: ignore[index]
        assert run.max_length == 64


def test_an_explicit_max_length_above_the_positions_is_refused_before_queuing(short_bert_path: Path) -> None:
    with pytest.raises(InvalidInput, match=r"max_length: 128 is more than the model's 64 positions") as refused:
        check_sources(IngestCreate(model=str(short_bert_path), name="short", max_length=128))
    assert refused.value.field == "max_length"
    check_sources(IngestCreate(model=str(short_bert_path), name="short", max_length=64))  # at the bound: taken
