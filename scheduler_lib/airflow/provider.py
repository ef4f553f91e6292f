"""What Airflow's providers manager reads (entry point ``apache_airflow_provider``)."""

from __future__ import annotations

from importlib import metadata
from typing import Any

DISTRIBUTION = "scheduler-lib"  # must equal the installed distribution's name (normalized)


def get_provider_info() -> dict[str, Any]:
    """The provider's description: hooks, operators, sensors, triggers, the connection
    type and its form, and its ``[scheduler_lib]`` configuration section."""
    try:
        version = metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        version = "0.0.0"
    return {
        "package-name": DISTRIBUTION,
        "name": "scheduler_lib",
        "description": "Ordered, durable, observable batch scheduling on a "
        "Service-Broker-style message broker, with Spark doing the work.",
        "versions": [version],
        "integrations": [
            {
                "integration-name": "scheduler_lib",
                "external-doc-url": "https://pypi.org/project/scheduler_lib/",
                "tags": ["software"],
            }
        ],
        "operators": [
            {
                "integration-name": "scheduler_lib",
                "python-modules": ["scheduler_lib.airflow.operators"],
            }
        ],
        "sensors": [
            {
                "integration-name": "scheduler_lib",
                "python-modules": ["scheduler_lib.airflow.sensors"],
            }
        ],
        "hooks": [
            {
                "integration-name": "scheduler_lib",
                "python-modules": ["scheduler_lib.airflow.hooks"],
            }
        ],
        "triggers": [
            {
                "integration-name": "scheduler_lib",
                "python-modules": ["scheduler_lib.airflow.triggers"],
            }
        ],
        "config": {
            "scheduler_lib": {
                "description": "The scheduler_lib provider: its Execution Status page in "
                "Airflow's UI (plugins/README.md).",
                "options": {
                    "ui_conn_id": {
                        "description": "The scheduler_lib connection whose broker the "
                        "Execution Status page shows.\n",
                        "version_added": None,
                        "type": "string",
                        "example": "scheduler_lib_prod",
                        "default": "scheduler_lib_default",
                    },
                    "ui_reconnect_timeout": {
                        "description": "Seconds a request of the Execution Status page "
                        "waits for an unavailable broker database before it answers 503 "
                        "with one line saying why (each connection attempt is bounded "
                        "too).\n",
                        "version_added": None,
                        "type": "float",
                        "example": "10",
                        "default": "5",
                    },
                },
            }
        },
        "connection-types": [
            {
                "connection-type": "scheduler_lib",
                "hook-class-name": "scheduler_lib.airflow.hooks.SchedulerLibHook",
                "hook-name": "scheduler_lib",
                "ui-field-behaviour": {
                    "hidden-fields": ["schema", "port", "login", "extra"],
                    "relabeling": {"host": "SQLAlchemy URL"},
                    "placeholders": {
                        "host": "postgresql://user@db-host:5432/broker",
                        "password": "put into the URL when the URL has none",
                        "target_service": "ServiceAsyncTarget",
                    },
                },
                "conn-fields": {
                    "target_service": {
                        "label": "Target service",
                        "description": "Where tasks go unless an operator names another.",
                        "schema": {"type": ["string", "null"]},
                    },
                    "migrate": {
                        "label": "Apply the schema",
                        "description": "Create/upgrade the broker's tables when it opens "
                        "(off for roles without DDL rights).",
                        "schema": {"type": ["boolean", "null"], "default": True},
                    },
                },
            }
        ],
    }
