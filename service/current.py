"""Which run a model serves, per lens: one rule, in one place.

A *lens* is one kind of result about a model's heads: its features, detections, importance,
attribution and syntax runs (a model's own), the stability runs of a clustering, and the
clustering that gives its heads their types. Each has a *current* run, stored in the catalog
(``models.current_<lens>_run_id``, ``models.current_clustering_id``, and for stability
``clusterings.current_stability_run_id``, since a stability run belongs to a clustering that may
span models); every read (``GET /heads``, the lens endpoints, the SQL views, exports, the page)
serves that run and no other. The rule that sets it:

- a run becomes current when its job completes (:func:`completed`, in the job's own transaction);
- the user can make another complete run of the model current (:func:`choose`:
  ``PUT /models/{name}/current/{lens}``, ``headcat current``);
- an import makes a model it creates (a clustering, for stability) serve the run its source catalog
  served, as the archive says (format 3 on); any other imported run becomes current only when it is
  newer, by its own ``created_at`` (ties by id), than the current one (:func:`imported_runs` before
  the write, :func:`after_import` after it); the import reports which became current and which did
  not, and by which of the two rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Table, any_, bindparam, cast, func, null, select, text, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session

from service.errors import Conflict, InvalidInput, NotFound
from service.orm import (
    AttributionRun,
    Base,
    CatalogModel,
    Clustering,
    DetectionRun,
    FeatureRun,
    ImportanceRun,
    StabilityRun,
    SyntaxRun,
    clustering_feature_runs,
)


@dataclass(frozen=True)
class Lens:
    name: str  # as the API and the CLI spell it
    run: type[Base]  # the run's table
    column: str  # the column holding the current run: on models, or on clusterings for stability
    noun: str  # "feature run", for messages
    command: str  # how to make one


LENSES: dict[str, Lens] = {
    lens.name: lens
    for lens in (
        Lens("features", FeatureRun, "current_feature_run_id", "feature run", "headcat ingest"),
        Lens("clustering", Clustering, "current_clustering_id", "clustering", "headcat cluster"),
        Lens("stability", StabilityRun, "current_stability_run_id", "stability run", "headcat stability"),
        Lens("importance", ImportanceRun, "current_importance_run_id", "importance run", "headcat importance"),
        Lens("attribution", AttributionRun, "current_attribution_run_id", "attribution run", "headcat attribute"),
        Lens("syntax", SyntaxRun, "current_syntax_run_id", "syntax run", "headcat syntax"),
        Lens("detections", DetectionRun, "current_detection_run_id", "detection run", "headcat detect"),
    )
}
BY_RUN: dict[type[Base], Lens] = {lens.run: lens for lens in LENSES.values()}
# The lenses an import decides (the clustering keeps its own rule: a new model takes the archive's).
IMPORTED = ("features", "stability", "importance", "attribution", "syntax", "detections")


def lens_named(name: str, field: str = "lens") -> Lens:
    lens = LENSES.get(name)
    if lens is None:
        raise InvalidInput(f"{field}: no lens {name!r}; lenses: {', '.join(LENSES)}", field=field)
    return lens


def completed(session: Session, run: Any) -> None:
    """``run`` (flushed, complete) becomes the current one of its lens: of its model, or for a stability run of
    its clustering. Called by each job in the transaction that writes the run."""
    lens = BY_RUN[type(run)]
    if isinstance(run, StabilityRun):
        session.execute(update(Clustering).where(Clustering.id == run.clustering_id).values({lens.column: run.id}))
    else:
        session.execute(update(CatalogModel).where(CatalogModel.id == run.model_id).values({lens.column: run.id}))


def current_runs(session: Session, model: CatalogModel) -> dict[str, int | None]:
    """lens -> the id of the run the model serves (None: none yet); stability is that of its current clustering."""
    found: dict[str, int | None] = {name: getattr(model, lens.column, None) for name, lens in LENSES.items()}
    found["stability"] = (
        None
        if model.current_clustering_id is None
        else session.scalar(
            select(Clustering.current_stability_run_id).where(Clustering.id == model.current_clustering_id)
        )
    )
    return found


def current_run(session: Session, model: CatalogModel, lens: str) -> Any | None:
    """The model's current run of a model lens (``features``, ``importance``, ...), or None."""
    run_id = getattr(model, LENSES[lens].column)
    return None if run_id is None else session.get(LENSES[lens].run, run_id)


