"""Model loading's one-line refusals, exactly (issue 14, mutation testing).

``_hub_access`` runs against a fake ``HfApi`` and cache lookup (monkeypatched on
``huggingface_hub``), never the network: each answer the hub can give is checked for the
argument it was asked with, what ``_hub_access`` returns (cache only or not) and its message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ingest.loading import (
    ModelLoadError,
    Task,
    _auto_model_class,
    _check_directory,
    _config_problem,
    _first_line,
    _hub_access,
    _is_local,
    _model_class,
    resolve_device,
    resolve_dtype,
)


def test_first_line() -> None:
    assert _first_line(ValueError("  first line\nsecond line  ")) == "first line"
    assert _first_line(ValueError("")) == "ValueError"
    assert _first_line(OSError("   ")) == "OSError"


def test_config_problem_names_the_model_type_or_the_error(tmp_path: Path) -> None:
    import transformers

    (tmp_path / "config.json").write_text('{"model_type": "imaginary"}')
    assert _config_problem(str(tmp_path), ValueError("ignored")) == (
        f"{tmp_path}: architecture 'imaginary' is not supported: transformers {transformers.__version__} "
        "does not know it (remote code is never run)"
    )
    (tmp_path / "config.json").write_text("[1]")  # JSON, but no object: no model_type to name
    assert _config_problem(str(tmp_path), KeyError("dim")) == (
        f"{tmp_path}: config.json cannot be read as a transformers config: 'dim'"
    )
    (tmp_path / "config.json").write_text('{"model_type": 3}')
    assert _config_problem(str(tmp_path), ValueError("bad\nmore")) == (
        f"{tmp_path}: config.json cannot be read as a transformers config: bad"
    )


def _error(cls: type[BaseException], message: str) -> BaseException:
    """An instance of a huggingface_hub error without the HTTP response its constructor wants."""
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    return error


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    import huggingface_hub
    from huggingface_hub import constants

    state: dict[str, Any] = {
        "cached": None,
        "cache_error": None,
        "info_error": None,
        "cache_calls": [],
        "info_calls": [],
    }

    def try_to_load_from_cache(*args: Any, **kwargs: Any) -> Any:
        state["cache_calls"].append((args, kwargs))
        if state["cache_error"] is not None:
            raise state["cache_error"]
        return state["cached"]

    class FakeApi:
        def model_info(self, *args: Any, **kwargs: Any) -> None:
            state["info_calls"].append((args, kwargs))
            if state["info_error"] is not None:
                raise state["info_error"]

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", try_to_load_from_cache)
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    state["cache"] = str(tmp_path)
    return state


def test_reachable_hub_loads_from_the_network(hub: dict[str, Any]) -> None:
    assert _hub_access("org/model", "v1") is False
    assert hub["cache_calls"] == [(("org/model", "config.json"), {"revision": "v1"})]
    assert hub["info_calls"] == [(("org/model",), {"revision": "v1", "timeout": 10})]


def test_offline_with_the_model_cached_reads_the_cache(hub: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub["cached"] = "/cache/org/model/config.json"
    assert _hub_access("org/model", None) is True
    assert hub["info_calls"] == []


def test_unreachable_hub_falls_back_to_the_cache(hub: dict[str, Any]) -> None:
    hub["info_error"] = ConnectionError("refused\nretry later")
    hub["cached"] = "/cache/org/model/config.json"
    assert _hub_access("org/model", None) is True
    hub["cached"] = None
    with pytest.raises(ModelLoadError) as error:
        _hub_access("org/model", None)
    assert str(error.value) == (
        f"hub id 'org/model': the Hugging Face hub cannot be reached (ConnectionError: refused) and the model "
        f"is not in the local cache ({hub['cache']}); download it where the hub is reachable (HF_HUB_OFFLINE=1 "
        "then uses the cache without trying the network), or give a local directory"
    )


def test_hub_refusals_are_named(hub: dict[str, Any]) -> None:
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError, RevisionNotFoundError

    hub["cache_error"] = HFValidationError("Repo id must be in the form 'repo_name'\ndetails")
    with pytest.raises(ModelLoadError) as error:
        _hub_access("a/b/c", None)
    assert str(error.value) == (
        "'a/b/c' is neither a local directory nor a hub id (Repo id must be in the form 'repo_name')"
    )
    hub["cache_error"] = None
    for cls in (RepositoryNotFoundError, GatedRepoError):
        hub["info_error"] = _error(cls, "404")
        with pytest.raises(ModelLoadError) as error:
            _hub_access("org/model", None)
        assert str(error.value) == (
            f"hub id 'org/model' does not exist on the Hugging Face hub, or is private or gated ({cls.__name__})"
        )
    hub["info_error"] = _error(RevisionNotFoundError, "404")
    with pytest.raises(ModelLoadError) as error:
        _hub_access("org/model", "v9")
    assert str(error.value) == "hub id 'org/model' has no revision 'v9'"


# --- names, devices, dtypes, directories: no model is loaded -----------------------------------


def test_dtypes_by_name() -> None:
    import torch

    assert [resolve_dtype(name) for name in ("float32", "float16", "bfloat16")] == [
        torch.float32,
        torch.float16,
        torch.bfloat16,
    ]
    with pytest.raises(ValueError, match=r"^dtype 'float64' is not supported; use one of float32, float16, bfloat16$"):
        resolve_dtype("float64")


def test_device_messages() -> None:
    import torch

    with pytest.raises(
        ValueError, match=r"^device 'gpu0' is not a device; use 'auto', 'cpu', 'cuda' or 'cuda:<index>'$"
    ):
        resolve_device("gpu0")
    assert resolve_device("cpu:0") == torch.device("cpu:0")
    if torch.cuda.is_available():  # these branches are only checked on a CUDA machine
        count = torch.cuda.device_count()
        assert resolve_device("auto") == torch.device("cuda")
        assert resolve_device("cuda") == torch.device("cuda")
        assert resolve_device(f"cuda:{count - 1}") == torch.device(f"cuda:{count - 1}")
        with pytest.raises(ValueError, match=rf"^device 'cuda:{count}': there are only {count} CUDA device\(s\) here$"):
            resolve_device(f"cuda:{count}")
    else:
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match=r"^device 'cuda' asked for CUDA, but CUDA is not available here$"):
            resolve_device("cuda")
    if torch.backends.mps.is_available():
        assert resolve_device("mps") == torch.device("mps")
    else:
        with pytest.raises(ValueError, match=r"^device 'mps' is not supported; use 'auto', 'cpu', 'cuda' or"):
            resolve_device("mps")


def test_device_choice_where_cuda_and_mps_are_present(monkeypatch: pytest.MonkeyPatch) -> None:
    """The branches a CPU machine never takes, with torch told there are 2 CUDA devices and MPS: the choice and
    its messages read only ``is_available`` and ``device_count``, and a ``torch.device`` is made without them."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"^device 'cuda:2': there are only 2 CUDA device\(s\) here$"):
        resolve_device("cuda:2")
    assert resolve_device("mps") == torch.device("mps")
    with pytest.raises(ValueError, match=r"^device 'meta' is not supported; use 'auto', 'cpu', 'cuda' or"):
        resolve_device("meta")  # neither CPU, CUDA nor MPS, even where those are present


