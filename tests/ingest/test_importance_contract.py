"""The contract of ``ingest.importance`` beyond the finite-difference checks of test_importance.py.

References, each independent of the code under test: finite differences of the loss (or of the
last hidden states) through forward pre-hooks on the output projections (plain eager
transformers, no headcat gate); losses written out with ``log_softmax`` and loops; gate
gradients worked out by hand; the mask rule and the orderings of the docstrings spelled out.
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from ingest.attention import OutputCall
from ingest.evaluation import Evaluator
from ingest.importance import (
    TYPE_ORDER,
    Curve,
    CurvePoint,
    HeadGate,
    ImportanceConfig,
    ImportanceError,
    ImportanceResult,
    LossBatch,
    _mlm_mask,
    _only_stack,
    _stack_arrays,
    architectures,
    check_loss,
    head_importance,
    lm_kind,
    loss_batches,
    normalize_by_layer,
    per_example_loss,
    primary_metric,
    prune_order,
    prune_spec,
    pruning_curve,
    score_evaluator,
    step_counts,
)
from ingest.tasks import QAExample
from ingest.types import Stack
from tests.ingest.test_importance import EPS, HEADS, LAYERS, SENTENCES, _examples


def _bert_config(vocab_size: int = 30522, **kw: Any) -> Any:
    from transformers import BertConfig

    return BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=HEADS,  # type: ignore[call-arg]
                      intermediate_size=64, max_position_embeddings=512, attn_implementation="eager",
                      **kw)  # fmt: skip


def _sharpen(model: torch.nn.Module) -> torch.nn.Module:
    """Query and key weights scaled up so that heads differ; float64, eval, frozen."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(part in name for part in (".query.", ".key.", "q_proj", "k_proj", "c_attn")):
                param.mul_(6.0)
    return model.double().eval().requires_grad_(False)


@pytest.fixture(scope="module")
def tokenizer(minilm_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path)


@pytest.fixture(scope="module")
def classifier() -> Any:
    from transformers import BertForSequenceClassification

    torch.manual_seed(11)
    return _sharpen(BertForSequenceClassification(_bert_config(num_labels=2)))


@pytest.fixture(scope="module")
def mlm() -> Any:
    from transformers import BertForMaskedLM

    torch.manual_seed(13)
    return _sharpen(BertForMaskedLM(_bert_config()))


@pytest.fixture(scope="module")
def encoder() -> Any:
    from transformers import BertModel

    torch.manual_seed(14)
    model = BertModel(_bert_config())
    with torch.no_grad():  # LayerNorm gains of 1 make every token's states sum to a constant: not what trained ones do
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
    return _sharpen(model)


@pytest.fixture(scope="module")
def gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(15)
    config = GPT2Config(vocab_size=50, n_embd=32, n_layer=LAYERS, n_head=HEADS, n_positions=32,
                        attn_implementation="eager")  # type: ignore[call-arg]  # fmt: skip
    return _sharpen(GPT2LMHeadModel(config))


def _output_projection(model: Any, layer: int) -> torch.nn.Module:
    if hasattr(model, "transformer"):  # GPT-2
        return model.transformer.h[layer].attn.c_proj
    return model.base_model.encoder.layer[layer].attention.output.dense


def _scale_heads(model: Any, factors: dict[tuple[int, int], float]) -> list[Any]:
    """Forward pre-hooks multiplying head ``(layer, head)``'s context slice by its factor."""
    width = model.config.hidden_size // model.config.num_attention_heads
    handles = []
    for layer in range(LAYERS):
        mine = {head: f for (lay, head), f in factors.items() if lay == layer}
        if not mine:
            continue

        def hook(_module: Any, args: tuple[torch.Tensor, ...], mine: dict[int, float] = mine) -> Any:
            x = args[0].clone()
            for head, factor in mine.items():
                x[..., head * width : (head + 1) * width] *= factor
            return (x, *args[1:])

        handles.append(_output_projection(model, layer).register_forward_pre_hook(hook))
    return handles


def _fd(model: Any, value_of: Any, zeroed: tuple[tuple[int, int], ...] = ()) -> np.ndarray:
    """``(layers, heads, ...)``: central difference of ``value_of()`` in each head's scale (at 1),
    with the ``zeroed`` heads scaled by 0 throughout."""
    out = []
    for layer in range(LAYERS):
        row = []
        for head in range(HEADS):
            values = []
            for factor in (1 + EPS, 1 - EPS):
                factors = dict.fromkeys(zeroed, 0.0)
                factors[(layer, head)] = 0.0 if (layer, head) in zeroed else factor
                handles = _scale_heads(model, factors)
                try:
                    with torch.no_grad():
                        values.append(np.asarray(value_of(), dtype=np.float64))
                finally:
                    for handle in handles:
                        handle.remove()
            row.append((values[0] - values[1]) / (2 * EPS))
        out.append(row)
    return np.array(out)


# --------------------------------------------------------------------------------------------
# Configuration and results
# --------------------------------------------------------------------------------------------


def test_config_defaults_are_the_spec_ones_and_bounds_are_checked() -> None:
    assert ImportanceConfig().to_dict() == {"loss": "task", "seed": 0, "mask_probability": 0.15, "probes": 8}
    for p in (0.0, 1.0, -0.5, 1.5):
        with pytest.raises(ImportanceError, match=rf"mask_probability must lie in \(0, 1\), got {p}"):
            ImportanceConfig("lm", mask_probability=p)
    assert ImportanceConfig("lm", mask_probability=1e-9).mask_probability == 1e-9
    assert ImportanceConfig("lm", mask_probability=1 - 1e-9).mask_probability == 1 - 1e-9
    with pytest.raises(ImportanceError, match="probes must be at least 1, got 0"):
        ImportanceConfig("sensitivity", probes=0)
    assert ImportanceConfig("sensitivity", probes=1).probes == 1
    with pytest.raises(ImportanceError, match="unknown loss 'nope'; losses: task, lm, sensitivity"):
        ImportanceConfig("nope")  # type: ignore[arg-type]


