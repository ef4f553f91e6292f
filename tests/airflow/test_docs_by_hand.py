"""docs/airflow.md's "Run one by hand" block, run as written: a reader copies it into a
shell at the repository's root and gets a DAG run that succeeds. Its ``/tmp`` paths go to
a scratch folder (so that runs never share a database), nothing else changes. Without
its ``scheduler-lib init`` line the run must fail, and say the command that fixes it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "airflow.md"

pytestmark = pytest.mark.slow


def _block() -> str:
    text = DOC.read_text()
    match = re.search(r"Run one by hand:\n\n```bash\n(?P<body>.*?)^```$", text, re.S | re.M)
    assert match, "docs/airflow.md has no 'Run one by hand' bash block"
    return match["body"]


def _run(block: str, scratch: Path) -> subprocess.CompletedProcess[str]:
    body = block.replace("/tmp/", f"{scratch}/")
    # The reader's shell: this environment's commands first, none of the test session's
    # Airflow settings; the background `serve` goes when the block ends.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    script = "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + body
    return subprocess.run(
        ["bash", "-c", script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_run_one_by_hand_works_as_written(tmp_path: Path) -> None:
    done = _run(_block(), tmp_path)
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])


def test_without_init_it_fails_and_names_the_command(tmp_path: Path) -> None:
    block = "\n".join(line for line in _block().splitlines() if "scheduler-lib init" not in line)
    done = _run(block, tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-4000:]
    assert "is not a scheduler target service" in output, output[-4000:]
    assert f"scheduler-lib init --db sqlite:///{tmp_path}/broker.db" in output, output[-4000:]
