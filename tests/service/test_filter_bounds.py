"""Every bound filter at its bound, and every value a filter reads that can be NULL.

The cases are generated from what the code declares: the ``*_ge``/``*_gt``/``*_lt``/``*_le``/``min_*``
parameters of ``GET /heads`` (``service.heads.endpoints.PARAMETERS``) and of the export
(``export_heads``'s signature), and the ``minimum``/``maximum`` of every query and path parameter in
the OpenAPI schema. A declared filter that :data:`QUANTITIES` cannot read fails
:func:`test_every_declared_bound_filter_has_a_case`, so a new filter gets covered or the suite says so.

For each filter and a bound ``b`` that heads hold exactly (several, in the catalog of
``tests/service/two_runs.py``), ``b`` just below and just above: the heads selected are those whose
value passes the operator the name says, computed here from the stored values; a head whose value is
NULL never passes (docs/usage/rest.md documents no exception). For a quantity with a lower and an
upper filter, ``x_ge=b`` and ``x_lt=b`` split the heads with a value with no gap or overlap (and
``x_gt=b``/``x_lt=b`` leave out exactly the heads at ``b``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ingest.detectors import DETECTORS
from service.exports.endpoints import export_heads
from service.heads import query
from service.heads.endpoints import PARAMETERS
from tests.service import two_runs
from tests.service.two_runs import RELATION, SHAPES, Catalog, Key

engine, catalog, api = two_runs.engine, two_runs.catalog, two_runs.api  # the catalog's module fixtures

BOUND = re.compile(r"^(?:min_(?P<min>\w+)|(?P<name>\w+)_(?P<op>ge|gt|lt|le))$")
OPS: dict[str, Callable[[float, float], bool]] = {
    "ge": lambda v, b: v >= b,
    "gt": lambda v, b: v > b,
    "lt": lambda v, b: v < b,
    "le": lambda v, b: v <= b,
}
HEADS_FILTERS = sorted(p for p in PARAMETERS if BOUND.match(p))
EXPORT_FILTERS = sorted(p for p in inspect.signature(export_heads).parameters if BOUND.match(p))

# quantity -> the head's value in the catalog (None: the head has none), and whether it is an integer
QUANTITIES: dict[str, tuple[Callable[[Catalog, Key], Any], bool]] = {
    "layer": (lambda c, k: k[2], True),
    "num_layers": (lambda c, k: 2, True),  # every model of the catalog has 2 layers x 4 heads per stack
    "num_heads": (lambda c, k: 4, True),
    "agreement": (lambda c, k: c.values[k]["agreement"], False),
    "margin": (lambda c, k: c.values[k]["margin"], False),
    "importance": (lambda c, k: c.values[k]["importance"], False),
    "discrepancy": (lambda c, k: c.values[k]["discrepancy"], False),
    "syntax_accuracy": (lambda c, k: c.values[k]["syntax_accuracy"], False),
    **{name: ((lambda c, k, name=name: c.values[k][name]), False) for name in DETECTORS},  # type: ignore[misc]
}
NEEDS = {"syntax_accuracy": {"relation": RELATION}}  # parameters a filter needs beside itself


def parse(parameter: str) -> tuple[str, str]:
    """``margin_ge`` -> ``("margin", "ge")``; ``min_agreement`` -> ``("agreement", "ge")``."""
    match = BOUND.match(parameter)
    assert match is not None, parameter
    return (match["min"], "ge") if match["min"] else (match["name"], match["op"])


@pytest.mark.parametrize("parameter", sorted({*HEADS_FILTERS, *EXPORT_FILTERS}))
def test_every_declared_bound_filter_has_a_case(parameter: str) -> None:
    quantity, _ = parse(parameter)
    assert quantity in QUANTITIES, f"{parameter}: a declared filter with no boundary case in {__name__}.QUANTITIES"


def test_the_filters_are_found() -> None:
    """The generation is not vacuous: the filters the docs name are among those found."""
    assert {"layer_ge", "importance_gt", "margin_ge", "agreement_lt", "induction_gt", "sink_lt"} <= set(HEADS_FILTERS)
    assert {"layer_gt", "min_agreement", "min_margin"} <= set(EXPORT_FILTERS)


# --- the catalog -------------------------------------------------------------------------------------


def bounds(catalog: Catalog, quantity: str) -> list[float]:
    """Values heads hold exactly (the lowest, a middle one, the highest), each with the values just beside it."""
    read, integer = QUANTITIES[quantity]
    held = sorted({v for k in catalog.heads() if (v := read(catalog, k)) is not None})
    assert len(held) >= 2 or integer, f"{quantity}: the catalog holds fewer than two values"
    out: list[float] = []
    for b in dict.fromkeys([held[0], held[len(held) // 2], held[-1]]):
        out += [b - 1, b, b + 1] if integer else [math.nextafter(b, -math.inf), b, math.nextafter(b, math.inf)]
    return out


def selected(catalog: Catalog, quantity: str, op: str, b: float, heads: list[Key]) -> set[Key]:
    read, _ = QUANTITIES[quantity]
    return {k for k in heads if (v := read(catalog, k)) is not None and OPS[op](v, b)}


def heads_page(api: TestClient, **params: Any) -> set[Key]:
    answer = api.get("/heads", params={"limit": 1000, **params})
    assert answer.status_code == 200, answer.text
    return {(h["model"], h["stack"], h["layer"], h["head"]) for h in answer.json()["items"]}


def in_range(parameter: str, b: float, api: TestClient, path: str) -> bool:
    """Whether ``b`` lies within the parameter's declared minimum and maximum (else the API answers 422)."""
    schema = next(p for p in api.app.openapi()["paths"][path]["get"]["parameters"] if p["name"] == parameter)  # type: ignore[attr-defined]
    declared = next((s for s in schema["schema"].get("anyOf", [schema["schema"]]) if s.get("type") != "null"), {})
    return declared.get("minimum", -math.inf) <= b <= declared.get("maximum", math.inf)


