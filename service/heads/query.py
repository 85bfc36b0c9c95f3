"""``GET /heads`` in one SQL statement that returns the page as JSON text.

The statement walks the selected models in name order (``models_name_key``, or
``ix_models_architecture_name`` / ``ix_models_task_name`` when those filters are given) and, for
each, the model's heads in ``(stack, layer, head)`` order through
``uq_heads_model_id_stack_layer_head``, then probes, by ``(model_id, head_id)``, the head's type in
the clustering used (``head_assignments``, ``clusters``) and its features (``head_features``). The
two probes are LATERAL subqueries so that they follow the head: joined plainly, the planner takes
a model's assignments under ``(model_id, clustering_id)`` for one row (the columns are correlated)
and starts from all of them, several times the buffers (README, "Performance"). A LATERAL
subquery per model with its own LIMIT and an incremental sort on the presorted model name let the
walk stop as soon as the page is full, so a page costs the same at 10^6 and 10^7 heads. The page's
order, ``(model name, stack, layer, head)``, is unique and stable: it is the keyset of the
``after=`` cursor.

PostgreSQL builds each head's JSON object (features by name, scalars); Python only glues the
envelope around the ``items`` array, so no per-row Python object is made.

**Per-head sources** beside the features (:data:`SOURCES`): each is a LEFT JOIN LATERAL keyed by
``(h.model_id, h.id)``, with the JSON keys it adds to each head, its filters (query parameter -> SQL condition,
the parameter bound under its own name) and the orders it offers. Each reads the model's *current* run of its
lens (``service/current.py``; the selected model row carries their ids): the head's importance (or that of
``importance_run=``; SPEC 7), its attribution (discrepancy and the global features; SPEC 8), the confidence in
its type (``margin`` of its assignment, ``agreement`` in the clustering's current stability run:
``service/clusterings/stability.py``), its four detector scores and roles (SPEC 10; ``role=`` repeated: any of
them), and, when ``relation=`` is given, its accuracy for that dependency relation (SPEC 9). An unclustered
model's features are those of its current feature run. Adding one is one :class:`HeadSource` and the
parameters in ``service/heads/endpoints.py``.

``order=`` (``importance``, ``-discrepancy``, ``-syntax_accuracy``, ...) sorts by a source's
value (NULLs last), then the default order: each model's walk takes its first ``offset + limit + 1``
heads in that order and the page merges them. Such pages are reached with ``offset``; the
``after=`` cursor pages the default order only.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from ingest.types import ROLES, SCALARS, SPECIAL_GROUPS, STACKS
from service.errors import InvalidInput

MAX_NAMED_MODELS = 100


@dataclass(frozen=True)
class HeadSource:
    """A per-head fact joined into ``GET /heads``: see the module docstring."""

    join: str  # LEFT JOIN LATERAL (... WHERE x.model_id = h.model_id AND x.head_id = h.id ...) alias ON true
    columns: Mapping[str, str]  # JSON key -> SQL expression over the alias
    filters: Mapping[str, str]  # query parameter -> SQL condition
    orders: Mapping[str, str] = field(default_factory=dict)  # order name -> SQL expression
    binds: tuple[str, ...] = ()  # parameters the join reads, bound (NULL when absent) whenever it is joined
    needs: str | None = None  # joined only when this parameter is given


def _features_json(vector: str, windows: str) -> str:
    special = ",".join(f"'{name}'" for name in ("self", *SPECIAL_GROUPS))
    return (
        f"(SELECT json_object_agg(CASE WHEN u.i <= {windows} THEN 'w' || (u.i - 1) "
        f"ELSE (ARRAY[{special}])[u.i - {windows}] END, u.v) FROM unnest({vector}) WITH ORDINALITY AS u(v, i))"
    )


SOURCES: tuple[HeadSource, ...] = (
    HeadSource(  # SPEC 7: the current importance run's scores, or importance_run's
        join="""LEFT JOIN LATERAL (
    SELECT s.normalized, s.raw, s.run_id FROM importance_scores s JOIN importance_runs ir ON ir.id = s.run_id
    WHERE s.model_id = h.model_id AND s.head_id = h.id AND ir.status = 'complete'
      AND s.run_id = coalesce(CAST(:importance_run AS integer), m.importance_run)) imp ON true""",
        columns={"importance": "imp.normalized", "importance_raw": "imp.raw", "importance_run_id": "imp.run_id"},
        filters={
            "importance_lt": "imp.normalized < :importance_lt",
            "importance_gt": "imp.normalized > :importance_gt",
        },
        orders={"importance": "imp.normalized"},
        binds=("importance_run",),
    ),
    HeadSource(  # SPEC 8: the current attribution run: discrepancy and the global vector by name
        join="""LEFT JOIN LATERAL (
    SELECT ha.discrepancy, ha.vector, ar.num_windows FROM head_attributions ha
    JOIN attribution_runs ar ON ar.id = ha.attribution_run_id
    WHERE ha.model_id = h.model_id AND ha.head_id = h.id AND ha.attribution_run_id = m.attribution_run) att ON true""",
        columns={"discrepancy": "att.discrepancy", "global_features": _features_json("att.vector", "att.num_windows")},
        filters={
            "discrepancy_lt": "att.discrepancy < :discrepancy_lt",
            "discrepancy_gt": "att.discrepancy > :discrepancy_gt",
        },
        orders={"discrepancy": "att.discrepancy"},
    ),
    HeadSource(  # confidence in the type: the assignment's margin, the clustering's current stability run's agreement
        join="""LEFT JOIN LATERAL (
    SELECT sh.agreement FROM stability_heads sh
    WHERE sh.model_id = h.model_id AND sh.head_id = h.id AND sh.stability_run_id = m.stability_run) conf ON true""",
        columns={"margin": "a.margin", "agreement": "conf.agreement"},
        filters={
            "margin_ge": "a.margin >= :margin_ge",
            "margin_lt": "a.margin < :margin_lt",
            "agreement_ge": "conf.agreement >= :agreement_ge",
            "agreement_lt": "conf.agreement < :agreement_lt",
        },
        orders={"margin": "a.margin", "agreement": "conf.agreement"},
    ),
    HeadSource(  # SPEC 9: accuracy for one relation (either direction, or the one asked) in the current syntax run
        join="""LEFT JOIN LATERAL (
    SELECT max(st.accuracy) AS accuracy FROM head_syntax_scores st
    WHERE st.model_id = h.model_id AND st.head_id = h.id AND st.relation = :relation
      AND (CAST(:direction AS text) IS NULL OR st.direction = CAST(:direction AS text))
      AND st.syntax_run_id = m.syntax_run) syn ON true""",
        columns={"syntax_accuracy": "syn.accuracy"},
        filters={"syntax_accuracy_gt": "syn.accuracy > :syntax_accuracy_gt"},
        orders={"syntax_accuracy": "syn.accuracy"},
        binds=("relation", "direction"),
        needs="relation",
    ),
    HeadSource(  # SPEC 10: the four detector scores and the roles of the model's current detection run
        join="""LEFT JOIN LATERAL (
    SELECT d.induction, d.duplicate_token, d.previous_token, d.sink, d.roles FROM head_detector_scores d
    WHERE d.model_id = h.model_id AND d.head_id = h.id AND d.detection_run_id = m.detection_run) det ON true""",
        columns={**{name: f"det.{name}" for name in ROLES}, "roles": "det.roles"},
        filters={
            "role": "det.roles && CAST(:role AS varchar[])",
            **{
                f"{name}_{op}": f"det.{name} {sign} :{name}_{op}"
                for name in ROLES
                for op, sign in (("gt", ">"), ("lt", "<"))
            },
        },  # fmt: skip
        orders={name: f"det.{name}" for name in ROLES},
    ),
)
ORDERS = frozenset(name for source in SOURCES for name in source.orders)


@dataclass(frozen=True)
class Cursor:
    """The last head of a page, ``(model name, stack, layer, head)``: the next page starts after it."""

    model: str
    stack: str
    layer: int
    head: int

    def encode(self) -> str:
        raw = json.dumps([self.model, self.stack, self.layer, self.head], separators=(",", ":"))
        return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")

    @classmethod
    def decode(cls, token: str) -> Cursor:
        """The cursor of ``token``; :class:`InvalidInput` naming ``after`` for anything else."""
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
            model, stack, layer, head = json.loads(raw)
        except (ValueError, TypeError) as error:
            raise InvalidInput(
                "after: not a cursor of GET /heads (pass a page's `next` as it is)", field="after"
            ) from error
        if not (isinstance(model, str) and stack in STACKS and type(layer) is int and type(head) is int):
            raise InvalidInput("after: not a cursor of GET /heads (pass a page's `next` as it is)", field="after")
        if not (0 < len(model) <= 200 and 0 <= layer < 2**31 and 0 <= head < 2**31) or "\x00" in model:
            raise InvalidInput("after: the cursor is out of range", field="after")
        return cls(model, stack, layer, head)


@dataclass(frozen=True)
class HeadQuery:
    """What ``GET /heads`` asks: which models, which of their heads, which page."""

    models: Sequence[str] = ()  # catalog names; empty: every model
    model_prefix: str | None = None
    architectures: Sequence[str] = ()
    tasks: Sequence[str] = ()
    num_layers_ge: int | None = None
    num_layers_le: int | None = None
    num_heads_ge: int | None = None
    num_heads_le: int | None = None
    clustering_id: int | None = None  # None: each model's current clustering (or, unclustered, its current feature run)
    stack: str | None = None
    type: str | None = None
    layer_gt: int | None = None
    layer_ge: int | None = None
    layer_lt: int | None = None
    layer_le: int | None = None
    head: int | None = None
    after: Cursor | None = None
    limit: int = 100
    offset: int = 0
    total: bool = False  # count every matching head (a second walk; cheap only for a few models)
    extra: Mapping[str, Any] = field(default_factory=dict)  # parameters of SOURCES, by name
    order: str | None = None  # a source's order, "-" first for descending; None: (model, stack, layer, head)

    def sources(self) -> list[HeadSource]:
        return [source for source in SOURCES if source.needs is None or self.extra.get(source.needs) is not None]


@dataclass(frozen=True)
class PageResult:
    items_json: str  # a JSON array of the page's heads
    count: int  # heads on the page
    last: Cursor | None  # the page's last head, when more may follow
    total: int | None
    models_found: int  # of the named models, how many exist
    clustering_found: bool | None  # None: no clustering asked for
    models_uncovered: int  # named models the asked-for clustering did not include


_FEATURES = _features_json("p.vector", "p.num_windows")


def _model_conditions(q: HeadQuery, bind: dict[str, Any]) -> list[str]:
    where: list[str] = []
    if q.models:
        where.append("mo.name = ANY(:models)")
        bind["models"] = list(q.models)
    if q.model_prefix is not None:  # a range of the name index, then the exact test
        where.append("mo.name >= :prefix AND starts_with(mo.name, :prefix)")
        bind["prefix"] = q.model_prefix
    if q.architectures:
        where.append("mo.architecture = ANY(:architectures)")
        bind["architectures"] = list(q.architectures)
    if q.tasks:
        where.append("mo.task = ANY(:tasks)")
        bind["tasks"] = list(q.tasks)
    for column, op in (("num_layers", ">="), ("num_layers", "<="), ("num_heads", ">="), ("num_heads", "<=")):
        name = f"{column}_{'ge' if op == '>=' else 'le'}"
        value = getattr(q, name)
        if value is not None:
            where.append(f"mo.{column} {op} :{name}")
            bind[name] = value
    if q.clustering_id is not None:
        where.append(
            "mo.id IN (SELECT r.model_id FROM clustering_feature_runs cfr JOIN feature_runs r "
            "ON r.id = cfr.feature_run_id WHERE cfr.clustering_id = :clustering)"
        )
    if q.after is not None:
        where.append("mo.name >= :after_model")
        bind["after_model"] = q.after.model
    return where


def _head_conditions(q: HeadQuery, bind: dict[str, Any]) -> list[str]:
    where = ["h.model_id = m.id"]
    for name, condition in (
        ("stack", "h.stack = :stack"),
        ("layer_gt", "h.layer > :layer_gt"),
        ("layer_ge", "h.layer >= :layer_ge"),
        ("layer_lt", "h.layer < :layer_lt"),
        ("layer_le", "h.layer <= :layer_le"),
        ("head", "h.head = :head"),
        ("type", "c.name = :type"),
    ):
        value = getattr(q, name)
        if value is not None:
            where.append(condition)
            bind[name] = value
    for source in q.sources():
        for name in source.binds:
            bind[name] = q.extra.get(name)
        for name, condition in source.filters.items():
            if q.extra.get(name) is not None:
                where.append(condition)
                bind[name] = q.extra[name]
    if q.after is not None:
        where.append(
            "(m.name > :after_model OR (h.stack, h.layer, h.head) > (:after_stack, :after_layer, :after_head))"
        )
        bind.update(after_stack=q.after.stack, after_layer=q.after.layer, after_head=q.after.head)
    return where


def page_sql(q: HeadQuery) -> tuple[str, dict[str, Any]]:
    """The statement of one page and its binds (see the module docstring for its plan)."""
    bind: dict[str, Any] = {"limit": q.limit, "offset": q.offset, "inner_limit": q.offset + q.limit + 1}
    clustering = ":clustering" if q.clustering_id is not None else "mo.current_clustering_id"
    if q.clustering_id is not None:
        bind["clustering"] = q.clustering_id
    model_where = " AND ".join(_model_conditions(q, bind)) or "true"
    head_where = " AND ".join(_head_conditions(q, bind))
    sources = q.sources()
    source_joins = "\n".join(source.join for source in sources)
    source_columns = "".join(
        f", {expression} AS {key}" for source in sources for key, expression in source.columns.items()
    )
    source_json = "".join(f", '{key}', p.{key}" for source in sources for key in source.columns)
    inner_order, outer_order, numbered_order = (
        "h.stack, h.layer, h.head",
        "m.name, x.stack, x.layer, x.head",
        ("p.model, p.stack, p.layer, p.head"),
    )
    if q.order is not None:
        name = q.order.removeprefix("-")
        expression = next(source.orders[name] for source in sources if name in source.orders)
        direction = "DESC" if q.order.startswith("-") else "ASC"
        inner_order = f"{expression} {direction} NULLS LAST, {inner_order}"
        outer_order = f"x.order_value {direction} NULLS LAST, {outer_order}"
        numbered_order = f"p.order_value {direction} NULLS LAST, {numbered_order}"
        source_columns += f", {expression} AS order_value"
    scalars = ", ".join(f"'{name}', p.{name}" for name in SCALARS)

    def heads_where(where: str) -> str:
        return f"""
