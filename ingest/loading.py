"""Load a model and its tokenizer for attention work: eager attention, frozen, on a chosen device.

``source`` is a local ``transformers`` directory or a Hugging Face hub id. Remote code is never
trusted. Every attention module of the model must be one :mod:`ingest.attention` sees exactly
(through ``AttentionInterface`` or an adapter): :func:`probe_stacks` runs one 4-token forward pass
under the probe at load time, so an architecture that is not is refused here, naming it, rather
than giving wrong or empty features later. Each refusal is one line (:class:`ModelLoadError`).
"""

from __future__ import annotations

import inspect
import logging
import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from ingest import attention
from ingest.types import STACKS, Stack

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

Task = Literal["base", "sequence-classification", "question-answering", "masked-lm", "causal-lm"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


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
    device: torch.device  # where inputs go (the first parameter's device under a device_map)
    dtype: torch.dtype
    stacks: dict[Stack, tuple[int, int]] = field(default_factory=dict)  # stack -> (layers, query heads)
    num_key_value_heads: int | None = None  # the config's, for grouped key/value heads; else None
    device_map: str | None = None


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


def probe_stacks(model: Any) -> dict[Stack, tuple[int, int]]:
    """``{stack: (layers, query heads)}`` of ``model``, from one 4-token forward pass under the probe.

    Raises :class:`ModelLoadError`, naming the architecture, when headcat cannot see every
    attention module's probabilities exactly (no ``AttentionInterface`` and no adapter, a softmax
    that is not over ``(batch, head, q, k)`` such as learned sinks, ...): before any real compute.
    """
    architecture = str(getattr(model.config, "model_type", type(model).__name__))
    seen: dict[tuple[Stack, int], int] = {}

    def record(call: attention.AttentionCall) -> None:
        seen[call.stack, call.layer] = int(call.probs.shape[1])

    device = next(model.parameters()).device
    vocab = int(getattr(model.config.get_text_config(), "vocab_size", 0) or 0)
    ids = torch.tensor([[1, 2, 3, 4]], device=device).clamp(max=max(vocab - 1, 0))
    inputs: dict[str, torch.Tensor] = {"input_ids": ids}
    if "decoder_input_ids" in inspect.signature(model.forward).parameters:
        inputs["decoder_input_ids"] = ids[:, :3]
    try:
        with torch.inference_mode(), attention.AttentionProbe(model, record):
            model(**inputs)
    except attention.UnsupportedAttention as error:
        raise ModelLoadError(str(error)) from error
    except (RuntimeError, ValueError, TypeError, IndexError) as error:
        raise ModelLoadError(
            f"architecture {architecture!r} cannot be probed on a text input: {type(error).__name__}: "
            f"{_first_line(error)}"
        ) from error
    stacks: dict[Stack, tuple[int, int]] = {}
    for stack in STACKS:
        layers = sorted(layer for name, layer in seen if name == stack)
        if not layers:
            continue
        heads = {seen[stack, layer] for layer in layers}
        if layers != list(range(len(layers))) or len(heads) != 1:
            raise ModelLoadError(
                f"architecture {architecture!r}: the probe saw {stack} layers {layers} with {sorted(heads)} heads; "
                "headcat needs layers 0..L-1 with one head count per stack"
            )
        stacks[stack] = (len(layers), heads.pop())
    if not stacks:
        raise ModelLoadError(f"architecture {architecture!r}: no attention module was called on a text input")
    return stacks


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


_WEIGHTS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json", "*.pt", "*.pth")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
)


def _check_directory(path: Path) -> None:
    """One line naming what is missing from a local model directory, before anything is loaded."""
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory {str(path)!r} has no config.json: it is not a transformers model")
    if not any(any(path.glob(pattern)) for pattern in _WEIGHTS):
        raise ModelLoadError(
            f"model directory {str(path)!r} has a config.json but no weights (model.safetensors or pytorch_model.bin)"
        )
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelLoadError(f"model directory {str(path)!r} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)})")


