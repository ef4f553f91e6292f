"""The browser of the Airflow end-to-end tests, for the stack's."""

from tests.airflow.test_standalone import chromium  # noqa: F401
