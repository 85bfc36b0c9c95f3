"""Model loading: local directories, refused sources, devices and dtypes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ingest.loading import ModelLoadError, load_model, resolve_device, resolve_dtype


def test_local_tiny_model_loads(tiny_bert_path: Path) -> None:
    loaded = load_model(str(tiny_bert_path), device="cpu")
    assert loaded.source == str(tiny_bert_path.resolve())
    assert loaded.revision is None
    assert (loaded.architecture, loaded.num_layers, loaded.num_heads) == ("bert", 2, 4)
    assert (loaded.device, loaded.dtype) == (torch.device("cpu"), torch.float32)
    assert not loaded.model.training
    assert loaded.model.config._attn_implementation == "eager"
    assert next(loaded.model.parameters()).device.type == "cpu"
    assert loaded.tokenizer.cls_token == "[CLS]"


def test_task_heads_and_dtype(tiny_bert_path: Path) -> None:
    loaded = load_model(str(tiny_bert_path), device="cpu", dtype="bfloat16", task="sequence-classification")
    assert type(loaded.model).__name__ == "BertForSequenceClassification"
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert loaded.dtype == torch.bfloat16
    qa = load_model(str(tiny_bert_path), device="cpu", task="question-answering")
    assert type(qa.model).__name__ == "BertForQuestionAnswering"


def test_missing_and_bad_local_paths(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"model path './no-such-model' does not exist"):
        load_model("./no-such-model", device="cpu")
    file = tmp_path / "model.bin"
    file.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is a file"):
        load_model(str(file), device="cpu")
    with pytest.raises(ModelLoadError, match=r"model directory .* could not be loaded"):
        load_model(str(tmp_path), device="cpu")


def test_unreachable_hub_id_is_a_clear_error() -> None:
    # conftest sets HF_HUB_OFFLINE=1: this fails at once, without the network.
    with pytest.raises(ModelLoadError, match="hub id 'no-org/no-such-model' could not be loaded") as error:
        load_model("no-org/no-such-model", device="cpu")
    assert "HF_HUB_OFFLINE" in str(error.value)
    assert error.value.__cause__ is not None


def test_architecture_without_attention_interface_is_refused(tmp_path: Path, tiny_bert_path: Path) -> None:
    from transformers import AutoTokenizer, DebertaV2Config, DebertaV2Model

    config = DebertaV2Config(
        vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    DebertaV2Model(config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_bert_path).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="architecture 'deberta-v2' does not dispatch its attention"):
        load_model(str(tmp_path), device="cpu")


def test_devices() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="device 'gpu0'"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda:1'.*not available"):
            resolve_device("cuda:1")


def test_dtypes() -> None:
    assert resolve_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype 'float64'"):
        resolve_dtype("float64")


def test_bad_device_fails_before_loading(tiny_bert_path: Path) -> None:
    with pytest.raises(ValueError, match="device 'tpu'"):
        load_model(str(tiny_bert_path), device="tpu")
