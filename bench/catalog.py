"""Export and import of a synthetic catalog against a bare binary COPY of the same rows: rows/s, peak memory.

    python bench/catalog.py [--heads 100000 --heads 1000000] [--rounds 3] [--keep] [--reuse-source DB]

Per size (``--heads``, repeatable; default 10^6):

1. Makes a scratch database and fills it as ``bench/api_load.py`` does (synthetic models of real
   shapes: per model a feature run, a k = 4 clustering, one feature row and one assignment per
   head), then makes it what an importer accepts: each head's 21 features rescaled to sum to 1
   (the fill draws them uniform), and each clustering's ``created_at`` one microsecond apart
   (the fill makes them all in one transaction, so their keys would be the same).
2. The baseline, the floor of moving the per-head rows (``head_features``, ``head_assignments``):
   a bare ``COPY ... TO STDOUT (FORMAT binary)`` to a file, and the file ``COPY ... FROM STDIN``
   into new tables like them (each made in a transaction before the COPY, as an import's tables
   are): with no index, with the same indexes (the baseline the ratios use), and with the same
   indexes and foreign keys. Rolled back.
3. ``headcat catalog export`` of the whole catalog and ``headcat catalog import`` of the archive
   into an empty, migrated database, each in a subprocess of its own (its peak RSS); then the
   baseline again. The ratios use the mean of the two baselines around them (the machine may be
   shared: both see the same minutes). The copy's row counts are checked.
   Before the first round, an export and import of one model, not measured: numba compiles the decoding's
   loops on their first use in a checkout (cached on disk after), which would otherwise land in the first round.
4. Steps 2 and 3 again, ``--rounds`` times in all (a new archive and an empty database each time).
5. Prints per-head rows per second of each step and its ratio to the baseline (export against
   COPY out, import against COPY in with the same indexes), each subprocess's peak RSS, and with
   two sizes the ratio of their peaks. With several rounds: the round of the median ratio, and
   the range of the ratios over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EXPORTED = ("models", "corpora", "feature_runs", "heads", "head_features", "clusterings", "clustering_feature_runs",
            "clusters", "head_assignments")  # fmt: skip


def phase(args: argparse.Namespace) -> None:
    """Run in a subprocess: export or import, and report seconds and peak RSS as JSON on stdout."""
    import logging

    from sqlalchemy import create_engine
    from sqlalchemy.orm import sessionmaker

    from service.catalogs import importer
    from service.catalogs.export import export_catalog

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    engine = create_engine(args.url)
    started = time.perf_counter()
    out: dict[str, float] = {}
    if args.phase == "export":
        with engine.connect() as connection, connection.begin():
            export_catalog(connection, Path(args.dir), args.model)
    else:
        archive = importer.validate(Path(args.dir))
        out["validate_s"] = time.perf_counter() - started
        with sessionmaker(bind=engine)() as session, session.begin():
            importer.write(session, archive, args.dir)
    out["seconds"] = time.perf_counter() - started
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    sys.stdout.write(json.dumps(out) + "\n")


def run_phase(name: str, url: str, directory: Path, models: list[str] | None = None) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, __file__, "--phase", name, "--url", url, "--dir", str(directory),
         *(f"--model={m}" for m in models or [])],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"{name} failed")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def prepare(url: str) -> None:
    import psycopg

    from service.jobs.queue import conninfo

    with psycopg.connect(conninfo(url)) as connection:
        connection.execute(
            "UPDATE head_features f SET vector = (SELECT array_agg(v / s.total ORDER BY i) FROM unnest(f.vector) "
            "WITH ORDINALITY AS u(v, i), (SELECT sum(x) AS total FROM unnest(f.vector) x) s)"
        )
        connection.execute("UPDATE clusterings SET created_at = created_at + id * interval '1 microsecond'")
    with psycopg.connect(conninfo(url), autocommit=True) as connection:
        connection.execute("VACUUM ANALYZE")


PER_HEAD = ("head_features", "head_assignments")


def baseline(url: str, scratch: Path) -> dict[str, float]:
    """Seconds of a bare binary COPY of the per-head tables: out to a file, and in again into empty tables like
    them with no index, with the same indexes, and with the same indexes and foreign keys (rolled back)."""
    import psycopg

    from service.jobs.queue import conninfo

    out: dict[str, float] = {"out": 0.0, "in_bare": 0.0, "in_indexes": 0.0, "in_foreign_keys": 0.0}
    with psycopg.connect(conninfo(url)) as connection:
        for table in PER_HEAD:
            path = scratch / f"{table}.copy"
            started = time.perf_counter()
            with path.open("wb") as file, connection.cursor().copy(f"COPY {table} TO STDOUT (FORMAT binary)") as copy:
                for data in copy:
                    file.write(data)
            out["out"] += time.perf_counter() - started
            keys = connection.execute(
                "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'f'",
                (table,),
            ).fetchall()
            for variant, like in (("in_bare", ""), ("in_indexes", "INCLUDING INDEXES"),
                                  ("in_foreign_keys", "INCLUDING INDEXES")):  # fmt: skip
                connection.execute(f"CREATE TABLE bench_{table} (LIKE {table} INCLUDING DEFAULTS {like})")
                if variant == "in_foreign_keys":
                    for (definition,) in keys:
                        connection.execute(f"ALTER TABLE bench_{table} ADD {definition}")
                connection.commit()  # the COPY into a table made in an earlier transaction, as an import's is
                started = time.perf_counter()
                with (
                    path.open("rb") as file,
                    connection.cursor().copy(f"COPY bench_{table} FROM STDIN (FORMAT binary)") as copy,
                ):
                    while data := file.read(1 << 20):
                        copy.write(data)
                out[variant] += time.perf_counter() - started
                connection.rollback()
                connection.execute(f"DROP TABLE bench_{table}")
                connection.commit()
            path.unlink()
    return out


def measure(args: argparse.Namespace, admin: Any, heads: int) -> dict[str, Any]:
    """Fill (or reuse) a source catalog of ``heads`` heads, then per round: baseline, export, import, baseline."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from bench.api_load import fill
    from service import db

    tag = uuid.uuid4().hex[:8]
    names = [args.reuse_source or f"headcat_catalog_src_{tag}", f"headcat_catalog_dst_{tag}"]
    fresh = args.reuse_source is None
    urls = [make_url(args.server_url).set(database=n).render_as_string(hide_password=False) for n in names]
    scratch = Path(tempfile.mkdtemp(prefix="headcat-catalog-bench-"))

    def empty(name: str, url: str) -> None:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            connection.execute(text(f'CREATE DATABASE "{name}"'))
        db.upgrade(url)

    try:
        if fresh:
            empty(names[0], urls[0])
            print(f"Filling {names[0]} with {heads} heads ...")
            fill(urls[0], heads)
            prepare(urls[0])
        source = create_engine(urls[0])
        with source.connect() as connection:
            rows = {t: connection.execute(text(f"SELECT count(*) FROM {t}")).scalar_one() for t in EXPORTED}
            table_bytes = sum(
                connection.execute(text(f"SELECT pg_total_relation_size('{t}')")).scalar_one() for t in EXPORTED
            )
            first_model = connection.execute(text("SELECT min(name) FROM models")).scalar_one()
        source.dispose()
        # Warm-up, not measured: an export and import of one model. numba compiles the decoding's loops on their
        # first use in a checkout (cached on disk after), which would otherwise land in the first round.
        empty(names[1], urls[1])
        run_phase("export", urls[0], scratch / "warm-up", [first_model])
        run_phase("import", urls[1], scratch / "warm-up")
        shutil.rmtree(scratch / "warm-up")
        rounds = []
        for number in range(args.rounds):
            empty(names[1], urls[1])
            archive = scratch / "catalog"
            shutil.rmtree(archive, ignore_errors=True)
            # Interleaved, so that the baseline and headcat see the same seconds of a shared machine.
            first = baseline(urls[0], scratch)
            exported = run_phase("export", urls[0], archive)
            imported = run_phase("import", urls[1], archive)
            second = baseline(urls[0], scratch)
            with create_engine(urls[1]).connect() as connection:
                copied = {t: connection.execute(text(f"SELECT count(*) FROM {t}")).scalar_one() for t in EXPORTED}
            assert copied == rows, (copied, rows)
            base = {k: (first[k] + second[k]) / 2 for k in first}
            rounds.append({"baseline": base, "export": exported, "import": imported})
            print(f"  round {number + 1}: export {base['out'] / exported['seconds']:.2f}x, "
                  f"import {base['in_indexes'] / imported['seconds']:.2f}x")  # fmt: skip
        manifest = json.loads((scratch / "catalog" / "manifest.json").read_text())
        return {
            "heads": rows["heads"], "per_head": rows["head_features"] + rows["head_assignments"],
            "archive_rows": sum(f["rows"] for f in manifest["files"].values()),
            "archive_bytes": sum(p.stat().st_size for p in (scratch / "catalog").iterdir()),
            "table_bytes": table_bytes, "rounds": rounds,
        }  # fmt: skip
    finally:
        if args.keep:
            print(f"Kept {names[0]}, {names[1]} and {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
            db.get_engine.cache_clear()
            with admin.connect() as connection:
                for name in names if fresh else names[1:]:
                    connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


STEPS = (  # (label, phase, its seconds, the baseline it is measured against)
    ("bare COPY out (binary)", None, "out", None),
    ("bare COPY in, no index", None, "in_bare", None),
    ("bare COPY in, same indexes (the baseline)", None, "in_indexes", None),
    ("bare COPY in, same indexes and foreign keys", None, "in_foreign_keys", None),
    ("headcat export", "export", "seconds", "out"),
    ("headcat import (validate + write)", "import", "seconds", "in_indexes"),
    ("  of which validate", "import", "validate_s", "in_indexes"),
    ("  of which write", "import", "write_s", "in_indexes"),
)


def report(results: list[dict[str, Any]]) -> None:
    """Per size and step, the round whose ratio is the median (a baseline row: the median seconds) and, with
    several rounds, the range of the ratios."""
    several = any(len(r["rounds"]) > 1 for r in results)
    print(f"\n| heads | per-head rows | step | seconds | per-head rows/s | vs bare COPY{' (range)' if several else ''} "
          "| peak RSS |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in results:
        for one in r["rounds"]:
            one["import"]["write_s"] = one["import"]["seconds"] - one["import"]["validate_s"]
        n = r["per_head"]
        for step, phase, key, against in STEPS:
            if phase is None:
                seconds = sorted(one["baseline"][key] for one in r["rounds"])
                print(f"| {r['heads']:,} | {n:,} | {step} | {seconds[len(seconds) // 2]:.2f} | "
                      f"{n / seconds[len(seconds) // 2]:,.0f} |  |  |")  # fmt: skip
                continue
            ratios = sorted((one["baseline"][against] / one[phase][key], i) for i, one in enumerate(r["rounds"]))
            ratio, median = ratios[len(ratios) // 2]
            one = r["rounds"][median]
            spread = f" ({ratios[0][0]:.2f}-{ratios[-1][0]:.2f})" if len(ratios) > 1 else ""
            memory = f"{one[phase]['peak_rss_mb']:.0f} MB" if key == "seconds" else ""
            print(f"| {r['heads']:,} | {n:,} | {step} | {one[phase][key]:.2f} | {n / one[phase][key]:,.0f} | "
                  f"{ratio:.2f}x{spread} | {memory} |")  # fmt: skip
    for r in results:
        print(f"\n{r['heads']:,} heads: archive {r['archive_bytes'] / 1e6:.1f} MB ({r['archive_rows']:,} rows), "
              f"the exported tables {r['table_bytes'] / 1e6:.1f} MB")  # fmt: skip
    if len(results) > 1:
        small, large = results[0], results[-1]
        for step in ("export", "import"):
            peak = {id(r): max(one[step]["peak_rss_mb"] for one in r["rounds"]) for r in (small, large)}
            print(f"highest peak RSS of the {step}, {large['heads']:,} against {small['heads']:,} heads: "
                  f"{peak[id(large)] / peak[id(small)]:.2f}x")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--server-url", default=os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    parser.add_argument("--heads", type=int, action="append", help="a catalog size (repeat); default 10^6")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of baseline, export, import, baseline")
    parser.add_argument("--keep", action="store_true", help="keep both databases and the archive")
    parser.add_argument("--reuse-source", help="a source database filled and prepared by an earlier --keep run")
    parser.add_argument("--phase", choices=("export", "import"), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--model", action="append", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        phase(args)
        return

    from sqlalchemy import create_engine

    from service import db

    args.server_url = db.sqlalchemy_url(args.server_url)
    admin = create_engine(args.server_url, isolation_level="AUTOCOMMIT")
    try:
        results = [measure(args, admin, heads) for heads in sorted(args.heads or [1_000_000])]
    finally:
        admin.dispose()
    report(results)


if __name__ == "__main__":
    main()
