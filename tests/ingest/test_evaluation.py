"""Task readers, SQuAD/GLUE scoring, drift, the shared Evaluator and plans on real task models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.hooks import RemovableHandle

from ingest.ablation import AblationSpec, AblationSpecError, HeadSelection, PlanRow, paper_plan
from ingest.attention import AttentionProbe
from ingest.evaluation import (
    Evaluator,
    classification_scores,
    exact_match_score,
    f1_score,
    kl_divergence,
    mean_token_cosine,
    normalize_answer,
    run_plan,
    squad_scores,
)
from ingest.tasks import (
    ClassificationExample,
    QAExample,
    TaskDataError,
    check_labels,
    read_classification,
    read_glue_tsv,
    read_jsonl,
    read_squad,
)
from ingest.types import HEAD_TYPES
from tests.surgery import hand_run

# --------------------------------------------------------------------------------------------
# SQuAD scoring (official v1.1 normalisation)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "normal"),
    [
        ("The Walt Disney Company", "walt disney company"),
        ("  An apple, a day!  ", "apple day"),
        ("Theater of the absurd", "theater of absurd"),
        ("Denver Broncos.", "denver broncos"),
        ("1,000 (approx.)", "1000 approx"),
        ("a", ""),
    ],
)
def test_normalize_answer(text: str, normal: str) -> None:
    assert normalize_answer(text) == normal


def test_exact_match_and_f1() -> None:
    assert exact_match_score("the Denver Broncos", "Denver Broncos!") == 1.0
    assert exact_match_score("Broncos", "Denver Broncos") == 0.0
    assert f1_score("Broncos", "Denver Broncos") == pytest.approx(2 * 1.0 * 0.5 / 1.5)
    assert f1_score("the cat sat", "a dog sat") == pytest.approx(0.5)
    assert f1_score("", "anything") == 0.0
    assert f1_score("x y y", "y y z") == pytest.approx(2 / 3)  # counts, not sets


def test_squad_scores_take_the_best_gold_answer() -> None:
    examples = [
        QAExample("q1", "?", "ctx", ("Denver Broncos", "Broncos"), (0, 7), "t", 0),
        QAExample("q2", "?", "ctx", ("Santa Clara",), (0,), "t", 0),
        QAExample("q3", "?", "ctx", ("Levi's Stadium",), (0,), "t", 0),
    ]
    scores = squad_scores({"q1": "broncos", "q2": "Santa Clara, California"}, examples)
    assert scores["exact_match"] == pytest.approx(100 / 3)
    assert scores["f1"] == pytest.approx(100 * (1 + 2 * (2 / 3) / (1 + 2 / 3) + 0) / 3)


def test_classification_scores() -> None:
    predictions = np.array([1, 1, 0, 0, 1])
    labels = np.array([1, 0, 0, 1, 1])
    scores = classification_scores(predictions, labels, num_labels=2)
    assert scores["accuracy"] == pytest.approx(60.0)
    assert scores["f1"] == pytest.approx(100 * 2 * 2 / (2 * 2 + 1 + 1))  # tp 2, fp 1, fn 1
    macro = classification_scores(np.array([0, 1, 2, 2]), np.array([0, 1, 2, 1]), num_labels=3)
    assert macro["f1"] == pytest.approx(100 * (1 + 2 / 3 + 2 / 3) / 3)


def test_kl_and_cosine() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    assert torch.equal(kl_divergence(logits, logits), torch.zeros(2))
    other = torch.tensor([[3.0, 2.0, 1.0], [0.0, 0.0, 0.0]])
    p = logits.softmax(-1)
    q = other.softmax(-1)
    torch.testing.assert_close(kl_divergence(logits, other), (p * (p / q).log()).sum(-1))
    mask = torch.tensor([[True, True, False], [True, True, True]])
    masked = kl_divergence(logits, other + torch.tensor([0.0, 0.0, 50.0]), mask)  # masked entry ignored
    torch.testing.assert_close(masked[0], kl_divergence(logits[:1, :2], other[:1, :2])[0])
    hidden = torch.randn(2, 3, 4)
    pad = torch.tensor([[1, 1, 0], [1, 1, 1]])
    changed = hidden.clone()
    changed[0, 2] = -changed[0, 2]  # a padding position: ignored
    torch.testing.assert_close(mean_token_cosine(hidden, changed, pad), torch.ones(2))


# --------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------


class _Config:
    num_labels = 2
    label2id = {"not_equivalent": 0, "equivalent": 1}
    id2label = {0: "not_equivalent", 1: "equivalent"}


def test_read_mrpc_tsv_with_bom_and_literal_quotes(tmp_path: Path) -> None:
    path = tmp_path / "dev.tsv"
    path.write_text(
        '\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\tHe said "no.\tHe "said" no.\n0\t3\t4\tA\tB\n',
        encoding="utf-8",
    )
    rows = read_glue_tsv(path, config=_Config())
    assert rows == [ClassificationExample('He said "no.', 'He "said" no.', 1), ClassificationExample("A", "B", 0)]
    text, pair, label = rows[0]
    assert label == 1


def test_read_sst2_tsv_and_errors_name_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "sst.tsv"
    path.write_text("sentence\tlabel\ngood film \t1\nbad\t0\n", encoding="utf-8")
    assert read_glue_tsv(path) == [ClassificationExample("good film ", None, 1), ClassificationExample("bad", None, 0)]
    path.write_text("sentence\tlabel\ngood\t1\nbad\t0\textra\n", encoding="utf-8")
    with pytest.raises(TaskDataError, match=rf"{path.name}:3: 3 columns, the header has 2"):
        read_glue_tsv(path)
    path.write_text("sentence\tlabel\ngood\t1\nbad\tterrible\n", encoding="utf-8")
    with pytest.raises(TaskDataError, match=rf"{path.name}:3: label 'terrible' is not one of the model's labels"):
        read_glue_tsv(path, config=_Config())
    path.write_text("sentence\tlabel\ngood\t1\nbad\t2\n", encoding="utf-8")
    with pytest.raises(TaskDataError, match=r"label id\(s\) \[2\] do not fit the model's head of 2 labels"):
        read_glue_tsv(path, config=_Config())
    path.write_text("index\tsentence\n0\tgood\n", encoding="utf-8")
    with pytest.raises(TaskDataError, match="no label column"):
        read_glue_tsv(path)


def test_read_jsonl_with_rte_and_generic_names(tmp_path: Path) -> None:
    path = tmp_path / "val.jsonl"
    records = [
        {"premise": "P1", "hypothesis": "H1", "label": "entailment", "idx": 0},
        {"premise": "P2", "hypothesis": "H2", "label": "not_entailment", "idx": 1},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    label2id = {"entailment": 0, "not_entailment": 1}
    assert read_jsonl(path, label2id=label2id) == [
        ClassificationExample("P1", "H1", 0),
        ClassificationExample("P2", "H2", 1),
    ]
    with pytest.raises(TaskDataError, match=rf"{path.name}:1: label 'entailment' is not one of the model's labels"):
        read_jsonl(path, config=_Config())
    generic = tmp_path / "g.jsonl"
    generic.write_text('{"text": "a", "text_pair": "b", "label": 1}\n{"text": "c", "label": 0}\n', encoding="utf-8")
    with pytest.raises(TaskDataError, match=rf"{generic.name}:2: no field\(s\) 'text_pair'"):
        read_classification(generic)
    generic.write_text('{"text": "a", "label": 1}\n{"text": \n', encoding="utf-8")
    with pytest.raises(TaskDataError, match=rf"{generic.name}:2: not valid JSON"):
        read_classification(generic)


def test_read_squad_and_article_ranges(tmp_path: Path) -> None:
    document: dict[str, Any] = {
        "version": "1.1",
        "data": [
            {
                "title": f"A{a}",
                "paragraphs": [
                    {
                        "context": "Paris is in France.",
                        "qas": [
                            {"id": f"{a}-0", "question": "Where?", "answers": [{"text": "France", "answer_start": 12}]}
                        ],
                    }
                ],
            }
            for a in range(3)
        ],
    }
    path = tmp_path / "squad.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    assert [e.id for e in read_squad(path)] == ["0-0", "1-0", "2-0"]
    held_out = read_squad(path, articles=(1, 3))
    assert [(e.id, e.title, e.article, e.answers, e.answer_starts) for e in held_out] == [
        ("1-0", "A1", 1, ("France",), (12,)),
        ("2-0", "A2", 2, ("France",), (12,)),
    ]
    del document["data"][1]["paragraphs"][0]["qas"][0]["question"]
    path.write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(TaskDataError, match=r"data\[1\]\.paragraphs\[0\]\.qas\[0\]: malformed"):
        read_squad(path)
    with pytest.raises(TaskDataError, match="articles 0-9 asked for, the file has 3"):
        read_squad(path, articles=range(10))


def test_shared_files_parse(shared_dir: Path) -> None:
    data = shared_dir / "data"
    held_out = read_squad(data / "squad-v1.1" / "dev-v1.1.json", articles=range(24, 48))
    assert len(held_out) == 4874
    assert held_out[0].title == "American_Broadcasting_Company"
    assert len(read_glue_tsv(data / "glue-mrpc" / "dev.tsv", config=_Config())) == 408
    sst = read_glue_tsv(data / "glue-sst2" / "dev.tsv")
    assert len(sst) == 872
    assert sum(label for _, _, label in sst) == 444
    rte = read_classification(data / "glue-rte" / "val.jsonl", label2id={"entailment": 0, "not_entailment": 1})
    assert len(rte) == 277
    mnli = read_jsonl(
        data / "glue-mnli" / "dev_matched.jsonl", label2id={"entailment": 0, "neutral": 1, "contradiction": 2}
    )
    assert len(mnli) == 9815
    with pytest.raises(TaskDataError, match="no label column"):
        read_jsonl(data / "glue-rte" / "test.jsonl")


def test_check_labels_wants_a_classification_head() -> None:
    class QAConfig:
        num_labels = 0

    with pytest.raises(TaskDataError, match="no classification head"):
        check_labels([ClassificationExample("a", None, 0)], QAConfig())


# --------------------------------------------------------------------------------------------
# The Evaluator on the tiny BERT (drift of the last hidden states)
# --------------------------------------------------------------------------------------------

TEXTS = [
    "The cat sat on the mat.",
    ("Where is the cat?", "It is on the mat, near the door."),
    "A much longer sentence, with commas, periods. And two parts.",
    "Short.",
    "Attention heads come in several types.",
]


@pytest.fixture(scope="module")
def tiny(tiny_bert_path: Path):
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(tiny_bert_path, attn_implementation="eager", dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_bert_path)


def _count_forwards(model) -> tuple[list[int], RemovableHandle]:
    calls: list[int] = []
    return calls, model.register_forward_pre_hook(lambda *a: calls.append(1))


def test_drift_evaluator_caches_tokenization_and_baseline(tiny) -> None:
    model, tokenizer = tiny
    Evaluator.clear_cache()
    pairs = [t for t in TEXTS if isinstance(t, tuple)] * 3
    evaluator = Evaluator.for_task("drift", model, tokenizer, pairs, batch_size=2)
    assert Evaluator.for_task("drift", model, tokenizer, pairs, batch_size=2) is evaluator
    assert Evaluator.for_task("drift", model, tokenizer, pairs, batch_size=3) is not evaluator
    calls, handle = _count_forwards(model)
    try:
        baseline = evaluator.baseline()
        assert len(calls) == 2  # 3 samples in batches of 2
        assert evaluator.baseline() is baseline
        assert baseline["cosine"] == pytest.approx(1.0, abs=1e-6)
        pruned = evaluator.run(AblationSpec.build({"prune": HeadSelection.all_heads()}, num_layers=2, num_heads=4))
        assert len(calls) == 4  # the baseline was not recomputed
        dropped = evaluator.run(
            AblationSpec.build({"drop_inter": HeadSelection.layers([0])}, num_layers=2, num_heads=4)
        )
    finally:
        handle.remove()
    assert pruned.n_examples == 3
    assert pruned["cosine"] < 1 - 1e-6  # small: a random tiny BERT leans on its residual stream
    assert dropped["cosine"] < 1.0
    assert evaluator.run(AblationSpec.empty(2, 4)) is baseline


def test_mixed_single_texts_and_pairs_are_rejected(tiny) -> None:
    model, tokenizer = tiny
    with pytest.raises(TaskDataError, match="mixed single texts and text pairs"):
        Evaluator.for_task("drift", model, tokenizer, TEXTS, cache=False)
    with pytest.raises(TaskDataError, match="takes ClassificationExample"):
        Evaluator.for_task("classification", model, tokenizer, ["a text"], cache=False)


def test_run_plan_validates_every_row_before_compute(tiny) -> None:
    model, tokenizer = tiny
    texts = [t for t in TEXTS if isinstance(t, str)]
    evaluator = Evaluator.for_task("drift", model, tokenizer, texts, batch_size=8, cache=False)
    assignments = {(layer, head): HEAD_TYPES[head] for layer in range(2) for head in range(4)}
    bad_plan = [*paper_plan(HEAD_TYPES)[:3], PlanRow.of("bad", "bad", {"prune": ["vertikal"]})]
    calls, handle = _count_forwards(model)
    try:
        with pytest.raises(AblationSpecError, match="unknown head type"):
            run_plan(evaluator, bad_plan, assignments=assignments)
        assert calls == []
        seen: list[str] = []
        outcomes = run_plan(
            evaluator,
            paper_plan(HEAD_TYPES)[:5],
            assignments=assignments,
            progress=lambda done, total, outcome: seen.append(f"{done}/{total} {outcome.row_id}"),
        )
    finally:
        handle.remove()
    assert seen[0] == "1/5 baseline"
    assert [o.row_id for o in outcomes] == [
        "baseline",
        "prune.dense",
        "prune.diagonal",
        "prune.dense_vertical",
        "prune.vertical",
    ]
    assert outcomes[0].metrics == outcomes[0].baseline
    assert all(o.n_examples == 4 for o in outcomes)
    assert outcomes[1].spec["ops"]["prune"] == [["encoder", 0, 0], ["encoder", 1, 0]]  # stored heads name their stack
    json.dumps([o.to_dict() for o in outcomes])  # JSON-able, ready for the catalog
    assert len(calls) == 5  # baseline + 4 ablated rows, one batch each


# --------------------------------------------------------------------------------------------
# Real task models (shared/models); small slices
# --------------------------------------------------------------------------------------------


def _task_model(shared_dir: Path, name: str, cls_name: str):
    import transformers

    path = shared_dir / "models" / name
    model = getattr(transformers, cls_name).from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(path)


def _types_from_attention(model, tokenizer, texts: list[str]) -> dict[tuple[int, int], str]:
    """A quick stand-in for the clustering: rank heads by special (S) and local (D) attention mass.

    Top quarter by ``S`` = vertical; of the rest, top third by ``D`` = diagonal; the remaining
    split by ``S`` into dense_vertical (higher) and dense (lower).
    """
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    real = batch["attention_mask"].bool()
    special = torch.isin(batch["input_ids"], torch.tensor([tokenizer.cls_token_id, tokenizer.sep_token_id]))
    n = batch["input_ids"].shape[1]
    local = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs() <= 1
    s_mass: dict[tuple[int, int], float] = {}
    d_mass: dict[tuple[int, int], float] = {}

    def reduce(call):
        probs = call.probs  # (batch, head, q, k)
        weight = real[:, None, :, None].float()
        s = ((probs * special[:, None, None, :]) * weight).sum((-1, -2)) / real.sum(-1)[:, None]
        d = ((probs * local) * weight).sum((-1, -2)) / real.sum(-1)[:, None]
        for head in range(probs.shape[1]):
            s_mass[(call.layer, head)] = float(s[:, head].mean())
            d_mass[(call.layer, head)] = float(d[:, head].mean())

    with torch.inference_mode(), AttentionProbe(model, reduce):
        model(**batch)
    heads = sorted(s_mass, key=lambda h: -s_mass[h])
    quarter = len(heads) // 4
    types = dict.fromkeys(heads[:quarter], "vertical")
    rest = sorted(heads[quarter:], key=lambda h: -d_mass[h])
    types.update(dict.fromkeys(rest[: len(rest) // 3], "diagonal"))
    last = sorted(rest[len(rest) // 3 :], key=lambda h: -s_mass[h])
    types.update(dict.fromkeys(last[: len(last) // 2], "dense_vertical"))
    types.update(dict.fromkeys(last[len(last) // 2 :], "dense"))
    return types


@pytest.mark.slow
def test_sst2_slice_baseline_and_pruning_each_type(shared_dir: Path) -> None:
    model, tokenizer = _task_model(shared_dir, "minilm-sst2", "AutoModelForSequenceClassification")
    data = read_glue_tsv(shared_dir / "data" / "glue-sst2" / "dev.tsv", config=model.config)[:48]
    evaluator = Evaluator.for_task("classification", model, tokenizer, data, batch_size=24, max_length=64)
    baseline = evaluator.baseline()

    # the same accuracy from a plain eager forward pass, one sentence at a time
    with torch.inference_mode():
        plain = [
            int(model(**tokenizer(text, truncation=True, max_length=64, return_tensors="pt")).logits.argmax())
            for text, _, _ in data
        ]
    assert baseline["accuracy"] == pytest.approx(100 * np.mean(np.array(plain) == [e.label for e in data]))
    assert baseline["accuracy"] > 75
    assert baseline["kl"] == 0.0

    assignments = _types_from_attention(model, tokenizer, [text for text, _, _ in data[:16]])
    plan = [row for row in paper_plan(HEAD_TYPES) if row.id == "baseline" or row.id.startswith("prune.")][:5]
    everything = AblationSpec.build({"prune": HeadSelection.all_heads()}, num_layers=6, num_heads=12)
    outcomes = run_plan(evaluator, [*plan, ("prune.all", "Prune every head", everything)], assignments=assignments)
    by_id = {o.row_id: o.metrics for o in outcomes}
    assert by_id["baseline"] == baseline
    for row_id, metrics in by_id.items():
        assert 0 <= metrics["accuracy"] <= 100, row_id
        if row_id != "baseline":
            assert metrics["kl"] > 0, row_id
    share = max(np.mean([e.label for e in data]), 1 - np.mean([e.label for e in data]))
    assert by_id["prune.all"]["accuracy"] <= 100 * share + 10  # about a constant guess
    assert by_id["prune.all"]["kl"] > max(m["kl"] for i, m in by_id.items() if i != "prune.all")


@pytest.mark.slow
def test_mrpc_slice_segment_drops(shared_dir: Path) -> None:
    """Drop intra/inter-segment attention of every head on MRPC pairs; each equals a hand-run of that
    surgery (caught: drop_intra and drop_inter swapped, which the old inequality checks let pass)."""
    model, tokenizer = _task_model(shared_dir, "minilm-mrpc", "AutoModelForSequenceClassification")
    data = read_glue_tsv(shared_dir / "data" / "glue-mrpc" / "dev.tsv", config=model.config)[:24]
    evaluator = Evaluator.for_task("classification", model, tokenizer, data, batch_size=24)
    baseline = evaluator.baseline()
    everything = HeadSelection.all_heads()
    intra = evaluator.run(AblationSpec.build({"drop_intra": everything}, num_layers=6, num_heads=12))
    inter = evaluator.run(AblationSpec.build({"drop_inter": everything}, num_layers=6, num_heads=12))
    assert baseline["accuracy"] > 60
    # both change the output; on this paraphrase task losing the cross-sentence part hurts more
    assert intra["kl"] > 0
    assert inter["kl"] > 0
    assert intra["kl"] != inter["kl"]
    # Pinned to a hand-run of each surgery (tests/surgery.py): swapping drop_intra and drop_inter fails.
    for result, op in ((intra, "drop_intra"), (inter, "drop_inter")):
        ops = {(layer, head): op for layer in range(6) for head in range(12)}
        kls = []
        for example in data:
            inputs = dict(
                tokenizer(example.text, example.text_pair, truncation=True, max_length=128, return_tensors="pt")
            )
            with torch.no_grad():
                base = model(**inputs).logits.log_softmax(-1)
            edited = hand_run(model, model.bert.encoder.layer, inputs, ops).logits.log_softmax(-1)
            kls.append(float((base.exp() * (base - edited)).sum()))
        assert result["kl"] == pytest.approx(float(np.mean(kls)), rel=1e-4, abs=1e-6), op


@pytest.mark.slow
def test_squad_slice_baseline_and_pruning_everything(shared_dir: Path) -> None:
    model, tokenizer = _task_model(shared_dir, "minilm-squad", "AutoModelForQuestionAnswering")
    data = read_squad(shared_dir / "data" / "squad-v1.1" / "dev-v1.1.json", articles=range(24, 48))
    evaluator = Evaluator.for_task("squad", model, tokenizer, data, limit=12, batch_size=12)
    baseline = evaluator.baseline()
    assert baseline.n_examples == 12
    assert baseline["f1"] > 50
    assert baseline["exact_match"] <= baseline["f1"]
    predictions = evaluator.predictions()
    assert all(p in e.context for e, p in zip(data[:12], [predictions[e.id] for e in data[:12]], strict=True))
    pruned = evaluator.run(AblationSpec.build({"prune": HeadSelection.all_heads()}, num_layers=6, num_heads=12))
    assert pruned["f1"] < baseline["f1"] / 2
    assert pruned["kl"] > 0.5
