"""The examples of README.md and docs/*.md: read out of the pages, and their shown answers compared.

A page's examples are its fenced blocks tagged ``bash``, ``sql`` or ``python``. A block tagged ``json``
or ``text`` that follows an example, with nothing but blank lines between them, is that example's
printed answer. An HTML comment on the line before a block (or several, one a line) changes how it is run:

- ``<!-- docs-test: skip REASON -->``: not run (a command that reproduces a published figure and runs
  for minutes, or needs a GPU); the reason is required, and a ``bench/`` script it names must exist.
- ``<!-- docs-test: exit N -->``: the example must end with exit status N (an error shown on purpose).
- ``<!-- docs-test: needs PATH [PATH ...] REASON -->``: the example needs files a clone of the project
  does not have (a fine-tuned checkpoint, a data set), each PATH relative to the project's root (as the
  examples' ``../shared/...``); it runs where they all exist and is skipped, with the REASON, where one
  does not. The reason is required. An example that names a path outside the project (``../...``, or an
  absolute path beside the project) must carry this marker, naming it or a folder above it
  (:func:`outside_paths`), so no example fails on a clone only because a file is missing.

How a shown answer is compared (``match_json`` and ``match_text``):

- JSON: equal, except that a string ``"..."`` stands for any value, a ``"..."`` as the last element
  of a list for any further elements (none or more), and a number shown with d decimals is compared
  with the answer's rounded to d decimals (a number shown as an integer must be equal).
- text (psql's tables, a command's lines): equal line by line, trailing spaces and leading or
  trailing blank lines aside.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE = {"bash", "sql", "python"}
ANSWERS = {"json", "text"}
MARKER = re.compile(r"^<!--\s*docs-test:\s*(?P<verb>skip|exit|needs)\b\s*(?P<arg>.*?)\s*-->\s*$")
OUTSIDE = re.compile(r"(?<![\w./~-])(?:\.\./[\w.@+-][\w./@+-]*|/[\w.@+-][\w./@+-]*)")
ELLIPSIS = "..."


@dataclass
class Example:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    answer: str | None = None
    answer_lang: str | None = None
    skip: str | None = None
    exit: int = 0
    needs: list[str] = field(default_factory=list)  # paths relative to the project's root
    needs_why: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page}:{self.line}"


def pages() -> list[Path]:
    """README.md, then every page of the docs site in name order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def examples(page: Path) -> list[Example]:
    """The page's examples, in page order, each with its shown answer and marker."""
    lines = page.read_text(encoding="utf-8").split("\n")
    found: list[Example] = []
    previous: Example | None = None  # the last example, while only blank lines followed it
    i = 0
    while i < len(lines):
        opening = re.match(r"^(`{3,})\s*([\w.+-]*)", lines[i])
        if not opening:
            if lines[i].strip() and not MARKER.match(lines[i].strip()):
                previous = None
            i += 1
            continue
        fence, lang = opening.group(1), opening.group(2).lower()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(fence)), None)
        if end is None:
            raise ValueError(f"{page}:{i + 1}: a fenced block that never closes")
        body = "\n".join(lines[i + 1 : end])
        markers = []  # the comments on the lines right above the block, nearest last
        j = i - 1
        while j >= 0 and (marker := MARKER.match(lines[j].strip())):
            markers.insert(0, marker)
            j -= 1
        if lang in RUNNABLE:
            example = Example(page=page, line=i + 1, lang=lang, code=body)
            for marker in markers:
                _mark(example, marker.group("verb"), marker.group("arg"))
            found.append(example)
            previous = example
        elif lang in ANSWERS and previous is not None and previous.answer is None:
            previous.answer, previous.answer_lang = body, lang
            previous = None
        else:
            previous = None
        i = end + 1
    return found


def _mark(example: Example, verb: str, arg: str) -> None:
    if verb == "skip":
        if not arg:
            raise ValueError(f"{example.where}: a skipped example must say why")
        example.skip = arg
    elif verb == "needs":
        words = arg.split()
        paths = [w for w in words if w.startswith(("../", "/"))]
        example.needs, example.needs_why = paths, " ".join(words[len(paths) :]) or None
        if not paths or words[: len(paths)] != paths or example.needs_why is None:
            raise ValueError(f"{example.where}: a 'needs' marker names its paths first, then why")
    else:
        example.exit = int(arg)