SELECT h.stack, h.layer, h.head, c.name AS type, a.clustering_id, f.feature_run_id, r.num_windows, f.vector,
       {", ".join(f"f.{name}" for name in SCALARS)}{source_columns}
FROM heads h
LEFT JOIN LATERAL (
    SELECT a.clustering_id, a.cluster_id, a.feature_run_id, a.margin FROM head_assignments a
    WHERE a.model_id = h.model_id AND a.clustering_id = m.clustering AND a.head_id = h.id LIMIT 1) a ON true
LEFT JOIN clusters c ON c.id = a.cluster_id
JOIN LATERAL (
    SELECT f.feature_run_id, f.vector, {", ".join(f"f.{name}" for name in SCALARS)} FROM head_features f
    WHERE f.model_id = h.model_id AND f.feature_run_id = coalesce(a.feature_run_id, m.run) AND f.head_id = h.id
    LIMIT 1) f ON true
JOIN feature_runs r ON r.id = f.feature_run_id
{source_joins}
WHERE {where}"""

    def models_where(where: str) -> str:
        return f"""
SELECT mo.id, mo.name, {clustering} AS clustering,
       CASE WHEN {clustering} IS NULL THEN mo.current_feature_run_id END AS run,
       mo.current_importance_run_id AS importance_run, mo.current_attribution_run_id AS attribution_run,
       mo.current_syntax_run_id AS syntax_run, mo.current_detection_run_id AS detection_run,
       (SELECT cs.current_stability_run_id FROM clusterings cs WHERE cs.id = {clustering}) AS stability_run
