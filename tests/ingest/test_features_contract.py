"""Features: the contract of the helpers around the reduction, each against values written by hand or a
plain-loop reference (the cross maps' ``reduce_map`` of ``test_architectures.py``, SPEC sections 1 and 6).

Weights are also built on PyTorch's ``meta`` device: it stands in for a GPU here, so that a weight left on
the CPU (a ``device=`` dropped) shows without CUDA.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from ingest import features as features_module
from ingest import kernels
from ingest.attention import AttentionCall, AttentionProbe
from ingest.corpora import Sample
from ingest.features import (
    Encoded,
    FeatureConfig,
    FeatureResult,
    LengthWeightsCache,
    ReductionWeights,
    SpecialTokens,
    StackFeatures,
    _adds_start_token,
    _as_cls,
    _batches,
    _check_max_length,
    _LayerReducer,
    _model_device,
    _pad,
    _prepend,
    _skewed_sums,
    _start_token,
    _text_config,
    build_cross_weights,
    build_weights,
    decoder_start_token,
    encode_samples,
    encode_targets,
    extract_features,
    length_weights,
    offset_weights,
    reduce_attention,
    reduce_cross_attention,
    resolve_special_tokens,
)
from ingest.loading import LoadedModel
from ingest.types import SPECIAL_GROUPS, Stack
from tests.ingest.test_architectures import (
    BERT_TEMPLATE,
    FAMILIES,
    LLAMA_TEMPLATE,
    T5_TEMPLATE,
    VOCAB,
    build,
    reduce_map,
    tokenizer,
)
from tests.ingest.test_features import assert_matches_reference, cell_reference, masked_batch

CLS, SEP, PERIOD, COMMA = (SPECIAL_GROUPS.index(group) for group in ("cls", "sep", "period", "comma"))
N = 8  # the windows of test_architectures' reduce_map


# --- cross maps (SPEC section 6) ---------------------------------------------------------------

# Three (decoder, encoder) pairs, right-padded to Tq = Tk = 6: queries longer than keys (a query's distance
# reaching L_k), a single-key encoder (every distance past the last window), keys longer than queries.
QUERY_GROUPS = [[CLS, SEP, -1, SEP, SEP, -1], [-1, -1, SEP, -1], [-1, -1, -1]]
KEY_GROUPS = [[CLS, -1, SEP, PERIOD], [-1, COMMA, -1, -1, SEP, -1], [-1]]


def padded(rows: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([row + [-1] * (width - len(row)) for row in rows])


def cross_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    query_lengths = torch.tensor([len(g) for g in QUERY_GROUPS])
    key_lengths = torch.tensor([len(g) for g in KEY_GROUPS])
    return padded(QUERY_GROUPS, 6), query_lengths, padded(KEY_GROUPS, 6), key_lengths


def test_cross_reduction_matches_the_plain_loop_reference() -> None:
    """Mass everywhere, padding cells included (as a model's garbage query rows): only real cells count, each in
    its SPEC 6 group; previous / next divided by the real queries whose such key is real, sep_to_sep by the
    decoder's [SEP] queries (0 where it has none), all to float64 precision."""
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(3, 2, 6, 6, generator=generator, dtype=torch.float64) + 0.01
    weights = build_cross_weights(*cross_inputs(), N)
    got = reduce_cross_attention(probs, weights)  # (batch, head, N + 10)
    for b, (query_groups, key_groups) in enumerate(zip(QUERY_GROUPS, KEY_GROUPS, strict=True)):
        for h in range(2):
            cells = probs[b, h, : len(query_groups), : len(key_groups)].tolist()
            expected = [0.0 if math.isnan(v) else v for v in reduce_map(cells, query_groups, key_groups, False)]
            np.testing.assert_allclose(got[b, h].numpy(), expected, rtol=1e-12, atol=1e-15, err_msg=f"{b, h}")


def test_cross_weights_flag_the_samples_with_a_sep_query() -> None:
    """Three [SEP] queries, one, none."""
    assert build_cross_weights(*cross_inputs(), N).has_sep.tolist() == [True, True, False]


def test_cross_weights_and_reduction_stay_on_the_device_asked_for() -> None:
    weights = build_cross_weights(*cross_inputs(), N, device="meta")
    for name in ("group", "previous", "following", "distance", "sep_cells", "real", "scale", "has_sep"):
        assert getattr(weights, name).device.type == "meta", name
    probs = torch.empty(3, 2, 6, 6, dtype=torch.float64, device="meta")
    out = reduce_cross_attention(probs, weights)
    assert (out.device.type, out.dtype, tuple(out.shape)) == ("meta", torch.float64, (3, 2, N + 10))


def test_cross_weights_default_to_the_keys_device() -> None:
    query_groups, query_lengths, key_groups, key_lengths = cross_inputs()
    on_meta = build_cross_weights(
        query_groups.to("meta"), query_lengths.to("meta"), key_groups.to("meta"), key_lengths.to("meta"), N
    )
    assert on_meta.scale.device.type == "meta"


# --- what a run records -------------------------------------------------------------------------


def test_metadata_names_every_field() -> None:
    vectors = np.zeros((1, 2, 21))
    config = FeatureConfig(num_windows=16, samples=3)
    result = FeatureResult(
        stacks={"decoder": StackFeatures("decoder", vectors, {}, np.zeros((1, 2, 1, 1), np.float32))},
        example_tokens=["<s>", "a"],
        num_samples=3,
        num_tokens=17,
        special_token_ids={"cls": [1]},
        special_tokens={"cls": ["<s>"]},
        device="cpu",
        dtype="bfloat16",
        seconds=1.5,
        config=config,
        feature_names=["w0", "self"],
        prepended_bos=True,
        decoder_input={"decoder_start_token_id": 0},
        decoder_example_tokens=["<pad>", "a"],
    )
    assert result.metadata() == {
        "config": {
            "num_windows": 16,
            "max_length": 128,
            "batch_size": 32,
            "samples": 3,
            "map_size": 32,
            "device": "auto",
            "dtype": "float32",
            "prepend_bos": True,
            "input_form": None,
            "reduction": None,
        },
        "feature_names": ["w0", "self"],
        "stacks": {"decoder": [1, 2]},
        "num_samples": 3,
        "num_tokens": 17,
        "special_token_ids": {"cls": [1]},
        "special_tokens": {"cls": ["<s>"]},
        "example_tokens": ["<s>", "a"],
        "device": "cpu",
        "dtype": "bfloat16",
        "seconds": 1.5,
        "prepended_bos": True,
        "decoder_input": {"decoder_start_token_id": 0},
        "decoder_example_tokens": ["<pad>", "a"],
    }


# --- input forms (SPEC section 6) -----------------------------------------------------------------


def test_prepend_puts_the_token_first_and_repeats_the_first_type() -> None:
    encoded = [Encoded([5, 6, 7], [1, 0, 0]), Encoded([8], None), Encoded([9], []), Encoded([4, 4], [0, 1])]
    assert _prepend(encoded, 2, 3) == [
        Encoded([2, 5, 6], [1, 1, 0]),  # the last id dropped at max_length; type ids follow
        Encoded([2, 8], None),
        Encoded([2, 9], [0]),
        Encoded([2, 4, 4], [0, 0, 1]),
    ]


def test_as_cls_moves_the_token_to_cls_with_its_string() -> None:
    tok = tokenizer(BERT_TEMPLATE, type_ids=True)
    special = resolve_special_tokens(tok)
    assert special.ids == {"cls": [2], "sep": [3], "period": [5], "comma": [6]}
    moved = _as_cls(special, 3, tok)  # the separator taken as the start token
    assert moved.ids == {"cls": [2, 3], "sep": [], "period": [5], "comma": [6]}
    assert moved.tokens == {"cls": ["[CLS]", "[SEP]"], "sep": [], "period": ["."], "comma": [","]}


class Seq2Seq:
    """A stand-in model: only the attributes decoder_start_token reads."""

    def __init__(self, **attributes: Any) -> None:
        self.__dict__.update(attributes)


def text_config(config: SimpleNamespace, text: SimpleNamespace) -> SimpleNamespace:
    config.get_text_config = lambda: text
    return config


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        # the model's config first (its text config, without one, read after it)
        (Seq2Seq(config=text_config(SimpleNamespace(decoder_start_token_id=7), SimpleNamespace())), 7),
        # an EncoderDecoderModel's: the decoder's config
        (Seq2Seq(config=text_config(SimpleNamespace(decoder=SimpleNamespace(decoder_start_token_id=5)),
                                    SimpleNamespace())), 5),
        # a multimodal model's: its text config
        (Seq2Seq(config=text_config(SimpleNamespace(), SimpleNamespace(decoder_start_token_id=4))), 4),
        # only the generation config has it (no config at all)
        (Seq2Seq(generation_config=SimpleNamespace(decoder_start_token_id=9)), 9),
        # a negative id is no id: the next source's
        (Seq2Seq(config=SimpleNamespace(decoder_start_token_id=-1),
                 generation_config=SimpleNamespace(decoder_start_token_id=3)), 3),
    ],
)  # fmt: skip
def test_decoder_start_token_sources_in_order(model: Seq2Seq, expected: int) -> None:
    assert decoder_start_token(model) == expected  # type: ignore[arg-type]


