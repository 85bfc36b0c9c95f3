"""Head detectors (SPEC 10): sequences, refusals, every score against a plain loop over
``output_attentions=True``, attention forced onto each pattern scoring exactly 1, the repeat gain."""

from __future__ import annotations

import math
from typing import Any, cast

import numpy as np
import pytest
import torch
import transformers as tf

from ingest import detectors as detectors_module
from ingest import features as features_module
from ingest.attention import AttentionCall
from ingest.detectors import (
    DEFAULT_THRESHOLDS,
    DETECTORS,
    DetectionConfig,
    DetectionError,
    detect_heads,
    make_sequences,
    plan_sequences,
    role_heads,
)
from ingest.types import Stack
from tests.ingest.test_architectures import (
    BERT_TEMPLATE,
    BOS,
    EOS,
    GQA,
    LLAMA_TEMPLATE,
    ROBERTA_TEMPLATE,
    SIZE,
    VOCAB,
    Family,
    build,
    tokenizer,
)

BART = {**SIZE, "decoder_start_token_id": EOS, "d_model": 32, "encoder_layers": 2, "decoder_layers": 3}
BART |= {"encoder_attention_heads": 4, "decoder_attention_heads": 2, "encoder_ffn_dim": 37, "decoder_ffn_dim": 37}
BART |= {"max_position_embeddings": 64}
BERT = {**SIZE, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 37}
BERT |= {"max_position_embeddings": 64}

# name -> (family, tokenizer options); LM heads where the family has one, so the gain is checked too.
CASES: dict[str, tuple[Family, dict[str, Any]]] = {
    "gpt2": (Family("gpt2", lambda: tf.GPT2LMHeadModel(tf.GPT2Config(**SIZE, n_embd=32, n_layer=2, n_head=4,
                                                                   n_positions=64)),
                    None, {"decoder": (2, 4)}, ("decoder", 0, 0, "")), {"template": None, "type_ids": False}),
    "llama": (Family("llama", lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**GQA)), LLAMA_TEMPLATE,
                     {"decoder": (2, 4)}, ("decoder", 0, 0, "")), {"template": LLAMA_TEMPLATE, "type_ids": False}),
    "bert": (Family("bert", lambda: tf.BertModel(tf.BertConfig(**BERT)), BERT_TEMPLATE, {"encoder": (2, 4)},
                    ("encoder", 0, 0, "")), {"template": BERT_TEMPLATE, "type_ids": True}),
    "bart": (Family("bart", lambda: tf.BartModel(tf.BartConfig(**BART)), ROBERTA_TEMPLATE,
                    {"encoder": (2, 4), "decoder": (3, 2), "cross": (3, 2)}, ("decoder", 0, 0, "")),
             {"template": ROBERTA_TEMPLATE, "type_ids": False}),
}  # fmt: skip
CONFIG = DetectionConfig(sequences=5, length=6, copies=3, seed=7, batch_size=2)


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest) -> tuple[str, Any, Any]:
    family, options = CASES[request.param]
    return request.param, build(family), tokenizer(options["template"], type_ids=options["type_ids"])


# --- the reference: SPEC 10 in plain loops over output_attentions=True ---------------------------


def reference_scores(a: list[list[float]], ids: list[int], special: set[int], cross: bool) -> dict[str, float | None]:
    """One map's four scores, written from SPEC 10 without the production code's masks."""

    def same(i: int, j: int) -> bool:
        return i not in special and j not in special and ids[i] == ids[j]

    rows = range(1, len(a))
    total = sum(a[i][j] for i in rows for j in range(len(a[i])))
    mass = {
        "previous_token": sum(a[i][i - 1] for i in rows),
        "sink": sum(a[i][0] for i in rows),
        "duplicate_token": sum(a[i][j] for i in rows for j in range(i) if same(i, j)),
        "induction": sum(a[i][j + 1] for i in rows for j in range(len(ids)) if same(i, j) and j + 1 < i),
    }
    return {name: None if cross and name in ("duplicate_token", "induction") else value / total
            for name, value in mass.items()}  # fmt: skip


