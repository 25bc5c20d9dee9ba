"""The ``mixprec`` command: one argparse parser, one subcommand module each.

Its exit status means one thing each (docs/training.md, "Exit statuses"):

    0        success
    2        a usage error: an argument, a file or a folder given is wrong (``ValueError``, ``TypeError``,
             a missing extra); nothing ran, or what ran is refused before it trained wrong
    1        a runtime failure: the machine refused (``OSError``: a checkpoint that cannot be written), the
             data stopped the run (``BadBatchError``), a peer of a distributed run was lost, a finding
             (``doctor``: FP32 itself makes inf/NaN), or an error of mixprec's own (with its traceback)
    128 + N  stopped by signal N, after its checkpoint (130 Ctrl-C, 143 SIGTERM)

Usage errors and runtime failures print one line on stderr, no traceback; ``MIXPREC_DEBUG=1`` shows it.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
from collections.abc import Sequence

from mixprec.app.cli import (
    bench_cmd,
    compare_cmd,
    demo,
    doctor_cmd,
    export_cmd,
    formats_cmd,
    policy_cmd,
    serve_cmd,
    train_cmd,
    tune_cmd,
)
from mixprec.app.cli.output import surviving_output
from mixprec.app.failures import BadBatchError
from mixprec.app.stop_signals import DEFAULT_STOP_SIGNALS

USAGE_ERROR = 2
RUNTIME_FAILURE = 1


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the command, not the whole usage text."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Python < 3.13 reads "-1e-40" as an option; accept negative numbers in scientific notation.
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    from mixprec import __version__

    parser = _Parser(
        prog="mixprec",
        description="Mixed-precision training for PyTorch: policies, exact float formats, loss scaling, diagnostics.",
    )
    parser.add_argument("--version", action="version", version=f"mixprec {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", dest="command", parser_class=_Parser)
    commands = (
        formats_cmd,
        policy_cmd,
        train_cmd,
        compare_cmd,
        doctor_cmd,
        export_cmd,
        serve_cmd,
        bench_cmd,
        tune_cmd,
        demo,
    )
    for command in commands:
        command.add_parser(subparsers)
    return parser


_NOT_GIVEN = object()


def _given(argv: Sequence[str]) -> frozenset[str]:
    """The destinations of the arguments on the command line itself, a default's value given too: argv parsed
    again with every command's defaults replaced by a marker."""
    probe = build_parser()
    for action in probe._subparsers._group_actions:  # argparse keeps its commands here
        for command in action.choices.values():
            for argument in command._actions:
                argument.default = _NOT_GIVEN
    parsed, _ = probe.parse_known_args(argv)
    return frozenset(name for name, value in vars(parsed).items() if value is not _NOT_GIVEN)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the command they were given to, not by the top-level parser
        prog = f"mixprec {args.command}" if getattr(args, "command", None) else "mixprec"
        print(f"{prog}: error: unrecognized arguments: {' '.join(unknown)} (see '{prog} --help')", file=sys.stderr)
        return USAGE_ERROR
    args.given = _given(argv if argv is not None else sys.argv[1:])  # what --resume compares with the run
    if not hasattr(args, "run"):
        parser.print_help()
        return USAGE_ERROR
    # a run's MODULE:FACTORY (--model, and the config.json that resume, export and serve-bench read) imports
    # from the current folder, as under `python -m mixprec`
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return args.run(args)
    except ModuleNotFoundError as exc:
        print(
            f"mixprec {args.command}: error: {exc}; install the extras: pip install 'mixprec[train]'", file=sys.stderr
        )
        return USAGE_ERROR
    except (ValueError, TypeError, OSError) as exc:
        if os.environ.get("MIXPREC_DEBUG"):
            raise
        message = " ".join(str(exc).split())  # one line, whatever the exception's own layout
        print(f"mixprec {args.command}: error: {message}", file=sys.stderr)
        return RUNTIME_FAILURE if _at_run_time(exc) else USAGE_ERROR
    except KeyboardInterrupt:
        print("mixprec: interrupted", file=sys.stderr)
        return 130


def _at_run_time(error: BaseException) -> bool:
    """Whether ``error`` is a runtime failure (exit 1), not a usage error (exit 2): the machine refused (an
    OSError: a disk, a permission, a file system) or the data stopped the run (BadBatchError)."""
    return isinstance(error, (OSError, BadBatchError))


def console_main() -> None:
    """The ``mixprec`` console script: :func:`main`, then the exit. Output that can no longer be written (a closed
    pipe, a closed descriptor, a full device) is dropped rather than ending the run (:mod:`.output`). A stop
    signal in the interpreter's teardown would only garble the exit status (a run's checkpoint and report are
    written by then), so it is ignored."""
    with surviving_output():
        code = main()
    if threading.current_thread() is threading.main_thread():
        for name in DEFAULT_STOP_SIGNALS:
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
