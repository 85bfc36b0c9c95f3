"""The catalog archive's files: one Parquet file per table, grouped in families, and the SQL that reads each.

Every file is self-describing: a model is its name, a head is ``(model, stack, layer, head)``,
and a run is its model and its *key*: the MD5 of the run's own columns (``to_jsonb`` of its row
without ids and foreign keys), the same in every catalog that holds the run. A clustering's key
alone names it (a joint clustering spans models). Columns are named as in the SQL views
(``head_types``, ``head_importance``, ``head_attribution``, ``head_syntax``); JSON columns hold
JSON text. Only complete runs are exported.

A new family is one more :class:`Table` entry in :data:`TABLES` with its export SQL (and ``since``, the
format version that added it; a per-head file also its :class:`Rows`), its run in :data:`RUNS` and
:data:`RUN_KEYS`, its references and checks, and its inserts in :mod:`service.catalogs.importer`
(``_write_tables``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from ingest.types import ROLES

# 2 (issue 26 follow-up): head_types.margin, stability_heads.agreement and the detections family
# (detection_runs, head_detections). 3: the runs the catalog serves (models.current_feature_run ...,
# clusterings.current_stability_run). 4 (issue 34): series (the series file; models.series, step,
# requested_revision). Older archives still import: a column or file that came with a
# later version than the archive's is absent there, and read as null (columns) or empty (files).
FORMAT_VERSION = 4

TIMESTAMP = pa.timestamp("us", tz="UTC")
JSON = pa.string()  # JSON text
FLOATS = pa.list_(pa.float64())
STRINGS = pa.list_(pa.string())
INTS = pa.list_(pa.int64())
MAP = pa.list_(pa.list_(pa.float32()))
FLAT_MAP = pa.list_(pa.float32())  # a square map, row-major
NUM_WINDOW_COLUMNS = 16  # w0..w15, as in the views
DETECTORS = ROLES  # the head detectors' scores, in the order of ingest.detectors.DETECTORS


def run_key(alias: str, *foreign: str) -> str:
    """SQL for a run's key: the MD5 of its own columns (its row without ``id`` and ``foreign``)."""
    dropped = ", ".join(f"'{column}'" for column in ("id", *foreign))
    return f"md5((to_jsonb({alias}) - ARRAY[{dropped}]::text[])::text)"


# Each run table's key, and the foreign keys left out of it.
RUN_KEYS: dict[str, tuple[str, ...]] = {
    "feature_runs": ("model_id", "corpus_id"),
    "clusterings": ("current_stability_run_id",),  # which of its runs this catalog serves: not the clustering's own
    "stability_runs": ("clustering_id",),
    "ablation_baselines": ("model_id",),
    "ablation_runs": ("model_id", "clustering_id", "baseline_id"),
    "importance_runs": ("model_id",),
    "pruning_curves": ("model_id", "baseline_id", "importance_run_id", "clustering_id"),
    "attribution_runs": ("model_id", "corpus_id"),
    "syntax_runs": ("model_id",),
    "detection_runs": ("model_id",),
}

# run file -> (its key column, the scope column that with the key names a run: model, or clustering)
RUNS: dict[str, tuple[str, str | None]] = {
    "feature_runs": ("feature_run", "model"), "clusterings": ("clustering", None),
    "stability_runs": ("stability_run", "clustering"), "ablation_baselines": ("ablation_baseline", "model"),
    "ablation_runs": ("ablation_run", "model"), "importance_runs": ("importance_run", "model"),
    "pruning_curves": ("pruning_curve", "model"), "attribution_runs": ("attribution_run", "model"),
    "syntax_runs": ("syntax_run", "model"), "detection_runs": ("detection_run", "model"),
}  # fmt: skip


# run file -> the models file's column holding the key of the run each model serves (the clusterings file's,
# for a stability run: a clustering's own current run)
CURRENT: dict[str, str] = {
    table: f"current_{RUNS[table][0]}"
    for table in ("feature_runs", "stability_runs", "importance_runs", "attribution_runs", "syntax_runs",
                  "detection_runs")
}  # fmt: skip


def _current(table: str, holder: str, column: str) -> str:
    """SQL for the key of the run ``holder.column`` names (null: none, or not complete, so not exported)."""
    complete = "" if table == "stability_runs" else " AND x.status = 'complete'"
    return f"(SELECT {run_key('x', *RUN_KEYS[table])} FROM {table} x WHERE x.id = {holder}.{column}{complete})"


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    sql: str  # the expression that exports it
    nullable: bool = False
    since: int = 1  # the format version that added it: older archives lack it (read as null)