def test_task_classes() -> None:
    import transformers

    assert [_auto_model_class(task) for task in TASKS] == [
        transformers.AutoModel,
        transformers.AutoModelForSequenceClassification,
        transformers.AutoModelForQuestionAnswering,
        transformers.AutoModelForMaskedLM,
        transformers.AutoModelForCausalLM,
    ]
    with pytest.raises(ValueError, match=f"^task 'ner' is not supported; use one of {', '.join(TASKS)}$"):
        _auto_model_class("ner")  # type: ignore[arg-type]


TASKS: tuple[Task, ...] = ("base", "sequence-classification", "question-answering", "masked-lm", "causal-lm")


@pytest.mark.parametrize(
    ("task", "architectures", "expected"),
    [
        ("base", ["T5EncoderModel"], "T5EncoderModel"),
        ("base", [3, "MT5EncoderModel"], "MT5EncoderModel"),  # names that are not strings are skipped
        ("base", ["BertModel"], "AutoModel"),
        ("base", ["HeadcatImaginaryEncoderModel"], "AutoModel"),  # not a transformers class
        ("base", None, "AutoModel"),
        ("base", [], "AutoModel"),
        ("sequence-classification", ["T5EncoderModel"], "AutoModelForSequenceClassification"),
    ],
)
def test_model_class(task: str, architectures: list[Any] | None, expected: str) -> None:
    import types

    assert _model_class(task, types.SimpleNamespace(architectures=architectures)).__name__ == expected  # type: ignore[arg-type]