@pytest.mark.parametrize("parameter", HEADS_FILTERS)
def test_get_heads_filters_at_just_below_and_just_above_their_bound(
    api: TestClient, catalog: Catalog, parameter: str
) -> None:
    assert wrong_bounds(api, catalog, parameter) == []


def wrong_bounds(api: TestClient, catalog: Catalog, parameter: str) -> list[float]:
    """The bounds at which ``GET /heads`` with ``parameter`` selects other heads than the operator says."""
    quantity, op = parse(parameter)
    heads, wrong = catalog.heads(), []
    for b in bounds(catalog, quantity):
        if in_range(parameter, b, api, "/heads"):
            want = selected(catalog, quantity, op, b, heads)
            if heads_page(api, **{parameter: repr(b)}, **NEEDS.get(quantity, {})) != want:
                wrong.append(b)
    return wrong


FLIPS = {">=": ">", ">": ">=", "<=": "<", "<": "<="}


def operator_mutants() -> list[tuple[str, str, str]]:
    """Each filter condition of ``query.SOURCES`` with its comparison flipped at the bound: (parameter, the
    condition, the mutant)."""
    out = []
    for source in query.SOURCES:
        for name, condition in source.filters.items():
            found = re.search(r" (>=|<=|>|<) :", condition)
            if found is not None:
                flipped = f" {FLIPS[found[1]]} :"
                out.append((name, condition, condition[: found.start()] + flipped + condition[found.end() :]))
    return out


@pytest.mark.parametrize(("parameter", "condition", "mutant"), operator_mutants(), ids=lambda v: str(v))
def test_a_filter_whose_comparison_is_flipped_at_the_bound_is_caught(
    api: TestClient, catalog: Catalog, monkeypatch: pytest.MonkeyPatch, parameter: str, condition: str, mutant: str
) -> None:
    """The cases above are strong enough: ``>=`` read as ``>`` (and kin) in the filter table fails them."""
    mutated = tuple(
        dataclasses.replace(s, filters={**s.filters, parameter: mutant}) if parameter in s.filters else s
        for s in query.SOURCES
    )
    monkeypatch.setattr(query, "SOURCES", mutated)
    assert wrong_bounds(api, catalog, parameter), f"{parameter}: {mutant!r} instead of {condition!r} passes"


def pairs(quantity: str) -> list[tuple[str, str]]:
    """The declared lower and upper filters of ``quantity`` (``GET /heads``), paired."""
    ops = {parse(p)[1]: p for p in HEADS_FILTERS if parse(p)[0] == quantity}
    return [(ops[low], ops[high]) for low in ("ge", "gt") for high in ("lt", "le") if low in ops and high in ops]


@pytest.mark.parametrize(
    ("lower", "upper"), [pair for quantity in sorted({parse(p)[0] for p in HEADS_FILTERS}) for pair in pairs(quantity)]
)
def test_a_lower_and_an_upper_filter_at_one_bound_split_the_heads(
    api: TestClient, catalog: Catalog, lower: str, upper: str
) -> None:
    quantity, low = parse(lower)
    _, high = parse(upper)
    extra = NEEDS.get(quantity, {})
    valued = {k for k in catalog.heads() if QUANTITIES[quantity][0](catalog, k) is not None}
    for b in bounds(catalog, quantity):
        if not (in_range(lower, b, api, "/heads") and in_range(upper, b, api, "/heads")):
            continue
        above, below = heads_page(api, **{lower: repr(b)}, **extra), heads_page(api, **{upper: repr(b)}, **extra)
        at = {k for k in valued if QUANTITIES[quantity][0](catalog, k) == b}
        inclusive = (low == "ge") + (high == "le")  # how many of the two keep the heads at b
        assert above | below | (at if inclusive == 0 else set()) == valued, (lower, upper, b)
        assert above & below == (at if inclusive == 2 else set()), (lower, upper, b)