@dataclass(frozen=True)
class Lookup:
    """Columns of a per-head file that hold one value per run (or clustering, model, cluster): read once from a
    small query instead of joined to every row. ``id`` is the per-head table's column naming the row's run (or
    clustering ...); ``sql`` gives that id, the models whose heads it holds (``int[]``, read from a file's first
    lookup: it scopes the parts of the file's COPYs) and the values of ``columns`` in order, with the ids in the
    file's order where ``ordered``."""

    id: str
    sql: str
    columns: tuple[str, ...]
    ordered: bool = True


@dataclass(frozen=True)
class Rows:
    """How a per-head file is read at the speed of a COPY (service.catalogs.export): ``table``'s rows with their
    ids; each head's stack, layer and head from its id where its model's heads are a grid in order, otherwise
    joined; the lookups' columns attached by id on the client, and the rows put in the file's order there by the
    ordered lookups' ranks and the heads (a stable sort, after ``then`` on the server). The file is the same as its
    table's :meth:`Table.select` (tests/service/test_catalog_copy.py)."""

    table: str
    lookups: tuple[Lookup, ...]  # the first: the run (or clustering) a part of the file's COPYs selects
    then: str = ""  # what orders a head's rows after the head (head_syntax: relation, direction)


@dataclass(frozen=True)
class Table:
    name: str  # the file is NAME.parquet
    family: str
    description: str
    columns: tuple[Column, ...]
    source: str  # FROM ... WHERE ... ORDER BY ..., with :models (model ids) and :clusterings (clustering ids)
    rows: Rows | None = None  # one row per head (per run): streamed, read as Rows says
    since: int = 1  # the format version that added it: older archives lack the file (read as empty)

    @property
    def file(self) -> str:
        return f"{self.name}.parquet"

    @property
    def per_head(self) -> bool:
        return self.rows is not None

    @property
    def schema(self) -> pa.Schema:
        return pa.schema([pa.field(c.name, c.type, nullable=c.nullable) for c in self.columns])

    def select(self) -> str:
        return "SELECT " + ", ".join(f'{c.sql} AS "{c.name}"' for c in self.columns) + "\n" + self.source


def c(name: str, type: pa.DataType, sql: str | None = None, *, null: bool = False, since: int = 1) -> Column:
    return Column(name, type, sql if sql is not None else name, null, since)


S, I64, F64, BOOL = pa.string(), pa.int64(), pa.float64(), pa.bool_()
HEAD = (c("stack", S, "h.stack"), c("layer", I64, "h.layer"), c("head", I64, "h.head"))
# The exported models named on heads too: a part of the export (some models) then reads their heads by index, not
# every head of the catalog.
HEAD_JOIN = "JOIN heads h ON h.model_id = x.model_id AND h.id = x.head_id AND h.model_id = ANY(:models)"
SCALARS = (
    c("entropy", F64, "x.entropy"), c("prev_token", F64, "x.prev_token"), c("next_token", F64, "x.next_token"),
    c("mean_distance", F64, "x.mean_distance"), c("sep_to_sep", F64, "x.sep_to_sep", null=True),
)  # fmt: skip
SPECIALS = ("self", "cls", "sep", "period", "comma")


def _runs(table: str, alias: str = "r", where: str = "r.model_id = ANY(:models)") -> str:
    """A subquery of the table's runs with their keys; ``OFFSET 0`` keeps the planner from pulling it
    up into the per-head join, which would compute a run's key once per head instead of once."""
    return f"SELECT {alias}.*, {run_key(alias, *RUN_KEYS[table])} AS key FROM {table} {alias} WHERE {where} OFFSET 0"


def _by_run(table: str, key: str, *values: str) -> Lookup:
    """A per-run file's runs (complete, of the exported models) in its order: model name, start, key; with the
    model's name, the run's key and ``values`` (more of the run's columns)."""
    runs = _runs(table, where="r.model_id = ANY(:models) AND r.status = 'complete'")
    extra = "".join(f", r.{v}" for v in values)
    return Lookup(
        f"x.{RUN_ID[table]}",
        f"""SELECT r.id, ARRAY[r.model_id] AS models, m.name, r.key{extra}
FROM ({runs}) r JOIN models m ON m.id = r.model_id ORDER BY m.name, r.started_at, r.key""",
        ("model", key, *values),
    )


# The per-head tables' column naming their run.
RUN_ID = {
    "feature_runs": "feature_run_id", "importance_runs": "run_id", "attribution_runs": "attribution_run_id",
    "syntax_runs": "syntax_run_id", "detection_runs": "detection_run_id",
}  # fmt: skip
# The models of a clustering (by its id, ``{clustering}``), as the first lookup of a per-clustering file gives them.
_CLUSTERED = """(SELECT array_agg(DISTINCT f.model_id) FROM clustering_feature_runs cf
        JOIN feature_runs f ON f.id = cf.feature_run_id WHERE cf.clustering_id = {clustering})"""
