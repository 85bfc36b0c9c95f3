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