def _config_problem(name: str, error: BaseException) -> str:
    """One line for a config.json transformers cannot read: an unknown ``model_type`` is named."""
    import json

    import transformers

    try:
        model_type = json.loads((Path(name) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None
    if isinstance(model_type, str):
        return (
            f"{name}: architecture {model_type!r} is not supported: transformers {transformers.__version__} "
            "does not know it (remote code is never run)"
        )
    return f"{name}: config.json cannot be read as a transformers config: {_first_line(error)}"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class _UnusedWeightsOnly(logging.Filter):
    """Drops transformers' LOAD REPORT when all it lists is weights headcat never uses: UNEXPECTED keys (in the
    checkpoint, unused by the class loaded: a task model's head read as the bare encoder) and, for the bare
    encoder, a MISSING pooler (question-answering models have none; no head feature reads it). Any other
    MISSING (randomly initialised), MISMATCHED or CONVERTED weight still goes through."""

    def __init__(self, harmless_missing: tuple[str, ...]) -> None:
        super().__init__()
        self.harmless_missing = harmless_missing

    def filter(self, record: logging.LogRecord) -> bool:
        message = _ANSI.sub("", record.getMessage())
        if "LOAD REPORT" not in message:
            return True
        for line in message.splitlines():
            cells = [cell.strip() for cell in line.split("|")]
            if len(cells) < 2 or cells[1] in ("Status", "") or set(cells[0]) <= {"-", "+"}:
                continue  # not a row of the table
            key, status = cells[0], cells[1]
            if status != "UNEXPECTED" and not (status == "MISSING" and key.startswith(self.harmless_missing)):
                return True
        logger.debug("transformers' load report, weights headcat does not use: %s", message)
        return False


@contextmanager
def _quiet_unused_weights(task: Task) -> Iterator[None]:
    from transformers.utils import logging as transformers_logging

    target = transformers_logging.get_logger("transformers.modeling_utils")
    quiet = _UnusedWeightsOnly(("pooler.",) if task == "base" else ())
    target.addFilter(quiet)
    try:
        yield
    finally:
        target.removeFilter(quiet)


def _hub_access(source: str, revision: str | None) -> bool:
    """Whether ``source`` must be read from the local cache only; one-line errors when it cannot be had.

    Never lets ``huggingface_hub`` retry an unreachable hub for a minute: one metadata request
    with a short timeout decides.
    """
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        cached = isinstance(try_to_load_from_cache(source, "config.json", revision=revision), str)
    except HFValidationError as error:
        raise ModelLoadError(f"{source!r} is neither a local directory nor a hub id ({_first_line(error)})") from error
    cache = constants.HF_HUB_CACHE
    if constants.HF_HUB_OFFLINE:
        if cached:
            return True
        raise ModelLoadError(
            f"hub id {source!r} is not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set: "
            "download it where the hub is reachable, or give a local directory"
        )
    try:
        HfApi().model_info(source, revision=revision, timeout=10)
    except (RepositoryNotFoundError, GatedRepoError) as error:
        raise ModelLoadError(
            f"hub id {source!r} does not exist on the Hugging Face hub, or is private or gated ({type(error).__name__})"
        ) from error
    except RevisionNotFoundError as error:
        raise ModelLoadError(f"hub id {source!r} has no revision {revision!r}") from error
    except Exception as error:  # the network: DNS, connection, timeout, proxy  # noqa: BLE001
        if cached:
            logger.warning("the hub is unreachable (%s); loading %s from the local cache", _first_line(error), source)
            return True
        raise ModelLoadError(
            f"hub id {source!r}: the Hugging Face hub cannot be reached ({type(error).__name__}: "
            f"{_first_line(error)}) and the model is not in the local cache ({cache}); download it where the "
            "hub is reachable (HF_HUB_OFFLINE=1 then uses the cache without trying the network), or give a "
            "local directory"
        ) from error
    return False


def _cached_commit(source: str, revision: str | None) -> str | None:
    """The commit hash of the cached snapshot of hub id ``source`` that ``revision`` names, once it is loaded.

    The cache keeps each commit's files under ``snapshots/<commit>/`` (transformers 5 no longer keeps a
    ``_commit_hash`` on the config).
    """
    from huggingface_hub import try_to_load_from_cache

    path = try_to_load_from_cache(source, "config.json", revision=revision)
    return Path(path).parent.name if isinstance(path, str) else None


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


def _model_class(task: Task, config: Any) -> Any:
    """The class to load: the task's auto class, or the checkpoint's own class where it matters.

    A checkpoint that names an encoder-only class of an encoder-decoder family (``T5EncoderModel``,
    ``MT5EncoderModel`` ...) in ``config.architectures`` is loaded as that class: ``AutoModel``
    would build the full model and give it a randomly initialised decoder.
    """
    import transformers

    named = [name for name in (getattr(config, "architectures", None) or []) if isinstance(name, str)]
    if task == "base" and named and named[0].endswith("EncoderModel") and hasattr(transformers, named[0]):
        return getattr(transformers, named[0])
    return _auto_model_class(task)


def load_model(
    source: str,
    *,
    device: str = "auto",
    dtype: str = "float32",
    task: Task = "base",
    revision: str | None = None,
    device_map: str | None = None,
) -> LoadedModel:
    """Load ``source`` (a local directory or a hub id) with eager attention, in eval mode, on ``device``.

    ``device_map`` (``"auto"``, ``"balanced"``, ``"sequential"``, ...) spreads a model too large
    for one device over several with ``accelerate`` instead (``device`` is then not used). Every
    refusal is a :class:`ModelLoadError` of one line naming what is wrong, raised before any
    feature is computed: a missing ``config.json``, weights or tokenizer, an unknown or
    unsupported architecture, an unreachable hub.
    """
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoTokenizer

    torch_dtype = resolve_dtype(dtype)
    torch_device = resolve_device(device) if device_map is None else None
    local = _is_local(source)
    name = str(Path(source).expanduser().resolve()) if local else source
    options: dict[str, Any] = {"revision": revision, "trust_remote_code": False}
    if local:
        _check_directory(Path(name))
    elif _hub_access(source, revision):
        options["local_files_only"] = True
    try:
        config = AutoConfig.from_pretrained(name, **options)
    except (OSError, ValueError, KeyError) as error:
        raise ModelLoadError(_config_problem(name, error)) from error
    architecture = str(config.model_type)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, **options)
    except (OSError, ValueError, KeyError, ImportError, RuntimeError, TypeError) as error:
        raise ModelLoadError(f"{name}: the tokenizer cannot be loaded: {_first_line(error)}") from error
    model_class = _model_class(task, config)
    placement: dict[str, Any] = {}
    if device_map is not None:
        placement["device_map"] = device_map
    try:
        with _quiet_unused_weights(task):
            model = model_class.from_pretrained(
                name, config=config, attn_implementation="eager", dtype=torch_dtype, **placement, **options
            )
    except (OSError, ValueError, KeyError, ImportError, RuntimeError, SafetensorError, pickle.UnpicklingError) as error:
        raise ModelLoadError(  # SafetensorError, UnpicklingError: a truncated or corrupt weights file
            f"{name}: the {architecture!r} model cannot be loaded as {model_class.__name__}: {_first_line(error)}"
        ) from error

    model = model.eval()
    if torch_device is not None:
        model = model.to(torch_device)
    model.requires_grad_(False)
    stacks = probe_stacks(model)
    commit = None if local else _cached_commit(source, revision)
    text_config = model.config.get_text_config()
    kv_heads = getattr(text_config, "num_key_value_heads", None)
    first = next(iter(stacks.values()))
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        source=name,
        revision=commit,
        architecture=architecture,
        num_layers=first[0],
        num_heads=first[1],
        device=next(model.parameters()).device,
        dtype=torch_dtype,
        stacks=stacks,
        num_key_value_heads=kv_heads if isinstance(kv_heads, int) and kv_heads > 0 else None,
        device_map=device_map,
    )
    logger.info(
        "loaded %s (%s: %s) on %s as %s",
        name,
        architecture,
        ", ".join(f"{stack} {layers} layers x {heads} heads" for stack, (layers, heads) in stacks.items()),
        getattr(model, "hf_device_map", None) or loaded.device,
        dtype,
    )
    return loaded
