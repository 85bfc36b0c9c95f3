"""``headcat ingest``: run a corpus through a model and store its per-head features."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from sqlalchemy import Engine

from service import db
from service.cli.app import Device, Dtype, Enqueue, app, catalog, log, run_job, validated


def ingest_model(engine: Engine, enqueue: bool = False, **options: object) -> dict[str, Any]:
    from service.ingests.schemas import IngestCreate
    from service.ingests.service import check_name, check_sources

    request = validated(IngestCreate, options)
    # Every check before torch is imported or a job row is written, as ablate and cluster do.
    check_sources(request)
    with db.session_scope(engine) as session:
        check_name(session, request)
    return run_job(engine, "ingest", request.model_dump(), enqueue=enqueue, progress="samples")


@app.command()
def ingest(
    model: Annotated[
        str,
        typer.Argument(
            help="hub id or local directory of a transformers model: encoder, decoder or both (encoder-decoder)"
        ),
    ],
    name: Annotated[str, typer.Option(help="unique catalog name for the model")],
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
    enqueue: Enqueue = False,
) -> None:
    """Run a corpus through a model and store its per-head features."""
    with catalog() as engine:
        result = ingest_model(
            engine, enqueue, model=model, name=name, corpus=corpus, samples=samples, max_length=max_length,
            batch_size=batch_size, num_windows=windows, device=device, dtype=dtype, add_run=add_run,
            device_map=device_map, prepend_bos=prepend_bos, refuse_malformed=refuse_malformed,
        )  # fmt: skip
        if result:
            log.info("Feature run %d of %r is stored.", result["feature_run_id"], name)
