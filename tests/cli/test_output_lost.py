"""The command's output is never the run: a closed pipe, a closed descriptor or a full device on stdout or
stderr stops neither training, nor the end-of-run checkpoint, nor the report, and the exit status is the run's.
Each case runs the real console script in a shell, as a user would."""

import subprocess
import sys

import pytest

from mixprec.app.checkpoint import list_checkpoints

REDIRECTS = {
    "a pipe its reader closed": "| head -c 1 > /dev/null",  # head reads one byte and exits
    "stdout closed": ">&-",
    "stdout on a full device": "> /dev/full",
    "stdout and stderr closed": ">&- 2>&-",
    "stderr on a full device": "2> /dev/full",
}


@pytest.mark.parametrize("redirect", REDIRECTS.values(), ids=REDIRECTS.keys())
def test_output_that_cannot_be_written_never_stops_the_run(tmp_path, redirect):
    run, status = tmp_path / "run", tmp_path / "status"
    command = (
        f"'{sys.executable}' -m mixprec train digits --steps 12 --log-every 1 --out '{run}' --policy fp32 {redirect}"
        f"; echo ${{PIPESTATUS[0]}} > '{status}'"
    )
    subprocess.run(["bash", "-c", command], timeout=600, check=False)
    assert status.read_text().strip() == "0"
    assert [path.name for path in list_checkpoints(run / "checkpoints")] == ["step-00000012.safetensors"]
    assert (run / "report.md").is_file()
