"""One ``make stack`` for every scenario of tests/stack (issue 23).

The stack is started once per session, as an operator starts it: ``make stack`` in a
process of its own, with the committed ``.env`` and nothing but free ports and names of
its own (its databases and roles on the machine's PostgreSQL, its state in a tmp dir).
Two additions an operator makes too: its DAGs folder holds the example DAGs and the
fault scenarios' DAGs (``tests/stack/dags``), and ``PYTHONPATH`` reaches this checkout,
so tasks on the workers can call ``tests.stack.marks``.

Scenarios leave the stack as they found it (a worker they kill is started again by
``stack/bin/again``, and they wait until it serves); the test that presses Ctrl-C runs
last (``stack_stop`` marker).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from bench.airflow_standalone import Api, Processes, free_port
from stack.run import DEFAULTS, read_env_file
from tests.airflow.test_standalone import chromium  # noqa: F401 - the browser fixture
from tests.stack.harness import (
    REPO,
    STOP_DEADLINE,
    SUPERUSER,
    MemorySampler,
    Stack,
    stack_processes,
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The test that stops the stack goes last (the others share the running stack)."""
    items.sort(key=lambda item: item.get_closest_marker("stack_stop") is not None)


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp_path = tmp_path_factory.mktemp("stack")
    suffix = uuid.uuid4().hex[:8]
    names = {
        "AIRFLOW_DB_NAME": f"stack_{suffix}_airflow",
        "AIRFLOW_DB_USER": f"stack_{suffix}_airflow",
        "BROKER_DB_NAME": f"stack_{suffix}_broker",
        "BROKER_OWNER_ROLE": f"stack_{suffix}_owner",
        "BROKER_APP_ROLE": f"stack_{suffix}_app",
        "BROKER_MONITOR_ROLE": f"stack_{suffix}_monitor",
        "METASTORE_DB_NAME": f"stack_{suffix}_metastore",
        "METASTORE_DB_USER": f"stack_{suffix}_metastore",
    }
    ports = {key: str(free_port()) for key in DEFAULTS if key.endswith("_PORT")}
    ports["POSTGRES_PORT"] = "5432"
    state = str(tmp_path / "stack")
    dags = tmp_path / "dags"
    dags.mkdir()
    for dag in [*(REPO / "dags").glob("*.py"), *(REPO / "tests" / "stack" / "dags").glob("*.py")]:
        shutil.copy(dag, dags)
    marks = tmp_path / "marks"
    marks.mkdir()
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "SPARK"))}
    env = {
        **inherited,
        **names,
        **ports,
        "STACK_DIR": state,
        "STACK_DAGS_FOLDER": str(dags),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), inherited.get("PYTHONPATH")])),
    }
    processes = Processes(tmp_path / "logs")
    make = processes.start("stack", ["make", "-s", "stack"], env, cwd=REPO)
    api = Api(f"http://127.0.0.1:{ports['AIRFLOW_PORT']}")
    sampler = MemorySampler(state)
    running = Stack(make, processes, env, api, names["BROKER_DB_NAME"], marks, sampler)
    sampler.start()
    try:
        running.wait_ready()
        secrets = read_env_file(REPO / ".env")
        api.login(secrets["AIRFLOW_ADMIN_USERNAME"], secrets["AIRFLOW_ADMIN_PASSWORD"])
        yield running
    finally:
        sampler.stop()
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                make.wait(STOP_DEADLINE)
        for process in stack_processes(state):
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)
        processes.stop_all()
        admin = sa.create_engine(SUPERUSER + "postgres", isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            for key in ("AIRFLOW_DB_NAME", "BROKER_DB_NAME", "METASTORE_DB_NAME"):
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{names[key]}" WITH (FORCE)'))
            roles = ("AIRFLOW_DB_USER", "BROKER_OWNER_ROLE", "BROKER_APP_ROLE", "METASTORE_DB_USER")
            for key in roles:
                conn.execute(sa.text(f'DROP ROLE IF EXISTS "{names[key]}"'))
            conn.execute(sa.text(f'DROP ROLE IF EXISTS "{names["BROKER_MONITOR_ROLE"]}"'))
        admin.dispose()
