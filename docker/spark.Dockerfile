# Spark workers and the scheduler_lib worker (the Spark driver) share this image, so the
# driver and its executors run the same Spark (4.2.0, the pyspark pin) and the same Python
# at the same path: PySpark refuses executors whose Python minor version differs from the
# driver's. The official image brings Java 17, Spark and its launch scripts; its python3
# variant has Ubuntu 22.04's Python 3.10, older than scheduler_lib supports, so Ubuntu's
# python3.11 is added and scheduler_lib goes into a virtual environment of its own.
# PostgreSQL's JDBC driver (/usr/share/java/postgresql.jar) is for the Hive metastore's
# clients, whose tables are in PostgreSQL (docker/hive-site.xml).
FROM apache/spark:4.2.0-scala2.13-java17-ubuntu

USER root
RUN set -ex; \
    apt-get update; \
    apt-get install -y --no-install-recommends python3.11 python3.11-venv libpostgresql-jdbc-java; \
    rm -rf /var/lib/apt/lists/*; \
    python3.11 -m venv /opt/scheduler_lib/venv; \
    mkdir -p /data/warehouse; \
    chown -R spark:spark /data

COPY pyproject.toml constraints.txt README.md /opt/scheduler_lib/src/
COPY scheduler_lib /opt/scheduler_lib/src/scheduler_lib
# pyspark itself is the image's ($SPARK_HOME/python, with its py4j): a .pth file puts it on
# the environment's path instead of a second copy of Spark from PyPI.
RUN set -ex; \
    /opt/scheduler_lib/venv/bin/pip install --no-cache-dir \
        -c /opt/scheduler_lib/src/constraints.txt "/opt/scheduler_lib/src[binary]"; \
    site="$(/opt/scheduler_lib/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"; \
    { echo "${SPARK_HOME}/python"; ls "${SPARK_HOME}"/python/lib/py4j-*-src.zip; } > "${site}/spark.pth"; \
    /opt/scheduler_lib/venv/bin/python -c "import pyspark, scheduler_lib; print(pyspark.__version__)"

ENV PATH=/opt/scheduler_lib/venv/bin:${PATH} \
    PYSPARK_PYTHON=/opt/scheduler_lib/venv/bin/python \
    PYSPARK_DRIVER_PYTHON=/opt/scheduler_lib/venv/bin/python
USER spark
