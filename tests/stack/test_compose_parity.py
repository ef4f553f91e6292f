"""stack/Procfile and docker-compose.yaml run the same commands (issue 23).

``make stack`` runs the compose file's services as processes on this machine (honcho on
``stack/Procfile``). Nothing runs the compose file here (no container engine), so the two
can drift unseen: this test reads both and checks that each Procfile line runs what its
compose service runs, the same entry point with the same flags and literal values, modulo
hosts, ports and sizes (which differ between containers and one machine, and come from
variables), and that neither puts a secret on a command line, where ``ps`` shows it.
"""

from __future__ import annotations

import json
import pathlib
import re
import shlex
from typing import Any

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Each process of the Procfile and the compose service it stands for. Compose scales one
# service where one machine runs two named processes.
SERVICE_OF = {
    "spark-master": "spark-master",
    "spark-worker-1": "spark-worker",
    "spark-worker-2": "spark-worker",
    "airflow-apiserver": "airflow-apiserver",
    "airflow-scheduler": "airflow-scheduler",
    "airflow-dag-processor": "airflow-dag-processor",
    "airflow-triggerer": "airflow-triggerer",
    "scheduler-lib-worker-1": "scheduler-lib-worker",
    "scheduler-lib-worker-2": "scheduler-lib-worker",
    "scheduler-lib-serve": "scheduler-lib-serve",
}

# Compose services with no Procfile line, and why.
NOT_PROCESSES = {
    # `python -m stack` uses the machine's PostgreSQL server and, before honcho starts,
    # does what the one-shots do (docker/postgres-init.sh, scheduler-lib init, airflow db
    # migrate and the admin user).
    "postgres": "the machine's server",
    "broker-init": "one shot: python -m stack's preparation",
    "metastore-init": "one shot: python -m stack's preparation (metastore_tables)",
    "airflow-init": "one shot: python -m stack's preparation",
    # Optional, behind the "transport" profile: not part of the default stack.
    "broker-endpoint": "profile-gated",
}

# The only options a Procfile line may have that its compose service lacks, and why. Every
# other option must be in both, with the same value after normalisation.
PROCESS_ONLY = {
    "spark-worker": {
        # In a container the hostname is the address the master and the drivers reach; on
        # one machine the worker must bind (and advertise) loopback.
        "--host": "one machine: the worker binds loopback",
        # Two workers on one machine need work directories of their own; in compose each
        # container has its own filesystem.
        "--work-dir": "one machine: a work directory per worker",
    },
    "scheduler-lib-worker": {
        # Two drivers on one machine cannot both have their UI on 4040 (compose publishes
        # each container's 4040 on a port of its own instead).
        "--conf spark.ui.port": "one machine: a UI port per driver",
    },
}

# What the entry point of each image adds in front of a compose `command`, by the
# Dockerfile the image is built from (None: an official image used as it is).
# - ./Dockerfile: its ENTRYPOINT (read below);
# - docker/airflow.Dockerfile: the official Airflow image's entrypoint runs `airflow` with
#   the command's words when the first is not a program (command ["scheduler"] is `airflow
#   scheduler`); the file sets no ENTRYPOINT of its own (checked below);
# - docker/spark.Dockerfile and apache/spark: the image's entrypoint runs the command as it
#   is given (a full path to spark-class or, through bash, spark-submit).
AIRFLOW_ENTRY_POINT = ["airflow"]

HOST_FLAGS = {"--host", "--metrics-host"}
PORT_FLAGS = {"--port", "--webui-port", "-p", "--metrics-port"}
HOST_CONFS = {"spark.driver.host", "spark.driver.bindAddress"}
PORT_CONFS = {"spark.ui.port"}
# Where a Spark application keeps state: a named volume in compose, .stack/ on one machine.
DIR_CONFS = {"spark.sql.warehouse.dir"}
_SPARK_URL = re.compile(r"(spark|thrift)://[^:/\s]+:[^/\s]+")
_SECRET_NAME = re.compile(r"PASSWORD|SECRET|_KEY\b|SCHEDULER_LIB_DB|_CONN\b|_CONN_")
_URL_WITH_PASSWORD = re.compile(r"://[^/\s:@]+:[^/\s@]+@")

Item = tuple[str, ...]  # ("--flag", value), ("--flag",) or (positional,)


def read_procfile(text: str) -> dict[str, str]:
    """The processes of a Procfile as honcho reads it: ``name: command`` lines."""
    processes = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9_-]+):\s*(.+)", line)
        assert match, f"not a Procfile line: {line!r}"
        assert match[1] not in processes, f"{match[1]} twice in the Procfile"
        processes[match[1]] = match[2]
    return processes


def entry_point(service: dict[str, Any]) -> list[str]:
    build = service.get("build")
    if build is None:
        return []
    dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
    text = (ROOT / dockerfile).read_text()
    declared = re.findall(r"^ENTRYPOINT (.+)$", text, re.M)
    if dockerfile == "docker/airflow.Dockerfile":
        assert not declared, "docker/airflow.Dockerfile overrides the official entrypoint"
        return AIRFLOW_ENTRY_POINT
    if not declared:
        return []
    return list(json.loads(declared[-1]))


