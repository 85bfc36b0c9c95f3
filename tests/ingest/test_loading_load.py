"""``load_model`` and ``probe_stacks`` end to end on tiny models (issue 14, mutation testing).

Hub ids are loaded from a Hugging Face cache built here (``models--<org>--<name>`` with a
snapshot and a ref, as ``huggingface_hub`` lays it out), never the network: what is recorded
(source, revision), which revision is read, and that nothing is fetched once the cache is chosen.
Each refusal's message is asserted in full; where it quotes transformers' own error, that
error's first line is taken here from the same transformers call.
"""

from __future__ import annotations

import http.server
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ingest.loading import ModelLoadError, load_model, probe_stacks

# --- weights that cannot be read ---------------------------------------------------------------


def _first_line_of_error(call: object) -> str:
    """The first line of what ``call()`` raises (transformers' own message, stripped)."""
    try:
        call()  # type: ignore[operator]
    except Exception as error:  # noqa: BLE001
        return str(error).strip().splitlines()[0]
    raise AssertionError("no error")


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_truncated_weights_are_one_line(tmp_path: Path, tiny_bert_path: Path, weights: str) -> None:
    """An interrupted download: half the weights file (safetensors), or bytes that are no pickle (.bin)."""
    from transformers import AutoModel

    model = Path(shutil.copytree(tiny_bert_path, tmp_path / "truncated"))
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").unlink()
    (model / weights).write_bytes(data[: len(data) // 2] if weights.endswith(".safetensors") else b"not a pickle")
    first = _first_line_of_error(lambda: AutoModel.from_pretrained(model))
    with pytest.raises(ModelLoadError) as error:
        load_model(str(model), device="cpu")
    assert str(error.value) == f"{model}: the 'bert' model cannot be loaded as AutoModel: {first}"


# --- hub ids, from a cache built here ----------------------------------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_bert_path: Path) -> Path:
    """``headcat/tiny-bert`` at ref ``v1`` (no ``main``) in a fresh hub cache; the hub offline."""
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--headcat--tiny-bert"
    shutil.copytree(tiny_bert_path, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "v1").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def test_a_cached_hub_id_records_its_commit(cache: Path) -> None:
    loaded = load_model("headcat/tiny-bert", device="cpu", revision="v1")
    assert (loaded.source, loaded.revision) == ("headcat/tiny-bert", COMMIT)
    assert (loaded.architecture, loaded.stacks) == ("bert", {"encoder": (2, 4)})
    with pytest.raises(ModelLoadError) as error:  # no ref main in the cache: the revision asked for is the one read
        load_model("headcat/tiny-bert", device="cpu")
    assert str(error.value) == (
        f"hub id 'headcat/tiny-bert' is not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set: "
        "download it where the hub is reachable, or give a local directory"
    )


class _Hub(http.server.BaseHTTPRequestHandler):
    """A hub that answers nothing: every request is counted, then its connection closed unanswered."""

    paths: list[str] = []

    def handle_one_request(self) -> None:
        self.raw_requestline = self.rfile.readline(65537)
        if self.raw_requestline:
            self.paths.append(self.raw_requestline.decode().split()[1])
        self.close_connection = True

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def dead_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    from huggingface_hub import constants

    _Hub.paths = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)  # the API's requests; below, the files' (else unrecorded)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    try:
        yield _Hub.paths
    finally:
        server.shutdown()
        server.server_close()


def test_an_unreachable_hub_is_asked_once_then_the_cache_is_read(cache: Path, dead_hub: list[str]) -> None:
    loaded = load_model("headcat/tiny-bert", device="cpu", revision="v1")
    assert (loaded.source, loaded.revision) == ("headcat/tiny-bert", COMMIT)
    # the model's metadata request, and no file of it asked for after (huggingface_hub may ask for its own things)
    assert [path for path in dead_hub if "tiny-bert" in path] == ["/api/models/headcat/tiny-bert/revision/v1"]


# --- local directories --------------------------------------------------------------------------

REMOTE_CODE = """
from pathlib import Path

from transformers import PretrainedConfig

(Path(__file__).resolve().parent / "{marker}").write_text("remote code ran")


class RemoteConfig(PretrainedConfig):
    model_type = "headcat-remote"
"""


def test_remote_code_is_never_run(tmp_path: Path, tiny_bert_path: Path) -> None:
    import json

    import transformers

    model = Path(shutil.copytree(tiny_bert_path, tmp_path / "remote"))
    marker = tmp_path / "ran.txt"
    config = json.loads((model / "config.json").read_text())
    config |= {"model_type": "headcat-remote", "auto_map": {"AutoConfig": "configuration_remote.RemoteConfig"}}
    (model / "config.json").write_text(json.dumps(config))
    (model / "configuration_remote.py").write_text(REMOTE_CODE.format(marker=f"../{marker.name}"))
    with pytest.raises(ModelLoadError) as error:
        load_model(str(model), device="cpu")
    assert str(error.value) == (
        f"{model}: architecture 'headcat-remote' is not supported: transformers {transformers.__version__} does not "
        "know it (remote code is never run)"
    )
    assert not marker.exists()


def test_a_relative_path_is_recorded_absolute(monkeypatch: pytest.MonkeyPatch, tiny_bert_path: Path) -> None:
    monkeypatch.chdir(tiny_bert_path.parent)
    loaded = load_model(f"./{tiny_bert_path.name}")  # the default device: "auto", the CPU here
    assert (loaded.source, loaded.revision) == (str(tiny_bert_path.resolve()), None)
    assert loaded.device == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert not any(parameter.requires_grad for parameter in loaded.model.parameters())  # frozen


def test_a_device_map_leaves_the_device_unread(tiny_bert_path: Path) -> None:
    loaded = load_model(str(tiny_bert_path), device="tpu", device_map="auto")  # "tpu" alone is refused
    assert (loaded.device, loaded.device_map) == (torch.device("cpu"), "auto")


def test_one_key_value_head_is_recorded(tmp_path: Path, tiny_bert_path: Path) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaModel

    path = tmp_path / "mqa"
    LlamaModel(LlamaConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=1, intermediate_size=37)).save_pretrained(path)  # fmt: skip
    AutoTokenizer.from_pretrained(tiny_bert_path).save_pretrained(path)
    loaded = load_model(str(path), device="cpu")
    assert (loaded.stacks, loaded.num_key_value_heads) == ({"decoder": (2, 4)}, 1)


