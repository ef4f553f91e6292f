#!/usr/bin/env bash
# Creates the Hive metastore's database, once, beside docker/postgres-init.sh's (the
# postgres service runs both from /docker-entrypoint-initdb.d; `make stack` runs this one
# when the database is missing):
#   metastore  the table catalog every Spark worker application shares, owned by the role
#              metastore (the applications' embedded metastore clients connect as it; the
#              metastore-init one-shot creates its tables before any of them starts)
# Also runs against any PostgreSQL as a superuser (psql's PGHOST, PGPORT, PGUSER...).
# Names can be overridden through the environment (the tests do); the password must be given.
set -euo pipefail

: "${METASTORE_DB_PASSWORD:?}"

psql --no-psqlrc -v ON_ERROR_STOP=1 \
    --username "${POSTGRES_USER:-${PGUSER:-postgres}}" \
    --dbname "${POSTGRES_DB:-${PGDATABASE:-postgres}}" \
    -v metastore_db="${METASTORE_DB_NAME:-metastore}" \
    -v metastore_role="${METASTORE_DB_USER:-metastore}" \
    -v metastore_password="${METASTORE_DB_PASSWORD}" <<'SQL'
CREATE ROLE :"metastore_role" LOGIN PASSWORD :'metastore_password';
CREATE DATABASE :"metastore_db" OWNER :"metastore_role";
REVOKE ALL ON DATABASE :"metastore_db" FROM PUBLIC;
GRANT CONNECT, TEMPORARY ON DATABASE :"metastore_db" TO :"metastore_role";
SQL
