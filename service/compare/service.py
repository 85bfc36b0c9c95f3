"""Head-by-head comparison of models' types; the baseline is the first model named."""

from __future__ import annotations

from sqlalchemy.orm import Session

from ingest.types import Stack
from service.compare.schemas import ChangedHead, ComparedModel, Comparison, ModelChanges
from service.errors import InvalidInput
from service.exports.service import HeadTable, Selection, resolve
from service.models import repository as models

MAX_MODELS = 20


def compare(
    session: Session, names: tuple[str, ...], clustering_id: int | None = None, stack: Stack | None = None
) -> Comparison:
    """Compare one stack of the models head by head: ``stack``, by default the baseline's first
    (``encoder`` when it has one, else ``decoder``)."""
    if len(names) < 2:
        raise InvalidInput("models: name two or more models, e.g. models=minilm,minilm-sst2", field="models")
    if len(names) > MAX_MODELS:
        raise InvalidInput(f"models: compare at most {MAX_MODELS} models at once", field="models")
    if stack is None:
        stack = next(iter(models.shapes(models.require(session, names[0], field="models"))))
    tables = [
        resolve(session, name, Selection(clustering_id=clustering_id, stack=stack), field="models") for name in names
    ]
    for table in tables:
        if table.clustering_id is None:
            raise InvalidInput(
                f"models: {table.model.name!r} has not been clustered yet, so its heads have no type; "
                f"run `headcat cluster {' '.join(names)}` to cluster them jointly",
                field="models",
            )
    base = tables[0]
    for table in tables[1:]:
        if table.shape != base.shape:
            raise InvalidInput(
                f"models: {table.model.name!r} has {table.shape[0]} x {table.shape[1]} heads but "
                f"{base.model.name!r} has {base.shape[0]} x {base.shape[1]}; "
                "only models of one shape compare head by head",
                field="models",
            )
    grids = {t.model.name: _grid(t) for t in tables}
    layers, heads = base.shape
    baseline = grids[base.model.name]
    changed = [
        ChangedHead(layer=la, head=h, types={name: grid[la][h] for name, grid in grids.items()})
        for la in range(layers)
        for h in range(heads)
        if any(grid[la][h] != baseline[la][h] for grid in grids.values())
    ]
    counts = []
    for table in tables[1:]:
        grid = grids[table.model.name]
        transitions: dict[str, dict[str, int]] = {}
        by_layer = [0] * layers
        for la in range(layers):
            for h in range(heads):
                before, after = baseline[la][h], grid[la][h]
                row = transitions.setdefault(before, {})
                row[after] = row.get(after, 0) + 1
                by_layer[la] += before != after
        counts.append(
            ModelChanges(
                model=table.model.name,
                changed=sum(by_layer),
                total=layers * heads,
                by_layer=by_layer,
                transitions=transitions,
            )  # fmt: skip
        )
    return Comparison(
        baseline=base.model.name,
        stack=stack,
        models=[
            ComparedModel(name=t.model.name, num_layers=t.shape[0], num_heads=t.shape[1], clustering_id=t.clustering_id)
            for t in tables
            if t.clustering_id is not None
        ],
        joint=len({t.clustering_id for t in tables}) == 1,
        types=grids,
        changed=changed,
        counts=counts,
    )


def _grid(table: HeadTable) -> list[list[str]]:
    layers, heads = table.shape
    grid = [["" for _ in range(heads)] for _ in range(layers)]
    for row in table.rows:
        grid[row.layer][row.head] = row.type
    return grid
