"""What to ablate, without torch: head selections, ablation specs and the paper's plan.

A head is ``(stack, layer, head)`` (SPEC section 6): ``encoder``, ``decoder`` or ``cross``, layers
counted within their stack. A model's shape is its :data:`Shapes`, ``{stack: (layers, heads)}``
(query heads: grouped key/value heads are ablated per query head).

:class:`HeadSelection` rules (explicit heads, layer ranges, types, "all but" types) resolve over a
head-type assignment into an :class:`AblationSpec`, a validated map ``(stack, layer, head) ->
operation``; :func:`paper_plan` lists the rows of Guan et al.'s Tables 2 and 3 as
:class:`PlanRow`\\ s. The API validates requests with these classes without importing torch;
:mod:`ingest.ablation` applies them.

A selection may name a stack (``HeadSelection.layers([0], stack="decoder")``). One that names
none means **every stack of the model**: ``layers([0])`` of a BART is encoder layer 0, decoder
layer 0 and cross layer 0, and each of its layers and heads must exist in every stack (name a
stack otherwise). For the single-stack models that are most of the catalog this is the old
meaning exactly. Selections by type pick the assigned heads of every stack, or of the named one.
The segment drops (``drop_intra``/``drop_inter``) compare a query's and a key's segment, which
means nothing when they are different sequences: they are refused on the ``cross`` stack, and a
rule naming no stack applies them to the other stacks only.

Single-stack shorthands are kept: ``num_layers=, num_heads=`` is the shape of an encoder, and
``(layer, head)`` pairs (in selections, assignments and :meth:`AblationSpec.from_heads`) are
heads of a model's only stack; with several stacks a pair is ambiguous and refused.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, get_args

from ingest.types import HEAD_TYPES, ROLES, STACKS, Stack

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger(__name__)

Operation = Literal["prune", "uniform", "drop_intra", "drop_inter"]
OPERATIONS: tuple[Operation, ...] = get_args(Operation)
SEGMENT_OPERATIONS: frozenset[Operation] = frozenset({"drop_intra", "drop_inter"})

Head: TypeAlias = tuple[Stack, int, int]  # (stack, layer, head), 0-based, layers within the stack
LayerHead: TypeAlias = tuple[int, int]  # (layer, head) of a single-stack model
Shapes: TypeAlias = Mapping[Stack, tuple[int, int]]  # stack -> (layers, query heads per layer)
Assignments: TypeAlias = "Mapping[Head, str] | Mapping[LayerHead, str]"  # head -> head type name
Roles: TypeAlias = "Mapping[Head, Iterable[str]]"  # head -> its roles (SPEC 10), from a detection run


class AblationSpecError(ValueError):
    """An ablation that cannot be applied: bad operation, type, stack, layer or head, or a conflict."""


# --------------------------------------------------------------------------------------------
# Model shape
# --------------------------------------------------------------------------------------------


def _first_int(config: Any, names: Sequence[str]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def model_shapes(model: nn.Module) -> dict[Stack, tuple[int, int]]:
    """``{stack: (layers, query heads)}`` of a ``transformers`` model, from its config.

    Encoder-decoders (``config.is_encoder_decoder`` and a module with ``is_decoder``) have an
    encoder, a decoder and a cross stack (the decoder's shape); an encoder-decoder's encoder
    loaded alone (``T5EncoderModel``) has its encoder; other models have one stack, ``decoder``
    when their attention modules are causal (GPT-2, Llama...), else ``encoder``. The :class:`~ingest.ablation.Ablator`
    checks every call's stack and head count against the spec too, so a model this reads wrong
    is refused, never silently left unablated.
    """
    config: Any = model.config
    if getattr(config, "is_encoder_decoder", False):
        has_decoder = any(getattr(module, "is_decoder", False) is True for module in model.modules())
        encoder = (
            _first_int(config, ("encoder_layers", "num_layers", "num_hidden_layers")),
            _first_int(config, ("encoder_attention_heads", "num_heads", "num_attention_heads")),
        )
        decoder = (
            _first_int(config, ("decoder_layers", "num_decoder_layers", "num_layers", "num_hidden_layers")),
            _first_int(config, ("decoder_attention_heads", "num_heads", "num_attention_heads")),
        )
        if None in encoder or None in decoder:
            raise AblationSpecError(f"cannot read the stacks of {type(model).__name__} from its config")
        if not has_decoder:
            return {"encoder": encoder}  # type: ignore[dict-item]
        return {"encoder": encoder, "decoder": decoder, "cross": decoder}  # type: ignore[dict-item]
    shape = (int(config.num_hidden_layers), int(config.num_attention_heads))
    causal = any(getattr(module, "is_causal", False) is True for module in model.modules())
    return {"decoder" if causal else "encoder": shape}


def model_shape(model: nn.Module) -> tuple[int, int]:
    """``(num_layers, num_heads)`` of a single-stack model (the first stack of others)."""
    return next(iter(model_shapes(model).values()))


def as_shapes(
    shapes: Shapes | None = None, num_layers: int | None = None, num_heads: int | None = None
) -> dict[Stack, tuple[int, int]]:
    """Normalise a shape: ``shapes`` as given (in STACKS order), or an encoder of ``num_layers x num_heads``."""
    if shapes is None:
        if num_layers is None or num_heads is None:
            raise AblationSpecError("give the model's shapes, or num_layers and num_heads")
        shapes = {"encoder": (num_layers, num_heads)}
    elif num_layers is not None or num_heads is not None:
        raise AblationSpecError("give shapes or num_layers/num_heads, not both")
    unknown = [name for name in shapes if name not in STACKS]
    if unknown:
        raise AblationSpecError(f"unknown stack(s) {', '.join(map(repr, unknown))}; stacks: {', '.join(STACKS)}")
    out: dict[Stack, tuple[int, int]] = {}
    for name in STACKS:
        if name in shapes:
            layers, heads = (int(v) for v in shapes[name])
            if layers < 1 or heads < 1:
                raise AblationSpecError(f"bad {name} shape {layers} layers x {heads} heads")
            out[name] = (layers, heads)
    if not out:
        raise AblationSpecError("a model has at least one stack")
    return out


def describe_shapes(shapes: Shapes) -> str:
    return ", ".join(f"{name} {layers} x {heads}" for name, (layers, heads) in shapes.items())


def check_stack(stack: str, shapes: Shapes) -> Stack:
    if stack not in shapes:
        if stack not in STACKS:
            raise AblationSpecError(f"unknown stack {stack!r}; stacks: {', '.join(STACKS)}")
        raise AblationSpecError(f"the model has no {stack} stack; its stacks: {', '.join(shapes)}")
    return stack  # type: ignore[return-value]


def as_head(item: Sequence[Any], shapes: Shapes) -> Head:
    """``(stack, layer, head)`` from a triple, or from a pair of a single-stack model."""
    if len(item) == 3:
        stack, layer, head = item
        return check_stack(str(stack), shapes), int(layer), int(head)
    if len(item) == 2:
        if len(shapes) != 1:
            raise AblationSpecError(
                f"head {tuple(item)!r} names no stack but the model has {len(shapes)} ({', '.join(shapes)}); "
                "give (stack, layer, head)"
            )
        return next(iter(shapes)), int(item[0]), int(item[1])
    raise AblationSpecError(f"a head is (stack, layer, head) or (layer, head), got {tuple(item)!r}")


def normalize_assignments(assignments: Assignments | None, shapes: Shapes) -> dict[Head, str] | None:
    """Assignments keyed by ``(stack, layer, head)``, every head checked against ``shapes``."""
    if assignments is None:
        return None
    out: dict[Head, str] = {}
    for key, name in assignments.items():
        if not isinstance(key, tuple):
            raise AblationSpecError(f"assignment keys are (stack, layer, head) triples, got {key!r}")
        try:
            head = as_head(key, shapes)
            _check_head(head, shapes)
        except AblationSpecError as error:
            raise AblationSpecError(f"type assignment: {error}") from None
        out[head] = name
    return out


# --------------------------------------------------------------------------------------------
# Selections
# --------------------------------------------------------------------------------------------

SelectionKind = Literal["heads", "layers", "types", "all_but_types", "roles", "all", "union"]
# an explicit head: (layer, head) in the selection's stack(s), or (stack, layer, head)
ExplicitHead: TypeAlias = "tuple[int, int] | tuple[Stack, int, int]"


@dataclass(frozen=True, slots=True)
class HeadSelection:
    """A rule that picks heads, resolved later against a model's shapes and a type assignment.

    Build with the class methods: :meth:`explicit`, :meth:`layers`, :meth:`of_type`,
    :meth:`of_types`, :meth:`all_but`, :meth:`of_role`, :meth:`all_heads`; combine with ``|``.
    ``stack`` limits the rule to one stack; ``None`` means every stack of the model.
    """

    kind: SelectionKind
    pairs: tuple[ExplicitHead, ...] = ()
    layer_ids: tuple[int, ...] = ()
    head_ids: tuple[int, ...] | None = None
    type_names: tuple[str, ...] = ()
    parts: tuple[HeadSelection, ...] = ()
    stack: Stack | None = None

    def __post_init__(self) -> None:
        if self.stack is not None and self.stack not in STACKS:
            raise AblationSpecError(f"unknown stack {self.stack!r}; stacks: {', '.join(STACKS)}")

    @classmethod
    def explicit(cls, heads: Iterable[Sequence[Any]], *, stack: Stack | None = None) -> HeadSelection:
        """These ``(layer, head)`` pairs (of ``stack``, or every stack) or ``(stack, layer, head)`` triples."""
        pairs: list[ExplicitHead] = []
        for item in heads:
            if len(item) == 2:
                pairs.append((int(item[0]), int(item[1])))
            elif len(item) == 3 and isinstance(item[0], str):
                if item[0] not in STACKS:
                    raise AblationSpecError(
                        f"unknown stack {item[0]!r} in head {tuple(item)!r}; stacks: {', '.join(STACKS)}"
                    )
                if stack is not None and item[0] != stack:
                    raise AblationSpecError(f"head {tuple(item)!r} is not in the selection's stack {stack}")
                pairs.append((item[0], int(item[1]), int(item[2])))  # type: ignore[arg-type]
            else:
                raise AblationSpecError(f"a head is a (layer, head) pair or (stack, layer, head), got {tuple(item)!r}")
        return cls("heads", pairs=tuple(pairs), stack=stack)

    @classmethod
    def layers(
        cls, layers: Iterable[int], heads: Iterable[int] | None = None, *, stack: Stack | None = None
    ) -> HeadSelection:
        """Every head (or the given heads) of these layers, e.g. ``layers(range(3, 6), stack="decoder")``."""
        return cls(
            "layers",
            layer_ids=tuple(int(layer) for layer in layers),
            head_ids=None if heads is None else tuple(int(head) for head in heads),
            stack=stack,
        )

    @classmethod
    def of_type(cls, name: str, *, stack: Stack | None = None) -> HeadSelection:
        """The heads assigned this type."""
        return cls("types", type_names=(name,), stack=stack)

    @classmethod
    def of_types(cls, names: Iterable[str], *, stack: Stack | None = None) -> HeadSelection:
        """The heads assigned any of these types."""
        return cls("types", type_names=tuple(names), stack=stack)

    @classmethod
    def all_but(cls, names: str | Iterable[str], *, stack: Stack | None = None) -> HeadSelection:
        """Every assigned head whose type is not among ``names`` ("all types but one")."""
        return cls("all_but_types", type_names=(names,) if isinstance(names, str) else tuple(names), stack=stack)

    @classmethod
    def of_role(cls, names: str | Iterable[str], *, stack: Stack | None = None) -> HeadSelection:
        """The heads with any of these roles (``induction``, ...) in a detection run (SPEC 10)."""
        chosen = (names,) if isinstance(names, str) else tuple(names)
        unknown = [name for name in chosen if name not in ROLES]
        if unknown or not chosen:
            raise AblationSpecError(f"unknown role {unknown[0] if unknown else ''!r}; roles: {', '.join(ROLES)}")
        return cls("roles", type_names=chosen, stack=stack)

    @classmethod
    def all_heads(cls, *, stack: Stack | None = None) -> HeadSelection:
        """Every head of the model (or of one stack)."""
        return cls("all", stack=stack)

    def __or__(self, other: HeadSelection) -> HeadSelection:
        return HeadSelection("union", parts=(self, other))

    @property
    def uses_types(self) -> bool:
        if self.kind == "union":
            return any(part.uses_types for part in self.parts)
        return self.kind in ("types", "all_but_types")

    @property
    def uses_roles(self) -> bool:
        if self.kind == "union":
            return any(part.uses_roles for part in self.parts)
        return self.kind == "roles"

    def _stacks(self, shapes: Shapes) -> list[Stack]:
        if self.stack is None:
            return list(shapes)
        return [check_stack(self.stack, shapes)]

    def resolve(
        self,
        assignments: Assignments | None,
        shapes: Shapes | int,
        num_heads: int | None = None,
        *,
        allow_empty: bool = False,
        roles: Roles | None = None,
    ) -> frozenset[Head]:
        """The selected ``(stack, layer, head)`` triples; raises :class:`AblationSpecError` on bad input.

        ``shapes`` is ``{stack: (layers, heads)}``; ``resolve(assignments, num_layers, num_heads)``
        is the encoder-only shorthand. ``roles`` (head -> roles of a detection run) is needed by
        selections by role.
        """
        shapes = as_shapes(None, shapes, num_heads) if isinstance(shapes, int) else as_shapes(shapes)
        return self._resolve(normalize_assignments(assignments, shapes), shapes, allow_empty, normalize_roles(roles))

    def _resolve(
        self,
        assignments: dict[Head, str] | None,
        shapes: Shapes,
        allow_empty: bool,
        roles: dict[Head, frozenset[str]] | None = None,
    ) -> frozenset[Head]:
        if self.kind == "union":
            chosen: set[Head] = set()
            for part in self.parts:
                chosen |= part._resolve(assignments, shapes, allow_empty, roles)
            return frozenset(chosen)
        stacks = self._stacks(shapes)
        if self.kind == "roles":
            if roles is None:
                raise AblationSpecError(
                    f"selecting heads by role ({', '.join(self.type_names)}) needs a detection run of the model"
                )
            wanted = set(self.type_names)
            picked = frozenset(h for h, have in roles.items() if h[0] in stacks and have & wanted)
            for picked_head in picked:
                _check_head(picked_head, shapes)
            if not picked and not allow_empty:
                where = "" if self.stack is None else f" of the {self.stack} stack"
                raise AblationSpecError(f"role(s) {', '.join(self.type_names)} select no head{where}")
            return picked
        if self.kind == "all":
            return frozenset(
                (stack, layer, head)
                for stack in stacks
                for layer in range(shapes[stack][0])
                for head in range(shapes[stack][1])
            )
        if self.kind == "heads":
            heads: set[Head] = set()
            for item in self.pairs:
                if len(item) == 3:
                    triple: Head = (check_stack(item[0], shapes), item[1], item[2])  # type: ignore[misc]
                    _check_head(triple, shapes)
                    heads.add(triple)
                else:
                    for stack in stacks:
                        triple = (stack, item[0], item[1])  # type: ignore[assignment]
                        _check_head(triple, shapes, every=self.stack is None and len(shapes) > 1)
                        heads.add(triple)
            return frozenset(heads)
        if self.kind == "layers":
            chosen_heads: set[Head] = set()
            every = self.stack is None and len(shapes) > 1
            for stack in stacks:
                num_layers, count = shapes[stack]
                for layer in self.layer_ids:
                    _check_head((stack, layer, 0), shapes, every=every)
                ids = range(count) if self.head_ids is None else self.head_ids
                for head in ids:
                    _check_head((stack, 0, head), shapes, every=every)
                chosen_heads |= {(stack, layer, head) for layer in self.layer_ids for head in ids}
            if not chosen_heads and not allow_empty:
                raise AblationSpecError("the layer selection is empty")
            return frozenset(chosen_heads)
        # by type
        if assignments is None:
            raise AblationSpecError(f"selecting heads by type ({', '.join(self.type_names)}) needs a type assignment")
        known = _known_types(assignments)
        unknown = [name for name in self.type_names if name not in known]
        if unknown:
            raise AblationSpecError(
                f"unknown head type(s) {', '.join(map(repr, unknown))}; known types: {', '.join(known)}"
            )
        names = set(self.type_names)
        in_stacks = {h: t for h, t in assignments.items() if h[0] in stacks}
        if self.kind == "types":
            chosen_pairs = frozenset(h for h, t in in_stacks.items() if t in names)
            what = f"type(s) {', '.join(self.type_names)}"
        else:
            chosen_pairs = frozenset(h for h, t in in_stacks.items() if t not in names)
            what = f"all types but {', '.join(self.type_names)}"
        if not chosen_pairs and not allow_empty:
            present = sorted(set(in_stacks.values()))
            where = "" if self.stack is None else f" of the {self.stack} stack"
            raise AblationSpecError(f"{what} select no head{where}; types present: {', '.join(present) or 'none'}")
        return chosen_pairs

    def to_dict(self) -> dict[str, Any]:
        """JSON-able description (stored with the outcome); ``stack`` only when the rule names one."""
        if self.kind == "union":
            return {"union": [part.to_dict() for part in self.parts]}
        out: dict[str, Any]
        if self.kind == "all":
            out = {"all": True}
        elif self.kind == "heads":
            out = {"heads": [list(pair) for pair in self.pairs]}
        elif self.kind == "layers":
            out = {"layers": list(self.layer_ids)}
            if self.head_ids is not None:
                out["heads"] = list(self.head_ids)
        else:
            out = {self.kind: list(self.type_names)}
        if self.stack is not None:
            out["stack"] = self.stack
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HeadSelection:
        if "union" in data:
            parts = [cls.from_dict(part) for part in data["union"]]
            out = parts[0]
            for part in parts[1:]:
                out = out | part
            return out
        stack = data.get("stack")
        if stack is not None and stack not in STACKS:
            raise AblationSpecError(f"unknown stack {stack!r}; stacks: {', '.join(STACKS)}")
        if data.get("all"):
            return cls.all_heads(stack=stack)
        if "layers" in data:
            return cls.layers(data["layers"], data.get("heads"), stack=stack)
        if "heads" in data:
            return cls.explicit(data["heads"], stack=stack)
        if "types" in data:
            return cls.of_types(data["types"], stack=stack)
        if "all_but_types" in data:
            return cls.all_but(data["all_but_types"], stack=stack)
        if "roles" in data:
            return cls.of_role(data["roles"], stack=stack)
        raise AblationSpecError(f"not a head selection: {dict(data)!r}")

    def describe(self) -> str:
        """Short human text, e.g. ``dense+vertical``, ``all but diagonal`` or ``decoder: layers [0]``."""
        if self.kind == "union":
            return " | ".join(part.describe() for part in self.parts)
        prefix = "" if self.stack is None else f"{self.stack}: "
        if self.kind == "all":
            return f"{prefix}all heads"
        if self.kind == "heads":
            return prefix + ", ".join(
                f"{item[0]} L{item[1]}H{item[2]}" if len(item) == 3 else f"L{item[0]}H{item[1]}" for item in self.pairs
            )
        if self.kind == "layers":
            heads = "" if self.head_ids is None else f" heads {list(self.head_ids)}"
            return f"{prefix}layers {list(self.layer_ids)}{heads}"
        if self.kind == "types":
            return prefix + "+".join(self.type_names)
        if self.kind == "roles":
            return prefix + "role:" + "+".join(self.type_names)
        return f"{prefix}all but " + "+".join(self.type_names)


SelectionLike: TypeAlias = "HeadSelection | str | Iterable[str] | Iterable[Sequence[Any]]"


ROLE_PREFIX = "role:"


def normalize_roles(roles: Roles | None) -> dict[Head, frozenset[str]] | None:
    """Roles keyed by ``(stack, layer, head)`` as frozen sets; an unknown role is refused."""
    if roles is None:
        return None
    out: dict[Head, frozenset[str]] = {}
    for head, names in roles.items():
        have = frozenset(names)
        unknown = sorted(have - set(ROLES))
        if unknown:
            raise AblationSpecError(f"unknown role {unknown[0]!r} of head {head!r}; roles: {', '.join(ROLES)}")
        out[head] = have
    return out


def as_selection(value: SelectionLike) -> HeadSelection:
    """Coerce the short forms: a type name, ``role:induction`` (``role:a+b``: either), a list of type
    names, a list of ``(layer, head)`` pairs (every stack) or ``(stack, layer, head)`` triples."""
    if isinstance(value, HeadSelection):
        return value
    if isinstance(value, str):
        if value.startswith(ROLE_PREFIX):
            return HeadSelection.of_role(value.removeprefix(ROLE_PREFIX).split("+"))
        return HeadSelection.of_type(value)
    items: list[Any] = list(value)
    if all(isinstance(item, str) for item in items):
        return HeadSelection.of_types(items)
    if all(isinstance(item, Sequence) and not isinstance(item, str) for item in items):
        return HeadSelection.explicit(items)
    raise AblationSpecError(
        f"cannot read {items!r} as a head selection: give a type name, a list of type names, "
        "a list of (layer, head) pairs or (stack, layer, head) triples, or a HeadSelection"
    )


def _check_head(head: Head, shapes: Shapes, *, every: bool = False) -> None:
    """Raise unless ``head`` exists; ``every``: the rule names no stack, so say to name one."""
    stack, layer, index = head
    num_layers, num_heads = shapes[stack]
    hint = "; the rule names no stack, so it applies to every stack: name one (e.g. encoder:...)" if every else ""
    where = f"the {stack} stack has" if len(shapes) > 1 else "the model has"
    if not 0 <= layer < num_layers:
        raise AblationSpecError(
            f"layer {layer} is out of range: {where} {num_layers} layers (0-{num_layers - 1}){hint}"
        )
    if not 0 <= index < num_heads:
        raise AblationSpecError(
            f"head {index} (layer {layer}) is out of range: each layer of {stack if len(shapes) > 1 else 'the model'} "
            f"has {num_heads} heads (0-{num_heads - 1}){hint}"
        )


def _known_types(assignments: Mapping[Head, str]) -> list[str]:
    extra = sorted({t for t in assignments.values() if t not in HEAD_TYPES})
    return [*HEAD_TYPES, *extra]


def check_operation(op: str) -> None:
    if op not in OPERATIONS:
        raise AblationSpecError(f"unknown operation {op!r}; operations: {', '.join(OPERATIONS)}")


# --------------------------------------------------------------------------------------------
# The spec
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, init=False)
class AblationSpec:
    """What to do to which head: one frozen, validated object (stored with its outcome).

    ``shapes`` is the model's ``((stack, layers, heads), ...)``; ``ops`` the sorted tuple of
    ``((stack, layer, head), operation)`` items, one per ablated head; ``selections`` records how
    they were chosen (JSON-able, for provenance only). ``AblationSpec(num_layers, num_heads, ops)``
    with ``(layer, head)`` keys is the encoder-only shorthand.
    """

    shapes: tuple[tuple[Stack, int, int], ...]
    ops: tuple[tuple[Head, Operation], ...]
    renormalize: bool
    selections: tuple[tuple[Operation, dict[str, Any]], ...] = field(compare=False)

    def __init__(
        self,
        shapes: Shapes | int,
        num_heads: int | None = None,
        ops: Iterable[tuple[Sequence[Any], Operation]] = (),
        renormalize: bool = False,
        *,
        selections: Iterable[tuple[Operation, dict[str, Any]]] = (),
    ) -> None:
        normalized = as_shapes(None, shapes, num_heads) if isinstance(shapes, int) else as_shapes(shapes)
        seen: dict[Head, Operation] = {}
        for key, op in ops:
            check_operation(op)
            head = as_head(key, normalized)
            _check_head(head, normalized)
            if op in SEGMENT_OPERATIONS and head[0] == "cross":
                raise AblationSpecError(
                    f"{op} compares the segments of a query and a key; cross attention's queries and keys "
                    "are different sequences, so it is not defined on the cross stack"
                )
            if head in seen:
                raise AblationSpecError(
                    f"head {_name(head, normalized)} is selected for both {seen[head]} and {op}; "
                    "a head gets at most one operation"
                )
            seen[head] = op
        object.__setattr__(self, "shapes", tuple((name, *shape) for name, shape in normalized.items()))
        object.__setattr__(self, "ops", tuple(sorted(seen.items(), key=lambda item: _order(item[0]))))
        object.__setattr__(self, "renormalize", bool(renormalize))
        object.__setattr__(self, "selections", tuple(selections))

    # -- constructors ------------------------------------------------------------------------

    @classmethod
    def empty(
        cls, num_layers: int | None = None, num_heads: int | None = None, *, shapes: Shapes | None = None
    ) -> AblationSpec:
        """No ablation: the model runs as it is (the baseline)."""
        return cls(as_shapes(shapes, num_layers, num_heads))

    @classmethod
    def from_heads(
        cls,
        heads: Mapping[Any, Operation],
        num_layers: int | None = None,
        num_heads: int | None = None,
        *,
        shapes: Shapes | None = None,
        renormalize: bool = False,
    ) -> AblationSpec:
        """From an explicit ``{(stack, layer, head): operation}`` (or ``(layer, head)``) map."""
        return cls(as_shapes(shapes, num_layers, num_heads), None, tuple(heads.items()), renormalize)

    @classmethod
    def build(
        cls,
        selections: Mapping[Operation, SelectionLike],
        assignments: Assignments | None = None,
        *,
        shapes: Shapes | None = None,
        num_layers: int | None = None,
        num_heads: int | None = None,
        renormalize: bool = False,
        allow_empty: bool = False,
        roles: Roles | None = None,
    ) -> AblationSpec:
        """Compose operations over selections; every row of Guan Tables 2 and 3 is one call.

        ``selections`` maps an operation to a :class:`HeadSelection` or a short form (a type
        name, a list of type names, a list of heads). ``assignments`` maps heads to type names
        and is needed for selections by type; ``roles`` (head -> roles) for selections by role.
        ``shapes`` is ``{stack: (layers, heads)}`` (``num_layers``/``num_heads``: an encoder). A
        selection that picks no head is an error unless ``allow_empty``. Nothing is computed before
        all of it is validated.
        """
        model = as_shapes(shapes, num_layers, num_heads)
        typed = normalize_assignments(assignments, model)
        roled = normalize_roles(roles)
        chosen: dict[Head, Operation] = {}
        provenance: list[tuple[Operation, dict[str, Any]]] = []
        for op, value in selections.items():
            check_operation(op)
            selection = as_selection(value)
            heads = selection._resolve(typed, model, allow_empty, roled)
            if op in SEGMENT_OPERATIONS and not _names_stack(selection, "cross"):
                heads = frozenset(head for head in heads if head[0] != "cross")  # "every stack" it is defined on
            for head in sorted(heads, key=_order):
                if head in chosen and chosen[head] != op:
                    raise AblationSpecError(
                        f"head {_name(head, model)} is selected for both {chosen[head]} and {op}; "
                        "a head gets at most one operation"
                    )
                chosen[head] = op
            provenance.append((op, selection.to_dict()))
        return cls(model, None, tuple(chosen.items()), renormalize, selections=tuple(provenance))

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        selections: Mapping[Operation, SelectionLike],
        assignments: Assignments | None = None,
        **kw: Any,
    ) -> AblationSpec:
        """:meth:`build` with the stacks read from ``model.config`` (:func:`model_shapes`)."""
        return cls.build(selections, assignments, shapes=model_shapes(model), **kw)

    # -- views -------------------------------------------------------------------------------

    @property
    def stack_shapes(self) -> dict[Stack, tuple[int, int]]:
        return {name: (layers, heads) for name, layers, heads in self.shapes}

    @property
    def num_layers(self) -> int:
        """Layers of the first stack (of the only one for single-stack models)."""
        return self.shapes[0][1]

    @property
    def num_heads(self) -> int:
        return self.shapes[0][2]

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

    def by_layer(self) -> dict[tuple[Stack, int], list[tuple[Operation, list[int]]]]:
        """``{(stack, layer): [(operation, sorted heads), ...]}`` for the layers with anything selected."""
        out: dict[tuple[Stack, int], dict[Operation, list[int]]] = {}
        for (stack, layer, head), op in self.ops:
            out.setdefault((stack, layer), {}).setdefault(op, []).append(head)
        return {
            key: [(op, sorted(heads)) for op, heads in ops.items()]
            for key, ops in sorted(out.items(), key=lambda item: (STACKS.index(item[0][0]), item[0][1]))
        }

    def heads_for(self, op: Operation) -> list[Head]:
        return [head for head, o in self.ops if o == op]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: stacks, ``{operation: [[stack, layer, head], ...]}``, renormalize, provenance.

        ``num_layers``/``num_heads`` (the first stack) are kept for readers of single-stack specs.
        """
        ops: dict[str, list[list[Any]]] = {}
        for (stack, layer, head), op in self.ops:
            ops.setdefault(op, []).append([stack, layer, head])
        return {
            "stacks": {name: [layers, heads] for name, layers, heads in self.shapes},
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "renormalize": self.renormalize,
            "ops": ops,
            "selections": dict(self.selections),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AblationSpec:
        """From :meth:`to_dict`; a stored spec without ``stacks`` (before stacks) is an encoder's."""
        if "stacks" in data:
            shapes = as_shapes({name: tuple(shape) for name, shape in data["stacks"].items()})
        else:
            shapes = as_shapes(None, int(data["num_layers"]), int(data["num_heads"]))
        items = tuple((tuple(head), op) for op, heads in data.get("ops", {}).items() for head in heads)
        return cls(
            shapes,
            None,
            items,
            bool(data.get("renormalize", False)),
            selections=tuple(data.get("selections", {}).items()),
        )


def _names_stack(selection: HeadSelection, stack: Stack) -> bool:
    """Whether the rule names ``stack`` itself (not just "every stack")."""
    if selection.kind == "union":
        return any(_names_stack(part, stack) for part in selection.parts)
    return selection.stack == stack or any(len(item) == 3 and item[0] == stack for item in selection.pairs)


def _order(head: Head) -> tuple[int, int, int]:
    return STACKS.index(head[0]), head[1], head[2]


def _name(head: Head, shapes: Shapes) -> str:
    """``(0, 3)`` for single-stack models (as before stacks), ``(decoder, 0, 3)`` otherwise."""
    stack, layer, index = head
    return f"({layer}, {index})" if len(shapes) == 1 else f"({stack}, {layer}, {index})"


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
        shapes: Shapes | None = None,
        num_layers: int | None = None,
        num_heads: int | None = None,
        renormalize: bool = False,
        roles: Roles | None = None,
    ) -> AblationSpec:
        """The row over a model of ``shapes`` (``num_layers``/``num_heads``: an encoder); ``roles`` for
        selections by role."""
        return AblationSpec.build(
            dict(self.ops),
            assignments,
            shapes=shapes,
            num_layers=num_layers,
            num_heads=num_heads,
            renormalize=renormalize,
            roles=roles,
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
