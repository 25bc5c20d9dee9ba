"""Part ``tests``: the test suite's CUDA cases, run by pytest in a child process, counted from its JUnit XML.

The cases are those :mod:`benchmarks.gpu.pytest_cuda` keeps: marked ``cuda``, parametrized on the
``device`` fixture's ``cuda``, or with a CUDA device among their parameters. Failures and errors are
listed by test id with the first line of their message; skips are counted by reason (a skip on a GPU
machine is a claim not checked: "needs 2 GPUs" is expected on one, "no CUDA" is not).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from benchmarks.gpu.common import Part, Settings

__all__ = ["junit_counts", "missing_imports", "run"]


def missing_imports(tests: Path) -> dict[str, str]:
    """Test files whose module-level imports name a package not installed here (file -> package).

    The GPU machine has no network and no Hypothesis, say: such a file would stop pytest's collection,
    so it is left out by name instead, and the summary says which and why.
    """
    local = {path.stem for path in tests.rglob("*.py")}
    missing = {}
    for path in sorted(tests.rglob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for top in {name.split(".")[0] for name in names} - local:
                if importlib.util.find_spec(top) is None:
                    missing[str(path.relative_to(tests.parent))] = top
    return missing


def junit_counts(path: Path) -> dict:
    """Counts, failing test ids and skip reasons from a JUnit XML file written by pytest."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failing, skips = [], Counter()
    for case in root.iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        for kind in ("failure", "error"):
            for found in case.findall(kind):
                first_line = (found.get("message") or "").splitlines()[:1]
                failing.append(f"{kind}: {test_id}: {first_line[0][:300] if first_line else ''}")
        for found in case.findall("skipped"):
            skips[(found.get("message") or "")[:200]] += 1
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failing": failing, "skip_reasons": dict(skips.most_common(15))}


def run(settings: Settings, part: Part) -> None:
    if not settings.cuda:
        part.skip("no CUDA device: the CUDA cases need one (on a CPU the suite runs as CI runs it)")
        return
    with tempfile.TemporaryDirectory(prefix="mixprec-gpu-tests-") as folder:
        xml = Path(folder) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "tests", "-p", "benchmarks.gpu.pytest_cuda", "-q",
                   "-o", "addopts=--strict-markers", "-p", "no:cacheprovider", f"--junitxml={xml}",
                   "--continue-on-collection-errors"]  # fmt: skip
        for path, package in missing_imports(settings.repo / "tests").items():
            command.append(f"--ignore={path}")
            part.leave_out(path, f"imports {package}, which is not installed here")
        src = str(settings.repo / "src")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
        part.meta["command"] = " ".join(command[1:])
        limit = min(settings.tests_timeout_s, settings.seconds_left() - 30)  # 30 s for pytest's report and ours
        output, code, stopped = _pytest(command, settings.repo, env, limit)
        part.meta["output_tail"] = output[-3000:]
        if not xml.exists():
            part.status, part.reason = (
                "failed",
                f"pytest wrote no report (exit code {code}{'; ' + stopped if stopped else ''})",
            )
            return
        counts = junit_counts(xml)
    part.records.append({"exit_code": code, **counts})
    if stopped:
        part.status = "failed"
        part.reason = (f"{stopped}: counts are of the {counts['tests']} cases run by then "
                       f"({counts['failures']} failed, {counts['errors']} errors)")  # fmt: skip
    elif counts["failures"] or counts["errors"] or code not in (0, 5):
        part.status = "failed"
        part.reason = f"{counts['failures']} failed, {counts['errors']} errors (pytest exit code {code})"
    elif counts["tests"] == 0:
        part.status, part.reason = "failed", "no CUDA case was selected: the suite lost its device parametrization"


def _default_sigint() -> None:
    """In the child: SIGINT's default disposition, so that its Python turns it into KeyboardInterrupt even
    where this process was started with SIGINT ignored (a background job of a script, a pytest-xdist worker)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _pytest(command: list[str], cwd: Path, env: dict, limit: float) -> tuple[str, int | None, str | None]:
    """Run pytest for at most ``limit`` seconds: its output, exit code, and why it was stopped (or None).

    At the limit it gets SIGINT, on which pytest stops after the case in progress and still writes its
    JUnit report of the cases run so far; SIGKILL 60 s later if it has not exited. If this process is
    stopped itself (SIGTERM), pytest is killed first, never left running on the device.
    """
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=_default_sigint,
    )  # fmt: skip
    stopped = None
    try:
        try:
            output, _ = process.communicate(timeout=max(limit, 1.0))
        except subprocess.TimeoutExpired:
            stopped = f"pytest stopped at the time limit ({limit:.0f} s: --tests-timeout or --time-limit)"
            process.send_signal(signal.SIGINT)
            try:
                output, _ = process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                output, _ = process.communicate()
    except BaseException:
        process.kill()
        process.wait()
        raise
    return output or "", process.returncode, stopped