def export_pairs(api: TestClient, model: str, **params: Any) -> set[Key]:
    answer = api.get(f"/models/{model}/export", params={"format": "pairs", **params})
    assert answer.status_code == 200, answer.text
    stacks = SHAPES[model]
    return {(model, *p) if len(stacks) > 1 else (model, stacks[0], *p) for p in answer.json()}  # type: ignore[misc]


@pytest.mark.parametrize("parameter", EXPORT_FILTERS)
def test_export_filters_at_just_below_and_just_above_their_bound(
    api: TestClient, catalog: Catalog, parameter: str
) -> None:
    quantity, op = parse(parameter)
    for model in SHAPES:
        if quantity in ("agreement", "margin") and model == "plain":
            continue  # an unclustered model has neither: a 422 (test_a_confidence_filter_needs_a_clustering)
        heads = catalog.heads(model)
        for b in bounds(catalog, quantity):
            if not in_range(parameter, b, api, "/models/{name}/export") or not layer_in_model(parameter, b):
                continue
            want = selected(catalog, quantity, op, b, heads)
            assert export_pairs(api, model, **{parameter: repr(b)}) == want, (model, parameter, b)


# --- validation ranges ------------------------------------------------------------------------------

# An export's layer bound must name a layer of the model (2 layers here): -1 and num_layers only where they
# mean "every layer" (service/exports/service.py, _check_positions).
LAYER_RANGE = {"layer_gt": (-1, 1), "layer_ge": (0, 1), "layer_lt": (0, 2), "layer_le": (0, 1), "head": (0, 3)}


def layer_in_model(parameter: str, b: float) -> bool:
    low, high = LAYER_RANGE.get(parameter, (-math.inf, math.inf))
    return low <= b <= high


@pytest.mark.parametrize("parameter", sorted(LAYER_RANGE))
def test_an_export_s_position_bounds_are_checked_at_their_ends(api: TestClient, parameter: str) -> None:
    low, high = LAYER_RANGE[parameter]
    for model in SHAPES:
        for value, ok in ((low - 1, False), (low, True), (high, True), (high + 1, False)):
            answer = api.get(f"/models/{model}/export", params={"format": "pairs", parameter: value})
            if ok:
                assert answer.status_code == 200, (model, parameter, value, answer.text)
            else:
                assert (answer.status_code, answer.json()["field"]) == (422, parameter), (model, value, answer.text)
                if "Input should" not in answer.json()["detail"]:  # not already the declared range's refusal
                    kind = "head" if parameter == "head" else "layer"  # the message names what the bound counts
                    assert answer.json()["detail"].startswith(f"{parameter}: {kind} {value} is out of range")
                    assert f"{low}..{high}" in answer.json()["detail"]


def test_the_page_s_head_is_checked_at_the_model_s_shape(api: TestClient) -> None:
    """``0 <= layer < num_layers`` and ``0 <= head < num_heads`` of ``GET /models/{name}/heads/{layer}/{head}``."""
    for model in SHAPES:
        stack = SHAPES[model][-1]
        assert api.get(f"/models/{model}/heads/1/3", params={"stack": stack}).status_code == 200
        for layer, head, field in ((2, 0, "layer"), (0, 4, "head")):
            answer = api.get(f"/models/{model}/heads/{layer}/{head}", params={"stack": stack})
            assert (answer.status_code, answer.json()["field"]) == (422, field), answer.text


def declared_ranges(app: Any) -> list[tuple[str, str, str, float | None, float | None, bool]]:
    """Every GET query or path parameter with a declared minimum or maximum:
    (path, parameter, where, minimum, maximum, integer)."""
    out = []
    for path, methods in app.openapi()["paths"].items():
        for parameter in methods.get("get", {}).get("parameters", []):
            schema = parameter["schema"]
            for declared in schema.get("anyOf", [schema]):
                if "minimum" in declared or "maximum" in declared:
                    out.append((path, parameter["name"], parameter["in"], declared.get("minimum"),
                                declared.get("maximum"), declared.get("type") == "integer"))  # fmt: skip
    return out


