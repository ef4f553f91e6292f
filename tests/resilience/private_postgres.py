"""The private PostgreSQL cluster the resilience tests stop, restart and kill. It lives in
``bench/private_postgres.py`` because the recovery benchmark restarts one too."""

from bench.private_postgres import PrivatePostgres, find_bindir, unavailable_reason

__all__ = ["PrivatePostgres", "find_bindir", "unavailable_reason"]
