"""A selection of one model's heads, in the forms pruning tools read (SPEC section 5).

The selection is the set of heads to prune: ``prune_heads`` and ``pairs`` list it, ``head_mask``
is 1 where a head is kept and 0 where it is selected. The REST endpoint and ``headcat export``
both call :func:`export`.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from sqlalchemy import Row
from sqlalchemy.orm import Session

from ingest.types import SCALARS, feature_names
from service.errors import InvalidInput, NotFound, known
from service.exports import repository
from service.exports.schemas import DERIVED_SCORES, EXPORT_FORMATS
from service.heads.repository import clustering_covers_model
from service.models import repository as models
from service.orm import CatalogModel, Clustering

_PAIR = re.compile(r"^\s*(\d{1,6})\s*:\s*(\d{1,6})\s*$")


@dataclass(frozen=True)
class Selection:
    """Which heads to select; every filter given must hold (an AND), none given selects all."""

    types: tuple[str, ...] = ()
    exclude_types: tuple[str, ...] = ()
    layer_gt: int | None = None
    layer_ge: int | None = None
    layer_lt: int | None = None
    layer_le: int | None = None
    head: int | None = None
    heads: tuple[tuple[int, int], ...] | None = None  # explicit (layer, head) pairs; None: no such filter
    clustering_id: int | None = None  # None: the model's current clustering
    lowest: str | None = (
        None  # "30%" or "12": of the selected heads, this share of all heads (or count) lowest by score
    )


@dataclass(frozen=True)
class HeadTable:
    """Every head of one model (rows ordered by layer, head) and which of them are selected."""

    model: CatalogModel
    clustering_id: int | None
    rows: Sequence[Row[Any]]
    selected: np.ndarray  # (layers, heads) bool
    importance: np.ndarray | None = None  # (layers, heads) latest normalised importance (score=importance)

    @property
    def shape(self) -> tuple[int, int]:
        return self.model.num_layers, self.model.num_heads


@dataclass(frozen=True)
class Export:
    """One rendered export: a JSON value or bytes, with what the HTTP answer needs."""

    content: Any
    media_type: str
    filename: str
    clustering_id: int | None
    selected: int


def split_names(values: Iterable[str] | None) -> tuple[str, ...]:
    """``["a,b", "c"]`` -> ``("a", "b", "c")``: a repeated parameter, a comma list, or both."""
    names: list[str] = []
    for value in values or ():
        names.extend(part.strip() for part in value.split(",") if part.strip())
    return tuple(dict.fromkeys(names))


def parse_heads(text: str | None, *, field: str = "heads") -> tuple[tuple[int, int], ...] | None:
    """``"0:1, 5:11"`` -> ``((0, 1), (5, 11))``; ``""`` -> ``()`` (no head); ``None`` -> no filter."""
    if text is None:
        return None
    pairs: list[tuple[int, int]] = []
    for part in text.split(","):
        if not part.strip():
            continue
        match = _PAIR.match(part)
        if match is None:
            raise InvalidInput(f"{field}: {part.strip()!r} is not LAYER:HEAD (e.g. heads=0:1,5:11)", field=field)
        pairs.append((int(match[1]), int(match[2])))
    return tuple(dict.fromkeys(pairs))


def resolve(session: Session, name: str, selection: Selection, *, field: str = "name") -> HeadTable:
    """The model's heads with their types and features, and the selected ones; 4xx on bad input."""
    model = models.require(session, name, field=field)
    clustering_id = _clustering(session, model, selection.clustering_id)
    if clustering_id is not None:
        rows = repository.typed_heads(session, model.id, clustering_id)
        _check_types(session, clustering_id, selection)
    else:
        run = models.latest_complete_run(session, model.id)
        if run is None:
            raise NotFound(f"{field}: {name!r} has no complete feature run yet", field=field)
        rows = repository.untyped_heads(session, model.id, run.id)
        for key, values in (("type", selection.types), ("exclude_type", selection.exclude_types)):
            if values:
                raise InvalidInput(
                    f"{key}: {name!r} has not been clustered yet, so its heads have no type; "
                    f"run `headcat cluster {name}` first",
                    field=key,
                )
    _check_positions(model, selection)
    return HeadTable(model=model, clustering_id=clustering_id, rows=rows, selected=_select(model, rows, selection))


def _clustering(session: Session, model: CatalogModel, clustering_id: int | None) -> int | None:
    if clustering_id is None:
        return model.current_clustering_id
    if session.get(Clustering, clustering_id) is None:
        raise NotFound(f"clustering: no clustering with id {clustering_id}", field="clustering")
    if not clustering_covers_model(session, clustering_id, model.id):
        raise InvalidInput(
            f"clustering: clustering {clustering_id} does not include {model.name!r}", field="clustering"
        )
    return clustering_id