BY_MODEL = Lookup(
    "x.model_id", "SELECT m.id, NULL::int[], m.name FROM models m WHERE m.id = ANY(:models) ORDER BY m.name", ("model",)
)


def _data(prefix: str = "r.") -> tuple[Column, ...]:
    return (
        c("data_kind", S, f"{prefix}data_kind"), c("data_source", S, f"{prefix}data_source"),
        c("data_sha256", S, f"{prefix}data_sha256", null=True), c("data_subset", S, f"{prefix}data_subset", null=True),
        c("data_size", I64, f"{prefix}data_size"), c("limit", I64, f'{prefix}"limit"', null=True),
    )  # fmt: skip


def _provenance(prefix: str = "r.") -> tuple[Column, ...]:
    return (
        c("device", S, f"{prefix}device"), c("dtype", S, f"{prefix}dtype"), c("seconds", F64, f"{prefix}seconds"),
        c("started_at", TIMESTAMP, f"{prefix}started_at"),
        c("finished_at", TIMESTAMP, f"{prefix}finished_at", null=True),
        c("created_at", TIMESTAMP, f"{prefix}created_at"),
    )  # fmt: skip


_CORPUS = (
    c("corpus", S, "co.name"), c("corpus_kind", S, "co.kind"), c("corpus_source", S, "co.source"),
    c("corpus_sha256", S, "co.sha256", null=True),
)  # fmt: skip