def test_decoder_start_token_missing_is_refused_naming_the_model() -> None:
    model = Seq2Seq(config=SimpleNamespace(decoder_start_token_id=None), generation_config=SimpleNamespace())
    message = "Seq2Seq's config names no decoder_start_token_id: cannot feed its decoder"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        decoder_start_token(model)  # type: ignore[arg-type]


def test_encode_targets_truncates_then_shifts_right() -> None:
    """The target (text_pair, else text) cut at max_length with its [SEP] kept, then [start, y_0 .. y_{n-2}]."""
    tok = tokenizer(T5_TEMPLATE, type_ids=False, start=False)
    samples = [Sample("a dog", "the cat sat on the mat"), Sample("it ran far away")]
    v = VOCAB
    assert encode_targets(tok, samples, 4, 0) == [
        Encoded([0, v["the"], v["cat"], v["sat"]], None),  # labels: the cat sat [SEP]
        Encoded([0, v["it"], v["ran"], v["far"]], None),  # labels: it ran far [SEP]
    ]
    assert encode_targets(tok, samples[1:], 32, 1) == [
        Encoded([1, v["it"], v["ran"], v["far"], v["away"]], None)  # labels: it ran far away [SEP]
    ]


def test_encode_samples_keeps_the_input_order_and_truncates() -> None:
    """Pairs and singles are tokenized in two calls; each comes back in its place, cut at max_length."""
    tok = tokenizer(BERT_TEMPLATE, type_ids=True)
    v = VOCAB
    pairs_only = encode_samples(tok, [Sample("a dog", "it ran"), Sample("it", "ran")], 32)
    assert pairs_only == [
        Encoded([2, v["a"], v["dog"], 3, v["it"], v["ran"], 3], [0, 0, 0, 0, 1, 1, 1]),
        Encoded([2, v["it"], 3, v["ran"], 3], [0, 0, 0, 1, 1]),
    ]
    mixed = encode_samples(tok, [Sample("it", "ran"), Sample("the cat sat on the mat"), Sample("a dog")], 5)
    assert mixed == [
        Encoded([2, v["it"], 3, v["ran"], 3], [0, 0, 0, 1, 1]),
        Encoded([2, v["the"], v["cat"], v["sat"], 3], [0, 0, 0, 0, 0]),  # cut at 5, [SEP] kept
        Encoded([2, v["a"], v["dog"], 3], [0, 0, 0, 0]),
    ]


def test_batches_go_longest_first_ties_in_input_order() -> None:
    assert _batches([3, 7, 5, 7, 1], 2) == [[1, 3], [2, 0], [4]]
    assert _batches([2, 2, 9], 5) == [[2, 0, 1]]


def test_pad_right_pads_ids_mask_and_types() -> None:
    inputs, lengths = _pad([Encoded([5, 6, 7], [0, 1, 1]), Encoded([8], [1])], pad_id=4, pad_type_id=2)
    expected = {
        "input_ids": torch.tensor([[5, 6, 7], [8, 4, 4]]),
        "attention_mask": torch.tensor([[1, 1, 1], [1, 0, 0]]),
        "token_type_ids": torch.tensor([[0, 1, 1], [1, 2, 2]]),
    }
    assert set(inputs) == set(expected)
    for name, tensor in expected.items():
        assert inputs[name].dtype == torch.long, name  # as a tokenizer's return_tensors="pt" gives them
        assert torch.equal(inputs[name], tensor), name
    assert lengths.tolist() == [3, 1]
    untyped, _ = _pad([Encoded([5], None), Encoded([6, 7], None)], pad_id=0, pad_type_id=0)
    assert set(untyped) == {"input_ids", "attention_mask"}


def test_text_config_and_start_token() -> None:
    text = SimpleNamespace(bos_token_id=0)  # id 0 is an id
    multimodal: Any = Seq2Seq(config=text_config(SimpleNamespace(bos_token_id=9), text))
    assert _text_config(multimodal) is text
    plain = SimpleNamespace(bos_token_id=5)
    assert _text_config(Seq2Seq(config=plain)) is plain  # type: ignore[arg-type]
    assert _text_config(Seq2Seq()) is None  # type: ignore[arg-type]
    assert _start_token(multimodal, SimpleNamespace(bos_token_id=7)) == 0
    assert _start_token(Seq2Seq(config=plain), SimpleNamespace(bos_token_id=7)) == 5  # type: ignore[arg-type]
    # the config has none (no attribute, or a negative id): the tokenizer's; neither: None
    assert _start_token(Seq2Seq(config=SimpleNamespace()), SimpleNamespace(bos_token_id=7)) == 7  # type: ignore[arg-type]
    assert _start_token(Seq2Seq(config=SimpleNamespace(bos_token_id=-1)), SimpleNamespace()) is None  # type: ignore[arg-type]


def test_group_table_covers_ids_past_the_vocabulary() -> None:
    special = SpecialTokens(ids={"cls": [1], "sep": [5], "period": [0, 2], "comma": []}, tokens={})
    assert torch.equal(special.group_table(4), torch.tensor([PERIOD, CLS, PERIOD, -1, -1, SEP]))
    assert special.group_table(4).dtype == torch.long
    assert torch.equal(special.group_table(7), torch.tensor([PERIOD, CLS, PERIOD, -1, -1, SEP, -1]))


# --- square maps' weights: rows of a sub-batch, the device ---------------------------------------

SQUARE_GROUPS = [[CLS, -1, PERIOD, -1, SEP], [CLS, -1, -1, SEP, -1], [CLS, COMMA, SEP], [CLS, -1]]


def square_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return padded(SQUARE_GROUPS, 5), torch.tensor([len(g) for g in SQUARE_GROUPS])


@pytest.mark.parametrize("batched", [False, True])
def test_rows_are_the_batch_rows_of_every_field(batched: bool) -> None:
    weights = build_weights(*square_inputs(), 4, torch.float64, device="meta" if batched else None, batched=batched)
    part = weights.rows(1, 3)
    # runs of equal length re-indexed to the part: rows 1 (L = 5) and 2 (L = 3); none empty
    assert [(start, stop, length) for start, stop, length, _ in part.runs] == [(0, 1, 5), (1, 2, 3)]
    assert [(start, stop, length) for start, stop, length, _ in weights.rows(0, 2).runs] == [(0, 2, 5)]
    assert [(start, stop, length) for start, stop, length, _ in weights.rows(2, 3).runs] == [(0, 1, 3)]
    fields = ["special_index", "special_counts", "slot_groups", "sep_queries", "query_mask", "scale", "has_sep"]
    fields += ["per_sample", "special_matrix"] if batched else []
    for name in fields:
        whole, sliced = getattr(weights, name), getattr(part, name)
        assert sliced is not None, name
        assert (sliced.shape, sliced.device) == (whole[1:3].shape, whole.device), name
        if not batched:
            assert torch.equal(sliced, whole[1:3]), name
    assert part.scratch is weights.scratch  # buffers shared with the batch
    assert part.kernel_inputs == {}  # the kernel's plan is made for the part's own rows
    if not batched:
        assert (weights.per_sample, weights.special_matrix, part.per_sample, part.special_matrix) == (None,) * 4
        assert part.has_sep.tolist() == [True, True]
        assert weights.has_sep.tolist() == [True, True, True, False]


