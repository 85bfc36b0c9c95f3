"""The catalog's tables. Alembic migrations are generated from these classes.

Tables are meant to be read by hand too; the views in the migrations (``head_types``) join
them into one row per head with its type and features by name.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from sqlalchemy import (
    REAL,
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    Double,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_N_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

RunStatus = Literal["queued", "running", "complete", "failed"]


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {
        datetime: DateTime(timezone=True),
        dict[str, Any]: JSONB,
        list[float]: ARRAY(Double),
    }


def _created_at() -> Mapped[datetime]:
    return mapped_column(server_default=func.now())


def _current_run(table: str, lens: str, path: str) -> Mapped[int | None]:
    """A ``current_<lens>_run_id`` column: the run that lens serves (``service/current.py``)."""
    return mapped_column(
        ForeignKey(f"{table}.id", use_alter=True, ondelete="SET NULL"),
        comment=f"the {lens} run served (GET /heads, the views, the page, exports): the latest to complete, "
        f"one chosen with PUT /models/{{name}}/current/{path}, or an imported newer one",
    )


_MODEL_LENSES = ("feature", "detection", "importance", "attribution", "syntax")


class CatalogModel(Base):
    """A transformer model in the catalog, under a unique name."""

    __tablename__ = "models"
    __table_args__ = (
        Index("ix_models_architecture_name", "architecture", "name"),
        Index("ix_models_task_name", "task", "name"),
        Index("ix_models_current_clustering_id", "current_clustering_id"),
        *(Index(f"ix_models_current_{lens}_run_id", f"current_{lens}_run_id") for lens in _MODEL_LENSES),
        UniqueConstraint("series_id", "step"),
        CheckConstraint("(series_id IS NULL) = (step IS NULL)", name="series_step"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    source: Mapped[str] = mapped_column(comment="hub id or local directory it was loaded from")
    revision: Mapped[str | None] = mapped_column(comment="hub commit hash, when known")
    architecture: Mapped[str] = mapped_column(comment="transformers model_type, e.g. bert")
    task: Mapped[str | None] = mapped_column(
        String(32), comment="the model's head: base, sequence-classification, question-answering, causal-lm, ..."
    )
    num_layers: Mapped[int] = mapped_column(comment="layers of the model's first stack (encoder, else decoder)")
    num_heads: Mapped[int] = mapped_column(comment="query heads per layer of the first stack")
    num_key_value_heads: Mapped[int | None] = mapped_column(
        comment="key/value heads per layer (grouped-query attention); NULL when equal to num_heads"
    )
    stacks: Mapped[dict[str, Any]] = mapped_column(
        server_default=text("'{}'::jsonb"), comment="stack -> {layers, heads, kv_heads}: the model's attention stacks"
    )
    current_clustering_id: Mapped[int | None] = mapped_column(
        ForeignKey("clusterings.id", use_alter=True, ondelete="SET NULL")
    )
    # The run each lens serves (service/current.py): set when a run completes, chosen by the user, or imported newer.
    current_feature_run_id: Mapped[int | None] = _current_run("feature_runs", "feature", "features")
    current_detection_run_id: Mapped[int | None] = _current_run("detection_runs", "detection", "detections")
    current_importance_run_id: Mapped[int | None] = _current_run("importance_runs", "importance", "importance")
    current_attribution_run_id: Mapped[int | None] = _current_run("attribution_runs", "attribution", "attribution")
    current_syntax_run_id: Mapped[int | None] = _current_run("syntax_runs", "syntax", "syntax")
    import_id: Mapped[int | None] = mapped_column(ForeignKey("catalog_imports.id", ondelete="SET NULL"))
    series_id: Mapped[int | None] = mapped_column(
        ForeignKey("series.id"), comment="the series this checkpoint is a step of; NULL for a lone model"
    )
    step: Mapped[int | None] = mapped_column(comment="the checkpoint's training step in its series")
    requested_revision: Mapped[str | None] = mapped_column(
        comment="the hub revision asked for (branch, tag or commit, e.g. step1000); revision holds the commit it "
        "resolved to"
    )
    created_at: Mapped[datetime] = _created_at()

    feature_runs: Mapped[list[FeatureRun]] = relationship(
        back_populates="model", lazy="raise", foreign_keys="FeatureRun.model_id"
    )
    catalog_import: Mapped[CatalogImport | None] = relationship(lazy="selectin")
    series_row: Mapped[Series | None] = relationship(lazy="selectin")

    @property
    def series_name(self) -> str | None:
        """The name of the series this model is a step of (None: a lone model)."""
        return None if self.series_row is None else self.series_row.name


class Series(Base):
    """A training run's checkpoints as one ordered set (SPEC 11): each step is a catalog model
    (``models.series_id``, ``models.step``) with the architecture, stacks and tokenizer stored here."""

    __tablename__ = "series"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    architecture: Mapped[str] = mapped_column(comment="transformers model_type every step shares, e.g. gpt2")
    stacks: Mapped[dict[str, Any]] = mapped_column(
        comment="stack -> {layers, heads, kv_heads}: the attention layout every step shares"
    )
    tokenizer_sha256: Mapped[str] = mapped_column(
        String(64), comment="SHA-256 of the tokenizer's vocabulary and special tokens, which every step shares"
    )
    created_at: Mapped[datetime] = _created_at()


class CatalogImport(Base):
    """An archive imported into the catalog (``headcat catalog import``): where from, when, which.

    ``archive_sha256`` is the SHA-256 of the archive's ``manifest.json`` (which holds every
    file's checksum); the same archive with the same renames is imported once.
    """

    __tablename__ = "catalog_imports"
    __table_args__ = (UniqueConstraint("archive_sha256", "renames"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    archive_sha256: Mapped[str] = mapped_column(String(64), comment="SHA-256 of the archive's manifest.json")
    origin: Mapped[str] = mapped_column(comment="where it came from: a directory, hub:<repo>, ...")
    renames: Mapped[dict[str, Any]] = mapped_column(
        server_default=text("'{}'::jsonb"), comment="archive name -> catalog name of the models renamed on import"
    )
    format_version: Mapped[int]
    headcat_version: Mapped[str] = mapped_column(comment="the headcat that exported it")
    exported_at: Mapped[datetime | None]
    models: Mapped[list[str]] = mapped_column(ARRAY(String), comment="catalog names of its models")
    rows: Mapped[int] = mapped_column(BigInteger, comment="rows the archive holds, all files together")
    imported_at: Mapped[datetime] = mapped_column(server_default=func.now())


class Corpus(Base):
    """Where samples came from: a built-in corpus, a file (by content hash) or a hub data set."""

    __tablename__ = "corpora"
    __table_args__ = (UniqueConstraint("kind", "source", "sha256", postgresql_nulls_not_distinct=True),)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str]
    kind: Mapped[str] = mapped_column(comment="builtin | squad | glue | jsonl | text | hub")
    source: Mapped[str]
    sha256: Mapped[str | None]
    created_at: Mapped[datetime] = _created_at()


class FeatureRun(Base):
    """One pass of a corpus through a model; its head features are written with it, at once."""

    __tablename__ = "feature_runs"
    __table_args__ = (
        CheckConstraint("status IN ('running', 'complete', 'failed')", name="status"),
        Index("ix_feature_runs_model_latest", "model_id", "status", "id"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    corpus_id: Mapped[int] = mapped_column(ForeignKey("corpora.id"))
    status: Mapped[str] = mapped_column(String(16))
    num_windows: Mapped[int]
    max_length: Mapped[int]
    samples_requested: Mapped[int | None]
    num_samples: Mapped[int]
    num_tokens: Mapped[int]
    special_tokens: Mapped[dict[str, Any]] = mapped_column(comment="group -> token ids and strings")
    config: Mapped[dict[str, Any]] = mapped_column(comment="the frozen FeatureConfig of the run")
    example_tokens: Mapped[list[str] | None] = mapped_column(ARRAY(String))
    device: Mapped[str]
    dtype: Mapped[str]
    seconds: Mapped[float]
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = _created_at()

    model: Mapped[CatalogModel] = relationship(back_populates="feature_runs", lazy="raise", foreign_keys=[model_id])
    corpus: Mapped[Corpus] = relationship(lazy="raise")


def _of_head(table: str, *index: str) -> tuple[ForeignKeyConstraint, Index]:
    """A head table's composite foreign key to ``heads`` and its per-head index (``model_id`` leads both)."""
    return (
        ForeignKeyConstraint(["model_id", "head_id"], ["heads.model_id", "heads.id"], ondelete="CASCADE"),
        Index(f"ix_{table}_model_id_head_id", "model_id", "head_id", *index),
    )


