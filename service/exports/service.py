"""A selection of one model's heads, in the forms pruning tools read (SPEC section 5).

The selection is the set of heads to prune: ``prune_heads`` and ``pairs`` list it, ``head_mask``
is 1 where a head is kept and 0 where it is selected. The REST endpoint and ``headcat export``
both call :func:`export`.

Stacks (SPEC section 6): a selection covers the model's stacks, or the one ``stack`` names. The
forms of one stack (a single-stack model, or ``stack=`` given) are as before stacks; over several
stacks each JSON form is ``{stack: form}``, ``pairs`` are ``[stack, layer, head]`` and
``head_mask.npy`` needs a ``stack``. Layer and head filters apply within each stack.
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

from ingest.types import ROLES, SCALARS, STACKS, Stack, feature_names
from service.errors import InvalidInput, NotFound, known
from service.exports import repository
from service.exports.schemas import DERIVED_SCORES, EXPORT_FORMATS
from service.heads.repository import clustering_covers_model
from service.models import repository as models
from service.orm import CatalogModel, Clustering

_PAIR = re.compile(r"^\s*(?:(encoder|decoder|cross)\s*:\s*)?(\d{1,6})\s*:\s*(\d{1,6})\s*$")

ExplicitHead = tuple[int, int] | tuple[str, int, int]  # (layer, head) in every stack, or (stack, layer, head)


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
    heads: tuple[ExplicitHead, ...] | None = None  # explicit heads; None: no such filter
    clustering_id: int | None = None  # None: the model's current clustering
    stack: Stack | None = None  # None: every stack of the model
    lowest: str | None = (
        None  # "30%" or "12": of the selected heads, this share of all heads (or count) lowest by score
    )
    min_agreement: float | None = None  # the type's agreement in the current stability run at least this
    min_margin: float | None = None  # the type's margin at least this
    roles: tuple[str, ...] = ()  # heads with any of these roles in the model's current detection run (SPEC 10)


@dataclass(frozen=True)
class HeadTable:
    """Every head of one model's covered stacks (rows ordered by stack, layer, head) and which are selected."""

    model: CatalogModel
    clustering_id: int | None
    rows: Sequence[Row[Any]]
    shapes: dict[Stack, tuple[int, int]]  # the stacks covered: the model's, or the one asked for
    selected: dict[Stack, np.ndarray]  # stack -> (layers, heads) bool
    importance: dict[Stack, np.ndarray] | None = None  # stack -> (layers, heads) latest normalised importance
    detections: dict[tuple[str, int, int], tuple[list[float | None], list[str]]] | None = None  # current detection run

    @property
    def shape(self) -> tuple[int, int]:
        """``(layers, heads)`` of the first covered stack (the only one of single-stack tables)."""
        return next(iter(self.shapes.values()))

    @property
    def keyed(self) -> bool:
        """Whether the forms are keyed by stack (more than one stack covered)."""
        return len(self.shapes) > 1


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


def parse_heads(text: str | None, *, field: str = "heads") -> tuple[ExplicitHead, ...] | None:
    """``"0:1, decoder:5:11"`` -> ``((0, 1), ("decoder", 5, 11))``; ``""`` -> ``()`` (no head); ``None`` -> no filter.

    ``LAYER:HEAD`` is that head in every covered stack; ``STACK:LAYER:HEAD`` names one.
    """
    if text is None:
        return None
    pairs: list[ExplicitHead] = []
    for part in text.split(","):
        if not part.strip():
            continue
        match = _PAIR.match(part)
        if match is None:
            raise InvalidInput(
                f"{field}: {part.strip()!r} is not LAYER:HEAD or STACK:LAYER:HEAD (e.g. heads=0:1,decoder:5:11)",
                field=field,
            )
        numbers = (int(match[2]), int(match[3]))
        pairs.append((match[1], *numbers) if match[1] else numbers)
    return tuple(dict.fromkeys(pairs))


