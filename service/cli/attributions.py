"""``headcat attribute``: gradient attribution of every head to the input tokens."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from service import db
from service.cli.app import Device, Dtype, Enqueue, app, catalog, log, make_console, run_job, validated


@app.command()
def attribute(
    name: Annotated[str, typer.Argument(help="catalog name of the model (ingested first)")],
    corpus: Annotated[
        str, typer.Option(help="builtin:wiki | builtin:lee | SQuAD .json | GLUE .tsv | .jsonl | .txt | hub:NAME")
    ] = "builtin:wiki",
    samples: Annotated[int, typer.Option(help="samples to attribute")] = 32,
    max_length: Annotated[int, typer.Option(help="tokens per sample (truncation)")] = 64,
    queries: Annotated[
        int | None, typer.Option(help="query positions per sample, a seeded subsample (default: every query)")
    ] = None,
    probes: Annotated[int, typer.Option(help="P Rademacher tangents per input position (forward mode)")] = 4,
    exact: Annotated[
        bool, typer.Option(help="G itself: the hidden size's unit vectors as tangents (tokens x hidden passes)")
    ] = False,
    seed: int = 0,
    device: Device = "auto",
    dtype: Dtype = "float32",
    enqueue: Enqueue = False,
) -> None:
    """Gradient attribution of every head to the input tokens (Pascual et al. 2021): global vectors and
    the discrepancy with attention; prints the mean discrepancy per layer.

    Forward mode: each of `--probes` seeded Rademacher tangents at each input position is one pass that
    gives every layer, head and query at once (an unbiased estimate of G^2); `--exact` pushes the hidden
    size's unit vectors instead and gives G itself. Progress counts these passes."""
    from service.attributions.schemas import AttributionCreate
    from service.attributions.service import validate

    with catalog() as engine:
        request = validated(
            AttributionCreate,
            {"model": name, "corpus": corpus, "samples": samples, "max_length": max_length, "queries": queries,
             "probes": probes, "scheme": "exact" if exact else "forward", "seed": seed, "device": device,
             "dtype": dtype},
        )  # fmt: skip
        with db.session_scope(engine) as session:
            validate(session, request)  # every check before any compute or job row
        payload = request.model_dump(mode="json")
        result = run_job(engine, "attribution", payload, enqueue=enqueue, progress="passes")
        if enqueue:
            return
    log.info("Attribution run %s of %r is stored (%s): %s rows from %s passes in %.1f s (%.0f rows/s).",
             result.get("attribution_run_id"), name, result.get("scheme"), result.get("rows"), result.get("passes"),
             result.get("seconds", 0.0), result.get("rows_per_second", 0.0))  # fmt: skip
    table = Table("layer", "mean discrepancy")
    for layer, value in enumerate(result.get("layer_discrepancy", [])):
        table.add_row(str(layer), f"{value:.3f}")
    make_console().print(table)