def _models_of_clustering(session: Session, clustering_id: int) -> list[int]:
    return list(
        session.scalars(
            select(FeatureRun.model_id)
            .join(clustering_feature_runs, clustering_feature_runs.c.feature_run_id == FeatureRun.id)
            .where(clustering_feature_runs.c.clustering_id == clustering_id)
            .distinct()
        )
    )


def choose(session: Session, model: CatalogModel, lens_name: str, run_id: int) -> dict[str, int | None]:
    """Make run ``run_id`` the model's current run of ``lens_name``; refused (404, 409, 422) with the reason when
    the run is unknown, of another model, not complete, or (a clustering) of the global vectors."""
    lens = lens_named(lens_name)
    run: Any = session.get(lens.run, run_id)  # a row of the lens's run table: each has an id and a status
    if run is None:
        raise NotFound(f"run_id: no {lens.noun} with id {run_id}", field="run_id")
    if isinstance(run, Clustering | StabilityRun):
        clustering = run if isinstance(run, Clustering) else session.get_one(Clustering, run.clustering_id)
        if model.id not in _models_of_clustering(session, clustering.id):
            what = (f"clustering {run_id}" if run is clustering
                    else f"stability run {run_id} is of clustering {clustering.id}, which")  # fmt: skip
            raise Conflict(f"run_id: {what} does not cover {model.name!r}", field="run_id")
        if clustering.status != "complete":
            raise Conflict(f"run_id: clustering {clustering.id} is {clustering.status}, not complete", field="run_id")
        if isinstance(run, Clustering):
            if run.vector == "global":
                raise Conflict(f"run_id: clustering {run_id} clusters the global (attribution) vectors; a model's "
                               "types are those of a clustering of its attention (vector local)",
                               field="run_id")  # fmt: skip
            model.current_clustering_id = run.id
        else:
            clustering.current_stability_run_id = run.id
    else:
        if run.model_id != model.id:
            owner = session.get_one(CatalogModel, run.model_id).name
            raise Conflict(f"run_id: {lens.noun} {run_id} is of {owner!r}, not of {model.name!r}", field="run_id")
        if run.status != "complete":
            raise Conflict(f"run_id: {lens.noun} {run_id} is {run.status}, not complete", field="run_id")
        setattr(model, lens.column, run.id)
    session.flush()
    return current_runs(session, model)


# --- imports ---------------------------------------------------------------------------------------


def imported_runs(session: Session, small: dict[str, list[dict[str, Any]]],
                  renames: dict[str, str]) -> set[tuple[str, int]]:  # fmt: skip
    """``{(lens, run id)}`` of the archive's runs (``small``: its run files, read whole) found in the catalog.

    Called before an import writes (the runs it already had) and after it (those plus the ones it wrote):
    a run is matched by its model (after ``renames``) and its key, as the importer matches it.
    """
    from service.catalogs.tables import RUN_KEYS, RUNS, run_key

    found: set[tuple[str, int]] = set()
    for name in IMPORTED:
        table = LENSES[name].run.__tablename__
        key_column, scope = RUNS[table]
        rows = small.get(table, [])
        if not rows:
            continue
        key = run_key("r", *RUN_KEYS[table])
        pairs = "IN (SELECT * FROM unnest(CAST(:scopes AS text[]), CAST(:keys AS text[])))"
        if scope == "model":
            sql = (f"SELECT r.id FROM {table} r JOIN models m ON m.id = r.model_id "
                   f"WHERE m.name = ANY(CAST(:scopes AS text[])) AND (m.name, {key}) {pairs}")  # fmt: skip
            scopes = [renames.get(row["model"], row["model"]) for row in rows]
        else:  # a stability run: its clustering's key and its own
            clustering = run_key("c", *RUN_KEYS["clusterings"])
            sql = (f"SELECT r.id FROM stability_runs r JOIN clusterings c ON c.id = r.clustering_id "
                   f"WHERE ({clustering}, {key}) {pairs}")  # fmt: skip
            scopes = [row["clustering"] for row in rows]
        ids = session.scalars(text(sql), {"scopes": scopes, "keys": [row[key_column] for row in rows]})
        found.update((name, int(i)) for i in ids)
    return found


