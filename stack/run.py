"""The production-shaped stack as processes on this machine: ``make stack``.

What docker-compose.yaml runs in containers, without a container engine: the machine's
PostgreSQL (Airflow's metadata, the broker with the roles of docs/operations.md, and the
Hive metastore the worker applications share), Airflow as its own processes (api-server,
scheduler, dag-processor, triggerer; LocalExecutor), a
Spark standalone cluster (a master and two workers from the ``spark-class`` inside the
pyspark wheel), two ``scheduler-lib worker`` applications submitted to it, and
``scheduler-lib serve``. honcho supervises them from ``stack/Procfile``.

This module prepares what must exist before the processes start (databases and roles, the
broker's schema, Airflow's metadata schema, the metastore's tables, the admin user's
password file), builds the one environment every process gets, and hands over to honcho.
Secrets come from ``.env`` (or ``$STACK_ENV_FILE``) into that environment only: no command
line carries one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote

ROOT = Path(__file__).resolve().parents[1]
PROCFILE = ROOT / "stack" / "Procfile"
BIN = Path(sys.executable).parent

# Secrets and names read from the env file (.env, shared with docker-compose.yaml).
SECRETS = (
    "AIRFLOW_DB_PASSWORD",
    "BROKER_OWNER_PASSWORD",
    "BROKER_APP_PASSWORD",
    "BROKER_MONITOR_PASSWORD",
    "AIRFLOW_ADMIN_USERNAME",
    "AIRFLOW_ADMIN_PASSWORD",
    "AIRFLOW_FERNET_KEY",
    "AIRFLOW_JWT_SECRET",
    "AIRFLOW_API_SECRET_KEY",
    "SCHEDULER_LIB_TRANSPORT_KEY",
    "METASTORE_DB_PASSWORD",
)

# Ports, sizes and names of this stack; the process environment overrides each one (the
# tests give free ports and names of their own). Sizes keep the whole stack within 8 GiB:
# two Spark workers of 2 cores and 1 GiB, one 512 MiB executor and a 512 MiB driver per
# application, 256 MiB for each Spark daemon. A standalone worker's cores are executor
# slots, not CPUs: with one per worker, the two scheduler-lib workers (one core each)
# would hold the whole cluster, and a spark_submit task's application, or a worker that
# external activation launches, would wait for ever for a core.
DEFAULTS = {
    "STACK_DIR": str(ROOT / ".stack"),
    "STACK_ENV_FILE": str(ROOT / ".env"),
    # The DAGs Airflow parses: the checkout's examples, or a folder of the operator's own.
    "STACK_DAGS_FOLDER": str(ROOT / "dags"),
    "POSTGRES_HOST": "127.0.0.1",
    "POSTGRES_PORT": "5432",
    "POSTGRES_SUPERUSER": "postgres",
    "AIRFLOW_DB_NAME": "airflow",
    "AIRFLOW_DB_USER": "airflow",
    "BROKER_DB_NAME": "broker",
    "BROKER_OWNER_ROLE": "scheduler_lib_owner",
    "BROKER_APP_ROLE": "scheduler_lib_app",
    "BROKER_MONITOR_ROLE": "scheduler_lib_monitor",
    "METASTORE_DB_NAME": "metastore",
    "METASTORE_DB_USER": "metastore",
    # The worker applications' metastore clients reach PostgreSQL through its JDBC driver,
    # which the pyspark wheel lacks: Debian's libpostgresql-jdbc-java installs it here.
    "POSTGRES_JDBC_JAR": "/usr/share/java/postgresql.jar",
    "AIRFLOW_PORT": "8080",
    "AIRFLOW_SCHEDULER_HEALTH_PORT": "8974",
    "SPARK_MASTER_PORT": "7077",
    "SPARK_MASTER_UI_PORT": "8081",
    "SPARK_WORKER_1_UI_PORT": "8082",
    "SPARK_WORKER_2_UI_PORT": "8083",
    "SPARK_DRIVER_1_UI_PORT": "4040",
    "SPARK_DRIVER_2_UI_PORT": "4041",
    # /metrics and /healthz of each scheduler-lib process (docs/operations.md)
    "SCHEDULER_LIB_WORKER_1_METRICS_PORT": "9464",
    "SCHEDULER_LIB_WORKER_2_METRICS_PORT": "9465",
    "SCHEDULER_LIB_SERVE_METRICS_PORT": "9466",
    "SPARK_WORKER_CORES": "2",
    "SPARK_WORKER_MEMORY": "1g",
    "SPARK_EXECUTOR_MEMORY": "512m",
    "SPARK_DRIVER_MEMORY": "512m",
    "SPARK_APP_CORES": "1",
    "SPARK_DAEMON_MEMORY": "256m",
    # Two readers per worker application, four on the queue: a wave of four tasks runs at
    # once only when both applications take part.
    "SCHEDULER_LIB_MAX_READERS": "2",
    "SCHEDULER_LIB_QUEUE_READERS": "4",
}


class StackError(Exception):
    """A step of preparing the stack failed: one line saying which and what to do."""


def read_env_file(path: Path) -> dict[str, str]:
    """The ``KEY=value`` lines of ``path`` (docker compose's .env format)."""
    from dotenv import dotenv_values

    if not path.is_file():
        raise StackError(f"{path} does not exist: copy .env from the repository and edit it")
    return {k: v for k, v in dotenv_values(path).items() if v is not None}


def settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The stack's settings: defaults, overridden by ``environ``, plus the secrets of its
    env file."""
    environ = os.environ if environ is None else environ
    values = {k: environ.get(k, v) for k, v in DEFAULTS.items()}
    from_file = read_env_file(Path(values["STACK_ENV_FILE"]))
    missing = [k for k in SECRETS if not (environ.get(k) or from_file.get(k))]
    if missing:
        raise StackError(f"{values['STACK_ENV_FILE']} lacks {', '.join(missing)}")
    values.update({k: environ.get(k) or from_file[k] for k in SECRETS})
    return values


def url(s: Mapping[str, str], role: str, password: str, database: str, driver: str = "") -> str:
    scheme = "postgresql+" + driver if driver else "postgresql"
    return (
        f"{scheme}://{quote(role, safe='')}:{quote(password, safe='')}"
        f"@{s['POSTGRES_HOST']}:{s['POSTGRES_PORT']}/{database}"
    )


def process_environment(s: Mapping[str, str]) -> dict[str, str]:
    """The environment of every process of the stack (secrets included)."""
    home = Path(s["STACK_DIR"]) / "airflow"
    api = f"http://127.0.0.1:{s['AIRFLOW_PORT']}"
    app_url = url(s, s["BROKER_APP_ROLE"], s["BROKER_APP_PASSWORD"], s["BROKER_DB_NAME"])
    monitor_url = url(
        s, s["BROKER_MONITOR_ROLE"], s["BROKER_MONITOR_PASSWORD"], s["BROKER_DB_NAME"]
    )
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "SPARK"))}
    return {
        **inherited,
        **s,
        "PATH": os.pathsep.join([str(ROOT / "stack" / "bin"), str(BIN), inherited["PATH"]]),
        # Spark: the driver and the executors' Python workers run this venv's Python; the
        # cluster binds to loopback only.
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        # Spark's logging and the Hive metastore's settings (prepare writes them there;
        # the metastore's password is read from METASTORE_DB_PASSWORD, never written).
        "SPARK_CONF_DIR": str(Path(s["STACK_DIR"]) / "spark-conf"),
        "SPARK_DAEMON_MEMORY": s["SPARK_DAEMON_MEMORY"],
        # scheduler-lib worker and serve: the broker as the role that reads and writes rows
        "SCHEDULER_LIB_DB": app_url,
        "SCHEDULER_LIB_TRANSPORT_KEY": s["SCHEDULER_LIB_TRANSPORT_KEY"],
        # Airflow, as docker-compose.yaml's x-airflow-common, on this machine
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__AUTH_MANAGER": (
            "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
        ),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{s['AIRFLOW_ADMIN_USERNAME']}:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": url(
            s, s["AIRFLOW_DB_USER"], s["AIRFLOW_DB_PASSWORD"], s["AIRFLOW_DB_NAME"], "psycopg"
        ),
        # psycopg 3 for the async engine too (Airflow's default for it is asyncpg).
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC": url(
            s,
            s["AIRFLOW_DB_USER"],
            s["AIRFLOW_DB_PASSWORD"],
            s["AIRFLOW_DB_NAME"],
            "psycopg_async",
        ),
        "AIRFLOW__CORE__FERNET_KEY": s["AIRFLOW_FERNET_KEY"],
        "AIRFLOW__API_AUTH__JWT_SECRET": s["AIRFLOW_JWT_SECRET"],
        "AIRFLOW__API__SECRET_KEY": s["AIRFLOW_API_SECRET_KEY"],
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": s["AIRFLOW_PORT"],
        "AIRFLOW__API__BASE_URL": api,
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{api}/execution/",
        "AIRFLOW__CORE__DAGS_FOLDER": s["STACK_DAGS_FOLDER"],
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "true",
        "AIRFLOW__CORE__LOAD_EXAMPLES": "false",
        "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "true",
        "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_HOST": "127.0.0.1",
        "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_PORT": s[
            "AIRFLOW_SCHEDULER_HEALTH_PORT"
        ],
        "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(home / "logs"),
        "AIRFLOW_CONN_SCHEDULER_LIB_DEFAULT": json.dumps(
            {"conn_type": "scheduler_lib", "host": app_url, "extra": {"migrate": False}}
        ),
        # The Execution Status page reads as the monitor role (SELECT only).
        "AIRFLOW__SCHEDULER_LIB__UI_CONN_ID": "scheduler_lib_monitor",
        "AIRFLOW_CONN_SCHEDULER_LIB_MONITOR": json.dumps(
            {"conn_type": "scheduler_lib", "host": monitor_url, "extra": {"migrate": False}}
        ),
        # spark_submit tasks submit through the Spark provider's hook to this cluster.
        "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps(
            {"conn_type": "spark", "host": "spark://127.0.0.1", "port": int(s["SPARK_MASTER_PORT"])}
        ),
    }


def run(what: str, command: list[str], env: Mapping[str, str], stdin: str | None = None) -> str:
    """Run one preparation step; its output, or :class:`StackError` with its last lines."""
    done = subprocess.run(
        command, env=dict(env), input=stdin, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise StackError(f"{what} failed: " + " | ".join(tail))
    return done.stdout


def database_exists(s: Mapping[str, str], env: Mapping[str, str], name: str) -> bool:
    """Whether the database ``name`` exists (the name goes to psql as a variable, quoted by
    psql: a name of the environment's is never SQL)."""
    found = run(
        "psql",
        ["psql", "--no-psqlrc", "-tA", "-v", "ON_ERROR_STOP=1", "-v", f"name={name}"],
        {**env, **superuser(s)},
        stdin="SELECT count(*) FROM pg_database WHERE datname = :'name';\n",
    )
    return found.strip() != "0"


def superuser(s: Mapping[str, str]) -> dict[str, str]:
    return {
        "PGHOST": s["POSTGRES_HOST"],
        "PGPORT": s["POSTGRES_PORT"],
        "PGUSER": s["POSTGRES_SUPERUSER"],
        "PGDATABASE": "postgres",
    }


def prepare(s: Mapping[str, str], env: Mapping[str, str]) -> None:
    """Everything the processes need before they start; each step is a no-op when done."""
    if shutil.which("psql") is None:
        raise StackError("psql is not installed: install the PostgreSQL client (apt-get)")
    if not Path(s["POSTGRES_JDBC_JAR"]).is_file():
        raise StackError(
            f"{s['POSTGRES_JDBC_JAR']} does not exist: install PostgreSQL's JDBC driver for the "
            "Hive metastore (apt-get install libpostgresql-jdbc-java) or set POSTGRES_JDBC_JAR "
            "to its jar"
        )
    if not database_exists(s, env, s["BROKER_DB_NAME"]):
        # The databases and roles, as the compose stack's postgres service makes them.
        run(
            "docker/postgres-init.sh",
            ["bash", str(ROOT / "docker" / "postgres-init.sh")],
            {**env, **superuser(s)},
        )
    if not database_exists(s, env, s["METASTORE_DB_NAME"]):
        run(
            "docker/postgres-metastore.sh",
            ["bash", str(ROOT / "docker" / "postgres-metastore.sh")],
            {**env, **superuser(s)},
        )
    owner = url(s, s["BROKER_OWNER_ROLE"], s["BROKER_OWNER_PASSWORD"], s["BROKER_DB_NAME"])
    run(
        "scheduler-lib init",
        [str(BIN / "scheduler-lib"), "init"],
        {**env, "SCHEDULER_LIB_DB": owner},
    )
    spark_target(owner, s)
    home = Path(env["AIRFLOW_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    passwords = home / "passwords.json"
    passwords.write_text(json.dumps({s["AIRFLOW_ADMIN_USERNAME"]: s["AIRFLOW_ADMIN_PASSWORD"]}))
    passwords.chmod(0o600)
    run("airflow db migrate", [str(BIN / "airflow"), "db", "migrate"], env)
    for worker in ("worker-1", "worker-2"):
        (Path(s["STACK_DIR"]) / "spark" / worker).mkdir(parents=True, exist_ok=True)
    conf = Path(env["SPARK_CONF_DIR"])
    conf.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "stack" / "spark-conf" / "log4j2.properties", conf)
    jdbc = metastore_site(s)
    (conf / "hive-site.xml").write_text(hive_site(jdbc))
    metastore_tables(s, env, jdbc)


def metastore_site(s: Mapping[str, str]) -> dict[str, str]:
    """Where the metastore's tables are: its database and role on this machine's
    PostgreSQL, the warehouse under the stack's directory."""
    return {
        "javax.jdo.option.ConnectionURL": (
            f"jdbc:postgresql://{s['POSTGRES_HOST']}:{s['POSTGRES_PORT']}/{s['METASTORE_DB_NAME']}"
        ),
        "javax.jdo.option.ConnectionUserName": s["METASTORE_DB_USER"],
        "hive.metastore.warehouse.dir": str(Path(s["STACK_DIR"]) / "warehouse"),
    }


def metastore_tables(s: Mapping[str, str], env: Mapping[str, str], site: dict[str, str]) -> None:
    """The metastore's tables, made once by one process before any worker starts.

    Each worker application runs the metastore client embedded (no metastore service: Hive
    2.3's listens on every interface, with no setting to bind it to loopback). Two clients
    that create the tables on first use deadlock each other (seen: each holds locks the
    other's DDL waits for, across its own connections, where PostgreSQL cannot see the
    cycle), so the workers never create any: here Hive's HiveMetaTool opens the metastore
    once with every model class of the jar's ``package.jdo`` started up front, which
    creates all their tables (a no-op when they exist)."""
    spark_class = shutil.which("spark-class", path=env["PATH"])
    if spark_class is None:
        raise StackError("spark-class is not installed: make venv installs pyspark")
    init = Path(s["STACK_DIR"]) / "metastore-init"
    init.mkdir(parents=True, exist_ok=True)
    (init / "hive-site.xml").write_text(hive_site(site, create=model_classes()))
    run(
        "the metastore's tables (HiveMetaTool)",
        [spark_class, "org.apache.hadoop.hive.metastore.tools.HiveMetaTool", "-listFSRoot"],
        {**env, "SPARK_CONF_DIR": str(init), "SPARK_DIST_CLASSPATH": s["POSTGRES_JDBC_JAR"]},
    )


def model_classes() -> list[str]:
    """The metastore's persistent classes, as the hive-metastore jar in the pyspark wheel
    maps them (its ``package.jdo``)."""
    import xml.etree.ElementTree as ET
    import zipfile

    import pyspark

    (jar,) = (Path(pyspark.__file__).parent / "jars").glob("hive-metastore-*.jar")
    with zipfile.ZipFile(jar) as archive:
        root = ET.fromstring(archive.read("package.jdo"))
    return [
        f"{package.get('name')}.{cls.get('name')}"
        for package in root.iter("package")
        for cls in package.iter("class")
    ]


def spark_target(owner_url: str, s: Mapping[str, str]) -> None:
    """The Spark target as the workers make it, before they start: a DAG triggered while
    their drivers still start would otherwise find the target of `scheduler-lib init`
    (sql and python only) and be refused ("does not run 'spark_sql' tasks")."""
    from scheduler_lib.broker import Broker
    from scheduler_lib.broker.exceptions import BrokerError
    from scheduler_lib.scheduler import catalog
    from scheduler_lib.spark import worker

    target = catalog.Target(
        kinds=worker.KINDS,
        max_readers=int(s["SCHEDULER_LIB_QUEUE_READERS"]),
        procedure=worker.PROCEDURE,
    )
    try:
        with Broker(owner_url) as broker:
            catalog.init(broker, targets=[target])
    except BrokerError as exc:
        raise StackError(f"the Spark target: {exc}") from exc


def hive_site(site: Mapping[str, str], create: list[str] | None = None) -> str:
    """A hive-site.xml for metastore clients on PostgreSQL: ``site`` says where (see
    :func:`metastore_site`); with ``create``, the settings of the one process that creates
    the tables of those model classes (docker/hive-site.xml and
    docker/metastore-init/hive-site.xml have the same for compose)."""
    settings = {
        **site,
        "javax.jdo.option.ConnectionDriverName": "org.postgresql.Driver",
        # Hadoop's configuration reads it from the process environment when it is used.
        "javax.jdo.option.ConnectionPassword": "${env.METASTORE_DB_PASSWORD}",
        "datanucleus.schema.autoCreateAll": "true" if create else "false",
        "hive.metastore.schema.verification": "false",
        # Hive's asynchronous logging needs a jar the pyspark wheel does not ship.
        "hive.async.log.enabled": "false",
    }
    if create:
        settings["datanucleus.autoStartMechanism"] = "Classes"
        settings["datanucleus.autoStartClassNames"] = ",".join(create)
    properties = "".join(
        f"  <property><name>{k}</name><value>{v}</value></property>\n" for k, v in settings.items()
    )
    return f'<?xml version="1.0"?>\n<configuration>\n{properties}</configuration>\n'


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        s = settings()
        env = process_environment(s)
        print(f"stack: preparing databases and schemas in {s['STACK_DIR']}", flush=True)
        prepare(s, env)
    except StackError as exc:
        print(f"stack: {exc}", file=sys.stderr)
        return 1
    print(
        f"stack: Airflow on http://127.0.0.1:{s['AIRFLOW_PORT']} "
        f"(user {s['AIRFLOW_ADMIN_USERNAME']}, password from {s['STACK_ENV_FILE']}), Spark "
        f"master UI on http://127.0.0.1:{s['SPARK_MASTER_UI_PORT']}; Ctrl-C stops it all",
        flush=True,
    )
    # /dev/null as honcho's env file: everything is in this environment already, and honcho
    # would otherwise read .env over it.
    honcho = [str(BIN / "honcho"), "-f", str(PROCFILE), "-d", str(ROOT), "-e", os.devnull]
    os.execve(honcho[0], [*honcho, "start", *argv], env)
    return 0  # not reached
