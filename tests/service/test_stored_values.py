"""``sep_to_sep`` as stored: averaged over exactly the samples that have a separator, NULL when none has.

Every corpus the other tests use gives every sample a ``[SEP]``, so a reduction that averaged over
all samples (counting the separator-less ones as 0), or stored 0 or NaN instead of NULL, passed.
Here the tokenizer adds no separator of its own (its post-processor is ``[CLS] $A``), so only the
samples whose text holds ``[SEP]`` have one; the reference is computed from ``output_attentions``.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from ingest.corpora import load_corpus
from ingest.features import FeatureConfig, extract_features
from ingest.loading import LoadedModel, load_model
from service.ingests.schemas import IngestCreate
from service.ingests.service import store_feature_run

TEXTS = [
    "a sample without any separator, just words.",
    "one separator [SEP] in the middle of this one",
    "two [SEP] separators [SEP] here",
    "again none at all",
    "[SEP] at the start and [SEP] at the end [SEP]",
]


@pytest.fixture
def no_sep_model(tiny_bert_path: Path) -> LoadedModel:
    """The tiny BERT with sharpened attention (heads differ) and a tokenizer that adds no [SEP]."""
    from tokenizers.processors import TemplateProcessing

    loaded = load_model(str(tiny_bert_path), device="cpu")
    with torch.no_grad():
        for layer in loaded.model.encoder.layer:  # type: ignore[union-attr]
            layer.attention.self.query.weight.mul_(20.0)
            layer.attention.self.key.weight.mul_(20.0)
    tokenizer = loaded.tokenizer
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single="[CLS] $A", pair="[CLS] $A $B:1", special_tokens=[("[CLS]", tokenizer.cls_token_id)]
    )
    return loaded


def corpus_file(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def reference_sep_to_sep(loaded: LoadedModel, texts: list[str]) -> np.ndarray:
    """(layers, heads): per sample, attention from [SEP] queries to [SEP] keys over the [SEP] queries,
    averaged over the samples that have a [SEP]; NaN when none has."""
    values = []
    with torch.no_grad():
        for text in texts:
            inputs = loaded.tokenizer(text, return_tensors="pt")
            tokens = loaded.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0])
            seps = [i for i, token in enumerate(tokens) if token == "[SEP]"]
            if not seps:
                continue
            attentions = loaded.model(**inputs, output_attentions=True).attentions
            probs = torch.stack(attentions)[:, 0].double().numpy()  # (layers, heads, L, L)
            values.append(probs[:, :, seps][:, :, :, seps].sum((-1, -2)) / len(seps))
    return np.mean(values, axis=0) if values else np.full((2, 4), np.nan)


def ingest(sessions: sessionmaker[Session], loaded: LoadedModel, path: Path, name: str) -> int:
    fields = {"samples": 10, "max_length": 64, "batch_size": 2, "device": "cpu"}
    request = IngestCreate.model_validate({"model": loaded.source, "name": name, "corpus": str(path), **fields})
    corpus = load_corpus(str(path))
    started = datetime.now(UTC)
    config = FeatureConfig(max_length=64, batch_size=2, samples=10, device="cpu")
    result = extract_features(loaded, None, corpus.samples(10), config)
    with sessions() as session, session.begin():
        return store_feature_run(session, request, loaded, corpus, result, started)


def served_scalar(client: TestClient, name: str, scalar: str) -> dict[tuple[int, int], Any]:
    items = client.get("/heads", params={"model": name, "limit": 100}).json()["items"]
    return {(h["layer"], h["head"]): h["scalars"][scalar] for h in items}


def test_sep_to_sep_is_averaged_over_the_samples_with_a_separator(
    client: TestClient, sessions: sessionmaker[Session], no_sep_model: LoadedModel, tmp_path: Path
) -> None:
    """Caught: dividing by every sample (the separator-less ones as 0) or by the [SEP] count of the batch."""
    expected = reference_sep_to_sep(no_sep_model, TEXTS)
    everyone = expected * 3 / len(TEXTS)  # what averaging over all samples would give
    assert (np.abs(expected - everyone) > 1e-2).sum() >= 6  # the two rules differ on most heads
    ingest(sessions, no_sep_model, corpus_file(tmp_path / "mixed.jsonl", TEXTS), "mixed-seps")
    served = served_scalar(client, "mixed-seps", "sep_to_sep")
    assert len(served) == 8
    for (layer, head), value in served.items():
        assert value == pytest.approx(expected[layer, head], abs=1e-6), (layer, head)


def test_sep_to_sep_is_null_when_no_sample_has_a_separator(
    client: TestClient, sessions: sessionmaker[Session], no_sep_model: LoadedModel, tmp_path: Path
) -> None:
    texts = [t for t in TEXTS if "[SEP]" not in t]
    ingest(sessions, no_sep_model, corpus_file(tmp_path / "none.jsonl", texts), "no-seps")
    served = served_scalar(client, "no-seps", "sep_to_sep")
    assert len(served) == 8
    assert set(served.values()) == {None}
    entropy = served_scalar(client, "no-seps", "entropy")
    assert all(value is not None and value > 0 for value in entropy.values())  # only sep_to_sep is undefined
