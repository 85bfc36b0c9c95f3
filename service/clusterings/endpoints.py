"""``/clusterings`` and ``/stability-runs``: start analysis jobs and read their results."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response, status

from ingest.types import feature_names
from service import current, etags
from service.auth.deps import KEY_RESPONSES, RequireKey
from service.clusterings import repository
from service.clusterings.schemas import (
    ClusteringCreate,
    ClusteringCurrent,
    ClusteringItem,
    ClusteringRead,
    ClusterRead,
    HeadPoint,
    ModelShares,
    StabilityCreate,
    StabilityRunRead,
    StabilitySummary,
    StableHead,
)
from service.clusterings.service import validate
from service.clusterings.stability import require_clustering
from service.deps import SessionDep
from service.errors import NotFound
from service.jobs.endpoints import accept
from service.jobs.schemas import JobAccepted
from service.orm import StabilityRun

router = APIRouter(tags=["clusterings"])

Id = Annotated[int, Path(ge=1, le=2**31 - 1)]


@router.post(
    "/clusterings",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=JobAccepted,
    dependencies=[RequireKey],
    responses=KEY_RESPONSES,
)
def create_clustering(body: ClusteringCreate, session: SessionDep, request: Request) -> JobAccepted:
    """Start a (re-)clustering job; when it succeeds the clustering is its models' current one.

    Checked before anything is queued: the models exist and have features, k fits the heads.
    An identical request that is still queued or running answers with that job.
    """
    validate(session, body)
    return accept(session, request, "clustering", body.model_dump())


@router.get("/clusterings", response_model=list[ClusteringItem])
def list_clusterings(
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
) -> list[ClusteringItem]:
    """Clusterings, newest first."""
    return [ClusteringItem.model_validate(c) for c in repository.list_recent(session, limit, offset)]


@router.get("/clusterings/{clustering_id}", response_model=ClusteringRead)
def get_clustering(session: SessionDep, clustering_id: Id, request: Request, response: Response) -> Any:
    """Clusters (name, centroid, share), per-model shares and per-layer types, t-SNE of every head.

    A complete clustering carries an ``ETag``; ``If-None-Match`` with it answers ``304``."""
    tag = etags.clustering_tag(session, clustering_id)
    if tag is not None and etags.matches(request, tag):
        return etags.not_modified(tag)
    if tag is not None:
        response.headers.update({"ETag": tag, "Cache-Control": etags.CACHE_CONTROL})
    clustering = require_clustering(session, clustering_id)
    names = feature_names(clustering.num_windows)
    rows = repository.head_rows(session, clustering.id)
    by_model: dict[tuple[str, int], list[tuple[str, int, str]]] = defaultdict(list)
    for row in rows:
        by_model[row.model, row.feature_run_id].append((row.stack, row.layer, row.type))
    models = []
    for (model, run_id), heads in sorted(by_model.items()):
        counts = Counter(t for _, _, t in heads)
        stacks: dict[str, list[Counter[str]]] = {}
        for stack in dict.fromkeys(stack for stack, _, _ in heads):  # rows come in STACKS order
            depth = max(layer for s, layer, _ in heads if s == stack) + 1
            stacks[stack] = [Counter() for _ in range(depth)]
        for stack, layer, t in heads:
            stacks[stack][layer][t] += 1
        per_stack = {stack: [dict(layer) for layer in layers] for stack, layers in stacks.items()}
        models.append(
            ModelShares(
                model=model,
                feature_run_id=run_id,
                heads=len(heads),
                shares={c.name: counts.get(c.name, 0) / len(heads) for c in clustering.clusters},
                layers=next(iter(per_stack.values())),
                stacks=per_stack,
            )
        )
    return ClusteringRead(
        id=clustering.id,
        algorithm=clustering.algorithm,
        k=clustering.k,
        seed=clustering.seed,
        num_windows=clustering.num_windows,
        num_heads=clustering.num_heads,
        params=clustering.params,
        seconds=clustering.seconds,
        created_at=clustering.created_at,
        current_for=repository.current_for(session, clustering.id),
        clusters=[
            ClusterRead(
                index=c.index,
                name=c.name,
                centroid=dict(zip(names, c.centroid, strict=True)),
                size=c.size,
                share=c.share,
            )  # fmt: skip
            for c in clustering.clusters
        ],
        models=models,
        tsne=[
            HeadPoint(model=r.model, stack=r.stack, layer=r.layer, head=r.head, type=r.type, x=r.tsne_x, y=r.tsne_y)
            for r in rows
        ],
        stability=[_summary(run) for run in repository.stability_runs(session, clustering.id)],
        current_stability_run_id=clustering.current_stability_run_id,
    )


@router.post(
    "/clusterings/{clustering_id}/stability",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=JobAccepted,
    dependencies=[RequireKey],
    responses=KEY_RESPONSES,
)
def create_stability_run(
    session: SessionDep, request: Request, clustering_id: Id, body: StabilityCreate | None = None
) -> JobAccepted:
    """Start a stability run (SPEC section 3) of a stored clustering."""
    body = body or StabilityCreate()
    require_clustering(session, clustering_id)
    return accept(session, request, "stability", {"clustering_id": clustering_id, **body.model_dump()})


@router.put(
    "/clusterings/{clustering_id}/current",
    response_model=ClusteringCurrent,
    dependencies=[RequireKey],
    responses=KEY_RESPONSES,
)
def put_current_clustering(session: SessionDep, clustering_id: Id) -> ClusteringCurrent:
    """Make this clustering current again for every model it covers, as it was when it was made (a model alone:
    ``PUT /models/{name}/current/clustering``). No new clustering is fitted. A clustering that is not complete,
    or one of the global (attribution) vectors, answers 409 saying so."""
    clustering = require_clustering(session, clustering_id)
    for model in repository.covered_models(session, clustering.id):
        current.choose(session, model, "clustering", clustering.id)
    return ClusteringCurrent(id=clustering.id, current_for=repository.current_for(session, clustering.id))


@router.get("/stability-runs/{run_id}", response_model=StabilityRunRead)
def get_stability_run(session: SessionDep, run_id: Id) -> StabilityRunRead:
    run = session.get(StabilityRun, run_id)
    if run is None:
        raise NotFound(f"run_id: no stability run with id {run_id}", field="run_id")
    return StabilityRunRead(
        id=run.id,
        clustering_id=run.clustering_id,
        score=run.score,
        n_runs=run.n_runs,
        fraction=run.fraction,
        random_state=run.random_state,
        seeds=run.seeds,
        num_heads=run.num_heads,
        seconds=run.seconds,
        created_at=run.created_at,
        heads=[
            StableHead(
                model=r.model,
                stack=r.stack,
                layer=r.layer,
                head=r.head,
                type=r.type,
                stable=r.stable,
                agreement=r.agreement,
                margin=r.margin,
            )  # fmt: skip
            for r in repository.stability_heads(session, run)
        ],
    )


def _summary(run: StabilityRun) -> StabilitySummary:
    return StabilitySummary(
        id=run.id, score=run.score, n_runs=run.n_runs, fraction=run.fraction, created_at=run.created_at
    )