class Head(Base):
    """One attention head of one model: ``(stack, layer, head)``, 0-based, layers counted within the stack.

    Every head table carries ``model_id`` and leads its primary key with it, the column the
    catalog is distributed by (README, "Scaling out"); ``id`` alone is still unique.
    """

    __tablename__ = "heads"
    __table_args__ = (
        PrimaryKeyConstraint("model_id", "id"),
        Index("ix_heads_id", "id"),
        UniqueConstraint("model_id", "stack", "layer", "head"),
        CheckConstraint("layer >= 0 AND head >= 0", name="position"),
        CheckConstraint("stack IN ('encoder', 'decoder', 'cross')", name="stack"),
    )

    id: Mapped[int] = mapped_column(BigInteger, autoincrement=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    stack: Mapped[str] = mapped_column(
        String(8), comment="encoder (bidirectional self-attention) | decoder (causal self-attention) | cross"
    )
    layer: Mapped[int]
    head: Mapped[int]


class HeadFeatures(Base):
    """A head's corpus-mean distance vector (SPEC section 1) and Clark et al.'s scalars."""

    __tablename__ = "head_features"
    __table_args__ = _of_head("head_features")

    model_id: Mapped[int] = mapped_column(primary_key=True)
    feature_run_id: Mapped[int] = mapped_column(ForeignKey("feature_runs.id", ondelete="CASCADE"), primary_key=True)
    head_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    vector: Mapped[list[float]] = mapped_column(comment="w0..w{N-1}, self, cls, sep, period, comma")
    entropy: Mapped[float] = mapped_column(Double, comment="mean attention entropy, nats")
    prev_token: Mapped[float] = mapped_column(Double)
    next_token: Mapped[float] = mapped_column(Double)
    mean_distance: Mapped[float] = mapped_column(Double)
    sep_to_sep: Mapped[float | None] = mapped_column(Double)
    example_map: Mapped[list[list[float]] | None] = mapped_column(
        ARRAY(REAL, dimensions=2), comment="downsampled attention map of the run's first sample"
    )


clustering_feature_runs = Table(
    "clustering_feature_runs",
    Base.metadata,
    Column("clustering_id", ForeignKey("clusterings.id", ondelete="CASCADE"), primary_key=True),
    Column("feature_run_id", ForeignKey("feature_runs.id", ondelete="CASCADE"), primary_key=True),
)


class Clustering(Base):
    """A clustering of the heads of one or more feature runs (jointly)."""

    __tablename__ = "clusterings"
    __table_args__ = (
        Index("ix_clusterings_current_stability_run_id", "current_stability_run_id"),
        CheckConstraint("status IN ('queued', 'running', 'complete', 'failed')", name="status"),
        CheckConstraint("algorithm IN ('kmeans', 'gmm')", name="algorithm"),
        CheckConstraint("k >= 2", name="k"),
        CheckConstraint("vector IN ('local', 'global')", name="vector"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    algorithm: Mapped[str] = mapped_column(String(16))
    k: Mapped[int]
    seed: Mapped[int]
    num_windows: Mapped[int]
    params: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16))
    num_heads: Mapped[int]
    seconds: Mapped[float | None]
    vector: Mapped[str] = mapped_column(
        String(8),
        server_default="local",
        comment="local: attention features (feature runs) | global: attribution features (attribution runs)",
    )
    current_stability_run_id: Mapped[int | None] = _current_run("stability_runs", "stability", "stability")
    created_at: Mapped[datetime] = _created_at()
    finished_at: Mapped[datetime | None]

    feature_runs: Mapped[list[FeatureRun]] = relationship(secondary=clustering_feature_runs, lazy="raise")
    clusters: Mapped[list[Cluster]] = relationship(back_populates="clustering", lazy="raise", order_by="Cluster.index")


class Cluster(Base):
    """A named cluster (head type) of a clustering."""

    __tablename__ = "clusters"
    __table_args__ = (UniqueConstraint("clustering_id", "index"), UniqueConstraint("clustering_id", "name"))

    id: Mapped[int] = mapped_column(primary_key=True)
    clustering_id: Mapped[int] = mapped_column(ForeignKey("clusterings.id", ondelete="CASCADE"))
    index: Mapped[int]
    name: Mapped[str] = mapped_column(String(64))
    centroid: Mapped[list[float]]
    size: Mapped[int]
    share: Mapped[float] = mapped_column(Double, comment="fraction of the clustering's heads")

    clustering: Mapped[Clustering] = relationship(back_populates="clusters", lazy="raise")


class HeadAssignment(Base):
    """Which cluster a head belongs to in a clustering, with its t-SNE position."""

    __tablename__ = "head_assignments"
    __table_args__ = (
        Index("ix_head_assignments_cluster", "clustering_id", "cluster_id"),
        *_of_head("head_assignments"),
    )

    model_id: Mapped[int] = mapped_column(primary_key=True)
    clustering_id: Mapped[int] = mapped_column(ForeignKey("clusterings.id", ondelete="CASCADE"), primary_key=True)
    head_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    cluster_id: Mapped[int] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"))
    feature_run_id: Mapped[int] = mapped_column(ForeignKey("feature_runs.id", ondelete="CASCADE"))
    tsne_x: Mapped[float | None] = mapped_column(Double)
    tsne_y: Mapped[float | None] = mapped_column(Double)
    margin: Mapped[float | None] = mapped_column(
        Double,
        comment="(d2 - d1) / max(d1, d2): d1 = distance of the head to its own cluster's centroid, d2 = to the "
        "nearest other centroid; 1 on the centroid, 0 exactly between two",
    )


class StabilityRun(Base):
    """Von Luxburg stability of a clustering (SPEC section 3), written whole when it finishes."""

    __tablename__ = "stability_runs"

    id: Mapped[int] = mapped_column(primary_key=True)
    clustering_id: Mapped[int] = mapped_column(ForeignKey("clusterings.id", ondelete="CASCADE"), index=True)
    n_runs: Mapped[int] = mapped_column(comment="R: number of fits on random subsets")
    fraction: Mapped[float] = mapped_column(Double, comment="share of heads in each subset")
    random_state: Mapped[int]
    seeds: Mapped[list[int]] = mapped_column(ARRAY(BigInteger))
    score: Mapped[float] = mapped_column(Double, comment="share of heads with the same label in all R fits")
    num_heads: Mapped[int]
    seconds: Mapped[float] = mapped_column(Double)
    created_at: Mapped[datetime] = _created_at()


class StabilityHead(Base):
    __tablename__ = "stability_heads"
    __table_args__ = (
        ForeignKeyConstraint(["model_id", "head_id"], ["heads.model_id", "heads.id"], ondelete="CASCADE"),
        Index("ix_stability_heads_stability_run_id", "stability_run_id"),  # a joint clustering's run spans models
    )

    model_id: Mapped[int] = mapped_column(primary_key=True)
    stability_run_id: Mapped[int] = mapped_column(ForeignKey("stability_runs.id", ondelete="CASCADE"), primary_key=True)
    head_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    stable: Mapped[bool]
    agreement: Mapped[float | None] = mapped_column(
        Double, comment="share of the run's R fits (aligned to the clustering) that give the head the clustering's type"
    )


JobKind = Literal[
    "ingest",
    "clustering",
    "stability",
    "ablation",
    "attribution",
    "syntax",
    "importance",
    "pruning",
    "detection",
    "catalog_import",
]
JobStatus = Literal["queued", "running", "succeeded", "failed"]


class Job(Base):
    """A unit of work (ingest, clustering, stability, ablation) run by a worker or in-process.

    The job's outcome (a feature run, a clustering, ...) is written in one transaction with
    the job's ``succeeded`` status; until then nothing it produces is visible.
    """

    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint("status IN ('queued', 'running', 'succeeded', 'failed')", name="status"),
        CheckConstraint(
            "kind IN ('ingest', 'clustering', 'stability', 'ablation', 'attribution', 'syntax', 'importance', "
            "'pruning', 'detection', 'catalog_import')",
            name="kind",
        ),
        Index(
            "uq_jobs_active_dedupe_key",
            "dedupe_key",
            unique=True,
            postgresql_where="status IN ('queued', 'running')",
        ),
        Index("ix_jobs_status", "status", "id"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    queue: Mapped[str] = mapped_column(String(16), comment="gpu: runs a model; cpu: analysis")
    status: Mapped[str] = mapped_column(String(16))
    request: Mapped[dict[str, Any]]
    dedupe_key: Mapped[str] = mapped_column(comment="identical requests share it while queued or running")
    procrastinate_job_id: Mapped[int | None] = mapped_column(BigInteger)
    attempts: Mapped[int] = mapped_column(server_default="0")
    progress_done: Mapped[int | None]
    progress_total: Mapped[int | None]
    result: Mapped[dict[str, Any] | None]
    error: Mapped[str | None]
    runner: Mapped[str | None] = mapped_column(comment="worker (host:pid) or in-process")
    created_at: Mapped[datetime] = _created_at()
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]


class AblationBaseline(Base):
    """The unablated metrics of a model on one evaluation set, shared by every ablation run on it.

    Keyed by model, task, the data (``sha256:<file hash>`` or ``hub:<spec>``), the subset of it
    (SQuAD articles, spread sampling), the example limit, the token limit and the dtype.
    """

    __tablename__ = "ablation_baselines"
    __table_args__ = (
        UniqueConstraint(
            "model_id",
            "task",
            "data_key",
            "data_subset",
            "limit",
            "max_length",
            "dtype",
            name="uq_ablation_baselines_key",
            postgresql_nulls_not_distinct=True,
        ),
        CheckConstraint("task IN ('squad', 'glue', 'drift')", name="task"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    task: Mapped[str] = mapped_column(String(16))
    data_key: Mapped[str] = mapped_column(comment="sha256:<hex> of the file, or hub:<spec>")
    data_subset: Mapped[str | None] = mapped_column(comment="e.g. 'articles 24-47', 'spread'")
    limit: Mapped[int | None]
    max_length: Mapped[int]
    dtype: Mapped[str] = mapped_column(String(16))
    n_examples: Mapped[int]
    metrics: Mapped[dict[str, Any]]
    seconds: Mapped[float] = mapped_column(Double, comment="time of the unablated pass that measured it")
    device: Mapped[str]
    created_at: Mapped[datetime] = _created_at()


class AblationRun(Base):
    """One ablation job: a plan of rows run on one model and data set, written whole when it finishes."""

    __tablename__ = "ablation_runs"
    __table_args__ = (
        CheckConstraint("status IN ('running', 'complete', 'failed')", name="status"),
        CheckConstraint("task IN ('squad', 'glue', 'drift')", name="task"),
        Index("ix_ablation_runs_model_latest", "model_id", "id"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    clustering_id: Mapped[int | None] = mapped_column(
        ForeignKey("clusterings.id", ondelete="SET NULL"), comment="the head types; none for head/layer lists only"
    )
    baseline_id: Mapped[int] = mapped_column(ForeignKey("ablation_baselines.id", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(16))
    task: Mapped[str] = mapped_column(String(16))
    data_kind: Mapped[str] = mapped_column(String(16), comment="squad | glue | jsonl | text | builtin | hub")
    data_source: Mapped[str] = mapped_column(comment="absolute file path, builtin:NAME or hub:NAME[:CONFIG][:SPLIT]")
    data_sha256: Mapped[str | None]
    data_subset: Mapped[str | None]
    data_size: Mapped[int] = mapped_column(comment="examples in the data (after the subset), before the limit")
    limit: Mapped[int | None]
    n_examples: Mapped[int] = mapped_column(comment="examples evaluated")
    plan: Mapped[str] = mapped_column(String(16), comment="paper | custom")
    types: Mapped[dict[str, Any]] = mapped_column(comment="head type -> number of the model's heads of it")
    config: Mapped[dict[str, Any]] = mapped_column(comment="the request: batch size, max length, device, ...")
    device: Mapped[str]
    dtype: Mapped[str] = mapped_column(String(16))
    seconds: Mapped[float] = mapped_column(Double, comment="whole plan, model load and tokenization included")
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = _created_at()

    baseline: Mapped[AblationBaseline] = relationship(lazy="raise")
    outcomes: Mapped[list[AblationOutcome]] = relationship(
        back_populates="run", lazy="raise", order_by="AblationOutcome.position"
    )


class AblationOutcome(Base):
    """One plan row's result (Guan et al. Tables 2 and 3), stored beside its baseline."""

    __tablename__ = "ablation_outcomes"
    __table_args__ = (
        UniqueConstraint("run_id", "row_id"),
        UniqueConstraint("run_id", "position"),
        Index("ix_ablation_outcomes_types", "types", postgresql_using="gin"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("ablation_runs.id", ondelete="CASCADE"))
    position: Mapped[int]
    row_id: Mapped[str] = mapped_column(String(200))
    label: Mapped[str]
    paper_ref: Mapped[str | None] = mapped_column(String(32), comment="e.g. T2.3: Guan et al. 2020, Table 2, row 3")
    operations: Mapped[list[str]] = mapped_column(ARRAY(String), comment="operations the row applies")
    selection: Mapped[dict[str, Any]] = mapped_column(comment="operation -> head selection rule")
    spec: Mapped[dict[str, Any]] = mapped_column(comment="the resolved AblationSpec: operation -> [layer, head]")
    types: Mapped[list[str]] = mapped_column(ARRAY(String), comment="head types with at least one ablated head")
    type_ops: Mapped[dict[str, Any]] = mapped_column(comment="head type -> operation -> heads of it ablated")
    heads: Mapped[int] = mapped_column(comment="heads ablated")
    metrics: Mapped[dict[str, Any]]
    baseline: Mapped[dict[str, Any]]
    n_examples: Mapped[int]
    seconds: Mapped[float] = mapped_column(Double)

    run: Mapped[AblationRun] = relationship(back_populates="outcomes", lazy="raise")


class AttributionRun(Base):
    """Gradient attribution of every head of a model (SPEC section 8), written whole when it finishes."""

    __tablename__ = "attribution_runs"
    __table_args__ = (
        CheckConstraint("status IN ('running', 'complete', 'failed')", name="status"),
        CheckConstraint("stack IN ('encoder', 'decoder', 'cross')", name="stack"),
        Index("ix_attribution_runs_model_latest", "model_id", "status", "id"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    corpus_id: Mapped[int] = mapped_column(ForeignKey("corpora.id"))
    status: Mapped[str] = mapped_column(String(16))
    stack: Mapped[str] = mapped_column(String(8))
    num_windows: Mapped[int]
    max_length: Mapped[int]
    samples_requested: Mapped[int]
    num_samples: Mapped[int]
    num_tokens: Mapped[int]
    queries: Mapped[int] = mapped_column(comment="query positions per sample (seeded subsample)")
    probes: Mapped[int] = mapped_column(
        comment=(
            "tangents per input position: P Rademacher probes (scheme forward), the hidden size (exact); "
            "for vjp runs, K probes per (head, query)"
        )
    )
    seed: Mapped[int]
    triples: Mapped[int] = mapped_column(BigInteger, comment="(layer, head, query, tangent) estimates")
    passes: Mapped[int] = mapped_column(
        comment="forward-mode passes, one per input position and tangent; for vjp runs, backward passes"
    )
    layer_discrepancy: Mapped[list[float]] = mapped_column(comment="mean discrepancy of each layer's heads")
    config: Mapped[dict[str, Any]] = mapped_column(comment="the frozen AttributionConfig of the run")
    example_tokens: Mapped[list[str]] = mapped_column(ARRAY(String))
    example_queries: Mapped[list[int]] = mapped_column(ARRAY(BigInteger), comment="rows of the example maps")
    device: Mapped[str]
    dtype: Mapped[str] = mapped_column(String(16))
    seconds: Mapped[float] = mapped_column(Double)
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = _created_at()


class HeadAttribution(Base):
    """A head's global vector (SPEC 1 features of its attribution rows), scalars, discrepancy and example rows."""

    __tablename__ = "head_attributions"
    __table_args__ = _of_head("head_attributions")

    model_id: Mapped[int] = mapped_column(primary_key=True)
    attribution_run_id: Mapped[int] = mapped_column(
        ForeignKey("attribution_runs.id", ondelete="CASCADE"), primary_key=True
    )
    head_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    vector: Mapped[list[float]] = mapped_column(comment="global: w0..w{N-1}, self, cls, sep, period, comma")
    local_vector: Mapped[list[float]] = mapped_column(comment="the same of the attention rows at the same queries")
    entropy: Mapped[float | None] = mapped_column(Double)
    prev_token: Mapped[float | None] = mapped_column(Double)
    next_token: Mapped[float | None] = mapped_column(Double)
    mean_distance: Mapped[float | None] = mapped_column(Double)
    sep_to_sep: Mapped[float | None] = mapped_column(Double)
    discrepancy: Mapped[float] = mapped_column(
        Double, comment="mean total variation between attention and attribution rows"
    )
    example_attention: Mapped[list[list[float]]] = mapped_column(
        ARRAY(REAL, dimensions=2), comment="the first sample's attention rows at example_queries, keys downsampled"
    )
    example_attribution: Mapped[list[list[float]]] = mapped_column(
        ARRAY(REAL, dimensions=2), comment="its attribution rows, the same shape"
    )


class SyntaxRun(Base):
    """Dependency-relation accuracy of every head of a model (SPEC section 9), written whole when it finishes."""

    __tablename__ = "syntax_runs"
    __table_args__ = (
        CheckConstraint("status IN ('running', 'complete', 'failed')", name="status"),
        CheckConstraint("parses IN ('gold', 'silver')", name="parses"),
        Index("ix_syntax_runs_model_latest", "model_id", "status", "id"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(16))
    stack: Mapped[str] = mapped_column(String(8))
    parses: Mapped[str] = mapped_column(String(8), comment="gold (CoNLL-U) | silver (spaCy)")
    source: Mapped[str] = mapped_column(comment="the CoNLL-U file, or the corpus spec parsed by spaCy")
    sha256: Mapped[str | None]
    parser: Mapped[str | None] = mapped_column(comment="spaCy pipeline and version for silver parses")
    num_sentences: Mapped[int]
    num_skipped: Mapped[int] = mapped_column(comment="sentences left out: too long, or a word with no token")
    num_words: Mapped[int]
    config: Mapped[dict[str, Any]]
    device: Mapped[str]
    dtype: Mapped[str] = mapped_column(String(16))
    seconds: Mapped[float] = mapped_column(Double)
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = _created_at()


class SyntaxBaseline(Base):
    """A relation's pair count and best fixed-offset baseline in a syntax run."""

    __tablename__ = "syntax_baselines"

    syntax_run_id: Mapped[int] = mapped_column(ForeignKey("syntax_runs.id", ondelete="CASCADE"), primary_key=True)
    relation: Mapped[str] = mapped_column(String(64), primary_key=True)
    count: Mapped[int] = mapped_column(comment="word pairs with the relation")
    offset: Mapped[int] = mapped_column(comment="the most common head - dependent position offset")
    accuracy: Mapped[float] = mapped_column(Double, comment="share of pairs at that offset")


class HeadSyntax(Base):
    """A head's accuracy for one relation and direction in a syntax run."""

    __tablename__ = "head_syntax_scores"
    __table_args__ = (
        CheckConstraint("direction IN ('dep2head', 'head2dep')", name="direction"),
        Index("ix_head_syntax_scores_relation", "syntax_run_id", "relation", "direction", "accuracy"),
        ForeignKeyConstraint(["model_id", "head_id"], ["heads.model_id", "heads.id"], ondelete="CASCADE"),
    )

    model_id: Mapped[int] = mapped_column(primary_key=True)
    syntax_run_id: Mapped[int] = mapped_column(ForeignKey("syntax_runs.id", ondelete="CASCADE"), primary_key=True)
    head_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    relation: Mapped[str] = mapped_column(String(64), primary_key=True)
    direction: Mapped[str] = mapped_column(String(8), primary_key=True)
    correct: Mapped[int]
    count: Mapped[int]
    accuracy: Mapped[float] = mapped_column(Double)


class DetectionRun(Base):
    """Head detectors (SPEC section 10) of every head of a model, on seeded repeated random sequences,
    written whole when it finishes."""

    __tablename__ = "detection_runs"
    __table_args__ = (
        CheckConstraint("status IN ('running', 'complete', 'failed')", name="status"),
        Index("ix_detection_runs_model_latest", "model_id", "status", "id"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(16))
    config: Mapped[dict[str, Any]] = mapped_column(
        comment="sequences, length, copies, seed, batch_size, thresholds {detector: threshold}, device, dtype"
    )
    sequences: Mapped[dict[str, Any]] = mapped_column(
        comment="ids [[...]] (every sequence, special tokens included), prefix, suffix, prefix_source, pool_size"
    )
    num_sequences: Mapped[int]
    num_tokens: Mapped[int] = mapped_column(comment="tokens per sequence, special tokens included")
    loss_first: Mapped[float | None] = mapped_column(Double, comment="mean next-token loss on the first copy (nats)")
    loss_later: Mapped[float | None] = mapped_column(Double, comment="mean next-token loss on the later copies")
    repeat_gain: Mapped[float | None] = mapped_column(
        Double, comment="loss_first - loss_later; NULL for a model without a causal LM head"
    )
    checks: Mapped[list[dict[str, Any]]] = mapped_column(
        JSONB, comment="the causal check: per role, its heads and the losses and gain with and without them"
    )
    example_tokens: Mapped[dict[str, Any]] = mapped_column(comment="{tokens: [...]}: the first sequence, as tokens")
    example_size: Mapped[int] = mapped_column(
        comment="side of the stored example maps (pooled when the sequence is longer)"
    )
    device: Mapped[str]
    dtype: Mapped[str] = mapped_column(String(16))
    seconds: Mapped[float] = mapped_column(Double)
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = _created_at()


class HeadDetection(Base):
    """A head's four detector scores and roles in a detection run (NULL: no such score on its stack)."""

    __tablename__ = "head_detector_scores"
    __table_args__ = (
        ForeignKeyConstraint(["model_id", "head_id"], ["heads.model_id", "heads.id"], ondelete="CASCADE"),
    )

    model_id: Mapped[int] = mapped_column(primary_key=True)
    detection_run_id: Mapped[int] = mapped_column(ForeignKey("detection_runs.id", ondelete="CASCADE"), primary_key=True)
    head_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    induction: Mapped[float | None] = mapped_column(Double)
    duplicate_token: Mapped[float | None] = mapped_column(Double)
    previous_token: Mapped[float | None] = mapped_column(Double)
    sink: Mapped[float | None] = mapped_column(Double)
    roles: Mapped[list[str]] = mapped_column(
        ARRAY(String(16)), comment="detectors whose score reaches the run's threshold"
    )
    example_map: Mapped[list[float]] = mapped_column(
        ARRAY(REAL), comment="the first sequence's map, row-major, example_size x example_size"
    )


class ApiKey(Base):
    """A key for the REST API's writes (and its reads, when they are closed).

    Only the SHA-256 of the secret is stored; the secret itself is shown once, when it is made.
    """

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), comment="who or what holds it")
    prefix: Mapped[str] = mapped_column(String(16), comment="the secret's first characters, to recognise it")
    key_hash: Mapped[str] = mapped_column(String(64), unique=True, comment="hex SHA-256 of the whole secret")
    created_at: Mapped[datetime] = _created_at()
    last_used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]


class ImportanceRun(Base):
    """One importance job (SPEC 7): every head's score on one model, loss and data, written whole."""

    __tablename__ = "importance_runs"
    __table_args__ = (
        CheckConstraint("status IN ('running', 'complete', 'failed')", name="status"),
        CheckConstraint("loss IN ('task', 'lm', 'sensitivity')", name="loss"),
        Index("ix_importance_runs_model_latest", "model_id", "id"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(16))
    loss: Mapped[str] = mapped_column(String(16), comment="task | lm | sensitivity")
    task: Mapped[str | None] = mapped_column(String(16), comment="squad | glue (task loss); NULL otherwise")
    data_kind: Mapped[str] = mapped_column(String(16))
    data_source: Mapped[str]
    data_sha256: Mapped[str | None]
    data_subset: Mapped[str | None]
    data_size: Mapped[int]
    limit: Mapped[int | None]
    n_examples: Mapped[int] = mapped_column(comment="examples scored (SQuAD: windows)")
    seed: Mapped[int] = mapped_column(comment="MLM mask / Rademacher probes")
    mean_loss: Mapped[float | None] = mapped_column(Double, comment="mean per-example loss; NULL for sensitivity")
    config: Mapped[dict[str, Any]]
    device: Mapped[str]
    dtype: Mapped[str] = mapped_column(String(16))
    seconds: Mapped[float] = mapped_column(Double)
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = _created_at()


class ImportanceScore(Base):
    """One head's score in one importance run: raw, and normalised by its layer's L2 norm (Michel)."""

    __tablename__ = "importance_scores"
    __table_args__ = _of_head("importance_scores", "run_id")

    model_id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("importance_runs.id", ondelete="CASCADE"), primary_key=True)
    head_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    raw: Mapped[float] = mapped_column(Double, comment="mean over examples of |dLoss/dxi_h|")
    normalized: Mapped[float] = mapped_column(Double, comment="raw / L2 norm of its layer's raw scores")


class PruningCurve(Base):
    """One pruning-curve job: a curve per ranking, every point against the one shared baseline."""

    __tablename__ = "pruning_curves"
    __table_args__ = (
        CheckConstraint("status IN ('running', 'complete', 'failed')", name="status"),
        CheckConstraint("task IN ('squad', 'glue', 'drift')", name="task"),
        Index("ix_pruning_curves_model_latest", "model_id", "id"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    baseline_id: Mapped[int] = mapped_column(ForeignKey("ablation_baselines.id", ondelete="CASCADE"))
    importance_run_id: Mapped[int | None] = mapped_column(
        ForeignKey("importance_runs.id", ondelete="SET NULL"), comment="the scores the importance rankings used"
    )
    clustering_id: Mapped[int | None] = mapped_column(
        ForeignKey("clusterings.id", ondelete="SET NULL"), comment="the head types of the type ranking"
    )
    status: Mapped[str] = mapped_column(String(16))
    task: Mapped[str] = mapped_column(String(16))
    metric: Mapped[str] = mapped_column(String(32), comment="the metric the curves are drawn in")
    rankings: Mapped[list[str]] = mapped_column(ARRAY(String))
    iterative: Mapped[bool]
    steps: Mapped[int]
    max_share: Mapped[float] = mapped_column(Double)
    seed: Mapped[int] = mapped_column(comment="the random ranking's seed")
    type_order: Mapped[list[str]] = mapped_column(ARRAY(String), comment="types pruned first to last")
    orders: Mapped[dict[str, Any]] = mapped_column(comment="ranking -> [[layer, head], ...] in the order pruned")
    baseline: Mapped[dict[str, Any]] = mapped_column(
        comment="the shared unpruned metrics every point is measured against"
    )
    data_kind: Mapped[str] = mapped_column(String(16))
    data_source: Mapped[str]
    data_sha256: Mapped[str | None]
    data_subset: Mapped[str | None]
    data_size: Mapped[int]
    limit: Mapped[int | None]
    n_examples: Mapped[int]
    config: Mapped[dict[str, Any]]
    device: Mapped[str]
    dtype: Mapped[str] = mapped_column(String(16))
    seconds: Mapped[float] = mapped_column(Double)
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = _created_at()

    points: Mapped[list[PruningPoint]] = relationship(
        back_populates="curve", lazy="raise", order_by="(PruningPoint.ranking, PruningPoint.step)"
    )


class PruningPoint(Base):
    """One point of one ranking's curve: the metrics with ``pruned`` heads removed."""

    __tablename__ = "pruning_points"
    __table_args__ = (UniqueConstraint("curve_id", "ranking", "step"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    curve_id: Mapped[int] = mapped_column(ForeignKey("pruning_curves.id", ondelete="CASCADE"))
    ranking: Mapped[str] = mapped_column(String(32))
    step: Mapped[int] = mapped_column(comment="0 is the shared baseline")
    pruned: Mapped[int] = mapped_column(comment="heads pruned")
    share: Mapped[float] = mapped_column(Double, comment="of all the model's heads")
    metrics: Mapped[dict[str, Any]]
    heads: Mapped[list[Any]] = mapped_column(JSONB, comment="[[layer, head], ...] pruned at this point")
    seconds: Mapped[float] = mapped_column(Double)

    curve: Mapped[PruningCurve] = relationship(back_populates="points", lazy="raise")
