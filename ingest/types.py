"""Closed sets of names shared by the science and the service."""

from __future__ import annotations

from typing import Any, Literal, get_args

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


# Tokens per sample when an ingest names none (fewer where the model has fewer positions).
DEFAULT_MAX_LENGTH = 128


def positions(config: Any) -> int | None:
    """The model's positions (``max_position_embeddings``, from a config object or its ``config.json`` dict);
    None where it has no such bound (some configs say -1: unbounded)."""
    limit = (
        config.get("max_position_embeddings")
        if isinstance(config, dict)
        else getattr(config, "max_position_embeddings", None)
    )
    return limit if isinstance(limit, int) and limit > 0 else None


def default_max_length(config: Any, preferred: int = DEFAULT_MAX_LENGTH) -> int:
    """``preferred`` tokens per sample, or the model's positions when it has fewer."""
    limit = positions(config)
    return preferred if limit is None else min(preferred, limit)
