"""Mutation score of the core modules: mutmut, one module at a time, on the fast tests that cover it.

    python bench/mutation.py                          # every module in MODULES (hours on 2 cores)
    python bench/mutation.py ingest/stability.py      # one module
    python bench/mutation.py --list                   # the modules and the tests each runs
    python bench/mutation.py --children 2 ...         # mutmut --max-children (default 2)
    python bench/mutation.py --no-recheck ...         # keep mutmut's timeouts as they are (see below)
    python bench/mutation.py --only 'service.ingests.service.x_store_feature_run__mutmut_*' service/ingests/service.py
                                                      # only the mutants matching these patterns (fnmatch)
    python bench/mutation.py --sample 200 --only 'service.catalogs.importer.x__write_tables__*' ... MODULE
                                                      # a uniform random sample of those mutants (--seed)

Each module runs in a scratch copy of the checkout (``git archive HEAD``, so commit first), with
``[tool.mutmut]`` of ``pyproject.toml`` narrowed to that module and its tests; mutmut's own
per-test selection then runs, for every mutant, only the tests that reach the mutated function.
Logging calls are not mutated (``do_not_mutate_patterns`` in ``pyproject.toml``): what a log line
says is not part of the contract. Fast tests only (``-m "not slow"``); the database tests need
``TEST_DATABASE_URL`` (or the embedded server) as for the suite. Not part of ``.ci/run``.

Prints, per module, killed / all (score) and the surviving mutants (``mutmut show NAME`` in the
scratch copy, kept under ``bench/out/mutation/<module>``, shows the diff). A mutant whose timeout
or crash (segfault, suspicious) stops its tests counts as killed; ``no tests`` counts as survived.

Timeouts are checked again. mutmut limits each mutant's run to ``(t + timeout_constant) x
timeout_multiplier`` seconds, where ``t`` is only the *call* phase of its tests; the fixtures'
setup and teardown in every forked run (a fresh database and its migrations, a module's committed
database, the tiny model's ingest) are not in ``t``, so a mutant whose tests pass can still be
stopped and counted as a kill. Modules whose tests build such fixtures get a larger
``timeout_constant`` (``SETUP_SECONDS``), and every mutant that still times out is run again
outside mutmut, with the same tests and no CPU limit, for up to ``RECHECK_SECONDS``: tests that
pass make it a survivor (a false timeout), a failing test a kill, and only a run that is still
going at the limit stays a timeout.

A sample (``--sample N``) is for modules whose every mutant runs expensive fixtures (the catalog
importer's tests build and export a catalog in every forked run): N mutants drawn uniformly, with
``--seed``, from those the patterns select, listed by mutmut's own generator under the narrowed
configuration, so the names are the run's. The score is then an estimate: it prints with its
95 % Wilson interval.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out" / "mutation"

# module -> the fast tests that exercise it
MODULES: dict[str, list[str]] = {
    "ingest/stability.py": ["tests/ingest/test_stability.py"],
    "ingest/clustering.py": ["tests/ingest/test_clustering.py", "tests/ingest/test_clustering_contract.py"],
    "ingest/features.py": [
        "tests/ingest/test_features.py",
        "tests/ingest/test_features_contract.py",
        "tests/ingest/test_features_weights.py",
        "tests/ingest/test_features_gpu_branches.py",
        "tests/ingest/test_architectures.py",
    ],
    "ingest/selection.py": ["tests/ingest/test_selection.py", "tests/ingest/test_ablation.py"],
    "ingest/ablation.py": [
        "tests/ingest/test_ablation.py",
        "tests/ingest/test_ablation_edges.py",
        "tests/ingest/test_ablation_stacks.py",
    ],
    "ingest/evaluation.py": ["tests/ingest/test_evaluation.py", "tests/ingest/test_evaluation_contract.py"],
    "ingest/corpora.py": ["tests/ingest/test_corpora.py", "tests/ingest/test_corpora_contract.py"],
    # test_architectures.py is left out: with one OpenMP thread its T5 entropies miss their 1e-6 tolerance
    # (by 1.05e-6), so mutmut's clean run fails; test_attention.py checks the same maps against output_attentions.
    "ingest/attention.py": ["tests/ingest/test_attention.py", "tests/ingest/test_ablation_stacks.py"],
    "ingest/importance.py": ["tests/ingest/test_importance.py", "tests/ingest/test_importance_contract.py"],
    "ingest/attribution.py": ["tests/ingest/test_attribution.py", "tests/ingest/test_attribution_contract.py"],
    "ingest/syntax.py": ["tests/ingest/test_syntax.py", "tests/ingest/test_syntax_contract.py"],
    "ingest/tasks.py": [
        "tests/ingest/test_evaluation.py",
        "tests/ingest/test_importance.py",
        "tests/ingest/test_tasks_labels.py",
    ],
    "ingest/loading.py": [
        "tests/ingest/test_loading.py",
        "tests/ingest/test_loading_contract.py",
        "tests/ingest/test_loading_load.py",
    ],
    # test_security.py covers these too, but every one of its tests creates keys, so mutmut would run all
    # of them (minutes) for every mutant of create(); the key tests alone take seconds.
    "service/auth/repository.py": ["tests/service/test_auth_keys.py"],
    "service/auth/deps.py": ["tests/service/test_auth_keys.py", "tests/service/test_auth_deps.py"],
    "service/jobs/repository.py": ["tests/service/test_jobs_repository.py", "tests/service/test_job_outcomes.py"],
    # in-process tests only: the worker-process tests (test_jobs.py, test_faults.py) are slow, and test_ingest.py
    # reaches execute() through a real model for every mutant
    "service/jobs/runner.py": ["tests/service/test_runner.py"],
    "service/jobs/queue.py": ["tests/service/test_queue.py", "tests/service/test_job_outcomes.py"],
    # the writers' own tests: test_stored_values.py and test_heads_api.py reach the same functions through
    # real ingests for every mutant (minutes each), and check served values, not the writers' rows
    "service/ingests/service.py": ["tests/service/test_ingest_writer.py", "tests/service/test_ingest.py"],
    # test_confidence.py: the margins (clusterings) and agreements (stability) these writers store
    "service/clusterings/service.py": [
        "tests/service/test_clustering_writer.py",
        "tests/service/test_job_outcomes.py",
        "tests/service/test_confidence.py",
    ],
    "service/clusterings/stability.py": [
        "tests/service/test_job_outcomes.py",
        "tests/service/test_stability_job.py",
        "tests/service/test_confidence.py",
    ],
    "service/syntax/service.py": ["tests/service/test_syntax.py"],
    "service/importance/service.py": ["tests/service/test_importance.py"],
    "service/detections/service.py": ["tests/service/test_detections.py"],
    # every forked run builds and exports a catalog (seconds): measured on a sample (--sample). test_catalog_copy.py
    # and test_catalog_series.py import part of an archive, in small chunks, and series: paths the first two miss
    "service/catalogs/importer.py": [
        "tests/service/test_catalog_archive.py",
        "tests/service/test_archive_edges.py",
        "tests/service/test_catalog_copy.py",
        "tests/service/test_catalog_series.py",
    ],
    "service/catalogs/service.py": ["tests/service/test_catalog_archive.py"],
    # issue 32's modules: the query and the exports are read through a committed catalog built in every forked run
    "service/heads/query.py": ["tests/service/test_heads_query.py", "tests/service/test_filter_bounds.py"],
    "service/exports/service.py": ["tests/service/test_exports.py", "tests/service/test_filter_bounds.py"],
    "service/exports/repository.py": ["tests/service/test_exports.py", "tests/service/test_latest_runs.py"],
    # the docs harness: its own tests (the matcher's properties and examples); not test_examples.py, which runs
    # every example of the docs; nor the in-suite mutants of match_json, which read its source (under mutmut, the
    # trampoline's)
    "tests/docs/examples.py": [
        "tests/docs/test_matcher.py",
        "--deselect=tests/docs/test_matcher.py::test_a_matcher_that_looks_at_fewer_elements_is_caught",
    ],
}
# module -> seconds added to mutmut's timeout_constant: its tests' fixtures build databases (and ingest) in
# every forked run, which mutmut does not time (module docstring).
SETUP_SECONDS: dict[str, float] = {module: 15.0 for module in MODULES if module.startswith("service/")}
RECHECK_SECONDS = 600
MUTMUT = [sys.executable, "-m", "mutmut"]  # this interpreter's mutmut, whether or not its venv is on PATH
STATUSES = ("killed", "survived", "timeout", "suspicious", "segfault", "no tests", "skipped", "not checked")


def narrowed_pyproject(text: str, module: str, tests: list[str]) -> str:
    """``pyproject.toml`` with ``[tool.mutmut]`` limited to ``module`` and ``tests``."""
    config = dict(tomllib.loads(text)["tool"]["mutmut"])
    if module in SETUP_SECONDS:
        config["timeout_constant"] = float(config.get("timeout_constant", 1.0)) + SETUP_SECONDS[module]
    lines = [
        "[tool.mutmut]",
        f"source_paths = [{module!r}]".replace("'", '"'),
        "pytest_add_cli_args_test_selection = [" + ", ".join(f'"{t}"' for t in tests) + "]",
        "pytest_add_cli_args = [" + ", ".join(f'"{a}"' for a in config["pytest_add_cli_args"]) + "]",
        "also_copy = [" + ", ".join(f'"{a}"' for a in config["also_copy"]) + "]",
        "do_not_mutate_patterns = [" + ", ".join(f"'{p}'" for p in config["do_not_mutate_patterns"]) + "]",
    ]
    lines += [f"{key} = {config[key]!r}" for key in ("timeout_multiplier", "timeout_constant") if key in config]
    head = text.split("[tool.mutmut]")[0]
    return head + "\n".join(lines) + "\n"


def recheck(work: Path, name: str, tests: list[str], env: dict[str, str], pytest_args: list[str]) -> str:
    """Run mutant ``name``'s ``tests`` again outside mutmut (no CPU limit): killed, survived or timeout."""
    command = [sys.executable, "-m", "pytest", "--rootdir=.", "--tb=no", "-x", "-q", "-p", "no:randomly",
               *pytest_args, *tests]  # fmt: skip
    try:
        done = subprocess.run(command, cwd=work / "mutants", env={**env, "MUTANT_UNDER_TEST": name},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=RECHECK_SECONDS,
                              check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return "timeout"
    return "survived" if done.returncode == 0 else "killed"


def target_names(work: Path, module: str, env: dict[str, str]) -> dict[str, str]:
    """``target_class`` of ``module``'s mutants as ``mutmut run`` makes and names them in ``work``."""
    script = ("import sys, json; sys.path.insert(0, sys.argv[2]); import mutation; "
              "from mutmut.mutation.file_mutation import mutate_file_contents as m; "
              "print(json.dumps(mutation.target_class(m(sys.argv[1], open(sys.argv[1]).read()).code)))")  # fmt: skip
    found = subprocess.run([sys.executable, "-c", script, module, str(Path(__file__).parent)], cwd=work, env=env,
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    prefix = module.removesuffix(".py").replace("/", ".") + "."
    return {prefix + name: kind for name, kind in json.loads(found).items()}


def mutant_names(work: Path, module: str, env: dict[str, str]) -> list[str]:
    """Every mutant mutmut makes of ``module`` in ``work``, named as ``mutmut run`` names them: its own generator,
    run in ``work`` so that it reads the narrowed configuration (the log lines it leaves alone shift the numbers)."""
    script = ("import sys; from mutmut.mutation.file_mutation import mutate_file_contents as m; "
              "print(*m(sys.argv[1], open(sys.argv[1]).read()).mutant_names, sep='\\n')")  # fmt: skip
    listed = subprocess.run([sys.executable, "-c", script, module], cwd=work, env=env, capture_output=True,
                            text=True, check=True).stdout.split()  # fmt: skip
    prefix = module.removesuffix(".py").replace("/", ".") + "."
    return [prefix + name for name in listed]


def _first_difference(a: ast.AST, b: ast.AST, chain: tuple[ast.AST, ...] = ()) -> tuple[ast.AST, ...] | None:
    """The chain of ``a``'s nodes from the root down to the innermost node where ``b`` differs, or None."""
    if type(a) is not type(b):
        return chain + (a,)
    for field, value in ast.iter_fields(a):
        other = getattr(b, field, None)
        if isinstance(value, ast.AST) and isinstance(other, ast.AST):
            found = _first_difference(value, other, chain + (a,))
        elif isinstance(value, list) and isinstance(other, list):
            if len(value) != len(other):
                return chain + (a,)
            found = None
            for x, y in zip(value, other, strict=True):
                found = (_first_difference(x, y, chain + (a,)) if isinstance(x, ast.AST) and isinstance(y, ast.AST)
                         else None if x == y else chain + (a,))  # fmt: skip
                if found:
                    break
        else:
            found = None if value == other else chain + (a,)
        if found:
            return found
    return None


def target_class(code: str) -> dict[str, str]:
    """The mutants of mutmut's mutated ``code`` that change a comparison (its operator, either side) or anything in
    a ``max(...)``/``min(...)`` call: mutant name -> ``comparison`` or ``max/min``. Each mutant function is compared
    with its ``__mutmut_orig``; the innermost node that differs decides, by its own type or an enclosing one."""
    functions: dict[str, ast.AST] = {}
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and "__mutmut_" in node.name:
            functions[node.name] = node
    found: dict[str, str] = {}
    for name, node in functions.items():
        base, _, number = name.rpartition("__mutmut_")
        original = functions.get(base + "__mutmut_orig")
        if number == "orig" or original is None:
            continue
        original.name = node.name  # the names differ by construction
        chain = _first_difference(original, node) or ()
        original.name = base + "__mutmut_orig"
        if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("max", "min") for n in chain):
            found[name] = "max/min"
        elif chain and isinstance(chain[-1], ast.cmpop):
            found[name] = "comparison"  # the operator itself: < <= > >= == != in is
    return found


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of a proportion k/n."""
    if n == 0:
        return 0.0, 1.0
    p, spread = k / n, z * z / n
    centre = (p + spread / 2) / (1 + spread)
    half = z * math.sqrt(p * (1 - p) / n + spread / (4 * n)) / (1 + spread)
    return centre - half, centre + half


def run_module(
    module: str,
    tests: list[str],
    children: int,
    out: Path = OUT,
    recheck_timeouts: bool = True,
    only: list[str] | None = None,
    sample: int | None = None,
    seed: int = 0,
    target: bool = False,
) -> dict[str, list[str]]:
    work = out / module.replace("/", "_").removesuffix(".py")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "x"], cwd=work, input=archive, check=True)
    pyproject = work / "pyproject.toml"
    pyproject.write_text(narrowed_pyproject(pyproject.read_text(), module, tests))
    shared = ROOT.parent / "shared"
    if shared.is_dir() and not (work.parent / "shared").exists():
        (work.parent / "shared").symlink_to(shared)  # tests find ../shared beside the checkout
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # import the mutated copy, not ROOT
    env.setdefault("HF_HUB_OFFLINE", "1")
    # mutmut forks each mutant's test run from a process that has run the tests once: an OpenMP pool
    # (torch, scikit-learn) started before the fork can hang the child, and a hang reads as a timeout,
    # which counts as killed. One thread each: no pool, no such false kills.
    env.update(dict.fromkeys(("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"), "1"))
    if target:
        kinds = target_names(work, module, env)
        only = sorted(name for name in kinds if not only or any(fnmatch.fnmatch(name, p) for p in only))
        print(f"    {module}: {len(only)} mutants of a comparison operator or in a max/min call", flush=True)
        if not only:
            return {status: [] for status in (*STATUSES, "rechecked")} | {"seconds": ["0"]}
    if sample is not None:
        names = [name for name in mutant_names(work, module, env)
                 if not only or any(fnmatch.fnmatch(name, pattern) for pattern in only)]  # fmt: skip
        only = sorted(random.Random(seed).sample(names, min(sample, len(names))))
        print(f"    {module}: a sample of {len(only)} of {len(names)} mutants (seed {seed})", flush=True)
    started = time.perf_counter()
    subprocess.run([*MUTMUT, "run", "--max-children", str(children), *(only or [])], cwd=work, env=env,
                   stdout=subprocess.DEVNULL, check=False)  # fmt: skip
    results = subprocess.run([*MUTMUT, "results", "--all", "true"], cwd=work, env=env, capture_output=True,
                             text=True, check=False).stdout  # fmt: skip
    by_status: dict[str, list[str]] = {status: [] for status in STATUSES}
    for line in results.splitlines():
        match = re.match(r"\s*(\S+): (.+)$", line)
        if match and only and not any(fnmatch.fnmatch(match[1], pattern) for pattern in only):
            continue
        if match and match[2] in by_status:
            by_status[match[2]].append(match[1])
    by_status["rechecked"] = []
    if recheck_timeouts:
        config = tomllib.loads(pyproject.read_text())["tool"]["mutmut"]
        stats = json.loads((work / "mutants" / "mutmut-stats.json").read_text())["tests_by_mangled_function_name"]
        for name in list(by_status["timeout"]):
            tests_of = sorted(stats.get(name.partition("__mutmut_")[0], []))
            verdict = recheck(work, name, tests_of, env, list(config["pytest_add_cli_args"]))
            by_status["rechecked"].append(f"{name}: {verdict}")
            if verdict != "timeout":
                by_status["timeout"].remove(name)
                by_status[verdict].append(name)
    by_status["seconds"] = [f"{time.perf_counter() - started:.0f}"]
    return by_status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help="modules to mutate (default: all of MODULES)")
    parser.add_argument("--children", type=int, default=2)
    parser.add_argument("--no-recheck", action="store_true", help="keep mutmut's timeouts unchecked")
    parser.add_argument("--only", action="append", help="run only the mutants matching this fnmatch pattern")
    parser.add_argument("--sample", type=int, help="run a uniform random sample of this many of the mutants")
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed (default 0)")
    parser.add_argument("--target", action="store_true",
                        help="only the mutants of a comparison operator or inside a max()/min() call")  # fmt: skip
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT, help=f"where the scratch copies go (default {OUT})")
    args = parser.parse_args()
    if args.list:
        for module, tests in MODULES.items():
            print(f"{module}: {' '.join(tests)}")
        return
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        sys.exit(f"unknown module(s) {unknown}; see --list")
    print("module | killed | survived | no tests | score | seconds (shared 2-core CPU)")
    for module in args.modules or list(MODULES):
        found = run_module(module, MODULES[module], args.children, args.out.resolve(), not args.no_recheck,
                           args.only, args.sample, args.seed, args.target)  # fmt: skip
        killed = sum(len(found[s]) for s in ("killed", "timeout", "suspicious", "segfault"))
        survived = len(found["survived"]) + len(found["no tests"])
        total = killed + survived
        score = f"{100 * killed / total:.1f} %" if total else "-"
        if args.sample is not None and total:
            low, high = wilson(killed, total)
            score += f" (95 % CI {100 * low:.1f}-{100 * high:.1f} %)"
        print(f"{module} | {killed} | {len(found['survived'])} | {len(found['no tests'])} | {score} | "
              f"{found['seconds'][0]}")  # fmt: skip
        print(f"    timeouts (kept as killed): {len(found['timeout'])}")
        for line in found["rechecked"]:
            print(f"    timeout rechecked: {line}")
        for name in found["survived"] + found["no tests"]:
            print(f"    survived: {name}")


if __name__ == "__main__":
    main()