def test_result_lists_every_head_and_picks_the_single_stack() -> None:
    raw: dict[Stack, np.ndarray] = {"encoder": np.array([[3.0, 4.0, 0.0], [1.0, 2.0, 2.0]]),
                                    "cross": np.array([[5.0, 12.0, 0.0]])}  # fmt: skip
    normalized: dict[Stack, np.ndarray] = {stack: normalize_by_layer(scores) for stack, scores in raw.items()}
    result = ImportanceResult(ImportanceConfig(), raw, normalized, 3, 0.5, 0.1)
    assert list(result.heads()) == [
        (("encoder", 0, 0), 3.0, 0.6), (("encoder", 0, 1), 4.0, 0.8), (("encoder", 0, 2), 0.0, 0.0),
        (("encoder", 1, 0), 1.0, 1 / 3), (("encoder", 1, 1), 2.0, 2 / 3), (("encoder", 1, 2), 2.0, 2 / 3),
        (("cross", 0, 0), 5.0, 5 / 13), (("cross", 0, 1), 12.0, 12 / 13), (("cross", 0, 2), 0.0, 0.0),
    ]  # fmt: skip
    with pytest.raises(ImportanceError, match=r"the model has stacks \['cross', 'encoder'\]; pick one"):
        result.single_stack()
    one = ImportanceResult(ImportanceConfig(), {"decoder": raw["encoder"]}, {"decoder": normalized["encoder"]},
                           3, 0.5, 0.1)  # fmt: skip
    np.testing.assert_array_equal(one.single_stack(), normalized["encoder"])  # the normalised scores


def test_normalisation_of_a_non_square_integer_array() -> None:
    got = normalize_by_layer(np.array([[0, 0, 0, 0], [1, 2, 2, 4]]))
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, [[0.0, 0.0, 0.0, 0.0], [0.2, 0.4, 0.4, 0.8]])


# --------------------------------------------------------------------------------------------
# The gate
# --------------------------------------------------------------------------------------------


def test_gate_is_a_per_example_leaf_of_ones_and_applies_fixed_factors() -> None:
    generator = torch.Generator().manual_seed(0)
    output = torch.randn(2, 3, 4, 5, generator=generator, dtype=torch.float64)  # (batch, q, head, head_dim)
    module = torch.nn.Identity()
    assert HeadGate().fixed == {}
    gate = HeadGate({("encoder", 1): torch.tensor([1.0, 0.0, 2.0, 1.0])})  # float32 factors
    same = gate(OutputCall(layer=0, output=output, module=module))
    torch.testing.assert_close(same, output, rtol=0, atol=0)
    changed = gate(OutputCall(layer=1, output=output, module=module))
    assert changed.dtype == torch.float64
    expected = output.clone()
    expected[:, :, 1] = 0.0
    expected[:, :, 2] *= 2.0
    torch.testing.assert_close(changed, expected, rtol=0, atol=0)
    assert list(gate.gates) == [("encoder", 0), ("encoder", 1)]
    for xi in gate.gates.values():
        assert xi.shape == (2, 4)
        assert xi.dtype == torch.float64
        assert xi.is_leaf
        assert xi.requires_grad
        torch.testing.assert_close(xi, torch.ones(2, 4, dtype=torch.float64), rtol=0, atol=0)
    # d sum(out) / d xi[b, h] = (sum of head h's context of example b) x its fixed factor
    grads = torch.autograd.grad((same.sum() + changed.sum()), list(gate.gates.values()))
    per_head = output.sum(dim=(1, 3))  # (batch, head)
    torch.testing.assert_close(grads[0], per_head)
    torch.testing.assert_close(grads[1], per_head * torch.tensor([1.0, 0.0, 2.0, 1.0], dtype=torch.float64))
    with pytest.raises(RuntimeError, match="encoder layer 1 ran twice in one forward pass"):
        gate(OutputCall(layer=1, output=output, module=module))
    gate(OutputCall(layer=0, output=output, module=module, stack="decoder"))  # another stack's layer 0
    gate.reset()
    assert gate.gates == {}
    gate(OutputCall(layer=1, output=output, module=module))  # a new forward pass
    # a bfloat16 model gets bfloat16 back (the float32 factors do not widen what it computes)
    gate.reset()
    half = gate(OutputCall(layer=1, output=output.to(torch.bfloat16), module=module))
    assert half.dtype == torch.bfloat16
    assert gate.gates[("encoder", 1)].dtype == torch.bfloat16
    torch.testing.assert_close(half, expected.to(torch.bfloat16), rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# Which loss a model has
# --------------------------------------------------------------------------------------------


def test_the_model_class_decides_the_loss() -> None:
    import transformers as tf

    small = _bert_config(vocab_size=64)
    decoder = _bert_config(vocab_size=64, is_decoder=True)
    gpt = tf.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    models: dict[str | None, list[Any]] = {
        "masked": [tf.BertForMaskedLM(small), tf.BertForPreTraining(small)],
        "causal": [tf.BertLMHeadModel(decoder), tf.GPT2LMHeadModel(gpt)],
        None: [tf.BertModel(small), tf.BertForSequenceClassification(small), tf.GPT2Model(gpt)],
    }
    for kind, found in models.items():
        for model in found:
            assert lm_kind(model) == kind, type(model).__name__
            if kind is None:
                with pytest.raises(ImportanceError, match=f"the lm loss needs a masked- or causal-LM head; "
                                                          f"{type(model).__name__} has none"):  # fmt: skip
                    check_loss(model, "lm")
            else:
                check_loss(model, "lm")
    check_loss(tf.BertForSequenceClassification(small), "task")
    check_loss(tf.BertForQuestionAnswering(small), "task")
    for model in (tf.BertModel(small), tf.BertForMaskedLM(small)):
        with pytest.raises(ImportanceError, match=f"the task loss needs a classification or QA head; "
                                                  f"{type(model).__name__} has none"):  # fmt: skip
            check_loss(model, "task")
    check_loss(tf.BertModel(small), "sensitivity")  # any model has hidden states
    bare = tf.BertModel(small)
    assert architectures(bare) == ("BertModel",)
    bare.config.architectures = ["BertForMaskedLM", "BertForPreTraining"]
    assert architectures(bare) == ("BertForMaskedLM", "BertForPreTraining")


# --------------------------------------------------------------------------------------------
# Per-example losses, written out
# --------------------------------------------------------------------------------------------


def _nll(logits: torch.Tensor, target: int) -> float:
    return -float(torch.log_softmax(logits.double(), dim=-1)[target])


def test_per_example_losses_by_hand() -> None:
    from transformers.modeling_outputs import QuestionAnsweringModelOutput, SequenceClassifierOutput

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 4, generator=g, dtype=torch.float64)
    labels = torch.tensor([2, 0, 3])
    batch = LossBatch({}, {"labels": labels})
    got = per_example_loss(None, SequenceClassifierOutput(logits=logits), batch, "task")  # type: ignore[arg-type]
    np.testing.assert_allclose(got.numpy(), [_nll(logits[i], int(labels[i])) for i in range(3)], rtol=1e-12)
    with pytest.raises(ImportanceError, match="^the task loss needs a sequence-classification head$"):
        per_example_loss(None, SequenceClassifierOutput(logits=logits[:, None]), batch, "task")  # type: ignore[arg-type]
    with pytest.raises(ImportanceError, match="^the task loss needs a sequence-classification head$"):
        per_example_loss(None, SimpleNamespace(), batch, "task")  # type: ignore[arg-type]

    start_logits = torch.randn(2, 7, generator=g, dtype=torch.float64)
    end_logits = torch.randn(2, 7, generator=g, dtype=torch.float64)
    qa = LossBatch({}, {"start": torch.tensor([1, 4]), "end": torch.tensor([2, 6])})
    output = QuestionAnsweringModelOutput(start_logits=start_logits, end_logits=end_logits)
    got = per_example_loss(None, output, qa, "task")  # type: ignore[arg-type]
    expected = [(_nll(start_logits[0], 1) + _nll(end_logits[0], 2)) / 2,
                (_nll(start_logits[1], 4) + _nll(end_logits[1], 6)) / 2]  # fmt: skip
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12)
    with pytest.raises(ImportanceError, match="^the SQuAD loss needs a question-answering head$"):
        per_example_loss(None, SequenceClassifierOutput(logits=start_logits), qa, "task")  # type: ignore[arg-type]
    with pytest.raises(ImportanceError, match="no per-example loss for 'sensitivity'"):
        per_example_loss(None, output, qa, "sensitivity")  # type: ignore[arg-type]


