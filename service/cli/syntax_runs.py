"""``headcat syntax``: score every head on dependency relations (syntax runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from service import db
from service.cli.app import Device, Dtype, Enqueue, app, catalog, log, make_console, run_job, validated


@app.command()
def syntax(
    name: Annotated[str, typer.Argument(help="catalog name of the model (ingested first)")],
    corpus: Annotated[str, typer.Option(help="text parsed by spaCy (silver parses; the \\[syntax] extra)")] = (
        "builtin:wiki"
    ),
    parses: Annotated[str | None, typer.Option(help="a CoNLL-U file of gold parses (instead of --corpus)")] = None,
    samples: Annotated[int, typer.Option(help="sentences to score")] = 500,
    max_length: Annotated[int, typer.Option(help="longer sentences (tokens) are left out")] = 128,
    batch_size: int = 32,
    min_count: Annotated[int, typer.Option(help="print relations with at least this many pairs")] = 10,
    device: Device = "auto",
    dtype: Dtype = "float32",
    enqueue: Enqueue = False,
) -> None:
    """Score every head on dependency relations (Clark et al. 2019); prints the best head per relation
    against the fixed-offset baseline."""
    from service.syntax.schemas import SyntaxCreate
    from service.syntax.service import model_syntax, validate

    with catalog() as engine:
        request = validated(
            SyntaxCreate,
            {"model": name, "corpus": corpus, "parses": parses, "samples": samples, "max_length": max_length,
             "batch_size": batch_size, "device": device, "dtype": dtype},
        )  # fmt: skip
        if request.parses is not None:
            request = request.model_copy(update={"parses": str(Path(request.parses).expanduser().resolve())})
        with db.session_scope(engine) as session:
            validate(session, request)  # every check before any compute or job row
        payload = request.model_dump(mode="json")
        run_job(engine, "syntax", payload, enqueue=enqueue, progress="sentences")
        if enqueue:
            return
        with db.session_scope(engine) as session:
            read = model_syntax(session, name, min_count=min_count)
    log.info("Syntax run %d of %r is stored: %d %s sentences.", read.run.id, name, read.run.num_sentences,
             read.run.parses)  # fmt: skip
    table = Table("relation", "pairs", "best head", "direction", "accuracy", "baseline (offset)")
    for row in read.best:
        table.add_row(row.relation, str(row.count), f"{row.layer}-{row.head}", row.direction, f"{row.accuracy:.1%}",
                      f"{row.baseline:.1%} ({row.baseline_offset:+d})")  # fmt: skip
    make_console().print(table)
