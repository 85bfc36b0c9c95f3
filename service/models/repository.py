"""SQL for models, their feature runs and per-layer type counts."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import and_, func, or_, select
from sqlalchemy import delete as delete_
from sqlalchemy.orm import Session, selectinload

from ingest.types import STACKS, Stack
from service.errors import NotFound, known
from service.orm import (
    CatalogModel,
    Cluster,
    Clustering,
    FeatureRun,
    Head,
    HeadAssignment,
    Job,
    clustering_feature_runs,
)


def get_by_name(session: Session, name: str) -> CatalogModel | None:
    return session.scalar(select(CatalogModel).where(CatalogModel.name == name))


def require(session: Session, name: str, *, field: str = "model") -> CatalogModel:
    """The model called ``name``, or a 404 that lists the known names."""
    model = get_by_name(session, name)
    if model is None:
        names = session.scalars(select(CatalogModel.name).order_by(CatalogModel.name).limit(50)).all()
        raise NotFound(f"{field}: no model named {name!r}; known models: {known(names)}", field=field)
    return model


def list_all(session: Session) -> Sequence[CatalogModel]:
    return session.scalars(select(CatalogModel).order_by(CatalogModel.name)).all()


def feature_runs(session: Session, model_id: int) -> Sequence[FeatureRun]:
    return session.scalars(
        select(FeatureRun)
        .where(FeatureRun.model_id == model_id)
        .options(selectinload(FeatureRun.corpus))
        .order_by(FeatureRun.id)
    ).all()


def current_run(session: Session, model: CatalogModel) -> FeatureRun | None:
    """The model's current feature run (``service/current.py``), or None before its first."""
    return None if model.current_feature_run_id is None else session.get(FeatureRun, model.current_feature_run_id)


def clustering_with_clusters(session: Session, clustering_id: int) -> Clustering | None:
    return session.scalar(
        select(Clustering).where(Clustering.id == clustering_id).options(selectinload(Clustering.clusters))
    )


def type_counts_by_layer(session: Session, model_id: int, clustering_id: int) -> list[tuple[str, int, str, int]]:
    """``(stack, layer, type, heads)`` for one model in one clustering (layers count within their stack)."""
    rows = session.execute(
        select(Head.stack, Head.layer, Cluster.name, func.count())
        .join(HeadAssignment, (HeadAssignment.model_id == Head.model_id) & (HeadAssignment.head_id == Head.id))
        .join(Cluster, Cluster.id == HeadAssignment.cluster_id)
        .where(Head.model_id == model_id, HeadAssignment.clustering_id == clustering_id)
        .group_by(Head.stack, Head.layer, Cluster.name)
        .order_by(Head.stack, Head.layer, Cluster.name)
    )
    return [(stack, layer, name, count) for stack, layer, name, count in rows]


def shapes(model: CatalogModel) -> dict[Stack, tuple[int, int]]:
    """``{stack: (layers, query heads)}`` of a catalog model, in STACKS order.

    Every model has ``stacks`` since migration 0005 (older rows were filled from their shape);
    a row without it is read as the single stack its ``num_layers x num_heads`` describe.
    """
    stored = model.stacks or {"encoder": {"layers": model.num_layers, "heads": model.num_heads}}
    return {name: (int(stored[name]["layers"]), int(stored[name]["heads"])) for name in STACKS if name in stored}


def model_type_shares(session: Session, model_id: int, clustering_id: int) -> dict[str, int]:
    """Heads of one model per type in a (possibly joint) clustering."""
    counts: dict[str, int] = {}
    for _, _, name, count in type_counts_by_layer(session, model_id, clustering_id):
        counts[name] = counts.get(name, 0) + count
    return counts


def active_jobs_naming(session: Session, name: str) -> list[int]:
    """Queued or running jobs that write to the model ``name`` (ingest, clustering, ablation)."""
    rows = session.scalars(
        select(Job.id).where(
            Job.status.in_(("queued", "running")),
            or_(
                Job.request["name"].astext == name,  # ingest
                and_(Job.kind == "ablation", Job.request["model"].astext == name),
                Job.request["models"].contains([name]),  # clustering (JSONB @>)
            ),
        )
    )
    return list(rows)


def delete(session: Session, model: CatalogModel) -> dict[str, int]:
    """Delete the model with its runs, heads, features, baselines and ablations (by cascade), and
    the clusterings that covered it alone. Joint clusterings keep the other models' types."""
    run_ids = select(FeatureRun.id).where(FeatureRun.model_id == model.id)
    alone = (
        select(clustering_feature_runs.c.clustering_id)
        .group_by(clustering_feature_runs.c.clustering_id)
        .having(func.bool_and(clustering_feature_runs.c.feature_run_id.in_(run_ids)))
    )
    clusterings = session.scalars(delete_(Clustering).where(Clustering.id.in_(alone)).returning(Clustering.id)).all()
    heads = session.scalar(select(func.count()).select_from(Head).where(Head.model_id == model.id)) or 0
    session.execute(delete_(CatalogModel).where(CatalogModel.id == model.id))
    return {"heads": heads, "clusterings": len(clusterings)}
