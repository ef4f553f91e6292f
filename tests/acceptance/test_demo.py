"""`python -m demo` (`make demo`), run as a user would: a Spark worker process, the blog's
waves of 4, 2, 1, 2, 1 tasks as Spark SQL, the execution_log and the timeline picture."""

from __future__ import annotations

import itertools
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WAVES = [4, 2, 1, 2, 1]


@pytest.mark.slow
def test_the_demo_runs_the_blogs_waves_on_a_spark_worker(tmp_path: Path) -> None:
    # Given a fresh output directory
    # When the demo runs with four readers on two local cores
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "demo",
            "--out",
            str(tmp_path),
            "--readers",
            "4",
            "--master",
            "local[2]",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )

    # Then it succeeds, says so, and stopped its worker
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all 10 tasks succeeded" in result.stdout
    assert "worker stopped (exit code 0)" in result.stdout
    assert "stopped" in (tmp_path / "demo-worker.log").read_text()
    # and the final report's rows came back from the worker (5 regions x 4 segments)
    assert "region report (wave 5)" in result.stdout
    for region in ("central", "east", "north", "south", "west"):
        assert region in result.stdout

    # and it drew the timeline
    picture = tmp_path / "demo-timeline.png"
    assert str(picture) in result.stdout
    data = picture.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert 20_000 < len(data) < 2_000_000, len(data)

    # and execution_log holds the run: every task succeeded, wave after wave
    with sqlite3.connect(tmp_path / "demo.db") as db:
        db.row_factory = sqlite3.Row
        rows = db.execute(
            "SELECT wave, task_name, status, worker_id, start_time, end_time "
            "FROM execution_log ORDER BY log_id"
        ).fetchall()
    assert len(rows) == sum(WAVES)
    assert {r["status"] for r in rows} == {"SUCCEEDED"}, [dict(r) for r in rows]
    waves = [[r for r in rows if r["wave"] == w] for w in range(1, len(WAVES) + 1)]
    assert [len(w) for w in waves] == WAVES
    for earlier, later in itertools.pairwise(waves):
        assert min(r["start_time"] for r in later) >= max(r["end_time"] for r in earlier)
    # the first wave ran in parallel: some two of its tasks overlapped in time
    assert any(
        a["start_time"] < b["end_time"] and b["start_time"] < a["end_time"]
        for a, b in itertools.combinations(waves[0], 2)
    )
    # and each task names the reader and the Spark application that ran it
    for r in rows:
        assert ":local-" in r["worker_id"], r["worker_id"]
