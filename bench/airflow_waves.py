"""50 tiny Spark SQL statements in 5 waves of 10, under one ``airflow standalone``: our
operators vs. plain Airflow (one Airflow task per statement), in the same run.

Run from the repository root::

    .venv/bin/python -m bench.airflow_waves                  # broker on PostgreSQL (~10 min)
    .venv/bin/python -m bench.airflow_waves --db sqlite      # broker in a SQLite file
    .venv/bin/python -m bench.airflow_waves --rounds 1 --no-docs   # smoke run (~4 min)
    .venv/bin/python -m bench.airflow_waves --wait-idle 300  # each round on a quiet machine

The workload (``bench/airflow_dags/waves_workload.py``): statement i (1..50) is
``SELECT i AS n, count(*) AS c FROM range(100)`` — tiny, but a real Spark job each — in 5
waves of 10; wave N+1 starts after wave N has ended. Three DAGs of
``bench/airflow_dags/waves_dags.py`` run it:

  - ours: one ``OrderedWavesOperator`` (``deferrable=False``): one Airflow task sends the
    waves to a scheduler_lib Spark worker and waits for each;
  - ours, task group: ``ordered_waves(..., deferrable=True)``: get_scheduler, per wave
    one ExecAsync task that sends the wave and waits for it (in the triggerer once it has
    run 2 s), release (7 Airflow tasks);
  - native: one Airflow task per statement, the Spark provider's ``@task.pyspark`` on a
    ``spark_connect`` connection, each wave ``cross_downstream`` of the one before.

Both sides get a warm Spark: ours a long-running ``scheduler-lib worker --db URL --master
local[2] --max-readers 4`` (one Spark driver, readers are threads on it), native a Spark
Connect server (``spark-submit --class ...SparkConnectServer``, the connect jar PySpark
ships, ``--master local[2]``) that every task's session connects to, so no side starts
a JVM per statement. Both JVMs run for the whole run, started (and checked with a query)
before anything is timed; each side's tasks use only its own.

One ``airflow standalone`` (``bench/airflow_standalone.py``: a temporary home with
Airflow's default SQLite metadata database and LocalExecutor, a free port, the DAGs
folder ``bench/airflow_dags``, examples off) runs all three DAGs; the connections are
``AIRFLOW_CONN_*`` variables of its environment. No scheduler, executor or parallelism
setting is changed: both sides run with Airflow's defaults.

A run is timed from the trigger REST call (``POST .../dagRuns``) until this client sees
the run ``success`` (polling every 0.2 s), and the run's own ``start_date`` ->
``end_date`` from the API is recorded too. After --warmup (1) uncounted runs of each DAG,
--rounds (3) rounds each run every DAG once, one at a time, the order rotating from round
to round; with --wait-idle, each round first waits (up to that long) for other programs
to take under 10 % of the machine's CPU. Reported: each run's figures, the medians, and
ours / native of medians (target <= 0.25) for both forms of ours; per run also the task
instances, the most of them running at once, the sum of their durations, the CPU of the
whole harness and the share of the machine foreign work took. Any run that does not
succeed ends the benchmark with an error (non-zero exit); the processes' logs are then
kept and named.

Prints one JSON object on stdout, progress on stderr, and appends a dated section to
docs/benchmarks.md (unless --no-docs).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.metadata
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from bench.airflow_dags import waves_workload as workload
from bench.airflow_standalone import (
    BIN,
    Api,
    HarnessError,
    Processes,
    Standalone,
    free_port,
    parse_time,
    port_open,
    wait_for,
)
from bench.broker_throughput import (
    BUSY_WARNING_PCT,
    FOREIGN_WARNING_PCT,
    busy_pct,
    database,
    docs_section,
    finish_run,
    log,
    machine_busy,
    machine_facts,
    our_backends,
)

HERE = Path(__file__).resolve().parent
DAGS_FOLDER = HERE / "airflow_dags"
ROUNDS = 3
WARMUP = 1  # uncounted runs of each DAG before the rounds
MASTER = "local[2]"
READERS = 4  # the worker's --max-readers
TARGET_RATIO = 0.25  # ours / native wall time, at most
SPARK_START = 180.0  # seconds for a Spark JVM (worker, Connect server) to come up
RUN_TIMEOUT = 900.0  # seconds one DAG run may take
SIDES = {  # name -> DAG id
    "ours": workload.OURS_DAG_ID,
    "ours_group": workload.GROUP_DAG_ID,
    "native": workload.NATIVE_DAG_ID,
}
LABELS = {
    "ours": "ours: OrderedWavesOperator (1 Airflow task)",
    "ours_group": "ours, task group: ordered_waves() (7 Airflow tasks, one per wave)",
    "native": "native: one Airflow task per statement (50, @task.pyspark on Spark Connect)",
}
CONNECT_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"


# --- the Spark sides ---------------------------------------------------------------------


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def java_version() -> str | None:
    try:
        done = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    first = (done.stderr or done.stdout).splitlines()[:1]
    return first[0].split('"')[1] if first and '"' in first[0] else None


def start_connect_server(processes: Processes, env: dict[str, str], master: str) -> str:
    """A Spark Connect server (its own JVM) on a free port, answering; its ``sc://`` URL."""
    home = spark_home()
    port = free_port()
    argv = [
        str(home / "bin" / "spark-submit"),
        "--class",
        CONNECT_CLASS,
        "--master",
        master,
        "--name",
        "bench Spark Connect server",
        "--conf",
        f"spark.connect.grpc.binding.port={port}",
    ]
    processes.start("spark-connect", argv, {**env, "SPARK_HOME": str(home)})
    wait_for(
        lambda: (
            port_open(port)
            and "Spark Connect server started" in processes.log_text("spark-connect")
        ),
        SPARK_START,
        "the Spark Connect server listening",
        check=processes.check_alive,
    )
    url = f"sc://127.0.0.1:{port}"
    # One query through the client the native tasks use: the server really answers.
    from pyspark.sql import SparkSession

    session = SparkSession.builder.remote(url).getOrCreate()
    try:
        rows = session.sql(workload.STATEMENT.format(i=0)).collect()
        assert [list(r) for r in rows] == [[0, 100]], rows
    finally:
        session.stop()
    return url


