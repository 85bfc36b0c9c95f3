"""The attention probe itself, model by model, against ``output_attentions=True`` in eager mode.

Each tiny random model of ``test_architectures`` (query/key weights scaled up so heads differ) is
run once eagerly with ``output_attentions=True`` and once under :class:`AttentionProbe`; the
probabilities the probe hands its callback, per ``(stack, layer)``, must be the eager model's,
exactly where it places them. Replacements (``callback`` and ``on_output``) are checked against
an independent mechanism: a forward pre-hook on the output projection that edits one head's slice
of its input. Every refusal's message is asserted in full.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers as tf
from torch import nn
from transformers.models.bert.modeling_bert import BertSelfAttention

from ingest.attention import AttentionCall, AttentionProbe, OutputCall, UnsupportedAttention, attention_sites
from tests.ingest.test_architectures import ENCODER, FAMILIES, SIZE, build

# --- helpers -----------------------------------------------------------------------------------


def _family(name: str) -> Any:
    return next(family for family in FAMILIES if family.name == name)


def _inputs(model: Any, batch: int = 3, length: int = 7, pad: int = 2) -> dict[str, torch.Tensor]:
    """Random ids (no special meaning) with the last sample padded by ``pad`` tokens."""
    generator = torch.Generator().manual_seed(3)
    vocab = int(model.config.get_text_config().vocab_size)
    ids = torch.randint(5, vocab, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[-1, length - pad :] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = torch.randint(5, vocab, (batch, length - 2), generator=generator)
    return inputs


def eager_maps(model: Any, inputs: dict[str, torch.Tensor], stack: str = "encoder") -> dict[tuple[str, int], Any]:
    """``(stack, layer) -> (batch, head, q, k)`` from ``output_attentions=True`` (eager)."""
    with torch.no_grad():
        output = model(**inputs, output_attentions=True)
    if model.config.is_encoder_decoder:
        stacks = {"encoder": output.encoder_attentions, "decoder": output.decoder_attentions,
                  "cross": output.cross_attentions}  # fmt: skip
    else:
        stacks = {stack: output.attentions}
    return {(name, layer): maps for name, layers in stacks.items() for layer, maps in enumerate(layers)}


def probed_maps(model: Any, inputs: dict[str, torch.Tensor], **options: Any) -> dict[tuple[str, int], Any]:
    """``(stack, layer) -> (batch, head, q, k)`` as the probe's callback sees them (sub-batches put back by row)."""
    seen: dict[tuple[str, int], dict[int, torch.Tensor]] = {}

    def record(call: AttentionCall) -> None:
        parts = seen.setdefault((call.stack, call.layer), {})
        assert call.rows not in parts, "one row seen twice"
        parts[call.rows] = call.probs.clone()

    with torch.no_grad(), AttentionProbe(model, record, **options):
        model(**inputs)
    return {key: torch.cat([parts[row] for row in sorted(parts)]) for key, parts in seen.items()}


def assert_same_maps(got: dict[tuple[str, int], Any], want: dict[tuple[str, int], Any]) -> None:
    assert sorted(got) == sorted(want)
    for key, maps in want.items():
        try:
            torch.testing.assert_close(got[key], maps, atol=1e-6, rtol=1e-6)
        except AssertionError as error:
            raise AssertionError(f"{key}: {error}") from None


# --- a forward under a decorator ---------------------------------------------------------------