def _check_types(session: Session, clustering_id: int, selection: Selection) -> None:
    names = repository.cluster_names(session, clustering_id)
    for key, values in (("type", selection.types), ("exclude_type", selection.exclude_types)):
        for value in values:
            if value not in names:
                raise InvalidInput(
                    f"{key}: unknown head type {value!r} in clustering {clustering_id}; known types: {known(names)}",
                    field=key,
                )


def _check_positions(model: CatalogModel, selection: Selection) -> None:
    layers, heads = model.num_layers, model.num_heads
    allowed = {  # each bound must name a layer of the model; -1 and num_layers only where they mean "all"
        "layer_gt": (selection.layer_gt, -1, layers - 1),
        "layer_ge": (selection.layer_ge, 0, layers - 1),
        "layer_lt": (selection.layer_lt, 0, layers),
        "layer_le": (selection.layer_le, 0, layers - 1),
        "head": (selection.head, 0, heads - 1),
    }
    for key, (value, low, high) in allowed.items():
        if value is not None and not low <= value <= high:
            what = "head" if key == "head" else "layer"
            raise InvalidInput(
                f"{key}: {what} {value} is out of range; {model.name!r} has {layers} layers x {heads} heads "
                f"(0-based, so {key} must be within {low}..{high})",
                field=key,
            )
    for layer, head in selection.heads or ():
        if layer >= layers or head >= heads:
            raise InvalidInput(
                f"heads: {layer}:{head} is out of range; {model.name!r} has layers 0..{layers - 1} "
                f"and heads 0..{heads - 1}",
                field="heads",
            )


def _select(model: CatalogModel, rows: Sequence[Row[Any]], s: Selection) -> np.ndarray:
    selected = np.zeros((model.num_layers, model.num_heads), dtype=bool)  # (layers, heads)
    explicit = None if s.heads is None else set(s.heads)
    for row in rows:
        layer, head, kind = row.layer, row.head, getattr(row, "type", None)
        keep = (
            (not s.types or kind in s.types)
            and (not s.exclude_types or kind not in s.exclude_types)
            and (s.layer_gt is None or layer > s.layer_gt)
            and (s.layer_ge is None or layer >= s.layer_ge)
            and (s.layer_lt is None or layer < s.layer_lt)
            and (s.layer_le is None or layer <= s.layer_le)
            and (s.head is None or head == s.head)
            and (explicit is None or (layer, head) in explicit)
        )
        selected[layer, head] = keep
    return selected


def score_names(num_windows: int) -> list[str]:
    return [*DERIVED_SCORES, "importance", *feature_names(num_windows), *SCALARS]


def scores(table: HeadTable, score: str) -> np.ndarray:
    """``(layers, heads)`` float64 of one quantity for every head; NaN where it is undefined."""
    num_windows = table.rows[0].num_windows if table.rows else 16
    names = score_names(num_windows)
    if score not in names:
        raise InvalidInput(f"score: unknown score {score!r}; known scores: {known(names)}", field="score")
    if score == "centroid_distance" and table.clustering_id is None:
        raise InvalidInput(
            f"score: centroid_distance needs a clustering and {table.model.name!r} has none yet", field="score"
        )
    if score == "importance":
        if table.importance is None:
            raise InvalidInput(f"score: {table.model.name!r} has no importance scores yet; run `headcat importance "
                               f"{table.model.name} --data ...` first", field="score")  # fmt: skip
        return table.importance
    features = feature_names(num_windows)
    values = np.full(table.shape, np.nan)  # (layers, heads)
    for row in table.rows:
        vector = np.asarray(row.vector, dtype=np.float64)
        named = dict(zip(features, vector, strict=True))
        if score == "special":
            value = named["cls"] + named["sep"] + named["period"] + named["comma"]
        elif score == "local":
            value = named["self"] + named["w0"] + (named["w1"] if "w1" in named else 0.0)
        elif score == "centroid_distance":
            value = float(np.linalg.norm(vector - np.asarray(row.centroid, dtype=np.float64)))
        elif score in named:
            value = named[score]
        else:
            value = getattr(row, score)
        values[row.layer, row.head] = np.nan if value is None else value
    return values


