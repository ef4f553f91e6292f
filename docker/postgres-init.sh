#!/usr/bin/env bash
# Creates the stack's two databases on one PostgreSQL, once, when the postgres service
# initialises its data directory (the image runs /docker-entrypoint-initdb.d/*.sh then):
#   airflow  Airflow's metadata, owned by the role airflow
#   broker   scheduler_lib's broker, owned by scheduler_lib_owner (schema changes:
#            `scheduler-lib init`), used by scheduler_lib_app (workers, Airflow: rows only)
#            and scheduler_lib_monitor (read only)
# The privileges are the ones docs/operations.md ("Database roles") explains and tests.
# Also runs against any PostgreSQL as a superuser (psql's PGHOST, PGPORT, PGUSER...).
# Names can be overridden through the environment (the tests do); passwords must be given.
set -euo pipefail

: "${AIRFLOW_DB_PASSWORD:?}" "${BROKER_OWNER_PASSWORD:?}" "${BROKER_APP_PASSWORD:?}"
: "${BROKER_MONITOR_PASSWORD:?}"

psql --no-psqlrc -v ON_ERROR_STOP=1 \
    --username "${POSTGRES_USER:-${PGUSER:-postgres}}" \
    --dbname "${POSTGRES_DB:-${PGDATABASE:-postgres}}" \
    -v airflow_db="${AIRFLOW_DB_NAME:-airflow}" \
    -v airflow_role="${AIRFLOW_DB_USER:-airflow}" \
    -v airflow_password="${AIRFLOW_DB_PASSWORD}" \
    -v broker_db="${BROKER_DB_NAME:-broker}" \
    -v owner="${BROKER_OWNER_ROLE:-scheduler_lib_owner}" \
    -v owner_password="${BROKER_OWNER_PASSWORD}" \
    -v app="${BROKER_APP_ROLE:-scheduler_lib_app}" \
    -v app_password="${BROKER_APP_PASSWORD}" \
    -v monitor="${BROKER_MONITOR_ROLE:-scheduler_lib_monitor}" \
    -v monitor_password="${BROKER_MONITOR_PASSWORD}" <<'SQL'
CREATE ROLE :"airflow_role" LOGIN PASSWORD :'airflow_password';
CREATE DATABASE :"airflow_db" OWNER :"airflow_role";

CREATE ROLE :"owner" LOGIN PASSWORD :'owner_password';
CREATE ROLE :"app" LOGIN PASSWORD :'app_password';
CREATE ROLE :"monitor" LOGIN PASSWORD :'monitor_password';
CREATE DATABASE :"broker_db" OWNER :"owner";
REVOKE ALL ON DATABASE :"broker_db" FROM PUBLIC;
GRANT CONNECT ON DATABASE :"broker_db" TO :"app", :"monitor";

\connect :"broker_db"
SET ROLE :"owner";
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
GRANT USAGE ON SCHEMA public TO :"app", :"monitor";
ALTER DEFAULT PRIVILEGES IN SCHEMA public
    GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO :"app";
ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT USAGE, SELECT ON SEQUENCES TO :"app";
ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO :"monitor";
SQL
