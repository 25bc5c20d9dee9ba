"""The ``mixprec`` command run inside the test process: the same ``main(argv)`` the console script calls,
without a new interpreter importing torch for every case. Tests of what only a process shows (exit by
signal, the console script itself, imports kept out) start one instead."""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from pathlib import Path

import pytest

# categories Python's default filters hide outside __main__: a subprocess would not print them either
_HIDDEN = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)
REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class Finished:
    """What a run of the command left: its exit status and what it printed (warnings as Python shows them)."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def mixprec_cli(capsys, monkeypatch):
    """``mixprec_cli(*args, cwd=REPO)`` runs ``mixprec ARGS`` in this process, in ``cwd``; modules it imported
    from there (a user's MODULE:FACTORY file) are forgotten afterwards, so the next case imports its own."""
    from mixprec.app.cli.main import main

    def call(*args, cwd: Path = REPO) -> Finished:
        monkeypatch.chdir(cwd)
        folder, path, modules = os.getcwd(), list(sys.path), set(sys.modules)
        capsys.readouterr()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            try:
                code = main([str(a) for a in args])
            except SystemExit as exit_:  # argparse: usage errors, --help, --version
                code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
            finally:
                sys.path[:] = path
                for name in set(sys.modules) - modules:
                    if os.path.dirname(getattr(sys.modules[name], "__file__", None) or "") == folder:
                        del sys.modules[name]
        printed = capsys.readouterr()
        shown = "".join(
            warnings.formatwarning(w.message, w.category, w.filename, w.lineno)
            for w in caught
            if not issubclass(w.category, _HIDDEN)
        )
        return Finished(code, printed.out, printed.err + shown)

    return call
