# Everything runs in .venv, created on first use with the pinned versions in constraints.txt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test test-quick lint bench sql clean demo

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[airflow,demo,dev]"
	touch $(STAMP)

## The whole suite (PostgreSQL tests skip locally without a server; CI=true makes them mandatory).
test: $(STAMP)
	$(PY) -m pytest

## The main job on the embedded default: the blog's waves as Spark SQL on SQLite + local[*].
demo: $(STAMP)
	$(PY) -m demo

## Lint: ruff, mypy on the library, import-linter for the layer rules.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

## Benchmarks on the local PostgreSQL; figures are appended to docs/benchmarks.md.
bench: $(STAMP)
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
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
