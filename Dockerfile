# The scheduler_lib image: the package and its command, pinned like a fresh checkout.
FROM python:3.11.14-slim-bookworm
WORKDIR /opt/scheduler_lib
COPY pyproject.toml constraints.txt README.md ./
COPY scheduler_lib ./scheduler_lib
RUN pip install --no-cache-dir -c constraints.txt ".[binary]"
ENTRYPOINT ["scheduler-lib"]
