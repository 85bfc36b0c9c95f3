"""``headcat importance`` and ``headcat prune-curve``: head importance scores, and pruning curves."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.table import Table

from service import db
from service.cli.app import (
    Articles,
    Device,
    Dtype,
    Enqueue,
    TaskMaxLength,
    app,
    catalog,
    log,
    make_console,
    run_job,
    validated,
)

if TYPE_CHECKING:
    from service.importance.schemas import HeadScoreRead


@app.command("importance")
def importance_command(
    name: Annotated[str, typer.Argument(help="catalog name of the model")],
    data: Annotated[
        str, typer.Option(help="SQuAD .json | GLUE .tsv | .jsonl | .txt or builtin:NAME (lm, sensitivity)")
    ],
    loss: Annotated[
        str | None, typer.Option(help="task | lm | sensitivity; default: task for a task model, else lm or sensitivity")
    ] = None,
    task: Annotated[
        str | None, typer.Option(help="squad | glue (the task loss); default from the model's head")
    ] = None,
    articles: Articles = None,
    limit: Annotated[int | None, typer.Option(help="score on this many examples")] = None,
    sample: Annotated[str, typer.Option(help="first | spread")] = "first",
    seed: Annotated[int, typer.Option(help="the MLM mask's and the Rademacher probes' seed")] = 0,
    probes: Annotated[int, typer.Option(help="sensitivity: Rademacher probes per batch")] = 8,
    batch_size: int = 32,
    max_length: TaskMaxLength = None,
    device: Device = "auto",
    dtype: Dtype = "float32",
    enqueue: Enqueue = False,
) -> None:
    """Score every head: mean over examples of |dLoss/dxi_h| (SPEC 7); prints the normalised scores."""
    from service.importance.schemas import ImportanceCreate
    from service.importance.service import get_importance, validate_importance

    with catalog() as engine:
        request = validated(
            ImportanceCreate,
            {"model": name, "data": data, "loss": loss, "task": task, "articles": articles, "limit": limit,
             "sample": sample, "seed": seed, "probes": probes, "batch_size": batch_size,
             "max_length": max_length, "device": device, "dtype": dtype},
        )  # fmt: skip
        with db.session_scope(engine) as session:
            validate_importance(session, request, load_hub=False)  # every check before any compute or job row
        payload = request.model_dump(mode="json")
        result = run_job(engine, "importance", payload, enqueue=enqueue, progress="batches")
        if enqueue:
            return
        with db.session_scope(engine) as session:
            read = get_importance(session, int(result["importance_run_id"]))
    log.info("Importance run %d of %r is stored (%s loss, %d examples, %.0f s).", read.id, name, read.loss,
             read.n_examples, read.seconds)  # fmt: skip
    console = make_console()
    console.print(importance_table(name, read.loss, read.scores, console.width))


def importance_table(name: str, loss: str, scores: Sequence[HeadScoreRead], width: int = 80) -> Table:
    """Layers down, heads across, each head's normalised score; every cell whole within ``width`` columns
    (no borders between cells; ``.83`` instead of ``0.83`` when that many heads need the room)."""
    layers = sorted({(s.stack, s.layer) for s in scores})
    heads = max((s.head for s in scores), default=-1) + 1
    labels = [str(layer) if len({s for s, _ in layers}) == 1 else f"{stack} {layer}" for stack, layer in layers]
    first = max([len("layer"), *map(len, labels)])

    def fits(cell: int) -> bool:
        return first + heads * (max(cell, len(str(heads - 1))) + 1) <= width

    short = not fits(4)  # "0.83" is 4 characters, ".83" 3 (a score is normalised to at most 1)

    def shown(value: float) -> str:
        text = f"{value:.2f}"
        return text.removeprefix("0") if short else text

    # No padding and no edge: the box's blank column dividers are the one space between cells.
    table = Table(title=f"{name}: head importance, normalised per layer ({loss} loss)", box=box.SIMPLE_HEAD,
                  padding=0, show_edge=False)  # fmt: skip
    table.add_column("layer", no_wrap=True)
    for head in range(heads):
        table.add_column(str(head), justify="right", no_wrap=True)
    cells = {(s.stack, s.layer, s.head): s.normalized for s in scores}
    for label, (stack, layer) in zip(labels, layers, strict=True):
        table.add_row(
            label, *(shown(cells[(stack, layer, h)]) if (stack, layer, h) in cells else "" for h in range(heads))
        )
    return table


@app.command("prune-curve")
def prune_curve_command(
    name: Annotated[str, typer.Argument(help="catalog name of the model")],
    data: Annotated[str, typer.Option(help="SQuAD .json | GLUE .tsv | .jsonl | .txt or builtin:NAME (drift)")],
    rankings: Annotated[
        str, typer.Option(help="comma list of importance, type, random, -importance")
    ] = "importance,type,random,-importance",
    steps: Annotated[int, typer.Option(help="points after the baseline, evenly up to --max-share")] = 10,
    max_share: Annotated[float, typer.Option(help="share of all heads pruned at the last point")] = 0.5,
    iterative: Annotated[bool, typer.Option(help="re-score the remaining heads after each step (Michel)")] = False,
    task: Annotated[str | None, typer.Option(help="squad | glue | drift; default from the model's head")] = None,
    loss: Annotated[str | None, typer.Option(help="the importance rankings' loss: task | lm | sensitivity")] = None,
    clustering: Annotated[int | None, typer.Option(help="clustering id for the type ranking; default: current")] = None,
    importance_run: Annotated[int | None, typer.Option(help="stored scores for the importance rankings")] = None,
    seed: Annotated[int, typer.Option(help="the random ranking's seed")] = 0,
    articles: Articles = None,
    limit: Annotated[int | None, typer.Option(help="evaluate this many examples")] = None,
    sample: Annotated[str, typer.Option(help="first | spread")] = "first",
    batch_size: int = 32,
    max_length: TaskMaxLength = None,
    device: Device = "auto",
    dtype: Dtype = "float32",
    enqueue: Enqueue = False,
) -> None:
    """Prune heads in each ranking's order and measure the metric at each step; prints the curves table."""
    from service.importance.schemas import PruningCurveCreate
    from service.importance.service import curves_table, get_curve, validate_curves

    with catalog() as engine:
        request = validated(
            PruningCurveCreate,
            {"model": name, "data": data, "rankings": rankings, "steps": steps, "max_share": max_share,
             "iterative": iterative, "task": task, "loss": loss, "clustering": clustering,
             "importance_run": importance_run, "seed": seed, "articles": articles, "limit": limit,
             "sample": sample, "batch_size": batch_size, "max_length": max_length, "device": device,
             "dtype": dtype},
        )  # fmt: skip
        with db.session_scope(engine) as session:
            validate_curves(session, request, load_hub=False)  # every check before any compute or job row
        payload = request.model_dump(mode="json")
        result = run_job(engine, "pruning", payload, enqueue=enqueue, progress="pruning steps")
        if enqueue:
            return
        with db.session_scope(engine) as session:
            read = get_curve(session, int(result["pruning_curve_id"]))
    log.info("Pruning curves %d of %r are stored (%.0f s).", read.id, name, read.seconds)
    sys.stdout.write(curves_table(read))
