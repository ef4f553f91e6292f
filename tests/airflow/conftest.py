"""Fixtures for the Airflow provider's tests: a real, migrated Airflow home (SQLite) for
the whole run, a ``scheduler_lib_default`` connection per test, and a real
``scheduler-lib worker`` process (a Spark driver) serving the broker.

Airflow reads its configuration when it is first imported, so the home is chosen here,
at collection, before any test module imports ``airflow``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.processes import Processes

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "integration"))  # multiproc: poll

BIN = Path(sys.executable).parent  # airflow and scheduler-lib live next to python
WORKER_START = 120.0  # seconds for a worker's JVM to start on a busy machine

_HOME = Path(tempfile.mkdtemp(prefix="scheduler-lib-airflow-"))
# dag.test() runs only DAGs of a bundle: the examples of dags/ and the tests' own DAGs,
# linked into one folder.
DAGS = _HOME / "dags"
DAGS.mkdir()
for _source in [*sorted((REPO / "dags").glob("*.py")), *sorted((HERE / "dags").glob("*.py"))]:
    (DAGS / _source.name).symlink_to(_source)
AIRFLOW_ENV = {
    "AIRFLOW_HOME": str(_HOME),
    "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
    "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
    "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
}
os.environ.update(AIRFLOW_ENV)


@pytest.fixture(scope="session")
def airflow_home() -> Path:
    """An Airflow home whose metadata database ``airflow db migrate`` created."""
    done = subprocess.run(
        [str(BIN / "airflow"), "db", "migrate"],
        env={**os.environ, **AIRFLOW_ENV},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"airflow db migrate failed:\n{done.stdout}\n{done.stderr}"
    return _HOME


@pytest.fixture(scope="session")
def parse_dags(airflow_home: Path) -> Callable[[Path], dict[str, Any]]:
    """``parse_dags(path)``: the DAGs of a file or folder, parsed the way Airflow parses
    them, with no import error."""

    def parse(path: Path) -> dict[str, Any]:
        try:
            from airflow.dag_processing.dagbag import DagBag
        except ImportError:  # Airflow < 3.2 (the lowest-Airflow job of .ci/run)
            from airflow.models.dagbag import DagBag  # type: ignore[no-redef]

        bag = DagBag(dag_folder=str(path))
        assert not bag.import_errors, bag.import_errors
        return dict(bag.dags)

    return parse


def connection(url: str, **extra: object) -> str:
    """A ``scheduler_lib`` connection in Airflow's JSON form."""
    return json.dumps({"conn_type": "scheduler_lib", "host": url, "extra": extra})


@pytest.fixture
def scheduler_lib_conn(
    db_url: str, airflow_home: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """``scheduler_lib_default`` pointing at this test's broker database (both backends);
    the brokers hooks opened on it are closed before the database is dropped."""
    from scheduler_lib.airflow import hooks

    monkeypatch.setenv("AIRFLOW_CONN_SCHEDULER_LIB_DEFAULT", connection(db_url))
    try:
        yield db_url
    finally:
        hooks.close_brokers()


@pytest.fixture
def spark_worker(scheduler_lib_conn: str, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``scheduler-lib worker`` on the test's broker: a real Spark driver (``local[2]``)
    in its own process, serving spark_sql, python and sql tasks with up to 4 readers; its
    OpenLineage events go to ``lineage.jsonl`` in the test's ``tmp_path``."""
    # The lowest-Airflow job installs what Airflow's environment needs, without Spark.
    pytest.importorskip("pyspark", reason="Spark is not installed (the `spark` extra)")
    warehouse = tmp_path / "warehouse"
    # OpenLineage's file transport: each task's lineage events, one a line (test_dags)
    lineage = {
        "OPENLINEAGE__TRANSPORT__TYPE": "file",
        "OPENLINEAGE__TRANSPORT__LOG_FILE_PATH": str(tmp_path / "lineage.jsonl"),
        "OPENLINEAGE__TRANSPORT__APPEND": "true",
    }
    environment = {**os.environ, "PYSPARK_PYTHON": sys.executable, **lineage}
    with Processes(tmp_path, environment) as processes:
        worker = processes.start(
            "worker",
            "worker",
            *("--db", scheduler_lib_conn, "--master", "local[2]", "--max-readers", "4"),
            *("--conf", f"spark.sql.warehouse.dir={warehouse}"),
            *("--conf", "spark.sql.shuffle.partitions=2"),
            *("--conf", "spark.ui.enabled=false"),
            cwd=tmp_path,
        )
        processes.wait_said(worker, "worker serving", WORKER_START)
        yield worker
