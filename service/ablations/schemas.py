"""Ablation requests (validated up front) and what the API says about stored outcomes.

A plan row maps operations to head selections. A selection is written as one of:

- a type name or comma list, ``"dense"``, ``"dense,vertical"``; ``"all-but:diagonal"`` for every
  type but those named; ``"all"`` for every head;
- layers, ``"layers:3-5"`` or ``"layers:0,2"`` (every head of them);
- explicit heads, ``"0:1,5:11"`` (``LAYER:HEAD``, 0-based);
- any of these after a stack, ``"encoder:layers:0-2"``, ``"decoder:0:1,0:3"``, ``"cross:dense"``:
  the rule covers that stack only. A rule that names no stack covers **every stack** of the
  model (for encoder-only and decoder-only models, their one stack: the old meaning);
- JSON forms: a list of type names, a list of ``[layer, head]`` pairs or ``[stack, layer, head]``
  triples, or the stored rule ``{"types": [...]}``, ``{"all_but_types": [...]}``,
  ``{"layers": [...], "heads": [...]}``, ``{"heads": [[l, h], ...]}``, ``{"all": true}``,
  ``{"union": [...]}``, each but the union with an optional ``"stack"``.

Every form is normalised here to the stored rule, so identical requests queue one job.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.errors import RequestBody

Task = Literal["squad", "glue", "drift"]
Operation = Literal["prune", "uniform", "drop_intra", "drop_inter"]
OPERATIONS: tuple[Operation, ...] = ("prune", "uniform", "drop_intra", "drop_inter")
Sample = Literal["first", "spread"]

_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+))?\s*$")
_PAIR = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_&\-]*$")
_RULE_KEYS = {"types", "all_but_types", "roles", "layers", "heads", "all", "union", "stack"}
ROLE_NAMES: tuple[str, ...] = ("induction", "duplicate_token", "previous_token", "sink")


def _role_names(values: Any) -> list[str]:
    names = [values] if isinstance(values, str) else values
    if not isinstance(names, list) or not names or not all(isinstance(name, str) for name in names):
        raise ValueError(f"expected one or more role names, got {values!r}")
    out = [part.strip() for name in names for part in name.replace("+", ",").split(",") if part.strip()]
    unknown = [name for name in out if name not in ROLE_NAMES]
    if unknown or not out:
        raise ValueError(f"unknown role {(unknown or [''])[0]!r}; roles: {', '.join(ROLE_NAMES)}")
    return list(dict.fromkeys(out))


STACK_NAMES: tuple[str, ...] = ("encoder", "decoder", "cross")


def _stack(value: Any) -> str:
    if value not in STACK_NAMES:
        raise ValueError(f"unknown stack {value!r}; stacks: {', '.join(STACK_NAMES)}")
    return str(value)


def parse_ints(text: str, what: str) -> list[int]:
    """``"3-5"`` -> ``[3, 4, 5]``; ``"0,2,4-5"`` -> ``[0, 2, 4, 5]`` (inclusive ranges)."""
    values: list[int] = []
    for part in text.split(","):
        if not part.strip():
            continue
        match = _RANGE.match(part)
        if match is None:
            raise ValueError(f"{what} {part.strip()!r} is not a number or a range like 3-5")
        start, stop = int(match[1]), int(match[2] if match[2] is not None else match[1])
        if stop < start:
            raise ValueError(f"{what} range {part.strip()!r} runs backwards")
        if stop - start > 100_000:
            raise ValueError(f"{what} range {part.strip()!r} is too long")
        values.extend(range(start, stop + 1))
    if not values:
        raise ValueError(f"no {what} in {text!r}")
    return list(dict.fromkeys(values))


def _type_names(values: Any) -> list[str]:
    names = [values] if isinstance(values, str) else values
    if not isinstance(names, list) or not names:
        raise ValueError(f"expected one or more head type names, got {values!r}")
    out: list[str] = []
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"a head type is a name, got {name!r}")
        for part in name.split(","):
            part = part.strip()
            if not part:
                continue
            if not _NAME.match(part) or len(part) > 64:
                raise ValueError(f"{part!r} is not a head type name")
            out.append(part)
    if not out:
        raise ValueError(f"expected one or more head type names, got {values!r}")
    return list(dict.fromkeys(out))


def _pairs(values: Any) -> list[list[Any]]:
    if isinstance(values, str):
        pairs = []
        for part in values.split(","):
            if not part.strip():
                continue
            match = _PAIR.match(part)
            if match is None:
                raise ValueError(f"{part.strip()!r} is not LAYER:HEAD (e.g. 0:1,5:11)")
            pairs.append([int(match[1]), int(match[2])])
        values = pairs
    if not isinstance(values, list) or not values:
        raise ValueError(f"expected (layer, head) pairs, got {values!r}")
    out: list[list[Any]] = []
    for pair in values:
        if isinstance(pair, list | tuple) and len(pair) == 3 and isinstance(pair[0], str):
            stack, numbers = [_stack(pair[0])], pair[1:]
        else:
            stack, numbers = [], pair
        if not (isinstance(numbers, list | tuple) and len(numbers) == 2 and all(isinstance(v, int) for v in numbers)):
            raise ValueError(f"a head is a [layer, head] pair of integers or [stack, layer, head], got {pair!r}")
        if min(numbers) < 0:
            raise ValueError(f"head {list(pair)}: layers and heads are 0-based, not negative")
        out.append([*stack, int(numbers[0]), int(numbers[1])])
    unique = {tuple(pair): pair for pair in out}
    return list(unique.values())


def _ints(values: Any, what: str) -> list[int]:
    if isinstance(values, str):
        return parse_ints(values, what)
    if isinstance(values, int) and not isinstance(values, bool):
        values = [values]
    if not isinstance(values, list) or not values or not all(isinstance(v, int) for v in values):
        raise ValueError(f"expected {what} numbers or a range like 3-5, got {values!r}")
    if min(values) < 0:
        raise ValueError(f"{what} numbers are 0-based, not negative: {values!r}")
    return list(dict.fromkeys(int(v) for v in values))


def normalize_selection(value: Any) -> dict[str, Any]:
    """Any accepted spelling of a head selection -> the stored rule (``HeadSelection.to_dict`` form)."""
    if isinstance(value, str):
        text = value.strip()
        stack, colon, rest = text.partition(":")
        if colon and stack.strip() in STACK_NAMES:
            return _with_stack(normalize_selection(rest), stack.strip())
        if colon and stack.strip().isalpha() and stack.strip() not in ("layers", "heads", "all", "role"):
            _stack(stack.strip())  # "middle:layers:0": name the stack that does not exist
        if text == "all":
            return {"all": True}
        if text.startswith("role:"):
            return {"roles": _role_names(text.removeprefix("role:"))}
        for prefix in ("all-but:", "all_but:", "!"):
            if text.startswith(prefix):
                return {"all_but_types": _type_names(text.removeprefix(prefix))}
        if text.startswith("layers:"):
            layers, _, heads = text.removeprefix("layers:").partition("/heads:")
            rule: dict[str, Any] = {"layers": parse_ints(layers, "layer")}
            if heads:
                rule["heads"] = parse_ints(heads, "head")
            return rule
        if text.startswith("heads:") or _PAIR.match(text.split(",")[0] or "x"):
            return {"heads": _pairs(text.removeprefix("heads:"))}
        return {"types": _type_names(text)}
    if isinstance(value, list):
        if value and all(isinstance(item, str) for item in value):
            return {"types": _type_names(value)}
        return {"heads": _pairs(value)}
    if isinstance(value, dict):
        keys = set(value)
        if not keys or not keys <= _RULE_KEYS:
            raise ValueError(f"a selection rule has keys among {sorted(_RULE_KEYS)}, got {sorted(keys)}")
        if "stack" in keys:
            others = {key: item for key, item in value.items() if key != "stack"}
            if "union" in others:
                raise ValueError("a union has no stack; give each of its parts one")
            return _with_stack(normalize_selection(others), _stack(value["stack"]))
        if "union" in keys:
            parts = value["union"]
            if keys != {"union"} or not isinstance(parts, list) or not parts:
                raise ValueError("a union is {'union': [selection, ...]} and nothing else")
            return {"union": [normalize_selection(part) for part in parts]}
        if "all" in keys:
            if keys != {"all"} or value["all"] is not True:
                raise ValueError("'all' is {'all': true} and nothing else")
            return {"all": True}
        if "roles" in keys:
            if keys != {"roles"}:
                raise ValueError(f"a role selection has one key, got {sorted(keys)}")
            return {"roles": _role_names(value["roles"])}
        if "types" in keys or "all_but_types" in keys:
            (key,) = keys if len(keys) == 1 else (None,)
            if key is None:
                raise ValueError(f"a type selection has one key, got {sorted(keys)}")
            return {key: _type_names(value[key])}
        if "layers" in keys:
            rule = {"layers": _ints(value["layers"], "layer")}
            if value.get("heads") is not None:
                rule["heads"] = _ints(value["heads"], "head")
            return rule
        return {"heads": _pairs(value["heads"])}
    raise ValueError(f"cannot read {value!r} as a head selection")


def _with_stack(rule: dict[str, Any], stack: str) -> dict[str, Any]:
    if "union" in rule:
        raise ValueError("a union has no stack; give each of its parts one")
    if "stack" in rule and rule["stack"] != stack:
        raise ValueError(f"the selection names two stacks, {rule['stack']} and {stack}")
    for pair in rule.get("heads", []) if "layers" not in rule else []:
        if len(pair) == 3 and pair[0] != stack:
            raise ValueError(f"head {pair} is not in the selection's stack {stack}")
    return {**rule, "stack": stack}


class PlanRowCreate(RequestBody):
    """One custom row: operations over head selections; every operation's heads are ablated together."""

    id: str | None = Field(default=None, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._+:\-\[\], ]*$")
    label: str | None = Field(default=None, max_length=300)
    ops: dict[Operation, Any] = Field(min_length=1, description="operation -> head selection")

    @field_validator("ops")
    @classmethod
    def _selections(cls, ops: dict[Operation, Any]) -> dict[Operation, Any]:
        ordered = sorted(ops.items(), key=lambda item: OPERATIONS.index(item[0]))  # one order, whatever was sent
        return {op: normalize_selection(selection) for op, selection in ordered}


