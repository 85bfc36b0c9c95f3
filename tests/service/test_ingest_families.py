"""Ingest jobs of a grouped-query decoder and an encoder-decoder, end to end into the catalog.

The request's ``prepend_bos`` reaches the feature run (its stored config says what was fed), the
model record carries its stacks and key/value heads, and every stored head's features sum to 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from service.jobs.runner import run_inline
from service.orm import CatalogModel, FeatureRun, Head, HeadFeatures
from tests.ingest.test_architectures import FAMILIES, build, tokenizer
from tests.service.conftest import ingest_request

FAMILY = {family.name: family for family in FAMILIES}


def _saved(name: str, directory: Path) -> Path:
    family = FAMILY[name]
    build(family).save_pretrained(directory)
    tokenizer(family.template, type_ids=family.type_ids, start=not family.prepend_bos).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("prepend_bos", [True, False])
def test_a_gqa_decoder_is_stored_per_query_head_with_its_input_form(
    sessions: sessionmaker[Session], tmp_path: Path, prepend_bos: bool
) -> None:
    source = _saved("qwen2", tmp_path / "qwen2")  # 2 layers x 4 query heads over 2 key/value heads; no start token
    job = run_inline(sessions, "ingest", ingest_request(source, name="gqa", samples=8, prepend_bos=prepend_bos))
    assert job.status == "succeeded", job.error
    with sessions() as session:
        model = session.scalars(select(CatalogModel).where(CatalogModel.name == "gqa")).one()
        assert (model.num_layers, model.num_heads, model.num_key_value_heads) == (2, 4, 2)
        assert model.stacks == {"decoder": {"layers": 2, "heads": 4, "kv_heads": 2}}
        run = session.scalars(select(FeatureRun).where(FeatureRun.model_id == model.id)).one()
        assert run.config["prepend_bos"] is prepend_bos
        assert run.config["input_form"]["prepended_bos"] is prepend_bos
        stacks = session.scalars(select(Head.stack).where(Head.model_id == model.id).distinct()).all()
        assert stacks == ["decoder"]
        vectors = session.scalars(select(HeadFeatures.vector).where(HeadFeatures.feature_run_id == run.id)).all()
        sums = [sum(vector) for vector in vectors]
        assert len(sums) == 8
        assert sums == pytest.approx([1.0] * 8, abs=1e-6)


def test_an_encoder_decoder_stores_three_stacks(sessions: sessionmaker[Session], tmp_path: Path) -> None:
    source = _saved("bart", tmp_path / "bart")
    job = run_inline(sessions, "ingest", ingest_request(source, name="bart", samples=8))
    assert job.status == "succeeded", job.error
    with sessions() as session:
        model = session.scalars(select(CatalogModel).where(CatalogModel.name == "bart")).one()
        assert model.stacks == {
            "encoder": {"layers": 2, "heads": 4, "kv_heads": 4},
            "decoder": {"layers": 3, "heads": 2, "kv_heads": 2},
            "cross": {"layers": 3, "heads": 2, "kv_heads": 2},
        }
        per_stack = select(Head.stack, func.count()).where(Head.model_id == model.id).group_by(Head.stack)
        counts = dict(session.execute(per_stack).all())
        assert counts == {"encoder": 8, "decoder": 6, "cross": 6}
