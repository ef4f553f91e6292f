"""The package installs like a provider, in whatever environment runs these tests: the
pinned one of ``make test`` (Airflow 3.3, an editable install) and the lowest one of
``make test-lowest`` (Airflow 3.1.1 on Python 3.10, a plain ``pip install .``).

Airflow's own commands answer, in their own processes, from a directory outside the source
tree: ``airflow providers list`` names the provider, ``airflow dags list-import-errors``
finds none in the example DAGs, and the installed ``scheduler-lib`` finds its migrations.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from scheduler_lib.airflow import provider

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.slow


def airflow_json(args: list[str], cwd: Path, **env: str) -> Any:
    """What an ``airflow ... -o json`` command prints (after any warning lines)."""
    done = subprocess.run(
        [str(BIN / "airflow"), *args, "-o", "json"],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"airflow {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    start = next(
        (i for i, line in enumerate(done.stdout.splitlines()) if line.startswith(("[", "{"))),
        None,
    )
    assert start is not None, f"no JSON from airflow {' '.join(args)}:\n{done.stdout}"
    return json.loads("\n".join(done.stdout.splitlines()[start:]))


def test_airflow_lists_the_provider_with_its_version(airflow_home: Path, tmp_path: Path) -> None:
    providers = airflow_json(["providers", "list"], tmp_path)
    ours = [p for p in providers if p["package_name"] == provider.DISTRIBUTION]
    assert len(ours) == 1, providers
    assert ours[0]["version"] == metadata.version(provider.DISTRIBUTION)


def test_the_example_dags_parse_without_import_errors(airflow_home: Path, tmp_path: Path) -> None:
    folder = {"AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags")}
    errors = airflow_json(["dags", "list-import-errors", "--local"], tmp_path, **folder)
    assert errors == []
    dags = airflow_json(["dags", "list", "--local"], tmp_path, **folder)
    assert {d["dag_id"] for d in dags} == {"scheduler_lib_blog_waves", "scheduler_lib_batch_etl"}


def test_the_installed_command_finds_its_migrations(tmp_path: Path) -> None:
    # Given a directory outside the source tree, so the installed package is what runs
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    db = f"sqlite:///{tmp_path / 'installed.db'}"
    for args in (["init", "--db", db], ["queues", "--db", db], ["ddl", "--dialect", "sqlite"]):
        done = subprocess.run(
            [str(BIN / "scheduler-lib"), *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"scheduler-lib {args}:\n{done.stdout}\n{done.stderr}"
    queues = subprocess.run(
        [str(BIN / "scheduler-lib"), "queues", "--db", db],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "QueueAsyncTarget" in queues.stdout  # init made the scheduler's catalog


def test_the_wheel_carries_every_file_of_the_package(tmp_path: Path) -> None:
    """``pip install .`` installs a wheel: it must hold each file of scheduler_lib/ that git
    tracks (migrations, SQL, the Execution Status page's files), not only the modules."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    # Built from a copy of what git tracks, as from a fresh clone: no build/ or egg-info
    # left over from earlier builds that would supply files the configuration forgets.
    source = tmp_path / "source"
    for path in tracked:
        if (REPO / path).is_file():
            (source / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / path, source / path)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("scheduler_lib-*.whl")
    held = set(zipfile.ZipFile(wheel).namelist())
    package = [path for path in tracked if path.startswith("scheduler_lib/")]
    assert package, "git lists no file of scheduler_lib"
    missing = sorted(path for path in package if path not in held)
    assert not missing, f"the wheel lacks {missing}"
    entry_points = next(n for n in held if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[apache_airflow_provider]" in text and "scheduler-lib = scheduler_lib.cli:main" in text
