"""Features: the contract of the helpers around the reduction, each against values written by hand or a
plain-loop reference (the cross maps' ``reduce_map`` of ``test_architectures.py``, SPEC sections 1 and 6).

Weights are also built on PyTorch's ``meta`` device: it stands in for a GPU here, so that a weight left on
the CPU (a ``device=`` dropped) shows without CUDA.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from ingest.corpora import Sample
from ingest.features import (
    Encoded,
    FeatureConfig,
    FeatureResult,
    SpecialTokens,
    StackFeatures,
    _as_cls,
    _batches,
    _pad,
    _prepend,
    _start_token,
    _text_config,
    build_cross_weights,
    decoder_start_token,
    encode_samples,
    encode_targets,
    reduce_cross_attention,
    resolve_special_tokens,
)
from ingest.types import SPECIAL_GROUPS
from tests.ingest.test_architectures import BERT_TEMPLATE, T5_TEMPLATE, VOCAB, reduce_map, tokenizer

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
    meta = [t.to("meta") for t in (query_groups, query_lengths, key_groups, key_lengths)]
    assert build_cross_weights(*meta, N).scale.device.type == "meta"


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
    with pytest.raises(ValueError) as error:
        decoder_start_token(model)  # type: ignore[arg-type]
    assert str(error.value) == "Seq2Seq's config names no decoder_start_token_id: cannot feed its decoder"


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
    multimodal = Seq2Seq(config=text_config(SimpleNamespace(bos_token_id=9), text))
    assert _text_config(multimodal) is text
    plain = SimpleNamespace(bos_token_id=5)
    assert _text_config(Seq2Seq(config=plain)) is plain
    assert _text_config(Seq2Seq()) is None
    assert _start_token(multimodal, SimpleNamespace(bos_token_id=7)) == 0
    assert _start_token(Seq2Seq(config=plain), SimpleNamespace(bos_token_id=7)) == 5
    # the config has none (no attribute, or a negative id): the tokenizer's; neither: None
    assert _start_token(Seq2Seq(config=SimpleNamespace()), SimpleNamespace(bos_token_id=7)) == 7  # type: ignore[arg-type]
    assert _start_token(Seq2Seq(config=SimpleNamespace(bos_token_id=-1)), SimpleNamespace()) is None  # type: ignore[arg-type]


def test_group_table_covers_ids_past_the_vocabulary() -> None:
    special = SpecialTokens(ids={"cls": [1], "sep": [5], "period": [0, 2], "comma": []}, tokens={})
    assert torch.equal(special.group_table(4), torch.tensor([PERIOD, CLS, PERIOD, -1, -1, SEP]))
    assert special.group_table(4).dtype == torch.long
    assert torch.equal(special.group_table(7), torch.tensor([PERIOD, CLS, PERIOD, -1, -1, SEP, -1]))
