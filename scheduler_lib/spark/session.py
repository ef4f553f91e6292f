"""The worker's SparkSession: built once per driver process, shared by its readers.

Readers are threads of one driver. PySpark pins each Python thread to a JVM thread, so a
reader's job group and scheduler pool (Spark *local properties*) apply to the jobs it
starts and to no one else's. Jobs of concurrent readers share the executors through the
FAIR scheduler, one pool per conversation priority: ``priority_1`` … ``priority_10``,
weighted by the level, so a priority-10 scheduler's tasks get ten times the share of a
priority-1 scheduler's while both run.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING
from xml.sax.saxutils import quoteattr

from scheduler_lib.broker.exceptions import BrokerError, InvalidArgument

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DEFAULT_MASTER = "local[*]"
APP_NAME = "scheduler-lib worker"
PRIORITY_LEVELS = range(1, 11)  # Service Broker's conversation priority levels
POOL_PREFIX = "priority_"

_lock = threading.Lock()
_session: SparkSession | None = None


class NoSparkSession(BrokerError):
    """A Spark task ran in a process without the worker's SparkSession."""


def pool_for(priority: int) -> str:
    """The FAIR-scheduler pool of a conversation priority level."""
    level = min(max(int(priority), PRIORITY_LEVELS[0]), PRIORITY_LEVELS[-1])
    return f"{POOL_PREFIX}{level}"


def allocation_xml() -> str:
    """The FAIR scheduler's pools: one per priority level, weight = level."""
    pools = "\n".join(
        f"  <pool name={quoteattr(pool_for(level))}>"
        f"<schedulingMode>FAIR</schedulingMode><weight>{level}</weight>"
        f"<minShare>0</minShare></pool>"
        for level in PRIORITY_LEVELS
    )
    return f'<?xml version="1.0"?>\n<allocations>\n{pools}\n</allocations>\n'


def _allocation_file() -> str:
    path = os.path.join(tempfile.gettempdir(), f"scheduler-lib-pools-{os.getuid()}.xml")
    text = allocation_xml()
    with contextlib.suppress(FileNotFoundError), open(path) as existing:
        if existing.read() == text:
            return path
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".xml")
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(tmp, path)  # atomic: a driver starting now never reads half a file
    return path


def parse_conf(pairs: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``key=value`` strings (``--conf``) as a dict; a malformed one is named."""
    conf: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise InvalidArgument(f"--conf takes key=value, got {pair!r}")
        conf[key.strip()] = value
    return conf


def build(
    master: str | None = None,
    conf: Mapping[str, str] | None = None,
    app_name: str = APP_NAME,
) -> SparkSession:
    """A SparkSession for a worker: FAIR scheduling with the priority pools, ``master``
    (default: what ``spark-submit`` set, else ``local[*]``) and ``conf`` on top.

    The session becomes this process's worker session (:func:`current`).
    """
    from pyspark import SparkConf
    from pyspark.sql import SparkSession

    settings = {
        "spark.scheduler.mode": "FAIR",
        "spark.scheduler.allocation.file": _allocation_file(),
        "spark.ui.showConsoleProgress": "false",  # readers share one terminal
    }
    settings.update(conf or {})
    builder = SparkSession.builder.appName(app_name)
    # Under spark-submit the master comes from its command line: keep it.
    if master is not None:
        builder = builder.master(master)
    elif not under_spark_submit() and not SparkConf().contains("spark.master"):
        builder = builder.master(DEFAULT_MASTER)
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    use(spark)
    return spark


@functools.cache
def identity(spark: SparkSession) -> tuple[str, str | None]:
    """(application id, Spark UI URL) of a session: fixed for its life, asked of the JVM
    once (each py4j call is a round trip)."""
    sc = spark.sparkContext
    return sc.applicationId, sc.uiWebUrl


def under_spark_submit() -> bool:
    """Whether spark-submit started this process (its JVM is already up and holds the
    master and settings from spark-submit's command line)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def stopped(spark: SparkSession) -> bool:
    """Whether the session's SparkContext stopped, or its JVM is gone (spark-submit's
    driver JVM was killed: the Python side must not linger)."""
    try:
        return bool(spark.sparkContext._jsc.sc().isStopped())
    except Exception:
        return True


def use(spark: SparkSession | None) -> None:
    """Make ``spark`` the session Spark tasks of this process run on (``None``: none)."""
    global _session
    with _lock:
        _session = spark


def current() -> SparkSession:
    """The session Spark tasks of this process run on.

    :raises NoSparkSession: outside a worker (``scheduler-lib worker``)
    """
    with _lock:
        spark = _session
    if spark is None:
        raise NoSparkSession(
            "no SparkSession in this process: Spark tasks run in `scheduler-lib worker` "
            "(or after scheduler_lib.spark.session.use(spark))"
        )
    return spark
