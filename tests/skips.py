"""CI cannot pass by skipping: under ``CI_TOOLS_STRICT=1`` (``.ci/run``), a run that
skipped a test for any reason but the expected ones fails at the end and lists them.

Expected: what no CI machine has (a CUDA device, onnxruntime-gpu, the GPU image, which
`make images VARIANT=gpu` builds from 4.7 GB of wheels) and what is opt-in (``--runslow``).
Anything else (a missing Redis, haproxy, Chromium, podman or helm, no pip index) means
CI did not test what it claims. Both kinds of skip count: a test's (its report) and a
module's (``pytest.importorskip`` or ``pytest.skip(allow_module_level=True)`` at import:
a collection report, which never reaches ``pytest_runtest_logreport``; under xdist the
workers forward skipped collection reports to the controller, whose hook sees them).
A pytest plugin: pyproject.toml's addopts loads it (``-p tests.skips``).
"""

from __future__ import annotations

import os
import re

import pytest

#: skip reasons that do not fail a strict run (regular expressions, searched)
EXPECTED_SKIPS = (
    r"^needs a CUDA device$",
    r"^slow: pass --runslow$",
    r"^onnxruntime without its CUDA provider",
    r"^no orthornn:\S+-gpu here: `make images VARIANT=gpu` builds it$",
    r"^CUDA can be used here$",  # a CPU-only error path, on a machine with a GPU
)

_unexpected: list[str] = []  # this run's, "nodeid: reason"


def strict() -> bool:
    return os.environ.get("CI_TOOLS_STRICT") == "1"


def expected(reason: str) -> bool:
    return any(re.search(pattern, reason) for pattern in EXPECTED_SKIPS)


def _reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_configure(config):
    _unexpected.clear()


def _record(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = _reason(report)
        line = f"{report.nodeid}: {reason}"
        if not expected(reason) and line not in _unexpected:
            _unexpected.append(line)


def pytest_runtest_logreport(report):
    _record(report)


def pytest_collectreport(report):
    _record(report)  # a module skipped as a whole, before any of its tests


def pytest_sessionfinish(session, exitstatus):
    if strict() and _unexpected and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _unexpected:
        return
    title = "unexpected skips (CI_TOOLS_STRICT=1: the run fails)" if strict() \
        else "skips that CI_TOOLS_STRICT=1 would fail"
    terminalreporter.section(title, sep="=", red=strict(), yellow=not strict())
    for line in _unexpected:
        terminalreporter.write_line(line)