TABLES: tuple[Table, ...] = (
    Table(
        "models",
        "models",
        "one row per model: its source (hub id and commit, or a local directory), shape, stacks",
        (
            c("model", S, "m.name"),
            c("source", S, "m.source"),
            c("revision", S, "m.revision", null=True),
            c("architecture", S, "m.architecture"),
            c("task", S, "m.task", null=True),
            c("num_layers", I64, "m.num_layers"),
            c("num_heads", I64, "m.num_heads"),
            c("num_key_value_heads", I64, "m.num_key_value_heads", null=True),
            c("stacks", JSON, "m.stacks::text"),
            c("current_clustering", S, "cl.key", null=True),
            c("created_at", TIMESTAMP, "m.created_at"),
            *(
                c(CURRENT[table], S, _current(table, "m", f"{CURRENT[table]}_id"), null=True, since=3)
                for table in CURRENT
                if table != "stability_runs"
            ),
            c("series", S, "se.name", null=True, since=4),
            c("step", I64, "m.step", null=True, since=4),
            c("requested_revision", S, "m.requested_revision", null=True, since=4),
        ),
        f"""FROM models m
LEFT JOIN series se ON se.id = m.series_id
LEFT JOIN (SELECT c.id, {run_key("c", *RUN_KEYS["clusterings"])} AS key FROM clusterings c
           WHERE c.id = ANY(:clusterings)) cl
       ON cl.id = m.current_clustering_id
WHERE m.id = ANY(:models) ORDER BY m.name""",
    ),
    Table(
        "series",
        "series",
        "one row per series of an exported model (SPEC 11): what every step shares, its architecture, "
        "attention stacks and tokenizer; models.parquet names each model's series and step",
        (
            c("series", S, "s.name"),
            c("architecture", S, "s.architecture"),
            c("stacks", JSON, "s.stacks::text"),
            c("tokenizer_sha256", S, "s.tokenizer_sha256"),
            c("created_at", TIMESTAMP, "s.created_at"),
        ),
        """FROM series s
WHERE s.id IN (SELECT m.series_id FROM models m WHERE m.id = ANY(:models))
ORDER BY s.name""",
        since=4,
    ),
    Table(
        "feature_runs",
        "feature runs",
        "one row per complete feature run: corpus, configuration, special tokens",
        (
            c("model", S, "m.name"),
            c("feature_run", S, "r.key"),
            *_CORPUS,
            c("status", S, "r.status"),
            c("num_windows", I64, "r.num_windows"),
            c("max_length", I64, "r.max_length"),
            c("samples_requested", I64, "r.samples_requested", null=True),
            c("num_samples", I64, "r.num_samples"),
            c("num_tokens", I64, "r.num_tokens"),
            c("special_tokens", JSON, "r.special_tokens::text"),
            c("config", JSON, "r.config::text"),
            c("example_tokens", STRINGS, "r.example_tokens", null=True),
            *_provenance(),
        ),
        f"""FROM ({_runs("feature_runs", where="r.model_id = ANY(:models) AND r.status = 'complete'")}) r
JOIN models m ON m.id = r.model_id JOIN corpora co ON co.id = r.corpus_id
ORDER BY m.name, r.started_at, r.key""",
    ),
    Table(
        "head_features",
        "heads",
        "one row per head per feature run: the distance features by name (w0..w15 "
        "null beyond the run's windows), the whole vector, Clark et al.'s scalars, the example map",
        (
            c("model", S, "m.name"),
            c("feature_run", S, "r.key"),
            *HEAD,
            *(
                c(f"w{i}", F64, f"CASE WHEN r.num_windows > {i} THEN x.vector[{i + 1}] END", null=True)
                for i in range(NUM_WINDOW_COLUMNS)
            ),
            *(c(name, F64, f"x.vector[r.num_windows + {j + 1}]") for j, name in enumerate(SPECIALS)),
            *SCALARS,
            c("vector", FLOATS, "x.vector"),
            c("example_map", MAP, "x.example_map", null=True),
        ),  # fmt: skip
        f"""FROM head_features x
JOIN ({_runs("feature_runs", where="r.model_id = ANY(:models) AND r.status = 'complete'")}) r
  ON r.id = x.feature_run_id
JOIN models m ON m.id = x.model_id {HEAD_JOIN}
WHERE x.model_id = ANY(:models)
ORDER BY m.name, r.started_at, r.key, h.stack, h.layer, h.head""",
        rows=Rows("head_features", (_by_run("feature_runs", "feature_run", "num_windows"),)),
    ),
    Table(
        "clusterings",
        "clusterings",
        "one row per complete clustering whose models are all exported, with the "
        "feature runs it clustered (parallel lists models, feature_runs)",
        (
            c("clustering", S, "r.key"),
            c("algorithm", S, "r.algorithm"),
            c("k", I64, "r.k"),
            c("seed", I64, "r.seed"),
            c("num_windows", I64, "r.num_windows"),
            c("params", JSON, "r.params::text"),
            c("status", S, "r.status"),
            c("num_heads", I64, "r.num_heads"),
            c("seconds", F64, "r.seconds", null=True),
            c("vector", S, "r.vector"),
            c("created_at", TIMESTAMP, "r.created_at"),
            c("finished_at", TIMESTAMP, "r.finished_at", null=True),
            c("models", STRINGS, "runs.models"),
            c("feature_runs", STRINGS, "runs.feature_runs"),
            c(
                "current_stability_run",
                S,
                _current("stability_runs", "r", "current_stability_run_id"),
                null=True,
                since=3,
            ),
        ),  # fmt: skip
        f"""FROM ({_runs("clusterings", where="r.id = ANY(:clusterings)")}) r
JOIN (
    SELECT cf.clustering_id, array_agg(m.name ORDER BY m.name, f.key) AS models,
           array_agg(f.key ORDER BY m.name, f.key) AS feature_runs
    FROM clustering_feature_runs cf
    JOIN ({_runs("feature_runs", "fr", "fr.model_id = ANY(:models)")}) f ON f.id = cf.feature_run_id
    JOIN models m ON m.id = f.model_id
    WHERE cf.clustering_id = ANY(:clusterings)
    GROUP BY cf.clustering_id
) runs ON runs.clustering_id = r.id
ORDER BY r.created_at, r.key""",
    ),
    Table(
        "clusters",
        "clusterings",
        "one row per cluster (head type) of each clustering: name, centroid, size, share",
        (
            c("clustering", S, "r.key"),
            c("index", I64, "x.index"),
            c("type", S, "x.name"),
            c("centroid", FLOATS, "x.centroid"),
            c("size", I64, "x.size"),
            c("share", F64, "x.share"),
        ),  # fmt: skip
        f"""FROM clusters x JOIN ({_runs("clusterings", where="r.id = ANY(:clusterings)")}) r ON r.id = x.clustering_id
ORDER BY r.created_at, r.key, x.index""",
    ),
    Table(
        "head_types",
        "clusterings",
        "one row per head per clustering (the head_types view): its type, the "
        "feature run it was clustered from, its t-SNE position, its margin (confidence in the type)",
        (
            c("clustering", S, "r.key"),
            c("model", S, "m.name"),
            c("feature_run", S, "f.key"),
            *HEAD,
            c("type", S, "cl.name"),
            c("tsne_x", F64, "x.tsne_x", null=True),
            c("tsne_y", F64, "x.tsne_y", null=True),
            c("margin", F64, "x.margin", null=True, since=2),
        ),  # fmt: skip
        f"""FROM head_assignments x
JOIN ({_runs("clusterings", where="r.id = ANY(:clusterings)")}) r ON r.id = x.clustering_id
JOIN ({_runs("feature_runs", "fr", "fr.model_id = ANY(:models)")}) f ON f.id = x.feature_run_id
JOIN clusters cl ON cl.id = x.cluster_id
JOIN models m ON m.id = x.model_id {HEAD_JOIN}
ORDER BY r.created_at, r.key, m.name, h.stack, h.layer, h.head""",
        rows=Rows(
            "head_assignments",
            (
                Lookup(
                    "x.clustering_id",
                    f"""SELECT r.id, {_CLUSTERED.format(clustering="r.id")}, r.key
FROM ({_runs("clusterings", where="r.id = ANY(:clusterings)")}) r ORDER BY r.created_at, r.key""",
                    ("clustering",),
                ),
                BY_MODEL,
                Lookup(
                    "x.feature_run_id",
                    f"SELECT id, NULL::int[], key FROM ({_runs('feature_runs', 'f', 'f.model_id = ANY(:models)')}) f",
                    ("feature_run",),
                    ordered=False,
                ),
                Lookup(
                    "x.cluster_id",
                    "SELECT cl.id, NULL::int[], cl.name FROM clusters cl WHERE cl.clustering_id = ANY(:clusterings)",
                    ("type",),
                    ordered=False,
                ),
            ),
        ),
    ),
    Table(
        "stability_runs",
        "stability",
        "one row per stability run of an exported clustering (SPEC section 3)",
        (
            c("clustering", S, "cl.key"),
            c("stability_run", S, "r.key"),
            c("n_runs", I64, "r.n_runs"),
            c("fraction", F64, "r.fraction"),
            c("random_state", I64, "r.random_state"),
            c("seeds", INTS, "r.seeds"),
            c("score", F64, "r.score"),
            c("num_heads", I64, "r.num_heads"),
            c("seconds", F64, "r.seconds"),
            c("created_at", TIMESTAMP, "r.created_at"),
        ),  # fmt: skip
        f"""FROM ({_runs("stability_runs", where="r.clustering_id = ANY(:clusterings)")}) r
JOIN ({_runs("clusterings", "cr", "cr.id = ANY(:clusterings)")}) cl ON cl.id = r.clustering_id
ORDER BY cl.created_at, cl.key, r.created_at, r.key""",
    ),
    Table(
        "stability_heads",
        "stability",
        "one row per head per stability run: stable in every fit or not, and the share of fits that "
        "agree with the clustering's type (null for runs stored before it was kept)",
        (
            c("clustering", S, "cl.key"),
            c("stability_run", S, "r.key"),
            c("model", S, "m.name"),
            *HEAD,
            c("stable", BOOL, "x.stable"),
            c("agreement", F64, "x.agreement", null=True, since=2),
        ),
        f"""FROM stability_heads x
JOIN ({_runs("stability_runs", where="r.clustering_id = ANY(:clusterings)")}) r ON r.id = x.stability_run_id
JOIN ({_runs("clusterings", "cr", "cr.id = ANY(:clusterings)")}) cl ON cl.id = r.clustering_id
JOIN models m ON m.id = x.model_id {HEAD_JOIN}
ORDER BY cl.created_at, cl.key, r.created_at, r.key, m.name, h.stack, h.layer, h.head""",
        rows=Rows(
            "stability_heads",
            (
                Lookup(
                    "x.stability_run_id",
                    f"""SELECT r.id, {_CLUSTERED.format(clustering="r.clustering_id")}, cl.key, r.key
FROM ({_runs("stability_runs", where="r.clustering_id = ANY(:clusterings)")}) r
JOIN ({_runs("clusterings", "cr", "cr.id = ANY(:clusterings)")}) cl ON cl.id = r.clustering_id
ORDER BY cl.created_at, cl.key, r.created_at, r.key""",
                    ("clustering", "stability_run"),
                ),
                BY_MODEL,
            ),
        ),
    ),
    Table(
        "ablation_baselines",
        "ablations",
        "one row per unablated measurement of a model on an evaluation set",
        (
            c("model", S, "m.name"),
            c("ablation_baseline", S, "r.key"),
            c("task", S, "r.task"),
            c("data_key", S, "r.data_key"),
            c("data_subset", S, "r.data_subset", null=True),
            c("limit", I64, 'r."limit"', null=True),
            c("max_length", I64, "r.max_length"),
            c("dtype", S, "r.dtype"),
            c("n_examples", I64, "r.n_examples"),
            c("metrics", JSON, "r.metrics::text"),
            c("seconds", F64, "r.seconds"),
            c("device", S, "r.device"),
            c("created_at", TIMESTAMP, "r.created_at"),
        ),  # fmt: skip
        f"""FROM ({_runs("ablation_baselines")}) r JOIN models m ON m.id = r.model_id
ORDER BY m.name, r.created_at, r.key""",
    ),
    Table(
        "ablation_runs",
        "ablations",
        "one row per complete ablation run: data, plan, the clustering whose types "
        "it ablated (null: none, or not exported), its baseline",
        (
            c("model", S, "m.name"),
            c("ablation_run", S, "r.key"),
            c("clustering", S, "cl.key", null=True),
            c("ablation_baseline", S, "b.key"),
            c("status", S, "r.status"),
            c("task", S, "r.task"),
            *_data(),
            c("n_examples", I64, "r.n_examples"),
            c("plan", S, "r.plan"),
            c("types", JSON, "r.types::text"),
            c("config", JSON, "r.config::text"),
            *_provenance(),
        ),  # fmt: skip
        f"""FROM ({_runs("ablation_runs", where="r.model_id = ANY(:models) AND r.status = 'complete'")}) r
JOIN models m ON m.id = r.model_id
JOIN ({_runs("ablation_baselines", "ab", "ab.model_id = ANY(:models)")}) b ON b.id = r.baseline_id
LEFT JOIN ({_runs("clusterings", "cr", "cr.id = ANY(:clusterings)")}) cl ON cl.id = r.clustering_id
ORDER BY m.name, r.started_at, r.key""",
    ),
    Table(
        "ablation_outcomes",
        "ablations",
        "one row per plan row of each ablation run (Guan et al. Tables 2 and 3)",
        (
            c("model", S, "m.name"),
            c("ablation_run", S, "r.key"),
            c("position", I64, "x.position"),
            c("row_id", S, "x.row_id"),
            c("label", S, "x.label"),
            c("paper_ref", S, "x.paper_ref", null=True),
            c("operations", STRINGS, "x.operations"),
            c("selection", JSON, "x.selection::text"),
            c("spec", JSON, "x.spec::text"),
            c("types", STRINGS, "x.types"),
            c("type_ops", JSON, "x.type_ops::text"),
            c("heads", I64, "x.heads"),
            c("metrics", JSON, "x.metrics::text"),
            c("baseline", JSON, "x.baseline::text"),
            c("n_examples", I64, "x.n_examples"),
            c("seconds", F64, "x.seconds"),
        ),  # fmt: skip
        f"""FROM ablation_outcomes x
JOIN ({_runs("ablation_runs", where="r.model_id = ANY(:models) AND r.status = 'complete'")}) r ON r.id = x.run_id
JOIN models m ON m.id = r.model_id
ORDER BY m.name, r.started_at, r.key, x.position""",
    ),
    Table(
        "importance_runs",
        "importance",
        "one row per complete importance run (SPEC section 7): loss, data, seed",
        (
            c("model", S, "m.name"),
            c("importance_run", S, "r.key"),
            c("status", S, "r.status"),
            c("loss", S, "r.loss"),
            c("task", S, "r.task", null=True),
            *_data(),
            c("n_examples", I64, "r.n_examples"),
            c("seed", I64, "r.seed"),
            c("mean_loss", F64, "r.mean_loss", null=True),
            c("config", JSON, "r.config::text"),
            *_provenance(),
        ),  # fmt: skip
        f"""FROM ({_runs("importance_runs", where="r.model_id = ANY(:models) AND r.status = 'complete'")}) r
JOIN models m ON m.id = r.model_id ORDER BY m.name, r.started_at, r.key""",
    ),
    Table(
        "head_importance",
        "importance",
        "one row per head per importance run (the head_importance view's columns): "
        "importance normalised by its layer's L2 norm, and raw",
        (
            c("model", S, "m.name"),
            c("importance_run", S, "r.key"),
            *HEAD,
            c("importance", F64, "x.normalized"),
            c("importance_raw", F64, "x.raw"),
        ),  # fmt: skip
        f"""FROM importance_scores x
JOIN ({_runs("importance_runs", where="r.model_id = ANY(:models) AND r.status = 'complete'")}) r ON r.id = x.run_id
JOIN models m ON m.id = x.model_id {HEAD_JOIN}
ORDER BY m.name, r.started_at, r.key, h.stack, h.layer, h.head""",
        rows=Rows("importance_scores", (_by_run("importance_runs", "importance_run"),)),
    ),
    Table(
        "pruning_curves",
        "importance",
        "one row per complete pruning-curve run: rankings, orders, shared baseline",
        (
            c("model", S, "m.name"),
            c("pruning_curve", S, "r.key"),
            c("ablation_baseline", S, "b.key"),
            c("importance_run", S, "ir.key", null=True),
            c("clustering", S, "cl.key", null=True),
            c("status", S, "r.status"),
            c("task", S, "r.task"),
            c("metric", S, "r.metric"),
            c("rankings", STRINGS, "r.rankings"),
            c("iterative", BOOL, "r.iterative"),
            c("steps", I64, "r.steps"),
            c("max_share", F64, "r.max_share"),
            c("seed", I64, "r.seed"),
            c("type_order", STRINGS, "r.type_order"),
            c("orders", JSON, "r.orders::text"),
            c("baseline", JSON, "r.baseline::text"),
            *_data(),
            c("n_examples", I64, "r.n_examples"),
            c("config", JSON, "r.config::text"),
            *_provenance(),
        ),  # fmt: skip
        f"""FROM ({_runs("pruning_curves", where="r.model_id = ANY(:models) AND r.status = 'complete'")}) r
JOIN models m ON m.id = r.model_id
JOIN ({_runs("ablation_baselines", "ab", "ab.model_id = ANY(:models)")}) b ON b.id = r.baseline_id
LEFT JOIN ({_runs("importance_runs", "i", "i.model_id = ANY(:models) AND i.status = 'complete'")}) ir
       ON ir.id = r.importance_run_id
LEFT JOIN ({_runs("clusterings", "cr", "cr.id = ANY(:clusterings)")}) cl ON cl.id = r.clustering_id
ORDER BY m.name, r.started_at, r.key""",
    ),
    Table(
        "pruning_points",
        "importance",
        "one row per point of each ranking's pruning curve",
        (
            c("model", S, "m.name"),
            c("pruning_curve", S, "r.key"),
            c("ranking", S, "x.ranking"),
            c("step", I64, "x.step"),
            c("pruned", I64, "x.pruned"),
            c("share", F64, "x.share"),
            c("metrics", JSON, "x.metrics::text"),
            c("heads", JSON, "x.heads::text"),
            c("seconds", F64, "x.seconds"),
        ),  # fmt: skip
        f"""FROM pruning_points x
JOIN ({_runs("pruning_curves", where="r.model_id = ANY(:models) AND r.status = 'complete'")}) r ON r.id = x.curve_id
JOIN models m ON m.id = r.model_id
ORDER BY m.name, r.started_at, r.key, x.ranking, x.step""",
    ),
    Table(
        "attribution_runs",
        "attribution",
        "one row per complete attribution run (SPEC section 8)",
        (
            c("model", S, "m.name"),
            c("attribution_run", S, "r.key"),
            *_CORPUS,
            c("status", S, "r.status"),
            c("stack", S, "r.stack"),
            c("num_windows", I64, "r.num_windows"),
            c("max_length", I64, "r.max_length"),
            c("samples_requested", I64, "r.samples_requested"),
            c("num_samples", I64, "r.num_samples"),
            c("num_tokens", I64, "r.num_tokens"),
            c("queries", I64, "r.queries"),
            c("probes", I64, "r.probes"),
            c("seed", I64, "r.seed"),
            c("triples", I64, "r.triples"),
            c("passes", I64, "r.passes"),
            c("layer_discrepancy", FLOATS, "r.layer_discrepancy"),
            c("config", JSON, "r.config::text"),
            c("example_tokens", STRINGS, "r.example_tokens"),
            c("example_queries", INTS, "r.example_queries"),
            *_provenance(),
        ),  # fmt: skip
        f"""FROM ({_runs("attribution_runs", where="r.model_id = ANY(:models) AND r.status = 'complete'")}) r
JOIN models m ON m.id = r.model_id JOIN corpora co ON co.id = r.corpus_id
ORDER BY m.name, r.started_at, r.key""",
    ),
    Table(
        "head_attribution",
        "attribution",
        "one row per head per attribution run (the head_attribution view's "
        "columns): discrepancy, global (attribution) and local vectors, scalars, example rows",
        (
            c("model", S, "m.name"),
            c("attribution_run", S, "r.key"),
            *HEAD,
            c("discrepancy", F64, "x.discrepancy"),
            c("global_vector", FLOATS, "x.vector"),
            c("local_vector", FLOATS, "x.local_vector"),
            *(Column(s.name, s.type, s.sql, True) for s in SCALARS),
            c("example_attention", MAP, "x.example_attention"),
            c("example_attribution", MAP, "x.example_attribution"),
        ),  # fmt: skip
        f"""FROM head_attributions x
JOIN ({_runs("attribution_runs", where="r.model_id = ANY(:models) AND r.status = 'complete'")}) r
  ON r.id = x.attribution_run_id
JOIN models m ON m.id = x.model_id {HEAD_JOIN}
ORDER BY m.name, r.started_at, r.key, h.stack, h.layer, h.head""",
        rows=Rows("head_attributions", (_by_run("attribution_runs", "attribution_run"),)),
    ),
    Table(
        "syntax_runs",
        "syntax",
        "one row per complete syntax run (SPEC section 9): parses, source, sentences",
        (
            c("model", S, "m.name"),
            c("syntax_run", S, "r.key"),
            c("status", S, "r.status"),
            c("stack", S, "r.stack"),
            c("parses", S, "r.parses"),
            c("source", S, "r.source"),
            c("sha256", S, "r.sha256", null=True),
            c("parser", S, "r.parser", null=True),
            c("num_sentences", I64, "r.num_sentences"),
            c("num_skipped", I64, "r.num_skipped"),
            c("num_words", I64, "r.num_words"),
            c("config", JSON, "r.config::text"),
            *_provenance(),
        ),  # fmt: skip
        f"""FROM ({_runs("syntax_runs", where="r.model_id = ANY(:models) AND r.status = 'complete'")}) r
JOIN models m ON m.id = r.model_id ORDER BY m.name, r.started_at, r.key""",
    ),
    Table(
        "syntax_baselines",
        "syntax",
        "one row per relation per syntax run: pair count, best fixed offset, accuracy",
        (
            c("model", S, "m.name"),
            c("syntax_run", S, "r.key"),
            c("relation", S, "x.relation"),
            c("count", I64, "x.count"),
            c("offset", I64, 'x."offset"'),
            c("accuracy", F64, "x.accuracy"),
        ),  # fmt: skip
        f"""FROM syntax_baselines x
JOIN ({_runs("syntax_runs", where="r.model_id = ANY(:models) AND r.status = 'complete'")}) r
  ON r.id = x.syntax_run_id
JOIN models m ON m.id = r.model_id
ORDER BY m.name, r.started_at, r.key, x.relation""",
    ),
    Table(
        "head_syntax",
        "syntax",
        "one row per head, relation and direction per syntax run (the head_syntax view's accuracy, correct and count)",
        (
            c("model", S, "m.name"),
            c("syntax_run", S, "r.key"),
            *HEAD,
            c("relation", S, "x.relation"),
            c("direction", S, "x.direction"),
            c("accuracy", F64, "x.accuracy"),
            c("correct", I64, "x.correct"),
            c("count", I64, "x.count"),
        ),  # fmt: skip
        f"""FROM head_syntax_scores x
JOIN ({_runs("syntax_runs", where="r.model_id = ANY(:models) AND r.status = 'complete'")}) r
  ON r.id = x.syntax_run_id
JOIN models m ON m.id = x.model_id {HEAD_JOIN}
ORDER BY m.name, r.started_at, r.key, h.stack, h.layer, h.head, x.relation, x.direction""",
        rows=Rows("head_syntax_scores", (_by_run("syntax_runs", "syntax_run"),), then="x.relation, x.direction"),
    ),
    Table(
        "detection_runs",
        "detections",
        "one row per complete detection run (SPEC 10): config (sequences, length, copies, seed, "
        "thresholds), the sequences' ids, the repeat gain and the causal check (JSON)",
        (
            c("model", S, "m.name"),
            c("detection_run", S, "r.key"),
            c("status", S, "r.status"),
            c("config", JSON, "r.config::text"),
            c("sequences", JSON, "r.sequences::text"),
            c("num_sequences", I64, "r.num_sequences"),
            c("num_tokens", I64, "r.num_tokens"),
            c("loss_first", F64, "r.loss_first", null=True),
            c("loss_later", F64, "r.loss_later", null=True),
            c("repeat_gain", F64, "r.repeat_gain", null=True),
            c("checks", JSON, "r.checks::text"),
            c("example_tokens", JSON, "r.example_tokens::text"),
            c("example_size", I64, "r.example_size"),
            *_provenance(),
        ),  # fmt: skip
        f"""FROM ({_runs("detection_runs", where="r.model_id = ANY(:models) AND r.status = 'complete'")}) r
JOIN models m ON m.id = r.model_id ORDER BY m.name, r.started_at, r.key""",
        since=2,
    ),
    Table(
        "head_detections",
        "detections",
        "one row per head per detection run (the head_detections view's scores): induction, "
        "duplicate_token, previous_token, sink (null where the stack has no such score), roles, "
        "the first sequence's map (row-major, example_size x example_size)",
        (
            c("model", S, "m.name"),
            c("detection_run", S, "r.key"),
            *HEAD,
            c("induction", F64, "x.induction", null=True),
            c("duplicate_token", F64, "x.duplicate_token", null=True),
            c("previous_token", F64, "x.previous_token", null=True),
            c("sink", F64, "x.sink", null=True),
            c("roles", STRINGS, "x.roles::text[]"),
            c("example_map", FLAT_MAP, "x.example_map"),
        ),  # fmt: skip
        f"""FROM head_detector_scores x
JOIN ({_runs("detection_runs", where="r.model_id = ANY(:models) AND r.status = 'complete'")}) r
  ON r.id = x.detection_run_id
JOIN models m ON m.id = x.model_id {HEAD_JOIN}
ORDER BY m.name, r.started_at, r.key, h.stack, h.layer, h.head""",
        rows=Rows("head_detector_scores", (_by_run("detection_runs", "detection_run"),)),
        since=2,
    ),
)

BY_NAME: dict[str, Table] = {t.name: t for t in TABLES}
