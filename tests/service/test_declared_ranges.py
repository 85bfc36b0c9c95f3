"""Every range a request body or a GET parameter declares, held to a contract written out here.

:data:`RANGES` is the contract, written out by hand: each bounded field of every request body (``POST``/``PUT``
schemas, all :class:`~service.errors.RequestBody`), its lowest and highest value and whether each end is allowed.
The tests check it against the code both ways: a bound declared in a schema and missing here fails (a new field
gets its range written down), a range here whose field no schema bounds fails, and each end behaves as written
when a body is validated (the value at an inclusive bound passes, the next integer or float beyond it is refused
naming the field; an exclusive bound is refused and the next value inside passes) and as the OpenAPI schema that
clients read says. So ``ge`` turned into ``gt``, or ``le`` into ``lt``, in any schema fails here. The GET
parameters' ranges are held to :func:`parameter_range` the same way (their calls at each end are in
``test_filter_bounds.py``).
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from dataclasses import dataclass
from typing import Any

import annotated_types as at
import pytest
from pydantic import BaseModel, ValidationError
from sqlalchemy import Engine

import service
from service.errors import RequestBody

INT32 = 2**31 - 1


@dataclass(frozen=True)
class Range:
    low: float
    high: float
    low_open: bool = False  # True: the low end itself is refused (gt), else allowed (ge)
    high_open: bool = False  # True: the high end itself is refused (lt), else allowed (le)


# schema -> field -> its range: what a user may send
RANGES: dict[str, dict[str, Range]] = {
    "AblationCreate": {
        "clustering": Range(1, INT32),
        "limit": Range(1, 10_000_000),
        "batch_size": Range(1, 4096),
        "max_length": Range(16, 8192),
    },
    "AttributionCreate": {
        "samples": Range(1, 100_000),
        "max_length": Range(8, 8192),
        "queries": Range(1, 8192),
        "probes": Range(1, 1024),
        "num_windows": Range(1, 249),
        "seed": Range(0, INT32),
    },
    "ClusteringCreate": {"k": Range(2, 1000), "seed": Range(0, INT32)},
    "StabilityCreate": {"n_runs": Range(2, 1000), "fraction": Range(0.0, 1.0, low_open=True), "seed": Range(0, INT32)},
    "DetectionCreate": {
        "sequences": Range(1, 100_000),
        "length": Range(2, 100_000),
        "copies": Range(2, 1000),
        "seed": Range(0, INT32),
        "corpus_samples": Range(1, 100_000),
        "batch_size": Range(1, 4096),
    },
    "DetectionSettings": {
        "sequences": Range(1, 100_000),
        "length": Range(2, 100_000),
        "copies": Range(2, 1000),
        "seed": Range(0, INT32),
        "corpus_samples": Range(1, 100_000),
        "batch_size": Range(1, 4096),
    },
    "ImportanceCreate": {
        "limit": Range(1, 10_000_000),
        "batch_size": Range(1, 4096),
        "max_length": Range(16, 8192),
        "seed": Range(0, INT32),
        "probes": Range(1, 256),
        "mask_probability": Range(0.0, 1.0, low_open=True, high_open=True),
    },
    "PruningCurveCreate": {
        "limit": Range(1, 10_000_000),
        "batch_size": Range(1, 4096),
        "max_length": Range(16, 8192),
        "seed": Range(0, INT32),
        "steps": Range(1, 200),
        "max_share": Range(0.0, 1.0, low_open=True),
        "clustering": Range(1, INT32),
        "importance_run": Range(1, INT32),
    },
    "IngestCreate": {
        "step": Range(0, INT32),
        "samples": Range(1, 10_000_000),
        "max_length": Range(8, 8192),
        "batch_size": Range(1, 4096),
        "num_windows": Range(1, 512),
    },
    "CurrentChoice": {"run_id": Range(1, INT32)},
    "SyntaxCreate": {"samples": Range(1, 1_000_000), "max_length": Range(8, 8192), "batch_size": Range(1, 4096)},
}


def request_bodies() -> dict[str, type[RequestBody]]:
    """Every public request body the service defines (its modules imported, its CLI entry point aside)."""
    for module in pkgutil.walk_packages(service.__path__, "service."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    found: dict[str, type[RequestBody]] = {}
    pending: list[type[RequestBody]] = [RequestBody]
    while pending:
        for sub in pending.pop().__subclasses__():
            pending.append(sub)
            if not sub.__name__.startswith("_"):
                found[sub.__name__] = sub
    return found


BODIES = request_bodies()


def declared(model: type[BaseModel]) -> dict[str, Range]:
    out = {}
    for name, field in model.model_fields.items():
        bounds = {type(item): item for item in field.metadata if isinstance(item, at.Ge | at.Gt | at.Le | at.Lt)}
        if not bounds:
            continue
        low = bounds.get(at.Ge) or bounds.get(at.Gt)
        high = bounds.get(at.Le) or bounds.get(at.Lt)
        assert low is not None, f"{model.__name__}.{name}: bounded above only"
        assert high is not None, f"{model.__name__}.{name}: bounded below only"
        out[name] = Range(
            float(getattr(low, "ge", getattr(low, "gt", math.nan))),
            float(getattr(high, "le", getattr(high, "lt", math.nan))),
            low_open=isinstance(low, at.Gt),
            high_open=isinstance(high, at.Lt),
        )
    return out


def test_every_declared_range_is_written_down_and_every_written_range_declared() -> None:
    declared_ranges = {name: ranges for name, model in BODIES.items() if (ranges := declared(model))}
    assert declared_ranges.keys() == RANGES.keys()
    for name, ranges in RANGES.items():
        assert declared_ranges[name] == ranges, name


def is_int(model: type[BaseModel], field: str) -> bool:
    annotation = model.model_fields[field].annotation
    return int in getattr(annotation, "__args__", (annotation,))


def field_errors(model: type[BaseModel], field: str, value: Any) -> list[str]:
    """The errors validating ``{field: value}`` gives at that field (the body's other fields aside)."""
    try:
        model.model_validate({field: value})
    except ValidationError as error:
        return [item["type"] for item in error.errors() if item["loc"][:1] == (field,)]
    return []


CASES = [
    pytest.param(schema, field, end, id=f"{schema}.{field}.{end}")
    for schema, fields in RANGES.items()
    for field in fields
    for end in ("low", "high")
]


@pytest.mark.parametrize(("schema", "field", "end"), CASES)
def test_each_end_of_each_range_is_allowed_or_refused_as_written(schema: str, field: str, end: str) -> None:
    model = BODIES[schema]
    limit = RANGES[schema][field]
    bound, is_open = (limit.low, limit.low_open) if end == "low" else (limit.high, limit.high_open)
    outward = -math.inf if end == "low" else math.inf
    if is_int(model, field):
        at_bound, beyond, inside = (
            int(bound),
            int(bound) + (-1 if end == "low" else 1),
            int(bound) + (1 if end == "low" else -1),
        )
    else:
        at_bound, beyond, inside = bound, math.nextafter(bound, outward), math.nextafter(bound, -outward)
    assert field_errors(model, field, inside) == []
    assert field_errors(model, field, beyond) != [], f"{field}={beyond} passes"
    if is_open:
        assert field_errors(model, field, at_bound) != [], f"{field}={at_bound} (the open bound) passes"
    else:
        assert field_errors(model, field, at_bound) == [], f"{field}={at_bound} (the bound) is refused"


@pytest.fixture(scope="module")
def openapi(engine: Engine) -> dict[str, Any]:
    from service.app import create_app

    return create_app(engine).openapi()


@pytest.mark.parametrize("schema", sorted(RANGES))
def test_the_openapi_schema_says_the_same_ranges(schema: str, openapi: dict[str, Any]) -> None:
    components = openapi["components"]["schemas"]
    properties = components[schema]["properties"]
    for field, limit in RANGES[schema].items():
        shown = properties[field]
        options = shown.get("anyOf", [shown])  # an optional field: its number type beside null
        number = next(option for option in options if option.get("type") in ("integer", "number"))
        low_key = "exclusiveMinimum" if limit.low_open else "minimum"
        high_key = "exclusiveMaximum" if limit.high_open else "maximum"
        assert (number.get(low_key), number.get(high_key)) == (limit.low, limit.high), f"{schema}.{field}"


# --- the parameters of every GET ---------------------------------------------------------------------
# tests/service/test_filter_bounds.py calls each GET at and beyond the ends its OpenAPI schema declares; here the
# declared ends themselves are held to the contract, so a bound made open (``ge`` to ``gt``, which OpenAPI shows
# as ``exclusiveMinimum``) or moved cannot pass unseen.

LAYERS = 100_000  # the most layers (or heads) a parameter may name


def parameter_range(path: str, name: str) -> Range:
    """What a user may send as ``name`` to ``GET path``: every range is closed."""
    if name in ("run_id", "clustering_id", "job_id", "curve_id", "clustering", "importance_run"):
        return Range(1, INT32)
    if name == "offset":
        return Range(0, 10_000_000)
    if name == "limit":
        return Range(1, 1000 if path in ("/heads", "/clusterings", "/jobs") else 100)
    if name in ("layer_gt", "layer_ge", "layer_lt", "layer_le"):
        return Range(-1, LAYERS)  # -1: layer_gt=-1 is every layer
    if name in ("layer", "head"):
        return Range(0, 10_000 if path == "/models/{name}/detections/example" else LAYERS)
    if name in ("num_layers_ge", "num_layers_le", "num_heads_ge", "num_heads_le"):
        return Range(0, LAYERS)
    if name in ("margin_ge", "margin_lt", "min_margin"):
        return Range(-1, 1)
    if name in ("agreement_ge", "agreement_lt", "min_agreement"):
        return Range(0, 1)
    if name == "step":
        return Range(0, INT32)
    if name == "min_count":
        return Range(1, 1_000_000)
    if name == "per_type":
        return Range(1, 20)
    raise AssertionError(f"GET {path}: {name} has a range the contract does not know; write it down here")


def test_every_get_parameter_range_is_closed_and_as_the_contract_says(openapi: dict[str, Any]) -> None:
    seen = []
    for path, methods in openapi["paths"].items():
        for parameter in methods.get("get", {}).get("parameters", []):
            schema = parameter["schema"]
            for option in schema.get("anyOf", [schema]):
                if not any(key in option for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
                    continue
                name = parameter["name"]
                shown = Range(
                    option.get("minimum", option.get("exclusiveMinimum", -math.inf)),
                    option.get("maximum", option.get("exclusiveMaximum", math.inf)),
                    low_open="exclusiveMinimum" in option,
                    high_open="exclusiveMaximum" in option,
                )
                assert shown == parameter_range(path, name), f"GET {path}: {name}"
                seen.append((path, name))
    assert {("/heads", "layer_gt"), ("/heads", "margin_ge"), ("/models/{name}/export", "min_agreement")} <= set(seen)