def start_worker(
    processes: Processes, env: dict[str, str], url: str, master: str, readers: int
) -> None:
    """``scheduler-lib worker`` on the broker at ``url``, its Spark driver up."""
    argv = [
        str(BIN / "scheduler-lib"),
        "worker",
        "--db",
        url,
        "--master",
        master,
        "--max-readers",
        str(readers),
    ]
    processes.start("worker", argv, env)
    wait_for(
        lambda: "worker serving" in processes.log_text("worker"),
        SPARK_START,
        "the scheduler-lib worker serving",
        check=processes.check_alive,
    )


@contextlib.contextmanager
def broker_database(db: str, workdir: Path) -> Iterator[str]:
    if db == "postgresql":
        with database("airflow_waves") as url:
            yield url
    else:
        yield f"sqlite:///{workdir / 'broker.db'}"


# --- CPU: ours and foreign ----------------------------------------------------------------


def harness_cpu(backends: set[int]) -> float:
    """CPU seconds so far of this process and every descendant alive (with the children
    they reaped: a task runner that ended counts in its parent), plus the broker
    database's PostgreSQL backends."""
    total = 0.0
    me = psutil.Process()
    for pid in [me.pid, *(p.pid for p in me.children(recursive=True)), *backends]:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


class CpuWindow:
    """The CPU of one run: the harness's seconds, and everything else's ("foreign": other
    programs) as a percentage of the machine."""

    def __init__(self, broker_url: str) -> None:
        self.broker_url = broker_url
        self.postgresql = broker_url.startswith("postgresql")

    def __enter__(self) -> CpuWindow:
        self.backends = our_backends(self.broker_url) if self.postgresql else set()
        self.machine0, self.ours0 = machine_busy(), harness_cpu(self.backends)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.postgresql:
            self.backends |= our_backends(self.broker_url)
        ours = harness_cpu(self.backends) - self.ours0
        busy1, total1, _ = machine_busy()
        busy, total = busy1 - self.machine0[0], max(1e-9, total1 - self.machine0[1])
        self.seconds = round(ours, 2)
        self.foreign_pct = round(max(0.0, 100 * (busy - ours) / total), 1)


