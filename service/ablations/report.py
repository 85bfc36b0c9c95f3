"""Guan et al. (2020) Tables 2 and 3 for one stored ablation run, in markdown (``headcat report``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ingest.types import HEAD_TYPES
from service.ablations.schemas import AblationRunRead, OutcomeRead

PRETTY = {"dense": "Dense", "diagonal": "Diagonal", "dense_vertical": "Dense&Vertical", "vertical": "Vertical"}
METRICS: dict[str, list[tuple[str, str]]] = {
    "squad": [("EM", "exact_match"), ("F1", "f1")],
    "glue": [("Acc.", "accuracy"), ("F1", "f1")],
}
MAIN_METRIC = {"squad": ("ΔF1", "f1"), "glue": ("ΔAcc.", "accuracy")}
SYMBOLS = {"prune": "✗", "uniform": "1/L", "drop_intra": "✗", "drop_inter": "✗"}
TABLE2_OPS = frozenset({"prune", "uniform"})


def _type_columns(run: AblationRunRead) -> list[str]:
    present = [t for t in HEAD_TYPES if t in run.types]
    return present + sorted(t for t in run.types if t not in HEAD_TYPES)


def _metric_columns(run: AblationRunRead) -> list[tuple[str, str, bool]]:
    """(header, metric key, is a delta) per metric column: task metrics, the main one's delta, drift."""
    columns = [(name, key, False) for name, key in METRICS.get(run.task, [])]
    if run.task in MAIN_METRIC:
        name, key = MAIN_METRIC[run.task]
        columns.append((name, key, True))
    drift = "kl" if "kl" in run.baseline.metrics else "cosine"
    columns.append(("KL" if drift == "kl" else "cosine", drift, False))
    return columns


def _metric_cells(outcome: OutcomeRead, columns: list[tuple[str, str, bool]]) -> list[str]:
    cells = []
    for _, key, is_delta in columns:
        value = outcome.deltas.get(key) if is_delta else outcome.metrics.get(key)
        if not isinstance(value, int | float) or (is_delta and not outcome.operations):
            cells.append("")
        elif is_delta:
            cells.append(f"{value:+.2f}")
        else:
            cells.append(f"{value:.4f}" if key in ("kl", "cosine") else f"{value:.2f}")
    return cells


def _cell(ops: dict[str, int], total: int) -> str:
    """✓ untouched; the operation's mark otherwise, with the share of the type's heads when partial."""
    marks = [SYMBOLS[op] if count >= total else f"{SYMBOLS[op]} {count}/{total}" for op, count in ops.items()]
    return " ".join(marks) or "✓"


def _data_name(run: AblationRunRead) -> str:
    source = run.data.source
    return source if source.startswith(("hub:", "builtin:")) else Path(source).name


def markdown_report(run: AblationRunRead) -> str:
    """Tables 2 and 3 of Guan et al. (2020) for one run: ✓ kept, ✗ pruned / dropped, 1/L uniform.

    Table 2 holds the rows that prune or substitute, Table 3 those that drop intra- or
    inter-segment attention; both start with the baseline row. A mark with a fraction (``✗ 3/15``)
    means only some of that type's heads were ablated (selections by layer or head list).
    """
    types = _type_columns(run)
    columns = _metric_columns(run)
    subset = f", {run.data.subset}" if run.data.subset else ""
    shares = ", ".join(f"{PRETTY.get(t, t)} {run.types[t]}" for t in types) or "none"
    lines = [
        f"**{run.model}**, ablation run {run.id} ({run.task}): {run.n_examples} of {run.data.size} examples of "
        f"`{_data_name(run)}`{subset}; head types from clustering {run.clustering_id or '-'} ({shares}); "
        f"{run.seconds:.0f} s on {run.device}.",
        "",
    ]
    baseline = [o for o in run.outcomes if not o.operations][:1]
    table2 = [o for o in run.outcomes if o.operations and set(o.operations) <= TABLE2_OPS]
    table3 = [o for o in run.outcomes if o.operations and not set(o.operations) <= TABLE2_OPS]

    if baseline or table2:
        lines += ["Table 2: prune (✗) or substitute with uniform attention (1/L) by head type.", ""]
        lines += _table(["", "id", *(PRETTY.get(t, t) for t in types), *(name for name, _, _ in columns)])
        last = None
        for outcome in baseline + table2:
            ops = set(outcome.operations)
            section = (
                "Baseline" if not ops else "Prune" if ops == {"prune"} else "Substitute" if ops == {"uniform"}
                else "Prune + substitute"
            )  # fmt: skip
            ref = outcome.paper_ref if (outcome.paper_ref or "").startswith("T2.") else outcome.row_id
            cells = [_cell(outcome.type_ops.get(t, {}), run.types[t]) for t in types]
            lines.append(_row([section if section != last else "", str(ref), *cells, *_metric_cells(outcome, columns)]))
            last = section
        lines.append("")
    if table3:
        header = ["", "id"]
        for t in types:
            header += [f"{PRETTY.get(t, t)} intra", f"{PRETTY.get(t, t)} inter"]
        lines += ["Table 3: drop intra- or inter-segment attention (✗) by head type.", ""]
        lines += _table([*header, *(name for name, _, _ in columns)])
        last = None
        for outcome in baseline + table3:
            section = (
                "Baseline" if not outcome.operations
                else {"T3.upper": "Drop one type", "T3.lower": "All types but one"}.get(outcome.paper_ref or "", "Drop")
            )  # fmt: skip
            cells = []
            for t in types:
                by_op = outcome.type_ops.get(t, {})
                cells += [
                    _cell({op: n for op, n in by_op.items() if op != "drop_inter"}, run.types[t]),
                    _cell({op: n for op, n in by_op.items() if op != "drop_intra"}, run.types[t]),
                ]
            lines.append(_row([section if section != last else "", outcome.row_id, *cells,
                               *_metric_cells(outcome, columns)]))  # fmt: skip
            last = section
        lines.append("")
    return "\n".join(lines)


def _table(header: Sequence[str]) -> list[str]:
    return [_row(header), "|" + "|".join("---" for _ in header) + "|"]


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"