def test_model_class_without_architectures_attribute() -> None:
    assert _model_class("base", object()).__name__ == "AutoModel"


def _model_dir(path: Path, *names: str) -> Path:
    path.mkdir()
    for name in names:
        (path / name).write_text("{}")
    return path


@pytest.mark.parametrize(
    "weights",
    ["model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "a.bin.index.json", "w.pt", "w.pth"],
)
def test_each_weights_file_counts(tmp_path: Path, weights: str) -> None:
    _check_directory(_model_dir(tmp_path / "m", "config.json", weights, "vocab.txt"))  # no error


@pytest.mark.parametrize(
    "tokenizer",
    [
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.txt",
        "vocab.json",
        "spiece.model",
        "sentencepiece.bpe.model",
        "tokenizer.model",
    ],
)
def test_each_tokenizer_file_counts(tmp_path: Path, tokenizer: str) -> None:
    _check_directory(_model_dir(tmp_path / "m", "config.json", "model.safetensors", tokenizer))  # no error


def test_check_directory_messages(tmp_path: Path) -> None:
    bare = _model_dir(tmp_path / "bare", "model.safetensors", "vocab.txt")
    with pytest.raises(ModelLoadError) as error:
        _check_directory(bare)
    assert str(error.value) == f"model directory {str(bare)!r} has no config.json: it is not a transformers model"
    (tmp_path / "dir-config").mkdir()
    (tmp_path / "dir-config" / "config.json").mkdir()  # a directory named config.json is no config
    with pytest.raises(ModelLoadError, match="has no config.json"):
        _check_directory(tmp_path / "dir-config")
    weightless = _model_dir(tmp_path / "weightless", "config.json", "vocab.txt", "model.safetensors.txt")
    with pytest.raises(ModelLoadError) as error:
        _check_directory(weightless)
    assert str(error.value) == (
        f"model directory {str(weightless)!r} has a config.json but no weights (model.safetensors or pytorch_model.bin)"
    )
    untokenized = _model_dir(tmp_path / "untokenized", "config.json", "model.safetensors", "special_tokens_map.json")
    with pytest.raises(ModelLoadError) as error:
        _check_directory(untokenized)
    assert str(error.value) == (
        f"model directory {str(untokenized)!r} has no tokenizer (none of tokenizer.json, tokenizer_config.json, "
        "vocab.txt, vocab.json, spiece.model, sentencepiece.bpe.model, tokenizer.model)"
    )


def test_is_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "model").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"")
    assert _is_local(str(tmp_path / "model")) is True
    assert _is_local("~/model") is True  # ~ is expanded
    assert _is_local("org/model") is False
    assert _is_local("model-name") is False
    with pytest.raises(ModelLoadError) as error:
        _is_local("~/weights.bin")
    assert str(error.value) == "model path '~/weights.bin' is a file; a model is a directory with config.json"
    for missing in ("./nope", "../nope", "/no/such/dir", "~/nope", "\\\\server\\share"):
        with pytest.raises(ModelLoadError) as error:
            _is_local(missing)
        assert str(error.value) == f"model path {missing!r} does not exist"