def test_every_declared_range_refuses_just_outside_and_not_at_its_ends(api: TestClient) -> None:
    """At a declared end a value is not refused for its range (it may be for another reason: a 404 for an id
    that does not exist, a layer the model has not); just outside it is a 422 naming the parameter."""
    ranges = declared_ranges(api.app)
    assert {("/heads", "margin_ge"), ("/models/{name}/export", "min_agreement"), ("/heads", "limit")} <= {
        (path, name) for path, name, *_ in ranges
    }
    for path, name, where, low, high, integer in ranges:
        for end, outside in ((low, -1), (high, 1)):
            if end is None:
                continue
            beyond = end + outside if integer else math.nextafter(end, outside * math.inf)
            for value, refused in ((end, False), (beyond, True)):
                answer = call(api, path, name, where, value)
                body = answer.json() if answer.headers["content-type"].startswith("application/json") else {}
                blamed = (
                    answer.status_code == 422
                    and body.get("field") == name
                    and ("greater than" in body["detail"] or "less than" in body["detail"])
                )
                assert blamed == refused, (path, name, value, answer.status_code, answer.text[:300])


def call(api: TestClient, path: str, name: str, where: str, value: float) -> Any:
    """``GET path`` with ``name`` = ``value``, its other required parameters filled with what the catalog has."""
    fill = {"name": "tiny", "layer": "0", "head": "0", "run_id": "1", "job_id": "1", "clustering_id": "1",
            "curve_id": "1", "stack": "encoder"}  # fmt: skip
    text = repr(value) if isinstance(value, float) else str(value)
    declared = api.app.openapi()["paths"][path]["get"]["parameters"]  # type: ignore[attr-defined]
    params = {p["name"]: fill.get(p["name"], "tiny") for p in declared if p["in"] == "query" and p.get("required")}
    if where == "path":
        fill = {**fill, name: text}
    else:
        params[name] = text
    return api.get(re.sub(r"\{(\w+)\}", lambda m: fill[m[1]], path), params=params)


# --- values that are NULL ---------------------------------------------------------------------------


@pytest.mark.parametrize("quantity", ["agreement", "margin", "discrepancy", "syntax_accuracy", "induction",
                                      "duplicate_token"])  # fmt: skip
def test_a_null_value_never_passes_a_filter(api: TestClient, catalog: Catalog, quantity: str) -> None:
    read, _ = QUANTITIES[quantity]
    nulls = {k for k in catalog.heads() if read(catalog, k) is None}
    assert nulls, quantity
    assert len(nulls) < len(catalog.heads()), quantity
    for parameter in [p for p in HEADS_FILTERS if parse(p)[0] == quantity]:
        for b in (-1.0, 0.0, 1.0):  # the widest bounds: every valued head passes one side
            if in_range(parameter, b, api, "/heads"):
                assert not heads_page(api, **{parameter: b}, **NEEDS.get(quantity, {})) & nulls, (parameter, b)
    for parameter in [p for p in EXPORT_FILTERS if parse(p)[0] == quantity]:
        for model in ("tiny", "bart"):
            assert not export_pairs(api, model, **{parameter: -1.0 if quantity == "margin" else 0.0}) & nulls


def test_ordering_by_a_nullable_value_puts_the_nulls_last(api: TestClient, catalog: Catalog) -> None:
    for quantity in ("agreement", "margin", "discrepancy", "induction"):
        for sign in ("", "-"):
            items = api.get("/heads", params={"order": f"{sign}{quantity}", "limit": 1000}).json()["items"]
            values = [h[quantity] for h in items]
            present = [v for v in values if v is not None]
            assert values == present + [None] * (len(values) - len(present)), quantity
            assert present == sorted(present, reverse=bool(sign)), quantity


def test_a_confidence_filter_needs_a_clustering(api: TestClient) -> None:
    for parameter in ("min_agreement", "min_margin"):
        answer = api.get("/models/plain/export", params={parameter: 0.5})
        assert (answer.status_code, answer.json()["field"]) == (422, parameter)


@pytest.mark.parametrize("parameter", [p for p in EXPORT_FILTERS if p.startswith("min_")])
def test_a_confidence_bound_at_either_end_of_its_range_is_taken(
    api: TestClient, catalog: Catalog, parameter: str
) -> None:
    """The export checks the range again (for the CLI, which has no Query): its ends are in it."""
    quantity, _ = parse(parameter)
    schema = next(p for p in api.app.openapi()["paths"]["/models/{name}/export"]["get"]["parameters"]  # type: ignore[attr-defined]
                  if p["name"] == parameter)["schema"]["anyOf"][0]  # fmt: skip
    for b in (schema["minimum"], schema["maximum"]):
        for model in ("tiny", "bart"):
            assert export_pairs(api, model, **{parameter: b}) == selected(catalog, quantity, "ge", b,
                                                                           catalog.heads(model))  # fmt: skip
