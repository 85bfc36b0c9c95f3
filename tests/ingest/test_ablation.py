"""Head surgery: exact edits on known tensors, bit-for-bit identity where nothing is ablated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ingest.ablation import (
    OPERATIONS,
    AblationSpec,
    AblationSpecError,
    Ablator,
    HeadSelection,
    PlanRow,
    ablate_probs,
    apply_ablation,
    paper_plan,
    segments_from_separators,
    segments_from_token_types,
)
from ingest.selection import Operation
from ingest.types import HEAD_TYPES

# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------


def _load(path: Path):
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def tiny(tiny_bert_path: Path):
    return _load(tiny_bert_path)


@pytest.fixture(scope="module")
def minilm(minilm_path: Path):
    return _load(minilm_path)


def _pair_batch(tokenizer):
    return tokenizer(
        ["Where is the cat?", "Who wrote it, and when?"],
        ["The cat sat on the mat, near the door.", "It was written long ago."],
        padding=True,
        return_tensors="pt",
    )


def _assignments(num_layers: int, num_heads: int) -> dict[tuple[int, int], str]:
    return {(layer, head): HEAD_TYPES[(layer + head) % 4] for layer in range(num_layers) for head in range(num_heads)}


# --------------------------------------------------------------------------------------------
# Bit-for-bit identity
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["tiny", pytest.param("minilm", marks=pytest.mark.slow)])
def test_empty_spec_is_bit_for_bit(which: str, request: pytest.FixtureRequest) -> None:
    model, tokenizer = request.getfixturevalue(which)
    batch = _pair_batch(tokenizer)
    with torch.inference_mode():
        expected = model(**batch, output_hidden_states=True)
        spec = AblationSpec.empty(*_shape(model))
        with Ablator(model, spec) as ablator:
            ablator.set_batch(batch["attention_mask"], token_type_ids=batch["token_type_ids"])
            got = model(**batch, output_hidden_states=True)
    assert model.config._attn_implementation == "eager"  # restored on exit
    assert torch.equal(got.last_hidden_state, expected.last_hidden_state)
    for a, b in zip(got.hidden_states, expected.hidden_states, strict=True):
        assert torch.equal(a, b)


def test_layers_without_selected_heads_stay_bit_for_bit(tiny) -> None:
    model, tokenizer = tiny
    batch = _pair_batch(tokenizer)
    spec = AblationSpec.from_heads({(1, 2): "uniform"}, *_shape(model))
    with torch.inference_mode():
        expected = model(**batch, output_hidden_states=True).hidden_states
        with apply_ablation(model, spec, attention_mask=batch["attention_mask"]):
            got = model(**batch, output_hidden_states=True).hidden_states
    assert torch.equal(got[0], expected[0])  # embeddings
    assert torch.equal(got[1], expected[1])  # layer 0: nothing selected
    assert not torch.equal(got[2], expected[2])  # layer 1: head 2 made uniform


def _shape(model) -> tuple[int, int]:
    return model.config.num_hidden_layers, model.config.num_attention_heads


@pytest.mark.parametrize("which", ["tiny", pytest.param("minilm", marks=pytest.mark.slow)])
def test_pruning_a_whole_layer_zeroes_its_attention_output(which: str, request: pytest.FixtureRequest) -> None:
    """Prune every head of layer 1 == a hook that zeroes BertSelfAttention's context output.

    In transformers 5, ``BertSelfAttention.forward`` returns ``(attn_output, attn_weights)``,
    ``attn_output`` (batch, seq, hidden) being the concatenated heads' context before the output
    projection; ``BertSelfOutput`` then applies dense + residual + LayerNorm.
    """
    model, tokenizer = request.getfixturevalue(which)
    batch = _pair_batch(tokenizer)
    layer = 1

    def zero_context(module, args, output):
        return (torch.zeros_like(output[0]), *output[1:])

    self_attention = model.encoder.layer[layer].attention.self
    handle = self_attention.register_forward_hook(zero_context)
    try:
        with torch.inference_mode():
            expected = model(**batch).last_hidden_state
    finally:
        handle.remove()
    spec = AblationSpec.build(
        {"prune": HeadSelection.layers([layer])}, num_layers=_shape(model)[0], num_heads=_shape(model)[1]
    )
    with torch.inference_mode(), apply_ablation(model, spec, attention_mask=batch["attention_mask"]):
        got = model(**batch).last_hidden_state
    assert torch.equal(got, expected)


def test_real_model_drop_changes_only_pairs_with_two_segments(tiny) -> None:
    model, tokenizer = tiny
    single = tokenizer(["One sentence only, with a comma."], return_tensors="pt")
    spec = AblationSpec.build({"drop_inter": HeadSelection.all_heads()}, num_layers=2, num_heads=4)
    with torch.inference_mode():
        expected = model(**single).last_hidden_state
        with apply_ablation(
            model, spec, attention_mask=single["attention_mask"], token_type_ids=single["token_type_ids"]
        ):
            got = model(**single).last_hidden_state
        assert torch.equal(got, expected)  # one segment: nothing is inter-segment

        pair = _pair_batch(tokenizer)
        baseline = model(**pair).last_hidden_state
        with apply_ablation(model, spec, attention_mask=pair["attention_mask"], token_type_ids=pair["token_type_ids"]):
            dropped = model(**pair).last_hidden_state
    assert not torch.equal(dropped, baseline)


# --------------------------------------------------------------------------------------------
# Exact edits on known probabilities
# --------------------------------------------------------------------------------------------


@pytest.fixture
def probs() -> torch.Tensor:
    """(batch 2, head 3, q 4, k 4): rows sum to 1; sample 1's last key is padding."""
    torch.manual_seed(0)
    p = torch.rand(2, 3, 4, 4, dtype=torch.float64)
    p[1, :, :, 3] = 0
    return p / p.sum(-1, keepdim=True)


MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
SEGMENTS = torch.tensor([[0, 0, 1, 1], [0, 1, 1, -1]])


def test_prune_zeroes_selected_heads_only(probs: torch.Tensor) -> None:
    before = probs.clone()
    out = ablate_probs(probs, {"prune": [0, 2]})
    assert torch.equal(probs, before)  # the input is left alone
    assert torch.equal(out[:, [0, 2]], torch.zeros(2, 2, 4, 4, dtype=probs.dtype))
    assert torch.equal(out[:, 1], probs[:, 1])


def test_uniform_is_one_over_real_length(probs: torch.Tensor) -> None:
    out = ablate_probs(probs, {"uniform": [1]}, attention_mask=MASK)
    assert torch.equal(out[0, 1], torch.full((4, 4), 0.25, dtype=probs.dtype))
    expected = torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0], dtype=probs.dtype).expand(4, 4)
    assert torch.equal(out[1, 1], expected)
    assert torch.equal(out[:, [0, 2]], probs[:, [0, 2]])


def _expected_drop(probs: torch.Tensor, heads: list[int], intra: bool, renormalize: bool = False) -> torch.Tensor:
    out = probs.clone()
    for b in range(probs.shape[0]):
        for h in heads:
            for s in range(4):
                for t in range(4):
                    same = bool(SEGMENTS[b, s] == SEGMENTS[b, t])
                    if same == intra:
                        out[b, h, s, t] = 0.0
                if renormalize:
                    total = out[b, h, s].sum()
                    if total > 0:
                        out[b, h, s] = out[b, h, s] / total
    return out


@pytest.mark.parametrize("heads", [[1], [0, 2], [0, 1, 2]])
@pytest.mark.parametrize("op", ["drop_intra", "drop_inter"])
def test_drops_zero_same_or_cross_segment_attention(probs: torch.Tensor, op: Operation, heads: list[int]) -> None:
    out = ablate_probs(probs, {op: heads}, attention_mask=MASK, segment_ids=SEGMENTS)
    expected = _expected_drop(probs, heads, intra=op == "drop_intra")
    assert torch.equal(out, expected)


@pytest.mark.parametrize("op", ["drop_intra", "drop_inter"])
def test_drops_renormalize_when_asked(probs: torch.Tensor, op: Operation) -> None:
    out = ablate_probs(probs, {op: [0, 2]}, attention_mask=MASK, segment_ids=SEGMENTS, renormalize=True)
    expected = _expected_drop(probs, [0, 2], intra=op == "drop_intra", renormalize=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-15)
    sums = out[:, [0, 2]].sum(-1)  # (batch, head, q)
    real_rows = MASK.bool()[:, None, :].expand_as(sums)
    assert torch.all((sums[real_rows] - 1).abs() < 1e-12)  # every real query keeps some mass here


