"""Model loading: local directories, refused sources, devices and dtypes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

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


def _one_line(error: pytest.ExceptionInfo[ModelLoadError]) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_a_directory_that_is_not_a_model_says_no_config_json(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ModelLoadError) as error:
        load_model(str(tmp_path), device="cpu")
    message = _one_line(error)
    assert message == f"model directory {str(tmp_path.resolve())!r} has no config.json: it is not a transformers model"
    assert "sentencepiece" not in message
    assert "tiktoken" not in message


def _copy_without(source: Path, target: Path, *patterns: str) -> Path:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(*patterns))
    return target


def test_a_checkpoint_without_weights_or_tokenizer_is_named(tmp_path: Path, tiny_bert_path: Path) -> None:
    bare = _copy_without(tiny_bert_path, tmp_path / "no-weights", "*.safetensors", "*.bin")
    with pytest.raises(ModelLoadError) as error:
        load_model(str(bare), device="cpu")
    assert _one_line(error).endswith("has a config.json but no weights (model.safetensors or pytorch_model.bin)")
    untokenized = _copy_without(
        tiny_bert_path, tmp_path / "no-tokenizer", "tokenizer*", "vocab*", "special_tokens_map.json"
    )
    with pytest.raises(ModelLoadError) as error:
        load_model(str(untokenized), device="cpu")
    assert "has no tokenizer (none of tokenizer.json" in _one_line(error)
    broken = _copy_without(tiny_bert_path, tmp_path / "bad-tokenizer", "vocab*", "tokenizer_config.json")
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError) as error:
        load_model(str(broken), device="cpu")
    assert "the tokenizer cannot be loaded: " in _one_line(error)


def test_an_unknown_architecture_is_named(tmp_path: Path, tiny_bert_path: Path) -> None:
    model = _copy_without(tiny_bert_path, tmp_path / "unknown")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "headcat-imaginary"}))
    with pytest.raises(ModelLoadError) as error:
        load_model(str(model), device="cpu")
    assert "architecture 'headcat-imaginary' is not supported: transformers" in _one_line(error)


def test_offline_hub_id_not_in_the_cache_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError) as error:
        load_model("no-org/no-such-model", device="cpu")
    assert _one_line(error) == (
        f"hub id 'no-org/no-such-model' is not in the local Hugging Face cache ({tmp_path}) and HF_HUB_OFFLINE "
        "is set: download it where the hub is reachable, or give a local directory"
    )


def test_unreachable_hub_fails_after_one_request_in_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A hub that hangs up: one metadata request decides, no retries with backoff (huggingface_hub's own
    would take a minute); counted on a local server that reads each request line and hangs up."""
    import socket
    import threading

    from huggingface_hub import constants

    requests: list[str] = []
    listener = socket.create_server(("127.0.0.1", 0))

    def hang_up_on_everyone() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            with connection:
                requests.append(connection.recv(4096).split(b"\r\n", 1)[0].decode())

    threading.Thread(target=hang_up_on_everyone, daemon=True).start()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{listener.getsockname()[1]}")
    try:
        with pytest.raises(ModelLoadError) as error:
            load_model("no-org/no-such-model", device="cpu")
    finally:
        listener.close()
    assert [r for r in requests if "no-such-model" in r] == ["GET /api/models/no-org/no-such-model HTTP/1.1"]
    message = _one_line(error)
    assert message.startswith("hub id 'no-org/no-such-model': the Hugging Face hub cannot be reached (")
    assert f"not in the local cache ({tmp_path})" in message
    assert "HF_HUB_OFFLINE=1" in message


def test_unsupported_attention_is_refused_naming_the_architecture(tmp_path: Path, tiny_bert_path: Path) -> None:
    from transformers import XLNetConfig, XLNetModel

    xlnet = XLNetModel(XLNetConfig(vocab_size=30522, d_model=32, n_layer=1, n_head=2, d_inner=32))
    with pytest.raises(ModelLoadError) as error:
        load_model(str(_save(xlnet, tiny_bert_path, tmp_path / "xlnet")), device="cpu")
    assert _one_line(error).startswith("architecture 'xlnet': no attention module dispatches through")