@pytest.mark.parametrize("batched", [False, True])
def test_weights_are_built_on_the_device_asked_for(batched: bool) -> None:
    key_groups, lengths = square_inputs()
    weights = build_weights(key_groups, lengths, 4, torch.float32, device="meta", batched=batched)
    tensors = {f.name: getattr(weights, f.name) for f in dataclasses.fields(weights)}
    tensors |= {f"runs[{i}]": run[3] for i, run in enumerate(weights.runs)}
    for name, value in tensors.items():
        if isinstance(value, torch.Tensor):
            assert value.device.type == "meta", name
    assert (weights.per_sample is not None) == batched
    assert weights.special_matrix is not None  # built where the maps are, off the CPU
    # a whole reduction there (the batched product, the gathered special keys, entropy from the maps)
    out = reduce_attention(torch.empty(4, 2, 5, 5, device="meta"), None, weights) if batched else None
    assert out is None or (out.device.type, out.dtype, tuple(out.shape)) == ("meta", torch.float64, (4, 2, 14))
    meta = torch.device("meta")
    assert length_weights(3, 5, 4, torch.float32, meta).device.type == "meta"
    assert offset_weights(3, 5, 4, torch.float32, meta).device.type == "meta"
    cache = LengthWeightsCache()
    assert cache.get(3, 5, 4, torch.float32, meta).device.type == "meta"
    assert cache.offsets(3, 5, 4, torch.float32, meta).device.type == "meta"


# --- the probe's callback -----------------------------------------------------------------------------


def test_reducer_refuses_a_stack_it_was_not_routed() -> None:
    reducer = _LayerReducer(4, 8, {"encoder": ("tokens", "tokens")})
    probs = torch.full((1, 1, 2, 2), 0.5)
    call = AttentionCall(layer=0, probs=probs, scores=probs.log(), module=torch.nn.Identity(), stack="decoder")
    message = "the probe saw a decoder attention module; this run expected ['encoder']"
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
        reducer(call)


# --- whole runs on tiny models ----------------------------------------------------------------------

# The example (first) sample is not the longest: it is not its batch's first row.
RUN_SAMPLES = [
    Sample("a dog ran ."),
    Sample("the cat sat on the mat , it was red and then it ran far away ."),
    Sample("it ran", "a big dog sat"),
    Sample("then , the small red cat sat ."),
]


def family(name: str) -> tuple[Any, Any]:
    chosen = next(f for f in FAMILIES if f.name == name)
    return build(chosen), tokenizer(chosen.template, type_ids=chosen.type_ids, start=chosen.extra.get("start", True))


