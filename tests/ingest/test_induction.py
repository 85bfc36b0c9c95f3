"""A model that really has an induction head (tests/induction_model.py, weights set by hand): its
layer-1 induction head and layer-0 previous-token partner are found, and pruning the heads of
``role:induction`` takes the repeat gain away, as zeroing the head's output by hand does."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from ingest.ablation import AblationSpec, AblationSpecError, HeadSelection, spec_callback
from ingest.detectors import (
    DETECTORS,
    DetectionConfig,
    causal_check,
    detect_heads,
    next_token_loss,
    role_heads,
    roles_by_head,
)
from ingest.selection import model_shapes
from tests.induction_model import INDUCTION_HEAD, PREVIOUS_TOKEN_HEAD, build_induction_model, induction_tokenizer
from tests.ingest.test_architectures import BOS
from tests.ingest.test_detectors import reference

CONFIG = DetectionConfig(sequences=8, length=12, copies=2, seed=3, batch_size=4)


@pytest.fixture(scope="module")
def model() -> Any:
    return build_induction_model()


@pytest.fixture(scope="module")
def result(model: Any) -> Any:
    return detect_heads(model, induction_tokenizer(), CONFIG)


def test_the_circuit_is_found(model: Any, result: Any) -> None:
    scores = result.scores["decoder"]  # (layers, heads, 4)
    induction, previous = DETECTORS.index("induction"), DETECTORS.index("previous_token")
    # a perfect induction head on 2 copies: every second-copy row, half the rows scored
    assert scores[INDUCTION_HEAD][induction] == pytest.approx(0.5, abs=1e-3)
    assert scores[PREVIOUS_TOKEN_HEAD][previous] == pytest.approx(1.0, abs=1e-3)
    assert scores[INDUCTION_HEAD][previous] < 0.1
    assert scores[PREVIOUS_TOKEN_HEAD][induction] < 0.01
    assert role_heads(result, "induction") == [("decoder", *INDUCTION_HEAD)]
    assert role_heads(result, "previous_token") == [("decoder", *PREVIOUS_TOKEN_HEAD)]
    assert role_heads(result, "duplicate_token") == []
    expected, _ = reference(model, result.sequences, {0})  # the plain loop over output_attentions
    np.testing.assert_allclose(scores, expected["decoder"], rtol=0, atol=1e-6)


def test_the_model_copies_in_context(result: Any) -> None:
    assert result.loss_later < 0.01  # the second copy is predicted
    assert result.loss_first > 3.0  # the first is not
    assert result.repeat_gain > 3.0


def _gain_with_head_zeroed_by_hand(model: Any, sequences: np.ndarray, layer: int, head: int) -> float:
    """The repeat gain with one head's slice of the output projection's input zeroed (no headcat)."""
    width = model.config.n_embd // model.config.n_head

    def zero(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        merged = args[0].clone()
        merged[..., head * width : (head + 1) * width] = 0
        return (merged, *args[1:])

    hook = model.transformer.h[layer].attn.c_proj.register_forward_pre_hook(zero)
    try:
        with torch.no_grad():
            logits = model(torch.from_numpy(sequences)).logits.double()
    finally:
        hook.remove()
    losses = -torch.log_softmax(logits[:, :-1], -1).gather(-1, torch.from_numpy(sequences[:, 1:, None])).squeeze(-1)
    r = CONFIG.length  # position 0 is BOS; copy c holds positions 1 + c * r .. c * r + r; its first token out
    first = losses[:, 1:r].mean()  # targets at positions 2..r (loss index t - 1)
    later = losses[:, r + 1 : 2 * r].mean()
    return float(first - later)


def test_pruning_role_induction_takes_the_repeat_gain_away(model: Any, result: Any) -> None:
    roles = roles_by_head(result)
    spec = AblationSpec.build({"prune": "role:induction"}, roles=roles, shapes=model_shapes(model))
    assert [head for head, _ in spec.ops] == [("decoder", *INDUCTION_HEAD)]
    pruned = detect_heads(model, induction_tokenizer(), CONFIG, edit=spec_callback(spec))
    assert pruned.repeat_gain is not None
    assert abs(pruned.repeat_gain) < 0.05
    assert pruned.scores["decoder"][INDUCTION_HEAD][DETECTORS.index("induction")] == 0.0
    by_hand = _gain_with_head_zeroed_by_hand(model, result.sequences, *INDUCTION_HEAD)
    assert pruned.repeat_gain == pytest.approx(by_hand, abs=1e-4)
    unpruned = _gain_with_head_zeroed_by_hand(model, result.sequences, 1, 1)  # a head that does nothing
    assert unpruned == pytest.approx(result.repeat_gain, abs=1e-4)


def test_pruning_the_previous_token_partner_breaks_the_circuit_but_not_the_whole_gain(model: Any, result: Any) -> None:
    """K-composition: the induction head's keys read the partner's output, so without it the induction
    head attends evenly and stops copying (no induction score, the repeats no longer predicted). The gain
    does not go: an even mixture of the earlier tokens holds the target in a later copy and never in the
    first. The score and the gain disagree (SPEC 10), here in the other direction."""
    spec = AblationSpec.build(
        {"prune": HeadSelection.of_role("previous_token")}, roles=roles_by_head(result), shapes=model_shapes(model)
    )
    pruned = detect_heads(model, induction_tokenizer(), CONFIG, edit=spec_callback(spec))
    assert role_heads(pruned, "induction") == []
    assert pruned.loss_later is not None
    assert pruned.repeat_gain is not None
    assert pruned.scores["decoder"][INDUCTION_HEAD][DETECTORS.index("induction")] < 0.1
    assert pruned.loss_later > 1.0
    assert pruned.repeat_gain > 3.0


def test_role_selections_need_roles_and_known_names(model: Any, result: Any) -> None:
    shapes = model_shapes(model)
    with pytest.raises(AblationSpecError, match="needs a detection run"):
        AblationSpec.build({"prune": "role:induction"}, shapes=shapes)
    with pytest.raises(AblationSpecError, match="unknown role 'copying'"):
        HeadSelection.of_role("copying")
    with pytest.raises(AblationSpecError, match=r"role\(s\) duplicate_token select no head"):
        AblationSpec.build({"prune": "role:duplicate_token"}, roles=roles_by_head(result), shapes=shapes)
    both = HeadSelection.of_role(["induction", "previous_token"])
    assert both.resolve(None, shapes, roles=roles_by_head(result)) == {
        ("decoder", *INDUCTION_HEAD),
        ("decoder", *PREVIOUS_TOKEN_HEAD),
    }
    assert HeadSelection.from_dict(both.to_dict()) == both
    assert both.describe() == "role:induction+previous_token"


def test_the_causal_check_reports_the_gain_with_and_without_each_role(model: Any, result: Any) -> None:
    checks = causal_check(model, induction_tokenizer(), result, ("induction", "duplicate_token"))
    induction, duplicate = checks
    assert induction["heads"] == [["decoder", *INDUCTION_HEAD]]
    assert induction["with"]["repeat_gain"] == result.repeat_gain
    assert abs(induction["without"]["repeat_gain"]) < 0.05
    assert induction["without"]["loss_later"] > 3.0
    assert duplicate == {"role": "duplicate_token", "heads": [], "with": induction["with"], "without": None}


def test_the_next_token_loss_on_a_corpus_with_and_without_a_head(model: Any, result: Any) -> None:
    """Against the model's own loss (``labels=``), one text at a time, and the head zeroed by hand."""
    tokenizer = induction_tokenizer()
    texts = ["the cat sat on the mat", "a dog ran far away and then the dog ran", "it was red", "big"]
    rows = [[BOS, *tokenizer(text)["input_ids"]] for text in texts]

    def reference(zero: tuple[int, int] | None) -> float:
        width = model.config.n_embd // model.config.n_head
        hook = None
        if zero is not None:
            layer, head = zero

            def hooked(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
                merged = args[0].clone()
                merged[..., head * width : (head + 1) * width] = 0
                return (merged, *args[1:])

            hook = model.transformer.h[layer].attn.c_proj.register_forward_pre_hook(hooked)
        try:
            with torch.no_grad():
                sums = [float(model(torch.tensor([r]), labels=torch.tensor([r])).loss) * (len(r) - 1) for r in rows]
        finally:
            if hook is not None:
                hook.remove()
        return sum(sums) / sum(len(r) - 1 for r in rows)

    assert next_token_loss(model, tokenizer, texts, batch_size=3) == pytest.approx(reference(None), abs=1e-5)
    spec = AblationSpec.build({"prune": "role:induction"}, roles=roles_by_head(result), shapes=model_shapes(model))
    pruned = next_token_loss(model, tokenizer, texts, edit=spec_callback(spec), batch_size=3)
    assert pruned == pytest.approx(reference(INDUCTION_HEAD), abs=1e-5)
    assert pruned != pytest.approx(reference(None), abs=1e-3)  # the text repeats "the" and "dog": the head matters
    (check,) = causal_check(model, tokenizer, result, ("induction",), texts=texts)
    assert check["with"]["corpus_loss"] == pytest.approx(reference(None), abs=1e-5)
    assert check["without"]["corpus_loss"] == pytest.approx(pruned, abs=1e-9)
