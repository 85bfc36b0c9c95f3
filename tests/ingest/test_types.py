"""A checkpoint's task, from the model class its config names."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig, BertConfig

from ingest.types import model_task


@pytest.mark.parametrize(
    ("model", "task"),
    [("minilm-sst2", "sequence-classification"), ("minilm-mrpc", "sequence-classification"),
     ("minilm-squad", "question-answering")],
)  # fmt: skip
def test_the_shared_task_models_name_their_head(shared_dir: Path, model: str, task: str) -> None:
    assert model_task(AutoConfig.from_pretrained(shared_dir / "models" / model)) == task


@pytest.mark.parametrize(
    ("architectures", "task"),
    [
        (["BertModel"], "base"),
        (["BertForMaskedLM"], "masked-lm"),
        (["BertForPreTraining"], "pretraining"),
        (["GPT2LMHeadModel"], "causal-lm"),
        (["LlamaForCausalLM"], "causal-lm"),
        (["T5ForConditionalGeneration"], "seq2seq-lm"),
        (["RobertaForTokenClassification"], "token-classification"),
        (["BertForMultipleChoice"], "multiple-choice"),
        (["SomethingElse"], None),
        (None, None),
        ([], None),
    ],
)
def test_model_task_reads_the_first_architecture(architectures: list[str] | None, task: str | None) -> None:
    assert model_task(BertConfig(architectures=architectures)) == task


def test_the_packaged_minilm_is_a_base_model(minilm_path: Path) -> None:
    assert model_task(AutoConfig.from_pretrained(minilm_path)) == "base"
