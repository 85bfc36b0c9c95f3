"""What to ablate, without torch: head selections, ablation specs and the paper's plan.

:class:`HeadSelection` rules (explicit heads, layer ranges, types, "all but" types) resolve over a
head-type assignment into an :class:`AblationSpec`, a validated map ``(layer, head) -> operation``;
:func:`paper_plan` lists the rows of Guan et al.'s Tables 2 and 3 as :class:`PlanRow`\\ s. The API
validates requests with these classes without importing torch; :mod:`ingest.ablation` applies them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, get_args

from ingest.types import HEAD_TYPES

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger(__name__)

Operation = Literal["prune", "uniform", "drop_intra", "drop_inter"]
OPERATIONS: tuple[Operation, ...] = get_args(Operation)
SEGMENT_OPERATIONS: frozenset[Operation] = frozenset({"drop_intra", "drop_inter"})

Head: TypeAlias = tuple[int, int]  # (layer, head), 0-based as in transformers
Assignments: TypeAlias = Mapping[Head, str]  # (layer, head) -> head type name


class AblationSpecError(ValueError):
    """An ablation that cannot be applied: bad operation, type, layer or head, or a conflict."""


# --------------------------------------------------------------------------------------------
# Model shape
# --------------------------------------------------------------------------------------------


def model_shape(model: nn.Module) -> tuple[int, int]:
    """``(num_layers, num_heads)`` of a ``transformers`` model, from its config."""
    config: Any = model.config
    return int(config.num_hidden_layers), int(config.num_attention_heads)


# --------------------------------------------------------------------------------------------
# Selections
# --------------------------------------------------------------------------------------------

SelectionKind = Literal["heads", "layers", "types", "all_but_types", "all", "union"]


@dataclass(frozen=True, slots=True)
class HeadSelection:
    """A rule that picks heads, resolved later against a model's shape and a type assignment.

    Build with the class methods: :meth:`explicit`, :meth:`layers`, :meth:`of_type`,
    :meth:`of_types`, :meth:`all_but`, :meth:`all_heads`; combine with ``|``.
    """

    kind: SelectionKind
    pairs: tuple[Head, ...] = ()
    layer_ids: tuple[int, ...] = ()
    head_ids: tuple[int, ...] | None = None
    type_names: tuple[str, ...] = ()
    parts: tuple[HeadSelection, ...] = ()

    @classmethod
    def explicit(cls, heads: Iterable[Sequence[int]]) -> HeadSelection:
        """These ``(layer, head)`` pairs."""
        pairs = []
        for item in heads:
            if len(item) != 2:
                raise AblationSpecError(f"a head is a (layer, head) pair, got {tuple(item)!r}")
            pairs.append((int(item[0]), int(item[1])))
        return cls("heads", pairs=tuple(pairs))

    @classmethod
    def layers(cls, layers: Iterable[int], heads: Iterable[int] | None = None) -> HeadSelection:
        """Every head (or the given heads) of these layers, e.g. ``layers(range(3, 6))``."""
        return cls(
            "layers",
            layer_ids=tuple(int(layer) for layer in layers),
            head_ids=None if heads is None else tuple(int(head) for head in heads),
        )

    @classmethod
    def of_type(cls, name: str) -> HeadSelection:
        """The heads assigned this type."""
        return cls("types", type_names=(name,))

    @classmethod
    def of_types(cls, names: Iterable[str]) -> HeadSelection:
        """The heads assigned any of these types."""
        return cls("types", type_names=tuple(names))

    @classmethod
    def all_but(cls, names: str | Iterable[str]) -> HeadSelection:
        """Every assigned head whose type is not among ``names`` ("all types but one")."""
        return cls("all_but_types", type_names=(names,) if isinstance(names, str) else tuple(names))

    @classmethod
    def all_heads(cls) -> HeadSelection:
        """Every head of the model."""
        return cls("all")

    def __or__(self, other: HeadSelection) -> HeadSelection:
        return HeadSelection("union", parts=(self, other))

    @property
    def uses_types(self) -> bool:
        if self.kind == "union":
            return any(part.uses_types for part in self.parts)
        return self.kind in ("types", "all_but_types")

    def resolve(
        self,
        assignments: Assignments | None,
        num_layers: int,
        num_heads: int,
        *,
        allow_empty: bool = False,
    ) -> frozenset[Head]:
        """The selected ``(layer, head)`` pairs; raises :class:`AblationSpecError` on bad input."""
        if self.kind == "union":
            chosen: set[Head] = set()
            for part in self.parts:
                chosen |= part.resolve(assignments, num_layers, num_heads, allow_empty=allow_empty)
            return frozenset(chosen)
        if self.kind == "all":
            return frozenset((layer, head) for layer in range(num_layers) for head in range(num_heads))
        if self.kind == "heads":
            for layer, head in self.pairs:
                _check_head(layer, head, num_layers, num_heads)
            return frozenset(self.pairs)
        if self.kind == "layers":
            for layer in self.layer_ids:
                _check_layer(layer, num_layers)
            heads = range(num_heads) if self.head_ids is None else self.head_ids
            for head in heads:
                _check_head(0, head, num_layers, num_heads)
            chosen_pairs = frozenset((layer, head) for layer in self.layer_ids for head in heads)
            if not chosen_pairs and not allow_empty:
                raise AblationSpecError("the layer selection is empty")
            return chosen_pairs
        # by type
        if assignments is None:
            raise AblationSpecError(f"selecting heads by type ({', '.join(self.type_names)}) needs a type assignment")
        _check_assignments(assignments, num_layers, num_heads)
        known = _known_types(assignments)
        unknown = [name for name in self.type_names if name not in known]
        if unknown:
            raise AblationSpecError(
                f"unknown head type(s) {', '.join(map(repr, unknown))}; known types: {', '.join(known)}"
            )
        names = set(self.type_names)
        if self.kind == "types":
            chosen_pairs = frozenset(h for h, t in assignments.items() if t in names)
            what = f"type(s) {', '.join(self.type_names)}"
        else:
            chosen_pairs = frozenset(h for h, t in assignments.items() if t not in names)
            what = f"all types but {', '.join(self.type_names)}"
        if not chosen_pairs and not allow_empty:
            present = sorted(set(assignments.values()))
            raise AblationSpecError(f"{what} select no head; types present: {', '.join(present)}")
        return chosen_pairs

    def to_dict(self) -> dict[str, Any]:
        """JSON-able description (stored with the outcome)."""
        if self.kind == "union":
            return {"union": [part.to_dict() for part in self.parts]}
        if self.kind == "all":
            return {"all": True}
        if self.kind == "heads":
            return {"heads": [list(pair) for pair in self.pairs]}
        if self.kind == "layers":
            out: dict[str, Any] = {"layers": list(self.layer_ids)}
            if self.head_ids is not None:
                out["heads"] = list(self.head_ids)
            return out
        return {self.kind: list(self.type_names)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HeadSelection:
        if "union" in data:
            parts = [cls.from_dict(part) for part in data["union"]]
            out = parts[0]
            for part in parts[1:]:
                out = out | part
            return out
        if data.get("all"):
            return cls.all_heads()
        if "layers" in data:
            return cls.layers(data["layers"], data.get("heads"))
        if "heads" in data:
            return cls.explicit(data["heads"])
        if "types" in data:
            return cls.of_types(data["types"])
        if "all_but_types" in data:
            return cls.all_but(data["all_but_types"])
        raise AblationSpecError(f"not a head selection: {dict(data)!r}")

    def describe(self) -> str:
        """Short human text, e.g. ``dense+vertical`` or ``all but diagonal``."""
        if self.kind == "union":
            return " | ".join(part.describe() for part in self.parts)
        if self.kind == "all":
            return "all heads"
        if self.kind == "heads":
            return ", ".join(f"L{layer}H{head}" for layer, head in self.pairs)
        if self.kind == "layers":
            heads = "" if self.head_ids is None else f" heads {list(self.head_ids)}"
            return f"layers {list(self.layer_ids)}{heads}"
        if self.kind == "types":
            return "+".join(self.type_names)
        return "all but " + "+".join(self.type_names)


SelectionLike: TypeAlias = "HeadSelection | str | Iterable[str] | Iterable[Sequence[int]]"


def as_selection(value: SelectionLike) -> HeadSelection:
    """Coerce the short forms: a type name, a list of type names, a list of ``(layer, head)``."""
    if isinstance(value, HeadSelection):
        return value
    if isinstance(value, str):
        return HeadSelection.of_type(value)
    items: list[Any] = list(value)
    if all(isinstance(item, str) for item in items):
        return HeadSelection.of_types(items)
    if all(isinstance(item, Sequence) and not isinstance(item, str) for item in items):
        return HeadSelection.explicit(items)
    raise AblationSpecError(
        f"cannot read {items!r} as a head selection: give a type name, a list of type names, "
        "a list of (layer, head) pairs or a HeadSelection"
    )


def _check_layer(layer: int, num_layers: int) -> None:
    if not 0 <= layer < num_layers:
        raise AblationSpecError(
            f"layer {layer} is out of range: the model has {num_layers} layers (0-{num_layers - 1})"
        )


def _check_head(layer: int, head: int, num_layers: int, num_heads: int) -> None:
    _check_layer(layer, num_layers)
    if not 0 <= head < num_heads:
        raise AblationSpecError(
            f"head {head} (layer {layer}) is out of range: each layer has {num_heads} heads (0-{num_heads - 1})"
        )


def _check_assignments(assignments: Assignments, num_layers: int, num_heads: int) -> None:
    for key in assignments:
        if not (isinstance(key, tuple) and len(key) == 2):
            raise AblationSpecError(f"assignment keys are (layer, head) pairs, got {key!r}")
        try:
            _check_head(int(key[0]), int(key[1]), num_layers, num_heads)
        except AblationSpecError as error:
            raise AblationSpecError(f"type assignment: {error}") from None


def _known_types(assignments: Assignments) -> list[str]:
    extra = sorted({t for t in assignments.values() if t not in HEAD_TYPES})
    return [*HEAD_TYPES, *extra]


def check_operation(op: str) -> None:
    if op not in OPERATIONS:
        raise AblationSpecError(f"unknown operation {op!r}; operations: {', '.join(OPERATIONS)}")


# --------------------------------------------------------------------------------------------
# The spec
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AblationSpec:
    """What to do to which head: one frozen, validated object (stored with its outcome).

    ``ops`` is the sorted tuple of ``((layer, head), operation)`` items, one per ablated head;
    ``selections`` records how they were chosen (JSON-able, for provenance only).
    """

    num_layers: int
    num_heads: int
    ops: tuple[tuple[Head, Operation], ...] = ()
    renormalize: bool = False
    selections: tuple[tuple[Operation, dict[str, Any]], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.num_heads < 1:
            raise AblationSpecError(f"bad model shape {self.num_layers} layers x {self.num_heads} heads")
        seen: dict[Head, Operation] = {}
        for (layer, head), op in self.ops:
            check_operation(op)
            _check_head(layer, head, self.num_layers, self.num_heads)
            if (layer, head) in seen:
                raise AblationSpecError(
                    f"head ({layer}, {head}) is selected for both {seen[(layer, head)]} and {op}; "
                    "a head gets at most one operation"
                )
            seen[(layer, head)] = op
        object.__setattr__(self, "ops", tuple(sorted(self.ops)))

    # -- constructors ------------------------------------------------------------------------

    @classmethod
    def empty(cls, num_layers: int, num_heads: int) -> AblationSpec:
        """No ablation: the model runs as it is (the baseline)."""
        return cls(num_layers, num_heads)

    @classmethod
    def from_heads(
        cls,
        heads: Mapping[Head, Operation],
        num_layers: int,
        num_heads: int,
        *,
        renormalize: bool = False,
    ) -> AblationSpec:
        """From an explicit ``{(layer, head): operation}`` map."""
        return cls(num_layers, num_heads, tuple((tuple(h), op) for h, op in heads.items()), renormalize)  # type: ignore[misc]

    @classmethod
    def build(
        cls,
        selections: Mapping[Operation, SelectionLike],
        assignments: Assignments | None = None,
        *,
        num_layers: int,
        num_heads: int,
        renormalize: bool = False,
        allow_empty: bool = False,
    ) -> AblationSpec:
        """Compose operations over selections; every row of Guan Tables 2 and 3 is one call.

        ``selections`` maps an operation to a :class:`HeadSelection` or a short form (a type
        name, a list of type names, a list of ``(layer, head)`` pairs). ``assignments`` maps
        ``(layer, head)`` to a type name and is needed for selections by type. A selection that
        picks no head is an error unless ``allow_empty``. Nothing is computed before all of it
        is validated.
        """
        chosen: dict[Head, Operation] = {}
        provenance: list[tuple[Operation, dict[str, Any]]] = []
        for op, value in selections.items():
            check_operation(op)
            selection = as_selection(value)
            heads = selection.resolve(assignments, num_layers, num_heads, allow_empty=allow_empty)
            for head in sorted(heads):
                if head in chosen and chosen[head] != op:
                    raise AblationSpecError(
                        f"head {head} is selected for both {chosen[head]} and {op}; a head gets at most one operation"
                    )
                chosen[head] = op
            provenance.append((op, selection.to_dict()))
        return cls(
            num_layers,
            num_heads,
            tuple(chosen.items()),
            renormalize,
            selections=tuple(provenance),
        )

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        selections: Mapping[Operation, SelectionLike],
        assignments: Assignments | None = None,
        **kw: Any,
    ) -> AblationSpec:
        """:meth:`build` with the layer and head counts read from ``model.config``."""
        num_layers, num_heads = model_shape(model)
        return cls.build(selections, assignments, num_layers=num_layers, num_heads=num_heads, **kw)

    # -- views -------------------------------------------------------------------------------

    @property
    def is_empty(self) -> bool:
        return not self.ops

    @property
    def heads(self) -> dict[Head, Operation]:
        return dict(self.ops)

    @property
    def operations(self) -> frozenset[Operation]:
        return frozenset(op for _, op in self.ops)

    @property
    def needs_segments(self) -> bool:
        return bool(self.operations & SEGMENT_OPERATIONS)

    @property
    def needs_mask(self) -> bool:
        return bool(self.operations - {"prune"})

    def by_layer(self) -> dict[int, list[tuple[Operation, list[int]]]]:
        """``{layer: [(operation, sorted heads), ...]}`` for the layers with anything selected."""
        out: dict[int, dict[Operation, list[int]]] = {}
        for (layer, head), op in self.ops:
            out.setdefault(layer, {}).setdefault(op, []).append(head)
        return {layer: [(op, sorted(heads)) for op, heads in ops.items()] for layer, ops in sorted(out.items())}

    def heads_for(self, op: Operation) -> list[Head]:
        return [head for head, o in self.ops if o == op]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: shape, ``{operation: [[layer, head], ...]}``, renormalize, provenance."""
        ops: dict[str, list[list[int]]] = {}
        for (layer, head), op in self.ops:
            ops.setdefault(op, []).append([layer, head])
        return {
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "renormalize": self.renormalize,
            "ops": ops,
            "selections": dict(self.selections),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AblationSpec:
        items = tuple(
            ((int(layer), int(head)), op) for op, heads in data.get("ops", {}).items() for layer, head in heads
        )
        return cls(
            int(data["num_layers"]),
            int(data["num_heads"]),
            items,
            bool(data.get("renormalize", False)),
            selections=tuple(data.get("selections", {}).items()),
        )


# --------------------------------------------------------------------------------------------
# Segments
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlanRow:
    """One row of an ablation plan: a stable id, a label and operations over head selections."""

    id: str
    label: str
    ops: tuple[tuple[Operation, HeadSelection], ...] = ()
    paper_ref: str | None = None  # e.g. "T2.6" (Guan et al. 2020, Table 2, row 6)

    def to_spec(
        self,
        assignments: Assignments | None,
        *,
        num_layers: int,
        num_heads: int,
        renormalize: bool = False,
    ) -> AblationSpec:
        return AblationSpec.build(
            dict(self.ops), assignments, num_layers=num_layers, num_heads=num_heads, renormalize=renormalize
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "label": self.label,
            "paper_ref": self.paper_ref,
            "ops": {op: selection.to_dict() for op, selection in self.ops},
        }

    @classmethod
    def of(cls, id: str, label: str, selections: Mapping[Operation, SelectionLike], **kw: Any) -> PlanRow:
        for op in selections:
            check_operation(op)
        return cls(id, label, tuple((op, as_selection(sel)) for op, sel in selections.items()), **kw)


_PRETTY = {"dense": "dense", "diagonal": "diagonal", "dense_vertical": "dense&vertical", "vertical": "vertical"}


def _pretty(name: str) -> str:
    return _PRETTY.get(name, name)


def paper_plan(head_types_present: Iterable[str]) -> list[PlanRow]:
    """The rows of Guan et al. (2020) Tables 2 and 3 over the types a clustering has.

    Table 2: baseline (T2.1); prune each type (T2.2-5); prune two types, diagonal always kept
    (T2.6 dense+vertical, T2.7 dense&vertical+vertical, plus dense+dense&vertical, which the
    paper does not report); uniform 1/L for each type (T2.8-11).
    Table 3, upper part: drop intra- or inter-segment attention of one type; lower part: drop it
    for every type but one. Rows that need a type the model lacks are left out.
    """
    present = set(head_types_present)
    rows = [PlanRow("baseline", "Baseline (no ablation)", (), "T2.1")]
    order = [t for t in HEAD_TYPES if t in present]

    for number, t in enumerate(HEAD_TYPES, start=2):
        if t in present:
            rows.append(PlanRow.of(f"prune.{t}", f"Prune {_pretty(t)}", {"prune": [t]}, paper_ref=f"T2.{number}"))
    pairs = [
        (("dense", "vertical"), "T2.6"),
        (("dense_vertical", "vertical"), "T2.7"),
        (("dense", "dense_vertical"), None),
    ]
    for pair, ref in pairs:
        if all(t in present for t in pair):
            label = f"Prune {' + '.join(map(_pretty, pair))}" + ("" if ref else " (not in the paper)")
            rows.append(PlanRow.of(f"prune.{'+'.join(pair)}", label, {"prune": list(pair)}, paper_ref=ref))
    for number, t in enumerate(HEAD_TYPES, start=8):
        if t in present:
            rows.append(
                PlanRow.of(f"uniform.{t}", f"Uniform 1/L for {_pretty(t)}", {"uniform": [t]}, paper_ref=f"T2.{number}")
            )
    drops: tuple[tuple[Operation, str], ...] = (("drop_intra", "intra"), ("drop_inter", "inter"))
    for t in order:
        for op, what in drops:
            rows.append(
                PlanRow.of(
                    f"{op}.{t}", f"Drop {what}-segment attention of {_pretty(t)}", {op: [t]}, paper_ref="T3.upper"
                )
            )
    for t in order:
        if len(order) < 2:
            break
        for op, what in drops:
            rows.append(
                PlanRow.of(
                    f"{op}.all_but.{t}",
                    f"Drop {what}-segment attention of all types but {_pretty(t)}",
                    {op: HeadSelection.all_but(t)},
                    paper_ref="T3.lower",
                )
            )
    return rows