class AblationCreate(RequestBody):
    """Run a plan of ablations of a catalog model's heads on labelled (or, for drift, any) data."""

    model: str = Field(min_length=1, max_length=200, description="catalog name of the model")
    clustering: int | None = Field(
        default=None, ge=1, le=2**31 - 1, description="clustering id for the head types; default: the model's current"
    )
    data: str = Field(
        min_length=1,
        max_length=1000,
        description="SQuAD .json | GLUE .tsv | .jsonl (text/text_pair/label) | .txt or builtin:NAME (drift) | "
        "hub:NAME[:CONFIG][:SPLIT]",
    )
    task: Task | None = Field(
        default=None, description="squad | glue | drift; default from the model's head (QA: squad, classifier: glue)"
    )
    plan: Literal["paper"] | list[PlanRowCreate] = Field(
        default="paper",
        description="'paper' (Guan et al. Tables 2 and 3 over the model's types) or custom rows; "
        "a row is {op: selection} or {id, label, ops: {op: selection}}",
    )
    articles: str | None = Field(
        default=None,
        pattern=r"^\s*(all|\d+\s*(-\s*\d+)?)\s*$",
        description="SQuAD articles to read, e.g. 24-47 (0-based, inclusive) or all; default: a fine-tuned "
        "model's held-out articles when its finetune.json names them, else all",
    )
    limit: int | None = Field(default=None, ge=1, le=10_000_000, description="evaluate this many examples")
    sample: Sample = Field(default="first", description="first: the first `limit` examples; spread: evenly spaced")
    batch_size: int = Field(default=32, ge=1, le=4096)
    max_length: int | None = Field(default=None, ge=16, le=8192, description="default: 384 for SQuAD, 128 otherwise")
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?|mps)$")
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    renormalize: bool = Field(default=False, description="renormalise rows after drop_intra / drop_inter")

    @field_validator("plan", mode="before")
    @classmethod
    def _rows(cls, plan: Any) -> Any:
        if isinstance(plan, list):
            return [row if isinstance(row, dict) and "ops" in row else {"ops": row} for row in plan]
        return plan

    @field_validator("plan")
    @classmethod
    def _not_empty(cls, plan: Any) -> Any:
        if isinstance(plan, list) and not plan:
            raise ValueError("give 'paper' or at least one row")
        if isinstance(plan, list) and len(plan) > 500:
            raise ValueError("at most 500 rows in one plan")
        return plan

    @model_validator(mode="after")
    def _sample_needs_limit(self) -> AblationCreate:
        if self.sample == "spread" and self.limit is None:
            raise ValueError("sample: 'spread' picks `limit` evenly spaced examples; give a limit")
        return self


