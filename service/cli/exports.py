"""``headcat export``: a selection of a model's heads for pruning tools."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from service import db
from service.cli.app import app, catalog, error_line, log
from service.errors import InvalidInput


@app.command("export")
def export_command(
    name: Annotated[str, typer.Argument(help="catalog name of the model")],
    format: Annotated[
        str, typer.Option("--format", "-f", help="prune_heads | head_mask | head_mask.npy | scores | pairs | csv")
    ] = "prune_heads",
    type: Annotated[list[str] | None, typer.Option(help="select heads of these types (repeat, or comma list)")] = None,
    exclude_type: Annotated[list[str] | None, typer.Option(help="leave out heads of these types")] = None,
    layer_gt: int | None = None,
    layer_ge: int | None = None,
    layer_lt: int | None = None,
    layer_le: int | None = None,
    head: Annotated[int | None, typer.Option(help="select this head index in each layer")] = None,
    heads: Annotated[
        str | None, typer.Option(help="explicit LAYER:HEAD or STACK:LAYER:HEAD, e.g. 0:1,decoder:5:11")
    ] = None,
    clustering: Annotated[int | None, typer.Option(help="clustering id for the types; default: the current")] = None,
    score: Annotated[
        str,
        typer.Option(
            help="special, local, centroid_distance, margin, agreement, importance, a detector (induction, ...), "
            "a feature or a scalar"
        ),
    ] = "special",
    stack: Annotated[
        str | None, typer.Option(help="encoder | decoder | cross: export this stack only; default: every stack")
    ] = None,
    lowest: Annotated[
        str | None,
        typer.Option(help="of the selected heads, this count (12) or share of all heads (30%) lowest by score"),
    ] = None,
    min_agreement: Annotated[
        float | None,
        typer.Option(help="select only heads whose type agreement (current stability run) is at least this"),
    ] = None,
    min_margin: Annotated[
        float | None, typer.Option(help="select only heads whose type margin is at least this")
    ] = None,
    role: Annotated[
        list[str] | None, typer.Option(help="select heads with any of these roles (current detection run; repeatable)")
    ] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="write to this file instead of stdout")] = None,
) -> None:
    """Export a selection of a model's heads for pruning tools, as GET /models/NAME/export does.

    The selection is the heads to prune: prune_heads and pairs list them, head_mask is 1 = keep
    and 0 = pruned. Every filter given must hold; with none, every head is selected.
    """
    import json

    from ingest.types import STACKS
    from service.exports.service import Selection, export, parse_heads, split_names

    if stack is not None and stack not in STACKS:
        raise InvalidInput(f"stack: unknown stack {stack!r}; stacks: {', '.join(STACKS)}", field="stack")
    with catalog() as engine, db.session_scope(engine) as session:
        selection = Selection(
            types=split_names(type), exclude_types=split_names(exclude_type), layer_gt=layer_gt, layer_ge=layer_ge,
            layer_lt=layer_lt, layer_le=layer_le, head=head, heads=parse_heads(heads), clustering_id=clustering,
            stack=stack,  # type: ignore[arg-type]
            lowest=lowest, min_agreement=min_agreement, min_margin=min_margin, roles=split_names(role),
        )  # fmt: skip
        result = export(session, name, selection, format, score)
    data = result.content if isinstance(result.content, bytes | str) else json.dumps(result.content) + "\n"
    if output is not None:
        output.write_bytes(data if isinstance(data, bytes) else data.encode())
        log.info("Wrote %s: %d heads selected (clustering %s).", output, result.selected, result.clustering_id)
    elif isinstance(data, bytes):
        if sys.stdout.isatty():
            error_line(".npy is binary; pass --output FILE or redirect stdout")
            raise typer.Exit(2)
        sys.stdout.buffer.write(data)
    else:
        sys.stdout.write(data)
