"""Model loading's one-line refusals, exactly (issue 14, mutation testing).

``_hub_access`` runs against a fake ``HfApi`` and cache lookup (monkeypatched on
``huggingface_hub``), never the network: each answer the hub can give is checked for the
argument it was asked with, what ``_hub_access`` returns (cache only or not) and its message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ingest.loading import ModelLoadError, _config_problem, _first_line, _hub_access


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