def resolve(session: Session, name: str, selection: Selection, *, field: str = "name") -> HeadTable:
    """The model's heads with their types and features, and the selected ones; 4xx on bad input."""
    model = models.require(session, name, field=field)
    clustering_id = _clustering(session, model, selection.clustering_id)
    if clustering_id is not None:
        rows = repository.typed_heads(session, model.id, clustering_id)
        _check_types(session, clustering_id, selection)
        _check_confidence(clustering_id, rows, selection)
    else:
        run = models.current_run(session, model)
        if run is None:
            raise NotFound(f"{field}: {name!r} has no complete feature run yet", field=field)
        rows = repository.untyped_heads(session, model.id, run.id)
        for key, values in (
            ("type", selection.types),
            ("exclude_type", selection.exclude_types),
            ("min_agreement", selection.min_agreement is not None),
            ("min_margin", selection.min_margin is not None),
        ):
            if values:
                raise InvalidInput(
                    f"{key}: {name!r} has not been clustered yet, so its heads have no type; "
                    f"run `headcat cluster {name}` first",
                    field=key,
                )
    shapes = _stacks(model, selection)
    _check_positions(model, shapes, selection)
    rows = sorted((row for row in rows if row.stack in shapes), key=lambda r: (STACKS.index(r.stack), r.layer, r.head))
    for role in selection.roles:
        if role not in ROLES:
            raise InvalidInput(f"role: unknown role {role!r}; roles: {known(list(ROLES))}", field="role")
    detections = _detections(session, model, "role") if selection.roles else None
    return HeadTable(
        model=model, clustering_id=clustering_id, rows=rows, shapes=shapes,
        selected=_select(shapes, rows, selection, detections), detections=detections,
    )  # fmt: skip


def _detections(
    session: Session, model: CatalogModel, field: str
) -> dict[tuple[str, int, int], tuple[list[float | None], list[str]]]:
    from service.detections.repository import latest_heads

    found = latest_heads(session, model.id)
    if not found:
        raise InvalidInput(f"{field}: {model.name!r} has no detection run yet; run `headcat detect {model.name}` first",
                           field=field)  # fmt: skip
    return found


def _stacks(model: CatalogModel, selection: Selection) -> dict[Stack, tuple[int, int]]:
    shapes = models.shapes(model)
    if selection.stack is None:
        return shapes
    if selection.stack not in shapes:
        raise InvalidInput(
            f"stack: {model.name!r} has no {selection.stack} stack; its stacks: {known(list(shapes))}", field="stack"
        )
    return {selection.stack: shapes[selection.stack]}


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


def _check_confidence(clustering_id: int, rows: Sequence[Row[Any]], selection: Selection) -> None:
    bounds = (("min_agreement", selection.min_agreement, 0.0), ("min_margin", selection.min_margin, -1.0))
    for key, value, low in bounds:
        if value is not None and not (low <= value <= 1.0):
            raise InvalidInput(f"{key}: {value} is outside [{low:g}, 1]", field=key)
    if selection.min_agreement is not None and all(row.agreement is None for row in rows):
        raise InvalidInput(
            f"min_agreement: clustering {clustering_id} has no stability run with per-head agreement; "
            f"run `headcat stability {clustering_id}` first",
            field="min_agreement",
        )