@pytest.mark.parametrize("value", [0, -1, "2", 2.0])
def test_a_key_value_head_count_that_is_no_positive_integer_is_not_recorded(
    tmp_path: Path, tiny_bert_path: Path, value: object
) -> None:
    """A config key BERT does not read (a hand-edited config.json): only a positive integer is a head count."""
    import json

    model = Path(shutil.copytree(tiny_bert_path, tmp_path / "odd"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_key_value_heads": value}))
    loaded = load_model(str(model), device="cpu")
    assert (loaded.stacks, loaded.num_key_value_heads) == ({"encoder": (2, 4)}, None)


def test_config_and_tokenizer_refusals_quote_the_first_line(tmp_path: Path, tiny_bert_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    model = Path(shutil.copytree(tiny_bert_path, tmp_path / "no-type"))
    (model / "config.json").write_text('{"hidden_size": 32}')  # JSON without model_type
    first = _first_line_of_error(lambda: AutoConfig.from_pretrained(model))
    with pytest.raises(ModelLoadError) as error:
        load_model(str(model), device="cpu")
    assert str(error.value) == f"{model}: config.json cannot be read as a transformers config: {first}"
    broken = Path(shutil.copytree(tiny_bert_path, tmp_path / "bad-tokenizer",
                                  ignore=shutil.ignore_patterns("vocab*", "tokenizer_config.json")))  # fmt: skip
    (broken / "tokenizer.json").write_text("{not json")
    first = _first_line_of_error(lambda: AutoTokenizer.from_pretrained(broken))
    with pytest.raises(ModelLoadError) as error:
        load_model(str(broken), device="cpu")
    assert str(error.value) == f"{broken}: the tokenizer cannot be loaded: {first}"


# --- probe_stacks: the 4-token pass, and what it refuses ----------------------------------------


def _probe_inputs(model: Any) -> dict[str, list[list[int]]]:
    """What ``probe_stacks`` feeds ``model``, by a forward pre-hook."""
    seen: dict[str, list[list[int]]] = {}

    def capture(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        seen.update({name: value.tolist() for name, value in kwargs.items()})

    hook = model.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        probe_stacks(model)
    finally:
        hook.remove()
    return seen


@pytest.mark.parametrize(("vocab", "ids"), [(30, [1, 2, 3, 4]), (3, [1, 2, 2, 2]), (1, [0, 0, 0, 0])])
def test_the_probe_pass_is_four_tokens_within_the_vocabulary(vocab: int, ids: list[int]) -> None:
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=37, pad_token_id=0)  # fmt: skip
    assert _probe_inputs(BertModel(config).eval()) == {"input_ids": [ids]}


def test_an_encoder_decoder_probe_pass_has_a_shorter_decoder_input() -> None:
    """Three decoder tokens against four encoder tokens: cross-attention maps that are not square."""
    from transformers import BartConfig, BartModel

    config = BartConfig(vocab_size=30, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37)  # fmt: skip
    bart = BartModel(config).eval()
    assert _probe_inputs(bart) == {"input_ids": [[1, 2, 3, 4]], "decoder_input_ids": [[1, 2, 3]]}
    assert probe_stacks(bart) == {"encoder": (1, 4), "decoder": (1, 4), "cross": (1, 4)}


class _TextConfig:
    """A config of a model outside transformers: only what is set here."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)

    def get_text_config(self) -> _TextConfig:
        return self


class _Wrapped(nn.Module):
    """MPNet layers (adapted attention: no attention implementation to switch) behind a config of its own;
    ``forward`` runs the layers listed in ``run`` and then raises ``fail`` if given."""

    def __init__(self, config: _TextConfig, heads: tuple[int, ...] = (4, 4), run: tuple[int, ...] = (0, 1),
                 fail: Exception | None = None) -> None:  # fmt: skip
        from transformers import MPNetConfig
        from transformers.models.mpnet.modeling_mpnet import MPNetLayer

        super().__init__()
        self.config, self.run, self.fail = config, run, fail
        self.embed = nn.Embedding(30, 32)
        self.layer = nn.ModuleList(
            MPNetLayer(MPNetConfig(hidden_size=32, num_attention_heads=h, intermediate_size=37)) for h in heads
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for index in self.run:
            hidden = self.layer[index](hidden)[0]
        if self.fail is not None:
            raise self.fail
        return hidden


NEEDS = "headcat needs layers 0..L-1 with one head count per stack"


@pytest.mark.parametrize("model_type", ["wrapped", None])
def test_probe_refusals_name_the_architecture(model_type: str | None) -> None:
    config = _TextConfig(vocab_size=30) if model_type is None else _TextConfig(vocab_size=30, model_type=model_type)
    name = model_type or "_Wrapped"
    assert probe_stacks(_Wrapped(config)) == {"encoder": (2, 4)}
    refusals = {
        _Wrapped(config, fail=ValueError("  bad input\nsecond line")):
            f"architecture {name!r} cannot be probed on a text input: ValueError: bad input",
        _Wrapped(config, run=()): f"architecture {name!r}: no attention module was called on a text input",
        _Wrapped(config, run=(1,)): f"architecture {name!r}: the probe saw encoder layers [1] with [4] heads; {NEEDS}",
        _Wrapped(config, heads=(4, 2)):
            f"architecture {name!r}: the probe saw encoder layers [0, 1] with [2, 4] heads; {NEEDS}",
    }  # fmt: skip
    for model, message in refusals.items():
        with pytest.raises(ModelLoadError) as error:
            probe_stacks(model)
        assert str(error.value) == message


def test_a_model_without_a_vocabulary_is_probed_with_token_0() -> None:
    assert _probe_inputs(_Wrapped(_TextConfig())) == {"input_ids": [[0, 0, 0, 0]]}
    assert _probe_inputs(_Wrapped(_TextConfig(vocab_size=None))) == {"input_ids": [[0, 0, 0, 0]]}
