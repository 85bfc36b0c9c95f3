"""Fixtures for the service tests: a tiny real model ingested and clustered in the test transaction."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session, sessionmaker

from service.app import create_app
from service.jobs.runner import run_inline
from tests.conftest import grant_key

TINY = "tiny"


def ingest_request(source: Path | str, name: str = TINY, **overrides: Any) -> dict[str, Any]:
    request = {"model": str(source), "name": name, "corpus": "builtin:wiki", "samples": 48, "max_length": 64,
               "batch_size": 16, "device": "cpu"}  # fmt: skip
    return {**request, **overrides}


@pytest.fixture
def tiny_ingested(sessions: sessionmaker[Session], tiny_bert_path: Path) -> int:
    """The tiny random BERT (2 layers x 4 heads) ingested as ``tiny``; returns the feature run id."""
    job = run_inline(sessions, "ingest", ingest_request(tiny_bert_path))
    assert job.status == "succeeded", job.error
    assert job.result is not None
    return int(job.result["feature_run_id"])


@pytest.fixture
def tiny_clustered(sessions: sessionmaker[Session], tiny_ingested: int) -> int:
    """``tiny`` clustered with k = 4; returns the clustering id."""
    job = run_inline(sessions, "clustering", {"models": [TINY], "k": 4, "seed": 0})
    assert job.status == "succeeded", job.error
    assert job.result is not None
    return int(job.result["clustering_id"])


@pytest.fixture(scope="session")
def sharp_bert_path(tmp_path_factory: pytest.TempPathFactory, tiny_bert_path: Path) -> Path:
    """The tiny BERT with its attention sharpened (query/key x 6) and weighted (output projection x 20), saved:
    its heads differ and ablating them moves the hidden states far above float noise."""
    import torch
    from transformers import AutoTokenizer, BertModel

    model = BertModel.from_pretrained(tiny_bert_path).eval()
    with torch.no_grad():
        for layer in model.encoder.layer:
            layer.attention.self.query.weight.mul_(6.0)
            layer.attention.self.key.weight.mul_(6.0)
            layer.attention.output.dense.weight.mul_(20.0)
    path = tmp_path_factory.mktemp("sharp-bert")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_bert_path).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def bart_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random BART (2 layers x 4 heads in its encoder, decoder and cross stacks) on disk."""
    import torch
    from transformers import BartConfig, BartModel

    from tests.ingest.test_architectures import tokenizer

    torch.manual_seed(0)
    config = BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                        max_position_embeddings=64)  # fmt: skip
    path = tmp_path_factory.mktemp("tiny-bart")
    BartModel(config).save_pretrained(path)
    tokenizer(None, type_ids=False).save_pretrained(path)  # load_model refuses a directory without one
    return path


@pytest.fixture(scope="module")
def catalog_engine(committed_database_url: str, tiny_bert_path: Path) -> Iterator[Engine]:
    """A committed catalog holding ``tiny`` ingested and clustered once (read-only tests, and the
    ablation fault test, which only adds rows of its own)."""
    engine = create_engine(committed_database_url)
    sessions = sessionmaker(bind=engine, expire_on_commit=False)
    run_inline(sessions, "ingest", ingest_request(tiny_bert_path))
    run_inline(sessions, "clustering", {"models": [TINY], "k": 4, "seed": 0})
    yield engine
    engine.dispose()


@pytest.fixture(scope="module")
def reader(catalog_engine: Engine) -> Iterator[TestClient]:
    """The API over the module's committed catalog."""
    key = grant_key(sessionmaker(bind=catalog_engine))
    with TestClient(create_app(catalog_engine), headers={"Authorization": f"Bearer {key}"}) as client:
        yield client
