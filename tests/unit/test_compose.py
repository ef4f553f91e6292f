"""docker-compose.yaml: no Docker engine here, so its shape is checked instead.

The file is interpolated with the committed ``.env`` exactly as ``docker compose`` would
(every variable must be defined there), validated against the Compose Specification's
JSON schema (``tests/data/compose-spec.json``, source named in ``tests/data/README.md``),
and held to the stack's own rules: pinned images, health checks on every long-running
service, named volumes, ``dags/`` and ``plugins/`` mounted, the services the docs name.
"""

from __future__ import annotations

import base64
import copy
import json
import pathlib
import re
from collections.abc import Mapping
from typing import Any

import jsonschema
import pytest
import tomllib
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "tests" / "data" / "compose-spec.json"
AIRFLOW_SERVICES = {
    "airflow-apiserver",
    "airflow-scheduler",
    "airflow-dag-processor",
    "airflow-triggerer",
}

# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ${NAME?error}, $NAME; $$ is "$".
_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?P<rest>[^}]*)\}"
    r"|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))"
)


def read_env(path: pathlib.Path) -> dict[str, str]:
    """KEY=VALUE lines of a compose ``.env`` file (comments and blank lines skipped)."""
    values = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), f".env:{number}: {line!r}"
        values[key] = value
    return values


