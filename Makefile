# Everything runs in .venv, created on first use with the pinned versions in constraints.txt.
PYTHON ?= python3
VENV := .venv
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv stack stack-test test test-quick test-lowest constraints-lowest lint bench bench-venv bench-components sql clean demo

venv: $(STAMP)

## uv installs the pinned set: a fresh clone's venv took 35 s here, 68 s with pip (most of
## uv's is building the pyspark sdists, which it builds again for each fresh venv); pip
## stays in the venv for the tests that install the package as users do.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade -c constraints.txt pip uv
	$(VENV)/bin/uv pip install --quiet --python $(PY) -c constraints.txt -e ".[airflow,spark,spark-submit,binary,demo,dev,stack]"
	touch $(STAMP)

## The whole suite (PostgreSQL tests skip locally without a server; CI=true makes them mandatory),
## on TEST_WORKERS pytest-xdist workers, a test file each at a time: most of a test's time is
## spent waiting on processes it started (Spark, Airflow, servers), so two workers on this
## 2-core machine take 20 min where one took 33. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadfile)

test: $(STAMP)
	$(PY) -m pytest --ignore=tests/stack $(XDIST) --durations=25

## The process stack's tests (tests/stack): make stack driven end to end, and its parity with
## docker-compose.yaml (.ci/run runs them after `make test`).
stack-test: $(STAMP)
	$(PY) -m pytest tests/stack -p no:cacheprovider --durations=0

## The provider's tests (and the transport's over TLS) on the lowest Airflow and Python that
## pyproject.toml declares, in a venv of their own pinned by constraints-lowest.txt (.ci/run
## runs it after `make test`, beside `make stack-test`). The package is installed as users install it (`pip install .`,
## not editable), again on every run. The provider's tests run on PostgreSQL only here: what
## this run proves is Airflow's and Python's lower bound, which the database does not change,
## and `make test` runs each of them on both databases (without the SQLite copies this run
## took 229 s here instead of 318).
LOWEST_VENV := .venv-lowest
LOWEST_STAMP := $(LOWEST_VENV)/.installed
LOWEST_PYTHON ?= python3.10

test-lowest: $(LOWEST_STAMP)
	$(LOWEST_VENV)/bin/python -m pip install --quiet --no-deps --force-reinstall .
	$(LOWEST_VENV)/bin/python -m pytest tests/airflow -m "not e2e" -k "not sqlite" -p no:cacheprovider $(XDIST) --durations=15
	# The transport over TLS: Python 3.10's asyncio TLS transport tells a lost connection
	# otherwise than 3.11's.
	$(LOWEST_VENV)/bin/python -m pytest tests/transport/test_protocol.py -k tls -p no:cacheprovider

# Installed by .venv's uv (constraints-lowest.txt is uv's output, and has no uv to pin).
$(LOWEST_STAMP): $(STAMP) pyproject.toml constraints-lowest.txt .ci/lowest.in
	test -x $(LOWEST_VENV)/bin/python || $(LOWEST_PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/uv pip install --quiet --python $(LOWEST_VENV)/bin/python -c constraints-lowest.txt ".[airflow,binary]" -r .ci/lowest.in
	touch $(LOWEST_STAMP)

## Write constraints-lowest.txt again from PyPI, as of the lowest Airflow's release day (uv).
constraints-lowest: $(STAMP)
	head -n 5 constraints-lowest.txt > constraints-lowest.txt.new
	$(VENV)/bin/uv pip compile --python-version 3.10 --exclude-newer 2025-10-24T00:00:00Z \
	  --exclude-newer-package apache-airflow=2025-10-28T00:00:00Z \
	  --exclude-newer-package apache-airflow-core=2025-10-28T00:00:00Z \
	  --exclude-newer-package apache-airflow-task-sdk=2025-10-28T00:00:00Z \
	  --exclude-newer-package apache-airflow-providers-common-compat=2026-01-18T00:00:00Z \
	  pyproject.toml --extra airflow --extra binary .ci/lowest.in --no-header --no-annotate \
	  >> constraints-lowest.txt.new
	mv constraints-lowest.txt.new constraints-lowest.txt

## The production-shaped stack on this machine: PostgreSQL's databases, Airflow's processes, a
## Spark standalone cluster, two workers and serve, under honcho (stack/Procfile); Ctrl-C stops it.
stack: $(STAMP)
	$(PY) -m stack

## The main job on the embedded default: the blog's waves as Spark SQL on SQLite + local[*].
demo: $(STAMP)
	$(PY) -m demo

## Lint: ruff, mypy on the library, import-linter for the layer rules.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

## The peers side by side (issue 10): scheduler_lib vs procrastinate, pgqueuer, Celery and the
## raw SKIP LOCKED ceiling on the local PostgreSQL and Redis, < 15 min; writes bench/results/
## and the peers block of docs/benchmarks.md. `.venv-bench/bin/python -m bench.peers --quick`
## is a ~2 min smoke run.
bench: $(BENCH_STAMP)
	$(BENCH_VENV)/bin/python -m bench.peers

## The peers' environment: our package with psycopg's binary wrapper (pinned by
## constraints.txt) and the peers at the exact versions of bench/requirements-peers.txt.
## They are installed without constraints.txt: Celery 5.7 pins python-dateutil 2.9,
## constraints.txt has Airflow's 4.0.
bench-venv: $(BENCH_STAMP)

$(BENCH_STAMP): pyproject.toml constraints.txt bench/requirements-peers.txt
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install --quiet -c constraints.txt -e ".[binary]"
	$(BENCH_VENV)/bin/python -m pip install --quiet -r bench/requirements-peers.txt
	touch $(BENCH_STAMP)

## Component benchmarks on the local PostgreSQL; figures are appended to docs/benchmarks.md.
bench-components: $(STAMP)
	$(PY) -m bench.broker_throughput
	$(PY) -m bench.priority_throughput
	$(PY) -m bench.activation_latency
	$(PY) -m bench.scheduler_loop
	$(PY) -m bench.transport
	$(PY) -m bench.spark_overhead
	$(PY) -m bench.airflow_waves

## Regenerate the reference DDL in sql/ from the migrations.
sql: $(STAMP)
	$(PY) -m scheduler_lib.cli ddl --dialect postgresql > sql/schema_postgresql.sql
	$(PY) -m scheduler_lib.cli ddl --dialect sqlite > sql/schema_sqlite.sql
	$(PY) -m scheduler_lib.cli ddl --dialect postgresql --schema scheduler > sql/scheduler_postgresql.sql
	$(PY) -m scheduler_lib.cli ddl --dialect sqlite --schema scheduler > sql/scheduler_sqlite.sql

clean:
	rm -rf $(VENV) $(LOWEST_VENV) .pytest_cache .mypy_cache .ruff_cache