def _ids(values: list[int]) -> Any:
    """``values`` as one bound ``bigint[]`` parameter (any number of ids, not one parameter each)."""
    return cast(bindparam(None, values, type_=ARRAY(BigInteger)), ARRAY(BigInteger))


def _set_current(
    session: Session, holder: type[CatalogModel | Clustering], column: str, winners: dict[int, int]
) -> None:
    """``holder.column = run`` for each ``{holder id: run id}`` of ``winners``, in one statement; holders the
    session has loaded are expired, so that they read the new value."""
    if not winners:
        return
    session.flush()
    table = holder.__table__
    assert isinstance(table, Table)  # a mapped class's own table, not a join or a subquery
    pairs = (
        func.unnest(_ids(list(winners)), _ids(list(winners.values())))
        .table_valued("holder_id", "run_id")
        .render_derived(name="w")
    )
    session.execute(
        update(table).where(table.c.id == pairs.c.holder_id).values({column: pairs.c.run_id}),
        execution_options={"synchronize_session": False},
    )
    for obj in list(session.identity_map.values()):
        if isinstance(obj, holder) and obj.id in winners:
            session.expire(obj, [column])


def after_import(session: Session, before: set[tuple[str, int]], after: set[tuple[str, int]],
                 served: set[tuple[str, int]] | None = None) -> dict[str, Any]:  # fmt: skip
    """Decide which of the runs an import wrote (``after - before``) become current, and say so.

    Per model (or clustering) and lens: a run of ``served`` (the runs the archive's source catalog served, of the
    models and clusterings the import created) becomes current (``by: source``); else the newest imported run
    by ``(created_at, id)`` does when there is none yet or it is newer than the current one (``by: newest``);
    the others stay as they are.
    """
    became: list[dict[str, Any]] = []
    not_current: list[dict[str, Any]] = []
    for name in IMPORTED:
        lens = LENSES[name]
        ids = sorted(i for lens_name, i in after - before if lens_name == name)
        if not ids:
            continue
        run: Any = lens.run
        stability = run is StabilityRun
        owner = "clustering_id" if stability else "model_id"
        holder: type[CatalogModel | Clustering] = Clustering if stability else CatalogModel
        runs = session.execute(select(run.id, getattr(run, owner), run.created_at).where(run.id.in_(ids))).all()
        by_owner: dict[int, list[tuple[datetime, int]]] = {}
        for run_id, owner_id, created_at in runs:
            by_owner.setdefault(owner_id, []).append((created_at, run_id))
        # The holders' names and current runs in one query, and the winners written by one UPDATE per lens:
        # no ORM object per model, no UPDATE per model.
        current = getattr(holder, lens.column)
        name_column = null() if stability else CatalogModel.name
        holders = {
            int(r.id): r
            for r in session.execute(
                select(
                    holder.id,
                    name_column.label("name"),
                    current.label("current_id"),
                    run.created_at.label("current_at"),
                )
                .outerjoin(run, run.id == current)
                .where(holder.id == any_(_ids(list(by_owner))))
            )
        }
        winners: dict[int, int] = {}
        for owner_id, imported in sorted(by_owner.items()):
            row = holders[owner_id]
            where = {"clustering_id": owner_id} if stability else {"model": row.name}
            current_id = row.current_id
            chosen = [pair for pair in imported if (name, pair[1]) in (served or set())]
            if chosen:
                winner: tuple[datetime, int] | None = chosen[0]
                by = "source"
            else:
                current_key = (row.current_at, current_id) if current_id is not None else None
                newest = max(imported)
                winner = newest if current_key is None or newest > current_key else None
                by = "newest"
            if winner is not None:
                winners[owner_id] = winner[1]
            for created_at, run_id in sorted(imported):
                entry = {"lens": name, **where, "run_id": run_id, "created_at": created_at.isoformat(), "by": by}
                if winner is not None and run_id == winner[1]:
                    became.append({**entry, "replaced": current_id})
                else:
                    kept = winner[1] if winner is not None else current_id
                    not_current.append({**entry, "current_run_id": kept})
        _set_current(session, holder, lens.column, winners)
    session.flush()
    return {"became_current": became, "not_current": not_current}