def test_operations_combine_on_distinct_heads(probs: torch.Tensor) -> None:
    out = ablate_probs(
        probs, {"prune": [2], "uniform": [0], "drop_inter": [1]}, attention_mask=MASK, segment_ids=SEGMENTS
    )
    assert torch.equal(out[:, 2], torch.zeros(2, 4, 4, dtype=probs.dtype))
    assert torch.equal(out[0, 0], torch.full((4, 4), 0.25, dtype=probs.dtype))
    assert torch.equal(out[:, 1], _expected_drop(probs, [1], intra=False)[:, 1])


def test_segments_from_token_types_and_separators() -> None:
    types = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    assert segments_from_token_types(types, mask).tolist() == [[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, -1, -1]]
    # RoBERTa: <s> A </s></s> B </s> <pad>   (0 = <s>, 2 = </s>, 1 = <pad>)
    ids = torch.tensor([[0, 11, 12, 2, 2, 13, 2, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]])
    assert segments_from_separators(ids, 2, mask).tolist() == [[0, 0, 0, 0, 0, 1, 1, -1]]
    # BERT: [CLS] A [SEP] B [SEP] gives the token type runs
    ids = torch.tensor([[101, 7, 102, 8, 9, 102]])
    assert segments_from_separators(ids, 102).tolist() == [[0, 0, 0, 1, 1, 1]]


# --------------------------------------------------------------------------------------------
# Specs, selections, validation
# --------------------------------------------------------------------------------------------


def test_build_composes_operations_over_types() -> None:
    assignments = _assignments(6, 12)
    spec = AblationSpec.build(
        {"prune": ["dense", "vertical"], "uniform": "diagonal", "drop_intra": HeadSelection.explicit([(5, 1)])},
        assignments,
        num_layers=6,
        num_heads=12,
    )
    heads = spec.heads  # keyed (stack, layer, head): a BERT's heads are all encoder heads
    assert heads[("encoder", 5, 1)] == "drop_intra"  # a dense_vertical head, chosen by hand
    assert len(heads) == 6 * 12 * 3 // 4 + 1
    assert {h for h, op in heads.items() if op == "prune"} == {
        ("encoder", *h) for h, t in assignments.items() if t in ("dense", "vertical")
    }


def test_conflicting_operations_are_rejected() -> None:
    assignments = _assignments(6, 12)
    with pytest.raises(AblationSpecError, match=r"head \(1, 0\) is selected for both prune and uniform"):
        AblationSpec.build({"prune": ["diagonal"], "uniform": [(1, 0)]}, assignments, num_layers=6, num_heads=12)
    with pytest.raises(AblationSpecError, match="both"):
        AblationSpec(6, 12, (((0, 0), "prune"), ((0, 0), "uniform")))


def test_validation_names_the_problem() -> None:
    assignments = _assignments(6, 12)
    with pytest.raises(AblationSpecError, match="unknown head type.*'diagnal'.*known types: dense, diagonal"):
        AblationSpec.build({"prune": ["diagnal"]}, assignments, num_layers=6, num_heads=12)
    with pytest.raises(AblationSpecError, match=r"layer 6 is out of range: the model has 6 layers \(0-5\)"):
        AblationSpec.build({"prune": HeadSelection.layers(range(4, 7))}, num_layers=6, num_heads=12)
    with pytest.raises(AblationSpecError, match=r"head 12 \(layer 2\) is out of range"):
        AblationSpec.build({"prune": [(2, 12)]}, num_layers=6, num_heads=12)
    with pytest.raises(AblationSpecError, match="unknown operation 'mask'"):
        AblationSpec.build({"mask": [(0, 0)]}, num_layers=6, num_heads=12)  # type: ignore[dict-item]
    with pytest.raises(AblationSpecError, match="needs a type assignment"):
        AblationSpec.build({"prune": ["dense"]}, num_layers=6, num_heads=12)
    with pytest.raises(AblationSpecError, match="select no head; types present"):
        AblationSpec.build({"prune": ["vertical"]}, {(0, 0): "dense"}, num_layers=6, num_heads=12)
    with pytest.raises(AblationSpecError, match="type assignment: layer 9"):
        AblationSpec.build({"prune": ["dense"]}, {(9, 0): "dense"}, num_layers=6, num_heads=12)


