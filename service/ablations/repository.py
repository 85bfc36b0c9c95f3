"""SQL for ablations: head types of a model in a clustering, stored baselines, runs and outcomes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session, selectinload

from ingest.types import Stack
from service.orm import (
    AblationBaseline,
    AblationOutcome,
    AblationRun,
    CatalogModel,
    Cluster,
    Clustering,
    Head,
    HeadAssignment,
)


def assignments(session: Session, model_id: int, clustering_id: int) -> dict[tuple[Stack, int, int], str]:
    """``{(stack, layer, head): cluster name}`` for the model's heads in the clustering (empty if none)."""
    rows = session.execute(
        select(Head.stack, Head.layer, Head.head, Cluster.name)
        .join(HeadAssignment, (HeadAssignment.model_id == Head.model_id) & (HeadAssignment.head_id == Head.id))
        .join(Cluster, Cluster.id == HeadAssignment.cluster_id)
        .where(Head.model_id == model_id, HeadAssignment.clustering_id == clustering_id)
    )
    return {(cast(Stack, stack), layer, head): name for stack, layer, head, name in rows}


def clustered_models(session: Session, clustering_id: int) -> list[str]:
    """Names of the models a clustering has heads of."""
    return list(
        session.scalars(
            select(CatalogModel.name)
            .join(Head, Head.model_id == CatalogModel.id)
            .join(HeadAssignment, (HeadAssignment.model_id == Head.model_id) & (HeadAssignment.head_id == Head.id))
            .where(HeadAssignment.clustering_id == clustering_id)
            .distinct()
            .order_by(CatalogModel.name)
        )
    )


def get_clustering(session: Session, clustering_id: int) -> Clustering | None:
    return session.get(Clustering, clustering_id)


def baseline_id(session: Session, values: dict[str, Any]) -> tuple[int, bool]:
    """The stored baseline for ``values``' key, inserting it when new; returns (id, created)."""
    created = session.scalar(
        pg_insert(AblationBaseline).values(**values).on_conflict_do_nothing().returning(AblationBaseline.id)
    )
    if created is not None:
        return created, True
    found = session.scalar(
        select(AblationBaseline.id).where(
            AblationBaseline.model_id == values["model_id"],
            AblationBaseline.task == values["task"],
            AblationBaseline.data_key == values["data_key"],
            AblationBaseline.data_subset.is_not_distinct_from(values["data_subset"]),
            AblationBaseline.limit.is_not_distinct_from(values["limit"]),
            AblationBaseline.max_length == values["max_length"],
            AblationBaseline.dtype == values["dtype"],
        )
    )
    assert found is not None
    return found, False


def get_baseline(session: Session, baseline_id: int) -> AblationBaseline:
    return session.get_one(AblationBaseline, baseline_id)


def _runs_query() -> Any:
    return select(AblationRun).options(selectinload(AblationRun.baseline), selectinload(AblationRun.outcomes))


def runs(
    session: Session, model_id: int, *, task: str | None = None, limit: int = 20, offset: int = 0
) -> Sequence[AblationRun]:
    """A model's ablation runs with baselines and outcomes, newest first."""
    stmt = _runs_query().where(AblationRun.model_id == model_id).order_by(AblationRun.id.desc())
    if task is not None:
        stmt = stmt.where(AblationRun.task == task)
    return session.scalars(stmt.limit(limit).offset(offset)).all()


def get_run(session: Session, run_id: int) -> AblationRun | None:
    return session.scalar(_runs_query().where(AblationRun.id == run_id))


def known_types(session: Session, model_id: int) -> list[str]:
    """Head types named in any of the model's ablation runs."""
    rows = session.scalars(select(AblationRun.types).where(AblationRun.model_id == model_id))
    return sorted({name for types in rows for name in types})


def outcome_ids_with_type(session: Session, run_ids: Sequence[int], type_name: str) -> set[int]:
    """Outcomes of these runs that ablate at least one head of ``type_name``."""
    return set(
        session.scalars(
            select(AblationOutcome.id).where(
                AblationOutcome.run_id.in_(run_ids), AblationOutcome.types.contains([type_name])
            )
        )
    )


def model_name(session: Session, model_id: int) -> str:
    return session.get_one(CatalogModel, model_id).name
