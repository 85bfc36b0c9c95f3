"""The end-of-run check: a test session fails when a process it started is still alive at its end.

Every process the tests start inherits ``HEADCAT_TEST_SESSION`` (set here when the session starts, to a value
of its own), and keeps it when it outlives its parent (a worker orphaned by a ``headcat serve`` killed without
its clean-up). At the end of the session, after every fixture's teardown, the processes that carry this
session's value, or descend from this process, are given :data:`PATIENCE_AT_END` seconds to end (one stopped
just before); any still alive then fails the run, named with its command line, and is killed.

Wired from ``tests/conftest.py`` (its hooks are this module's).
"""

from __future__ import annotations

import os
import uuid

import psutil
import pytest

from tests.waiting import PATIENCE

MARK = "HEADCAT_TEST_SESSION"
#: Seconds the processes still alive at the end have to end by themselves before they are named and killed:
#: ``HEADCAT_TEST_PATIENCE_AT_END``, else two minutes (or the suite's :data:`~tests.waiting.PATIENCE` if shorter).
#: Only a session that leaves a process behind waits at all; on a loaded machine a server stopped just before
#: the end can take tens of seconds to go, and that must not read as a leftover.
PATIENCE_AT_END = float(os.environ.get("HEADCAT_TEST_PATIENCE_AT_END", min(PATIENCE, 120.0)))

_leftovers: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    os.environ[MARK] = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


def started_by_this_session(mark: str) -> list[psutil.Process]:
    """The live processes carrying ``mark`` or descending from this one (this process and its ancestors aside)."""
    me = psutil.Process()
    found = {child.pid: child for child in me.children(recursive=True)}
    ours = {me.pid, *(parent.pid for parent in me.parents())}
    for process in psutil.process_iter():
        if process.pid in ours or process.pid in found:
            continue
        try:
            if process.environ().get(MARK) == mark:
                found[process.pid] = process
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    alive = []
    for process in found.values():
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            continue
    return alive


def describe(process: psutil.Process) -> str:
    try:
        return f"pid {process.pid}: {' '.join(process.cmdline())[:200]}"
    except psutil.Error:
        return f"pid {process.pid}"


def end_leftovers(mark: str, patience: float = PATIENCE_AT_END) -> list[str]:
    """Wait up to ``patience`` seconds for this session's processes to end; kill the ones left, and name them."""
    processes = started_by_this_session(mark)
    if not processes:
        return []
    _, alive = psutil.wait_procs(processes, timeout=patience)
    named = [describe(process) for process in alive]
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(alive, timeout=patience)
    return named


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    mark = os.environ.get(MARK)
    if mark is None or hasattr(session.config, "workerinput"):  # an xdist worker: its controller checks
        return
    _leftovers[:] = end_leftovers(mark)
    if _leftovers and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _leftovers:
        terminalreporter.section("processes left running", sep="=", red=True, bold=True)
        terminalreporter.line(f"{len(_leftovers)} process(es) started by the tests outlived the session (now killed):")
        for line in _leftovers:
            terminalreporter.line(f"  {line}")
