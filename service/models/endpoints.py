"""``/models``: what is in the catalog."""

from __future__ import annotations

from fastapi import APIRouter, Path

from ingest.types import STACKS
from service import current
from service.auth.deps import KEY_RESPONSES, RequireKey
from service.deps import SessionDep
from service.errors import Conflict
from service.models import repository
from service.models.schemas import (
    ClusteringSummary,
    ClusterShare,
    CurrentChoice,
    CurrentRuns,
    FeatureRunRead,
    LayerTypes,
    LensName,
    ModelDeleted,
    ModelDetail,
    ModelRead,
)

router = APIRouter(prefix="/models", tags=["models"])

ModelName = Path(description="the model's unique catalog name", max_length=200)


@router.get("", response_model=list[ModelRead])
def list_models(session: SessionDep) -> list[ModelRead]:
    return [ModelRead.model_validate(m) for m in repository.list_all(session)]


@router.get("/{name}", response_model=ModelDetail)
def get_model(session: SessionDep, name: str = ModelName) -> ModelDetail:
    """A model with its stacks, feature runs and, per layer of each stack, how many heads of each type it has."""
    model = repository.require(session, name, field="name")
    runs = [FeatureRunRead.model_validate(r) for r in repository.feature_runs(session, model.id)]
    summary, layers = None, []
    if model.current_clustering_id is not None:
        clustering = repository.clustering_with_clusters(session, model.current_clustering_id)
        assert clustering is not None
        per_layer: dict[tuple[int, int], dict[str, int]] = {
            (STACKS.index(stack), layer): {}
            for stack, (layers, _) in repository.shapes(model).items()
            for layer in range(layers)
        }
        for stack, layer, type_name, count in repository.type_counts_by_layer(session, model.id, clustering.id):
            per_layer.setdefault((STACKS.index(stack), layer), {})[type_name] = count
        totals = repository.model_type_shares(session, model.id, clustering.id)
        heads = sum(totals.values()) or 1
        summary = ClusteringSummary(
            id=clustering.id,
            algorithm=clustering.algorithm,
            k=clustering.k,
            seed=clustering.seed,
            clusters=[
                ClusterShare(name=c.name, size=totals.get(c.name, 0), share=totals.get(c.name, 0) / heads)
                for c in clustering.clusters
            ],
        )
        layers = [
            LayerTypes(stack=STACKS[stack], layer=layer, counts=counts)
            for (stack, layer), counts in sorted(per_layer.items())
        ]
    return ModelDetail(
        **ModelRead.model_validate(model).model_dump(),
        feature_runs=runs,
        current_runs=current.current_runs(session, model),
        clustering=summary,
        layers=layers,
    )


@router.delete("/{name}", response_model=ModelDeleted, dependencies=[RequireKey], responses=KEY_RESPONSES)
def delete_model(session: SessionDep, name: str = ModelName) -> ModelDeleted:
    """Delete a model and everything computed from it, in one transaction: feature runs, heads,
    features, ablation runs and baselines, and the clusterings that covered it alone (joint
    clusterings keep the other models). Refused (409) while a queued or running job writes to it."""
    model = repository.require(session, name, field="name")
    session.refresh(model, with_for_update=True)
    busy = repository.active_jobs_naming(session, name)
    if busy:
        raise Conflict(f"name: jobs {busy} are queued or running for {name!r}; delete it when they are done",
                       field="name")  # fmt: skip
    counts = repository.delete(session, model)
    return ModelDeleted(name=name, **counts)


@router.get("/{name}/current", response_model=CurrentRuns)
def get_current_runs(session: SessionDep, name: str = ModelName) -> CurrentRuns:
    """The run each lens serves: what ``GET /heads``, the lens endpoints, the views, exports and the page read."""
    model = repository.require(session, name, field="name")
    return CurrentRuns(model=model.name, **current.current_runs(session, model))


@router.put("/{name}/current/{lens}", response_model=CurrentRuns, dependencies=[RequireKey], responses=KEY_RESPONSES)
def put_current_run(session: SessionDep, lens: LensName, body: CurrentChoice, name: str = ModelName) -> CurrentRuns:
    """Serve another run of this lens: a complete run of the model (for ``clustering``, a local clustering that
    covers it; for ``stability``, a run of a clustering that covers it, which becomes that clustering's current
    one). A run of another model, one not complete, or an unknown run answers 409 or 404 saying which."""
    model = repository.require(session, name, field="name")
    session.refresh(model, with_for_update=True)
    return CurrentRuns(model=model.name, **current.choose(session, model, lens, body.run_id))
