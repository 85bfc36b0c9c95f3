"""``headcat detect``: induction, duplicate-token, previous-token and sink heads (detection runs)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table
from sqlalchemy import Engine

from service import db
from service.cli.app import Device, Dtype, Enqueue, app, catalog, log, make_console, run_job, validated
from service.errors import InvalidInput


def _thresholds(values: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for value in values:
        name, _, number = value.partition("=")
        try:
            out[name.strip()] = float(number)
        except ValueError:
            raise InvalidInput(f"thresholds: {value!r} is not DETECTOR=NUMBER, e.g. induction=0.5",
                               field="thresholds") from None  # fmt: skip
    return out


def detect_series(engine: Engine, series: str, options: dict[str, object], enqueue: bool) -> None:
    """One detection run per step of ``series`` in step order, each its own job, skipping the steps whose current
    run asked the same sequences and thresholds (SPEC 11); every step is checked before the first runs."""
    from service.detections.schemas import DetectionSettings
    from service.detections.service import plan_series

    settings = validated(DetectionSettings, options)
    with db.session_scope(engine) as session:
        todo, skipped = plan_series(session, series, settings)
    for step, model, run_id in skipped:
        log.info("Step %s (%r) has detection run %d with these sequences; skipped.", step, model, run_id)
    for step, request in todo:
        log.info("Detecting the heads of step %s of %r (%s)", step, series, request.model)
        run_job(engine, "detection", request.model_dump(mode="json"), enqueue=enqueue, progress="sequences")
    log.info("Series %r: %d of %d steps detected now.", series, len(todo), len(todo) + len(skipped))


@app.command()
def detect(
    name: Annotated[
        str | None, typer.Argument(help="catalog name of the model (ingested first); none with --series")
    ] = None,
    sequences: Annotated[int, typer.Option(help="seeded random sequences")] = 32,
    length: Annotated[int, typer.Option(help="distinct random ids per copy")] = 24,
    copies: Annotated[int, typer.Option(help="copies of the ids in each sequence (>= 2)")] = 2,
    seed: int = 0,
    threshold: Annotated[
        list[str] | None, typer.Option(help="DETECTOR=VALUE in [0, 1], repeatable (e.g. induction=0.5)")
    ] = None,
    check: Annotated[
        list[str] | None,
        typer.Option(
            help="causal LMs: a role whose heads are pruned to measure the repeat gain without them "
            "(repeatable; default induction)"
        ),
    ] = None,
    corpus: Annotated[
        str, typer.Option(help="causal LMs: text whose next-token loss the causal check measures ('none': skip)")
    ] = "builtin:wiki",
    corpus_samples: Annotated[int, typer.Option(help="texts of the corpus read")] = 64,
    batch_size: int = 32,
    device: Device = "auto",
    dtype: Dtype = "float32",
    series: Annotated[
        str | None, typer.Option(help="every step of this series, in step order; steps already detected are skipped")
    ] = None,
    enqueue: Enqueue = False,
) -> None:
    """Score every head as an induction, duplicate-token, previous-token and sink head on repeated random
    sequences (SPEC 10); prints the heads with a role and the model's repeat gain. With `--series`,
    every step of the series with the same sequences (SPEC 11)."""
    from service.detections.schemas import DetectionCreate
    from service.detections.service import model_detections, validate

    with catalog() as engine:
        options: dict[str, object] = {"sequences": sequences, "length": length, "copies": copies, "seed": seed,
                   "thresholds": _thresholds(threshold or []) or None, "check": check or ["induction"],
                   "corpus": None if corpus == "none" else corpus, "corpus_samples": corpus_samples,
                   "batch_size": batch_size, "device": device, "dtype": dtype}  # fmt: skip
        if (name is None) == (series is None):
            raise InvalidInput("name: give a model's name or --series NAME (one of them)", field="name")
        if series is not None:
            detect_series(engine, series, options, enqueue)
            return
        request = validated(DetectionCreate, {**options, "model": name})
        with db.session_scope(engine) as session:
            validate(session, request)  # every check before any compute or job row
        run_job(engine, "detection", request.model_dump(mode="json"), enqueue=enqueue, progress="sequences")
        if enqueue:
            return
        with db.session_scope(engine) as session:
            read = model_detections(session, request.model)
    run = next(r for r in read.runs if r.id == read.current_run_id)  # the run just stored
    gain = "n/a (no causal LM head)" if run.repeat_gain is None else f"{run.repeat_gain:.3f} nats"
    log.info("Detection run %d of %r is stored: repeat gain %s.", run.id, name, gain)
    table = Table("head", "induction", "duplicate", "previous", "sink", "roles")
    for head in read.heads:
        if head.roles:
            cells = [f"{v:.3f}" if v is not None else "-" for v in
                     (head.induction, head.duplicate_token, head.previous_token, head.sink)]  # fmt: skip
            table.add_row(f"{head.stack} {head.layer}-{head.head}", *cells, ", ".join(head.roles))
    make_console().print(table)
    make_console().print(f"repeat gain: {gain}")
    for entry in run.checks:
        without = entry["without"]
        after = "no head has the role" if without is None else f"{without['repeat_gain']:.3f} nats without them"
        if without is not None and without.get("corpus_loss") is not None:
            after += f"; corpus loss {entry['with']['corpus_loss']:.3f} -> {without['corpus_loss']:.3f} nats"
        make_console().print(f"causal check, {entry['role']} ({len(entry['heads'])} heads): {after}")
