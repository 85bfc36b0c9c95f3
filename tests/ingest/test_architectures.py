"""Conformance: every architecture headcat accepts, checked against its own eager attention.

For each family, a tiny random-weight model (query/key weights scaled up so that heads really
differ) and a tiny real tokenizer built here (``tokenizers`` WordLevel, no hub):

- every head's features and scalars from :func:`extract_features` (batched, padded, probed) equal
  those computed here, one sample at a time, from ``output_attentions=True`` in eager mode, with a
  plain-loop reduction written from SPEC sections 1 and 6 (independent of the production code);
- the same with every attention call split into one-sample sub-calls, as long maps are on the CPU,
  and the model's output unchanged by that split;
- pruning one explicit head through the probe (its probabilities zeroed, or its per-head output
  zeroed) gives the same model output as the eager model with that head's slice of the output
  projection's input zeroed by a hook (an independent mechanism);
- the heads are counted right per stack.

Set ``HEADCAT_TEST_DEVICE=cuda`` to run every check on a GPU (the GPU's torch branches of the
reduction instead of the CPU's compiled pass); the reference reads the same device's eager maps.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
import transformers as tf
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from ingest import features as features_module
from ingest.attention import AttentionCall, AttentionProbe, OutputCall, attention_sites
from ingest.corpora import Sample
from ingest.features import FeatureConfig, extract_features
from ingest.types import SCALARS, SPECIAL_GROUPS

N = 8  # windows: short samples, so every window is populated
CLS, SEP, PERIOD, COMMA = (SPECIAL_GROUPS.index(group) for group in ("cls", "sep", "period", "comma"))
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = "the a cat dog sat on mat ran far away it was red blue big small and then".split()
VOCAB = {token: i for i, token in enumerate([*SPECIALS, ".", ",", *WORDS])}
PAD, BOS, EOS = 0, 2, 3
DEVICE = torch.device(os.environ.get("HEADCAT_TEST_DEVICE", "cpu"))

SAMPLES = [
    Sample("the cat sat on the mat . it was red , and then it ran far away ."),
    Sample("a dog ran .", "the dog was big , the cat was small ."),
    Sample("then , the small red cat sat ."),
    Sample("it ran", "a big blue dog sat on a mat , then ran away"),
]
BERT_TEMPLATE = ("[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1")
ROBERTA_TEMPLATE = ("[CLS] $A [SEP]", "[CLS] $A [SEP] [SEP] $B [SEP]")
T5_TEMPLATE = ("$A [SEP]", "$A [SEP] $B [SEP]")
LLAMA_TEMPLATE = ("[CLS] $A", "[CLS] $A $B")


def tokenizer(template: tuple[str, str] | None, *, type_ids: bool, start: bool = True) -> Any:
    """A WordLevel tokenizer over :data:`VOCAB` with the family's special-token template."""
    backend = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if template is not None:
        ids = [("[CLS]", BOS), ("[SEP]", EOS)]
        backend.post_processor = processors.TemplateProcessing(single=template[0], pair=template[1], special_tokens=ids)
    names = ["input_ids", "token_type_ids", "attention_mask"] if type_ids else ["input_ids", "attention_mask"]
    special: dict[str, str] = {"pad_token": "[PAD]", "unk_token": "[UNK]", "eos_token": "[SEP]"}
    if start:
        special |= {"bos_token": "[CLS]"}
    if type_ids:
        special |= {"cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"}
    return tf.PreTrainedTokenizerFast(tokenizer_object=backend, model_input_names=names, **special)


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[], Any]  # -> the model, eager
    template: tuple[str, str] | None
    stacks: dict[str, tuple[int, int]]  # stack -> (layers, query heads)
    prune: tuple[str, int, int, str]  # (stack, layer, head, path of the linear the merged heads feed)
    type_ids: bool = False
    prepend_bos: bool = False  # the tokenizer adds no start token: extract_features prepends BOS
    scale: float = 12.0
    prune_call: int = 0  # which call of the prune's linear is the pruned layer (ALBERT shares one layer)
    extra: dict[str, Any] = field(default_factory=dict)


