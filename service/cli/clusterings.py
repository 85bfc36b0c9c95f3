"""``headcat cluster`` and ``headcat stability``: cluster heads into types, and how stable that is."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table
from sqlalchemy import Engine

from service import db
from service.cli.app import Enqueue, app, catalog, console, log, refusals, run_job, validated
from service.errors import InvalidInput, listed


def cluster_models(
    engine: Engine,
    names: list[str],
    k: int,
    seed: int,
    algorithm: str,
    enqueue: bool = False,
    stacks: list[str] | None = None,
    vector: str = "local",
    series: str | None = None,
) -> list[str]:
    """Cluster ``names`` and every step of ``series`` jointly; returns the models clustered."""
    from service.clusterings.schemas import ClusteringCreate

    request = validated(
        ClusteringCreate,
        {"models": names, "series": series, "k": k, "seed": seed, "algorithm": algorithm, "stacks": stacks,
         "vector": vector},
    )  # fmt: skip
    from service.clusterings.service import model_names, validate

    with db.session_scope(engine) as session:
        validate(session, request)  # every check before a job row is written
        names = model_names(session, request)
    result = run_job(engine, "clustering", request.model_dump(), enqueue=enqueue)
    if result and vector == "global":
        log.info("Clustering %d of the global (attribution) vectors of %s; the current clustering stays.",
                 result["clustering_id"], listed(names))  # fmt: skip
    elif result:
        log.info("Clustering %d is now current for %s.", result["clustering_id"], listed(names))
    return names


@app.command("cluster")
def cluster_command(
    names: Annotated[list[str] | None, typer.Argument(help="catalog names; several are clustered jointly")] = None,
    k: Annotated[int, typer.Option(help="number of clusters")] = 4,
    seed: Annotated[int, typer.Option(help="random seed, stored with the clustering")] = 0,
    algorithm: Annotated[str, typer.Option(help="kmeans | gmm")] = "kmeans",
    enqueue: Enqueue = False,
    stack: Annotated[
        list[str] | None,
        typer.Option(help="cluster this stack's heads (repeat: encoder, decoder, cross); default: every stack"),
    ] = None,
    vector: Annotated[
        str,
        typer.Option(help="local: attention features (becomes current) | global: the current attribution runs"),
    ] = "local",
    series: Annotated[
        str | None, typer.Option(help="cluster every step of this series jointly (one set of centroids, SPEC 11)")
    ] = None,
) -> None:
    """Cluster the heads of the models' current feature runs (jointly) and make it their current clustering.

    With `--series` the models are every step of the series, so that a head's type at one step and
    at another are names from the same centroids.

    With `--vector global` the heads' attribution vectors (`headcat attribute`) are clustered
    instead; such a clustering is stored beside the current one, not in its place.
    """
    with catalog() as engine:
        if not names and series is None:
            raise InvalidInput("models: name at least one model, or --series NAME", field="models")
        clustered = cluster_models(engine, list(names or []), k, seed, algorithm, enqueue, stack, vector, series)
        if not enqueue and vector == "local":
            print_types(engine, clustered)


@app.command()
def stability(
    clustering: Annotated[int, typer.Argument(help="clustering id")],
    runs: Annotated[int, typer.Option(help="R: fits on random subsets")] = 10,
    fraction: Annotated[float, typer.Option(help="share of heads in each subset")] = 0.5,
    seed: int = 0,
    enqueue: Enqueue = False,
) -> None:
    """Measure how stable a clustering is (Von Luxburg 2010, as in Guan et al. Table 1)."""
    from service.clusterings.schemas import StabilityCreate
    from service.clusterings.stability import require_clustering

    with refusals():
        request = validated(StabilityCreate, {"n_runs": runs, "fraction": fraction, "seed": seed}, {"n_runs": "--runs"})
    with catalog() as engine:
        with db.session_scope(engine) as session:
            require_clustering(session, clustering)  # before a job row is written
        result = run_job(engine, "stability", {"clustering_id": clustering, **request.model_dump()}, enqueue=enqueue)
        if result:
            log.info("Stability run %d: %.2f %% of heads keep their type in all %d fits.",
                     result["stability_run_id"], 100 * result["score"], runs)  # fmt: skip


def print_types(engine: Engine, names: list[str]) -> None:
    from service.models import repository

    with db.session_scope(engine) as session:
        for name in names:
            model = repository.require(session, name)
            if model.current_clustering_id is None:
                continue
            table = Table(title=f"{name}: heads per type and layer (clustering {model.current_clustering_id})")
            counts = repository.type_counts_by_layer(session, model.id, model.current_clustering_id)
            types = sorted({t for _, _, t, _ in counts})
            table.add_column("stack")
            table.add_column("layer", justify="right")
            for t in types:
                table.add_column(t, justify="right")
            for stack, (layers, _) in repository.shapes(model).items():
                for layer in range(layers):
                    row = {t: c for st, la, t, c in counts if (st, la) == (stack, layer)}
                    table.add_row(stack, str(layer), *(str(row.get(t, 0)) for t in types))
            console.print(table)
