"""The selection grammar of ``ingest.selection`` without torch: shapes, head rules, specs, the paper plan.

Every expected head set below is written out by hand from the grammar (README "Ablations", SPEC
section 6); every expected error names the bad field. The models of :func:`model_shapes` are
duck-typed stand-ins (a config and the flags of its attention modules), which is all it reads.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ingest.selection import (
    AblationSpec,
    AblationSpecError,
    Head,
    HeadSelection,
    PlanRow,
    _check_head,
    _known_types,
    _name,
    _names_stack,
    _order,
    _pretty,
    as_head,
    as_selection,
    as_shapes,
    check_operation,
    check_stack,
    describe_shapes,
    model_shape,
    model_shapes,
    normalize_assignments,
    paper_plan,
)
from ingest.types import Stack

BART: dict[Stack, tuple[int, int]] = {
    "encoder": (2, 3),
    "decoder": (1, 2),
    "cross": (1, 2),
}  # stacks of different shapes


class _Model:
    """What :func:`model_shapes` reads: ``config`` and ``modules()`` with their flags."""

    def __init__(self, config: dict[str, Any], *modules: dict[str, Any]) -> None:
        self.config = SimpleNamespace(**config)
        self._modules = [SimpleNamespace(**flags) for flags in modules]

    def modules(self) -> Any:
        return iter(self._modules)


def _model(config: dict[str, Any], *modules: dict[str, Any]) -> Any:
    return _Model(config, *modules)


def _err(match: str) -> Any:
    return pytest.raises(AblationSpecError, match=match)


# --------------------------------------------------------------------------------------------
# Model shape
# --------------------------------------------------------------------------------------------


def test_model_shapes_reads_the_most_specific_config_names_first() -> None:
    # every fallback name holds a different value, so a wrong order picks a wrong number
    decoys = {"num_layers": 7, "num_heads": 11, "num_hidden_layers": 13, "num_attention_heads": 17}
    bart = {"is_encoder_decoder": True, "encoder_layers": 2, "encoder_attention_heads": 3, **decoys}
    bart |= {"decoder_layers": 4, "decoder_attention_heads": 5, "num_decoder_layers": 19}
    model = _model(bart, {"is_decoder": False}, {"is_decoder": True})
    assert model_shapes(model) == {"encoder": (2, 3), "decoder": (4, 5), "cross": (4, 5)}
    assert list(model_shapes(model)) == ["encoder", "decoder", "cross"]
    assert model_shape(model) == (2, 3)  # the first stack
    # T5's names: num_layers/num_heads, num_decoder_layers
    t5 = {"is_encoder_decoder": True, "num_layers": 2, "num_heads": 3, "num_decoder_layers": 4}
    t5 |= {"num_hidden_layers": 13, "num_attention_heads": 17}
    assert model_shapes(_model(t5, {"is_decoder": True})) == {"encoder": (2, 3), "decoder": (4, 3), "cross": (4, 3)}
    # only the generic names
    generic = {"is_encoder_decoder": True, "num_hidden_layers": 2, "num_attention_heads": 3}
    assert model_shapes(_model(generic, {"is_decoder": True})) == {
        "encoder": (2, 3),
        "decoder": (2, 3),
        "cross": (2, 3),
    }


def test_model_shapes_skips_values_that_are_not_counts() -> None:
    # a bool is an int to Python but no layer count; a string or None is skipped too
    config = {"is_encoder_decoder": True, "encoder_layers": True, "num_layers": "9", "num_hidden_layers": 2}
    config |= {"encoder_attention_heads": None, "num_heads": 3, "decoder_layers": False, "num_decoder_layers": 4}
    assert model_shapes(_model(config, {"is_decoder": True})) == {"encoder": (2, 3), "decoder": (4, 3), "cross": (4, 3)}


def test_model_shapes_of_an_encoder_decoder_without_a_decoder_module() -> None:
    config = {"is_encoder_decoder": True, "num_layers": 2, "num_heads": 3, "num_decoder_layers": 4}
    assert model_shapes(_model(config, {"is_decoder": False}, {})) == {"encoder": (2, 3)}  # T5EncoderModel
    assert model_shapes(_model(config, {"is_decoder": 1})) == {"encoder": (2, 3)}  # only True counts


@pytest.mark.parametrize(
    "missing", ["encoder_layers", "encoder_attention_heads", "decoder_layers", "decoder_attention_heads"]
)
def test_model_shapes_refuses_an_unreadable_encoder_decoder(missing: str) -> None:
    config = {"is_encoder_decoder": True, "encoder_layers": 2, "encoder_attention_heads": 3}
    config |= {"decoder_layers": 4, "decoder_attention_heads": 5}
    del config[missing]
    with _err(r"^cannot read the stacks of _Model from its config$"):
        model_shapes(_model(config, {"is_decoder": True}))


def test_model_shapes_of_single_stack_models() -> None:
    bert = {"num_hidden_layers": "2", "num_attention_heads": "3", "num_layers": 7, "num_heads": 11}
    shapes = model_shapes(_model(bert, {"is_causal": False}, {}))
    assert shapes == {"encoder": (2, 3)}
    assert all(type(v) is int for v in shapes["encoder"])
    assert model_shapes(_model(bert, {"is_causal": True})) == {"decoder": (2, 3)}
    assert model_shapes(_model(bert, {"is_causal": 1})) == {"encoder": (2, 3)}  # only True counts
    assert model_shapes(_model({**bert, "is_encoder_decoder": False}, {"is_decoder": True})) == {"encoder": (2, 3)}
    assert model_shape(_model(bert)) == (2, 3)


def test_as_shapes_normalises_and_names_the_bad_field() -> None:
    assert as_shapes(None, 2, 3) == {"encoder": (2, 3)}
    shapes = as_shapes({"cross": ("1", "2"), "encoder": (3, 4)})  # type: ignore[dict-item]
    assert list(shapes) == ["encoder", "cross"]
    assert shapes["cross"] == (1, 2)
    assert type(shapes["cross"][0]) is int
    assert as_shapes({"decoder": (1, 1)}) == {"decoder": (1, 1)}  # the smallest shape is fine
    with _err(r"^give the model's shapes, or num_layers and num_heads$"):
        as_shapes(None, 2, None)
    with _err(r"^give the model's shapes, or num_layers and num_heads$"):
        as_shapes(None, None, 3)
    with _err(r"^give shapes or num_layers/num_heads, not both$"):
        as_shapes({"encoder": (2, 3)}, None, 3)
    with _err(r"^give shapes or num_layers/num_heads, not both$"):
        as_shapes({"encoder": (2, 3)}, 2, None)
    with _err(r"^unknown stack\(s\) 'foo', 'bar'; stacks: encoder, decoder, cross$"):
        as_shapes({"encoder": (2, 3), "foo": (1, 1), "bar": (1, 1)})  # type: ignore[dict-item]
    with _err(r"^bad decoder shape 0 layers x 3 heads$"):
        as_shapes({"encoder": (2, 3), "decoder": (0, 3)})
    with _err(r"^bad encoder shape 2 layers x 0 heads$"):
        as_shapes({"encoder": (2, 0)})
    with _err(r"^a model has at least one stack$"):
        as_shapes({})


def test_describe_shapes_and_check_stack() -> None:
    assert describe_shapes({"encoder": (2, 3), "decoder": (4, 5)}) == "encoder 2 x 3, decoder 4 x 5"
    assert check_stack("cross", BART) == "cross"
    with _err(r"^unknown stack 'foo'; stacks: encoder, decoder, cross$"):
        check_stack("foo", BART)
    with _err(r"^the model has no decoder stack; its stacks: encoder, cross$"):
        check_stack("decoder", {"encoder": (1, 1), "cross": (1, 1)})


def test_as_head_and_normalize_assignments() -> None:
    assert as_head(("decoder", "0", "1"), BART) == ("decoder", 0, 1)
    assert type(as_head(("decoder", "0", "1"), BART)[2]) is int
    assert as_head(["1", "2"], {"decoder": (3, 3)}) == ("decoder", 1, 2)
    assert [type(v) for v in as_head(["1", "2"], {"decoder": (3, 3)})] == [str, int, int]
    with _err(
        r"^head \(0, 1\) names no stack but the model has 3 \(encoder, decoder, cross\); give \(stack, layer, head\)$"
    ):
        as_head((0, 1), BART)
    with _err(r"^a head is \(stack, layer, head\) or \(layer, head\), got \(1, 2, 3, 4\)$"):
        as_head([1, 2, 3, 4], BART)
    with _err(r"^unknown stack 'x'"):
        as_head(("x", 0, 0), BART)

    assert normalize_assignments(None, BART) is None
    assert normalize_assignments({(1, 2): "dense"}, {"encoder": (2, 3)}) == {("encoder", 1, 2): "dense"}
    assert normalize_assignments({("cross", 0, 1): "odd"}, BART) == {("cross", 0, 1): "odd"}
    with _err(r"^assignment keys are \(stack, layer, head\) triples, got 5$"):
        normalize_assignments({5: "dense"}, BART)  # type: ignore[arg-type]
    with _err(r"^type assignment: layer 2 is out of range: the model has 2 layers \(0-1\)$") as info:
        normalize_assignments({(2, 0): "dense"}, {"encoder": (2, 3)})
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__
    with _err(r"^type assignment: head \(0, 1\) names no stack"):
        normalize_assignments({(0, 1): "dense"}, BART)


def test_check_head_bounds_and_messages() -> None:
    for head in [("encoder", 0, 0), ("encoder", 1, 2), ("decoder", 0, 1)]:
        _check_head(head, BART)  # type: ignore[arg-type]
    with _err(r"^layer 2 is out of range: the encoder stack has 2 layers \(0-1\)$"):
        _check_head(("encoder", 2, 0), BART)
    with _err(r"^layer -1 is out of range: the model has 2 layers \(0-1\)$"):
        _check_head(("encoder", -1, 0), {"encoder": (2, 3)})
    hint = "; the rule names no stack, so it applies to every stack: name one (e.g. encoder:...)"
    with _err(r"^head 2 \(layer 0\) is out of range: each layer of decoder has 2 heads \(0-1\)" + _re(hint) + "$"):
        _check_head(("decoder", 0, 2), BART, every=True)
    with _err(r"^head -1 \(layer 1\) is out of range: each layer of the model has 3 heads \(0-2\)$"):
        _check_head(("encoder", 1, -1), {"encoder": (2, 3)})
    with _err(r"^layer 1 is out of range: the decoder stack has 1 layers \(0-0\)" + _re(hint) + "$"):
        _check_head(("decoder", 1, 0), BART, every=True)


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_known_types_and_operations() -> None:
    assert _known_types({("encoder", 0, 0): "zeta", ("encoder", 0, 1): "alpha", ("encoder", 0, 2): "dense"}) == [
        "dense",
        "diagonal",
        "dense_vertical",
        "vertical",
        "alpha",
        "zeta",
    ]
    for op in ["prune", "uniform", "drop_intra", "drop_inter"]:
        check_operation(op)
    with _err(r"^unknown operation 'mask'; operations: prune, uniform, drop_intra, drop_inter$"):
        check_operation("mask")


# --------------------------------------------------------------------------------------------
# Head selections
# --------------------------------------------------------------------------------------------


def test_selection_constructors_keep_what_they_are_given() -> None:
    sel = HeadSelection.explicit([("1", "2"), ("decoder", "0", "1")], stack="decoder")
    assert (sel.kind, sel.pairs, sel.stack) == ("heads", ((1, 2), ("decoder", 0, 1)), "decoder")
    assert HeadSelection.explicit([(0, 1)]).stack is None
    lay = HeadSelection.layers(["0", 2], ["1"], stack="cross")  # type: ignore[list-item]
    assert (lay.kind, lay.layer_ids, lay.head_ids, lay.stack) == ("layers", (0, 2), (1,), "cross")
    assert HeadSelection.layers(range(2)).head_ids is None
    assert HeadSelection.layers([0]).stack is None
    one = HeadSelection.of_type("dense", stack="encoder")
    assert (one.kind, one.type_names, one.stack) == ("types", ("dense",), "encoder")
    assert HeadSelection.of_type("dense").stack is None
    many = HeadSelection.of_types(iter(["dense", "vertical"]), stack="decoder")
    assert (many.kind, many.type_names, many.stack) == ("types", ("dense", "vertical"), "decoder")
    assert HeadSelection.of_types(["dense"]).stack is None
    but = HeadSelection.all_but("dense_vertical", stack="encoder")
    assert (but.kind, but.type_names, but.stack) == ("all_but_types", ("dense_vertical",), "encoder")
    assert HeadSelection.all_but(["dense", "vertical"]).type_names == ("dense", "vertical")
    assert HeadSelection.all_but("dense").stack is None
    assert (HeadSelection.all_heads(stack="cross").kind, HeadSelection.all_heads(stack="cross").stack) == (
        "all",
        "cross",
    )
    assert HeadSelection.all_heads().stack is None
    union = lay | one
    assert (union.kind, union.parts, union.stack) == ("union", (lay, one), None)
    assert union.uses_types
    assert but.uses_types
    assert not (lay | sel).uses_types
    assert not HeadSelection.all_heads().uses_types


def test_selection_constructors_name_the_bad_field() -> None:
    with _err(r"^unknown stack 'middle'; stacks: encoder, decoder, cross$"):
        HeadSelection("all", stack="middle")  # type: ignore[arg-type]
    with _err(r"^unknown stack 'middle' in head \('middle', 0, 1\); stacks: encoder, decoder, cross$"):
        HeadSelection.explicit([("middle", 0, 1)])
    with _err(r"^head \('encoder', 0, 1\) is not in the selection's stack decoder$"):
        HeadSelection.explicit([("encoder", 0, 1)], stack="decoder")
    with _err(r"^a head is a \(layer, head\) pair or \(stack, layer, head\), got \(0, 1, 2\)$"):
        HeadSelection.explicit([(0, 1, 2)])
    with _err(r"^a head is a \(layer, head\) pair or \(stack, layer, head\), got \(0,\)$"):
        HeadSelection.explicit([(0,)])


def test_resolve_all_and_explicit_heads() -> None:
    enc = [("encoder", layer, h) for layer in range(2) for h in range(3)]
    assert HeadSelection.all_heads().resolve(None, BART) == {
        *enc,
        ("decoder", 0, 0),
        ("decoder", 0, 1),
        ("cross", 0, 0),
        ("cross", 0, 1),
    }
    assert HeadSelection.all_heads(stack="encoder").resolve(None, BART) == set(enc)
    assert HeadSelection.all_heads().resolve(None, 2, 3) == set(enc)  # the encoder shorthand
    with _err(r"^the model has no decoder stack"):
        HeadSelection.all_heads(stack="decoder").resolve(None, 2, 3)
    # a pair applies to every stack, a triple to its own
    sel = HeadSelection.explicit([(0, 1), ("encoder", 1, 2)])
    assert sel.resolve(None, BART) == {("encoder", 0, 1), ("decoder", 0, 1), ("cross", 0, 1), ("encoder", 1, 2)}
    assert HeadSelection.explicit([(0, 1)], stack="cross").resolve(None, BART) == {("cross", 0, 1)}
    hint = _re("; the rule names no stack, so it applies to every stack: name one (e.g. encoder:...)")
    with _err(r"^layer 1 is out of range: the decoder stack has 1 layers \(0-0\)" + hint + "$"):
        HeadSelection.explicit([(1, 0)]).resolve(None, BART)  # fine in the encoder, not in the decoder
    with _err(r"^layer 1 is out of range: the decoder stack has 1 layers \(0-0\)$"):
        HeadSelection.explicit([(1, 0)], stack="decoder").resolve(None, BART)
    with _err(r"^layer 1 is out of range: the model has 1 layers \(0-0\)$"):
        HeadSelection.explicit([(1, 0)]).resolve(None, {"decoder": (1, 2)})
    with _err(r"^head 3 \(layer 0\) is out of range: each layer of encoder has 3 heads \(0-2\)$"):
        HeadSelection.explicit([("encoder", 0, 3)]).resolve(None, BART)
    with _err(r"^the model has no decoder stack"):
        HeadSelection.explicit([("decoder", 0, 0)]).resolve(None, {"encoder": (2, 3)})


def test_resolve_layers() -> None:
    assert HeadSelection.layers([1]).resolve(None, {"encoder": (2, 3)}) == {("encoder", 1, h) for h in range(3)}
    assert HeadSelection.layers([0], [1]).resolve(None, BART) == {("encoder", 0, 1), ("decoder", 0, 1), ("cross", 0, 1)}
    assert HeadSelection.layers([0]).resolve(None, BART) == {
        ("encoder", 0, 0),
        ("encoder", 0, 1),
        ("encoder", 0, 2),
        ("decoder", 0, 0),
        ("decoder", 0, 1),
        ("cross", 0, 0),
        ("cross", 0, 1),
    }
    assert HeadSelection.layers([0, 1], [2], stack="encoder").resolve(None, BART) == {
        ("encoder", 0, 2),
        ("encoder", 1, 2),
    }
    hint = _re("; the rule names no stack, so it applies to every stack: name one (e.g. encoder:...)")
    with _err(r"^layer 1 is out of range: the decoder stack has 1 layers \(0-0\)" + hint + "$"):
        HeadSelection.layers([1]).resolve(None, BART)
    with _err(r"^head 2 \(layer 0\) is out of range: each layer of decoder has 2 heads \(0-1\)" + hint + "$"):
        HeadSelection.layers([0], [2]).resolve(None, BART)
    with _err(r"^head 2 \(layer 0\) is out of range: each layer of decoder has 2 heads \(0-1\)$"):
        HeadSelection.layers([0], [2], stack="decoder").resolve(None, BART)
    with _err(r"^layer -1 is out of range: the model has 2 layers \(0-1\)$"):
        HeadSelection.layers([-1]).resolve(None, 2, 3)
    with _err(r"^head 3 \(layer 0\) is out of range: each layer of the model has 3 heads \(0-2\)$"):
        HeadSelection.layers([1], [3]).resolve(None, 2, 3)
    with _err(r"^the layer selection is empty$"):
        HeadSelection.layers([]).resolve(None, 2, 3)
    with _err(r"^the layer selection is empty$"):
        HeadSelection.layers([0], []).resolve(None, 2, 3)
    assert HeadSelection.layers([], stack="encoder").resolve(None, BART, allow_empty=True) == frozenset()


TYPED: dict[Head, str] = {
    ("encoder", 0, 0): "dense",
    ("encoder", 0, 1): "vertical",
    ("encoder", 1, 2): "dense",
    ("decoder", 0, 0): "vertical",
    ("cross", 0, 1): "diagonal",
}  # the other heads have no type


def test_resolve_types() -> None:
    assert HeadSelection.of_type("dense").resolve(TYPED, BART) == {("encoder", 0, 0), ("encoder", 1, 2)}
    assert HeadSelection.of_types(["vertical", "diagonal"]).resolve(TYPED, BART) == {
        ("encoder", 0, 1),
        ("decoder", 0, 0),
        ("cross", 0, 1),
    }
    assert HeadSelection.of_type("vertical", stack="decoder").resolve(TYPED, BART) == {("decoder", 0, 0)}
    # "all but" picks the *assigned* heads of the other types
    assert HeadSelection.all_but("dense").resolve(TYPED, BART) == {
        ("encoder", 0, 1),
        ("decoder", 0, 0),
        ("cross", 0, 1),
    }
    assert HeadSelection.all_but(["dense", "vertical"], stack="cross").resolve(TYPED, BART) == {("cross", 0, 1)}
    pairs = {(0, 0): "dense", (1, 1): "vertical"}  # single-stack assignments by (layer, head)
    assert HeadSelection.all_but("vertical").resolve(pairs, 2, 3) == {("encoder", 0, 0)}
    assert HeadSelection.of_type("dense").resolve(TYPED, BART, allow_empty=True) == {
        ("encoder", 0, 0),
        ("encoder", 1, 2),
    }


def test_resolve_types_names_the_problem() -> None:
    with _err(r"^selecting heads by type \(dense, vertical\) needs a type assignment$"):
        HeadSelection.of_types(["dense", "vertical"]).resolve(None, BART)
    with _err(
        r"^unknown head type\(s\) 'dens', 'vertcal'; known types: dense, diagonal, dense_vertical, vertical, odd$"
    ):
        HeadSelection.of_types(["dens", "dense", "vertcal"]).resolve({**TYPED, ("encoder", 1, 0): "odd"}, BART)
    with _err(r"^type\(s\) dense, dense_vertical select no head of the decoder stack; types present: vertical$"):
        HeadSelection.of_types(["dense", "dense_vertical"], stack="decoder").resolve(TYPED, BART)
    with _err(r"^type\(s\) dense_vertical select no head; types present: dense, diagonal, vertical$"):
        HeadSelection.of_type("dense_vertical").resolve(TYPED, BART)
    with _err(r"^all types but diagonal, vertical select no head of the decoder stack; types present: vertical$"):
        HeadSelection.all_but(["diagonal", "vertical"], stack="decoder").resolve(TYPED, BART)
    with _err(r"^type\(s\) dense select no head; types present: none$"):
        HeadSelection.of_type("dense").resolve({}, BART)
    assert HeadSelection.of_type("dense_vertical").resolve(TYPED, BART, allow_empty=True) == frozenset()
    assert HeadSelection.all_but("vertical", stack="decoder").resolve(TYPED, BART, allow_empty=True) == frozenset()


def test_resolve_union_passes_allow_empty_to_its_parts() -> None:
    sel = HeadSelection.of_type("dense_vertical") | HeadSelection.layers([1], [0], stack="encoder")
    assert sel.resolve(TYPED, BART, allow_empty=True) == {("encoder", 1, 0)}
    with _err("select no head"):
        sel.resolve(TYPED, BART)
    three = (
        HeadSelection.explicit([("cross", 0, 0)])
        | HeadSelection.of_type("dense")
        | HeadSelection.all_heads(stack="decoder")
    )
    assert three.resolve(TYPED, BART) == {
        ("cross", 0, 0),
        ("encoder", 0, 0),
        ("encoder", 1, 2),
        ("decoder", 0, 0),
        ("decoder", 0, 1),
    }


def test_selection_to_dict_from_dict_and_describe() -> None:
    cases = [
        (HeadSelection.all_heads(), {"all": True}, "all heads"),
        (HeadSelection.all_heads(stack="cross"), {"all": True, "stack": "cross"}, "cross: all heads"),
        (
            HeadSelection.explicit([(0, 1), ("decoder", 2, 3)]),
            {"heads": [[0, 1], ["decoder", 2, 3]]},
            "L0H1, decoder L2H3",
        ),
        (HeadSelection.explicit([(0, 1)], stack="encoder"), {"heads": [[0, 1]], "stack": "encoder"}, "encoder: L0H1"),
        (HeadSelection.layers([0, 2]), {"layers": [0, 2]}, "layers [0, 2]"),
        (
            HeadSelection.layers([1], [2, 3], stack="decoder"),
            {"layers": [1], "heads": [2, 3], "stack": "decoder"},
            "decoder: layers [1] heads [2, 3]",
        ),
        (HeadSelection.of_types(["dense", "vertical"]), {"types": ["dense", "vertical"]}, "dense+vertical"),
        (HeadSelection.of_type("dense", stack="decoder"), {"types": ["dense"], "stack": "decoder"}, "decoder: dense"),
        (
            HeadSelection.all_but(["diagonal", "dense"]),
            {"all_but_types": ["diagonal", "dense"]},
            "all but diagonal+dense",
        ),
        (
            HeadSelection.all_but("vertical", stack="encoder"),
            {"all_but_types": ["vertical"], "stack": "encoder"},
            "encoder: all but vertical",
        ),
    ]
    for sel, data, text in cases:
        assert sel.to_dict() == data
        assert HeadSelection.from_dict(data) == sel
        assert sel.describe() == text
    a, b, c = (HeadSelection.of_type("dense"), HeadSelection.layers([0], stack="encoder"), HeadSelection.all_heads())
    union = a | b | c
    data = {"union": [{"union": [{"types": ["dense"]}, {"layers": [0], "stack": "encoder"}]}, {"all": True}]}
    assert union.to_dict() == data
    assert HeadSelection.from_dict(data) == union
    assert union.describe() == "dense | encoder: layers [0] | all heads"
    flat = HeadSelection.from_dict(
        {"union": [{"types": ["dense"]}, {"layers": [0], "stack": "encoder"}, {"all": True}]}
    )
    assert flat == union  # parts combined left to right
    assert HeadSelection.from_dict({"union": [{"all": True}]}) == c
    assert HeadSelection.from_dict({"all": False, "layers": [1]}) == HeadSelection.layers([1])
    assert HeadSelection.from_dict({"heads": [0, 1], "layers": [1]}) == HeadSelection.layers([1], [0, 1])  # head ids
    with _err(r"^unknown stack 'middle'; stacks: encoder, decoder, cross$"):
        HeadSelection.from_dict({"all": True, "stack": "middle"})
    with _err(r"^not a head selection: \{'every': True\}$"):
        HeadSelection.from_dict({"every": True})


def test_as_selection_reads_the_short_forms() -> None:
    sel = HeadSelection.layers([0])
    assert as_selection(sel) is sel
    assert as_selection("dense") == HeadSelection.of_type("dense")
    assert as_selection(["dense", "vertical"]) == HeadSelection.of_types(["dense", "vertical"])
    assert as_selection([(0, 1), ["decoder", 1, 2]]) == HeadSelection.explicit([(0, 1), ("decoder", 1, 2)])
    with _err(
        r"^cannot read \['dense', \(0, 1\)\] as a head selection: give a type name, a list of type names, "
        r"a list of \(layer, head\) pairs or \(stack, layer, head\) triples, or a HeadSelection$"
    ):
        as_selection(["dense", (0, 1)])
    with _err(r"^cannot read \[3\] as a head selection"):
        as_selection([3])  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# The spec
# --------------------------------------------------------------------------------------------


def test_spec_orders_validates_and_keeps_its_fields() -> None:
    ops: list[tuple[Head, Any]] = [
        (("cross", 0, 1), "prune"),
        (("encoder", 1, 0), "uniform"),
        (("decoder", 0, 1), "drop_intra"),
        (("encoder", 0, 2), "drop_inter"),
        (("encoder", 0, 1), "prune"),
    ]
    spec = AblationSpec(BART, None, ops, 1, selections=[("prune", {"all": True})])  # type: ignore[arg-type]
    assert spec.shapes == (("encoder", 2, 3), ("decoder", 1, 2), ("cross", 1, 2))
    assert spec.ops == (
        (("encoder", 0, 1), "prune"),
        (("encoder", 0, 2), "drop_inter"),
        (("encoder", 1, 0), "uniform"),
        (("decoder", 0, 1), "drop_intra"),
        (("cross", 0, 1), "prune"),
    )
    assert spec.renormalize is True
    assert spec.selections == (("prune", {"all": True}),)
    assert spec.stack_shapes == {"encoder": (2, 3), "decoder": (1, 2), "cross": (1, 2)}
    assert (spec.num_layers, spec.num_heads) == (2, 3)
    assert not spec.is_empty
    assert spec.heads == dict(spec.ops)
    assert spec.operations == {"prune", "uniform", "drop_intra", "drop_inter"}
    assert spec.needs_segments
    assert spec.needs_mask
    assert spec.heads_for("prune") == [("encoder", 0, 1), ("cross", 0, 1)]
    assert spec.heads_for("uniform") == [("encoder", 1, 0)]
    assert spec.by_layer() == {
        ("encoder", 0): [("prune", [1]), ("drop_inter", [2])],  # operations in head order
        ("encoder", 1): [("uniform", [0])],
        ("decoder", 0): [("drop_intra", [1])],
        ("cross", 0): [("prune", [1])],
    }
    assert list(spec.by_layer()) == [("encoder", 0), ("encoder", 1), ("decoder", 0), ("cross", 0)]
    assert AblationSpec(2, 3, [((1, 0), "prune")]).renormalize is False
    assert AblationSpec(2, 3, [((1, 0), "prune")]).shapes == (("encoder", 2, 3),)
    assert AblationSpec(2, 3).selections == ()


def test_spec_by_layer_sorts_heads_and_orders_layers_by_stack() -> None:
    spec = AblationSpec(
        {"decoder": (3, 4), "encoder": (1, 4)},
        None,
        [
            (("decoder", 2, 3), "prune"),
            (("decoder", 2, 0), "prune"),
            (("decoder", 1, 1), "uniform"),
            (("encoder", 0, 3), "uniform"),
            (("encoder", 0, 1), "uniform"),
        ],
    )
    assert spec.by_layer() == {
        ("encoder", 0): [("uniform", [1, 3])],
        ("decoder", 1): [("uniform", [1])],
        ("decoder", 2): [("prune", [0, 3])],
    }
    assert list(spec.by_layer()) == [("encoder", 0), ("decoder", 1), ("decoder", 2)]


def test_spec_flags() -> None:
    prune = AblationSpec.from_heads({(0, 0): "prune"}, 2, 3)
    assert not prune.needs_mask
    assert not prune.needs_segments
    assert prune.operations == {"prune"}
    uniform = AblationSpec.from_heads({(0, 0): "uniform"}, 2, 3)
    assert uniform.needs_mask
    assert not uniform.needs_segments
    drop = AblationSpec.from_heads({(0, 0): "drop_inter"}, 2, 3)
    assert drop.needs_mask
    assert drop.needs_segments
    empty = AblationSpec.empty(2, 3)
    assert empty.is_empty
    assert empty.ops == ()
    assert not empty.needs_mask
    assert empty.shapes == (("encoder", 2, 3),)
    assert AblationSpec.empty(shapes=BART).shapes == (("encoder", 2, 3), ("decoder", 1, 2), ("cross", 1, 2))
    assert AblationSpec.empty(shapes=BART).renormalize is False


def test_spec_names_the_bad_field() -> None:
    with _err(
        r"^drop_intra compares the segments of a query and a key; cross attention's queries and keys "
        r"are different sequences, so it is not defined on the cross stack$"
    ):
        AblationSpec(BART, None, [(("cross", 0, 0), "drop_intra")])
    with _err(r"^drop_inter compares the segments"):
        AblationSpec(BART, None, [(("cross", 0, 0), "drop_inter")])
    AblationSpec(BART, None, [(("cross", 0, 0), "uniform"), (("decoder", 0, 0), "drop_inter")])  # fine
    with _err(r"^head \(decoder, 0, 1\) is selected for both prune and uniform; a head gets at most one operation$"):
        AblationSpec(BART, None, [(("decoder", 0, 1), "prune"), (("decoder", 0, 1), "uniform")])
    with _err(r"^head \(1, 2\) is selected for both uniform and uniform; a head gets at most one operation$"):
        AblationSpec(2, 3, [((1, 2), "uniform"), ((1, 2), "uniform")])
    with _err(r"^unknown operation 'zero'"):
        AblationSpec(2, 3, [((1, 2), "zero")])  # type: ignore[list-item]
    with _err(r"^head 3 \(layer 1\) is out of range"):
        AblationSpec(2, 3, [((1, 3), "prune")])
    with _err(r"names no stack"):
        AblationSpec(BART, None, [((0, 0), "prune")])


def test_from_heads_passes_shapes_and_renormalize() -> None:
    spec = AblationSpec.from_heads({("decoder", 0, 1): "uniform"}, shapes=BART, renormalize=True)
    assert spec.ops == ((("decoder", 0, 1), "uniform"),)
    assert spec.renormalize is True
    assert len(spec.shapes) == 3
    assert AblationSpec.from_heads({(1, 1): "prune"}, num_layers=2, num_heads=3).renormalize is False
    with _err("not both"):
        AblationSpec.from_heads({(1, 1): "prune"}, 2, 3, shapes=BART)


def test_build_composes_and_keeps_provenance() -> None:
    spec = AblationSpec.build({"prune": "dense", "uniform": [(0, 1)]}, TYPED, shapes=BART, renormalize=True)
    assert spec.heads == {
        ("encoder", 0, 0): "prune",
        ("encoder", 1, 2): "prune",
        ("encoder", 0, 1): "uniform",
        ("decoder", 0, 1): "uniform",
        ("cross", 0, 1): "uniform",
    }
    assert spec.renormalize is True
    assert spec.shapes == (("encoder", 2, 3), ("decoder", 1, 2), ("cross", 1, 2))
    assert spec.selections == (("prune", {"types": ["dense"]}), ("uniform", {"heads": [[0, 1]]}))
    assert spec == AblationSpec(BART, None, list(spec.heads.items()), True)


def test_build_drops_segment_operations_on_cross_unless_named() -> None:
    # a drop naming no stack means every stack it is defined on: not cross
    spec = AblationSpec.build({"drop_inter": HeadSelection.layers([0], [1])}, shapes=BART)
    assert spec.heads == {("encoder", 0, 1): "drop_inter", ("decoder", 0, 1): "drop_inter"}
    typed: dict[Head, str] = {**TYPED, ("cross", 0, 0): "vertical"}
    uniform = [("cross", 0, 1), ("decoder", 0, 1)]
    spec = AblationSpec.build({"drop_intra": "vertical", "uniform": uniform}, typed, shapes=BART, renormalize=True)
    assert spec.heads == {
        ("encoder", 0, 1): "drop_intra",
        ("decoder", 0, 0): "drop_intra",
        ("cross", 0, 1): "uniform",
        ("decoder", 0, 1): "uniform",
    }  # cross 0 0 is vertical, not dropped
    with _err(r"^head \(encoder, 0, 1\) is selected for both drop_intra and uniform"):
        AblationSpec.build({"drop_intra": "vertical", "uniform": [("encoder", 0, 1)]}, TYPED, shapes=BART)
    assert spec.renormalize is True
    assert spec.selections == (
        ("drop_intra", {"types": ["vertical"]}),
        ("uniform", {"heads": [["cross", 0, 1], ["decoder", 0, 1]]}),
    )
    # naming cross is refused, as a triple, a stack, or inside a union
    for sel in [
        HeadSelection.explicit([("cross", 0, 0)]),
        HeadSelection.all_heads(stack="cross"),
        HeadSelection.of_type("dense") | HeadSelection.layers([0], stack="cross"),
    ]:
        with _err(r"^drop_intra compares the segments"):
            AblationSpec.build({"drop_intra": sel}, TYPED, shapes=BART)
    spec = AblationSpec.build({"prune": HeadSelection.layers([0], [1])}, shapes=BART)  # not a drop: every stack
    assert set(spec.heads) == {("encoder", 0, 1), ("decoder", 0, 1), ("cross", 0, 1)}


def test_build_names_conflicts_and_validates() -> None:
    with _err(r"^head \(0, 1\) is selected for both prune and uniform; a head gets at most one operation$"):
        AblationSpec.build({"prune": HeadSelection.layers([0]), "uniform": [(0, 1)]}, num_layers=2, num_heads=3)
    with _err(r"^head \(decoder, 0, 0\) is selected for both prune and drop_inter"):
        AblationSpec.build(
            {"prune": "vertical", "drop_inter": HeadSelection.all_heads(stack="decoder")}, TYPED, shapes=BART
        )
    with _err(r"^unknown operation 'zero'"):
        AblationSpec.build({"zero": "dense"}, TYPED, shapes=BART)  # type: ignore[dict-item]
    with _err(r"^type\(s\) dense_vertical select no head"):
        AblationSpec.build({"prune": "dense_vertical"}, TYPED, shapes=BART)
    empty = AblationSpec.build({"prune": "dense_vertical"}, TYPED, shapes=BART, allow_empty=True)
    assert empty.is_empty
    assert empty.selections == (("prune", {"types": ["dense_vertical"]}),)
    assert empty.renormalize is False
    with _err(r"^type assignment: head \(0, 0\) names no stack"):
        AblationSpec.build({"prune": "dense"}, {(0, 0): "dense"}, shapes=BART)
    one = AblationSpec.build({"uniform": [(1, 2)]}, num_layers=2, num_heads=3)
    assert one.ops == ((("encoder", 1, 2), "uniform"),)
    assert one.shapes == (("encoder", 2, 3),)


def test_for_model_reads_the_stacks_from_the_config() -> None:
    model = _model(
        {"is_encoder_decoder": True, "num_layers": 2, "num_heads": 3, "num_decoder_layers": 1}, {"is_decoder": True}
    )
    spec = AblationSpec.for_model(model, {"prune": HeadSelection.layers([0], [2])}, renormalize=True)
    assert spec.shapes == (("encoder", 2, 3), ("decoder", 1, 3), ("cross", 1, 3))
    assert set(spec.heads) == {("encoder", 0, 2), ("decoder", 0, 2), ("cross", 0, 2)}
    assert spec.renormalize
    typed = AblationSpec.for_model(model, {"uniform": "dense"}, {("decoder", 0, 1): "dense"})
    assert typed.heads == {("decoder", 0, 1): "uniform"}


def test_spec_to_dict_and_from_dict() -> None:
    spec = AblationSpec(
        BART,
        None,
        [(("decoder", 0, 1), "prune"), (("encoder", 1, 0), "uniform"), (("encoder", 0, 0), "prune")],
        True,
        selections=[("prune", {"all": True})],
    )
    data = {
        "stacks": {"encoder": [2, 3], "decoder": [1, 2], "cross": [1, 2]},
        "num_layers": 2,
        "num_heads": 3,
        "renormalize": True,
        "ops": {"prune": [["encoder", 0, 0], ["decoder", 0, 1]], "uniform": [["encoder", 1, 0]]},
        "selections": {"prune": {"all": True}},
    }
    assert spec.to_dict() == data
    again = AblationSpec.from_dict(data)
    assert again == spec
    assert again.renormalize is True
    assert again.selections == (("prune", {"all": True}),)
    # a spec stored before stacks: num_layers/num_heads, (layer, head) lists, no renormalize or selections
    old = AblationSpec.from_dict({"num_layers": "2", "num_heads": 3, "ops": {"uniform": [[1, 2]]}})
    assert old.shapes == (("encoder", 2, 3),)
    assert old.ops == ((("encoder", 1, 2), "uniform"),)
    assert old.renormalize is False
    assert old.selections == ()
    bare = AblationSpec.from_dict({"stacks": {"decoder": [1, 2]}})
    assert bare.shapes == (("decoder", 1, 2),)
    assert bare.is_empty
    assert bare.renormalize is False
    assert AblationSpec.from_dict({"num_layers": 1, "num_heads": 1, "renormalize": 1}).renormalize is True


def test_names_and_order_helpers() -> None:
    assert _order(("cross", 0, 0)) > _order(("decoder", 5, 5)) > _order(("encoder", 9, 9))
    assert _order(("decoder", 1, 2)) == (1, 1, 2)
    assert _name(("encoder", 1, 2), {"encoder": (2, 3)}) == "(1, 2)"
    assert _name(("encoder", 1, 2), BART) == "(encoder, 1, 2)"
    assert _names_stack(HeadSelection.all_heads(stack="cross"), "cross")
    assert _names_stack(HeadSelection.explicit([(0, 0), ("cross", 0, 1)]), "cross")
    assert not _names_stack(HeadSelection.explicit([(0, 0), ("decoder", 0, 1)]), "cross")
    assert not _names_stack(HeadSelection.all_heads(), "cross")
    assert _names_stack(HeadSelection.all_heads() | HeadSelection.of_type("dense", stack="cross"), "cross")
    assert not _names_stack(HeadSelection.all_heads() | HeadSelection.of_type("dense", stack="decoder"), "cross")


# --------------------------------------------------------------------------------------------
# Plan rows
# --------------------------------------------------------------------------------------------


def test_plan_row_of_to_dict_and_to_spec() -> None:
    row = PlanRow.of("p", "Prune dense", {"prune": ["dense"], "uniform": [(0, 1)]}, paper_ref="T9")
    assert row.ops == (("prune", HeadSelection.of_types(["dense"])), ("uniform", HeadSelection.explicit([(0, 1)])))
    assert row.paper_ref == "T9"
    assert PlanRow.of("q", "Q", {}).paper_ref is None
    assert row.to_dict() == {
        "id": "p",
        "label": "Prune dense",
        "paper_ref": "T9",
        "ops": {"prune": {"types": ["dense"]}, "uniform": {"heads": [[0, 1]]}},
    }
    with _err(r"^unknown operation 'zero'"):
        PlanRow.of("x", "x", {"prune": "dense", "zero": ["dense"]})  # type: ignore[dict-item]
    spec = row.to_spec({(0, 0): "dense", (1, 2): "dense"}, num_layers=2, num_heads=3, renormalize=True)
    assert spec.heads == {("encoder", 0, 0): "prune", ("encoder", 1, 2): "prune", ("encoder", 0, 1): "uniform"}
    assert spec.renormalize is True
    stacked = PlanRow.of("s", "S", {"uniform": HeadSelection.layers([0], [1])}).to_spec(None, shapes=BART)
    assert set(stacked.heads) == {("encoder", 0, 1), ("decoder", 0, 1), ("cross", 0, 1)}
    assert stacked.renormalize is False


def test_pretty_names() -> None:
    assert [_pretty(t) for t in ["dense", "diagonal", "dense_vertical", "vertical", "other"]] == [
        "dense",
        "diagonal",
        "dense&vertical",
        "vertical",
        "other",
    ]


def test_paper_plan_rows_for_four_types() -> None:
    """Guan et al. (2020) Tables 2 and 3, written out by hand (ids, labels, references, operations)."""
    types = ["dense", "diagonal", "dense_vertical", "vertical"]
    pretty = {"dense": "dense", "diagonal": "diagonal", "dense_vertical": "dense&vertical", "vertical": "vertical"}
    expected: list[tuple[str, str, str | None, dict[str, Any]]] = [("baseline", "Baseline (no ablation)", "T2.1", {})]
    expected += [
        (f"prune.{t}", f"Prune {pretty[t]}", f"T2.{2 + i}", {"prune": {"types": [t]}}) for i, t in enumerate(types)
    ]
    expected += [
        ("prune.dense+vertical", "Prune dense + vertical", "T2.6", {"prune": {"types": ["dense", "vertical"]}}),
        (
            "prune.dense_vertical+vertical",
            "Prune dense&vertical + vertical",
            "T2.7",
            {"prune": {"types": ["dense_vertical", "vertical"]}},
        ),
        (
            "prune.dense+dense_vertical",
            "Prune dense + dense&vertical (not in the paper)",
            None,
            {"prune": {"types": ["dense", "dense_vertical"]}},
        ),
    ]
    expected += [
        (f"uniform.{t}", f"Uniform 1/L for {pretty[t]}", f"T2.{8 + i}", {"uniform": {"types": [t]}})
        for i, t in enumerate(types)
    ]
    for t in types:
        for op, what in [("drop_intra", "intra"), ("drop_inter", "inter")]:
            expected.append(
                (f"{op}.{t}", f"Drop {what}-segment attention of {pretty[t]}", "T3.upper", {op: {"types": [t]}})
            )
    for t in types:
        for op, what in [("drop_intra", "intra"), ("drop_inter", "inter")]:
            expected.append(
                (
                    f"{op}.all_but.{t}",
                    f"Drop {what}-segment attention of all types but {pretty[t]}",
                    "T3.lower",
                    {op: {"all_but_types": [t]}},
                )
            )
    plan = paper_plan(reversed(types))  # the order of the argument does not matter
    assert [(r.id, r.label, r.paper_ref, r.to_dict()["ops"]) for r in plan] == expected


def test_paper_plan_keeps_the_table_numbers_when_types_are_missing() -> None:
    plan = paper_plan(["vertical", "dense"])
    assert [(r.id, r.paper_ref) for r in plan] == [
        ("baseline", "T2.1"),
        ("prune.dense", "T2.2"),
        ("prune.vertical", "T2.5"),
        ("prune.dense+vertical", "T2.6"),
        ("uniform.dense", "T2.8"),
        ("uniform.vertical", "T2.11"),
        ("drop_intra.dense", "T3.upper"),
        ("drop_inter.dense", "T3.upper"),
        ("drop_intra.vertical", "T3.upper"),
        ("drop_inter.vertical", "T3.upper"),
        ("drop_intra.all_but.dense", "T3.lower"),
        ("drop_inter.all_but.dense", "T3.lower"),
        ("drop_intra.all_but.vertical", "T3.lower"),
        ("drop_inter.all_but.vertical", "T3.lower"),
    ]
    plan = paper_plan(["dense_vertical", "vertical", "zeta"])
    assert [r.id for r in plan if r.id.startswith("prune.")] == [
        "prune.dense_vertical",
        "prune.vertical",
        "prune.dense_vertical+vertical",
    ]
    assert [r.id for r in paper_plan(["dense", "dense_vertical"]) if "+" in r.id] == ["prune.dense+dense_vertical"]
    assert [r.id for r in paper_plan(["vertical"])] == [
        "baseline",
        "prune.vertical",
        "uniform.vertical",
        "drop_intra.vertical",
        "drop_inter.vertical",
    ]
    assert [r.id for r in paper_plan([])] == ["baseline"]
    assert paper_plan([])[0].ops == ()


def test_model_shapes_decoder_falls_back_to_num_layers() -> None:
    # no decoder-specific count: the decoder has the model's num_layers (not num_hidden_layers)
    config = {"is_encoder_decoder": True, "num_layers": 2, "num_heads": 3, "num_hidden_layers": 9}
    assert model_shapes(_model(config, {"is_decoder": True})) == {"encoder": (2, 3), "decoder": (2, 3), "cross": (2, 3)}


def test_two_stack_models_name_the_stack_in_messages() -> None:
    two: dict[Stack, tuple[int, int]] = {"encoder": (2, 3), "decoder": (1, 2)}  # any subset of the stacks is a shape
    hint = _re("; the rule names no stack, so it applies to every stack: name one (e.g. encoder:...)")
    with _err(r"^layer 1 is out of range: the decoder stack has 1 layers \(0-0\)" + hint + "$"):
        HeadSelection.explicit([(1, 0)]).resolve(None, two)
    with _err(r"^layer 1 is out of range: the decoder stack has 1 layers \(0-0\)" + hint + "$"):
        HeadSelection.layers([1]).resolve(None, two)
    with _err(r"^head 2 \(layer 0\) is out of range: each layer of decoder has 2 heads \(0-1\)$"):
        _check_head(("decoder", 0, 2), two)
    with _err(r"^layer 1 is out of range: the decoder stack has 1 layers \(0-0\)$"):
        _check_head(("decoder", 1, 0), two)


def test_layers_of_a_one_head_model() -> None:
    assert HeadSelection.layers([0, 1]).resolve(None, 2, 1) == {("encoder", 0, 0), ("encoder", 1, 0)}


def test_build_reports_the_first_conflict_in_stack_order() -> None:
    # prune everything, then uniform head 0 of layer 0: it conflicts in every stack; the encoder's is named
    with _err(r"^head \(encoder, 0, 0\) is selected for both prune and uniform"):
        AblationSpec.build({"prune": HeadSelection.all_heads(), "uniform": [(0, 0)]}, shapes=BART)
