"""Series (SPEC 11): a training run's checkpoints in step order, what they must share, and when a head formed.

Pure functions, no database: the service stores and serves what these compute.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STEP_DIRECTORY = re.compile(r"^step[-_]?(\d+)$")
STEP_REVISION = re.compile(r"(?:^|[^A-Za-z0-9])step[-_]?(\d+)$|^step[-_]?(\d+)$")


def step_of(name: str) -> int | None:
    """The step a checkpoint directory or hub revision names (``step-1000``, ``step1000``, ``step_1000``), else None."""
    found = STEP_DIRECTORY.match(Path(name).name) or STEP_REVISION.search(name)
    if found is None:
        return None
    return int(next(group for group in found.groups() if group is not None))


def checkpoint_directories(directory: Path) -> list[tuple[int, Path]]:
    """The ``step-N/`` checkpoints of ``directory``, in step order (an empty list when it has none).

    Two directories naming the same step (``step-10`` and ``step10``) are refused: their order
    would be a guess.
    """
    found: dict[int, Path] = {}
    for child in sorted(directory.iterdir()):
        match = STEP_DIRECTORY.match(child.name)
        if match is None or not child.is_dir():
            continue
        step = int(match.group(1))
        if step in found:
            raise ValueError(f"{directory}: {found[step].name} and {child.name} are both step {step}")
        found[step] = child
    return sorted(found.items())


def tokenizer_sha256(tokenizer: Any) -> str:
    """SHA-256 of what makes two tokenizers the same for a series: the vocabulary (token -> id),
    the special tokens, the class and whether BOS/EOS are added."""
    vocabulary = sorted(tokenizer.get_vocab().items())
    special = {key: str(value) for key, value in sorted((tokenizer.special_tokens_map or {}).items())}
    facts = {
        "vocabulary": vocabulary,
        "special": special,
        "class": type(tokenizer).__name__.removesuffix("Fast"),
        "add_bos": bool(getattr(tokenizer, "add_bos_token", False)),
        "add_eos": bool(getattr(tokenizer, "add_eos_token", False)),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def formation_step(steps: Sequence[int], has_role: Sequence[bool]) -> int | None:
    """The smallest step from which the head has the role at that step and every later one; None when
    it does not have it at the last step. ``steps`` ascending, ``has_role[i]`` at ``steps[i]``."""
    if len(steps) != len(has_role):
        raise ValueError(f"{len(steps)} steps but {len(has_role)} role flags")
    formed: int | None = None
    for step, present in zip(reversed(steps), reversed(has_role), strict=True):
        if not present:
            break
        formed = step
    return formed