FROM models mo
WHERE {where}"""

    heads, selected = heads_where(head_where), models_where(model_where)
    total = "NULL::bigint"
    if q.total:  # the query's count, the same on every page: a cursor only says where a page starts
        everything = replace(q, after=None)
        counted_models = models_where(" AND ".join(_model_conditions(everything, bind)) or "true")
        counted_heads = heads_where(" AND ".join(_head_conditions(everything, bind)))
        total = f"(SELECT count(*) FROM ({counted_models}) m CROSS JOIN LATERAL ({counted_heads}) x)"
    found = "(SELECT count(*) FROM models WHERE name = ANY(:models))" if q.models else "0"
    covered = (
        "(SELECT count(*) FROM models mo WHERE mo.name = ANY(:models) AND mo.id NOT IN (SELECT r.model_id "
        "FROM clustering_feature_runs cfr JOIN feature_runs r ON r.id = cfr.feature_run_id "
        "WHERE cfr.clustering_id = :clustering))"
        if q.models and q.clustering_id is not None
        else "0"
    )
    clustering_found = (
        "EXISTS (SELECT FROM clusterings WHERE id = :clustering)" if q.clustering_id is not None else "NULL::boolean"
    )
    last = (
        "(SELECT json_build_array(model, stack, layer, head)::text FROM numbered WHERE n = :limit "
        "AND EXISTS (SELECT FROM numbered WHERE n = :limit + 1))"
        if q.order is None
        else "NULL::text"  # a cursor pages the default order only
    )
    sql = f"""