def reference(model: Any, sequences: np.ndarray, special: set[int]) -> tuple[dict[str, np.ndarray], list[float]]:
    """Per stack ``(layers, heads, 4)`` means over sequences (NaN for no score), and every next-token loss."""
    per_stack: dict[str, list[np.ndarray]] = {}
    losses: list[float] = []
    device = next(model.parameters()).device  # HEADCAT_TEST_DEVICE's (tests/ingest/test_architectures.py)
    for row in sequences.tolist():
        inputs: dict[str, Any] = {"input_ids": torch.tensor([row], device=device)}
        if model.config.is_encoder_decoder:
            inputs["decoder_input_ids"] = torch.tensor([row], device=device)
        with torch.no_grad():
            output = model(**inputs, output_attentions=True)
        if model.config.is_encoder_decoder:
            maps = {"encoder": output.encoder_attentions, "decoder": output.decoder_attentions,
                    "cross": output.cross_attentions}  # fmt: skip
        else:
            maps = {"decoder" if model.config.model_type in ("gpt2", "llama") else "encoder": output.attentions}
        for stack, layers in maps.items():
            values = [
                [[v if v is not None else math.nan for v in reference_scores(head, row, special, stack == "cross")
                  .values()] for head in layer[0].tolist()]
                for layer in layers
            ]  # fmt: skip
            per_stack.setdefault(stack, []).append(np.array(values))
        if hasattr(output, "logits"):
            logits = output.logits[0].double()
            for t in range(1, len(row)):
                losses.append(float(-torch.log_softmax(logits[t - 1], -1)[row[t]]))
    order = [["previous_token", "sink", "duplicate_token", "induction"].index(name) for name in DETECTORS]
    return {stack: np.mean(arrays, axis=0)[..., order] for stack, arrays in per_stack.items()}, losses


# --- the tests --------------------------------------------------------------------------------


# Families of CASES whose attention the fused kernel expresses (ingest.features.FUSED_FAMILIES, one stack).
FUSED = {"llama", "bert"}


