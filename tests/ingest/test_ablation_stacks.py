"""Stack-aware ablation (SPEC section 6): a head is ``(stack, layer, head)``.

The references are independent of headcat's probe: forward pre-hooks on each attention module's
output projection zero one head's slice of the context ``(batch, q, heads * head_dim)``, which
is what setting that head's probabilities to 0 does. The tiny BART has its query/key weights
scaled up so heads differ (at default init attention is near uniform).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
import torch

from ingest.ablation import AblationSpec, AblationSpecError, Ablator, HeadSelection, model_shapes
from ingest.attention import AttentionCall, AttentionProbe
from ingest.types import Stack

LAYERS, HEADS, HEAD_DIM = 2, 4, 8


@pytest.fixture(scope="module")
def bart() -> Any:
    from transformers import BartConfig, BartModel

    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=64,
        d_model=HEADS * HEAD_DIM,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        init_std=0.1,
        attn_implementation="eager",  # type: ignore[call-arg]  # PretrainedConfig takes it through **kwargs
    )
    model = BartModel(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "q_proj") and hasattr(module, "k_proj"):
                module.q_proj.weight.mul_(6.0)
                module.k_proj.weight.mul_(6.0)
    return model


@pytest.fixture(scope="module")
def inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(4, 64, (2, 9), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0  # padding in the second sample
    decoder_input_ids = torch.randint(4, 64, (2, 7), generator=generator)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "decoder_input_ids": decoder_input_ids}


def _attention(model: Any, stack: str, layer: int) -> Any:
    if stack == "encoder":
        return model.encoder.layers[layer].self_attn
    if stack == "decoder":
        return model.decoder.layers[layer].self_attn
    return model.decoder.layers[layer].encoder_attn


@contextmanager
def zeroed(model: Any, heads: list[tuple[str, int, int]]) -> Iterator[None]:
    """The independent reference: zero these heads' context slices before each out_proj."""
    with ExitStack() as stack:
        for name, layer, head in heads:

            def hook(module: Any, args: tuple[torch.Tensor, ...], head: int = head) -> tuple[torch.Tensor, ...]:
                context = args[0].clone()  # (batch, q, heads * head_dim)
                context[..., head * HEAD_DIM : (head + 1) * HEAD_DIM] = 0
                return (context, *args[1:])

            stack.callback(_attention(model, name, layer).out_proj.register_forward_pre_hook(hook).remove)
        yield


def _tags_stacks(model: Any, inputs: dict[str, torch.Tensor]) -> bool:
    seen: set[str] = set()

    def callback(call: AttentionCall) -> None:
        seen.add(call.stack)

    with torch.inference_mode(), AttentionProbe(model, callback):
        model(**inputs)
    return seen == {"encoder", "decoder", "cross"}


@pytest.fixture(scope="module")
def stacked(bart: Any, inputs: dict[str, torch.Tensor]) -> Any:
    if not _tags_stacks(bart, inputs):
        pytest.skip(
            "this checkout's attention path does not yet tag BART's calls with their stacks "
            "(issue 9, the attention half); the Ablator keys by (call.stack, call.layer)"
        )
    return bart


def _run(model: Any, inputs: dict[str, torch.Tensor], spec: AblationSpec | None = None) -> Any:
    with torch.inference_mode():
        if spec is None:
            return model(**inputs)
        with Ablator(model, spec) as ablator:
            ablator.set_batch(inputs["attention_mask"])
            return model(**inputs)


def _spec(selection: HeadSelection, op: str = "prune") -> AblationSpec:
    return AblationSpec.build({op: selection}, shapes={"encoder": (2, 4), "decoder": (2, 4), "cross": (2, 4)})  # type: ignore[dict-item]