def wait_quiet(broker_url: str, limit: float | None) -> float:
    """Wait up to ``limit`` seconds for foreign work to take under ``FOREIGN_WARNING_PCT``
    of the machine (measured over 5 s windows; this harness's own idle work does not
    count); the last window's foreign percentage."""
    until = time.monotonic() + (limit or 0)
    while True:
        with CpuWindow(broker_url) as cpu:
            time.sleep(5.0 if limit else 1.0)
        if cpu.foreign_pct <= FOREIGN_WARNING_PCT or time.monotonic() >= until:
            return cpu.foreign_pct
        log(f"foreign work takes {cpu.foreign_pct}% of the machine; waiting for it to go quiet")


# --- one run -----------------------------------------------------------------------------


def most_at_once(tis: list[dict[str, Any]]) -> int:
    """The most task instances running at the same time (from their start/end dates)."""
    events = []
    for ti in tis:
        start, end = parse_time(ti.get("start_date")), parse_time(ti.get("end_date"))
        if start is not None and end is not None:
            events += [(start, 1), (end, -1)]
    running = best = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        running += step
        best = max(best, running)
    return best


def one_run(api: Api, side: str, processes: Processes, broker_url: str) -> dict[str, Any]:
    """Trigger ``side``'s DAG, wait for its end; its figures. Raises unless it succeeded."""
    dag_id = SIDES[side]
    with CpuWindow(broker_url) as cpu:
        triggered_at = time.time()
        started = time.monotonic()
        run_id = api.trigger(dag_id)["dag_run_id"]
        run = api.wait_run(dag_id, run_id, RUN_TIMEOUT, check=processes.check_alive)
        wall = time.monotonic() - started
    tis = api.task_instances(dag_id, run_id)
    if run["state"] != "success":
        states = sorted((t["task_id"], t["state"]) for t in tis)
        raise HarnessError(f"{dag_id} run {run_id} ended {run['state']}: task states {states}")
    start, end = parse_time(run["start_date"]), parse_time(run["end_date"])
    assert start is not None and end is not None
    return {
        "run_id": run_id,
        "wall_s": round(wall, 3),
        "run_s": round(end - start, 3),
        "trigger_to_start_s": round(start - triggered_at, 3),
        "task_instances": len(tis),
        "most_at_once": most_at_once(tis),
        "task_instance_s_sum": round(sum(t.get("duration") or 0.0 for t in tis), 3),
        "cpu_s": cpu.seconds,
        "foreign_cpu_pct": cpu.foreign_pct,
    }


# --- the benchmark ----------------------------------------------------------------------


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    samples: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    warmups: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    foreign_before_rounds: list[float] = []  # % of the machine
    with broker_database(args.db, workdir) as url, Processes(workdir / "logs") as processes:
        airflow = Standalone(processes, workdir, dags_folder=DAGS_FOLDER)
        log(f"Spark Connect server (master {args.master})")
        connect_url = start_connect_server(processes, airflow.env, args.master)
        log(f"scheduler-lib worker on {args.db} (master {args.master}, {args.readers} readers)")
        start_worker(processes, airflow.env, url, args.master, args.readers)
        airflow.env.update(
            AIRFLOW_CONN_SCHEDULER_LIB_DEFAULT=json.dumps(
                {"conn_type": "scheduler_lib", "host": url}
            ),
            **{
                f"AIRFLOW_CONN_{workload.SPARK_CONNECT_CONN_ID.upper()}": json.dumps(
                    {"conn_type": "spark_connect", "host": connect_url.removeprefix("sc://")}
                )
            },
        )
        log(f"airflow standalone on {airflow.base} (home {airflow.home})")
        began = time.monotonic()
        api = airflow.start()
        log(f"airflow standalone healthy after {time.monotonic() - began:.0f} s")
        for side, dag_id in SIDES.items():
            dag = api.wait_dag(dag_id, check=processes.check_alive)
            log(f"{side}: DAG {dag_id} parsed ({dag.get('fileloc')})")
            api.unpause(dag_id)

        def run(side: str, what: str, into: list[dict[str, Any]]) -> None:
            result = one_run(api, side, processes, url)
            into.append(result)
            log(
                f"{what} {side}: {result['wall_s']:.2f} s (run {result['run_s']:.2f} s, "
                f"{result['task_instances']} task instances, at most "
                f"{result['most_at_once']} at once; CPU {result['cpu_s']} s, foreign "
                f"{result['foreign_cpu_pct']}%)"
            )

        for w in range(args.warmup):
            for side in SIDES:
                run(side, f"warm-up {w + 1}/{args.warmup}", warmups[side])
        order = list(SIDES)
        for r in range(args.rounds):
            foreign = wait_quiet(url, args.wait_idle)
            foreign_before_rounds.append(foreign)
            if foreign > FOREIGN_WARNING_PCT:
                log(f"foreign work takes {foreign}% of the machine before round {r + 1}")
            for side in order[r % len(order) :] + order[: r % len(order)]:
                run(side, f"round {r + 1}/{args.rounds}", samples[side])
        out = summarize(samples)
        out["warmup_runs"] = warmups
        out["foreign_cpu_pct_before_rounds"] = foreign_before_rounds
        out["airflow_settings"] = sorted(k for k in airflow.env if k.startswith("AIRFLOW__"))
    return out


