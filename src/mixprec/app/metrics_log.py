"""A run's metrics: one JSON line per record in ``metrics.jsonl``, and TensorBoard scalars when installed.

Records are plain dicts (see :mod:`mixprec.app.trainer` for their fields). On resume the file is cut
back to the checkpoint's step, so the history never holds steps that the resumed run will redo.
:class:`LogInterval` sums what a train record reports between two records.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mixprec.checks import shown

if TYPE_CHECKING:
    import torch

__all__ = ["LogInterval", "MetricsLog", "read_metrics"]

FILE = "metrics.jsonl"


def _earlier(number: int) -> str:
    """The name the ``number``-th run that saved no checkpoint in a folder is set aside under by the next: its
    metrics as ``metrics-NAME.jsonl``, its TensorBoard events in ``tensorboard/NAME``."""
    return "earlier" if number == 1 else f"earlier-{number}"


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run, oldest first; a torn last line (a killed process: not JSON) is ignored.

    Raises:
        ValueError: a line before the last that is not JSON (an edit, a binary write), or any line that is not
            a record as the log writes it (a step that is not a whole number, a metric that is not a number),
            naming the file and the line: the records after it would be lost, or the plots fail after training.
    """
    path = Path(run_dir) / FILE
    if not path.is_file():
        return []
    lines = path.read_bytes().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line.decode("utf-8"))
        except ValueError as error:  # UnicodeDecodeError, JSONDecodeError
            if number == len(lines):
                break  # torn by a killed process
            problem = error
        else:
            problem = _record_problem(record)
        if problem is not None:
            raise ValueError(
                f"{path}: line {number} is not a metrics record ({' '.join(str(problem).split())[:120]}); "
                f"the file was damaged or edited: move it away to resume without the run's history."
            ) from None
        records.append(record)
    return records


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _record_problem(record: Any) -> str | None:
    """What keeps ``record`` from being one the log writes (a kind, a whole step, numbers where the plots and a
    resume read them), or None."""
    if not isinstance(record, dict):
        return f"a {type(record).__name__}, not a record"
    step = record.get("step")
    if not isinstance(record.get("kind"), str) or isinstance(step, bool) or not isinstance(step, int):
        return f"a record needs a 'kind' and a whole 'step'; received {shown(record)}"
    numbers = [k for k in record if k not in ("kind", "step")] if record["kind"] == "eval" else ["loss"]
    wrong = next((key for key in numbers if key in record and not _number(record[key])), None)
    return None if wrong is None else f"its {wrong!r} is {shown(record[wrong])}, not a number"