def interpolate(node: Any, env: Mapping[str, str], used: set[str]) -> Any:
    """The compose file as Compose sees it after variable substitution; an undefined
    variable is an error, since the stack must start from the committed ``.env`` alone."""
    if isinstance(node, dict):
        return {k: interpolate(v, env, used) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env, used) for v in node]
    if not isinstance(node, str):
        return node

    def substitute(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["braced"] or match["plain"]
        used.add(name)
        assert name in env, f"${{{name}}} is not defined in .env"
        return env[name]

    return _VARIABLE.sub(substitute, node)


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    return read_env(ROOT / ".env")


@pytest.fixture(scope="module")
def compose(env: dict[str, str]) -> dict[str, Any]:
    raw = yaml.safe_load((ROOT / "docker-compose.yaml").read_text())
    return interpolate(raw, env, set())


def validate(document: Mapping[str, Any]) -> None:
    """Validate against the Compose Specification's schema, with its service constraint
    (``build`` or ``image``; a ``build`` object has a ``context``), which the schema file
    declares but does not reference."""
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft201909Validator(schema).validate(document)
    constraint = schema["definitions"]["constraints"]["service"]
    for service in document["services"].values():
        jsonschema.Draft201909Validator(constraint).validate(service)


def test_compose_file_follows_the_compose_specification(compose: dict[str, Any]) -> None:
    # Given the file as Compose reads it, When validated, Then the schema accepts it
    validate(compose)
    # And the check can fail: a misspelt key or a wrong type is refused
    for path, bad in (
        (("services", "postgres", "healtcheck"), {"test": ["NONE"]}),
        (("services", "postgres", "ports"), "5432:5432"),
        (("servces",), {}),
    ):
        broken = copy.deepcopy(compose)
        node = broken
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = bad
        with pytest.raises(jsonschema.ValidationError):
            validate(broken)


def test_every_variable_comes_from_env_and_every_secret_says_change_me(
    env: dict[str, str],
) -> None:
    # Given the raw compose file and .env
    raw = yaml.safe_load((ROOT / "docker-compose.yaml").read_text())
    used: set[str] = set()
    interpolate(raw, env, used)
    # Then .env holds nothing the file does not use
    assert set(env) == used, f"unused in .env: {sorted(set(env) - used)}"
    # And each secret is marked as a local default to change (on its line or the comment
    # just above it)
    lines = (ROOT / ".env").read_text().splitlines()
    for index, line in enumerate(lines):
        key = line.partition("=")[0]
        if re.search(r"PASSWORD|SECRET|_KEY$", key) and not line.startswith("#"):
            context = line + (lines[index - 1] if index else "")
            assert "change-me" in context or "change me" in context, key
    # And the Fernet key is a valid one (Airflow refuses to start otherwise)
    assert len(base64.urlsafe_b64decode(env["AIRFLOW_FERNET_KEY"])) == 32


def test_compose_services_are_pinned_and_wired(compose: dict[str, Any]) -> None:
    services = compose["services"]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    version = pyproject["project"]["version"]
    # Then every image has an explicit tag, never "latest"; images of official projects
    # carry a version number; images built here carry the package's version
    for name, service in services.items():
        image = service.get("image")
        assert image, f"service {name} has no image"
        assert ":" in image and not image.endswith(":latest"), f"{name}: unpinned {image}"
        tag = image.rsplit(":", 1)[1]
        if "build" in service:
            assert tag == version, f"{name}: a built image is tagged {version}, not {tag}"
        else:
            assert re.match(r"\d+\.\d+", tag), f"{name}: {image} names no release"
    # And the Dockerfiles start from pinned images: Airflow and Spark as pinned in pyproject
    spark_pin = next(d for d in pyproject["project"]["optional-dependencies"]["spark"])
    spark_version = spark_pin.split("==")[1]
    assert services["spark-master"]["image"] == (
        f"apache/spark:{spark_version}-scala2.13-java17-ubuntu"
    )
    # pyproject declares a range for Airflow; the tested release is constraints.txt's pin
    airflow_version = re.search(
        r"^apache-airflow==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M
    )
    assert airflow_version, "constraints.txt pins no apache-airflow"
    froms = {
        path.name: re.findall(r"^FROM (\S+)", path.read_text(), re.M)
        for path in (ROOT / "docker").glob("*.Dockerfile")
    }
    assert froms["airflow.Dockerfile"] == [f"apache/airflow:{airflow_version[1]}-python3.11"]
    assert froms["spark.Dockerfile"] == [services["spark-master"]["image"]]
    for path in [ROOT / "Dockerfile", *(ROOT / "docker").glob("*.Dockerfile")]:
        text = path.read_text()
        assert "constraints.txt" in text, f"{path.name} installs without the pins"
        for base in re.findall(r"^FROM (\S+)", text, re.M):
            assert re.search(r":\d+\.\d+", base), f"{path.name}: unpinned FROM {base}"
    # And what they copy is in the build context, which .dockerignore keeps to that
    allowed = {
        line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line[:1] == "!"
    }
    for path in [ROOT / "Dockerfile", *(ROOT / "docker").glob("*.Dockerfile")]:
        for copy_line in re.findall(r"^COPY (.+)$", path.read_text(), re.M):
            sources = [w for w in copy_line.split()[:-1] if not w.startswith("--")]
            assert set(sources) <= allowed, f"{path.name}: {sources} not in the build context"
    # And every build names a Dockerfile that exists
    for name, service in services.items():
        build = service.get("build")
        if build is not None:
            context = build if isinstance(build, str) else build["context"]
            dockerfile = "Dockerfile" if isinstance(build, str) else build["dockerfile"]
            assert (ROOT / context / dockerfile).is_file(), f"{name}: no {dockerfile}"
    # And the broker is initialised only once PostgreSQL is healthy, on that database
    init = services["broker-init"]
    assert init["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "@postgres:5432/" in init["environment"]["SCHEDULER_LIB_DB"]
    assert init["command"] == ["init"]
    assert "healthcheck" in services["postgres"]
    # And the image it builds installs the pinned versions
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "-c constraints.txt" in dockerfile
    assert 'ENTRYPOINT ["scheduler-lib"]' in dockerfile
    # And every dependency names a service of the file
    for name, service in services.items():
        for other in service.get("depends_on", {}):
            assert other in services, f"{name} depends on a missing service {other}"


def test_long_running_services_have_health_checks_and_named_volumes(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    # Then every service but the one-shots has a health check and restarts
    one_shots = {name for name, s in services.items() if s.get("restart") == "no"}
    assert one_shots == {"broker-init", "airflow-init", "metastore-init"}
    for name, service in services.items():
        if name not in one_shots:
            assert service.get("healthcheck", {}).get("test"), f"{name}: no health check"
            assert service.get("restart") == "always", name
    # And a volume is either a named volume declared at the top or a file of this checkout
    declared = set(compose["volumes"])
    used = set()
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith(("./", "/")):
                assert (ROOT / source).exists(), f"{name}: {source} is not in the checkout"
            else:
                assert source in declared, f"{name}: volume {source} is not declared"
                used.add(source)
    assert used == declared
    # And state lives in named volumes: the databases, Airflow's logs, Spark's warehouse
    assert "postgres-data:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    assert any(v.startswith("spark-data:") for v in services["spark-worker"]["volumes"])
    assert any(v.startswith("spark-data:") for v in services["scheduler-lib-worker"]["volumes"])


def test_airflow_runs_the_four_components_with_dags_and_plugins(compose: dict[str, Any]) -> None:
    services = compose["services"]
    # Then the four Airflow 3 components run from the image that has scheduler_lib
    commands = {services[name]["command"][0] for name in AIRFLOW_SERVICES}
    assert commands == {"api-server", "scheduler", "dag-processor", "triggerer"}
    for name in [*AIRFLOW_SERVICES, "airflow-init"]:
        service = services[name]
        assert service["build"]["dockerfile"] == "docker/airflow.Dockerfile", name
        # dags/ and plugins/ of this checkout are mounted
        assert "./dags:/opt/airflow/dags:ro" in service["volumes"], name
        assert "./plugins:/opt/airflow/plugins:ro" in service["volumes"], name
        environment = service["environment"]
        # they share one JWT secret and reach the api-server's execution API by name
        assert environment["AIRFLOW__API_AUTH__JWT_SECRET"], name
        assert environment["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == (
            "http://airflow-apiserver:8080/execution/"
        )
        assert "@postgres:5432/airflow" in environment["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
        # the scheduler_lib connection uses the role that cannot change the schema
        connection = json.loads(environment["AIRFLOW_CONN_SCHEDULER_LIB_DEFAULT"])
        assert connection["conn_type"] == "scheduler_lib"
        assert connection["host"].startswith("postgresql://scheduler_lib_app:")
        assert connection["extra"] == {"migrate": False}
    # And the components start after Airflow's schema and the broker's schema exist
    for name in AIRFLOW_SERVICES:
        depends = services[name]["depends_on"]
        assert depends["airflow-init"]["condition"] == "service_completed_successfully"
        assert depends["broker-init"]["condition"] == "service_completed_successfully"


def test_the_page_reads_as_the_monitor_role_which_only_the_api_server_gets(
    compose: dict[str, Any], env: dict[str, str]
) -> None:
    services = compose["services"]
    # The Execution Status page (on the api-server) reads through its own connection...
    api = services["airflow-apiserver"]["environment"]
    name = api["AIRFLOW__SCHEDULER_LIB__UI_CONN_ID"]
    connection = json.loads(api[f"AIRFLOW_CONN_{name.upper()}"])
    assert connection["conn_type"] == "scheduler_lib"
    # ... as the monitor role (SELECT only), never migrating
    assert connection["host"].startswith("postgresql://scheduler_lib_monitor:")
    assert connection["extra"] == {"migrate": False}
    # And no other service is given the monitor role's password but the database's init
    password = env["BROKER_MONITOR_PASSWORD"]
    holders = sorted(n for n, s in services.items() if password in json.dumps(s))
    assert holders == ["airflow-apiserver", "postgres"]


def test_the_worker_is_submitted_to_the_spark_master(compose: dict[str, Any]) -> None:
    services = compose["services"]
    worker = services["scheduler-lib-worker"]
    script = worker["command"][-1]
    # Then spark-submit hosts `scheduler-lib worker` on the master of this stack
    assert worker["command"][:2] == ["bash", "-c"]
    assert "spark-submit" in script and "--master spark://spark-master:7077" in script
    assert '"$(scheduler-lib worker --entry-script)"' in script
    assert "spark.driver.host=scheduler-lib-worker" in script
    assert worker["hostname"] == "scheduler-lib-worker"
    # And driver and executors run the same image (same Spark, same Python path)
    assert worker["image"] == services["spark-worker"]["image"]
    assert "spark://spark-master:7077" in services["spark-worker"]["command"]
    assert "org.apache.spark.deploy.master.Master" in services["spark-master"]["command"]
    assert worker["environment"]["SCHEDULER_LIB_DB"].startswith("postgresql://scheduler_lib_app:")
    # And the database URL stays in the environment (the CLI's --db default), off the
    # command line that `ps` shows; the queue's cap over all workers is set with it
    assert "--db" not in script and "SCHEDULER_LIB_DB" not in script
    assert '--queue-readers "${SCHEDULER_LIB_QUEUE_READERS}"' in script


def test_serve_runs_the_other_targets_as_the_app_role(compose: dict[str, Any]) -> None:
    services = compose["services"]
    serve = services["scheduler-lib-serve"]
    # Then `scheduler-lib serve` runs from the package's image, once the schema exists
    assert serve["image"] == services["broker-init"]["image"]
    assert serve["command"] == ["serve", "--metrics-port", "9464", "--metrics-host", "0.0.0.0"]
    # And its health check is its own /healthz (the database answers, the readers loop)
    assert "http://127.0.0.1:9464/healthz" in " ".join(serve["healthcheck"]["test"])
    assert serve["depends_on"]["broker-init"]["condition"] == "service_completed_successfully"
    assert serve["restart"] == "always"
    # And as the role that reads and writes rows, from the environment
    assert serve["environment"]["SCHEDULER_LIB_DB"].startswith("postgresql://scheduler_lib_app:")


def test_postgres_holds_both_databases_through_the_init_script(compose: dict[str, Any]) -> None:
    postgres = compose["services"]["postgres"]
    # Then the init script is mounted where the image runs it on first start
    assert (
        "./docker/postgres-init.sh:/docker-entrypoint-initdb.d/10-databases.sh:ro"
        in postgres["volumes"]
    )
    # And it gets every password it needs
    script = (ROOT / "docker" / "postgres-init.sh").read_text()
    for needed in re.findall(r'"\$\{(\w+_PASSWORD):\?\}"', script):
        assert postgres["environment"][needed], needed
    # And health waits for TCP, which listens only once the init scripts are done
    assert "-h 127.0.0.1" in " ".join(postgres["healthcheck"]["test"])


def _named_services(text: str) -> set[str]:
    """Services a document names: the first column of its services table, and the
    service argument of the ``docker compose`` commands in it."""
    names = set(re.findall(r"^\| `([a-z][a-z0-9-]*)` \|", text, re.M))
    for command in re.findall(r"docker compose [^\n]*", text):
        words = command.split()
        action = words[2] if len(words) > 2 else ""
        if action in {"logs", "exec", "restart", "stop", "start", "run"}:
            rest = [w for w in words[3:] if not w.startswith("-")]
            if rest:
                names.add(re.match(r"[a-z0-9-]*", rest[0])[0])
    return names


def test_every_service_the_docs_name_exists(compose: dict[str, Any]) -> None:
    services = set(compose["services"])
    operations = (ROOT / "docs" / "operations.md").read_text()
    named = _named_services(operations)
    # Then the operations guide's table lists every service, and names no other
    assert services <= named, f"not described in docs/operations.md: {services - named}"
    for path in ("docs/operations.md", "docs/architecture.md", "README.md"):
        missing = _named_services((ROOT / path).read_text()) - services
        assert not missing, f"{path} names services the stack lacks: {missing}"