def _check_positions(model: CatalogModel, shapes: dict[Stack, tuple[int, int]], selection: Selection) -> None:
    """Bounds and explicit heads must exist in every covered stack (layers count within each)."""
    layers = min(shape[0] for shape in shapes.values())
    heads = min(shape[1] for shape in shapes.values())
    what = (
        f"{model.name!r} has"
        if len(shapes) == 1
        else f"every stack of {model.name!r} ({', '.join(shapes)}; give stack= for one) has at least"
    )
    allowed = {  # each bound must name a layer of the model; -1 and num_layers only where they mean "all"
        "layer_gt": (selection.layer_gt, -1, layers - 1),
        "layer_ge": (selection.layer_ge, 0, layers - 1),
        "layer_lt": (selection.layer_lt, 0, layers),
        "layer_le": (selection.layer_le, 0, layers - 1),
        "head": (selection.head, 0, heads - 1),
    }
    for key, (value, low, high) in allowed.items():
        if value is not None and not low <= value <= high:
            kind = "head" if key == "head" else "layer"
            raise InvalidInput(
                f"{key}: {kind} {value} is out of range; {what} {layers} layers x {heads} heads "
                f"(0-based, so {key} must be within {low}..{high})",
                field=key,
            )
    for item in selection.heads or ():
        if len(item) == 3:
            stack, layer, head = item
            if stack not in shapes:
                raise InvalidInput(
                    f"heads: {stack}:{layer}:{head} names the {stack} stack, which this export does not cover "
                    f"({known(list(shapes))})",
                    field="heads",
                )
            top = shapes[stack]  # type: ignore[index]
            where = f"the {stack} stack of {model.name!r} has"
        else:
            layer, head = item
            top, where = (layers, heads), what
        if layer >= top[0] or head >= top[1]:
            raise InvalidInput(
                f"heads: {':'.join(map(str, item))} is out of range; {where} layers 0..{top[0] - 1} "
                f"and heads 0..{top[1] - 1}",
                field="heads",
            )


def _select(
    shapes: dict[Stack, tuple[int, int]],
    rows: Sequence[Row[Any]],
    s: Selection,
    detections: dict[tuple[str, int, int], tuple[list[float | None], list[str]]] | None = None,
) -> dict[Stack, np.ndarray]:
    selected = {name: np.zeros(shape, dtype=bool) for name, shape in shapes.items()}  # stack -> (layers, heads)
    explicit = None if s.heads is None else set(s.heads)
    wanted = set(s.roles)
    for row in rows:
        layer, head, kind = row.layer, row.head, getattr(row, "type", None)
        roles = set((detections or {}).get((row.stack, layer, head), ([], []))[1])
        keep = (
            (not wanted or bool(roles & wanted))
            and (not s.types or kind in s.types)
            and (not s.exclude_types or kind not in s.exclude_types)
            and (s.layer_gt is None or layer > s.layer_gt)
            and (s.layer_ge is None or layer >= s.layer_ge)
            and (s.layer_lt is None or layer < s.layer_lt)
            and (s.layer_le is None or layer <= s.layer_le)
            and (s.head is None or head == s.head)
            and (explicit is None or (layer, head) in explicit or (row.stack, layer, head) in explicit)
            and _at_least(getattr(row, "agreement", None), s.min_agreement)
            and _at_least(getattr(row, "margin", None), s.min_margin)
        )
        selected[row.stack][layer, head] = keep
    return selected


def _at_least(value: float | None, bound: float | None) -> bool:
    """No bound: every head; a bound: heads with a value at least that (a head without one never)."""
    return bound is None or (value is not None and value >= bound)


def score_names(num_windows: int) -> list[str]:
    return [*DERIVED_SCORES, "importance", *ROLES, *feature_names(num_windows), *SCALARS]


