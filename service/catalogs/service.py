"""Catalog archives as jobs and downloads: the ``catalog_import`` job, ``hub:`` archives, the tar stream."""

from __future__ import annotations

import logging
import re
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from service.catalogs import importer
from service.catalogs.export import export_catalog
from service.errors import InvalidInput
from service.jobs.runner import Progress, Writer

log = logging.getLogger(__name__)

HUB = re.compile(r"^hub:([A-Za-z0-9][A-Za-z0-9._\-]*/[A-Za-z0-9][A-Za-z0-9._\-]*)(?:@([A-Za-z0-9._\-/]+))?$")


def hub_snapshot(repo_id: str, revision: str | None) -> Path:
    """The archive published as the Hugging Face data set ``repo_id``, downloaded (or from the hub cache)."""
    try:
        import huggingface_hub
    except ImportError as error:
        raise InvalidInput("archive: hub: archives need huggingface_hub (pip install 'headcat[hub]')",
                           field="archive") from error  # fmt: skip
    try:
        path = huggingface_hub.snapshot_download(repo_id=repo_id, repo_type="dataset", revision=revision)
    except Exception as error:  # the hub's errors: offline, no such repo, no such revision
        raise InvalidInput(f"archive: hub:{repo_id} could not be downloaded ({type(error).__name__}: {error})",
                           field="archive") from error  # fmt: skip
    return Path(path)


def resolve(spec: str) -> tuple[Path, str]:
    """``(directory, origin)`` of an archive spec: a directory (or a tar file), or ``hub:OWNER/NAME[@REVISION]``."""
    if spec.startswith("hub:"):
        match = HUB.match(spec)
        if match is None:
            raise InvalidInput(f"archive: {spec!r} is not hub:OWNER/NAME[@REVISION]", field="archive")
        directory = hub_snapshot(match[1], match[2])
        commit = directory.name if re.fullmatch(r"[0-9a-f]{40}", directory.name) else match[2]
        return directory, f"hub:{match[1]}" + (f"@{commit}" if commit else "")
    directory = Path(spec).expanduser().resolve()
    return directory, str(directory)


def check_archive(spec: str, models: list[str] | None = None) -> None:
    """The quick check before an import is queued: a local archive exists and is an archive directory with a
    manifest of a format this headcat reads that lists ``models``, or a tar file (as ``GET /catalog/export`` sends
    it)."""
    if spec.startswith("hub:"):
        if HUB.match(spec) is None:
            raise InvalidInput(f"archive: {spec!r} is not hub:OWNER/NAME[@REVISION]", field="archive")
        return
    path = Path(spec).expanduser()
    if path.is_file():
        if not tarfile.is_tarfile(path):
            raise InvalidInput(f"archive: {spec} is neither an archive directory nor a tar archive", field="archive")
        return
    importer.check_manifest(path, models)


def unpack(tar: Path) -> tuple[Path, Path]:
    """A tar archive unpacked into a new temporary directory, with tarfile's ``data`` filter (no member outside
    it, no links out, no devices): ``(the directory holding its manifest, the temporary directory)``."""
    scratch = Path(tempfile.mkdtemp(prefix="headcat-import-"))
    try:
        with tarfile.open(tar) as archive:
            archive.extractall(scratch, filter="data")
        found = sorted(path.parent for path in scratch.rglob(importer.MANIFEST))
        if len(found) != 1:
            what = "no manifest.json" if not found else f"{len(found)} manifest.json files"
            raise InvalidInput(f"archive: {tar} holds {what}: not one catalog archive", field="archive")
    except (tarfile.TarError, OSError) as error:
        shutil.rmtree(scratch, ignore_errors=True)
        raise InvalidInput(f"archive: {tar} is not a readable tar archive ({error})", field="archive") from error
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return found[0], scratch


def prepare(sessions: sessionmaker[Session], request: dict[str, Any], progress: Progress) -> Writer:
    """The ``catalog_import`` job: fetch and check the whole archive, then write it in the job's transaction.
    A tar archive is unpacked into a temporary directory, removed once the import is written (or refused)."""
    spec, renames = str(request["archive"]), dict(request.get("renames") or {})
    directory, origin = resolve(spec)
    scratch = None
    if directory.is_file():
        directory, scratch = unpack(directory)
    log.info("Checking the catalog archive %s", origin)
    try:
        archive = importer.validate(directory, renames)
        importer.select(archive, request.get("models"))
    except BaseException:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        raise

    def write(session: Session) -> dict[str, Any]:
        # No job progress from here: the job's row is locked by this transaction until it commits.
        try:
            return importer.write(session, archive, origin, renames, progress=_log_progress)
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)

    return write


def _log_progress(done: int, total: int) -> None:
    log.debug("Staged %d of %d rows", done, total)


def export_tar(engine: Engine, models: list[str] | None) -> Iterator[bytes]:
    """The archive of ``models`` as an uncompressed tar, yielded in chunks (the Parquet files are compressed).

    The files are written to a temporary directory first (bounded memory), which is removed
    when the stream ends or the client goes away. Unknown models are refused before the first byte.
    """
    scratch = Path(tempfile.mkdtemp(prefix="headcat-catalog-"))
    try:
        with engine.connect() as connection, connection.begin():
            export_catalog(connection, scratch / "catalog", models)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise

    def stream() -> Iterator[bytes]:
        try:
            for path in sorted((scratch / "catalog").iterdir()):
                yield from _tar_member(path, f"catalog/{path.name}")
            yield tarfile.NUL * (2 * tarfile.BLOCKSIZE)  # the end-of-archive marker
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    return stream()


def _tar_member(path: Path, name: str, chunk: int = 1 << 20) -> Iterator[bytes]:
    """One file as a ustar member, read in chunks: its header, its bytes, the padding to a block."""
    info = tarfile.TarInfo(name)
    info.size = path.stat().st_size
    info.mtime = int(path.stat().st_mtime)
    info.mode = 0o644
    yield info.tobuf(format=tarfile.USTAR_FORMAT)
    with path.open("rb") as file:
        while data := file.read(chunk):
            yield data
    if info.size % tarfile.BLOCKSIZE:
        yield tarfile.NUL * (tarfile.BLOCKSIZE - info.size % tarfile.BLOCKSIZE)
