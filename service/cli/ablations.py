"""``headcat ablate`` and ``headcat report``: ablate heads by type, and Guan et al.'s Tables 2 and 3."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

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
    run_job,
    validated,
)
from service.errors import InvalidInput


def _ablation_plan(
    plan: str | None, selections: dict[str, str | None], rows: list[str] | None
) -> str | list[dict[str, str]]:
    """``--plan paper``, or custom rows: the ``--prune/--uniform/--drop-*`` options make one, each ``--row`` one."""
    custom: list[dict[str, str]] = []
    single = {op: value for op, value in selections.items() if value}
    if single:
        custom.append(single)
    for text in rows or []:
        row: dict[str, str] = {}
        for part in text.split(";"):
            op, sep, selection = part.partition("=")
            if not part.strip():
                continue
            if not sep or not selection.strip():
                raise InvalidInput(f"row: {part.strip()!r} is not OPERATION=SELECTION (e.g. prune=dense,vertical)")
            row[op.strip().replace("-", "_")] = selection.strip()
        if not row:
            raise InvalidInput(f"row: {text!r} names no operation")
        custom.append(row)
    if plan is not None and plan != "paper":
        raise InvalidInput(f"plan: {plan!r} is not a plan; use --plan paper, or --prune/--uniform/--drop-*/--row")
    if plan == "paper" and custom:
        raise InvalidInput("plan: give --plan paper or custom rows (--prune, --uniform, --drop-*, --row), not both")
    return custom or "paper"


@app.command()
def ablate(
    name: Annotated[str, typer.Argument(help="catalog name of the model")],
    data: Annotated[
        str,
        typer.Option(help="SQuAD .json | GLUE .tsv | .jsonl | .txt or builtin:NAME (drift) | hub:NAME[:CFG][:SPLIT]"),
    ],
    task: Annotated[str | None, typer.Option(help="squad | glue | drift; default from the model's head")] = None,
    clustering: Annotated[int | None, typer.Option(help="clustering id for the types; default: the current")] = None,
    plan: Annotated[str | None, typer.Option(help="paper: Guan et al. Tables 2 and 3 (the default)")] = None,
    prune: Annotated[
        str | None,
        typer.Option(
            help="one row: prune these (dense,vertical | all-but:diagonal | layers:3-5 | 0:1,5:1); a stack "
            "prefix (encoder:layers:0, decoder:0:1) limits a rule to that stack, else it covers every stack"
        ),
    ] = None,
    uniform: Annotated[str | None, typer.Option(help="same row: uniform 1/L attention for these heads")] = None,
    drop_intra: Annotated[str | None, typer.Option(help="same row: drop their intra-segment attention")] = None,
    drop_inter: Annotated[str | None, typer.Option(help="same row: drop their inter-segment attention")] = None,
    row: Annotated[
        list[str] | None, typer.Option(help="a row of its own, e.g. 'prune=dense;uniform=vertical' (repeat)")
    ] = None,
    articles: Articles = None,
    limit: Annotated[int | None, typer.Option(help="evaluate this many examples")] = None,
    sample: Annotated[str, typer.Option(help="first | spread: the first LIMIT examples or evenly spaced")] = "first",
    batch_size: int = 32,
    max_length: TaskMaxLength = None,
    device: Device = "auto",
    dtype: Dtype = "float32",
    renormalize: Annotated[bool, typer.Option(help="renormalise rows after drop_intra/drop_inter")] = False,
    enqueue: Enqueue = False,
) -> None:
    """Ablate a model's heads by type and measure what it loses; prints Tables 2 and 3 (markdown)."""
    from service.ablations.report import markdown_report
    from service.ablations.schemas import AblationCreate
    from service.ablations.service import get_run, validate

    with catalog() as engine:
        selections = {"prune": prune, "uniform": uniform, "drop_intra": drop_intra, "drop_inter": drop_inter}
        request = validated(
            AblationCreate,
            {"model": name, "data": data, "task": task, "clustering": clustering,
             "plan": _ablation_plan(plan, selections, row), "articles": articles, "limit": limit,
             "sample": sample, "batch_size": batch_size, "max_length": max_length, "device": device,
             "dtype": dtype, "renormalize": renormalize},
        )  # fmt: skip
        with db.session_scope(engine) as session:
            validate(session, request, load_hub=False)  # every check before any compute or job row
        payload = request.model_dump(mode="json")
        result = run_job(engine, "ablation", payload, enqueue=enqueue, progress="ablation rows")
        if enqueue:
            return
        with db.session_scope(engine) as session:
            read = get_run(session, int(result["ablation_run_id"]))
        log.info("Ablation run %d of %r is stored (%d rows, %.0f s).", read.id, name, len(read.outcomes), read.seconds)
    sys.stdout.write(markdown_report(read))


@app.command()
def report(
    name: Annotated[str, typer.Argument(help="catalog name of the model")],
    run: Annotated[int | None, typer.Option(help="ablation run id; default: the model's newest")] = None,
    task: Annotated[str | None, typer.Option(help="the newest run of this task: squad | glue | drift")] = None,
    curves: Annotated[int | None, typer.Option(help="pruning curves id; default: the model's newest")] = None,
) -> None:
    """Print a model's ablation outcomes as Guan et al.'s Tables 2 and 3 and its pruning curves (markdown)."""
    from service.ablations.report import markdown_report
    from service.ablations.service import latest_run
    from service.errors import NotFound
    from service.importance.service import curves_table, get_curve, list_curves

    with catalog() as engine, db.session_scope(engine) as session:
        curve = (
            get_curve(session, curves) if curves is not None else next(iter(list_curves(session, name, limit=1)), None)
        )
        if curve is not None and curve.model != name:
            raise InvalidInput(
                f"curves: pruning curves {curve.id} are of {curve.model!r}, not {name!r}", field="curves"
            )
        try:
            read = latest_run(session, name, run_id=run, task=task)
        except NotFound:
            if curve is None or run is not None:
                raise
            read = None
    if read is not None:
        sys.stdout.write(markdown_report(read))
    if curve is not None:
        sys.stdout.write(("\n" if read is not None else "") + curves_table(curve))