class MetricsLog:
    """Appends records to ``run_dir/metrics.jsonl`` (and TensorBoard); ``run_dir=None`` keeps them in memory."""

    def __init__(self, run_dir: str | Path | None, tensorboard: bool = True) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.records: list[dict[str, Any]] = read_metrics(self.run_dir) if self.run_dir else []
        self.last_train_step = self._last_train_step()
        self._writer = None
        self._tensorboard = tensorboard and self.run_dir is not None  # opened at the first record

    def _open_writer(self):
        """TensorBoard's writer, created with the first record (so a run that fails before training
        leaves no event file), or None without the optional 'tensorboard' extra."""
        if self._writer is None and self._tensorboard:
            self._tensorboard = False
            try:
                from torch.utils.tensorboard import SummaryWriter  # the optional 'tensorboard' extra
            except ImportError:
                return None
            self._writer = SummaryWriter(str(self.run_dir / "tensorboard"))
        return self._writer

    def truncate_after(self, step: int) -> None:
        """Drop records past ``step`` (resuming from a checkpoint taken there); rewrites the file atomically."""
        self.records = [r for r in self.records if r["step"] <= step]
        self.last_train_step = self._last_train_step()
        if self.run_dir is None:
            return
        temporary = self.run_dir / f".{FILE}.tmp-{os.getpid()}"
        temporary.write_text("".join(json.dumps(r) + "\n" for r in self.records), encoding="utf-8")
        os.replace(temporary, self.run_dir / FILE)

    def set_aside(self) -> tuple[int, str | None]:
        """Start empty, keeping an earlier run's records (one that saved no checkpoint, so a new run starts over
        in its folder) as ``metrics-earlier.jsonl`` and its TensorBoard events under ``tensorboard/earlier``
        (shown there as a run of its own), or ``-2``, ``-3`` after those; how many records, and the file."""
        if self.run_dir is None or not (self.run_dir / FILE).exists():
            return 0, None  # in memory: a second fit() on the same Trainer goes on with the same records
        count = len(self.records)
        self.records, self.last_train_step = [], 0
        name = next(
            _earlier(n) for n in itertools.count(1) if not (self.run_dir / f"metrics-{_earlier(n)}.jsonl").exists()
        )
        os.replace(self.run_dir / FILE, self.run_dir / f"metrics-{name}.jsonl")
        events = sorted((self.run_dir / "tensorboard").glob("events.out.tfevents.*"))
        if events:
            (self.run_dir / "tensorboard" / name).mkdir(exist_ok=True)
            for event in events:
                os.replace(event, self.run_dir / "tensorboard" / name / event.name)
        return count, f"metrics-{name}.jsonl"

    def _last_train_step(self) -> int:
        return next((r["step"] for r in reversed(self.records) if r["kind"] == "train"), 0)

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if record["kind"] == "train":
            self.last_train_step = record["step"]
        if self.run_dir is not None:
            with open(self.run_dir / FILE, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")
        writer = self._open_writer()
        if writer is not None:
            for key, value in record.items():
                if key not in ("kind", "step", "epoch", "skipped_at") and isinstance(value, (int, float)):
                    writer.add_scalar(f"{record['kind']}/{key}", value, record["step"])

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class LogInterval:
    """Running loss, samples and time since the last train record (the loss stays on the device)."""

    def __init__(self, records: Sequence[dict[str, Any]] = ()) -> None:
        """``records``: a resumed run's records, whose last train record's "time" this run's goes on from."""
        now = time.perf_counter()
        self.start, self.loss, self.batches, self.samples, self.updates = now, None, 0, 0, 0
        self.origin = now - next((r.get("time", 0.0) for r in reversed(records) if r["kind"] == "train"), 0.0)

    def unrecorded(self) -> dict[str, Any]:
        """The loss summed since the last record and its batches, for a checkpoint (a host read of the sum), so a
        resumed run's next record covers the same batches as an uninterrupted run's."""
        return {"loss_sum": float(self.loss) if self.loss is not None else 0.0, "batches": self.batches}

    def carry_on(self, unrecorded: dict[str, Any] | None) -> None:
        """Go on from a checkpoint's :meth:`unrecorded` (None: an earlier release's, or a distributed run's)."""
        if unrecorded and unrecorded["batches"]:
            self.loss = float(unrecorded["loss_sum"])  # an FP32 sum: the next add rounds it into FP32 exactly
            self.batches = int(unrecorded["batches"])

    def add(self, loss: torch.Tensor, samples: int) -> None:  # self.loss: a tensor, or a float carried on
        self.loss = loss.float() if self.loss is None else self.loss + loss.float()
        self.batches += 1
        self.samples += samples

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Work inside (an evaluation, a checkpoint write) counts in the run's time, not in the interval's
        ms/step and samples/s (an evaluation of 0.5 s after each 24 ms step made them 502 ms and 16 samples/s)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - start

    def flush(self) -> dict[str, float]:
        now = time.perf_counter()
        elapsed = max(now - self.start, 1e-9)
        loss = float(self.loss) / self.batches if self.batches else math.nan  # host sync: once per record
        record = {
            "loss": loss,
            "samples_per_s": self.samples / elapsed,
            "ms_per_step": 1e3 * elapsed / max(self.updates, 1),
            "time": now - self.origin,
        }
        self.start, self.loss, self.batches, self.samples, self.updates = now, None, 0, 0, 0
        return record
