"""Edges of the head surgery (issue 14, mutation testing): masks, renormalisation, causal uniform, messages.

Every expected tensor is written by hand or in plain numpy here; messages are compared in full.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ingest.ablation import (
    AblationSpec,
    AblationSpecError,
    Ablator,
    BatchMasks,
    HeadSelection,
    _edit,
    _head_index,
    _visible_uniform,
    ablate_probs,
    segments_from_separators,
)
from ingest.attention import AttentionCall
from ingest.selection import Operation
from ingest.types import Stack
from tests.ingest.test_ablation_stacks import HEAD_DIM, _spec, bart, inputs, stacked, zeroed  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def tiny(tiny_bert_path: Path):
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(tiny_bert_path, attn_implementation="eager", dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_bert_path)


def _probs(batch: int = 2, heads: int = 3, q: int = 4, k: int = 4, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    p = torch.rand(batch, heads, q, k, generator=g, dtype=torch.float64) + 0.1
    return (p / p.sum(-1, keepdim=True)).to(dtype)


# --------------------------------------------------------------------------------------------
# BatchMasks
# --------------------------------------------------------------------------------------------


def test_batch_masks_shape_mismatch_message() -> None:
    with pytest.raises(ValueError, match="differ in shape") as err:
        BatchMasks(torch.ones(2, 3), torch.zeros(2, 4, dtype=torch.long))
    assert str(err.value) == "attention_mask (2, 3) and segment ids (2, 4) differ in shape"
    BatchMasks(None, torch.zeros(2, 4, dtype=torch.long))  # segments alone are fine
    BatchMasks(torch.ones(2, 4), None)


def test_check_compares_batch_and_keys_only() -> None:
    probs = torch.zeros(2, 3, 5, 4)  # batch 2, 3 heads, 5 queries, 4 keys (cross attention: q != k)
    BatchMasks(torch.ones(2, 4), None).check(probs, 0)  # keys match: no error
    BatchMasks(None, None).check(probs, 0)  # nothing set: nothing to compare
    with pytest.raises(RuntimeError) as err:
        BatchMasks(None, torch.zeros(2, 5, dtype=torch.long)).check(probs, 3)  # shape from the segments
    assert str(err.value) == (
        "layer 3: attention is (batch 2, keys 4) but the masks set for this batch are (2, 5); "
        "call set_batch(...) before every forward pass"
    )
    with pytest.raises(
        RuntimeError, match=r"^layer 1: attention is \(batch 2, keys 4\) but the masks set for this batch are \(3, 4\)"
    ):
        BatchMasks(torch.ones(3, 4), None).check(probs, 1)


def test_uniform_without_mask_and_with_one_real_key() -> None:
    masks = BatchMasks(None, None)
    got = masks.uniform(torch.zeros(2, 3, 5, 4, dtype=torch.float64))
    assert got.dtype == torch.float64
    assert got.shape == (2, 1, 1, 4)
    assert torch.equal(got, torch.full((2, 1, 1, 4), 0.25, dtype=torch.float64))
    one = BatchMasks(torch.tensor([[1, 0, 0], [1, 1, 1]]), None)
    got = one.uniform(torch.zeros(2, 1, 3, 3))
    expected = torch.tensor([[1.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]])[:, None, None, :]
    assert torch.equal(got, expected)


def test_mask_cache_is_per_dtype_and_per_operation() -> None:
    masks = BatchMasks(torch.tensor([[1, 1, 1, 0]]), torch.tensor([[0, 0, 1, -1]]))
    p32, p64 = torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 4, 4, dtype=torch.float64)
    assert masks.uniform(p32).dtype == torch.float32
    u64 = masks.uniform(p64)
    assert u64.dtype == torch.float64
    assert u64[0, 0, 0, 0].item() == 1 / 3  # exact in float64, not a float32 1/3
    intra = masks.keep("drop_intra", p64)
    inter = masks.keep("drop_inter", p64)
    seg = np.array([0, 0, 1, -1])
    same = (seg[:, None] == seg[None, :]).astype(np.float64)
    assert intra.dtype == torch.float64
    assert inter.dtype == torch.float64
    np.testing.assert_array_equal(intra[0, 0].numpy(), 1 - same)
    np.testing.assert_array_equal(inter[0, 0].numpy(), same)


def test_keep_without_segments_names_the_fix() -> None:
    with pytest.raises(RuntimeError) as err:
        BatchMasks(torch.ones(1, 3), None).keep("drop_inter", torch.zeros(1, 1, 3, 3))
    assert str(err.value) == "drop_inter needs segment ids: pass token_type_ids or segment_ids to set_batch"


# --------------------------------------------------------------------------------------------
# Head index, causal uniform, the edit
# --------------------------------------------------------------------------------------------


def test_head_index_is_a_slice_for_contiguous_runs_only() -> None:
    assert _head_index([2, 1]) == slice(1, 3)
    assert _head_index([3]) == slice(3, 4)
    assert _head_index([0, 1, 2]) == slice(0, 3)
    index = _head_index([0, 2])
    assert isinstance(index, torch.Tensor)
    assert index.tolist() == [0, 2]
    assert isinstance(_head_index([1, 3, 4]), torch.Tensor)


def test_visible_uniform_is_one_over_the_keys_above_half_min() -> None:
    lo = torch.finfo(torch.float32).min
    # row 0 sees key 0; row 1 keys 0, 1; row 2: key 2 sits exactly at min/2 (not above), key 1 at 0.4 min (above)
    scores = torch.tensor(
        [[[[0.5, lo, lo], [1.0, -2.0, lo], [3.0, 0.4 * lo, lo / 2]]]], dtype=torch.float32
    )  # (1, 1, 3, 3)
    got = _visible_uniform(scores, torch.float64)
    expected = np.array([[1, 0, 0], [0.5, 0.5, 0], [0.5, 0.5, 0]], dtype=np.float64)
    assert got.dtype == torch.float64
    np.testing.assert_array_equal(got[0, 0].numpy(), expected)
    # a row that sees nothing stays 0
    none = _visible_uniform(torch.full((1, 1, 1, 2), lo), torch.float32)
    assert torch.equal(none, torch.zeros(1, 1, 1, 2))


def test_edit_uniform_with_visible_scores_uses_the_causal_mask() -> None:
    lo = torch.finfo(torch.float32).min
    probs = _probs(1, 3, 3, 3)
    before = probs.clone()
    causal = torch.triu(torch.ones(3, 3, dtype=torch.bool), diagonal=1)
    scores = torch.zeros(1, 3, 3, 3).masked_fill(causal, lo)
    got = _edit(probs.clone(), [("uniform", _head_index([0, 2]))], BatchMasks(None, None), False, scores)
    tri = np.array([[1, 0, 0], [1 / 2, 1 / 2, 0], [1 / 3, 1 / 3, 1 / 3]])
    np.testing.assert_array_equal(got[0, 0].numpy(), tri)
    np.testing.assert_array_equal(got[0, 2].numpy(), tri)
    assert torch.equal(got[0, 1], before[0, 1])


@pytest.mark.parametrize("heads", [[0, 1], [0, 2]])  # a slice (in place) and an index tensor
@pytest.mark.parametrize("op", ["drop_intra", "drop_inter"])
def test_renormalised_drops_match_numpy(op: Operation, heads: list[int]) -> None:
    probs = _probs(2, 3, 4, 4)
    seg = np.array([[0, 0, 1, 1], [0, 1, 1, -1]])
    mask = (seg >= 0).astype(np.int64)
    p = probs.numpy()
    probs[1, :, :, 3] = 0.0  # padding key already 0
    p = probs.numpy().copy()
    same = seg[:, :, None] == seg[:, None, :]
    keep = (~same if op == "drop_intra" else same).astype(np.float64)[:, None]
    expected = p.copy()
    for h in heads:
        edited = p[:, h] * keep[:, 0]
        total = edited.sum(-1, keepdims=True)
        expected[:, h] = np.where(total > 0, edited / np.where(total > 0, total, 1), 0.0)
    got = ablate_probs(
        probs, {op: heads}, attention_mask=torch.tensor(mask), segment_ids=torch.tensor(seg), renormalize=True
    )
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=0)
    # sample 1, query 3 is padding (segment -1): under drop_inter nothing is left there and the row stays 0
    if op == "drop_inter":
        assert np.all(got[1, heads[0], 3].numpy() == 0)


def test_edit_copies_a_tensor_that_tracks_gradients() -> None:
    probs = _probs(1, 2, 3, 3).requires_grad_(True)
    got = _edit(probs, [("prune", _head_index([1]))], BatchMasks(None, None), False)
    assert torch.equal(got[0, 1], torch.zeros(3, 3, dtype=torch.float64))
    assert torch.equal(got[0, 0], probs[0, 0])
    assert torch.all(probs[0, 1] > 0)  # the input is untouched
    got.sum().backward()
    expected_grad = torch.ones(1, 2, 3, 3, dtype=torch.float64)
    expected_grad[0, 1] = 0
    assert probs.grad is not None
    assert torch.equal(probs.grad, expected_grad)


# --------------------------------------------------------------------------------------------
# The Ablator on the tiny BERT (2 layers x 4 heads)
# --------------------------------------------------------------------------------------------


def test_prune_only_spec_runs_without_set_batch_and_records_layers(tiny) -> None:
    model, tokenizer = tiny
    batch = tokenizer(["a cat sat"], return_tensors="pt")
    spec = AblationSpec.from_heads({(1, 2): "prune"}, 2, 4)
    with torch.inference_mode(), Ablator(model, spec) as ablator:
        model(**batch)
        assert ablator.layers_seen == {("encoder", 0), ("encoder", 1)}


def test_missing_set_batch_message(tiny) -> None:
    model, tokenizer = tiny
    batch = tokenizer(["a cat sat"], return_tensors="pt")
    spec = AblationSpec.from_heads({(0, 1): "uniform"}, 2, 4)
    with torch.inference_mode(), Ablator(model, spec):
        with pytest.raises(RuntimeError) as err:
            model(**batch)
    assert str(err.value) == "call set_batch(attention_mask, ...) before the forward pass"


def test_stale_masks_message_names_the_layer(tiny) -> None:
    model, tokenizer = tiny
    batch = tokenizer(["a cat sat", "the dog ran off"], padding=True, return_tensors="pt")
    spec = AblationSpec.from_heads({(1, 0): "uniform"}, 2, 4)
    k = batch["attention_mask"].shape[1]
    with torch.inference_mode(), Ablator(model, spec) as ablator:
        ablator.set_batch(batch["attention_mask"][:1])
        with pytest.raises(RuntimeError) as err:
            model(**batch)
    assert str(err.value).startswith(
        f"layer 1: attention is (batch 2, keys {k}) but the masks set for this batch are (1, {k})"
    )


def test_segments_needed_message(tiny) -> None:
    model, _ = tiny
    spec = AblationSpec.from_heads({(0, 0): "drop_intra"}, 2, 4)
    with Ablator(model, spec) as ablator, pytest.raises(AblationSpecError) as err:
        ablator.set_batch(torch.ones(1, 5, dtype=torch.long))
    assert str(err.value) == (
        "drop_intra/drop_inter need segments: pass token_type_ids or segment_ids "
        "(segments_from_separators for models without token types)"
    )


def test_spec_for_other_stacks_names_both(tiny) -> None:
    model, _ = tiny
    spec = AblationSpec.empty(shapes={"encoder": (2, 4), "decoder": (2, 4), "cross": (2, 4)})
    with pytest.raises(AblationSpecError) as err, Ablator(model, spec):
        pass
    message = str(err.value)
    assert message.startswith("the spec is for ")
    wanted, have = message.split(" (layers x heads) but the model has ")
    assert "decoder" in wanted
    assert "cross" in wanted
    assert "encoder" in have
    assert "decoder" not in have


# --------------------------------------------------------------------------------------------
# The Ablator on a tiny BART: the cross stack's keys and the decoder's own masks
# --------------------------------------------------------------------------------------------


def test_cross_uniform_averages_the_real_encoder_tokens(stacked, inputs) -> None:  # noqa: F811 (imported fixtures)
    """``uniform`` on a cross head: its context is the plain mean of the values of the non-padding encoder tokens."""
    layer, head = 0, 1
    attn = stacked.decoder.layers[layer].encoder_attn
    captured: dict[str, torch.Tensor] = {}

    def grab(module, args):
        captured["context"] = args[0].clone()

    handle = attn.out_proj.register_forward_pre_hook(grab)
    try:
        with (
            torch.inference_mode(),
            Ablator(stacked, _spec(HeadSelection.explicit([("cross", layer, head)]), "uniform")) as ab,
        ):
            ab.set_batch(inputs["attention_mask"])
            out = stacked(**inputs)
    finally:
        handle.remove()
    with torch.inference_mode():
        values = attn.v_proj(out.encoder_last_hidden_state)[..., head * HEAD_DIM : (head + 1) * HEAD_DIM]
    mask = inputs["attention_mask"].bool()
    for b in range(values.shape[0]):
        expected = values[b, mask[b]].mean(dim=0)  # (head_dim,), the same for every decoder query
        got = captured["context"][b, :, head * HEAD_DIM : (head + 1) * HEAD_DIM]
        torch.testing.assert_close(got, expected.expand_as(got), rtol=0, atol=1e-6)


def test_decoder_drops_read_the_decoder_segments(stacked, inputs) -> None:  # noqa: F811 (imported fixtures)
    head = ("decoder", 1, 3)
    q = inputs["decoder_input_ids"].shape[1]
    one_segment = torch.zeros(2, q, dtype=torch.long)
    with torch.inference_mode(), Ablator(stacked, _spec(HeadSelection.explicit([head]), "drop_intra")) as ab:
        with pytest.raises(AblationSpecError) as err:
            ab.set_batch(inputs["attention_mask"])
        assert str(err.value) == "drop_intra/drop_inter on the decoder stack need decoder_segment_ids"
        ab.set_batch(inputs["attention_mask"], decoder_segment_ids=one_segment)
        got = stacked(**inputs)
    # one segment: every (query, key) pair is intra-segment, so drop_intra is the pruned head
    with zeroed(stacked, [head]), torch.inference_mode():
        expected = stacked(**inputs)
    torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state, rtol=0, atol=1e-6)


def test_decoder_masks_are_checked_against_the_decoder_batch(stacked, inputs) -> None:  # noqa: F811 (imported fixtures)
    spec = _spec(HeadSelection.explicit([("decoder", 0, 2)]), "uniform")
    q = inputs["decoder_input_ids"].shape[1]
    with torch.inference_mode(), Ablator(stacked, spec) as ab:
        ab.set_batch(inputs["attention_mask"], decoder_attention_mask=torch.ones(1, q, dtype=torch.long))
        with pytest.raises(RuntimeError) as err:
            stacked(**inputs)
    assert str(err.value).startswith(
        f"layer 0: attention is (batch 2, keys {q}) but the masks set for this batch are (1, {q})"
    )


def test_segments_from_several_separator_ids() -> None:
    # A 1 B 2 C 1 <pad>: separators 1 and 2 both close a segment
    ids = torch.tensor([[5, 1, 6, 2, 7, 1, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    expected = [[0, 0, 1, 1, 2, 2, -1]]
    assert segments_from_separators(ids, [1, 2], mask).tolist() == expected
    assert segments_from_separators(ids, {1, 2}, mask).tolist() == expected
    assert segments_from_separators(ids, (i for i in (1, 2)), mask).tolist() == expected


def test_ablator_renormalises_when_the_spec_says_so(tiny) -> None:
    """The forward pass's edited probabilities, against the rule in numpy on the model's own probabilities."""
    model, tokenizer = tiny
    batch = tokenizer(
        ["Where is the cat?", "Who?"], ["On the mat.", "Me, long ago."], padding=True, return_tensors="pt"
    )
    spec = AblationSpec.from_heads({(0, 1): "drop_inter", (0, 2): "drop_intra"}, 2, 4, renormalize=True)
    captured: dict[str, torch.Tensor] = {}
    with torch.inference_mode(), Ablator(model, spec) as ablator:
        ablator.set_batch(batch["attention_mask"], token_type_ids=batch["token_type_ids"])
        edit = ablator._callback

        def spy(call):
            if (call.stack, call.layer) == ("encoder", 0):
                captured["before"] = call.probs.clone()
            out = edit(call)
            if (call.stack, call.layer) == ("encoder", 0):
                assert out is not None  # layer 0 has heads to edit
                captured["after"] = out.clone()
            return out

        ablator._probe.callback = spy
        ablator._probe._state.callback = spy
        model(**batch)
    before, after = captured["before"].double().numpy(), captured["after"].double().numpy()
    types, mask = batch["token_type_ids"].numpy(), batch["attention_mask"].numpy()
    for b in range(types.shape[0]):
        seg = np.where(mask[b] == 1, types[b], -1)  # each pair's types are one run of 0s then one of 1s
        same = seg[:, None] == seg[None, :]
        for head, keep in ((1, same), (2, ~same)):
            edited = before[b, head] * keep
            total = edited.sum(-1, keepdims=True)
            expected = np.where(total > 0, edited / np.where(total > 0, total, 1), 0.0)
            np.testing.assert_allclose(after[b, head], expected, rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(after[b, [0, 3]], before[b, [0, 3]])


def test_single_stack_spec_for_another_stack_is_not_a_size_mismatch(tiny, bart) -> None:  # noqa: F811
    model, _ = tiny
    with pytest.raises(AblationSpecError) as err, Ablator(model, AblationSpec.empty(shapes={"decoder": (2, 4)})):
        pass
    assert " (layers x heads) but the model has " in str(err.value)  # the stacks differ, not the sizes
    # bart's stacks, other sizes
    three: dict[Stack, tuple[int, int]] = {"encoder": (2, 4), "decoder": (3, 4), "cross": (3, 4)}
    with pytest.raises(AblationSpecError) as err, Ablator(bart, AblationSpec.empty(shapes=three)):
        pass
    assert " (layers x heads) but the model has " in str(err.value)


def test_callback_refuses_calls_the_spec_cannot_place(tiny) -> None:
    """Guards against a model whose calls do not match what ``model_shapes`` reported."""
    model, _ = tiny
    spec = AblationSpec.from_heads({(0, 1): "prune"}, 2, 4)
    probs = torch.full((1, 3, 2, 2), 0.5)
    with Ablator(model, spec) as ablator:
        with pytest.raises(RuntimeError) as err:
            ablator._callback(AttentionCall(layer=0, probs=probs, scores=probs, module=model, stack="cross"))
        assert str(err.value) == "the model called cross attention (layer 0) but the spec knows only the stacks encoder"
        with pytest.raises(RuntimeError) as err:
            ablator._callback(AttentionCall(layer=0, probs=probs, scores=probs, module=model))
        assert str(err.value) == "encoder layer 0 has 3 heads, the spec 4"


def test_padding_queries_keep_their_keys_under_drop_intra(tiny) -> None:
    """Padding is segment -1 (never a real token's segment), also when its token type equals the sentence's."""
    model, tokenizer = tiny
    batch = tokenizer(["a cat", "the dog ran off far away"], padding=True, return_tensors="pt")
    assert batch["attention_mask"][0].tolist().count(0) > 0  # the first sentence is padded, token type 0 like it
    spec = AblationSpec.from_heads({(0, 3): "drop_intra"}, 2, 4)
    captured: dict[str, torch.Tensor] = {}
    with torch.inference_mode(), Ablator(model, spec) as ablator:
        ablator.set_batch(batch["attention_mask"], token_type_ids=batch["token_type_ids"])
        edit = ablator._callback

        def spy(call):
            out = edit(call)
            if (call.stack, call.layer) == ("encoder", 0):
                assert out is not None  # layer 0 has a head to edit
                captured["before"], captured["after"] = call.probs.clone(), out.clone()
            return out

        ablator._probe.callback = spy
        ablator._probe._state.callback = spy
        model(**batch)
    pad = batch["attention_mask"][0] == 0
    real = ~pad
    # one segment per sentence: every real query loses all its (real) keys; padding queries lose nothing
    assert torch.equal(captured["after"][0, 3][real], torch.zeros_like(captured["after"][0, 3][real]))
    assert torch.equal(captured["after"][0, 3][pad], captured["before"][0, 3][pad])
    assert captured["before"][0, 3][pad][:, real].sum() > 0  # there was mass to lose


def test_unknown_stack_message_lists_every_known_stack(bart) -> None:  # noqa: F811
    spec = _spec(HeadSelection.explicit([("cross", 0, 1)]))
    probs = torch.full((1, 4, 2, 2), 0.5)
    with Ablator(bart, spec) as ablator, pytest.raises(RuntimeError) as err:
        ablator._callback(AttentionCall(layer=0, probs=probs, scores=probs, module=bart, stack="vision"))  # type: ignore[arg-type]
    assert str(err.value) == (
        "the model called vision attention (layer 0) but the spec knows only the stacks encoder, decoder, cross"
    )