def scores(table: HeadTable, score: str) -> dict[Stack, np.ndarray]:
    """``stack -> (layers, heads)`` float64 of one quantity for every head; NaN where it is undefined."""
    num_windows = table.rows[0].num_windows if table.rows else 16
    names = score_names(num_windows)
    if score not in names:
        raise InvalidInput(f"score: unknown score {score!r}; known scores: {known(names)}", field="score")
    if score == "centroid_distance" and table.clustering_id is None:
        raise InvalidInput(
            f"score: centroid_distance needs a clustering and {table.model.name!r} has none yet", field="score"
        )
    if score in ("margin", "agreement") and table.clustering_id is None:
        raise InvalidInput(f"score: {score} needs a clustering and {table.model.name!r} has none yet", field="score")
    if score == "agreement" and all(row.agreement is None for row in table.rows):
        raise InvalidInput(f"score: clustering {table.clustering_id} has no stability run with per-head agreement; "
                           f"run `headcat stability {table.clustering_id}` first", field="score")  # fmt: skip
    if score == "importance":
        if table.importance is None:
            raise InvalidInput(f"score: {table.model.name!r} has no importance scores yet; run `headcat importance "
                               f"{table.model.name} --data ...` first", field="score")  # fmt: skip
        return table.importance
    if score in ROLES:
        if table.detections is None:
            raise InvalidInput(f"score: {table.model.name!r} has no detection run yet; run `headcat detect "
                               f"{table.model.name}` first", field="score")  # fmt: skip
        detected = {name: np.full(shape, np.nan) for name, shape in table.shapes.items()}
        for (where, layer, head), (values_, _) in table.detections.items():
            value = values_[ROLES.index(score)]  # type: ignore[arg-type]
            if where in detected and value is not None:
                detected[where][layer, head] = value  # type: ignore[index]
        return detected
    features = feature_names(num_windows)
    values = {name: np.full(shape, np.nan) for name, shape in table.shapes.items()}  # stack -> (layers, heads)
    for row in table.rows:
        vector = np.asarray(row.vector, dtype=np.float64)
        named = dict(zip(features, vector, strict=True))
        if score == "special":
            value = named["cls"] + named["sep"] + named["period"] + named["comma"]
        elif score == "local":
            value = named["self"] + named["w0"] + (named["w1"] if "w1" in named else 0.0)
        elif score in ("margin", "agreement"):
            value = getattr(row, score)
        elif score == "centroid_distance":
            value = float(np.linalg.norm(vector - np.asarray(row.centroid, dtype=np.float64)))
        elif score in named:
            value = named[score]
        else:
            value = getattr(row, score)
        values[row.stack][row.layer, row.head] = np.nan if value is None else value
    return values


def export(session: Session, name: str, selection: Selection, fmt: str, score: str) -> Export:
    """Resolve the selection on ``name`` and render it as ``fmt`` (one of ``EXPORT_FORMATS``)."""
    if fmt not in EXPORT_FORMATS:
        raise InvalidInput(f"format: unknown format {fmt!r}; known formats: {known(EXPORT_FORMATS)}", field="format")
    table = resolve(session, name, selection)
    if score in ROLES and table.detections is None:
        table = replace(table, detections=_detections(session, table.model, "score"))
    if score == "importance":
        table = replace(table, importance=_importance(session, table))
    if selection.lowest is not None:
        table = replace(table, selected=lowest(table, scores(table, score), selection.lowest))
    return render(table, fmt, score)


def _importance(session: Session, table: HeadTable) -> dict[Stack, np.ndarray] | None:
    """The latest normalised importance of the table's heads, per covered stack; NaN where unscored."""
    from service.importance.repository import latest_scores

    found = latest_scores(session, table.model.id)
    if not found:
        return None
    values = {name: np.full(shape, np.nan) for name, shape in table.shapes.items()}  # stack -> (layers, heads)
    for (where, layer, head), (normalized, _, _) in found.items():
        if where in values and layer < values[where].shape[0] and head < values[where].shape[1]:
            values[where][layer, head] = normalized  # type: ignore[index]
    return values


_LOWEST = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%?)\s*$")


def lowest(table: HeadTable, values: dict[Stack, np.ndarray], text: str) -> dict[Stack, np.ndarray]:
    """Of the selected heads, the ``N`` (``"12"``) or ``P %`` of all covered heads (``"30%"``) lowest by ``values``.

    Ties go by stack, layer, then head; heads without a value are never chosen. With
    ``score=importance`` this is Michel et al.'s pruning order (ascending importance).
    """
    match = _LOWEST.match(text)
    if match is None:
        raise InvalidInput(f"lowest: {text!r} is not a count (12) or a share of all heads (30%)", field="lowest")
    total = sum(layers * heads for layers, heads in table.shapes.values())
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
        (float(values[name][layer, head]), STACKS.index(name), int(layer), int(head), name)
        for name, selected in table.selected.items()
        for layer, head in zip(*np.nonzero(selected), strict=True)
        if not np.isnan(values[name][layer, head])
    ]
    chosen = {name: np.zeros_like(selected) for name, selected in table.selected.items()}
    for _, _, layer, head, name in sorted(candidates)[:count]:
        chosen[name][layer, head] = True
    return chosen