@pytest.mark.parametrize("reduction", ["maps", "fused"])
def test_every_score_equals_a_plain_loop_over_output_attentions(
    case: tuple[str, Any, Any], reduction: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``maps``: each layer's maps times the pattern masks; ``fused``: the masses taken in the attention's own pass
    (ingest.fused) where the family is covered, no map made (the maps path elsewhere), as the stored config says."""
    name, model, tok = case
    monkeypatch.setattr(features_module, "REDUCTION", reduction)
    fused = reduction == "fused" and name in FUSED
    if fused:
        monkeypatch.setattr(detectors_module._DetectorReducer, "__call__", lambda self, call: pytest.fail("a map"))
    result = detect_heads(model, tok, CONFIG)
    assert result.config.reduction == result.config.to_json()["reduction"] == ("fused" if fused else "maps")
    plan = result.plan
    length = result.sequences.shape[1]
    special = set(range(len(plan.prefix))) | set(range(length - len(plan.suffix), length))
    expected, losses = reference(model, result.sequences, special)
    assert set(result.scores) == set(expected)
    for stack, values in expected.items():
        stack = cast(Stack, stack)
        assert result.scores[stack].shape == values.shape
        np.testing.assert_allclose(result.scores[stack], values, rtol=0, atol=1e-6, err_msg=f"{name} {stack}")
        finite = values[~np.isnan(values)]
        assert finite.max() - finite.min() > 0.02, "heads that really differ"
    if fused:  # the example the catalog keeps, computed beside the pass: the first sequence's eager maps
        with torch.no_grad():
            ids = torch.tensor(result.sequences[:1], device=next(model.parameters()).device)
            maps = model(input_ids=ids, output_attentions=True).attentions
        (stack,) = result.example_maps
        want = torch.stack([layer[0] for layer in maps]).cpu().numpy()
        np.testing.assert_allclose(result.example_maps[stack], want, rtol=0, atol=1e-6)
    if "cross" in expected:
        assert np.isnan(result.scores["cross"][..., :2]).all()
        assert not np.isnan(result.scores["cross"][..., 2:]).any()
    if name in ("gpt2", "llama"):  # the gain: mean loss on copy 0 minus later copies, each copy's first token out
        start, r = len(plan.prefix), CONFIG.length
        first: list[float] = []
        later: list[float] = []
        for s in range(CONFIG.sequences):
            for t in range(1, length):
                copy, k = divmod(t - start, r)
                if 0 <= copy < CONFIG.copies and k >= 1:
                    (first if copy == 0 else later).append(losses[s * (length - 1) + t - 1])
        assert result.loss_first == pytest.approx(np.mean(first), abs=1e-5)
        assert result.loss_later == pytest.approx(np.mean(later), abs=1e-5)
        assert result.repeat_gain == pytest.approx(np.mean(first) - np.mean(later), abs=1e-5)
    else:
        assert result.repeat_gain is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 7, 1000])  # chunks of one row, across sequences, of one sequence, all
def test_next_token_losses_are_cross_entropy_in_float64(monkeypatch: Any, dtype: torch.dtype, rows: int) -> None:
    """Each position's loss against log-softmax in float64 of the same (rounded) logits, the chunks cut anywhere."""
    vocab = 37
    monkeypatch.setitem(detectors_module.LOSS_CHUNK_BYTES, "cpu", rows * vocab * 4)
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 6, vocab, generator=generator) * 8).to(dtype)  # peaked rows: the log-sum-exp's max
    ids = torch.randint(0, vocab, (3, 6), generator=generator)
    want = -torch.log_softmax(logits.double(), -1)[:, :-1].gather(2, ids[:, 1:, None]).squeeze(2)
    got = detectors_module.next_token_losses(logits, ids)
    assert got.dtype == torch.float32
    assert got.shape == (3, 5)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    wide = torch.zeros(3, 6, 2 * vocab, dtype=dtype)
    wide[..., ::2] = logits  # logits that are not contiguous: the same losses
    torch.testing.assert_close(detectors_module.next_token_losses(wide[..., ::2], ids), got, rtol=0, atol=1e-6)


def test_sequences_are_seeded_repeats_of_distinct_non_special_ids(case: tuple[str, Any, Any]) -> None:
    name, model, tok = case
    plan = plan_sequences(model, tok, CONFIG)
    sequences = make_sequences(plan, CONFIG)
    expected_prefix = {"gpt2": (BOS,), "llama": (BOS,), "bert": (BOS,), "bart": (BOS,)}[name]
    expected_suffix = {"gpt2": (), "llama": (), "bert": (EOS,), "bart": (EOS,)}[name]
    assert (plan.prefix, plan.suffix) == (expected_prefix, expected_suffix)
    assert plan.prefix_source == ("bos" if name == "gpt2" else "tokenizer")
    special = {0, 1, BOS, EOS} | ({4} if tok.mask_token is not None else set())  # [PAD] [UNK] [CLS] [SEP] ([MASK])
    assert set(plan.pool.tolist()) == set(range(len(VOCAB))) - special
    start = len(plan.prefix)
    assert sequences.shape == (CONFIG.sequences, start + CONFIG.length * CONFIG.copies + len(plan.suffix))
    for row in sequences:
        body = row[start : start + CONFIG.length]
        assert len(set(body.tolist())) == CONFIG.length
        assert set(body.tolist()) <= set(plan.pool.tolist())
        for c in range(CONFIG.copies):
            assert (row[start + c * CONFIG.length : start + (c + 1) * CONFIG.length] == body).all()
    assert len({tuple(row) for row in sequences.tolist()}) > 1
    np.testing.assert_array_equal(sequences, make_sequences(plan, CONFIG))
    other = make_sequences(plan, DetectionConfig(sequences=5, length=6, copies=3, seed=8))
    assert not np.array_equal(sequences, other)


