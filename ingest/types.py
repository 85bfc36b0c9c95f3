"""Closed sets of names shared by the science and the service."""

from __future__ import annotations

from typing import Literal, get_args

Stack = Literal["encoder", "decoder", "cross"]
"""Where an attention module sits (SPEC section 6): bidirectional self-attention, causal
self-attention, or decoder queries over encoder keys. A head is ``(stack, layer, head)``."""
STACKS: tuple[Stack, ...] = get_args(Stack)

HeadType = Literal["dense", "diagonal", "dense_vertical", "vertical"]
HEAD_TYPES: tuple[HeadType, ...] = get_args(HeadType)

Role = Literal["induction", "duplicate_token", "previous_token", "sink"]
"""What a head does on repeated random sequences (SPEC section 10): its detectors, and the roles it can have."""
ROLES: tuple[Role, ...] = get_args(Role)

SpecialGroup = Literal["cls", "sep", "period", "comma"]
SPECIAL_GROUPS: tuple[SpecialGroup, ...] = get_args(SpecialGroup)

Scalar = Literal["entropy", "prev_token", "next_token", "mean_distance", "sep_to_sep"]
SCALARS: tuple[Scalar, ...] = get_args(Scalar)

DEFAULT_NUM_WINDOWS = 16


def feature_names(num_windows: int = DEFAULT_NUM_WINDOWS) -> list[str]:
    """Names of a head's distance vector, in SPEC order: ``w0..w{N-1}, self, cls, sep, period, comma``."""
    return [f"w{i}" for i in range(num_windows)] + ["self", *SPECIAL_GROUPS]


# Suffixes of transformers' model class names (``config.architectures``), most specific first.
_TASK_SUFFIXES: tuple[tuple[str, str], ...] = (
    ("ForSequenceClassification", "sequence-classification"),
    ("ForQuestionAnswering", "question-answering"),
    ("ForTokenClassification", "token-classification"),
    ("ForMultipleChoice", "multiple-choice"),
    ("ForCausalLM", "causal-lm"),
    ("LMHeadModel", "causal-lm"),
    ("ForMaskedLM", "masked-lm"),
    ("ForConditionalGeneration", "seq2seq-lm"),
    ("ForPreTraining", "pretraining"),
    ("Model", "base"),
)


def model_task(config: object) -> str | None:
    """The head a checkpoint was saved with, from its config's first ``architectures`` entry
    (``BertForSequenceClassification`` -> ``sequence-classification``, ``BertModel`` -> ``base``);
    None when the config names no class, or one of no known kind."""
    architectures = getattr(config, "architectures", None) or []
    first = str(architectures[0]) if architectures else ""
    return next((task for suffix, task in _TASK_SUFFIXES if first.endswith(suffix)), None)