def render(table: HeadTable, fmt: str, score: str) -> Export:
    values = scores(table, score)  # validates the score name for every format
    if fmt == "head_mask.npy" and table.keyed:
        raise InvalidInput(
            f"stack: a .npy file holds one (layers, heads) mask and {table.model.name!r} has the stacks "
            f"{known(list(table.shapes))}; give stack=, or use format=head_mask for every stack",
            field="stack",
        )
    per_stack = {name: _render_stack(table.selected[name], values[name], fmt) for name in table.shapes}
    selected = sum(int(mask.sum()) for mask in table.selected.values())
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", table.model.name)
    if table.keyed or table.model.stacks and len(table.model.stacks) > 1:
        base = f"{base}-{'+'.join(table.shapes)}"
    content: Any
    media_type, suffix = "application/json", "json"
    if fmt == "head_mask.npy":
        buffer = io.BytesIO()
        (mask,) = table.selected.values()
        np.save(buffer, (~mask).astype(np.float32), allow_pickle=False)
        content, media_type, suffix = buffer.getvalue(), "application/x-npy", "npy"
        fmt = "head_mask"
    elif fmt == "csv":
        content, media_type, suffix = _csv(table, values, score), "text/csv; charset=utf-8", "csv"
    elif not table.keyed:
        (content,) = per_stack.values()
    elif fmt == "pairs":
        content = [[name, *pair] for name, pairs in per_stack.items() for pair in pairs]
    else:
        content = per_stack
    return Export(
        content=content,
        media_type=media_type,
        filename=f"{base}-{fmt}.{suffix}",
        clustering_id=table.clustering_id,
        selected=selected,
    )


def _render_stack(selected: np.ndarray, values: np.ndarray, fmt: str) -> Any:
    """One stack's JSON form (``selected``, ``values``: (layers, heads))."""
    layers, heads = np.nonzero(selected)
    pairs = [[int(layer), int(head)] for layer, head in zip(layers, heads, strict=True)]
    if fmt == "prune_heads":
        grouped: dict[str, list[int]] = {}
        for layer, head in pairs:
            grouped.setdefault(str(layer), []).append(head)
        return grouped
    if fmt == "head_mask":
        return (~selected).astype(int).tolist()
    if fmt == "scores":
        return [
            [None if not selected[la, h] or np.isnan(values[la, h]) else float(values[la, h]) for h in range(row.size)]
            for la, row in enumerate(values)
        ]
    return pairs


def _csv(table: HeadTable, values: dict[Stack, np.ndarray], score: str) -> str:
    """One row per selected head; ``stack`` is the last column (added after the others, which keep their places)."""
    num_windows = table.rows[0].num_windows if table.rows else 16
    features = feature_names(num_windows)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["model", "layer", "head", "type", "clustering_id", "feature_run_id", f"score_{score}",
                     *features, *SCALARS, "stack"])  # fmt: skip
    for row in table.rows:
        if not table.selected[row.stack][row.layer, row.head]:
            continue
        value = values[row.stack][row.layer, row.head]
        writer.writerow([
            table.model.name, row.layer, row.head, getattr(row, "type", None) or "", table.clustering_id or "",
            row.feature_run_id, "" if np.isnan(value) else repr(float(value)),
            *(repr(float(v)) for v in row.vector),
            *("" if getattr(row, s) is None else repr(float(getattr(row, s))) for s in SCALARS), row.stack,
        ])  # fmt: skip
    return out.getvalue()