def test_model_shapes_of_an_encoder_decoder(bart: Any) -> None:
    from transformers import GPT2Config, GPT2Model, T5Config, T5EncoderModel, T5Model

    assert model_shapes(bart) == {"encoder": (2, 4), "decoder": (2, 4), "cross": (2, 4)}
    t5 = T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=3, num_heads=4)
    assert model_shapes(T5Model(t5)) == {"encoder": (2, 4), "decoder": (3, 4), "cross": (3, 4)}
    assert model_shapes(T5EncoderModel(t5)) == {"encoder": (2, 4)}  # the encoder of a T5 checkpoint alone
    gpt2 = GPT2Config(vocab_size=32, n_embd=16, n_layer=3, n_head=2, n_positions=16)
    assert model_shapes(GPT2Model(gpt2)) == {"decoder": (3, 2)}  # causal self-attention


@pytest.mark.parametrize("head", [("decoder", 0, 1), ("cross", 1, 2), ("encoder", 1, 3)])
def test_prune_one_head_of_a_stack_is_zeroing_its_context(stacked: Any, inputs: dict[str, torch.Tensor], head) -> None:
    baseline = _run(stacked, inputs)
    with zeroed(stacked, [head]), torch.inference_mode():
        expected = stacked(**inputs)
    got = _run(stacked, inputs, _spec(HeadSelection.explicit([head])))
    torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.encoder_last_hidden_state, expected.encoder_last_hidden_state, rtol=0, atol=1e-6)
    own = "encoder_last_hidden_state" if head[0] == "encoder" else "last_hidden_state"
    assert (getattr(got, own) - getattr(baseline, own)).abs().max() > 1e-3  # the head mattered
    if head[0] != "encoder":  # the encoder never sees a decoder or cross edit
        assert torch.equal(got.encoder_last_hidden_state, baseline.encoder_last_hidden_state)


def test_a_stacked_layer_rule_leaves_other_stacks_alone(stacked: Any, inputs: dict[str, torch.Tensor]) -> None:
    """``encoder:layers:0`` prunes encoder layer 0 only; before stacks it pruned the decoder's and cross's too."""
    every_head = [("encoder", 0, h) for h in range(HEADS)]
    with zeroed(stacked, every_head), torch.inference_mode():
        expected = stacked(**inputs)
    with zeroed(stacked, [(s, 0, h) for s in ("encoder", "decoder", "cross") for h in range(HEADS)]):
        with torch.inference_mode():
            all_stacks = stacked(**inputs)
    got = _run(stacked, inputs, _spec(HeadSelection.layers([0], stack="encoder")))
    torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state, rtol=0, atol=1e-6)
    assert (got.last_hidden_state - all_stacks.last_hidden_state).abs().max() > 1e-3
    # no stack named: every stack's layer 0
    got_all = _run(stacked, inputs, _spec(HeadSelection.layers([0])))
    torch.testing.assert_close(got_all.last_hidden_state, all_stacks.last_hidden_state, rtol=0, atol=1e-6)


def test_uniform_on_the_decoder_stays_causal(stacked: Any, inputs: dict[str, torch.Tensor]) -> None:
    """``uniform`` on a causal head spreads each query over the keys it can see, never the future."""
    captured: dict[str, torch.Tensor] = {}
    spec = _spec(HeadSelection.explicit([("decoder", 0, 2)]), "uniform")

    with torch.inference_mode(), Ablator(stacked, spec) as ablator:
        ablator.set_batch(inputs["attention_mask"])
        edit = ablator._callback

        def spy(call: AttentionCall) -> torch.Tensor | None:
            out = edit(call)
            if (call.stack, call.layer) == ("decoder", 0):
                captured["probs"] = out  # type: ignore[assignment]
            return out

        ablator._probe.callback = spy
        ablator._probe._state.callback = spy
        stacked(**inputs)
    probs = captured["probs"][:, 2]  # (batch, q, k)
    q = probs.shape[-1]
    expected = torch.tril(torch.ones(q, q)) / torch.arange(1, q + 1)[:, None]
    torch.testing.assert_close(probs, expected.expand_as(probs), rtol=0, atol=1e-7)