def forced(pattern: str, special_positions: set[int]) -> Any:
    """An edit that puts each row's attention on ``pattern``'s cells (evenly), nothing elsewhere."""

    def edit(call: AttentionCall) -> torch.Tensor:
        probs = call.probs
        batch, _, q, k = probs.shape
        out = torch.zeros_like(probs)
        ids = edit.ids[call.rows : call.rows + batch]  # type: ignore[attr-defined]
        for b in range(batch):
            for i in range(1, q):
                cells = []
                row = ids[b]

                def same(x: int, y: int, row: list[int] = row) -> bool:
                    return x not in special_positions and y not in special_positions and row[x] == row[y]

                for j in range(k):
                    if pattern == "previous_token" and j == i - 1 or pattern == "sink" and j == 0:
                        cells.append(j)
                    elif pattern == "duplicate_token" and j < i and same(i, j):
                        cells.append(j)
                    elif pattern == "induction" and j >= 1 and j < i and same(i, j - 1):
                        cells.append(j)
                for j in cells:
                    out[b, :, i, j] = 1.0 / len(cells)
        return out

    return edit


@pytest.mark.parametrize("pattern", DETECTORS)
def test_attention_forced_onto_a_pattern_scores_exactly_one(case: tuple[str, Any, Any], pattern: str) -> None:
    name, model, tok = case
    config = DetectionConfig(sequences=3, length=5, copies=2, seed=1, batch_size=2)
    plan = plan_sequences(model, tok, config)
    sequences = make_sequences(plan, config).tolist()
    length = len(sequences[0])
    special = set(range(len(plan.prefix))) | set(range(length - len(plan.suffix), length))
    edit = forced(pattern, special)
    edit.ids = sequences  # type: ignore[attr-defined]
    result = detect_heads(model, tok, config, edit=edit)
    for stack, values in result.scores.items():
        column = DETECTORS.index(pattern)
        if stack == "cross" and pattern in ("induction", "duplicate_token"):
            assert np.isnan(values[..., column]).all()
            continue
        np.testing.assert_array_equal(values[..., column], 1.0, err_msg=f"{name} {stack} {pattern}")
        others = [k for k, other in enumerate(DETECTORS) if other != pattern and not np.isnan(values[..., k]).any()]
        assert all(values[..., k].max() < 1.0 for k in others), "another pattern does not fill the same cells"


def test_roles_follow_the_thresholds(case: tuple[str, Any, Any]) -> None:
    name, model, tok = case
    if name != "gpt2":
        pytest.skip("one family is enough: roles are read off the scores")
    edit = forced("previous_token", {0})
    config = DetectionConfig(sequences=2, length=4, copies=2, seed=0)
    plan = plan_sequences(model, tok, config)
    edit.ids = make_sequences(plan, config).tolist()  # type: ignore[attr-defined]
    result = detect_heads(model, tok, config, edit=edit)
    assert all("previous_token" in roles for layer in result.roles("decoder") for roles in layer)
    assert role_heads(result, "previous_token") == [("decoder", layer, head) for layer in range(2) for head in range(4)]
    assert role_heads(result, "induction") == []
    strict = DetectionConfig(sequences=2, length=4, copies=2, seed=0, thresholds={"previous_token": 1.0, "sink": 0})
    result = detect_heads(model, tok, strict, edit=edit)
    assert result.config.thresholds == {**DEFAULT_THRESHOLDS, "previous_token": 1.0, "sink": 0.0}
    assert len(role_heads(result, "previous_token")) == 8
    assert len(role_heads(result, "sink")) == 8  # every score reaches 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"copies": 1}, "copies: must be >= 2"),
        ({"length": 1}, "length: must be >= 2"),
        ({"sequences": 0}, "sequences: must be >= 1"),
        ({"thresholds": {"induction": 1.5}}, "thresholds.induction: must lie in [0, 1], not 1.5"),
        ({"thresholds": {"sink": -0.1}}, "thresholds.sink"),
        ({"thresholds": {"sink": float("nan")}}, "thresholds.sink"),
        ({"thresholds": {"copying": 0.5}}, "unknown detector 'copying'"),
    ],
)
def test_bad_configs_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(DetectionError, match=message.replace("[", r"\[").replace("]", r"\]")):
        DetectionConfig(**options)


