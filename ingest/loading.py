"""Load a model and its tokenizer for attention work: eager attention, frozen, on a chosen device.

``source`` is a local ``transformers`` directory or a Hugging Face hub id. Remote code is never
trusted. The model must dispatch its attention through ``transformers``' ``AttentionInterface``:
that is where :mod:`ingest.attention` sees each layer's probabilities, so a model that does not
is refused here, at load time, rather than giving empty features later.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from ingest import attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

Task = Literal["base", "sequence-classification", "question-answering", "masked-lm", "causal-lm"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

_LAYER_KEYS = ("num_hidden_layers", "n_layers", "n_layer", "num_layers")
_HEAD_KEYS = ("num_attention_heads", "n_heads", "n_head")


class ModelLoadError(ValueError):
    """The model (or its tokenizer) cannot be loaded, or cannot be probed by headcat."""


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for attention probing, with what a feature run records about it."""

    model: PreTrainedModel
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    source: str  # the local directory (absolute) or the hub id
    revision: str | None  # the hub commit hash when the hub gives one, else None
    architecture: str  # config.model_type, e.g. "bert"
    num_layers: int
    num_heads: int
    device: torch.device
    dtype: torch.dtype


def resolve_device(device: str) -> torch.device:
    """``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or ``"mps"``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device {device!r} is not a device; use 'auto', 'cpu', 'cuda' or 'cuda:<index>'") from error
    if resolved.type == "cpu":
        return resolved
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for CUDA, but CUDA is not available here")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: there are only {torch.cuda.device_count()} CUDA device(s) here")
        return resolved
    if resolved.type == "mps" and torch.backends.mps.is_available():
        return resolved
    raise ValueError(f"device {device!r} is not supported; use 'auto', 'cpu', 'cuda' or 'cuda:<index>'")


def resolve_dtype(name: str) -> torch.dtype:
    """``"float32"``, ``"float16"`` or ``"bfloat16"`` as a ``torch.dtype``."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported; use one of {', '.join(DTYPES)}") from None


def _auto_model_class(task: Task) -> Any:
    import transformers

    classes = {
        "base": transformers.AutoModel,
        "sequence-classification": transformers.AutoModelForSequenceClassification,
        "question-answering": transformers.AutoModelForQuestionAnswering,
        "masked-lm": transformers.AutoModelForMaskedLM,  # importance from the model's own LM loss
        "causal-lm": transformers.AutoModelForCausalLM,
    }
    try:
        return classes[task]
    except KeyError:
        raise ValueError(f"task {task!r} is not supported; use one of {', '.join(classes)}") from None


def _config_int(config: Any, keys: tuple[str, ...], what: str, source: str) -> int:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in keys:
        value = getattr(text_config, key, None)
        if isinstance(value, int):
            return value
    raise ModelLoadError(f"{source}: the config names no {what} (looked for {', '.join(keys)})")


def check_attention_interface(model: Any, architecture: str) -> None:
    """Raise :class:`ModelLoadError` unless the probe's attention implementation can be set on ``model``.

    ``transformers`` only warns (and keeps the old implementation) when a model's attention does
    not go through ``AttentionInterface``; the probe would then see nothing, so refuse it here.
    """
    from transformers import PreTrainedModel

    reason = (
        f"architecture {architecture!r} does not dispatch its attention through transformers' "
        "AttentionInterface, so headcat cannot see its attention probabilities"
    )
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and not type(module)._can_set_attn_implementation():
            raise ModelLoadError(f"{reason} ({type(module).__name__})")
    config = model.config
    previous = config._attn_implementation
    try:
        model.set_attn_implementation(attention.IMPLEMENTATION)
        switched = config._attn_implementation == attention.IMPLEMENTATION
    except (ValueError, NotImplementedError) as error:
        raise ModelLoadError(reason) from error
    finally:
        model.set_attn_implementation(previous)
    if not switched:
        raise ModelLoadError(reason)


def _is_local(source: str) -> bool:
    """A source that names the file system; anything else is taken as a hub id."""
    path = Path(source).expanduser()
    if path.is_dir():
        return True
    if path.exists():
        raise ModelLoadError(f"model path {source!r} is a file; a model is a directory with config.json")
    if source.startswith((".", "/", "~", "\\")):
        raise ModelLoadError(f"model path {source!r} does not exist")
    return False


def load_model(
    source: str,
    *,
    device: str = "auto",
    dtype: str = "float32",
    task: Task = "base",
    revision: str | None = None,
) -> LoadedModel:
    """Load ``source`` (a local directory or a hub id) with eager attention, in eval mode, on ``device``."""
    from transformers import AutoTokenizer

    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype)
    model_class = _auto_model_class(task)
    local = _is_local(source)
    name = str(Path(source).expanduser().resolve()) if local else source
    options: dict[str, Any] = {"revision": revision, "trust_remote_code": False}
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, **options)
        model = model_class.from_pretrained(name, attn_implementation="eager", dtype=torch_dtype, **options)
    except (OSError, ValueError, KeyError, ImportError, RuntimeError) as error:
        if local:
            raise ModelLoadError(f"model directory {name!r} could not be loaded: {error}") from error
        raise ModelLoadError(
            f"hub id {source!r} could not be loaded ({type(error).__name__}: {error}); it may not exist, "
            "or the hub may be unreachable (HF_HUB_OFFLINE may be set)"
        ) from error

    architecture = str(model.config.model_type)
    check_attention_interface(model, architecture)
    model = model.eval().to(torch_device)
    model.requires_grad_(False)
    commit = getattr(model.config, "_commit_hash", None)
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        source=name,
        revision=None if local else (commit or None),
        architecture=architecture,
        num_layers=_config_int(model.config, _LAYER_KEYS, "number of layers", name),
        num_heads=_config_int(model.config, _HEAD_KEYS, "number of attention heads", name),
        device=torch_device,
        dtype=torch_dtype,
    )
    logger.info(
        "loaded %s (%s, %d layers x %d heads) on %s as %s",
        name,
        architecture,
        loaded.num_layers,
        loaded.num_heads,
        torch_device,
        dtype,
    )
    return loaded