@pytest.mark.parametrize("sub_batches", [False, True], ids=["whole", "sub-batched"])
def test_example_maps_are_the_first_samples_pooled(sub_batches: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first sample's maps, eager (output_attentions=True), average-pooled to map_size: also when the probe
    sees one sample a call and that sample is not its batch's first row."""
    if sub_batches:
        monkeypatch.setattr(features_module, "SUB_BATCH_MAP_BYTES", 1)
    model, tok = family("bert")
    config = FeatureConfig(num_windows=N, max_length=32, batch_size=4, map_size=3)  # the example: row 3 of 4
    result = extract_features(model, tok, RUN_SAMPLES, config)
    encoded = tok(RUN_SAMPLES[0].text)
    with torch.no_grad():
        inputs = {name: torch.tensor([encoded[name]]) for name in ("input_ids", "token_type_ids")}
        maps = model(**inputs, output_attentions=True).attentions
    expected = np.stack([torch.nn.functional.adaptive_avg_pool2d(layer[0], 3).numpy() for layer in maps])
    assert result.example_maps.shape == (2, 4, 3, 3)
    np.testing.assert_allclose(result.example_maps, expected, atol=2e-6)


def test_cross_example_map_is_decoder_rows_by_encoder_columns() -> None:
    """An encoder-decoder's cross example map: the first sample's decoder queries (its text_pair, 6 tokens) by its
    encoder keys (text and pair, 10 tokens), unpooled."""
    model, tok = family("bart")
    sample = RUN_SAMPLES[2]
    result = extract_features(model, tok, [sample], FeatureConfig(num_windows=N, max_length=32, map_size=32))
    ids = tok(sample.text, sample.text_pair)["input_ids"]
    labels = tok(text_target=sample.text_pair)["input_ids"]
    decoder = [model.config.decoder_start_token_id, *labels[:-1]]
    with torch.no_grad():
        output = model(input_ids=torch.tensor([ids]), decoder_input_ids=torch.tensor([decoder]), output_attentions=True)
    start = model.config.decoder_start_token_id
    assert result.decoder_input == {
        "text": "text_pair when the sample has one, else text",
        "form": "tokenizer(text_target=...), shifted right",
        "decoder_start_token_id": start,
    }
    assert result.config.input_form == {"prepended_bos": False, "decoder_input": result.decoder_input}
    assert result.decoder_example_tokens == tok.convert_ids_to_tokens(decoder)
    pairs: list[tuple[Stack, Any]] = [("cross", output.cross_attentions), ("decoder", output.decoder_attentions)]
    for stack, maps in pairs:
        expected = np.stack([layer[0].numpy() for layer in maps])
        assert result.stacks[stack].example_maps.shape == expected.shape, stack
        np.testing.assert_allclose(result.stacks[stack].example_maps, expected, atol=1e-6, err_msg=stack)


def test_weights_are_built_once_a_batch_and_per_length_weights_once_a_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two batches (3 samples, then 1) of one length, 2 layers, one sample a call: the batch's weights are built
    on its first call and used by every layer, each sub-batch's rows sliced once, and W_L of that length made
    once for both batches (the maps path: the fused one has no sub-batches)."""
    monkeypatch.setattr(features_module, "SUB_BATCH_MAP_BYTES", 1)
    monkeypatch.setattr(features_module, "REDUCTION", "maps")
    counts = {"build_weights": 0, "rows": 0, "offset_weights": 0}

    def counted(name: str, function: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return function(*args, **kwargs)

        return call

    for name in ("build_weights", "offset_weights"):
        monkeypatch.setattr(features_module, name, counted(name, getattr(features_module, name)))
    monkeypatch.setattr(ReductionWeights, "rows", counted("rows", ReductionWeights.rows))
    model, tok = family("bert")
    same_length = [Sample("the cat sat ."), Sample("a dog ran ."), Sample("it was red ."), Sample("then it sat .")]
    extract_features(model, tok, same_length, FeatureConfig(num_windows=N, max_length=32, batch_size=3))
    # rows: batch 1's three one-sample parts; batch 2's one call is the whole batch (no slice)
    assert counts == {"build_weights": 2, "rows": 3, "offset_weights": 1}


# --- checks before a run ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "max_length", "refused"),
    [
        (SimpleNamespace(max_position_embeddings=1), 2, True),
        (SimpleNamespace(max_position_embeddings=64), 65, True),
        (SimpleNamespace(max_position_embeddings=64), 64, False),  # exactly the model's positions
        (SimpleNamespace(max_position_embeddings=0), 8, False),  # 0 and -1: unbounded
        (SimpleNamespace(max_position_embeddings=-1), 8, False),
        (SimpleNamespace(), 8, False),  # no limit given
        (None, 8, False),  # no config at all
    ],
)
def test_max_length_against_the_models_positions(config: Any, max_length: int, refused: bool) -> None:
    model = Seq2Seq() if config is None else Seq2Seq(config=config)
    if refused:
        limit = config.max_position_embeddings
        message = f"max_length {max_length} is more than the model's {limit} positions"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            _check_max_length(model, max_length)  # type: ignore[arg-type]
    else:
        _check_max_length(model, max_length)  # type: ignore[arg-type]


def test_model_device_is_the_first_parameters_else_the_cpu() -> None:
    assert _model_device(torch.nn.Linear(2, 2, device="meta")) == torch.device("meta")
    assert _model_device(torch.nn.Identity()) == torch.device("cpu")


def test_a_run_without_a_tokenizer_or_samples_is_refused() -> None:
    model, tok = family("bert")
    message = "extract_features needs a tokenizer (or a LoadedModel, which has one)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        extract_features(model, None, RUN_SAMPLES, FeatureConfig(max_length=32))
    message = "the corpus yielded no samples: nothing to compute features from"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        extract_features(model, tok, iter([]), FeatureConfig(max_length=32))


def test_a_loaded_models_tokenizer_unless_one_is_given() -> None:
    """The tokenizer given wins over the LoadedModel's: here one whose template has no [CLS]."""
    model, tok = family("bert")
    loaded = LoadedModel(model, tok, "tiny", None, "bert", 2, 4, torch.device("cpu"), torch.float32)
    config = FeatureConfig(num_windows=N, max_length=32, samples=1)
    own = extract_features(loaded, None, RUN_SAMPLES, config)
    given = extract_features(loaded, tokenizer(None, type_ids=True), RUN_SAMPLES, config)
    assert own.example_tokens == ["[CLS]", "a", "dog", "ran", ".", "[SEP]"]
    assert given.example_tokens == ["a", "dog", "ran", "."]


def test_special_tokens_of_a_tokenizer_without_cls_or_sep_attributes() -> None:
    """BOS and EOS stand in for [CLS] and [SEP]; "." and "," count with a word prefix ("Ġ", "▁"), not inside a word."""
    vocab = {"<s>": 0, "</s>": 1, ".": 2, "Ġ.": 3, "▁,": 4, "a.": 5, ",Ġ": 6, "Ġ": 7, ",": 8}
    names = {index: token for token, index in vocab.items()}
    tok = SimpleNamespace(
        bos_token_id=0,
        eos_token_id=1,
        get_vocab=lambda: vocab,
        convert_ids_to_tokens=lambda ids: [names[i] for i in ids],
    )
    special = resolve_special_tokens(tok)
    assert special.ids == {"cls": [0], "sep": [1], "period": [2, 3], "comma": [4, 8]}
    assert special.tokens == {"cls": ["<s>"], "sep": ["</s>"], "period": [".", "Ġ."], "comma": ["▁,", ","]}


# --- what a run records, on a causal model whose tokenizer adds no start token ----------------------

CAUSAL_SAMPLES = [Sample("the cat sat on the mat"), Sample("a dog [SEP] ran"), Sample("it ran")]


def eager_maps(model: Any, ids: list[int]) -> list[np.ndarray]:
    with torch.no_grad():
        return [layer[0].numpy() for layer in model(input_ids=torch.tensor([ids]), output_attentions=True).attentions]


def test_a_causal_run_records_its_inputs() -> None:
    model, tok = family("gpt2")  # its tokenizer adds no start token: the model's BOS ([CLS], 2) is put first
    config = FeatureConfig(num_windows=N, max_length=6, batch_size=2)
    started = time.perf_counter()
    result = extract_features(model, tok, CAUSAL_SAMPLES, config)
    elapsed = time.perf_counter() - started
    assert [(name, stack.stack) for name, stack in result.stacks.items()] == [("decoder", "decoder")]
    assert result.example_tokens == ["[CLS]", "the", "cat", "sat", "on", "the"]  # cut at 6 after the BOS
    assert (result.num_samples, result.num_tokens) == (3, 6 + 5 + 3)
    assert result.prepended_bos is True
    assert result.config.input_form == {"prepended_bos": True, "decoder_input": None}
    assert (result.decoder_input, result.decoder_example_tokens) == (None, None)
    assert result.special_token_ids == {"cls": [2], "sep": [3], "period": [5], "comma": [6]}
    assert result.special_tokens == {"cls": ["[CLS]"], "sep": ["[SEP]"], "period": ["."], "comma": [","]}
    assert (result.device, result.dtype) == ("cpu", "float32")
    assert 0 < result.seconds <= elapsed
    assert result.feature_names == [f"w{i}" for i in range(N)] + ["self", "cls", "sep", "period", "comma"]
    # sep_to_sep: the mean over the samples with a [SEP] (only the second: [CLS] a dog [SEP] ran, [SEP] at 3)
    maps = eager_maps(model, [2, VOCAB["a"], VOCAB["dog"], 3, VOCAB["ran"]])
    expected = np.stack([layer[:, 3, 3] for layer in maps])  # (layers, heads): one [SEP] query, one [SEP] key
    np.testing.assert_allclose(result.scalars["sep_to_sep"], expected, atol=1e-6)


def test_a_causal_run_without_prepending_or_separators() -> None:
    model, tok = family("gpt2")
    config = FeatureConfig(num_windows=N, max_length=5, batch_size=2, prepend_bos=False)
    result = extract_features(model, tok, [CAUSAL_SAMPLES[0], CAUSAL_SAMPLES[2]], config)
    assert result.example_tokens == ["the", "cat", "sat", "on", "the"]  # cut at 5
    assert (result.prepended_bos, result.num_tokens) == (False, 5 + 2)
    assert result.config.input_form == {"prepended_bos": False, "decoder_input": None}
    sep_to_sep = result.scalars["sep_to_sep"]  # no sample has a [SEP]: undefined
    assert (sep_to_sep.shape, sep_to_sep.dtype) == ((2, 4), np.float64)
    assert np.isnan(sep_to_sep).all()
    # the first sample's features, unprepended: its first token is an ordinary word (not cls)
    maps = eager_maps(model, tok(CAUSAL_SAMPLES[0].text)["input_ids"][:5])
    assert result.vectors[..., N + 1] == pytest.approx(0)  # cls
    assert result.example_maps.shape == (2, 4, 5, 5)
    np.testing.assert_allclose(result.example_maps, np.stack(maps), atol=1e-6)


@pytest.mark.parametrize("source", ["config", "tokenizer"])
def test_the_start_token_prepended_is_the_models_else_the_tokenizers(source: str) -> None:
    """The model's config names the BOS (the tokenizer none), or only the tokenizer does (the config none)."""
    model, _ = family("gpt2")
    tok = tokenizer(None, type_ids=False, start=source == "tokenizer")
    if source == "tokenizer":
        model.config.bos_token_id = None
    result = extract_features(model, tok, CAUSAL_SAMPLES[2:], FeatureConfig(num_windows=N, max_length=8))
    assert result.prepended_bos is True
    assert result.example_tokens == ["[CLS]", "it", "ran"]
    assert result.special_token_ids["cls"] == [2]


class WithoutPadType:
    """A tokenizer that has no ``pad_token_type_id`` attribute at all (everything else: ``tok``'s)."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok

    def __getattr__(self, name: str) -> Any:
        if name == "pad_token_type_id":
            raise AttributeError(name)
        return getattr(self._tok, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tok(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._tok)


@pytest.mark.parametrize(("pad_token", "pad_type"), [("[PAD]", 0), ("[MASK]", 1), ("[PAD]", None), (None, 0)])
def test_the_model_is_fed_the_tokenizers_padding(pad_token: str | None, pad_type: int | None) -> None:
    """Padding ids are the tokenizer's pad id (0 when it has none), padding type ids its pad type id (0 when it has
    no such attribute)."""
    model, tok = family("bert")
    tok.pad_token = pad_token
    if pad_type is not None:
        tok._pad_token_type_id = pad_type
    fed: list[dict[str, torch.Tensor]] = []
    model.register_forward_pre_hook(lambda _, args, kwargs: fed.append(dict(kwargs)), with_kwargs=True)
    samples = [Sample("a dog ran ."), Sample("it ran", "a big dog sat")]  # 6 and 9 tokens: one batch
    extract_features(model, tok if pad_type is not None else WithoutPadType(tok), samples, FeatureConfig(max_length=32))
    pad = VOCAB[pad_token] if pad_token is not None else 0
    v = VOCAB
    assert fed[0]["input_ids"].tolist() == [
        [2, v["it"], v["ran"], 3, v["a"], v["big"], v["dog"], v["sat"], 3],
        [2, v["a"], v["dog"], v["ran"], v["."], 3, pad, pad, pad],
    ]
    assert fed[0]["attention_mask"].tolist() == [[1] * 9, [1] * 6 + [0] * 3]
    assert fed[0]["token_type_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 1, 1], [0] * 6 + [pad_type or 0] * 3]


# --- the checks on what the probe saw (a stand-in probe) --------------------------------------------


class StubProbe:
    """Stands in for AttentionProbe: after the model's forward, calls back with uniform maps over the real keys
    for ``LAYERS`` (no call at all when empty)."""

    LAYERS: tuple[int, ...] = ()

    def __init__(
        self, module: torch.nn.Module, callback: Any, max_map_bytes: int | None = None, fused: Any = None
    ) -> None:
        assert fused is None  # the maps path (REDUCTION "maps")
        self.module, self.callback = module, callback

    def __enter__(self) -> StubProbe:
        def hook(*_: Any) -> None:
            groups, lengths = self.callback.sides["tokens"]
            real = torch.arange(groups.shape[1])[None, :] < lengths[:, None]  # (batch, T)
            probs = (real / lengths[:, None])[:, None, None, :].expand(-1, 1, groups.shape[1], -1).contiguous()
            for layer in self.LAYERS:
                self.callback(AttentionCall(layer=layer, probs=probs, scores=probs.log(), module=self.module))

        self.handle = self.module.register_forward_hook(hook)
        return self

    def __exit__(self, *_: object) -> None:
        self.handle.remove()


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ((), "BertModel ran without calling headcat's attention probe: its attention does not go through "
             "transformers' AttentionInterface"),
        ((0, 2), "the probe saw encoder layers [0, 2]; expected 0..1"),
    ],
)  # fmt: skip
def test_a_probe_that_misses_layers_is_refused(
    layers: tuple[int, ...], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(StubProbe, "LAYERS", layers)
    monkeypatch.setattr(features_module, "AttentionProbe", StubProbe)
    monkeypatch.setattr(features_module, "REDUCTION", "maps")
    model, tok = family("bert")
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
        extract_features(model, tok, RUN_SAMPLES, FeatureConfig(num_windows=N, max_length=32))


# --- entropy's log normalizer on the GPU's branches ---------------------------------------------------


@pytest.mark.parametrize("gpu_branches", [True, False], ids=["gpu-branches", "cpu-rows"])
def test_entropy_reads_no_subnormal_diagonal(gpu_branches: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Float32 diagonals of ~1.8e-41 are subnormal (their log ~2.6e-5 off), so lse is read off each such row's
    own largest key instead; the entropy of 3 rows then matches float64 to float32's own rounding. On the CPU,
    with scores in another dtype than the maps (no compiled pass), only the untrusted rows are recomputed."""
    monkeypatch.setattr(features_module, "GPU_BRANCHES_ON_CPU", gpu_branches)
    scores = torch.tensor([[[[0.5, 1.0, -0.3], [2.0, -91.7, 0.0], [0.1, 0.2, -91.5]]]], dtype=torch.float32)
    probs = scores.softmax(-1)
    assert 0 < float(probs[0, 0, 1, 1]) < torch.finfo(torch.float32).tiny  # subnormal, not 0
    assert 0 < float(probs[0, 0, 2, 2]) < torch.finfo(torch.float32).tiny  # another row, another largest key
    weights = build_weights(torch.tensor([[-1, -1, -1]]), torch.tensor([3]), N, torch.float32)
    given = scores if gpu_branches else scores.double()
    before = given.clone()
    entropy = float(reduce_attention(probs, given, weights)[0, 0, N + 5])
    assert torch.equal(given, before)  # the scores are read, never written (the fallback writes a copy)
    rows = scores[0, 0].double().softmax(-1)
    assert entropy == pytest.approx(float(torch.special.entr(rows).sum(-1).mean()), abs=1e-7)