def _passthrough(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator defined here, as transformers 5.24's ``deprecate_kwarg`` wraps attention forwards."""

    @functools.wraps(forward)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        return forward(self, *args, **kwargs)

    return wrapper


class DecoratedSelfAttention(BertSelfAttention):
    """BERT's self-attention, its forward wrapped by a decorator of this file (whose eager function is not BERT's)."""

    forward = _passthrough(inspect.unwrap(BertSelfAttention.forward))


def test_a_decorated_forward_is_seen_and_follows_its_own_eager_function() -> None:
    model = build(_family("bert"))
    for layer in model.encoder.layer:
        layer.attention.self.__class__ = DecoratedSelfAttention
    inputs = _inputs(model)
    FALLBACK_CALLS.clear()
    assert_same_maps(probed_maps(model, inputs), eager_maps(model, inputs))
    assert FALLBACK_CALLS == []  # BERT's own eager function ran, not the one of the decorator's file (this one)


# --- every family: the probe's maps are the eager model's, whole and in sub-batches --------------


@pytest.fixture(scope="module", params=FAMILIES, ids=[family.name for family in FAMILIES])
def family_model(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    return request.param, build(request.param)


@pytest.mark.parametrize("max_map_bytes", [None, 1, 10**9], ids=["whole", "one-sample-calls", "large-budget"])
def test_probe_maps_are_the_eager_maps(family_model: tuple[Any, Any], max_map_bytes: int | None) -> None:
    family, model = family_model
    inputs = _inputs(model)
    want = eager_maps(model, inputs, stack=next(iter(family.stacks)))
    assert_same_maps(probed_maps(model, inputs, max_map_bytes=max_map_bytes), want)
    assert {stack: (1 + max(layer for s, layer in want if s == stack), want[stack, 0].shape[1])
            for stack, _ in want} == family.stacks  # fmt: skip


def test_scores_are_what_the_softmax_saw_and_a_callbacks_own_softmax_is_not_probed() -> None:
    model = build(_family("llama"))  # grouped key/value heads: 4 query heads over 2 key/value heads
    inputs = _inputs(model)
    want = eager_maps(model, inputs, stack="decoder")
    calls: list[tuple[str, int, int, nn.Module]] = []

    def check(call: AttentionCall) -> None:
        # torch.nn.functional.softmax on purpose: the callback's own softmax must not count as the model's.
        torch.testing.assert_close(nn.functional.softmax(call.scores, dim=-1), want[call.stack, call.layer])
        calls.append((call.stack, call.layer, call.rows, call.module))

    with torch.no_grad(), AttentionProbe(model, check):
        model(**inputs)
    assert calls == [("decoder", 0, 0, model.layers[0].self_attn), ("decoder", 1, 0, model.layers[1].self_attn)]


@pytest.mark.parametrize(("max_map_bytes", "rows"), [(1, [0, 1, 2]), (4 * 7 * 7 * 4 * 2, [0, 2]), (10**9, [0])])
def test_sub_batch_rows(max_map_bytes: int, rows: list[int]) -> None:
    """Maps of 4 heads x 7 x 7 float32 take 784 bytes a sample: a budget of two samples runs calls of 2 and 1."""
    model = build(_family("bert"))
    seen: list[tuple[int, int, int]] = []
    with (
        torch.no_grad(),
        AttentionProbe(
            model, lambda call: seen.append((call.layer, call.rows, call.probs.shape[0])), max_map_bytes=max_map_bytes
        ),
    ):
        model(**_inputs(model))
    expected = [(layer, row, (rows + [3])[i + 1] - row) for layer in (0, 1) for i, row in enumerate(rows)]
    assert seen == expected


# --- where the attention modules are: (stack, layer) from the structure -------------------------


def _sites(model: nn.Module) -> list[tuple[str, str, int]]:
    return [(site.name, site.stack, site.layer) for site in attention_sites(model)]


def test_sites_of_encoder_decoders_by_path() -> None:
    bart = [(f"encoder.layers.{i}.self_attn", "encoder", i) for i in range(2)]
    bart += [(f"decoder.layers.{i}.self_attn", "decoder", i) for i in range(3)]
    bart += [(f"decoder.layers.{i}.encoder_attn", "cross", i) for i in range(3)]
    assert _sites(build(_family("bart"))) == bart
    t5 = [(f"encoder.block.{i}.layer.0.SelfAttention", "encoder", i) for i in range(2)]
    t5 += [(f"decoder.block.{i}.layer.0.SelfAttention", "decoder", i) for i in range(3)]
    t5 += [(f"decoder.block.{i}.layer.1.EncDecAttention", "cross", i) for i in range(3)]
    assert _sites(build(_family("t5"))) == t5


def test_sites_of_a_decoder_with_cross_attention_by_flag_and_name() -> None:
    """A BERT decoder (causal, no encoder-decoder config) with cross-attention: ``crossattention`` by its name."""
    config = tf.BertConfig(**ENCODER, is_decoder=True, add_cross_attention=True)
    expected = [(f"encoder.layer.{i}.attention.self", "decoder", i) for i in range(2)]
    expected += [(f"encoder.layer.{i}.crossattention.self", "cross", i) for i in range(2)]
    assert _sites(tf.BertModel(config)) == expected


def test_sites_of_modules_named_anyhow() -> None:
    """Outside a model: no config, cross-attention by name or by ``is_cross_attention``, layers by call order
    where a path has no index."""
    config = tf.GPT2Config(**SIZE, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    holder = nn.ModuleDict(
        {
            "cross_attn": BertSelfAttention(tf.BertConfig(**ENCODER)),
            "cross_attention": BertSelfAttention(tf.BertConfig(**ENCODER)),
            "flagged": tf.models.gpt2.modeling_gpt2.GPT2Attention(config, is_cross_attention=True),
            "causal": tf.models.gpt2.modeling_gpt2.GPT2Attention(config),
            "plain": BertSelfAttention(tf.BertConfig(**ENCODER)),
        }
    )
    assert _sites(holder) == [
        ("plain", "encoder", -1),
        ("causal", "decoder", -1),
        ("cross_attn", "cross", -1),
        ("cross_attention", "cross", -1),
        ("flagged", "cross", -1),
    ]
    decoder = nn.ModuleList([BertSelfAttention(tf.BertConfig(**ENCODER, is_decoder=True)) for _ in range(2)])
    assert _sites(decoder) == [("0", "decoder", 0), ("1", "decoder", 1)]  # is_decoder: causal


def test_layers_rank_within_their_stack_or_go_by_call_order() -> None:
    gaps = nn.ModuleList([BertSelfAttention(tf.BertConfig(**ENCODER)), nn.Identity(),
                          BertSelfAttention(tf.BertConfig(**ENCODER))])  # fmt: skip
    assert _sites(gaps) == [("0", "encoder", 0), ("2", "encoder", 1)]  # indexes 0 and 2: layers 0 and 1
    two_per_layer = nn.ModuleList([nn.ModuleList([BertSelfAttention(tf.BertConfig(**ENCODER)) for _ in range(2)])])
    assert _sites(two_per_layer) == [("0.0", "encoder", -1), ("0.1", "encoder", -1)]  # one index, two modules
    albert = build(_family("albert"))  # one shared layer, 2 configured
    assert _sites(albert) == [("encoder.albert_layer_groups.0.albert_layers.0.attention", "encoder", -1)]
    albert.config.num_hidden_layers = 1
    assert _sites(albert) == [("encoder.albert_layer_groups.0.albert_layers.0.attention", "encoder", 0)]


class _Config:
    """A config with only the attribute named, as configs outside transformers' attribute maps have."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)


class _Holder(nn.Module):
    def __init__(self, config: Any, layers: int) -> None:
        super().__init__()
        self.config = config
        self.layer = nn.ModuleList([BertSelfAttention(tf.BertConfig(**ENCODER)) for _ in range(layers)])


@pytest.mark.parametrize("key", ["num_hidden_layers", "n_layers", "n_layer", "num_layers"])
def test_fewer_modules_than_configured_layers_go_by_call_order(key: str) -> None:
    assert _sites(_Holder(_Config(**{key: 3}), 2)) == [("layer.0", "encoder", -1), ("layer.1", "encoder", -1)]
    assert _sites(_Holder(_Config(**{key: 2}), 2)) == [("layer.0", "encoder", 0), ("layer.1", "encoder", 1)]


def test_configured_layers_are_read_from_the_text_config_and_only_as_integers() -> None:
    class Multimodal(_Config):
        def get_text_config(self) -> Any:
            return _Config(num_hidden_layers=None, n_layers="3", n_layer=3)

    assert _sites(_Holder(Multimodal(num_hidden_layers=2), 2))[0] == ("layer.0", "encoder", -1)
    assert _sites(_Holder(_Config(num_hidden_layers=2.0, num_layers=3), 2))[0] == ("layer.0", "encoder", -1)
    # an encoder-decoder config: fewer modules than configured layers (a shorter decoder) is no sharing
    assert _sites(_Holder(_Config(num_layers=3, is_encoder_decoder=True), 2))[1] == ("layer.1", "encoder", 1)


# --- refusals, each message in full ------------------------------------------------------------

NO_INTERFACE = (
    "no attention module dispatches through transformers' AttentionInterface and none has a headcat adapter, "
    "so headcat cannot see its attention probabilities"
)


def test_a_model_without_visible_attention_is_refused_naming_it() -> None:
    xlnet = tf.XLNetModel(tf.XLNetConfig(vocab_size=30, d_model=32, n_layer=1, n_head=2, d_inner=32))
    with pytest.raises(UnsupportedAttention) as error:
        attention_sites(xlnet)
    assert str(error.value) == f"architecture 'xlnet': {NO_INTERFACE}"
    # DeBERTa v1 has a DisentangledSelfAttention too, but only DeBERTa-v2/v3's is verified and adapted
    with pytest.raises(UnsupportedAttention) as error:
        AttentionProbe(tf.DebertaModel(tf.DebertaConfig(**ENCODER)), lambda call: None).__enter__()
    assert str(error.value) == f"architecture 'deberta': {NO_INTERFACE}"
    with pytest.raises(UnsupportedAttention) as error:
        attention_sites(_Holder(_Config(), 0))  # a config without model_type: the class is named
    assert str(error.value) == f"architecture '_Holder': {NO_INTERFACE}"


MIXED = "mixes adapted and AttentionInterface attention modules: not supported"


def test_adapted_and_interface_modules_in_one_model_are_refused() -> None:
    holder = _Holder(_Config(model_type="hybrid"), 1)
    holder.other = tf.MPNetModel(tf.MPNetConfig(**ENCODER))
    with pytest.raises(UnsupportedAttention) as error:
        attention_sites(holder)
    assert (
        str(error.value)
        == "architecture 'hybrid' mixes adapted and AttentionInterface attention modules: not supported"
    )
    mixed = nn.ModuleDict({"a": tf.BertModel(tf.BertConfig(**ENCODER)), "b": tf.MPNetModel(tf.MPNetConfig(**ENCODER))})
    with pytest.raises(UnsupportedAttention) as error:
        attention_sites(mixed)
    assert (
        str(error.value)
        == "architecture 'ModuleDict' mixes adapted and AttentionInterface attention modules: not supported"
    )


def _bert_eager_with(monkeypatch: pytest.MonkeyPatch, normalise: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """BERT's eager attention with ``normalise`` in place of its softmax (the probe looks the function up per call)."""

    def eager(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float, **_: Any) -> Any:
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling + attention_mask
        probs = normalise(scores)[..., : key.shape[2]]
        return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs

    monkeypatch.setattr(tf.models.bert.modeling_bert, "eager_attention_forward", eager)


def _refusal(model: Any, inputs: dict[str, torch.Tensor]) -> str:
    with pytest.raises(UnsupportedAttention) as error, torch.no_grad(), AttentionProbe(model, lambda call: None):
        model(**inputs)
    return str(error.value)


SOFTMAX = nn.functional.softmax
BERT_REFUSED = "architecture 'bert' (BertSelfAttention) is not supported: "
SINKS = "probabilities headcat reduces (learned sinks or another normaliser)"


@pytest.mark.parametrize(
    ("normalise", "problem"),
    [
        (lambda s: SOFTMAX(SOFTMAX(s, dim=-1), dim=-1), "its attention calls softmax more than once"),
        (lambda s: torch.softmax(s, dim=-1), "its attention computed no softmax that headcat could see"),
        (
            lambda s: SOFTMAX(s, dim=2),
            f"its attention softmax is over (3, 4, 7, 7) (dim 2), not the (batch, head, q, k) = 3x4x7x7 {SINKS}",
        ),
        (
            lambda s: SOFTMAX(s, dim=1),
            f"its attention softmax is over (3, 4, 7, 7) (dim 1), not the (batch, head, q, k) = 3x4x7x7 {SINKS}",
        ),
        (
            lambda s: SOFTMAX(s.flatten(0, 1), dim=-1).view_as(s),
            f"its attention softmax is over (12, 7, 7) (dim -1), not the (batch, head, q, k) = 3x4x7x7 {SINKS}",
        ),
        (
            lambda s: SOFTMAX(torch.cat([s, torch.zeros_like(s[..., :1])], -1), dim=-1),
            f"its attention softmax is over (3, 4, 7, 8) (dim -1), not the (batch, head, q, k) = 3x4x7x7 {SINKS}",
        ),
        (
            lambda s: SOFTMAX(s[:, :2], dim=-1).repeat(1, 2, 1, 1),
            f"its attention softmax is over (3, 2, 7, 7) (dim -1), not the (batch, head, q, k) = 3x4x7x7 {SINKS}",
        ),
        (
            lambda s: SOFTMAX(s[:, :, :6], dim=-1),
            f"its attention softmax is over (3, 4, 6, 7) (dim -1), not the (batch, head, q, k) = 3x4x7x7 {SINKS}",
        ),
    ],
    ids=["twice", "none", "dim-2", "dim-1", "flattened", "sink-column", "fewer-heads", "fewer-queries"],
)
def test_an_attention_softmax_headcat_cannot_see_exactly_is_refused(
    monkeypatch: pytest.MonkeyPatch, normalise: Callable[[torch.Tensor], torch.Tensor], problem: str
) -> None:
    model = build(_family("bert"))
    inputs = _inputs(model)
    _bert_eager_with(monkeypatch, normalise)
    assert _refusal(model, inputs) == BERT_REFUSED + problem


def test_a_softmax_over_the_last_dimension_by_its_index_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build(_family("bert"))
    inputs = _inputs(model)
    want = eager_maps(model, inputs)
    _bert_eager_with(monkeypatch, lambda s: SOFTMAX(s, dim=3))
    assert_same_maps(probed_maps(model, inputs), want)


def test_an_adapted_softmax_over_another_head_count_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from ingest import attention

    model = build(_family("mpnet"))
    adapter = attention.ADAPTERS["MPNetSelfAttention"]
    monkeypatch.setitem(attention.ADAPTERS, "MPNetSelfAttention", dataclasses.replace(adapter, num_heads=lambda s: 3))
    assert _refusal(model, _inputs(model)) == (
        "architecture 'mpnet' (MPNetSelfAttention) is not supported: its attention softmax is over (3, 4, 7, 7) "
        f"(dim -1), not the (batch, head, q, k) = (batch, 3, q, k) {SINKS}"
    )


def test_a_module_file_without_an_eager_function_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build(_family("bert"))
    monkeypatch.setattr(tf.models.bert.modeling_bert, "eager_attention_forward", None)
    assert _refusal(model, _inputs(model)) == (
        "architecture 'bert' (BertSelfAttention) has no eager_attention_forward for headcat to follow"
    )


def test_a_module_of_another_model_is_refused() -> None:
    model, other = build(_family("bert")), build(_family("bert"))
    other.set_attn_implementation("headcat")
    with pytest.raises(RuntimeError) as error, torch.no_grad(), AttentionProbe(model, lambda call: None):
        other(**_inputs(other))
    assert str(error.value) == "BertSelfAttention is not an attention module of the model the probe was entered on"


def test_a_callback_must_keep_the_shape() -> None:
    model = build(_family("bert"))
    with pytest.raises(ValueError, match=r"^a probe callback returned shape \(1, 4, 7, 7\), not \(3, 4, 7, 7\)$"):
        with torch.no_grad(), AttentionProbe(model, lambda call: call.probs[:1]):
            model(**_inputs(model))


@pytest.mark.parametrize("budget", [0, -5])
def test_max_map_bytes_must_be_positive(budget: int) -> None:
    with pytest.raises(ValueError, match=rf"^max_map_bytes must be at least 1, not {budget}$"):
        AttentionProbe(nn.Identity(), lambda call: None, max_map_bytes=budget)


# --- replacements, per-head outputs, one pass after another, and after the probe -----------------


def _hooked(model: Any, path: str, edit: Callable[[torch.Tensor], torch.Tensor], inputs: dict[str, Any]) -> Any:
    """The eager model's last hidden state with ``edit`` applied to the input of the linear at ``path``."""
    hook = model.get_submodule(path).register_forward_pre_hook(lambda module, args: (edit(args[0]), *args[1:]))
    try:
        with torch.no_grad():
            return model(**inputs).last_hidden_state
    finally:
        hook.remove()


def _zero_head(head: int, heads: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def edit(merged: torch.Tensor) -> torch.Tensor:  # (batch, q, heads * d)
        merged = merged.clone()
        width = merged.shape[-1] // heads
        merged[..., head * width : (head + 1) * width] = 0
        return merged

    return edit


@pytest.mark.parametrize("name", ["bert", "deberta-v2", "mpnet", "llama", "bart"])
def test_replaced_probabilities_and_outputs_are_used(name: str) -> None:
    """A head's probabilities set to 0 (returned as float64) and its per-head output set to 0 both give the
    eager model with that head's slice of the output projection's input zeroed; keeping both changes nothing."""
    family = _family(name)
    model = build(family)
    stack, layer, head, path = family.prune
    inputs = _inputs(model)
    want = _hooked(model, path, _zero_head(head, family.stacks[stack][1]), inputs)
    with torch.no_grad():
        plain = model(**inputs).last_hidden_state
    assert (want - plain).abs().max() > 1e-3  # the head matters

    def zero_probs(call: AttentionCall) -> torch.Tensor | None:
        if (call.stack, call.layer) != (stack, layer):
            return None
        probs = call.probs.double()
        probs[:, head] = 0
        return probs

    def zero_output(call: OutputCall) -> torch.Tensor | None:
        if (call.stack, call.layer) != (stack, layer):
            return None
        output = call.output.clone()
        output[:, :, head] = 0
        return output

    for options in ({"callback": zero_probs}, {"callback": lambda call: None, "on_output": zero_output}):
        with torch.no_grad(), AttentionProbe(model, **options):
            got = model(**inputs).last_hidden_state
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad(), AttentionProbe(model, lambda call: None, on_output=lambda call: None):
        torch.testing.assert_close(model(**inputs).last_hidden_state, plain, atol=1e-6, rtol=1e-6)


def _values(model: Any, name: str, layer: int, hidden: torch.Tensor) -> torch.Tensor:
    """``(batch, k, kv_head, d)``: the value projection of layer ``layer``'s input, by the family's own modules."""
    if name == "bert":
        return model.encoder.layer[layer].attention.self.value(hidden).unflatten(-1, (4, 8))
    if name == "deberta-v2":
        return model.encoder.layer[layer].attention.self.value_proj(hidden).unflatten(-1, (4, 8))
    block = model.layers[layer]
    return block.self_attn.v_proj(block.input_layernorm(hidden)).unflatten(-1, (2, 8))


@pytest.mark.parametrize("name", ["bert", "deberta-v2", "llama"])
def test_per_head_outputs_are_the_probabilities_times_the_values(name: str) -> None:
    """``z[b, q, h] = sum_k A[b, h, q, k] v[b, k, h // group]`` from output_attentions and the value projection
    of each layer's input (hidden states): per query head, the key/value head repeated in grouped attention."""
    family = _family(name)
    model = build(family)
    inputs = _inputs(model)
    with torch.no_grad():
        output = model(**inputs, output_attentions=True, output_hidden_states=True)
    stack = next(iter(family.stacks))
    sites = [site.module for site in attention_sites(model)]
    seen: list[tuple[str, int, nn.Module]] = []

    def check(call: OutputCall) -> None:
        maps = output.attentions[call.layer]  # (batch, head, q, k)
        values = _values(model, name, call.layer, output.hidden_states[call.layer])
        values = values.repeat_interleave(maps.shape[1] // values.shape[2], dim=2)  # (batch, k, head, d)
        torch.testing.assert_close(call.output, torch.einsum("bhqk,bkhd->bqhd", maps, values), atol=1e-5, rtol=1e-5)
        seen.append((call.stack, call.layer, call.module))

    with torch.no_grad(), AttentionProbe(model, lambda call: None, on_output=check):
        model(**inputs)
    assert seen == [(stack, 0, sites[0]), (stack, 1, sites[1])]


def test_layers_restart_with_every_forward_pass() -> None:
    model = build(_family("albert"))  # one module for both layers: layers by call order
    layers: list[tuple[int, int]] = []
    outputs: list[int] = []
    with (
        torch.no_grad(),
        AttentionProbe(
            model,
            lambda call: layers.append((call.layer, call.rows)),
            on_output=lambda call: outputs.append(call.layer),
        ),
    ):
        model(**_inputs(model))
        model(**_inputs(model))
    assert layers == [(0, 0), (1, 0), (0, 0), (1, 0)]
    assert outputs == [0, 1, 0, 1]


@pytest.mark.parametrize("name", ["bert", "deberta-v2"])
def test_nothing_is_probed_after_the_probe(name: str) -> None:
    """On exit the model's own attention implementation is back, every hook is gone, no probe is active: the
    model answers as before, a model switched to headcat's implementation by hand runs plain eager attention."""
    model = build(_family(name))
    inputs = _inputs(model)
    with torch.no_grad():
        before = model(**inputs).last_hidden_state
    seen: list[AttentionCall | OutputCall] = []
    with AttentionProbe(model, seen.append, on_output=seen.append):
        pass
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).last_hidden_state, before, atol=0, rtol=0)
        if name == "bert":
            model.set_attn_implementation("headcat")  # no probe: headcat's function runs the eager one
            torch.testing.assert_close(model(**inputs).last_hidden_state, before, atol=0, rtol=0)
            model.set_attn_implementation("eager")
    assert nn.functional.softmax(torch.zeros(1, 4, 2, 2), dim=-1).eq(0.5).all()
    assert seen == []


def test_an_error_inside_an_adapted_module_leaves_no_call_behind() -> None:
    model = build(_family("deberta-v2"))

    def fail(*_: Any) -> None:
        raise RuntimeError("stop")

    model.encoder.layer[0].attention.self.query_proj.register_forward_hook(fail)  # before the softmax
    seen: list[AttentionCall] = []
    with warnings.catch_warnings():  # torch warns that the closing hook's own refusal (no softmax seen) was dropped
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="^stop$"), torch.no_grad(), AttentionProbe(model, seen.append):
            model(**_inputs(model))
    nn.functional.softmax(torch.zeros(1, 4, 2, 2), dim=-1)  # a 4-head softmax outside any attention call
    assert seen == []


@pytest.mark.parametrize(
    ("name", "probed_dtype"), [("gpt2-upcast", None), ("llama", torch.float32)], ids=["gpt2-upcast", "llama"]
)
def test_half_precision_maps_are_the_eager_ones(name: str, probed_dtype: torch.dtype | None) -> None:
    """bfloat16 models whose attention upcasts: GPT-2's reordered, float32-upcast eager path (the probe must run
    that path, its float32 probabilities cast as the model casts them, not the plain bfloat16 one), and Llama's
    softmax over bfloat16 scores in float32 (``dtype=torch.float32``), then cast: the maps the probe hands out are
    that float32 softmax. Either way equal to the eager bfloat16 maps once cast."""
    model = build(_family(name)).to(torch.bfloat16)
    inputs = _inputs(model)
    want = eager_maps(model, inputs, stack="decoder")
    got = probed_maps(model, inputs)
    assert sorted(got) == sorted(want)
    for key, maps in want.items():
        if probed_dtype is not None:
            assert got[key].dtype == probed_dtype
        assert torch.equal(got[key].to(maps.dtype), maps), key


# --- sub-batches: the budget per sample --------------------------------------------------------


def test_sub_batch_budget_counts_four_bytes_at_least_per_map_entry() -> None:
    from ingest.attention import _rows, _sub_batches

    key = torch.zeros(5, 2, 6, 3)  # maps of 2 x 4 x 6 entries: 48 a sample
    for dtype, size in ((torch.bfloat16, 4), (torch.float16, 4), (torch.float32, 4), (torch.float64, 8)):
        query = torch.zeros(5, 2, 4, 3, dtype=dtype)
        assert _sub_batches(query, key, (), {}, 48 * size * 2) == [(0, 2), (2, 4), (4, 5)], dtype
        assert _sub_batches(query, key, (), {}, 48 * size * 2 - 1) == [(i, i + 1) for i in range(5)], dtype
    query = torch.zeros(5, 2, 4, 3)
    assert _sub_batches(query, key, (), {}, 192 * 4) == [(0, 4), (4, 5)]
    assert _sub_batches(query, key, (), {"position_ids": torch.zeros(5, 4)}, 192) is not None
    assert _sub_batches(query, key, (), {"position_ids": torch.zeros(2, 4)}, 192) is None
    assert _sub_batches(query, key, (), {"cache_position": torch.zeros(4), "s_aux": torch.zeros(2)}, 192) is not None
    assert _sub_batches(query, key, (), {}, 192 * 5) is None  # five samples fit: one call
    assert _sub_batches(query, key, (torch.zeros(5),), {}, 192) is None  # a tensor by position: its layout unknown
    assert _sub_batches(query, key, (0.5,), {}, 192) is not None
    assert torch.equal(_rows(torch.arange(5), 1, 3, 5), torch.tensor([1, 2]))  # batch-major, one dimension
    scalar = torch.tensor(0.5)
    assert _rows(scalar, 1, 3, 5) is scalar
    assert _rows(torch.zeros(3, 2), 0, 1, 5).shape == (3, 2)  # not batch-major: as it is


# --- the eager function, the layer of a call, the registration ---------------------------------

FALLBACK_CALLS: list[str] = []


def eager_attention_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """This file's eager function: BERT's, counted. Only a class of this file whose forward's own file has none
    may be sent here."""
    FALLBACK_CALLS.append(type(module).__name__)
    return tf.models.bert.modeling_bert.eager_attention_forward(module, *args, **kwargs)


_bert_forward = inspect.unwrap(BertSelfAttention.forward)


class FallbackSelfAttention(BertSelfAttention):
    """BERT's forward, compiled against globals that have no eager function: headcat looks in the class's file."""

    forward = types.FunctionType(
        _bert_forward.__code__,
        {**vars(tf.models.bert.modeling_bert), "eager_attention_forward": None},
        "forward",
        _bert_forward.__defaults__,
    )


def test_the_eager_function_falls_back_to_the_classs_own_file(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build(_family("bert"))
    inputs = _inputs(model)
    want = eager_maps(model, inputs)
    for layer in model.encoder.layer:
        layer.attention.self.__class__ = FallbackSelfAttention
    FALLBACK_CALLS.clear()
    assert_same_maps(probed_maps(model, inputs), want)
    assert FALLBACK_CALLS == ["FallbackSelfAttention"] * 2
    monkeypatch.delattr(sys.modules[__name__], "eager_attention_forward")
    assert _refusal(model, inputs) == (
        "architecture 'tests' (FallbackSelfAttention) has no eager_attention_forward for headcat to follow"
    )


def test_a_module_whose_forward_is_no_python_code_is_no_attention_module() -> None:
    class Builtin(nn.Module):
        forward = torch.relu  # a builtin: no __code__ to read

    holder = nn.ModuleDict({"relu": Builtin(), "attention": BertSelfAttention(tf.BertConfig(**ENCODER))})
    assert _sites(holder) == [("attention", "encoder", -1)]


class _Reordered(nn.Module):
    """Two MPNet layers (adapted: no attention implementation to switch) run in the order given."""

    def __init__(self, order: tuple[int, ...]) -> None:
        super().__init__()
        self.order = order
        self.layer = nn.ModuleList(
            tf.models.mpnet.modeling_mpnet.MPNetLayer(tf.MPNetConfig(**ENCODER)) for _ in range(2)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for index in self.order:
            hidden = self.layer[index](hidden)[0]
        return hidden


@pytest.mark.parametrize("order", [(1, 0), (1,), (0, 1)])
def test_a_modules_layer_is_its_index_whatever_the_order_of_calls(order: tuple[int, ...]) -> None:
    model = _Reordered(order)
    layers: list[int] = []
    with torch.no_grad(), AttentionProbe(model, lambda call: layers.append(call.layer)):
        model(torch.randn(1, 5, 32))
    assert layers == list(order)


def test_importing_the_probe_registers_its_attention_and_mask_functions(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from ingest import attention

    monkeypatch.delitem(AttentionInterface._global_mapping, "headcat")
    monkeypatch.delitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "headcat")
    attention._register()  # what importing ingest.attention ran
    for name in ("bert", "llama"):  # a padding mask, and a causal one
        model = build(_family(name))
        inputs = _inputs(model)
        assert_same_maps(probed_maps(model, inputs), eager_maps(model, inputs, stack=next(iter(_family(name).stacks))))


# --- the registered function called as transformers calls it ------------------------------------


def _t5_call() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], torch.Tensor]:
    """T5's first encoder self-attention and a call of 3 samples, 4 heads, 5 queries and keys: scaling and dropout
    given by position, a per-sample position bias (batch-major) and position ids by name; the padded keys masked."""
    model = build(_family("t5"))
    generator = torch.Generator().manual_seed(5)
    query, key, value = (torch.randn(3, 4, 5, 8, generator=generator) for _ in range(3))
    bias = torch.randn(3, 4, 5, 5, generator=generator)
    mask = torch.zeros(3, 1, 5, 5)
    mask[2, :, :, 3:] = torch.finfo(torch.float32).min
    args = (query, key, value, mask, 1.0, 0.0)  # T5 does not scale its scores: 1.0, not 1/sqrt(8)
    kwargs = {"position_bias": bias, "position_ids": torch.arange(5).expand(3, 5)}
    probs = torch.softmax(query @ key.transpose(2, 3) + bias + mask, dim=-1)  # the reference, by hand
    return model, args, kwargs, probs


@pytest.mark.parametrize("max_map_bytes", [None, 1], ids=["whole", "one-sample-calls"])
def test_the_registered_function_runs_the_eager_one_with_every_argument(max_map_bytes: int | None) -> None:
    from ingest.attention import headcat_attention_forward

    model, args, kwargs, probs = _t5_call()
    module = model.get_submodule("encoder.block.0.layer.0.SelfAttention")
    eager = tf.models.t5.modeling_t5.eager_attention_forward
    want = eager(module, *args, **kwargs)[0]
    torch.testing.assert_close(want, (probs @ args[2]).transpose(1, 2))
    output, weights = headcat_attention_forward(module, *args, **kwargs)  # no probe: plain eager attention
    torch.testing.assert_close(output, want, atol=0, rtol=0)
    assert weights is None
    seen: dict[int, torch.Tensor] = {}
    with AttentionProbe(model, lambda call: seen.setdefault(call.rows, call.probs), max_map_bytes=max_map_bytes):
        output, _ = headcat_attention_forward(module, *args, **kwargs)
    torch.testing.assert_close(output, want, atol=1e-6, rtol=1e-6)
    assert sorted(seen) == ([0] if max_map_bytes is None else [0, 1, 2])
    torch.testing.assert_close(torch.cat([seen[row] for row in sorted(seen)]), probs, atol=1e-6, rtol=1e-6)


def test_per_head_and_per_position_arguments_reach_every_sub_batch_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call split into one-sample calls slices only the batch-major arguments: a per-head ``sinks`` and a
    per-position ``cache_position`` pass whole to each call, also when their length happens to be the batch's."""
    from ingest.attention import headcat_attention_forward

    model, args, kwargs, _ = _t5_call()
    module = model.get_submodule("encoder.block.0.layer.0.SelfAttention")
    eager = tf.models.t5.modeling_t5.eager_attention_forward
    received: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def recording(
        module: nn.Module, query: torch.Tensor, *rest: Any, sinks: Any, cache_position: Any, **kw: Any
    ) -> Any:
        received.append((query.shape[0], sinks, cache_position))
        return eager(module, query, *rest, **kw)

    monkeypatch.setattr(tf.models.t5.modeling_t5, "eager_attention_forward", recording)
    sinks, positions = torch.tensor([0.5, 1.5, 2.5]), torch.arange(3)  # 3 = the batch, by design
    with AttentionProbe(model, lambda call: None, max_map_bytes=1):
        headcat_attention_forward(module, *args, **kwargs, sinks=sinks, cache_position=positions)
    assert [rows for rows, _, _ in received] == [1, 1, 1]
    for _, got_sinks, got_positions in received:
        assert got_sinks is sinks
        assert got_positions is positions


# --- an encoder-decoder's stacks by path, before any flag --------------------------------------


def test_an_encoder_decoder_assigns_stacks_by_path() -> None:
    """A causal encoder (GPT-2) under a BERT decoder whose path also holds ``encoder`` (``decoder.bert.encoder``):
    the path decides, ``decoder`` before ``encoder``; maps as output_attentions gives them."""
    encoder = tf.GPT2Config(**SIZE, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    decoder = tf.BertConfig(**{**ENCODER, "num_attention_heads": 2}, is_decoder=True, add_cross_attention=True)
    config = tf.EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id = 2, 0
    torch.manual_seed(0)
    model = tf.EncoderDecoderModel(config=config).eval()
    model.set_attn_implementation("eager")
    expected = [(f"encoder.h.{i}.attn", "encoder", i) for i in range(2)]
    expected += [(f"decoder.bert.encoder.layer.{i}.attention.self", "decoder", i) for i in range(2)]
    expected += [(f"decoder.bert.encoder.layer.{i}.crossattention.self", "cross", i) for i in range(2)]
    assert _sites(model) == expected
    inputs = _inputs(model)
    assert_same_maps(probed_maps(model, inputs), eager_maps(model, inputs))


# --- the softmax wrapper outside attention ------------------------------------------------------


@pytest.mark.skipif(
    "MUTANT_UNDER_TEST" in os.environ, reason="mutmut's trampoline around the wrapper is one more frame"
)
def test_a_softmax_warning_names_the_callers_line() -> None:
    """torch warns where softmax is called without ``dim``; headcat's wrapper must not become that caller."""
    line = inspect.currentframe().f_lineno + 2  # type: ignore[union-attr]
    with pytest.warns(UserWarning, match="^Implicit dimension choice for softmax has been deprecated") as caught:
        nn.functional.softmax(torch.zeros(2, 3))
    assert [(warning.filename, warning.lineno) for warning in caught] == [(__file__, line)]


class Nameless(FallbackSelfAttention):
    """A class made outside any module (``__module__`` empty): refusals name it by its class."""

    __module__ = ""


def test_a_class_outside_any_module_is_named_by_its_class() -> None:
    model = build(_family("bert"))
    for layer in model.encoder.layer:
        layer.attention.self.__class__ = Nameless
    assert _refusal(model, _inputs(model)) == (
        "architecture 'Nameless' (Nameless) has no eager_attention_forward for headcat to follow"
    )