def outside_paths(code: str, root: Path = ROOT) -> list[str]:
    """The paths ``code`` names that lie outside the project at ``root`` (run from the root, as the examples
    are): ``../x`` and absolute paths under the root's parent folder (a sibling checkout, ``../shared``).
    System paths (``/tmp``, ``/usr/bin``, ...) and URLs' paths are not files of another checkout."""
    found = []
    for match in OUTSIDE.finditer(code):
        path = match.group(0).rstrip(".")
        resolved = (root / path).resolve() if path.startswith("..") else Path(path)
        if resolved.is_relative_to(root.parent) and not resolved.is_relative_to(root):
            found.append(path)
    return found


def unmarked_paths(example: Example, root: Path = ROOT) -> list[str]:
    """The outside paths of ``example`` that its ``needs`` marker does not name (nor a folder above them)."""
    covered = [(root / need).resolve() for need in example.needs]
    return [
        path for path in outside_paths(example.code, root)
        if not any((root / path).resolve().is_relative_to(need) for need in covered)
    ]  # fmt: skip


# --- comparing a shown answer with the real one --------------------------------------------------


def match_json(shown: Any, real: Any, path: str = "$") -> list[str]:
    """Where ``real`` differs from ``shown`` under the rules above ([] when it matches).

    ``shown`` is parsed with its non-integer numbers as :class:`~decimal.Decimal`, which keeps the
    decimals they are shown with.
    """
    if shown == ELLIPSIS:
        return []
    differs = [f"{path}: shown {shown!r}, got {real!r}"]
    if isinstance(shown, Decimal):
        if isinstance(real, bool) or not isinstance(real, int | float):
            return differs
        places = -int(shown.as_tuple().exponent)
        close = abs(Decimal(repr(real)) - shown) <= Decimal(5).scaleb(-places - 1)
        return [] if close else [f"{path}: shown {shown}, got {real!r}"]
    if isinstance(shown, bool) or shown is None or isinstance(shown, str | int):
        return [] if shown == real and type(shown) is type(real) else differs
    if isinstance(shown, list):
        if not isinstance(real, list):
            return [f"{path}: shown a list, got {real!r}"]
        open_ended = bool(shown) and shown[-1] == ELLIPSIS
        fixed = shown[:-1] if open_ended else shown
        if len(real) < len(fixed) or (not open_ended and len(real) != len(fixed)):
            return [f"{path}: shown {len(fixed)}{' or more' if open_ended else ''} elements, got {len(real)}"]
        problems: list[str] = []
        for index, item in enumerate(fixed):
            problems += match_json(item, real[index], f"{path}[{index}]")
        return problems
    if isinstance(shown, dict):
        if not isinstance(real, dict):
            return [f"{path}: shown an object, got {real!r}"]
        problems = []
        if set(shown) != set(real):
            missing, extra = sorted(set(real) - set(shown)), sorted(set(shown) - set(real))
            problems.append(f"{path}: keys differ: the answer also has {missing}, the page also shows {extra}")
        for key in shown:
            if key in real:
                problems += match_json(shown[key], real[key], f"{path}.{key}")
        return problems
    raise TypeError(f"{path}: unexpected JSON value {shown!r}")


def compare_json(shown: str, printed: str) -> list[str]:
    """``printed`` (an example's output) against the page's JSON answer ``shown``."""
    try:
        real = json.loads(printed)
    except json.JSONDecodeError as error:
        return [f"the example did not print one JSON document ({error}): {printed[:500]!r}"]
    return match_json(json.loads(shown, parse_float=Decimal), real)


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def compare_text(shown: str, printed: str) -> list[str]:
    want, got = _lines(shown), _lines(printed)
    if want == got:
        return []
    page, printed_lines = "\n".join(want), "\n".join(got)
    return [f"the printed lines differ from the page's:\n--- page\n{page}\n--- printed\n{printed_lines}"]