def test_lm_losses_are_the_mean_over_each_examples_counted_tokens() -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 5, 6, generator=g, dtype=torch.float64)  # (batch, seq, vocab)
    # masked LM: the labelled positions only; an example with none has loss 0, not NaN
    lm_labels = torch.tensor([[-100, 3, -100, 5, -100], [1, -100, -100, -100, -100], [-100] * 5])
    masked = LossBatch({"input_ids": torch.zeros(3, 5, dtype=torch.long)}, {"lm_labels": lm_labels})
    got = per_example_loss(None, SimpleNamespace(logits=logits), masked, "lm")  # type: ignore[arg-type]
    expected = [(_nll(logits[0, 1], 3) + _nll(logits[0, 3], 5)) / 2, _nll(logits[1, 0], 1), 0.0]
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12)
    # causal LM: token t predicts token t + 1, padding is neither predicted nor counted
    ids = torch.tensor([[1, 2, 3, 4, 5], [5, 4, 3, 0, 0], [2, 0, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    causal = LossBatch({"input_ids": ids, "attention_mask": mask})
    got = per_example_loss(None, SimpleNamespace(logits=logits), causal, "lm")  # type: ignore[arg-type]
    expected = [
        sum(_nll(logits[0, t], int(ids[0, t + 1])) for t in range(4)) / 4,
        (_nll(logits[1, 0], 4) + _nll(logits[1, 1], 3)) / 2,
        0.0,  # one token: nothing to predict
    ]
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12)


def test_half_precision_logits_are_widened_and_float64_is_kept() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 3, generator=g, dtype=torch.float64) * 4
    labels = torch.tensor([0, 1, 2, 1])
    batch = LossBatch({}, {"labels": labels})
    exact = [_nll(logits[i], int(labels[i])) for i in range(4)]
    wide = per_example_loss(None, SimpleNamespace(logits=logits), batch, "task")  # type: ignore[arg-type]
    assert wide.dtype == torch.float64
    np.testing.assert_allclose(wide.numpy(), exact, rtol=1e-14)
    half = logits.to(torch.bfloat16)
    got = per_example_loss(None, SimpleNamespace(logits=half), batch, "task")  # type: ignore[arg-type]
    assert got.dtype == torch.float32
    np.testing.assert_allclose(
        got.numpy(), [_nll(half[i].double(), int(labels[i])) for i in range(4)], rtol=1e-5, atol=1e-6
    )


# --------------------------------------------------------------------------------------------
# Loss batches
# --------------------------------------------------------------------------------------------


def _maskable(ids: torch.Tensor, mask: torch.Tensor, tokenizer: Any) -> torch.Tensor:
    special = torch.tensor([i in set(tokenizer.all_special_ids) for i in ids.flatten().tolist()]).view(ids.shape)
    return ~special & (mask == 1)


def test_masked_lm_batches_mask_a_seeded_share_of_each_examples_own_tokens(mlm, tokenizer) -> None:
    long = " ".join(["the quick brown fox jumps over the lazy dog"] * 25)  # ~225 tokens
    texts = [text for text, _ in SENTENCES] + [long]
    evaluator = Evaluator.for_task("drift", mlm, tokenizer, texts, batch_size=4, cache=False)
    plain = {int(r): (b.inputs, j) for b in evaluator._prepared.batches for j, r in enumerate(b.rows)}
    config = ImportanceConfig("lm", seed=7)

    def per_example(batches: list[LossBatch], prepared: Any) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for batch, source in zip(batches, prepared.batches, strict=True):
            for j, row in enumerate(source.rows.tolist()):
                real = batch.inputs["attention_mask"][j] == 1
                out[row] = (batch.inputs["input_ids"][j][real], batch.targets["lm_labels"][j][real])
        return out

    batches = loss_batches(evaluator, config)
    got = per_example(batches, evaluator._prepared)
    for row, (inputs, j) in plain.items():
        ids, mask = inputs["input_ids"][j], inputs["attention_mask"][j]
        maskable = _maskable(ids, mask, tokenizer)
        real = mask == 1
        masked_ids, labels = got[row]
        chosen = labels != -100
        assert chosen.sum() >= 1
        assert not (chosen & ~maskable[real]).any()  # never [CLS], [SEP] or padding
        torch.testing.assert_close(labels[chosen], ids[real][chosen])
        assert (masked_ids[chosen] == tokenizer.mask_token_id).all()
        torch.testing.assert_close(masked_ids[~chosen], ids[real][~chosen])
        # the rule of the docstring: example i's mask is default_rng([seed, i]).random(n) < p
        candidates = torch.nonzero(maskable[real]).flatten().numpy()
        draws = np.random.default_rng([7, row]).random(len(candidates)) < 0.15
        if draws.any():
            np.testing.assert_array_equal(torch.nonzero(chosen).flatten().numpy(), candidates[draws])
    padded = [b for b in batches if (b.inputs["attention_mask"] == 0).any()]
    assert padded  # the long text pads the others in its batch: padding keeps -100 and its id
    for batch, source in zip(batches, evaluator._prepared.batches, strict=True):
        pad = source.inputs["attention_mask"] == 0
        assert (batch.targets["lm_labels"][pad] == -100).all()
        torch.testing.assert_close(batch.inputs["input_ids"][pad], source.inputs["input_ids"][pad])
        torch.testing.assert_close(batch.inputs["attention_mask"], source.inputs["attention_mask"])
    share = float((got[len(texts) - 1][1] != -100).float().mean())
    assert 0.09 < share < 0.21  # 15 % of ~225 tokens
    # independent of batching, different for another seed, all tokens for p -> 1
    again = loss_batches(Evaluator.for_task("drift", mlm, tokenizer, texts, batch_size=1, cache=False), config)
    alone = per_example(again, Evaluator.for_task("drift", mlm, tokenizer, texts, batch_size=1, cache=False)._prepared)
    for row in got:
        torch.testing.assert_close(alone[row][1], got[row][1])
    other = per_example(loss_batches(evaluator, ImportanceConfig("lm", seed=8)), evaluator._prepared)
    assert not torch.equal(other[len(texts) - 1][1], got[len(texts) - 1][1])
    every = per_example(loss_batches(evaluator, ImportanceConfig("lm", mask_probability=0.999999)), evaluator._prepared)
    for row, (inputs, j) in plain.items():
        real = inputs["attention_mask"][j] == 1
        np.testing.assert_array_equal((every[row][1] != -100).numpy(), _maskable(inputs["input_ids"][j],
                                      inputs["attention_mask"][j], tokenizer)[real].numpy())  # fmt: skip


def test_mlm_mask_takes_one_token_when_the_draw_takes_none_and_skips_examples_without_any() -> None:
    ids = torch.arange(32).view(4, 8)
    special = torch.zeros(4, 8, dtype=torch.bool)
    special[0] = True  # nothing to mask in the first example
    special[1, [0, 7]] = True
    special[2, 5:] = True
    special[3] = True
    special[3, 4] = False  # one maskable token
    rows = np.array([4, 9, 2, 6])
    chosen = _mlm_mask(ids, special, rows, seed=3, p=1e-12)
    assert chosen.dtype == torch.bool
    assert chosen.shape == ids.shape
    assert not chosen[0].any()
    assert chosen[1].sum() == 1
    assert chosen[2].sum() == 1
    assert chosen[3].tolist() == [False] * 4 + [True] + [False] * 3
    assert not (chosen & special).any()
    # the one token is drawn uniformly from (seed, example index): over many indices, all of them
    seen = set()
    for row in range(60):
        seen |= set(torch.nonzero(_mlm_mask(ids[2:], special[2:], np.array([row]), 3, 1e-12)[0]).flatten().tolist())
    assert seen == {0, 1, 2, 3, 4}
    every = _mlm_mask(ids, special, rows, seed=3, p=1 - 1e-12)
    torch.testing.assert_close(every, ~special)


def test_masked_lm_needs_a_mask_token(mlm, tokenizer) -> None:
    no_mask = copy.deepcopy(tokenizer)
    no_mask.mask_token = None
    assert no_mask.mask_token_id is None
    evaluator = Evaluator.for_task("drift", mlm, no_mask, ["a text"], cache=False)
    with pytest.raises(ImportanceError, match="^the masked-LM loss needs a tokenizer with a mask token$"):
        loss_batches(evaluator, ImportanceConfig("lm"))


def test_other_losses_take_the_evaluators_batches_as_they_are(encoder, mlm, classifier, tokenizer) -> None:
    texts = [text for text, _ in SENTENCES]
    for model in (encoder, mlm):  # the sensitivity of a masked LM does not mask its input
        evaluator = Evaluator.for_task("drift", model, tokenizer, texts, batch_size=2, cache=False)
        batches = loss_batches(evaluator, ImportanceConfig("sensitivity"))
        assert len(batches) == 3
        for batch, source in zip(batches, evaluator._prepared.batches, strict=True):
            assert batch.targets == {}
            assert batch.inputs.keys() == source.inputs.keys()
            for name, value in batch.inputs.items():
                torch.testing.assert_close(value, source.inputs[name], rtol=0, atol=0)
    labelled = Evaluator.for_task("classification", classifier, tokenizer, _examples(), batch_size=2, cache=False)
    for batch, source in zip(loss_batches(labelled, ImportanceConfig("task")), labelled._prepared.batches, strict=True):
        assert batch.targets["labels"].tolist() == [SENTENCES[r][1] for r in source.rows.tolist()]


def test_squad_windows_that_cut_the_answer_off_target_cls(tokenizer) -> None:
    from transformers import BertForQuestionAnswering

    torch.manual_seed(2)
    model = _sharpen(BertForQuestionAnswering(_bert_config()))
    context = ("Long ago a small grey cat lived in a quiet village by the river. Every morning the cat "
               "sat on the warm stone steps of the baker's house and watched the boats go by.")  # fmt: skip
    answer = "the warm stone steps"
    # "" at a token boundary ("grey|" + " cat" has a space; "baker|'s" has none)
    boundary = context.index("'s")
    last = "the boats go by."
    examples = [
        QAExample("a", "Where did the cat sit?", context, (answer,), (context.index(answer),), "t", 0),
        QAExample("b", "What?", context, ("",), (boundary,), "t", 0),
        QAExample("c", "When?", context, ("Long ago",), (0,), "t", 0),  # the context's first token
        QAExample("d", "What did it watch?", context, (last,), (context.index(last),), "t", 0),  # its last
    ]
    evaluator = Evaluator.for_task("squad", model, tokenizer, examples, max_length=32, stride=8, batch_size=3,
                                   cache=False)  # fmt: skip
    prepared = evaluator._prepared
    assert prepared.feature_example is not None
    assert prepared.offsets is not None
    batches = loss_batches(evaluator, ImportanceConfig("task"))
    whole: dict[str, int] = {}
    cut = 0
    for batch, source in zip(batches, prepared.batches, strict=True):
        for j, row in enumerate(source.rows.tolist()):
            start, end = int(batch.targets["start"][j]), int(batch.targets["end"][j])
            example = examples[int(prepared.feature_example[row])]
            spans = [span for span in prepared.offsets[row] if span[0] >= 0]
            if example.id == "b":
                assert end >= start  # a degenerate (empty) answer still gives a span
                continue
            a, b = example.answer_starts[0], example.answer_starts[0] + len(example.answers[0])
            if spans[0][0] <= a and spans[-1][1] >= b:
                whole[example.id] = whole.get(example.id, 0) + 1
                ids = batch.inputs["input_ids"][j, start : end + 1].tolist()
                assert tokenizer.decode(ids) == example.answers[0].lower()
            else:
                cut += 1
                assert (start, end) == (0, 0)
    assert set(whole) == {"a", "c", "d"}
    assert cut >= 3


# --------------------------------------------------------------------------------------------
# Scoring: pruned heads, losses, bookkeeping
# --------------------------------------------------------------------------------------------


def _ce_per_example(model: Any, batches: list[LossBatch]) -> list[float]:
    out = []
    with torch.no_grad():
        for batch in batches:
            logits = model(**batch.inputs).logits
            out += [_nll(logits[j], int(batch.targets["labels"][j])) for j in range(batch.size)]
    return out


def test_pruned_heads_score_zero_and_the_others_are_the_derivative_without_them(classifier, tokenizer) -> None:
    evaluator = Evaluator.for_task("classification", classifier, tokenizer, _examples(), batch_size=2, cache=False)
    config = ImportanceConfig("task")
    batches = loss_batches(evaluator, config)
    pruned = ((0, 0), (1, 3))
    params = list(classifier.parameters())
    calls: list[tuple[int, int, bool]] = []

    def progress(done: int, total: int) -> None:  # called inside the scoring: parameters frozen
        calls.append((done, total, any(p.requires_grad for p in params)))

    classifier.requires_grad_(True)
    try:
        result = head_importance(classifier, batches, config, pruned=iter([("encoder", *h) for h in pruned]),
                                 progress=progress)  # fmt: skip
    finally:
        classifier.requires_grad_(False)
    assert calls == [(1, 3, False), (2, 3, False), (3, 3, False)]
    assert result.n_examples == 5
    assert result.raw["encoder"].dtype == np.float64

    def losses() -> list[float]:
        return _ce_per_example(classifier, batches)

    expected = np.abs(_fd(classifier, losses, zeroed=pruned)).mean(axis=-1)
    for head in pruned:
        expected[head] = 0.0
    assert min(expected[h] for h in np.ndindex(LAYERS, HEADS) if h not in pruned) > 1e-8  # the others matter
    np.testing.assert_allclose(result.raw["encoder"], expected, rtol=1e-6, atol=1e-12)
    # the mean loss is that of the pruned model
    handles = _scale_heads(classifier, dict.fromkeys(pruned, 0.0))
    try:
        pruned_loss = np.mean(losses())
    finally:
        for handle in handles:
            handle.remove()
    assert result.mean_loss == pytest.approx(pruned_loss, rel=1e-12)
    assert result.mean_loss != pytest.approx(np.mean(losses()), rel=1e-6)
    for bad in [("encoder", 0, HEADS), ("encoder", 0, -1), ("encoder", LAYERS, 0), ("decoder", 0, 0)]:
        with pytest.raises(ImportanceError, match=rf"head \({bad[0]!r}, {bad[1]}, {bad[2]}\) is not a head"):
            head_importance(classifier, batches, config, pruned=[bad])  # type: ignore[list-item]


def test_scoring_uses_eval_mode_restores_the_mode_and_the_gradient_flags(classifier, tokenizer) -> None:
    evaluator = Evaluator.for_task("classification", classifier, tokenizer, _examples(), batch_size=5, cache=False)
    config = ImportanceConfig("task")
    batches = loss_batches(evaluator, config)
    started = time.perf_counter()
    reference = head_importance(classifier, batches, config)
    assert 0 < reference.seconds <= time.perf_counter() - started
    assert reference.mean_loss == pytest.approx(np.mean(_ce_per_example(classifier, batches)), rel=1e-12)
    assert reference.config is config
    params = list(classifier.parameters())
    flags = [i % 3 == 0 for i in range(len(params))]
    classifier.train()
    try:
        for param, flag in zip(params, flags, strict=True):
            param.requires_grad_(flag)
        again = head_importance(classifier, batches, config)
        assert classifier.training
        assert [p.requires_grad for p in params] == flags
        assert all(p.grad is None for p in params)
        # dropout was off: the same scores as in eval mode
        np.testing.assert_array_equal(again.raw["encoder"], reference.raw["encoder"])
    finally:
        classifier.eval().requires_grad_(False)
    head_importance(classifier, batches, config)
    assert not classifier.training


def test_sensitivity_is_the_probe_estimate_of_the_hidden_state_derivative(encoder, classifier, tokenizer) -> None:
    texts = [text for text, _ in SENTENCES[:3]]
    evaluator = Evaluator.for_task("drift", encoder, tokenizer, texts, batch_size=3, cache=False)
    config = ImportanceConfig("sensitivity", probes=3, seed=5)
    result = score_evaluator(evaluator, config)
    assert math.isnan(result.mean_loss)
    (batch,) = evaluator._prepared.batches
    with torch.no_grad():
        shape = encoder(**batch.inputs).last_hidden_state.shape
    # dH/dxi by central differences of the whole batch: each example's gate moves only its own states
    jacobian = _fd(encoder, lambda: encoder(**batch.inputs).last_hidden_state.numpy())  # (L, H, batch, seq, hidden)
    real = batch.inputs["attention_mask"].numpy()[:, :, None]
    generator = torch.Generator().manual_seed(5)  # the seeded Rademacher probes, drawn in order
    probes = [(torch.randint(0, 2, shape, generator=generator) * 2 - 1).double().numpy() for _ in range(3)]
    projections = np.stack([(jacobian * (r * real)).sum(axis=(-1, -2)) for r in probes])  # (K, L, H, batch)
    expected = np.sqrt((projections**2).mean(axis=0)).mean(axis=-1)
    assert (real == 0).any()  # padding is left out of the probes
    np.testing.assert_allclose(result.raw["encoder"], expected, rtol=1e-6, atol=1e-10)
    with pytest.raises(ImportanceError, match="^the sensitivity loss needs a bare encoder's last hidden states$"):
        score_evaluator(Evaluator.for_task("drift", classifier, tokenizer, texts, cache=False), config)


def test_causal_lm_importance_is_the_finite_difference_of_the_next_token_loss(gpt2) -> None:
    generator = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 50, (3, 7), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    mask[2, 3:] = 0
    batches = [LossBatch({"input_ids": ids[:2], "attention_mask": mask[:2]}),
               LossBatch({"input_ids": ids[2:], "attention_mask": mask[2:]})]  # fmt: skip
    result = head_importance(gpt2, batches, ImportanceConfig("lm"))
    assert result.n_examples == 3

    def losses() -> list[float]:
        out = []
        for batch in batches:
            logits = gpt2(**batch.inputs).logits
            for j in range(batch.size):
                n = int(batch.inputs["attention_mask"][j].sum())
                out.append(sum(_nll(logits[j, t], int(batch.inputs["input_ids"][j, t + 1])) for t in range(n - 1))
                           / (n - 1))  # fmt: skip
        return out

    with torch.no_grad():
        assert result.mean_loss == pytest.approx(np.mean(losses()), rel=1e-12)
    expected = np.abs(_fd(gpt2, losses)).mean(axis=-1)
    assert list(result.raw) == ["decoder"]
    np.testing.assert_allclose(result.raw["decoder"], expected, rtol=1e-6, atol=1e-12)


def test_several_stacks_are_scored_apart_and_a_curve_refuses_them(tokenizer) -> None:
    from transformers import BartConfig, BartModel

    torch.manual_seed(7)
    config = BartConfig(vocab_size=30522, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
                        attn_implementation="eager")  # type: ignore[call-arg]  # fmt: skip
    bart = _sharpen(BartModel(config))
    texts = [text for text, _ in SENTENCES[:2]]
    evaluator = Evaluator.for_task("drift", bart, tokenizer, texts, batch_size=2, cache=False)
    result = score_evaluator(evaluator, ImportanceConfig("sensitivity", probes=1))
    assert list(result.raw) == ["encoder", "decoder", "cross"]  # in the order they run
    assert {stack: s.shape for stack, s in result.raw.items()} == {"encoder": (2, 4), "decoder": (3, 2),
                                                                   "cross": (3, 2)}  # fmt: skip
    for scores in result.raw.values():
        assert (scores > 0).all()
    with pytest.raises(ImportanceError, match=r"pruning curves prune one stack; the model has \['cross', "):
        _only_stack(evaluator)


def test_layers_missing_from_the_gate_are_refused() -> None:
    with pytest.raises(RuntimeError, match=r"encoder layers \[0, 2\] are not 0..n-1"):
        _stack_arrays({("encoder", 0): torch.ones(2), ("encoder", 2): torch.ones(2)})
    got = _stack_arrays({("decoder", 1): torch.full((2,), 2.0), ("decoder", 0): torch.ones(2, dtype=torch.float16)})
    np.testing.assert_array_equal(got["decoder"], [[1.0, 1.0], [2.0, 2.0]])
    assert got["decoder"].dtype == np.float64


# --------------------------------------------------------------------------------------------
# Rankings, steps, curves
# --------------------------------------------------------------------------------------------


def test_importance_rankings_break_ties_by_layer_then_head() -> None:
    scores = np.array([[0.2, 0.1, 0.2], [0.1, 0.2, 0.3]])
    assert prune_order("importance", 2, 3, scores=scores) == [(0, 1), (1, 0), (0, 0), (0, 2), (1, 1), (1, 2)]
    assert prune_order("-importance", 2, 3, scores=scores) == [(1, 2), (0, 0), (0, 2), (1, 1), (0, 1), (1, 0)]
    for ranking in ("importance", "-importance"):
        with pytest.raises(ImportanceError, match=rf"the {ranking} ranking needs a \(2, 3\) score array"):
            prune_order(ranking, 2, 3, scores=scores.T)  # type: ignore[arg-type]
    with pytest.raises(ImportanceError, match=r"unknown ranking 'best'; rankings: importance, type, random"):
        prune_order("best", 2, 3)  # type: ignore[arg-type]


def test_type_ranking_follows_type_order_then_other_types_by_name() -> None:
    assert TYPE_ORDER == ("vertical", "dense_vertical", "dense", "diagonal")
    types = {(0, 0): "diagonal", (0, 1): "zeta", (0, 2): "dense", (0, 3): "alpha",
             (1, 0): "dense_vertical", (1, 1): "vertical", (1, 2): "alpha", (1, 3): "dense"}  # fmt: skip
    assert prune_order("type", 2, 4, types=types) == [
        (1, 1), (1, 0), (0, 2), (1, 3), (0, 0), (0, 3), (1, 2), (0, 1)
    ]  # fmt: skip
    empties: tuple[dict[tuple[int, int], str] | None, ...] = (None, {})
    for empty in empties:
        with pytest.raises(ImportanceError, match="^the type ranking needs the heads' types"):
            prune_order("type", 2, 4, types=empty)
    del types[(1, 2)], types[(0, 0)]
    with pytest.raises(ImportanceError, match="needs a type for every head; 2 have none"):
        prune_order("type", 2, 4, types=types)


def test_random_ranking_is_a_seeded_permutation() -> None:
    order = prune_order("random", 3, 4, seed=5)
    assert sorted(order) == [(layer, head) for layer in range(3) for head in range(4)]
    assert order == prune_order("random", 3, 4, seed=5)
    assert prune_order("random", 3, 4) == prune_order("random", 3, 4, seed=0)


def test_step_counts_bounds() -> None:
    assert step_counts(10, 4) == [0, 1, 2, 4, 5]  # the default max_share is half
    assert step_counts(10, 3, 1.0) == [0, 3, 7, 10]
    assert step_counts(12, 1, 0.25) == [0, 3]
    for share in (0.0, -0.1, 1.01):
        with pytest.raises(ImportanceError, match=rf"max_share must lie in \(0, 1\], got {share}"):
            step_counts(10, 2, share)
    with pytest.raises(ImportanceError, match="steps must be at least 1, got 0"):
        step_counts(10, 0)


def test_prune_spec_prunes_exactly_those_heads() -> None:
    spec = prune_spec(iter([[1, 3], (0, 1)]), 2, 4)  # type: ignore[arg-type]
    assert spec.heads == {("encoder", 0, 1): "prune", ("encoder", 1, 3): "prune"}
    assert spec.shapes == (("encoder", 2, 4),)
    assert not spec.renormalize


def test_curve_points_progress_and_metric(classifier, tokenizer) -> None:
    evaluator = Evaluator.for_task("classification", classifier, tokenizer, _examples(), batch_size=5, cache=False)
    calls: list[tuple[int, int]] = []
    started = time.perf_counter()
    curve = pruning_curve(evaluator, "random", steps=3, max_share=0.25, seed=4, iterative=True,
                          progress=lambda done, total: calls.append((done, total)))  # fmt: skip
    elapsed = time.perf_counter() - started
    assert calls == [(1, 3), (2, 3), (3, 3)]
    assert not curve.iterative  # only the importance rankings change between steps
    assert curve.ranking == "random"
    order = prune_order("random", LAYERS, HEADS, seed=4)
    assert curve.order == tuple(order[:2])
    assert [p.step for p in curve.points] == [0, 1, 2, 3]
    assert [p.pruned for p in curve.points] == [0, 1, 1, 2]  # round(2/3), round(4/3), 2 of 8
    assert [p.share for p in curve.points] == [0.0, 0.125, 0.125, 0.25]
    assert [p.heads for p in curve.points] == [(), (order[0],), (order[0],), tuple(sorted(order[:2]))]
    assert curve.points[0].seconds == 0.0
    assert all(0 < p.seconds <= elapsed for p in curve.points[1:])
    assert curve.baseline == evaluator.baseline()
    for point in curve.points[1:]:
        assert point.metrics == dict(evaluator.run(prune_spec(point.heads, LAYERS, HEADS)).values)
    assert curve.metric("accuracy") == [p.metrics["accuracy"] for p in curve.points]
    assert all(isinstance(v, float) for v in curve.metric("accuracy"))
    zero = pruning_curve(evaluator, "random", steps=4, max_share=0.1)  # round(0.2): no head at step 1
    assert zero.points[1].pruned == 0
    assert zero.points[1].metrics == dict(evaluator.baseline().values)


def test_iterative_curve_rescores_the_remaining_heads(classifier, tokenizer) -> None:
    evaluator = Evaluator.for_task("classification", classifier, tokenizer, _examples(), batch_size=3, cache=False)
    config = ImportanceConfig("task")

    def next_heads(ranking: str, pruned: list[tuple[int, int]], k: int, scores: np.ndarray | None = None) -> list:
        if scores is None:
            scores = score_evaluator(evaluator, config, pruned=[("encoder", *h) for h in pruned]).single_stack()
        return [h for h in prune_order(ranking, LAYERS, HEADS, scores=scores) if h not in pruned][:k]  # type: ignore[arg-type]

    given = np.arange(LAYERS * HEADS, dtype=np.float64).reshape(LAYERS, HEADS)  # not the model's scores
    # (ranking, heads per step, scores given); with one head a step, "-importance" re-scored after two
    # steps picks another head than the ranking after one step would: each step must re-score
    for ranking, k, scores in (("importance", 2, None), ("-importance", 2, None), ("importance", 2, given),
                               ("-importance", 1, None)):  # fmt: skip
        curve = pruning_curve(evaluator, ranking, steps=3, max_share=3 * k / (LAYERS * HEADS), iterative=True,  # type: ignore[arg-type]
                              scores=scores)  # fmt: skip
        assert curve.iterative
        first = next_heads(ranking, [], k, scores)  # the first step follows the scores given, if any
        second = next_heads(ranking, first, k)
        third = next_heads(ranking, first + second, k)
        assert list(curve.order) == first + second + third
        assert [p.heads for p in curve.points] == [(), tuple(sorted(first)), tuple(sorted(first + second)),
                                                   tuple(sorted(first + second + third))]  # fmt: skip


def test_one_shot_curves_with_the_defaults(encoder, classifier, tokenizer) -> None:
    texts = [text for text, _ in SENTENCES]
    drift = Evaluator.for_task("drift", encoder, tokenizer, texts, batch_size=5, cache=False)
    curve = pruning_curve(drift, "random")  # 10 steps up to half the heads, seed 0
    assert [p.pruned for p in curve.points] == [0, 0, 1, 1, 2, 2, 2, 3, 3, 4, 4]
    assert curve.order == tuple(prune_order("random", LAYERS, HEADS, seed=0)[:4])
    baseline = dict(drift.baseline().values)
    for point in curve.points:
        if point.pruned == 0:
            assert point.metrics == baseline
        else:  # the drift moves with every head pruned
            assert point.metrics == dict(drift.run(prune_spec(point.heads, LAYERS, HEADS)).values)
            assert point.metrics != baseline
    scores = np.linspace(0.0, 1.0, LAYERS * HEADS).reshape(LAYERS, HEADS)[:, ::-1]
    once = pruning_curve(drift, "importance", steps=1, max_share=0.25, scores=scores)
    assert not once.iterative
    assert once.order == ((0, 3), (0, 2))  # the two lowest scores
    types = {(layer, head): ("dense", "vertical", "diagonal", "other")[head] for layer in range(LAYERS)
             for head in range(HEADS)}  # fmt: skip
    typed = pruning_curve(drift, "type", steps=1, max_share=0.5, types=types)
    assert typed.order == ((0, 1), (1, 1), (0, 0), (1, 0))


def test_primary_metric() -> None:
    assert primary_metric("classification", {"f1": 1.0, "accuracy": 2.0, "cosine": 3.0}) == "accuracy"
    assert primary_metric("squad", {"exact_match": 1.0, "f1": 2.0, "cosine": 3.0}) == "f1"
    assert primary_metric("drift", {"kl": 1.0, "cosine": 2.0}) == "cosine"
    assert primary_metric("drift", {"top1": 1.0, "kl": 2.0}) == "kl"
    assert primary_metric("classification", {"f1": 1.0, "kl": 2.0}) == "kl"
    assert primary_metric("drift", {"x": 1.0, "y": 2.0}) == "x"


def test_curve_records_are_frozen() -> None:
    point = CurvePoint(1, 2, 0.25, {"accuracy": 50.0}, ((0, 1), (1, 0)), 0.1)
    with pytest.raises(AttributeError):
        point.pruned = 3  # type: ignore[misc]
    assert Curve("importance", False, ((0, 1),), (point,), None).metric("accuracy") == [50.0]  # type: ignore[arg-type]


def test_scoring_checks_the_loss_first_and_reports_progress(encoder, classifier, tokenizer) -> None:
    texts = [text for text, _ in SENTENCES]
    drift = Evaluator.for_task("drift", encoder, tokenizer, texts, batch_size=2, cache=False)
    message = "the task loss needs a classification or QA head; BertModel has none"
    with pytest.raises(ImportanceError, match=message):
        score_evaluator(drift, ImportanceConfig("task"))
    with pytest.raises(ImportanceError, match=message):
        head_importance(encoder, loss_batches(drift, ImportanceConfig("sensitivity")), ImportanceConfig("task"))
    with pytest.raises(ImportanceError, match="^no examples to score$"):
        head_importance(classifier, [], ImportanceConfig("task"))
    labelled = Evaluator.for_task("classification", classifier, tokenizer, _examples(), batch_size=2, cache=False)
    with pytest.raises(ImportanceError, match=r"^the task loss needs labelled data \(classification or SQuAD\)$"):
        loss_batches(Evaluator.for_task("drift", classifier, tokenizer, texts, cache=False), ImportanceConfig("task"))
    calls: list[tuple[int, int]] = []
    score_evaluator(labelled, ImportanceConfig("task"), progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 3), (2, 3), (3, 3)]


def test_a_model_whose_attention_never_runs_is_refused(tokenizer) -> None:
    from transformers import BertModel, BertPreTrainedModel
    from transformers.modeling_outputs import BaseModelOutput

    class BertEmbeddingsOnly(BertPreTrainedModel):
        """A real BERT whose forward stops at the embeddings: its attention modules never run."""

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.bert = BertModel(config)
            self.post_init()

        def forward(self, input_ids: torch.Tensor, **_: Any) -> BaseModelOutput:
            return BaseModelOutput(last_hidden_state=self.bert.embeddings(input_ids=input_ids))

    model = BertEmbeddingsOnly(_bert_config(vocab_size=64)).eval()
    batch = LossBatch({"input_ids": torch.tensor([[2, 5, 3]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)})
    with pytest.raises(ImportanceError, match="^BertEmbeddingsOnly's attention never reached headcat's attention path"):
        head_importance(model, [batch], ImportanceConfig("sensitivity"))