def _save(model: Any, tokenizer_from: Path, path: Path) -> Path:
    from transformers import AutoTokenizer

    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(path)
    return path


def test_stacks_and_key_value_heads_are_recorded(tmp_path: Path, tiny_bert_path: Path) -> None:
    from transformers import BartConfig, BartModel, DebertaV2Config, DebertaV2Model, LlamaConfig, LlamaModel

    llama = LlamaModel(LlamaConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=37))  # fmt: skip
    loaded = load_model(str(_save(llama, tiny_bert_path, tmp_path / "llama")), device="cpu")
    assert (loaded.stacks, loaded.num_key_value_heads) == ({"decoder": (3, 4)}, 2)
    assert (loaded.num_layers, loaded.num_heads) == (3, 4)
    bart = BartModel(BartConfig(vocab_size=30522, d_model=32, encoder_layers=2, decoder_layers=3,
                                encoder_attention_heads=4, decoder_attention_heads=2, encoder_ffn_dim=37,
                                decoder_ffn_dim=37))  # fmt: skip
    loaded = load_model(str(_save(bart, tiny_bert_path, tmp_path / "bart")), device="cpu")
    assert loaded.stacks == {"encoder": (2, 4), "decoder": (3, 2), "cross": (3, 2)}
    assert loaded.num_key_value_heads is None
    deberta = DebertaV2Model(DebertaV2Config(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=37, relative_attention=True,
                                             pos_att_type=["p2c", "c2p"]))  # fmt: skip
    loaded = load_model(str(_save(deberta, tiny_bert_path, tmp_path / "deberta")), device="cpu")
    assert (loaded.architecture, loaded.stacks) == ("deberta-v2", {"encoder": (2, 4)})


def test_t5_encoder_checkpoint_loads_as_its_own_class(tmp_path: Path, tiny_bert_path: Path) -> None:
    from transformers import T5Config, T5EncoderModel, T5Model

    config = T5Config(vocab_size=30522, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4)
    loaded = load_model(str(_save(T5EncoderModel(config), tiny_bert_path, tmp_path / "t5-encoder")), device="cpu")
    assert type(loaded.model).__name__ == "T5EncoderModel"
    assert loaded.stacks == {"encoder": (2, 4)}
    full = load_model(str(_save(T5Model(config), tiny_bert_path, tmp_path / "t5")), device="cpu")
    assert type(full.model).__name__ == "T5Model"
    assert full.stacks == {"encoder": (2, 4), "decoder": (2, 4), "cross": (2, 4)}


def test_device_map_places_a_small_model_on_the_cpu(tiny_bert_path: Path) -> None:
    loaded = load_model(str(tiny_bert_path), device_map="auto")
    assert loaded.device_map == "auto"
    assert {parameter.device.type for parameter in loaded.model.parameters()} == {"cpu"}
    assert loaded.device == torch.device("cpu")
    assert loaded.stacks == {"encoder": (2, 4)}
    bf16 = load_model(str(tiny_bert_path), device_map="auto", dtype="bfloat16")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16


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


def test_a_task_models_unused_weights_raise_no_load_report_but_missing_weights_do(
    tmp_path: Path, tiny_bert_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A fine-tuned task model read as the bare encoder leaves its head's weights unused: transformers'
    LOAD REPORT table of UNEXPECTED keys (and of the pooler a QA model lacks) is noise then. Weights a class
    needs and the checkpoint lacks (MISSING, randomly initialised) are still reported."""
    from transformers import AutoTokenizer, BertConfig, BertForQuestionAnswering

    config = BertConfig.from_pretrained(tiny_bert_path)
    task_dir = tmp_path / "tiny-qa"
    BertForQuestionAnswering(config).save_pretrained(task_dir)
    AutoTokenizer.from_pretrained(tiny_bert_path).save_pretrained(task_dir)
    with caplog.at_level("WARNING"):
        load_model(str(task_dir), device="cpu")  # qa_outputs.* unused; no pooler in a QA model
    assert "LOAD REPORT" not in caplog.text
    with caplog.at_level("WARNING"):
        load_model(str(tiny_bert_path), device="cpu", task="question-answering")  # no qa_outputs: MISSING
    assert "LOAD REPORT" in caplog.text
    assert "qa_outputs.weight" in caplog.text