def test_spec_must_match_the_model_before_any_compute(tiny) -> None:
    model, tokenizer = tiny
    spec = AblationSpec.from_heads({(0, 0): "prune"}, 6, 12)
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(AblationSpecError, match="spec is for 6 layers x 12 heads but the model has 2 x 4"):
            with Ablator(model, spec):
                pass
        drop = AblationSpec.from_heads({(0, 0): "drop_intra"}, 2, 4)
        with pytest.raises(AblationSpecError, match="need segments"), Ablator(model, drop) as ablator:
            ablator.set_batch(torch.ones(1, 5, dtype=torch.long))
    finally:
        handle.remove()
    assert calls == []
    assert model.config._attn_implementation == "eager"


def test_stale_batch_masks_are_caught(tiny) -> None:
    model, tokenizer = tiny
    spec = AblationSpec.from_heads({(0, 1): "uniform"}, 2, 4)
    batch = _pair_batch(tokenizer)
    with torch.inference_mode(), Ablator(model, spec) as ablator:
        ablator.set_batch(batch["attention_mask"][:1])
        with pytest.raises(RuntimeError, match="call set_batch"):
            model(**batch)


def test_selections_and_json_round_trip() -> None:
    assignments = _assignments(4, 4)
    sel = HeadSelection.layers(range(0, 2), heads=[1, 3]) | HeadSelection.all_but(["dense", "diagonal", "vertical"])
    heads = sel.resolve(assignments, 4, 4)
    dense_vertical = {h for h, t in assignments.items() if t == "dense_vertical"}
    assert heads == {("encoder", *h) for h in [(0, 1), (0, 3), (1, 1), (1, 3), *dense_vertical]}
    assert HeadSelection.from_dict(sel.to_dict()) == sel
    spec = AblationSpec.build({"prune": sel, "uniform": [(3, 0)]}, assignments, num_layers=4, num_heads=4)
    again = AblationSpec.from_dict(spec.to_dict())
    assert again == spec
    assert again.to_dict() == spec.to_dict()
    assert spec.by_layer()["encoder", 3][0][0] in OPERATIONS


# --------------------------------------------------------------------------------------------
# Guan et al. Tables 2 and 3
# --------------------------------------------------------------------------------------------


def test_paper_plan_has_every_row_for_four_types() -> None:
    plan = paper_plan(HEAD_TYPES)
    ids = [row.id for row in plan]
    assert len(ids) == len(set(ids)) == 1 + 4 + 3 + 4 + 8 + 8
    refs = {row.id: row.paper_ref for row in plan}
    assert refs["baseline"] == "T2.1"
    assert refs["prune.diagonal"] == "T2.3"
    assert refs["prune.dense+vertical"] == "T2.6"
    assert refs["prune.dense_vertical+vertical"] == "T2.7"
    assert refs["uniform.dense"] == "T2.8"
    assert refs["uniform.vertical"] == "T2.11"
    assert refs["drop_intra.diagonal"] == "T3.upper"
    assert refs["drop_inter.all_but.dense_vertical"] == "T3.lower"
    assignments = _assignments(6, 12)
    for row in plan:
        spec = row.to_spec(assignments, num_layers=6, num_heads=12)
        assert spec.is_empty == (row.id == "baseline")
    row = next(row for row in plan if row.id == "drop_inter.all_but.dense_vertical")
    spec = row.to_spec(assignments, num_layers=6, num_heads=12)
    assert set(spec.heads) == {("encoder", *h) for h, t in assignments.items() if t != "dense_vertical"}
    assert set(spec.operations) == {"drop_inter"}


def test_paper_plan_skips_missing_types() -> None:
    plan = paper_plan(["dense", "diagonal", "dense_vertical"])
    ids = {row.id for row in plan}
    assert not any("vertical" in i.replace("dense_vertical", "") for i in ids)
    assert "prune.dense+dense_vertical" in ids
    assert "drop_intra.all_but.dense" in ids
    assert [row.id for row in paper_plan(["diagonal"])] == [
        "baseline",
        "prune.diagonal",
        "uniform.diagonal",
        "drop_intra.diagonal",
        "drop_inter.diagonal",
    ]


def test_plan_row_of_checks_operations() -> None:
    with pytest.raises(AblationSpecError, match="unknown operation"):
        PlanRow.of("x", "x", {"zero": ["dense"]})  # type: ignore[dict-item]
