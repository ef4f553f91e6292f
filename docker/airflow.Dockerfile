# Airflow 3.3 with scheduler_lib installed as a provider: the official image, plus this
# package and its `airflow` extra pinned with constraints.txt. apache-airflow is named with
# its version so that pip can never move the image's Airflow while resolving ours.
FROM apache/airflow:3.3.2-python3.11
COPY --chown=airflow:0 pyproject.toml constraints.txt README.md /opt/scheduler_lib/
COPY --chown=airflow:0 scheduler_lib /opt/scheduler_lib/scheduler_lib
RUN pip install --no-cache-dir -c /opt/scheduler_lib/constraints.txt \
        "apache-airflow==3.3.2" "/opt/scheduler_lib[airflow,binary]"