def summarize(samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for side, runs in samples.items():
        walls = [r["wall_s"] for r in runs]
        out[side] = {
            "median_s": round(statistics.median(walls), 3),
            "min_s": round(min(walls), 3),
            "max_s": round(max(walls), 3),
            "run_s_median": round(statistics.median(r["run_s"] for r in runs), 3),
            "trigger_to_start_s_median": round(
                statistics.median(r["trigger_to_start_s"] for r in runs), 3
            ),
            "task_instance_s_sum_median": round(
                statistics.median(r["task_instance_s_sum"] for r in runs), 3
            ),
            "cpu_s_median": round(statistics.median(r["cpu_s"] for r in runs), 2),
            "foreign_cpu_pct_max": max(r["foreign_cpu_pct"] for r in runs),
            "task_instances": max(r["task_instances"] for r in runs),
            "most_at_once": max(r["most_at_once"] for r in runs),
            "runs": runs,
        }
    native = out["native"]
    for side in ("ours", "ours_group"):
        per_round = [
            round(a["wall_s"] / b["wall_s"], 3)
            for a, b in zip(samples[side], samples["native"], strict=True)
        ]
        ratio = round(out[side]["median_s"] / native["median_s"], 3)
        out[f"ratio_{side}"] = {
            "of_medians": ratio,
            "per_round": per_round,
            "met": ratio <= TARGET_RATIO,
        }
    return out


def markdown_section(report: dict[str, Any]) -> str:
    c, r = report["config"], report["result"]

    def walls(side: str) -> str:
        return f"{r[side]['median_s']} ({', '.join(str(x['wall_s']) for x in r[side]['runs'])})"

    def all_sides(key: str) -> str:
        return " / ".join(str(r[side][key]) for side in SIDES)

    rows: list[tuple[str, Any, str, str]] = [
        (f"{LABELS[side]}, s median (per round)", walls(side), "", "") for side in SIDES
    ]
    for side, name in (("ours", "ours"), ("ours_group", "ours, task group")):
        x = r[f"ratio_{side}"]
        rows.append(
            (
                f"ratio {name} / native, of medians (per round)",
                f"{x['of_medians']} ({', '.join(str(p) for p in x['per_round'])})",
                f"<= {TARGET_RATIO}",
                "met" if x["met"] else "**missed**",
            )
        )
    rows += [
        (
            "run start_date -> end_date (API), s median, ours / task group / native",
            all_sides("run_s_median"),
            "",
            "",
        ),
        (
            "trigger call -> run start_date, s median, ours / task group / native",
            all_sides("trigger_to_start_s_median"),
            "",
            "",
        ),
        (
            "Airflow task instances per run, ours / task group / native",
            all_sides("task_instances"),
            "",
            "",
        ),
        (
            "most task instances running at once, ours / task group / native",
            all_sides("most_at_once"),
            "",
            "",
        ),
        (
            "sum of the task instances' durations, s median, ours / task group / native",
            all_sides("task_instance_s_sum_median"),
            "",
            "",
        ),
    ]
    rows += [
        (
            "CPU s per run of the harness (Airflow, both JVMs, the broker's backends), median, "
            "ours / task group / native",
            all_sides("cpu_s_median"),
            "",
            "",
        ),
        (
            "foreign CPU (other programs), % of the machine, max, ours / task group / native",
            all_sides("foreign_cpu_pct_max"),
            "",
            "",
        ),
    ]
    settings = ", ".join(f"`{k}`" for k in r["airflow_settings"])
    notes = [
        "Airflow settings made by the harness (`bench/airflow_standalone.py`), the same for "
        f"all three DAGs: {settings}; the connections are `AIRFLOW_CONN_*` variables. "
        "Everything else is Airflow's default (LocalExecutor, SQLite metadata database, "
        "scheduler and parallelism settings untouched)."
    ]
    foreign = max(r[side]["foreign_cpu_pct_max"] for side in SIDES)
    if foreign > FOREIGN_WARNING_PCT:
        notes.insert(
            0,
            f"Warning: foreign work (other programs) took up to {foreign}% of the machine's "
            "CPU during a run; the figures are noisy.",
        )
    return docs_section(
        "airflow_waves",
        report,
        f"{c['waves']} waves of {c['per_wave']} tiny Spark SQL statements "
        f"(`{workload.STATEMENT.format(i='i')}`), wave N+1 after wave N, under one `airflow "
        f"standalone` {c['airflow']}: ours — `OrderedWavesOperator` (one task, "
        "`deferrable=False`) and the `ordered_waves()` task group (one deferrable task "
        "per wave) — on "
        f"`scheduler-lib worker --master {c['master']} --max-readers {c['readers']}` "
        f"(broker on {c['db']}); native — one `@task.pyspark` task per statement, waves "
        f"joined by `cross_downstream` — on a Spark Connect server (master {c['master']}). "
        "Both JVMs warm and up for the whole run. Wall: the trigger REST call until the "
        f"client sees the run `success`; {c['rounds']} rounds, each DAG once per round in "
        f"rotating order, after {c['warmup_runs']} uncounted run(s) of each. Design in "
        "`bench/airflow_waves.py`'s docstring.",
        rows,
        notes,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.airflow_waves", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--db", choices=["postgresql", "sqlite"], default="postgresql", help="the broker's database"
    )
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="timed runs of each DAG")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="uncounted runs of each DAG")
    parser.add_argument("--master", default=MASTER, help="Spark master of both JVMs")
    parser.add_argument("--readers", type=int, default=READERS, help="the worker's readers")
    parser.add_argument(
        "--wait-idle",
        type=float,
        metavar="SECONDS",
        help=f"before each round, wait up to this long for other programs to take under "
        f"{FOREIGN_WARNING_PCT}%% of the machine",
    )
    parser.add_argument("--no-docs", action="store_true", help="do not append to the docs")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    # SIGTERM ends the run as Ctrl-C does: the finally blocks stop every process started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    idle_check = busy_pct(1.0)
    if idle_check > BUSY_WARNING_PCT:
        log(f"warning: the machine is {idle_check}% busy before the start; figures will be noisy")
    started = time.monotonic()
    report: dict[str, Any] = {
        "benchmark": "airflow_waves",
        "started_at": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(
            [Path(sys.executable).name, "-m", "bench.airflow_waves", *sys.argv[1:]]
        ),
        "quick": False,
        "machine": machine_facts(),
        "config": {
            "waves": workload.WAVES,
            "per_wave": workload.PER_WAVE,
            "statement": workload.STATEMENT,
            "db": args.db,
            "rounds": args.rounds,
            "warmup_runs": args.warmup,
            "master": args.master,
            "readers": args.readers,
            "airflow": importlib.metadata.version("apache-airflow"),
            "dags": SIDES,
        },
    }
    for package in ("apache-airflow", "apache-airflow-providers-apache-spark", "pyspark"):
        report["machine"]["packages"][package] = importlib.metadata.version(package)
    report["machine"]["packages"]["java"] = java_version()
    report["machine"]["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    report["machine"]["cpu_busy_pct_before_start"] = idle_check

    workdir = Path(tempfile.mkdtemp(prefix="bench_airflow_waves_"))
    try:
        report["result"] = measure(args, workdir)
    except BaseException:
        log(f"failed; the processes' logs are kept in {workdir / 'logs'}")
        raise
    shutil.rmtree(workdir, ignore_errors=True)
    r = report["result"]
    log(
        f"medians: ours {r['ours']['median_s']} s, task group {r['ours_group']['median_s']} s, "
        f"native {r['native']['median_s']} s; ours / native {r['ratio_ours']['of_medians']}, "
        f"task group / native {r['ratio_ours_group']['of_medians']} (target <= {TARGET_RATIO})"
    )
    return finish_run(report, started, None if args.no_docs else markdown_section)


if __name__ == "__main__":
    sys.exit(main())