def compose_words(service: dict[str, Any]) -> list[str]:
    """What a compose service runs, as words: its image's entry point and its command,
    with compose's ``$$`` (a literal ``$`` for the container's shell) as ``$``."""
    command = service["command"]
    words = shlex.split(command) if isinstance(command, str) else list(command)
    if words[:2] == ["bash", "-c"]:
        words = shlex.split(words[2])
    return [word.replace("$$", "$") for word in [*entry_point(service), *words]]


def value(word: str) -> str:
    """A literal stays itself; a command substitution stays itself (it names what runs);
    anything else with a ``$`` is a variable (a host, port or size of its environment)."""
    word = _SPARK_URL.sub(r"\1://HOST:PORT", word)
    if re.fullmatch(r"\$\([^)]*\)", word):
        return word
    return "VAR" if "$" in word else word


def normalise(words: list[str]) -> list[Item]:
    """A command line as items: positionals and ``--flag value`` pairs, with hosts as
    HOST, ports as PORT, state directories as DIR and variables as VAR."""
    words = list(words)
    if words and words[0] in ("exec", "again"):  # the shell's exec; stack/bin/again's loop
        words = words[1:]
    if words and words[0].startswith("/opt/spark/bin/"):
        words[0] = pathlib.PurePosixPath(words[0]).name
    items: list[Item] = []
    index = 0
    while index < len(words):
        word = words[index]
        following = words[index + 1] if index + 1 < len(words) else None
        if not word.startswith("-"):
            items.append((value(word),))
            index += 1
            continue
        if following is None or following.startswith("-"):
            items.append((word,))
            index += 1
            continue
        if word in HOST_FLAGS:
            items.append((word, "HOST"))
        elif word in PORT_FLAGS:
            items.append((word, "PORT"))
        elif word == "--conf":
            key, _, setting = following.partition("=")
            if key in HOST_CONFS:
                setting = "HOST"
            elif key in PORT_CONFS:
                setting = "PORT"
            elif key in DIR_CONFS:
                setting = "DIR"
            else:
                setting = value(setting)
            items.append((f"--conf {key}", setting))
        else:
            items.append((word, value(following)))
        index += 2
    return items


def differences(process: list[str], service: list[str], allowed: set[str]) -> list[str]:
    """How a Procfile command differs from its compose service's (empty when alike)."""
    ours = [item for item in normalise(process) if item[0] not in allowed]
    theirs = normalise(service)
    if ours == theirs:
        return []
    # The same order in both files, so that they read side by side.
    return [f"Procfile: {render(ours)}", f"compose:  {render(theirs)}"]


def render(items: list[Item]) -> str:
    return " ".join(
        "=".join(item) if item[0].startswith("--conf ") else " ".join(item) for item in items
    )


@pytest.fixture(scope="module")
def procfile() -> dict[str, str]:
    return read_procfile((ROOT / "stack" / "Procfile").read_text())


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    # The raw file: ${NAME} is compose's own substitution from .env (a variable here too)
    return dict(yaml.safe_load((ROOT / "docker-compose.yaml").read_text())["services"])


def test_every_process_is_a_compose_service_and_back(
    procfile: dict[str, str], services: dict[str, Any]
) -> None:
    # Then every Procfile process stands for a compose service
    assert set(procfile) == set(SERVICE_OF), (
        f"Procfile processes not mapped: {sorted(set(procfile) - set(SERVICE_OF))}; "
        f"mapped but gone: {sorted(set(SERVICE_OF) - set(procfile))}"
    )
    assert set(SERVICE_OF.values()) <= set(services)
    # And every compose service runs in the Procfile, but the ones python -m stack's
    # preparation stands for and the profile-gated endpoint
    missing = set(services) - set(SERVICE_OF.values()) - set(NOT_PROCESSES)
    assert not missing, f"compose services with no Procfile line: {sorted(missing)}"
    assert set(NOT_PROCESSES) <= set(services)
    for name in ("broker-init", "airflow-init"):
        assert services[name]["restart"] == "no", f"{name} is no longer a one shot"
    assert services["broker-endpoint"].get("profiles"), "broker-endpoint is no longer optional"


@pytest.mark.parametrize("process", sorted(SERVICE_OF))
def test_each_process_runs_what_its_service_runs(
    process: str, procfile: dict[str, str], services: dict[str, Any]
) -> None:
    service = SERVICE_OF[process]
    # Given the Procfile line and the compose service's command, both normalised
    # When the options only one machine needs are set aside
    found = differences(
        shlex.split(procfile[process]),
        compose_words(services[service]),
        set(PROCESS_ONLY.get(service, {})),
    )
    # Then they run the same entry point with the same flags and values, in the same order
    assert not found, f"{process} drifted from compose's {service}:\n" + "\n".join(found)