class AblationFilter(BaseModel):
    type: str | None = None
    task: Task | None = None


class BaselineRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    task: str
    data_key: str
    data_subset: str | None
    limit: int | None
    max_length: int
    dtype: str
    n_examples: int
    metrics: dict[str, Any]
    seconds: float
    device: str
    created_at: datetime


class OutcomeRead(BaseModel):
    row_id: str
    label: str
    paper_ref: str | None
    operations: list[str]
    selection: dict[str, Any] = Field(description="operation -> head selection rule")
    types: list[str] = Field(description="head types with at least one ablated head")
    type_ops: dict[str, dict[str, int]] = Field(description="head type -> operation -> heads of that type ablated")
    heads: int = Field(description="heads ablated")
    metrics: dict[str, Any]
    baseline: dict[str, Any]
    deltas: dict[str, float] = Field(description="metric minus baseline, for each metric")
    n_examples: int
    seconds: float


class DataRead(BaseModel):
    kind: str
    source: str
    sha256: str | None
    subset: str | None
    size: int = Field(description="examples in the data (after the subset), before the limit")


class AblationRunRead(BaseModel):
    id: int
    model: str
    clustering_id: int | None
    status: str
    task: str
    data: DataRead
    limit: int | None
    n_examples: int
    plan: str
    types: dict[str, int] = Field(description="head type -> heads of the model of that type")
    config: dict[str, Any]
    device: str
    dtype: str
    seconds: float
    started_at: datetime
    finished_at: datetime | None
    baseline: BaselineRead
    outcomes: list[OutcomeRead]