def trace_sums(maps: torch.Tensor, lengths: list[int], heads: int) -> np.ndarray:
    """``(maps, 2T - 1)``: ``D[o] = sum_s A[s, s + o]`` over each map's real query rows ``s < L``, by np.trace."""
    length = maps.shape[-1]
    out = []
    for m in range(maps.shape[0]):
        rows = maps[m, : lengths[m // heads]].double().numpy()  # (L, T): the real queries' rows
        out.append(
            [np.trace(rows, offset=o) if -rows.shape[0] < o < length else 0.0 for o in range(1 - length, length)]
        )
    return np.array(out)


@pytest.mark.parametrize(("length", "width"), [(26, 81), (40, 81), (9, 17)])  # R - 1: 2T - 2 up to 16 k, k odd
def test_skewed_sums_buffer_layout_and_offset_sums(length: int, width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's offset sums: a skewed buffer of rows R = 16 k + 1 >= 2T - 1 (k odd) holding one map at a time
    when the cache budget is just under two, reused by the next call (layer); the per-offset sums of each map's
    real query rows (np.trace)."""
    monkeypatch.setattr(features_module, "_CACHE_BYTES", 2 * length * width * 8 - 1)  # one float64 map per copy
    generator = torch.Generator().manual_seed(length)
    lengths = [length, length - 3]  # two samples, 2 heads each
    maps = torch.rand(4, length, length, generator=generator, dtype=torch.float64)
    maps[2:, :, lengths[1] :] = 0  # the shorter sample's padding keys hold no mass (its padding queries do)
    scratch: dict[tuple[int, ...], torch.Tensor] = {}
    sums = _skewed_sums(maps, lengths, 2, torch.float64, scratch)
    assert list(scratch) == [(1, length, width, -1)]
    buffer = scratch[1, length, width, -1]
    np.testing.assert_allclose(sums.numpy(), trace_sums(maps, lengths, 2), rtol=1e-12, atol=1e-12)
    again = _skewed_sums(maps.flip(0), lengths[::-1], 2, torch.float64, scratch)  # ascending: copies of one map
    assert scratch[1, length, width, -1] is buffer
    np.testing.assert_allclose(again.numpy(), trace_sums(maps.flip(0), lengths[::-1], 2), rtol=1e-12, atol=1e-12)


def test_skewed_sums_of_several_samples_a_copy_and_of_half_precision_maps() -> None:
    """Copies holding several samples' maps (the default cache budget), in either order of lengths: only each
    map's own rows past its sample's end are left out. float16 maps are summed in a float32 buffer, and a float32
    call after them (same buffer key) gets its own buffer."""
    generator = torch.Generator().manual_seed(5)
    maps = torch.rand(4, 12, 12, generator=generator, dtype=torch.float64)
    maps[:2, :, 9:] = 0  # the first sample: 9 real tokens of 12
    scratch: dict[tuple[int, ...], torch.Tensor] = {}
    sums = _skewed_sums(maps, [9, 12], 2, torch.float64, scratch)
    np.testing.assert_allclose(sums.numpy(), trace_sums(maps, [9, 12], 2), rtol=1e-12, atol=1e-12)
    one = maps[2:3].half()  # one map: the copy holds one, whatever the dtype
    scratch = {}
    half = _skewed_sums(one, [12], 1, torch.float32, scratch)
    assert [b.dtype for b in scratch.values()] == [torch.float32]
    assert half.dtype == torch.float32
    np.testing.assert_allclose(half.numpy(), trace_sums(one, [12], 1), rtol=1e-5, atol=1e-5)
    single = _skewed_sums(maps[2:3].float(), [12], 1, torch.float32, scratch)
    np.testing.assert_allclose(single.numpy(), trace_sums(maps[2:3].float(), [12], 1), rtol=1e-5, atol=1e-5)
    exact = _skewed_sums(maps[2:3], [12], 1, torch.float64, scratch)  # float64 after float32: not its buffer
    np.testing.assert_allclose(exact.numpy(), trace_sums(maps[2:3], [12], 1), rtol=1e-12, atol=1e-12)


def test_skewed_sums_copies_past_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two one-head maps a copy; the second copy holds a 9-token sample then a 12-token one: only the first's rows
    past 9 are left out."""
    monkeypatch.setattr(features_module, "_CACHE_BYTES", 2 * 12 * 49 * 8)  # T = 12: R = 49; two float64 maps
    maps = torch.rand(4, 12, 12, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    maps[2, :, 9:] = 0
    scratch: dict[tuple[int, ...], torch.Tensor] = {}
    sums = _skewed_sums(maps, [12, 12, 9, 12], 1, torch.float64, scratch)
    assert list(scratch) == [(2, 12, 49, -1)]
    np.testing.assert_allclose(sums.numpy(), trace_sums(maps, [12, 12, 9, 12], 1), rtol=1e-12, atol=1e-12)


def test_skewed_sums_take_every_map_in_one_copy_off_the_cpu() -> None:
    """Off the CPU a copy and a column sum are a kernel launch each: BERT-base's 32 x 12 maps of 128 tokens go in
    one copy there (``_DEVICE_COPY_BYTES``), in copies of a few maps on the CPU (``_CACHE_BYTES``). The maps on
    ``meta`` stand for a GPU's: the buffer's shape is what is checked."""
    heads, length = 12, 128
    width = 273  # R: 2T - 1 = 255 rounded up to 16 k + 1, k odd
    per_map = length * width * 4
    for device, chunk in (("meta", 32 * heads), ("cpu", features_module._CACHE_BYTES // per_map)):
        scratch: dict[tuple[int, ...], torch.Tensor] = {}
        maps = torch.zeros(32 * heads, length, length, device=device)
        sums = _skewed_sums(maps, [length] * 32, heads, torch.float32, scratch)
        assert list(scratch) == [(chunk, length, width, -1)], device
        assert sums.shape == (32 * heads, 2 * length - 1)
    assert 1 < features_module._CACHE_BYTES // per_map < 32 * heads


def test_weights_of_a_batch_by_hand() -> None:
    """Special keys in position order (padding ignored, even where it holds a group id), 0 / -1 in unused slots;
    divisors 1/L, 1/(L - 1) for previous / next, 1/[SEP] queries (0 with none)."""
    key_groups = torch.tensor(
        [
            [CLS, -1, PERIOD, -1, SEP],
            [CLS, -1, -1, SEP, -1],
            [CLS, COMMA, SEP, PERIOD, PERIOD],  # L = 3: the two periods are padding
            [CLS, -1, SEP, SEP, SEP],  # L = 2: no [SEP]
        ]
    )
    weights = build_weights(key_groups, torch.tensor([5, 5, 3, 2]), 4, torch.float64)
    assert weights.special_index.tolist() == [[[[0, 2, 4]]], [[[0, 3, 0]]], [[[0, 1, 2]]], [[[0, 0, 0]]]]
    assert weights.special_counts.tolist() == [3, 2, 3, 1]
    assert weights.slot_groups.tolist() == [[CLS, PERIOD, SEP], [CLS, SEP, -1], [CLS, COMMA, SEP], [CLS, -1, -1]]
    assert weights.sep_queries.tolist() == [
        [False, False, False, False, True],
        [False, False, False, True, False],
        [False, False, True, False, False],
        [False] * 5,
    ]
    assert weights.query_mask.sum(1).tolist() == [5, 5, 3, 2]
    assert weights.has_sep.tolist() == [True, True, True, False]
    cases = ((5, 1), (5, 1), (3, 1), (2, 0))  # (L, 1 / [SEP] queries)
    # the N + 5 distance features, then entropy, previous, next, distance, sep_to_sep
    expected = [[1 / L] * 9 + [1 / L, 1 / (L - 1), 1 / (L - 1), 1 / L, sep] for L, sep in cases]
    np.testing.assert_allclose(weights.scale.numpy(), expected, rtol=1e-15)
    assert weights.scale.dtype == torch.float64


def test_one_token_samples_and_an_empty_batch() -> None:
    weights = build_weights(torch.tensor([[-1, -1], [SEP, -1]]), torch.tensor([2, 1]), 4, torch.float64)
    np.testing.assert_allclose(weights.scale[1].numpy(), [1.0] * 9 + [1.0, 0.0, 0.0, 1.0, 1.0])  # no pairs
    empty = build_weights(torch.empty(0, 3, dtype=torch.long), torch.empty(0, dtype=torch.long), 4)
    assert tuple(empty.special_index.shape) == (0, 1, 1, 0)


@pytest.mark.parametrize("num_windows", [0, 250])
def test_num_windows_out_of_range_is_refused(num_windows: int) -> None:
    key_groups, lengths = square_inputs()
    with pytest.raises(ValueError, match=f"^num_windows must be in 1..249, not {num_windows}$"):
        build_weights(key_groups, lengths, num_windows)
    for accepted in (1, 249):
        assert build_weights(key_groups, lengths, accepted).num_windows == accepted


def test_products_are_batched_off_the_cpu_beyond_four_runs() -> None:
    """One product with per-sample cell weights only where kernel launches cost (not on the CPU), and only for
    more than MAX_RUNS_ON_GPU runs of equal length."""
    five = padded([[CLS] * length for length in (6, 5, 4, 3, 2)], 6)
    lengths = torch.tensor([6, 5, 4, 3, 2])
    assert build_weights(five, lengths, 4).per_sample is None  # CPU
    assert build_weights(five, lengths, 4, device="meta").per_sample is not None
    assert build_weights(five[1:], lengths[1:], 4, device="meta").per_sample is None  # 4 runs


def test_reducer_builds_weights_where_the_maps_are() -> None:
    """The probe's callback on maps off the CPU (meta): a square and a cross route's weights are built there, in
    the maps' dtype, from the batch's CPU-side groups and lengths (full-length samples: no padding to check)."""
    routes: dict[Stack, tuple[str, str]] = {"decoder": ("decoder", "decoder"), "cross": ("decoder", "encoder")}
    reducer = _LayerReducer(4, 8, routes)
    decoder = (torch.tensor([[CLS, -1, SEP], [CLS, COMMA, SEP]]), torch.tensor([3, 3]))
    encoder = (torch.tensor([[CLS, -1, -1, SEP], [CLS, PERIOD, -1, SEP]]), torch.tensor([4, 4]))
    reducer.start_batch({"decoder": decoder, "encoder": encoder}, None)
    module = torch.nn.Identity()
    for stack, keys in (("decoder", 3), ("cross", 4)):
        probs = torch.empty(2, 2, 3, keys, dtype=torch.float64, device="meta")
        reducer(AttentionCall(layer=0, probs=probs, scores=probs, module=module, stack=stack))  # type: ignore[arg-type]
        total = reducer.sums[stack, 0]  # type: ignore[index]
        assert (total.device.type, total.dtype, tuple(total.shape)) == ("meta", torch.float64, (2, 14)), stack
    assert reducer.calls == 2


def test_reducer_takes_the_compiled_pass_for_upcast_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 maps from float32 scores (softmax's upcast, as Llama's): the scores are put back in the maps' dtype
    (exactly) and the CPU's compiled pass reduces the layer; its features are the cell-by-cell SPEC reduction's."""
    calls: list[int] = []
    original = kernels.reduce_maps

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(kernels, "reduce_maps", counted)
    groups = [[CLS, -1, PERIOD, -1, SEP], [CLS, COMMA, -1, SEP, -1]]
    generator = torch.Generator().manual_seed(3)
    scores = (3 * torch.randn(2, 2, 5, 5, generator=generator)).bfloat16().float()  # bfloat16 logits, upcast
    probs = scores.softmax(-1).bfloat16()
    reducer = _LayerReducer(N, 8, {"encoder": ("tokens", "tokens")})
    reducer.start_batch({"tokens": (torch.tensor(groups), torch.tensor([5, 5]))}, None)
    reducer(AttentionCall(layer=0, probs=probs, scores=scores, module=torch.nn.Identity()))
    assert calls == [1]
    total = reducer.sums["encoder", 0].numpy()  # (head, F): summed over the two samples
    for h in range(2):
        expected = np.sum([cell_reference(probs[b, h].double().numpy(), groups[b], N) for b in range(2)], axis=0)
        linear = [i for i in range(N + 10) if i != N + 5]  # entropy: from the scores, as good as bfloat16's rounding
        np.testing.assert_allclose(total[h, linear], expected[linear], rtol=1e-4, atol=1e-4)
        assert total[h, N + 5] == pytest.approx(expected[N + 5], abs=16 * torch.finfo(torch.bfloat16).eps)


def test_reducer_reduces_float64_maps_in_float64() -> None:
    groups = [[CLS, -1, PERIOD, -1, SEP], [CLS, COMMA, -1, SEP, -1]]
    generator = torch.Generator().manual_seed(4)
    scores = 3 * torch.randn(2, 2, 5, 5, generator=generator, dtype=torch.float64)
    probs = scores.softmax(-1)
    reducer = _LayerReducer(N, 8, {"encoder": ("tokens", "tokens")})
    reducer.start_batch({"tokens": (torch.tensor(groups), torch.tensor([5, 5]))}, None)
    reducer(AttentionCall(layer=0, probs=probs, scores=scores, module=torch.nn.Identity()))
    total = reducer.sums["encoder", 0]
    assert total.dtype == torch.float64
    for h in range(2):
        expected = np.sum([cell_reference(probs[b, h].numpy(), groups[b], N) for b in range(2)], axis=0)
        np.testing.assert_allclose(total[h].numpy(), expected, rtol=1e-12, atol=1e-12)


def test_an_encoder_decoder_run_cuts_both_inputs_at_max_length() -> None:
    model, tok = family("bart")
    result = extract_features(model, tok, [RUN_SAMPLES[2]], FeatureConfig(num_windows=N, max_length=5))
    sample = RUN_SAMPLES[2]  # text and pair: 10 tokens, cut as the tokenizer cuts a pair
    cut = tok(sample.text, sample.text_pair, truncation=True, max_length=5)["input_ids"]
    assert result.example_tokens == tok.convert_ids_to_tokens(cut)
    assert len(cut) == 5
    # the target (the pair) cut at 5 with its [SEP], then shifted right after the start token ([SEP] in BART)
    assert result.decoder_example_tokens == ["[SEP]", "[CLS]", "a", "big", "dog"]


@pytest.mark.parametrize("name", ["num_windows", "max_length", "batch_size", "samples", "map_size"])
def test_config_refuses_a_count_below_one_naming_it(name: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(f'FeatureConfig.{name} must be >= 1, not 0')}$"):
        FeatureConfig(**{name: 0})  # type: ignore[arg-type]
    if name != "max_length":
        assert getattr(FeatureConfig(**{name: 1}), name) == 1  # type: ignore[arg-type]


def test_config_needs_two_tokens_a_sample() -> None:
    with pytest.raises(ValueError, match=f"^{re.escape('FeatureConfig.max_length must be >= 2')}$"):
        FeatureConfig(max_length=1)
    assert FeatureConfig(max_length=2).max_length == 2


def test_gpu_branches_sum_in_the_weights_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 maps with float64 weights (no special keys): the offset sums are taken in the weights' dtype, so
    the features match the cell-by-cell reduction of the same float32 values to 1e-12."""
    monkeypatch.setattr(features_module, "GPU_BRANCHES_ON_CPU", True)
    groups = [[-1] * 7, [-1] * 4]
    probs, _, key_groups, lengths = masked_batch(groups, heads=2, seed=12)
    probs = probs.float()
    out = reduce_attention(probs, None, build_weights(key_groups, lengths, N, torch.float64))
    assert_matches_reference(out, probs, groups, N, entropy=False)


def test_gpu_branches_reuse_the_batchs_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second layer's reduction reuses the batch's buffers: the skewed copy's and the special keys' columns."""
    monkeypatch.setattr(features_module, "GPU_BRANCHES_ON_CPU", True)
    groups = [[CLS, -1, PERIOD, -1, -1, -1, SEP], [CLS, COMMA, -1, SEP]]
    probs, _, key_groups, lengths = masked_batch(groups, heads=2, seed=13)
    weights = build_weights(key_groups, lengths, N, torch.float64)
    reduce_attention(probs, None, weights)
    buffers = dict(weights.scratch.items())
    assert len(buffers) == 2
    out = reduce_attention(probs.flip(1), None, weights)  # the next layer
    assert all(weights.scratch[key] is value for key, value in buffers.items())
    assert_matches_reference(out, probs.flip(1), groups, N, entropy=False)


def test_unsorted_maps_off_the_cpu_are_summed_there() -> None:
    """A batch not sorted by length, on the meta device: the row-by-row offset sums are taken there too."""
    key_groups = padded([[CLS, -1, SEP], [CLS, -1, -1, -1, SEP]], 5)
    weights = build_weights(key_groups, torch.tensor([3, 5]), 4, torch.float32, device="meta")
    out = reduce_attention(torch.empty(2, 2, 5, 5, device="meta"), None, weights)
    assert (out.device.type, tuple(out.shape)) == ("meta", (2, 2, 14))


def test_the_compiled_pass_takes_a_whole_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU, one compiled pass gives a layer's offset sums, special keys' mass and entropy (from the scores):
    no torch fallback runs, and the kernel's plan is made on the batch's first layer only."""
    calls = dict.fromkeys(["_kernel_inputs", "_special_mass", "_log_normalizer", "_offset_sums"], 0)

    def counted(name: str) -> Any:
        function = getattr(features_module, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return function(*args, **kwargs)

        return call

    for name in calls:
        monkeypatch.setattr(features_module, name, counted(name))
    groups = [[CLS, -1, PERIOD, -1, -1, -1, SEP], [CLS, COMMA, -1, SEP]]
    probs, scores, key_groups, lengths = masked_batch(groups, heads=2, seed=14)
    weights = build_weights(key_groups, lengths, N, torch.float64)
    for layer in range(2):
        layer_probs, layer_scores = (probs, scores) if layer == 0 else (probs.flip(1), scores.flip(1))
        out = reduce_attention(layer_probs, layer_scores, weights)
        assert_matches_reference(out, layer_probs, groups, N)
    assert calls == {"_kernel_inputs": 1, "_special_mass": 0, "_log_normalizer": 0, "_offset_sums": 0}


def test_length_weights_cache_keeps_the_recently_used_within_its_budget() -> None:
    """W_L by (kind, length, padded, windows, dtype, device): the same tensor while cached; least recently used out
    first once the entries pass max_bytes (here: two of 9 x 8 float32 = 288 bytes each)."""
    cpu = torch.device("cpu")
    cache = LengthWeightsCache(max_bytes=2 * 288)
    three = cache.offsets(3, 5, 4, torch.float32, cpu)
    assert cache.offsets(3, 5, 4, torch.float32, cpu) is three
    assert cache.offsets(3, 5, 4, torch.float64, cpu) is not three  # another dtype, another entry (over budget)
    four = cache.offsets(4, 5, 4, torch.float32, cpu)
    five = cache.offsets(5, 5, 4, torch.float32, cpu)  # over budget: 3 (least recently used) goes
    assert cache.offsets(5, 5, 4, torch.float32, cpu) is five
    assert cache.offsets(4, 5, 4, torch.float32, cpu) is four
    assert cache.offsets(3, 5, 4, torch.float32, cpu) is not three
    assert torch.equal(cache.offsets(3, 5, 4, torch.float32, cpu), offset_weights(3, 5, 4, torch.float32, cpu))
    cells = cache.get(3, 5, 4, torch.float64, cpu)  # W_cells: (T*T, N + 4), not W_L
    assert (tuple(cells.shape), cells.dtype) == ((25, 8), torch.float64)
    assert torch.equal(cells, length_weights(3, 5, 4, torch.float64, cpu))
    per_device = LengthWeightsCache()
    per_device.offsets(3, 5, 4, torch.float32, cpu)
    assert per_device.offsets(3, 5, 4, torch.float32, torch.device("meta")).device.type == "meta"  # not the CPU's
    big = LengthWeightsCache(max_bytes=1)  # one entry is kept whatever its size
    kept = big.offsets(3, 5, 4, torch.float32, cpu)
    assert big.offsets(3, 5, 4, torch.float32, cpu) is kept
    big.offsets(4, 5, 4, torch.float32, cpu)  # the newer one is kept, the older one goes
    assert big.offsets(3, 5, 4, torch.float32, cpu) is not kept


def test_gpu_branches_entropy_of_large_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's entropy from float32 scores of ~1000: each row's lse remainder put back for that row (and sample)
    only; float64's value from the same float32 logits."""
    monkeypatch.setattr(features_module, "GPU_BRANCHES_ON_CPU", True)
    groups = [[CLS, -1, -1, -1, -1, -1, SEP], [CLS, -1, -1, SEP]]
    _, scores64, key_groups, lengths = masked_batch(groups, heads=2, seed=15)
    real = torch.arange(7)[None, :] < lengths[:, None]
    scores = (scores64 + 1000.0).float().masked_fill(~real[:, None, None, :], torch.finfo(torch.float32).min)
    probs = scores.softmax(-1)
    entropy = reduce_attention(probs, scores, build_weights(key_groups, lengths, N, torch.float32))[..., N + 5]
    for b, length in enumerate(lengths.tolist()):
        rows = scores[b, :, :length, :length].double().softmax(-1)
        assert entropy[b].numpy() == pytest.approx(torch.special.entr(rows).sum(-1).mean(-1).numpy(), abs=2e-6), b


# --- entropy's precision: read off the scores, sums never rounded back to the maps' dtype ---------------------

UNIFORM_LENGTHS = [64, 32]  # powers of two: 1 / L is exact in half precision


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gpu_branches", [False, True], ids=["compiled", "torch"])
def test_half_precision_entropy_of_uniform_rows_is_read_off_the_scores(
    dtype: torch.dtype, gpu_branches: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Half-precision maps from float32 scores (softmax's upcast, as Llama's): uniform rows over L = 64 and 32 real
    keys; the padding keys' finfo.min becomes -inf in the maps' dtype. The probe's callback puts the scores back in
    the maps' dtype and the entropy is read off them (-inf clamped): log L to float32's rounding. -sum A log A over
    the maps' own values rounds each of the L equal terms the same way: 0.9e-3 to 3e-3 off."""
    monkeypatch.setattr(features_module, "GPU_BRANCHES_ON_CPU", gpu_branches)
    length = max(UNIFORM_LENGTHS)
    real = torch.arange(length)[None, :] < torch.tensor(UNIFORM_LENGTHS)[:, None]  # (batch, T)
    scores = torch.zeros(2, 2, length, length).masked_fill(~real[:, None, None, :], torch.finfo(torch.float32).min)
    probs = scores.softmax(-1).to(dtype)
    assert probs[1, :, :, :32].eq(1 / 32).all()
    assert probs[1, :, :, 32:].eq(0).all()
    assert scores.to(dtype).isneginf().any()
    groups = padded([[CLS] + [-1] * (value - 2) + [SEP] for value in UNIFORM_LENGTHS], length)
    reducer = _LayerReducer(N, 8, {"encoder": ("tokens", "tokens")})
    reducer.start_batch({"tokens": (groups, torch.tensor(UNIFORM_LENGTHS))}, None)
    reducer(AttentionCall(layer=0, probs=probs, scores=scores, module=torch.nn.Identity()))
    entropy = reducer.sums["encoder", 0][:, N + 5]  # (head,): summed over the two samples
    assert entropy.tolist() == pytest.approx([math.log(64) + math.log(32)] * 2, abs=1e-5)


def test_scores_in_another_dtype_than_the_maps_take_the_torch_branches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled pass reads scores in the maps' dtype: float64 scores beside float32 maps (a direct call; the
    probe's callback puts them in the maps' dtype first) are reduced by the torch branches, lse from the scores."""
    calls = {"reduce_maps": 0, "_log_normalizer": 0}

    def counted(name: str, function: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(kernels, "reduce_maps", counted("reduce_maps", kernels.reduce_maps))
    monkeypatch.setattr(features_module, "_log_normalizer", counted("_log_normalizer", features_module._log_normalizer))
    groups = [[CLS, -1, PERIOD, -1, -1, -1, SEP], [CLS, COMMA, -1, SEP]]
    probs64, scores64, key_groups, lengths = masked_batch(groups, heads=2, seed=16)
    probs, scores = probs64.float(), scores64.clamp(min=torch.finfo(torch.float32).min)  # finite in float32 too
    out = reduce_attention(probs, scores, build_weights(key_groups, lengths, N, torch.float32))
    assert calls == {"reduce_maps": 0, "_log_normalizer": 1}
    for b, sample_groups in enumerate(groups):
        real = len(sample_groups)
        for h in range(2):
            expected = cell_reference(probs[b, h, :real, :real].double().numpy(), sample_groups, N)
            np.testing.assert_allclose(out[b, h].numpy(), expected, rtol=1e-5, atol=1e-6, err_msg=f"{b, h}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_entropy_without_scores_keeps_its_sums_in_float32(dtype: torch.dtype) -> None:
    """Without scores (output_attentions maps, as the benchmark's naive path passes them), a half-precision map's
    entropy is -sum A log A of its own terms as its dtype gives them (torch.special.entr), each row's terms summed in
    float32 and the rows in float64: no sum is rounded back to the maps' dtype (a row's entropy of 2 to 4 rounded to
    bfloat16 is up to 2^-7 off). Every query row of a head is the same row here."""
    length = 128
    generator = torch.Generator().manual_seed(17)
    rows = (2 * torch.randn(4, length, generator=generator)).softmax(-1).to(dtype)  # (head, T)
    probs = rows[None, :, None, :].expand(1, 4, length, length).contiguous()
    weights = build_weights(torch.full((1, length), -1), torch.tensor([length]), N, dtype)
    entropy = reduce_attention(probs, None, weights)[0, :, N + 5]  # (head,)
    terms = torch.special.entr(rows).double()  # (head, T): the maps' own terms
    np.testing.assert_allclose(entropy.numpy(), terms.sum(-1).numpy(), rtol=1e-6)


def test_identical_rows_average_to_their_own_entropy() -> None:
    """Float32 maps without scores: every row of a 15-token sample and of a 2-token one halves its mass between two
    keys, so every row's entropy is the same float32 value (ln 2 rounded). The rows are summed in float64, as every
    per-sample sum: the 15-token sample's mean is that value too (a float32 sum of the 15 rows is 9.5e-8 off)."""
    probs = torch.zeros(2, 1, 15, 15)
    s = torch.arange(15)
    probs[0, 0, s, s] = 0.5
    probs[0, 0, s, (s + 1) % 15] = 0.5
    probs[1, 0, :, :2] = 0.5  # 2 real tokens: the padding queries' rows are not read
    weights = build_weights(torch.full((2, 15), -1), torch.tensor([15, 2]), N, torch.float32)
    entropy = reduce_attention(probs, None, weights)[:, 0, N + 5]
    assert float(entropy[1]) == pytest.approx(math.log(2), abs=1e-7)
    assert float(entropy[0]) == pytest.approx(float(entropy[1]), abs=1e-15)


# --- the start token, and a run off the CPU ----------------------------------------------------------------


def test_the_start_token_check_reads_a_word_the_vocabulary_knows() -> None:
    """Whether the tokenizer adds a start token is read off the first id of a known word ("a"): a model whose BOS is
    the tokenizer's unknown token (GPT-2's <|endoftext|> is unk, bos and eos at once) still gets it prepended, though
    an unknown word's first id would be that BOS."""
    model, _ = family("gpt2")
    unknown = VOCAB["[UNK]"]
    model.config.bos_token_id = unknown
    tok = tokenizer(None, type_ids=False, start=False)  # adds no start token
    assert tok("A")["input_ids"] == [unknown]  # an unknown word
    assert _adds_start_token(tok, unknown) is False
    assert _adds_start_token(tokenizer(LLAMA_TEMPLATE, type_ids=False), VOCAB["[CLS]"]) is True
    result = extract_features(model, tok, CAUSAL_SAMPLES[2:], FeatureConfig(num_windows=N, max_length=8))
    assert result.prepended_bos is True
    assert result.example_tokens == ["[UNK]", "it", "ran"]
    assert result.special_token_ids["cls"] == [unknown]


class StopAtForward(Exception):
    """Ends a run at the model's forward (a meta model computes nothing to read back)."""


def test_a_run_off_the_cpu_moves_its_inputs_there_and_probes_whole_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model on the meta device (standing in for a GPU): the batch's inputs reach its forward there, and the probe
    is given no map budget (whole batches; sub-batches that stay in cache are the CPU's)."""
    budgets: list[int | None] = []

    class Recording(AttentionProbe):
        def __init__(self, *args: Any, max_map_bytes: int | None = None, **kwargs: Any) -> None:
            budgets.append(max_map_bytes)
            super().__init__(*args, max_map_bytes=max_map_bytes, **kwargs)

    monkeypatch.setattr(features_module, "AttentionProbe", Recording)
    model, tok = family("bert")
    model.to("meta")
    fed: list[dict[str, str]] = []

    def stop(_: Any, args: Any, kwargs: dict[str, torch.Tensor]) -> None:
        fed.append({name: value.device.type for name, value in kwargs.items()})
        raise StopAtForward

    model.register_forward_pre_hook(stop, with_kwargs=True)
    with pytest.raises(StopAtForward):
        extract_features(model, tok, RUN_SAMPLES, FeatureConfig(num_windows=N, max_length=32))
    assert fed == [dict.fromkeys(["input_ids", "attention_mask", "token_type_ids"], "meta")]
    assert budgets == [None]
    assert features_module._map_budget(torch.device("cpu")) == features_module.SUB_BATCH_MAP_BYTES