def test_stacked_specs_are_validated_before_any_compute(bart: Any) -> None:
    shapes: dict[Stack, tuple[int, int]] = {"encoder": (2, 4), "decoder": (3, 4)}
    with pytest.raises(AblationSpecError, match="the model has no cross stack; its stacks: encoder, decoder"):
        AblationSpec.build({"prune": HeadSelection.layers([0], stack="cross")}, shapes=shapes)
    with pytest.raises(AblationSpecError, match="layer 2 is out of range: the encoder stack has 2 layers.*name one"):
        AblationSpec.build({"prune": HeadSelection.layers([2])}, shapes=shapes)  # decoder has it, encoder not
    spec = AblationSpec.build({"prune": HeadSelection.layers([2], stack="decoder")}, shapes=shapes)
    assert set(spec.heads) == {("decoder", 2, h) for h in range(4)}
    with pytest.raises(AblationSpecError, match="names no stack but the model has 2"):
        AblationSpec.from_heads({(0, 0): "prune"}, shapes=shapes)
    with pytest.raises(AblationSpecError, match="not defined on the cross stack"):
        AblationSpec.build({"drop_intra": HeadSelection.all_heads(stack="cross")}, shapes=model_shapes(bart))
    drops = AblationSpec.build({"drop_intra": HeadSelection.layers([0])}, shapes=model_shapes(bart))
    assert {stack for stack, _, _ in drops.heads} == {"encoder", "decoder"}  # "every stack" it is defined on
    encoder_only = AblationSpec.build({"prune": HeadSelection.layers([0])}, num_layers=2, num_heads=4)
    with pytest.raises(AblationSpecError, match="spec is for encoder 2 x 4 .* the model has encoder 2 x 4, decoder"):
        with Ablator(bart, encoder_only):
            pass
    assert bart.config._attn_implementation == "eager"


def test_types_by_stack_and_round_trip() -> None:
    shapes: dict[Stack, tuple[int, int]] = {"encoder": (1, 2), "decoder": (1, 2), "cross": (1, 2)}
    assignments: dict[tuple[Stack, int, int], str] = {
        ("encoder", 0, 0): "dense",
        ("encoder", 0, 1): "vertical",
        ("decoder", 0, 0): "vertical",
        ("decoder", 0, 1): "diagonal",
        ("cross", 0, 0): "vertical",
        ("cross", 0, 1): "dense",
    }
    everywhere = AblationSpec.build({"prune": "vertical"}, assignments, shapes=shapes)
    assert set(everywhere.heads) == {("encoder", 0, 1), ("decoder", 0, 0), ("cross", 0, 0)}
    decoder = HeadSelection.of_type("vertical", stack="decoder")
    spec = AblationSpec.build({"prune": decoder, "uniform": [("cross", 0, 1)]}, assignments, shapes=shapes)
    assert spec.heads == {("decoder", 0, 0): "prune", ("cross", 0, 1): "uniform"}
    assert AblationSpec.from_dict(spec.to_dict()) == spec
    assert HeadSelection.from_dict(decoder.to_dict()) == decoder
    assert spec.to_dict()["ops"] == {"prune": [["decoder", 0, 0]], "uniform": [["cross", 0, 1]]}
    assert spec.by_layer() == {("decoder", 0): [("prune", [0])], ("cross", 0): [("uniform", [1])]}
    with pytest.raises(AblationSpecError, match=r"diagonal select no head of the encoder stack"):
        AblationSpec.build({"prune": HeadSelection.of_type("diagonal", stack="encoder")}, assignments, shapes=shapes)
    # a stored spec from before stacks reads as an encoder's
    old = {"num_layers": 2, "num_heads": 4, "renormalize": False, "ops": {"prune": [[1, 2]]}}
    assert AblationSpec.from_dict(old).heads == {("encoder", 1, 2): "prune"}
