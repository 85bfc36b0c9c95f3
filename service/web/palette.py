"""One colour per head type, the same on the page, in its screenshots and in the tests.

The four named types have fixed colours; any other cluster name (``cluster_3``, or the names
of a k != 4 clustering) gets one from a fallback palette, chosen from the name alone so that a
type has the same colour in every view. ``static/app.js`` reads these from ``/palette.json``.
"""

from __future__ import annotations

import re

from ingest.types import HeadType

TYPE_COLORS: dict[HeadType, str] = {
    "dense": "#4e79a7",
    "diagonal": "#f28e2b",
    "dense_vertical": "#59a14f",
    "vertical": "#e15759",
}
FALLBACK_COLORS: tuple[str, ...] = ("#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#8cd17d", "#bab0ac")
UNTYPED_COLOR = "#d4d4d8"  # heads of a model that has not been clustered yet


def name_hash(name: str) -> int:
    """A small deterministic hash, written the same way in ``app.js``."""
    value = 0
    for char in name:
        value = (value * 31 + ord(char)) % 1_000_003
    return value


def color_for(name: str | None) -> str:
    if name is None:
        return UNTYPED_COLOR
    if name in TYPE_COLORS:
        return TYPE_COLORS[name]  # type: ignore[index]
    numbered = re.fullmatch(r"cluster_(\d+)", name)
    index = int(numbered[1]) if numbered else name_hash(name)
    return FALLBACK_COLORS[index % len(FALLBACK_COLORS)]


def palette() -> dict[str, object]:
    return {"types": dict(TYPE_COLORS), "fallback": list(FALLBACK_COLORS), "untyped": UNTYPED_COLOR}