def test_the_process_only_options_are_used(procfile: dict[str, str]) -> None:
    # Then each allowance is still needed (an unused one would hide a drift later)
    for service, options in PROCESS_ONLY.items():
        for option in options:
            for process in (p for p, s in SERVICE_OF.items() if s == service):
                keys = {item[0] for item in normalise(shlex.split(procfile[process]))}
                assert option in keys, f"{process} no longer uses {option}: drop its allowance"


def test_a_drift_is_found(procfile: dict[str, str], services: dict[str, Any]) -> None:
    # Given the worker's Procfile line with one flag changed, one dropped, one value changed
    line = procfile["scheduler-lib-worker-1"]
    compose = compose_words(services["scheduler-lib-worker"])
    allowed = set(PROCESS_ONLY["scheduler-lib-worker"])
    assert not differences(shlex.split(line), compose, allowed)
    for changed in (
        line.replace("--max-readers", "--max-reader"),
        line.replace(' --queue-readers "$SCHEDULER_LIB_QUEUE_READERS"', ""),
        line.replace("spark.executor.memory=$SPARK_EXECUTOR_MEMORY", "spark.executor.memory=2g"),
        line.replace("spark-submit", "spark-shell"),
        line + " --idle-exit 30",
    ):
        assert changed != line
        # Then each is a difference
        assert differences(shlex.split(changed), compose, allowed), changed
    # And so is a process-only option on a service that is not allowed it
    master = procfile["spark-master"] + " --work-dir /tmp/x"
    assert differences(shlex.split(master), compose_words(services["spark-master"]), set())


def _secrets_in(words: list[str]) -> list[str]:
    found = []
    for index, word in enumerate(words):
        if word == "--db" or word.startswith("--db="):
            found.append(word)
        for name in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", word):
            if _SECRET_NAME.search(name):
                found.append(word)
        if _URL_WITH_PASSWORD.search(word):
            found.append(f"a URL with a password (word {index})")
    return found


def test_no_command_line_carries_a_secret(
    procfile: dict[str, str], services: dict[str, Any]
) -> None:
    # Then no Procfile line passes a password, a key or the database URL (`ps` shows them):
    # they come from the environment python -m stack builds
    for process, line in procfile.items():
        assert not _secrets_in(shlex.split(line)), f"{process}: {_secrets_in(shlex.split(line))}"
    # And no compose command or health check does either (every service, one-shots too)
    for name, service in services.items():
        commands = []
        if "command" in service:
            commands.append(compose_words(service))
        test = service.get("healthcheck", {}).get("test")
        if test:
            commands.append(shlex.split(test) if isinstance(test, str) else list(test))
        for words in commands:
            words = [w for word in words for w in (shlex.split(word) if " " in word else [word])]
            assert not _secrets_in(words), f"{name}: {_secrets_in(words)}"
    # And the check can fail
    assert _secrets_in(["scheduler-lib", "worker", "--db", "$SCHEDULER_LIB_DB"])
    assert _secrets_in(["psql", "postgresql://app:pw@localhost/broker"])
    assert _secrets_in(["airflow", "users", "--password=${AIRFLOW_ADMIN_PASSWORD}"])


# Where compose keeps the metastore: the postgres service's metastore database, as the
# role of docker/postgres-metastore.sh's default name, the warehouse on spark-data.
COMPOSE_METASTORE = {
    "javax.jdo.option.ConnectionURL": "jdbc:postgresql://postgres:5432/metastore",
    "javax.jdo.option.ConnectionUserName": "metastore",
    "hive.metastore.warehouse.dir": "/data/warehouse",
}


def hive_properties(text: str) -> dict[str, str]:
    import xml.etree.ElementTree as ET

    return {
        p.findtext("name") or "": p.findtext("value") or ""
        for p in ET.fromstring(text).iter("property")
    }


@pytest.mark.parametrize(
    ("path", "service", "creates"),
    [
        ("docker/hive-site.xml", "scheduler-lib-worker", False),
        ("docker/metastore-init/hive-site.xml", "metastore-init", True),
    ],
)
def test_the_metastore_settings_are_the_stacks(
    services: dict[str, Any], path: str, service: str, creates: bool
) -> None:
    # Given the hive-site.xml python -m stack writes for the workers' metastore clients,
    # or for the one process that makes the metastore's tables, with compose's places
    from stack.run import hive_site, model_classes

    ours = hive_properties(
        hive_site(COMPOSE_METASTORE, create=model_classes() if creates else None)
    )
    # Then compose's file says the same, and its service mounts it
    assert hive_properties((ROOT / path).read_text()) == ours
    assert any(v.startswith(f"./{path}:") for v in services[service]["volumes"]), service
    # And no password is in it: the clients read it from their environment
    assert ours["javax.jdo.option.ConnectionPassword"] == "${env.METASTORE_DB_PASSWORD}"
    assert "METASTORE_DB_PASSWORD" in services[service]["environment"]
