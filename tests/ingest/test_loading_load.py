"""``load_model`` and ``probe_stacks`` end to end on tiny models (issue 14, mutation testing).

Hub ids are loaded from a Hugging Face cache built here (``models--<org>--<name>`` with a
snapshot and a ref, as ``huggingface_hub`` lays it out), never the network: what is recorded
(source, revision), which revision is read, and that nothing is fetched once the cache is chosen.
Each refusal's message is asserted in full; where it quotes transformers' own error, that
error's first line is taken here from the same transformers call.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ingest.loading import ModelLoadError, load_model

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
