"""The ``spark-submit`` entry script (``scheduler-lib worker --entry-script``) run as
spark-submit runs it: as a script, whose folder Python puts first on ``sys.path``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scheduler_lib import worker_entry


@pytest.mark.parametrize(
    "module", ["airflow.sdk", "airflow.providers.apache.spark.hooks.spark_submit"]
)
def test_airflow_is_airflow_in_a_process_the_entry_script_started(module: str) -> None:
    # Given the entry script run as a script (-i: the interpreter stays, so what a task
    # would import next is imported in that same process, with its sys.path)
    script = Path(worker_entry.__file__)
    done = subprocess.run(
        [sys.executable, "-i", str(script), "--entry-script"],
        input=f"import {module}; print('imported', {module}.__name__)\n",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    # Then Airflow is Airflow, not the provider package beside the script
    assert f"imported {module}" in done.stdout, done.stderr[-2000:]