WITH page AS (
    SELECT m.name AS model, x.*
    FROM ({selected}) m
    CROSS JOIN LATERAL ({heads}
        ORDER BY {inner_order}
        LIMIT :inner_limit) x
    ORDER BY {outer_order}
    LIMIT :limit + 1 OFFSET :offset
), numbered AS (
    SELECT p.*, row_number() OVER (ORDER BY {numbered_order}) AS n FROM page p
)
SELECT coalesce(json_agg(json_build_object(
           'model', p.model, 'stack', p.stack, 'layer', p.layer, 'head', p.head, 'type', p.type,
           'clustering_id', p.clustering_id, 'feature_run_id', p.feature_run_id,
           'features', {_FEATURES},
           'scalars', json_build_object({scalars}){source_json}) ORDER BY p.n) FILTER (WHERE p.n <= :limit),
           '[]')::text AS items,
       count(*) FILTER (WHERE p.n <= :limit) AS page_count,
       {last} AS last,
       {total} AS total,
       {found} AS models_found,
       {clustering_found} AS clustering_found,
       {covered} AS models_uncovered
FROM numbered p"""
    return sql, bind


def page(session: Session, q: HeadQuery) -> PageResult:
    """One page of heads, in one statement."""
    sql, bind = page_sql(q)
    row = session.execute(text(sql), bind).one()
    last = None
    if row.last is not None:
        model, stack, layer, head = json.loads(row.last)
        last = Cursor(model, stack, layer, head)
    return PageResult(
        items_json=row.items,
        count=row.page_count,
        last=last,
        total=row.total,
        models_found=row.models_found,
        clustering_found=row.clustering_found,
        models_uncovered=row.models_uncovered,
    )