SIZE: dict[str, Any] = {"vocab_size": len(VOCAB), "pad_token_id": PAD, "bos_token_id": BOS, "eos_token_id": EOS}
ENCODER: dict[str, Any] = {**SIZE, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
ENCODER |= {"intermediate_size": 37, "max_position_embeddings": 64}
MODERNBERT_LAYERS = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
T5: dict[str, Any] = {"vocab_size": len(VOCAB), "pad_token_id": PAD, "eos_token_id": EOS, "decoder_start_token_id": PAD}
T5 |= {"d_model": 32, "d_kv": 8, "d_ff": 37, "num_layers": 2, "num_decoder_layers": 3, "num_heads": 4}
T5 |= {"relative_attention_num_buckets": 8}
GQA: dict[str, Any] = {**ENCODER, "num_key_value_heads": 2, "head_dim": 8}


def _encoder(config_class: Any, model_class: Any, **options: Any) -> Callable[[], Any]:
    return lambda: model_class(config_class(**{**ENCODER, **options}))


FAMILIES = [
    Family("bert", _encoder(tf.BertConfig, tf.BertModel), BERT_TEMPLATE, {"encoder": (2, 4)},
           ("encoder", 1, 2, "encoder.layer.1.attention.output.dense"), type_ids=True),
    Family("roberta", _encoder(tf.RobertaConfig, tf.RobertaModel), ROBERTA_TEMPLATE, {"encoder": (2, 4)},
           ("encoder", 0, 3, "encoder.layer.0.attention.output.dense")),
    Family("xlm-roberta", _encoder(tf.XLMRobertaConfig, tf.XLMRobertaModel), ROBERTA_TEMPLATE, {"encoder": (2, 4)},
           ("encoder", 1, 0, "encoder.layer.1.attention.output.dense")),
    Family("distilbert",
           lambda: tf.DistilBertModel(tf.DistilBertConfig(vocab_size=len(VOCAB), pad_token_id=PAD, dim=32, n_layers=2,
                                                          n_heads=4, hidden_dim=37, max_position_embeddings=64)),
           BERT_TEMPLATE, {"encoder": (2, 4)}, ("encoder", 1, 1, "transformer.layer.1.attention.out_lin")),
    Family("albert", _encoder(tf.AlbertConfig, tf.AlbertModel, embedding_size=16), BERT_TEMPLATE, {"encoder": (2, 4)},
           ("encoder", 1, 2, "encoder.albert_layer_groups.0.albert_layers.0.attention.dense"), type_ids=True,
           prune_call=1),
    Family("electra", _encoder(tf.ElectraConfig, tf.ElectraModel, embedding_size=16), BERT_TEMPLATE,
           {"encoder": (2, 4)}, ("encoder", 0, 1, "encoder.layer.0.attention.output.dense"), type_ids=True),
    Family("deberta-v2",
           _encoder(tf.DebertaV2Config, tf.DebertaV2Model, relative_attention=True, pos_att_type=["p2c", "c2p"],
                    position_buckets=8, max_relative_positions=16, type_vocab_size=2),
           BERT_TEMPLATE, {"encoder": (2, 4)}, ("encoder", 1, 3, "encoder.layer.1.attention.output.dense"),
           type_ids=True),
    Family("modernbert",  # local attention (4 wide: +-2 tokens) in layers 1 and 2, global in layers 0 and 3
           lambda: tf.ModernBertModel(tf.ModernBertConfig(**{**ENCODER, "num_hidden_layers": 4}, local_attention=4,
                                                          layer_types=MODERNBERT_LAYERS,
                                                          cls_token_id=BOS, sep_token_id=EOS)),
           BERT_TEMPLATE, {"encoder": (4, 4)}, ("encoder", 1, 0, "layers.1.attn.Wo")),
    Family("mpnet", _encoder(tf.MPNetConfig, tf.MPNetModel), ROBERTA_TEMPLATE, {"encoder": (2, 4)},
           ("encoder", 1, 2, "encoder.layer.1.attention.attn.o")),
    Family("gpt2",
           lambda: tf.GPT2Model(tf.GPT2Config(**SIZE, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
           None, {"decoder": (2, 4)}, ("decoder", 1, 1, "h.1.attn.c_proj"), prepend_bos=True),
    Family("gpt2-upcast",  # GPT-2's other eager path: float32 scores, reordered scaling, by inverse layer index
           lambda: tf.GPT2Model(tf.GPT2Config(**SIZE, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                              reorder_and_upcast_attn=True, scale_attn_by_inverse_layer_idx=True)),
           None, {"decoder": (2, 4)}, ("decoder", 0, 2, "h.0.attn.c_proj"), prepend_bos=True),
    Family("llama", lambda: tf.LlamaModel(tf.LlamaConfig(**GQA)), LLAMA_TEMPLATE, {"decoder": (2, 4)},
           ("decoder", 1, 3, "layers.1.self_attn.o_proj")),
    Family("qwen2", lambda: tf.Qwen2Model(tf.Qwen2Config(**GQA)), None, {"decoder": (2, 4)},
           ("decoder", 0, 1, "layers.0.self_attn.o_proj"), prepend_bos=True),
    Family("mistral", lambda: tf.MistralModel(tf.MistralConfig(**GQA, sliding_window=4)), LLAMA_TEMPLATE,
           {"decoder": (2, 4)}, ("decoder", 1, 2, "layers.1.self_attn.o_proj")),
    Family("gemma2",
           lambda: tf.Gemma2Model(tf.Gemma2Config(**GQA, sliding_window=4, attn_logit_softcapping=5.0,
                                                  query_pre_attn_scalar=8)),
           LLAMA_TEMPLATE, {"decoder": (2, 4)}, ("decoder", 0, 3, "layers.0.self_attn.o_proj")),
    Family("t5",
           lambda: tf.T5Model(tf.T5Config(**T5)),
           T5_TEMPLATE, {"encoder": (2, 4), "decoder": (3, 4), "cross": (3, 4)},
           ("cross", 2, 1, "decoder.block.2.layer.1.EncDecAttention.o"), extra={"start": False}),
    Family("bart",
           lambda: tf.BartModel(tf.BartConfig(**SIZE, decoder_start_token_id=EOS, d_model=32, encoder_layers=2,
                                              decoder_layers=3, encoder_attention_heads=4, decoder_attention_heads=2,
                                              encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64)),
           ROBERTA_TEMPLATE, {"encoder": (2, 4), "decoder": (3, 2), "cross": (3, 2)},
           ("decoder", 1, 1, "decoder.layers.1.self_attn.out_proj")),
]  # fmt: skip

_QK = ("query", "key", "q_proj", "k_proj", ".q.", ".k.", "c_attn", "Wqkv", "q_lin", "k_lin", "relative_attention_bias")


def build(family: Family) -> Any:
    torch.manual_seed(0)
    model = family.build()
    model.config._attn_implementation = "eager"
    model.set_attn_implementation("eager") if type(model)._can_set_attn_implementation() else None
    with torch.no_grad():  # large query/key weights: far-from-uniform attention, heads that differ
        for name, parameter in model.named_parameters():
            if any(part in f".{name}" for part in _QK) and "norm" not in name.lower():
                parameter.mul_(family.scale)
    return model.eval().to(DEVICE)


# --- the reference: SPEC sections 1 and 6 in plain loops, from output_attentions=True ------------


def group_of(token: int, tok: Any, cls_ids: set[int]) -> int:
    if token in cls_ids:
        return CLS
    if token in {tok.sep_token_id, tok.eos_token_id} - {None}:
        return SEP
    return {VOCAB["."]: PERIOD, VOCAB[","]: COMMA}.get(token, -1)


def reduce_map(a: list[list[float]], query_groups: list[int], key_groups: list[int], square: bool) -> list[float]:
    """One sample's and head's features then scalars; square maps (SPEC 1) or cross maps (SPEC 6)."""
    lq, lk = len(a), len(a[0])
    features = [0.0] * (N + 5)
    for s in range(lq):
        for t in range(lk):
            if key_groups[t] >= 0:
                features[N + 1 + key_groups[t]] += a[s][t]
            elif s == t:
                features[N] += a[s][t]
            else:
                features[min(N - 1, math.floor(abs(s - t) * N / lk))] += a[s][t]
    features = [value / lq for value in features]
    entropy = sum(-p * math.log(p) for row in a for p in row if p > 0) / lq
    before = [s for s in range(1, lq) if s - 1 < lk]
    after = [s for s in range(lq) if s + 1 < lk]
    previous = sum(a[s][s - 1] for s in before) / len(before) if before else 0.0
    following = sum(a[s][s + 1] for s in after) / len(after) if after else 0.0
    distance = sum(a[s][t] * abs(s - t) for s in range(lq) for t in range(lk)) / lq
    seps = [s for s in range(lq) if query_groups[s] == SEP]
    sep_keys = [t for t in range(lk) if key_groups[t] == SEP]
    sep_to_sep = sum(a[s][t] for s in seps for t in sep_keys) / len(seps) if seps else math.nan
    if square:
        assert lq == lk
    return [*features, entropy, previous, following, distance, sep_to_sep]


def reference(family: Family, model: Any, tok: Any) -> dict[str, np.ndarray]:
    """Per stack ``(layers, heads, N + 5 + 5)``: the mean over samples (sep_to_sep over samples with [SEP])."""
    encoder_decoder = bool(model.config.is_encoder_decoder)
    cls_ids = {BOS} if (tok.cls_token_id is not None or tok.bos_token_id is not None) else set()
    per_stack: dict[str, list[np.ndarray]] = {}
    for sample in SAMPLES:
        encoded = tok(sample.text, sample.text_pair)
        ids = list(encoded["input_ids"])
        if family.prepend_bos:
            ids = [model.config.bos_token_id, *ids]
        inputs: dict[str, Any] = {"input_ids": torch.tensor([ids], device=DEVICE)}
        if family.type_ids:
            inputs["token_type_ids"] = torch.tensor([encoded["token_type_ids"]], device=DEVICE)
        sides = {"encoder": ids, "decoder": ids}
        if encoder_decoder:
            labels = tok(text_target=sample.text_pair or sample.text)["input_ids"]
            decoder = [model.config.decoder_start_token_id, *labels[:-1]]
            inputs["decoder_input_ids"] = torch.tensor([decoder], device=DEVICE)
            sides["decoder"] = decoder
        with torch.no_grad():
            output = model(**inputs, output_attentions=True)
        if encoder_decoder:
            maps = {"encoder": output.encoder_attentions, "decoder": output.decoder_attentions,
                    "cross": output.cross_attentions}  # fmt: skip
        else:
            maps = {next(iter(family.stacks)): output.attentions}
        for stack, layers in maps.items():
            query_side, key_side = ("decoder", "encoder") if stack == "cross" else (stack, stack)
            query_groups = [group_of(t, tok, cls_ids) for t in sides[query_side]]
            key_groups = [group_of(t, tok, cls_ids) for t in sides[key_side]]
            values = [
                [reduce_map(head, query_groups, key_groups, stack != "cross") for head in layer[0].tolist()]
                for layer in layers
            ]
            per_stack.setdefault(stack, []).append(np.array(values))
    return {stack: np.array(arrays) for stack, arrays in per_stack.items()}


# --- the tests --------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=FAMILIES, ids=[family.name for family in FAMILIES])
def case(request: pytest.FixtureRequest) -> tuple[Family, Any, Any]:
    family: Family = request.param
    tok = tokenizer(family.template, type_ids=family.type_ids, start=family.extra.get("start", True))
    return family, build(family), tok


# Families whose statistics are taken in the attention's own pass (ingest.fused: the C++ kernel on the CPU, the
# Triton kernel on CUDA where triton imports); the rest reduce maps.
FUSED = {"bert", "roberta", "xlm-roberta", "electra", "albert", "llama", "qwen2", "mistral", "gemma2"}


def _fused_here() -> bool:
    """Whether this device has a fused kernel: the CPU's, or on CUDA the Triton kernel (triton imports)."""
    from ingest import fused

    return DEVICE.type == "cpu" or (DEVICE.type == "cuda" and fused.triton_unavailable() is None)


@pytest.mark.parametrize("mode", ["fused", "whole", "sub-batched"])
def test_features_equal_output_attentions(
    case: tuple[Family, Any, Any], mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fused``: statistics in the attention's pass where the family is covered (the default on the CPU; on CUDA
    from ``TRITON_MIN_LENGTH`` tokens on, asked for here at 32); ``whole`` and ``sub-batched``: every family through
    its maps."""
    family, model, tok = case
    sub_batches = mode == "sub-batched"
    monkeypatch.setattr(features_module, "REDUCTION", "fused" if mode == "fused" else "maps")
    config = FeatureConfig(num_windows=N, max_length=32, batch_size=3, map_size=4)
    rows_seen: set[int] = set()
    if sub_batches:  # every attention call run one sample at a time (on the CPU, long maps are; on any device here)
        monkeypatch.setattr(features_module, "_map_budget", lambda device: 1)
        reduce = features_module._LayerReducer.__call__

        def watch(self: Any, call: AttentionCall) -> None:
            rows_seen.add(call.rows)
            reduce(self, call)

        monkeypatch.setattr(features_module._LayerReducer, "__call__", watch)
    result = extract_features(model, tok, SAMPLES, config)
    if sub_batches and all(site.adapter is None for site in attention_sites(model)):
        assert rows_seen == {0, 1, 2}  # batches of 3 and 1 samples, each sample its own call
    assert {stack: (s.num_layers, s.num_heads) for stack, s in result.stacks.items()} == family.stacks
    assert result.prepended_bos == family.prepend_bos
    fused = mode == "fused" and family.name in FUSED and _fused_here()
    assert result.config.to_json()["reduction"] == ("fused" if fused else "maps")  # as the stored run config says
    recorded = result.config.to_json()["input_form"]  # what the stored run config says
    assert recorded["prepended_bos"] == family.prepend_bos
    if "cross" in family.stacks:
        start = model.config.decoder_start_token_id
        assert recorded["decoder_input"]["decoder_start_token_id"] == start
        assert result.decoder_example_tokens is not None
        assert result.decoder_example_tokens[0] == tok.convert_ids_to_tokens(start)
    else:
        assert recorded["decoder_input"] is None
    expected = reference(family, model, tok)
    assert set(expected) == set(result.stacks)
    for stack, values in expected.items():
        got = result.stacks[stack]  # type: ignore[index]
        mean = values.mean(0)  # (layers, heads, F)
        # The batch is padded, the reference is one sample at a time: float32 rounds differently (transformers
        # 5.24's T5 by up to 1.1e-6 in a cross head's entropy and mean distance, at logits ~100; 1e-7 unpadded).
        assert got.vectors == pytest.approx(mean[..., : N + 5], abs=2e-6), stack
        assert got.vectors.sum(-1) == pytest.approx(1, abs=1e-6)
        for k, name in enumerate(SCALARS):
            column = values[..., N + 5 + k]
            want = column.mean(0)
            if name == "sep_to_sep":  # over the samples with a [SEP] query; NaN where none has one
                has = ~np.isnan(column)
                want = np.where(has.any(0), np.where(has, column, 0).sum(0) / np.maximum(has.sum(0), 1), np.nan)
            # Entropy too (T5's unscaled logits reach ~100 here: nothing large may cancel).
            assert got.scalars[name] == pytest.approx(want, abs=2e-6, rel=2e-6, nan_ok=True), (stack, name)
        # Heads of one layer really differ (at default init every head is near-uniform and alike).
        spread = np.abs(got.vectors[:, :, None] - got.vectors[:, None, :]).sum(-1).max()
        assert spread > 0.2, (stack, spread)


def _outputs(model: Any, inputs: dict[str, Any]) -> list[torch.Tensor]:
    with torch.no_grad():
        output = model(**inputs)
    tensors = [output.last_hidden_state]
    if getattr(output, "encoder_last_hidden_state", None) is not None:
        tensors.append(output.encoder_last_hidden_state)
    return tensors


def test_pruning_one_head_equals_zeroing_its_context(case: tuple[Family, Any, Any]) -> None:
    family, model, tok = case
    stack, layer, head, path = family.prune
    sample = SAMPLES[1]
    encoded = tok(sample.text, sample.text_pair, return_tensors="pt")
    inputs = {name: encoded[name].to(DEVICE) for name in tok.model_input_names}
    if model.config.is_encoder_decoder:
        start = model.config.decoder_start_token_id
        inputs["decoder_input_ids"] = torch.tensor([[start, BOS, 7, 8, 9, EOS]], device=DEVICE)
    heads = family.stacks[stack][1]

    calls = []

    def zero_context(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        calls.append(1)
        if len(calls) - 1 != family.prune_call:
            return args
        merged = args[0].clone()  # (batch, q, heads * d)
        width = merged.shape[-1] // heads
        merged[..., head * width : (head + 1) * width] = 0
        return (merged, *args[1:])

    linear = model.get_submodule(path)
    hook = linear.register_forward_pre_hook(zero_context)
    try:
        expected = _outputs(model, inputs)
    finally:
        hook.remove()
    unpruned = _outputs(model, inputs)
    assert (expected[0] - unpruned[0]).abs().max() > 1e-3  # the head matters

    def zero_probs(call: AttentionCall) -> torch.Tensor | None:
        if (call.stack, call.layer) != (stack, layer):
            return None
        probs = call.probs.clone()
        probs[:, head] = 0
        return probs

    def zero_output(call: OutputCall) -> torch.Tensor | None:
        if (call.stack, call.layer) != (stack, layer):
            return None
        output = call.output.clone()  # (batch, q, head, d)
        output[:, :, head] = 0
        return output

    with AttentionProbe(model, zero_probs):
        by_probs = _outputs(model, inputs)
    with AttentionProbe(model, lambda call: None, on_output=zero_output):
        by_output = _outputs(model, inputs)
    with AttentionProbe(model, lambda call: None):
        untouched = _outputs(model, inputs)
    pairs = tok([sample.text for sample in SAMPLES[:3]], [sample.text_pair or "" for sample in SAMPLES[:3]],
                padding=True, return_tensors="pt")  # fmt: skip
    batch = {name: pairs[name].to(DEVICE) for name in tok.model_input_names}
    if model.config.is_encoder_decoder:
        batch["decoder_input_ids"] = inputs["decoder_input_ids"].expand(3, -1)
    rows: list[int] = []
    with AttentionProbe(model, lambda call: rows.append(call.rows), max_map_bytes=1):  # one sample a call
        sub_batched = _outputs(model, batch)
    if all(site.adapter is None for site in attention_sites(model)):
        assert set(rows) == {0, 1, 2}
    for a, b in zip(sub_batched, _outputs(model, batch), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    for got in (by_probs, by_output):
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(untouched, unpruned, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["llama", "modernbert", "bart"])
def test_bfloat16_runs_close_to_float32(name: str) -> None:
    """Half precision: Llama-style softmax(dtype=float32) over bfloat16 scores, and plain bfloat16."""
    family = next(family for family in FAMILIES if family.name == name)
    tok = tokenizer(family.template, type_ids=family.type_ids)
    model = build(family)
    config = FeatureConfig(num_windows=N, max_length=32, batch_size=3)
    full = extract_features(model, tok, SAMPLES, config)
    half = extract_features(model.to(torch.bfloat16), tok, SAMPLES, config)
    assert half.dtype == "bfloat16"
    for stack, features in full.stacks.items():
        assert half.stacks[stack].vectors == pytest.approx(features.vectors, abs=5e-3), stack
        assert half.stacks[stack].scalars["entropy"] == pytest.approx(features.scalars["entropy"], abs=5e-2), stack


def test_learned_sinks_are_refused_naming_the_architecture() -> None:
    """gpt-oss normalises over one extra (sink) column: not a (batch, head, q, k) map, so refused."""
    from ingest.attention import UnsupportedAttention

    config = tf.GptOssConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, intermediate_size=16, num_local_experts=2,
                             num_experts_per_tok=1, sliding_window=4)  # fmt: skip
    model = tf.GptOssModel(config).eval()
    with pytest.raises(UnsupportedAttention, match=r"architecture 'gpt_oss' \(GptOssAttention\) is not supported"):
        extract_features(model, tokenizer(LLAMA_TEMPLATE, type_ids=False), SAMPLES, FeatureConfig(max_length=32))


def test_sub_batches_follow_the_budget_and_never_split_an_unknown_tensor() -> None:
    from ingest.attention import _rows, _sub_batches

    query, key = torch.zeros(5, 2, 4, 3), torch.zeros(5, 2, 6, 3)  # maps of 2 x 4 x 6 float32: 192 bytes a sample
    assert _sub_batches(query, key, (), {}, 192 * 2) == [(0, 2), (2, 4), (4, 5)]
    assert _sub_batches(query, key, (), {"scaling": 0.5, "dropout": 0.0}, 191) == [(i, i + 1) for i in range(5)]
    assert _sub_batches(query, key, (), {}, 192 * 5) is None  # the whole batch fits: one call
    per_sample_bias, shared_bias = torch.zeros(5, 2, 4, 6), torch.zeros(1, 2, 4, 6)
    assert _sub_batches(query, key, (), {"position_bias": per_sample_bias}, 192) is not None
    assert _sub_batches(query, key, (), {"position_bias": shared_bias, "sinks": torch.zeros(2)}, 192) is not None
    assert _sub_batches(query, key, (), {"position_bias": torch.zeros(3, 2, 4, 6)}, 192) is None  # neither 1 nor 5
    assert _sub_batches(query, key, (), {"alibi": torch.zeros(5, 2, 1, 6)}, 192) is None  # unknown: never split
    assert _sub_batches(query, key, (torch.zeros(5),), {}, 192) is None  # a positional tensor: unknown
    assert torch.equal(_rows(torch.arange(5), 1, 3, 5), torch.tensor([1, 2]))
    assert _rows(shared_bias, 1, 3, 5) is shared_bias
    assert _rows(None, 1, 3, 5) is None


@pytest.mark.skipif(not _fused_here(), reason="no fused kernel on this device (on CUDA: triton does not import)")
@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_attention_output_equals_eager_and_sdpa(name: str) -> None:
    """The model's output with every attention computed by the fused kernel (on CUDA the Triton kernel), on a
    padded batch, equals its eager output, and its SDPA output at real tokens (where SDPA runs the family: not
    soft-capping)."""
    from ingest import fused

    family = next(family for family in FAMILIES if family.name == name)
    tok = tokenizer(family.template, type_ids=family.type_ids)
    model = build(family)
    pairs = tok([sample.text for sample in SAMPLES], [sample.text_pair or "" for sample in SAMPLES],
                padding=True, return_tensors="pt")  # fmt: skip
    batch = {name: pairs[name].to(DEVICE) for name in tok.model_input_names}
    assert not bool(pairs["attention_mask"].all())  # padded
    calls: list[tuple[str, int]] = []

    def attend(call: Any) -> torch.Tensor:
        calls.append((call.stack, call.layer))
        output, sums = fused.attend(call.query, call.key, call.value, call.mask, scale=call.scale,
                                    causal=call.causal, softcap=call.softcap)  # fmt: skip
        assert sums is None
        return output

    with AttentionProbe(model, lambda call: pytest.fail("no map may be computed"), fused=attend):
        got = _outputs(model, batch)
    assert len(calls) == sum(layers for layers, _ in family.stacks.values())
    eager = _outputs(model, batch)
    for a, b in zip(got, eager, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    if name != "gemma2":
        model.set_attn_implementation("sdpa")
        sdpa = _outputs(model, batch)
        model.set_attn_implementation("eager")
        # a padding query whose window holds no real key: SDPA gives it 0
        real = pairs["attention_mask"].bool().to(DEVICE)
        for a, b in zip(got, sdpa, strict=True):
            torch.testing.assert_close(a[real], b[real], atol=2e-5, rtol=2e-5)


def test_a_fused_probe_refuses_what_the_kernel_cannot_express() -> None:
    """T5's relative position bias is no argument the kernel takes: refused by name, never approximated."""
    from ingest import fused
    from ingest.attention import UnsupportedAttention

    family = next(family for family in FAMILIES if family.name == "t5")
    model = build(family)
    inputs = {
        "input_ids": torch.tensor([[7, 8, 9, EOS]], device=DEVICE),
        "decoder_input_ids": torch.tensor([[PAD, 7, 8]], device=DEVICE),
    }

    def attend(call: Any) -> torch.Tensor:
        return fused.attend(call.query, call.key, call.value, call.mask, scale=call.scale, causal=call.causal)[0]

    with (
        pytest.raises(
            UnsupportedAttention, match=r"architecture 't5' \(T5Attention\): its attention takes position_bias"
        ),
        AttentionProbe(model, lambda call: None, fused=attend),
    ):
        _outputs(model, inputs)


def test_without_the_kernel_the_maps_path_runs_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from ingest import fused

    family = next(family for family in FAMILIES if family.name == "bert")
    tok = tokenizer(family.template, type_ids=family.type_ids)
    model = build(family)
    config = FeatureConfig(num_windows=N, max_length=32, batch_size=3, map_size=4)
    assert extract_features(model, tok, SAMPLES, config).config.reduction == "fused"  # auto, at any length
    assert features_module.choose_reduction(model, torch.device("cpu"), {"encoder"}, 1)[0] == "fused"
    monkeypatch.setattr(features_module, "REDUCTION", "maps")
    assert extract_features(model, tok, SAMPLES, config).config.reduction == "maps"
    monkeypatch.setattr(features_module, "REDUCTION", "fused")
    monkeypatch.setattr(fused, "unavailable", lambda: "OSError: no compiler")
    assert features_module.choose_reduction(model, torch.device("cpu"), {"encoder"}) == (
        "maps", "the fused kernel is not available here (OSError: no compiler)"
    )  # fmt: skip
    result = extract_features(model, tok, SAMPLES, config)
    assert result.config.to_json()["reduction"] == "maps"
    assert features_module.choose_reduction(model.double(), torch.device("cpu"), {"encoder"})[0] == "maps"