def export(session: Session, name: str, selection: Selection, fmt: str, score: str) -> Export:
    """Resolve the selection on ``name`` and render it as ``fmt`` (one of ``EXPORT_FORMATS``)."""
    if fmt not in EXPORT_FORMATS:
        raise InvalidInput(f"format: unknown format {fmt!r}; known formats: {known(EXPORT_FORMATS)}", field="format")
    table = resolve(session, name, selection)
    if score == "importance":
        table = replace(table, importance=_importance(session, table.model))
    if selection.lowest is not None:
        table = replace(table, selected=lowest(table, scores(table, score), selection.lowest))
    return render(table, fmt, score)


def _importance(session: Session, model: CatalogModel) -> np.ndarray | None:
    """The latest normalised importance of the model's heads (its first stack), NaN where unscored."""
    from service.importance.repository import latest_scores

    found = latest_scores(session, model.id)
    if not found:
        return None
    stack = next(iter(model.stacks or {"encoder": None}))
    values = np.full((model.num_layers, model.num_heads), np.nan)
    for (where, layer, head), (normalized, _, _) in found.items():
        if where == stack and layer < model.num_layers and head < model.num_heads:
            values[layer, head] = normalized
    return values


_LOWEST = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%?)\s*$")


def lowest(table: HeadTable, values: np.ndarray, text: str) -> np.ndarray:
    """Of the selected heads, the ``N`` (``"12"``) or ``P %`` of all heads (``"30%"``) lowest by ``values``.

    Ties go by layer, then head; heads without a value are never chosen. With ``score=importance``
    this is Michel et al.'s pruning order (ascending importance).
    """
    match = _LOWEST.match(text)
    if match is None:
        raise InvalidInput(f"lowest: {text!r} is not a count (12) or a share of all heads (30%)", field="lowest")
    total = table.shape[0] * table.shape[1]
    if match[2]:
        share = float(match[1])
        if not 0 <= share <= 100:
            raise InvalidInput(f"lowest: {share} % is not a share between 0 and 100", field="lowest")
        count = round(share / 100 * total)
    else:
        if "." in match[1]:
            raise InvalidInput(f"lowest: {text!r} is not a whole number of heads", field="lowest")
        count = int(match[1])
    candidates = [
        (float(values[layer, head]), int(layer), int(head))
        for layer, head in zip(*np.nonzero(table.selected), strict=True)
        if not np.isnan(values[layer, head])
    ]
    chosen = np.zeros_like(table.selected)
    for _, layer, head in sorted(candidates)[:count]:
        chosen[layer, head] = True
    return chosen


def render(table: HeadTable, fmt: str, score: str) -> Export:
    values = scores(table, score)  # validates the score name for every format
    selected = table.selected
    layers, heads = np.nonzero(selected)
    pairs = [[int(layer), int(head)] for layer, head in zip(layers, heads, strict=True)]
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", table.model.name)
    content: Any
    media_type, suffix = "application/json", "json"
    if fmt == "prune_heads":
        grouped: dict[str, list[int]] = {}
        for layer, head in pairs:
            grouped.setdefault(str(layer), []).append(head)
        content = grouped
    elif fmt == "head_mask":
        content = (~selected).astype(int).tolist()
    elif fmt == "head_mask.npy":
        buffer = io.BytesIO()
        np.save(buffer, (~selected).astype(np.float32), allow_pickle=False)
        content, media_type, suffix = buffer.getvalue(), "application/x-npy", "npy"
        fmt = "head_mask"
    elif fmt == "scores":
        content = [
            [None if not selected[la, h] or np.isnan(values[la, h]) else float(values[la, h]) for h in range(row.size)]
            for la, row in enumerate(values)
        ]
    elif fmt == "pairs":
        content = pairs
    else:
        content, media_type, suffix = _csv(table, values, score), "text/csv; charset=utf-8", "csv"
    return Export(
        content=content,
        media_type=media_type,
        filename=f"{base}-{fmt}.{suffix}",
        clustering_id=table.clustering_id,
        selected=len(pairs),
    )


def _csv(table: HeadTable, values: np.ndarray, score: str) -> str:
    num_windows = table.rows[0].num_windows if table.rows else 16
    features = feature_names(num_windows)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["model", "layer", "head", "type", "clustering_id", "feature_run_id", f"score_{score}",
                     *features, *SCALARS])  # fmt: skip
    for row in table.rows:
        if not table.selected[row.layer, row.head]:
            continue
        value = values[row.layer, row.head]
        writer.writerow([
            table.model.name, row.layer, row.head, getattr(row, "type", None) or "", table.clustering_id or "",
            row.feature_run_id, "" if np.isnan(value) else repr(float(value)),
            *(repr(float(v)) for v in row.vector),
            *("" if getattr(row, s) is None else repr(float(getattr(row, s))) for s in SCALARS),
        ])  # fmt: skip
    return out.getvalue()