def test_lengths_beyond_positions_or_vocabulary_are_refused_before_any_forward(
    case: tuple[str, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    name, model, tok = case
    calls = []
    pool = len(plan_sequences(model, tok, CONFIG).pool)
    assert pool == len(VOCAB) - (5 if tok.mask_token is not None else 4)
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(DetectionError, match=f"length {pool + 1} is more than the {pool} non-special tokens"):
        detect_heads(model, tok, DetectionConfig(length=pool + 1, copies=2))
    # 64 positions: 18 x 4 = 72 tokens
    with pytest.raises(DetectionError, match=r"more than the model's 64 positions"):
        detect_heads(model, tok, DetectionConfig(length=18, copies=4))
    assert calls == []


def test_a_vocabulary_of_fewer_than_two_ordinary_tokens_is_refused() -> None:
    config = tf.GPT2Config(vocab_size=5, n_embd=16, n_layer=1, n_head=2, n_positions=32, bos_token_id=BOS,
                           eos_token_id=EOS, pad_token_id=0)  # fmt: skip
    model = tf.GPT2LMHeadModel(config).eval()
    model.set_attn_implementation("eager")
    with pytest.raises(DetectionError, match="vocabulary has 1 non-special token"):
        detect_heads(model, tokenizer(None, type_ids=False), DetectionConfig(length=2))


@pytest.mark.parametrize(
    ("length", "copies", "prefix", "suffix"), [(7, 2, 1, 1), (5, 3, 1, 0), (9, 4, 0, 1), (1, 2, 1, 1)]
)
def test_pattern_cells_are_the_dense_masks_cell_for_cell(length: int, copies: int, prefix: int, suffix: int) -> None:
    """The O(T) cells (what both paths now use) against the dense (T, T, 5) masks, the reference."""
    body = torch.randperm(100, generator=torch.Generator().manual_seed(length))[:length]
    ids = torch.cat([torch.full((prefix,), 500), body.repeat(copies), torch.full((suffix,), 501)])
    total = len(ids)
    special = torch.zeros(total, dtype=torch.bool)
    special[:prefix] = True
    special[total - suffix :] = True
    identity = torch.where(special, -1 - torch.arange(total), ids)
    reference = detectors_module.pattern_masks(ids[None], special)[0]
    cells = detectors_module.pattern_cells(identity)
    assert torch.equal(detectors_module.cell_masks(cells, total).view(total, total, 5).bool(), reference)
    rows = torch.repeat_interleave(torch.arange(total), cells.rows.diff())
    listed = sorted(zip(rows.tolist(), cells.keys.tolist(), cells.kinds.tolist(), strict=True))
    assert len(set(listed)) == len(listed)  # no cell counted twice
    equal = identity[:, None] == identity[None, :]
    assert torch.equal(detectors_module.first_positions(identity[None])[0], equal.int().argmax(1))


def test_first_positions_are_equal_exactly_when_two_rows_repeat_alike() -> None:
    """detect_heads' check that every sequence shares the first one's repetition pattern: equal first positions
    for the same pattern over other ids, different ones when a single repeat moves."""
    rows = torch.tensor([[7, 3, 7, 9, 3], [4, 8, 4, 6, 8], [4, 8, 4, 6, 6], [1, 2, 3, 4, 5]])
    first = detectors_module.first_positions(rows)
    assert first.tolist()[0] == [0, 1, 0, 3, 1]
    assert torch.equal(first[0], first[1])
    assert not torch.equal(first[0], first[2])
    assert first[3].tolist() == [0, 1, 2, 3, 4]
