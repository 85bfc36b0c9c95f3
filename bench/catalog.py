"""Export and import of a 10^6-head catalog (issue 26): rows per second, archive size, peak memory.

    python bench/catalog.py [--heads 1000000] [--server-url URL] [--keep]

1. Makes a scratch database and fills it as ``bench/api_load.py`` does (synthetic models of real
   shapes: per model a feature run, a k = 4 clustering, one feature row and one assignment per
   head), then makes it what an importer accepts: each head's 21 features rescaled to sum to 1
   (the fill draws them uniform), and each clustering's ``created_at`` one microsecond apart
   (the fill makes them all in one transaction, so their keys would be the same).
2. Baseline, the floor of moving these rows: ``COPY head_features, head_assignments TO STDOUT``
   (binary; no joins, no Parquet) and the same bytes ``COPY ... FROM STDIN`` into empty copies of
   the two tables.
3. ``headcat catalog export`` of the whole catalog (a subprocess: its own peak RSS), then
   ``headcat catalog import`` into a second, empty, migrated database (another subprocess:
   validation, then the one transaction), each timed; the copy's row counts are checked.
4. Prints rows per second against the baseline, the archive's size against the source tables'
   ``pg_total_relation_size`` (heap, TOAST and indexes) and ``pg_database_size``, and each
   subprocess's peak RSS.
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
            export_catalog(connection, Path(args.dir))
    else:
        archive = importer.validate(Path(args.dir))
        out["validate_s"] = time.perf_counter() - started
        with sessionmaker(bind=engine)() as session, session.begin():
            importer.write(session, archive, args.dir)
    out["seconds"] = time.perf_counter() - started
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    sys.stdout.write(json.dumps(out) + "\n")


def run_phase(name: str, url: str, directory: Path) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, __file__, "--phase", name, "--url", url, "--dir", str(directory)],
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


def baseline(url: str, target: str) -> float:
    """Seconds to COPY the two per-head tables out (binary) and into empty copies of them."""
    import psycopg

    from service.jobs.queue import conninfo

    started = time.perf_counter()
    with psycopg.connect(conninfo(url)) as source, psycopg.connect(conninfo(target)) as sink:
        for table in ("head_features", "head_assignments"):
            sink.execute(f"CREATE TEMP TABLE copy_{table} (LIKE {table})")
            with (
                source.cursor().copy(f"COPY {table} TO STDOUT (FORMAT binary)") as out,
                sink.cursor().copy(f"COPY copy_{table} FROM STDIN (FORMAT binary)") as into,
            ):
                for data in out:
                    into.write(data)
        sink.rollback()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--server-url", default=os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    parser.add_argument("--heads", type=int, default=1_000_000)
    parser.add_argument("--keep", action="store_true", help="keep both databases and the archive")
    parser.add_argument("--reuse-source", help="a source database filled and prepared by an earlier --keep run")
    parser.add_argument("--phase", choices=("export", "import"), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        phase(args)
        return

    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from bench.api_load import fill
    from service import db

    server_url = db.sqlalchemy_url(args.server_url)
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    tag = uuid.uuid4().hex[:8]
    names = [args.reuse_source or f"headcat_catalog_src_{tag}", f"headcat_catalog_dst_{tag}"]
    fresh = args.reuse_source is None
    urls = [make_url(server_url).set(database=n).render_as_string(hide_password=False) for n in names]
    scratch = Path(tempfile.mkdtemp(prefix="headcat-catalog-bench-"))
    try:
        for name, url in zip(names, urls, strict=True):
            if fresh or name == names[1]:
                with admin.connect() as connection:
                    connection.execute(text(f'CREATE DATABASE "{name}"'))
                db.upgrade(url)
        if fresh:
            print(f"Filling {names[0]} with {args.heads} heads ...")
            fill(urls[0], args.heads)
            prepare(urls[0])
        source = create_engine(urls[0])
        with source.connect() as connection:
            rows = {t: connection.execute(text(f"SELECT count(*) FROM {t}")).scalar_one() for t in EXPORTED}
            table_bytes = sum(
                connection.execute(text(f"SELECT pg_total_relation_size('{t}')")).scalar_one() for t in EXPORTED
            )
            database_bytes = connection.execute(text("SELECT pg_database_size(current_database())")).scalar_one()
        base = baseline(urls[0], urls[1])
        base_rows = rows["head_features"] + rows["head_assignments"]
        print(f"baseline COPY out and in of {base_rows} per-head rows: {base:.1f} s, {base_rows / base:,.0f} rows/s")
        archive = scratch / "catalog"
        exported = run_phase("export", urls[0], archive)
        manifest = json.loads((archive / "manifest.json").read_text())
        archive_rows = sum(f["rows"] for f in manifest["files"].values())
        archive_bytes = sum(p.stat().st_size for p in archive.iterdir())
        imported = run_phase("import", urls[1], archive)
        with create_engine(urls[1]).connect() as connection:
            copied = {t: connection.execute(text(f"SELECT count(*) FROM {t}")).scalar_one() for t in EXPORTED}
        assert copied == rows, (copied, rows)
        source.dispose()
        per_head = manifest["files"]["head_features.parquet"]["rows"] + manifest["files"]["head_types.parquet"]["rows"]
        write_s = imported["seconds"] - imported["validate_s"]
        print("\n| heads | archive rows | step | seconds | rows/s | per-head rows/s vs baseline | peak RSS |")
        print("|---|---|---|---|---|---|---|")
        for step, seconds, rss in (
            ("export", exported["seconds"], exported["peak_rss_mb"]),
            ("import (validate + write)", imported["seconds"], imported["peak_rss_mb"]),
            ("  of which validate", imported["validate_s"], None),
            ("  of which write (one transaction)", write_s, None),
        ):
            ratio = (per_head / seconds) / (base_rows / base)
            memory = f"{rss:.0f} MB" if rss is not None else ""
            print(f"| {rows['heads']:,} | {archive_rows:,} | {step} | {seconds:.1f} | {archive_rows / seconds:,.0f} | "
                  f"{ratio:.3f} | {memory} |")  # fmt: skip
        print(f"\narchive: {archive_bytes / 1e6:.1f} MB; the exported tables in PostgreSQL (heap, TOAST, indexes): "
              f"{table_bytes / 1e6:.1f} MB (archive / tables = {archive_bytes / table_bytes:.3f}); "
              f"the whole database: {database_bytes / 1e6:.1f} MB")  # fmt: skip
        print("files: " + ", ".join(f"{n} {f['bytes'] / 1e6:.1f} MB" for n, f in manifest["files"].items()
                                    if f["bytes"] > 100_000))  # fmt: skip
    finally:
        if args.keep:
            print(f"Kept {names[0]}, {names[1]} and {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
            db.get_engine.cache_clear()
            with admin.connect() as connection:
                for name in names if fresh else names[1:]:
                    connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


if __name__ == "__main__":
    main()
