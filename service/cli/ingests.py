"""``headcat ingest``: run a corpus through a model and store its per-head features."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from sqlalchemy import Engine

from service import db
from service.cli.app import Device, Dtype, Enqueue, app, catalog, log, run_job, validated
from service.errors import InvalidInput


def ingest_model(engine: Engine, enqueue: bool = False, **options: object) -> dict[str, Any]:
    from service.ingests.schemas import IngestCreate
    from service.ingests.service import check_name, check_sources

    request = validated(IngestCreate, options)
    # Every check before torch is imported or a job row is written, as ablate and cluster do.
    check_sources(request)
    with db.session_scope(engine) as session:
        check_name(session, request)
    return run_job(engine, "ingest", request.model_dump(), enqueue=enqueue, progress="samples")


def checkpoints(model: str, name: str | None, series: str | None, step: int | None,
                revision: str | None) -> list[tuple[str, str, int | None]]:  # fmt: skip
    """``(source, catalog name, step)`` of each checkpoint the command names, in step order.

    A directory of ``step-N/`` checkpoints (and no ``config.json`` of its own) is a series, one
    model per step, named ``SERIES-step-N``; a single checkpoint of a series takes its step from
    ``--step``, else from its directory's or revision's name (``step-1000``, ``step1000``).
    """
    from pathlib import Path

    from ingest.series import checkpoint_directories, step_of

    directory = Path(model).expanduser()
    found = checkpoint_directories(directory) if directory.is_dir() and not (directory / "config.json").exists() else []
    if found:
        if series is None:
            raise InvalidInput(f"series: {model} holds the checkpoints {', '.join(p.name for _, p in found[:3])}"
                               f"{' ...' if len(found) > 3 else ''}; name their series with --series",
                               field="series")  # fmt: skip
        if name is not None or step is not None or revision is not None:
            field = "name" if name is not None else "step" if step is not None else "revision"
            raise InvalidInput(f"{field}: --{field} names one checkpoint, but {model} holds {len(found)}; each is "
                               f"named {series}-step-N", field=field)  # fmt: skip
        return [(str(path), f"{series}-step-{number}", number) for number, path in found]
    if series is not None and step is None:
        step = step_of(revision) if revision is not None else step_of(str(directory))
        if step is None:
            raise InvalidInput(f"step: give --step for {model} (its name holds no step-N)", field="step")
    if name is None:
        if series is None:
            raise InvalidInput("name: give --name, the model's unique catalog name", field="name")
        name = f"{series}-step-{step}"
    return [(model, name, step)]


def _has_features(engine: Engine, name: str) -> bool:
    from service.models import repository as models

    with db.session_scope(engine) as session:
        found = models.get_by_name(session, name)
        return found is not None and found.current_feature_run_id is not None


@app.command()
def ingest(
    model: Annotated[
        str,
        typer.Argument(
            help="hub id or local checkpoint directory of a transformers model (encoder, decoder or both), "
            "or a directory of step-N/ checkpoints (with --series)"
        ),
    ],
    name: Annotated[
        str | None, typer.Option(help="unique catalog name for the model (default for a series step: SERIES-step-N)")
    ] = None,
    corpus: Annotated[
        str,
        typer.Option(help="builtin:wiki | builtin:lee | SQuAD .json | GLUE .tsv | .jsonl | .txt | hub:NAME"),
    ] = "builtin:wiki",
    samples: Annotated[int, typer.Option(help="number of samples to run")] = 1000,
    max_length: Annotated[
        int | None, typer.Option(help="tokens per sample (truncation); default: 128, or the model's positions if fewer")
    ] = None,
    batch_size: int = 32,
    windows: Annotated[int, typer.Option(help="number of distance windows N")] = 16,
    device: Device = "auto",
    dtype: Dtype = "float32",
    device_map: Annotated[
        str | None, typer.Option(help="auto | balanced | sequential: spread a large model over devices")
    ] = None,
    prepend_bos: Annotated[
        bool, typer.Option(help="prepend the model's BOS where a causal model's tokenizer adds none")
    ] = True,
    add_run: Annotated[bool, typer.Option(help="add a feature run to a model already in the catalog")] = False,
    refuse_malformed: Annotated[
        bool, typer.Option(help="refuse a .tsv with malformed lines instead of leaving them out with a warning")
    ] = False,
    revision: Annotated[
        str | None, typer.Option(help="hub ids: the branch, tag or commit to load (e.g. step1000)")
    ] = None,
    series: Annotated[str | None, typer.Option(help="make the checkpoint(s) steps of this series (SPEC 11)")] = None,
    step: Annotated[int | None, typer.Option(help="the checkpoint's training step in its series")] = None,
    detect: Annotated[
        bool, typer.Option(help="with --series: then a detection run on every step that lacks one (headcat detect)")
    ] = False,
    detect_sequences: Annotated[int, typer.Option(help="with --detect: seeded random sequences")] = 32,
    detect_length: Annotated[int, typer.Option(help="with --detect: distinct random ids per copy")] = 24,
    detect_copies: Annotated[int, typer.Option(help="with --detect: copies of the ids")] = 2,
    detect_seed: Annotated[int, typer.Option(help="with --detect: the sequences' seed")] = 0,
    detect_corpus: Annotated[
        str, typer.Option(help="with --detect: the causal check's corpus ('none': the repeat gain only)")
    ] = "builtin:wiki",
    enqueue: Enqueue = False,
) -> None:
    """Run a corpus through a model and store its per-head features.

    With `--series`, a directory of `step-N/` checkpoints is ingested in step order, one model
    per step; a step already in the catalog with a feature run is skipped, so a second run after a
    failure or a new checkpoint costs only the missing steps."""
    with catalog() as engine:
        if detect and series is None:
            raise InvalidInput("detect: --detect runs over a series' steps; give --series", field="detect")
        if detect and enqueue:
            raise InvalidInput("detect: queued steps are not ingested yet; run `headcat detect --series "
                               f"{series} --enqueue` once the workers have stored them", field="detect")  # fmt: skip
        try:
            todo = checkpoints(model, name, series, step, revision)
        except ValueError as error:
            raise InvalidInput(f"model: {error}", field="model") from error
        for source, catalog_name, number in todo:
            if series is not None and not add_run and _has_features(engine, catalog_name):
                log.info("Step %s of %r is in the catalog as %r; skipped.", number, series, catalog_name)
                continue
            result = ingest_model(
                engine, enqueue, model=source, name=catalog_name, corpus=corpus, samples=samples,
                max_length=max_length, batch_size=batch_size, num_windows=windows, device=device, dtype=dtype,
                add_run=add_run, device_map=device_map, prepend_bos=prepend_bos, refuse_malformed=refuse_malformed,
                revision=revision, series=series, step=number,
            )  # fmt: skip
            if result:
                log.info("Feature run %d of %r is stored.", result["feature_run_id"], catalog_name)
        if detect and series is not None:
            from service.cli.detections import detect_series

            detect_series(engine, series, {"sequences": detect_sequences, "length": detect_length,
                                           "copies": detect_copies, "seed": detect_seed,
                                           "corpus": None if detect_corpus == "none" else detect_corpus,
                                           "device": device, "dtype": dtype}, enqueue)  # fmt: skip
