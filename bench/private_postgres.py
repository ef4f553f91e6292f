"""A private, throw-away PostgreSQL cluster that tests may stop, restart and kill.

The shared server on 127.0.0.1:5432 must never be disturbed by a test, so resilience
tests run their own cluster: ``initdb`` into a temporary directory, a free TCP port on
127.0.0.1, a private Unix-socket directory, and ``pg_ctl`` to drive it. The server
binaries are this machine's (the newest ``/usr/lib/postgresql/<version>/bin``).

PostgreSQL refuses to run as root. When the test process is root, every server binary
(``initdb``, ``pg_ctl``, hence ``postgres``) runs as the ``postgres`` OS user through
``runuser -u postgres --`` (or ``setpriv`` when ``runuser`` is absent), and the temporary
directory is chowned to that user. Clients (``pg_isready``, psycopg) run as we are.

Every wait has a deadline and polls a condition; nothing sleeps and hopes. A server that
does not come up (or go down) in time raises ``RuntimeError`` with the tail of its log.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.rows import TupleRow

SERVER_USER = "postgres"  # the OS user the server runs as when we are root
TIMEOUT = 30.0  # seconds for the server to come up or go down
_POLL = 0.05
_STOP_MODES = ("smart", "fast", "immediate")


def find_bindir() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` holding the server binaries."""
    found = []
    for initdb in glob.glob("/usr/lib/postgresql/*/bin/initdb"):
        bindir = Path(initdb).parent
        version = bindir.parent.name
        if re.fullmatch(r"\d+(\.\d+)?", version) and all(
            (bindir / tool).is_file() for tool in ("initdb", "pg_ctl", "postgres", "pg_isready")
        ):
            found.append((tuple(int(part) for part in version.split(".")), bindir))
    return max(found)[1] if found else None


def _privilege_drop() -> list[str]:
    """The command prefix that runs a server binary as ``SERVER_USER`` (empty unless root)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("runuser"):
        return ["runuser", "-u", SERVER_USER, "--"]
    if shutil.which("setpriv"):
        return ["setpriv", f"--reuid={SERVER_USER}", f"--regid={SERVER_USER}", "--init-groups"]
    raise RuntimeError("running as root and neither runuser nor setpriv is available")


def unavailable_reason() -> str | None:
    """Why a private cluster cannot run on this machine, or None when it can."""
    if find_bindir() is None:
        return "no PostgreSQL server binaries under /usr/lib/postgresql/*/bin"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SERVER_USER)
        except KeyError:
            return f"running as root and there is no {SERVER_USER!r} OS user to run the server"
        if not (shutil.which("runuser") or shutil.which("setpriv")):
            return "running as root and neither runuser nor setpriv is available"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pid_exists(pid: int) -> bool:
    """Whether ``pid`` exists at all, zombies included."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (killed, not yet reaped)."""
    if not _pid_exists(pid):
        return False
    # A zombie (killed, not yet reaped) is as good as dead.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids of process group ``pgid``, from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def _working_in(directory: Path) -> list[int]:
    """Live (non-zombie) pids whose working directory is ``directory``: a server's
    processes (each backend calls setsid(), so the postmaster's process group does not
    hold them; all of them work in the data directory)."""
    target = str(directory.resolve())
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/cwd") != target:
                continue
        except OSError:
            continue
        if _pid_alive(int(entry)):
            found.append(int(entry))
    return found


class PrivatePostgres:
    """A private PostgreSQL cluster in a temporary directory, on a free port of 127.0.0.1.

    ``PrivatePostgres()`` runs initdb and starts the server; ``close()`` (also run at
    exit) stops it and removes every file.
    """

    def __init__(self, *, bindir: Path | str | None = None, start: bool = True) -> None:
        found = Path(bindir) if bindir is not None else find_bindir()
        if found is None:
            raise RuntimeError("no PostgreSQL server binaries under /usr/lib/postgresql/*/bin")
        self.bindir = found
        self._prefix = _privilege_drop()
        self._closed = False
        self._ever_started = False
        self.root = Path(tempfile.mkdtemp(prefix="pgpriv-"))
        self.datadir = self.root / "data"
        self.sockdir = self.root / "sock"
        self.logfile = self.root / "postgres.log"
        self.port = _free_port()
        atexit.register(self.close)
        try:
            self.sockdir.mkdir()
            self.logfile.touch()
            if self._prefix:
                user = pwd.getpwnam(SERVER_USER)
                for path in (self.root, self.sockdir, self.logfile):
                    os.chown(path, user.pw_uid, user.pw_gid)
            self._run(
                "initdb",
                "-D",
                str(self.datadir),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "--encoding=UTF8",
                "--locale=C",
            )
            if start:
                self.start()
        except BaseException:
            self.close()
            raise

    # -- addresses -------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The admin URL: ``postgresql://postgres@127.0.0.1:PORT/postgres``."""
        return self.url_for("postgres")

    def url_for(self, dbname: str) -> str:
        """The URL of database ``dbname`` on this server."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    # -- databases -------------------------------------------------------------------

    def create_database(self, name: str) -> str:
        """Create database ``name``; returns its URL."""
        with self._admin() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url_for(name)

    def drop_database(self, name: str) -> None:
        """Drop database ``name`` if it exists, disconnecting its sessions."""
        with self._admin() as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    def terminate_backends(self, dbname: str) -> int:
        """``pg_terminate_backend`` every other backend of ``dbname``; returns how many.

        Each termination waits (up to 5 s) for the backend to have exited.
        """
        with self._admin() as conn:
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 5000)) "
                "FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                (dbname,),
            ).fetchone()
        return int(row[0]) if row else 0

    # -- life cycle ------------------------------------------------------------------

    def is_accepting(self) -> bool:
        """Whether the server accepts connections now (``pg_isready``)."""
        result = subprocess.run(
            [
                str(self.bindir / "pg_isready"),
                *("-q", "-h", "127.0.0.1", "-p", str(self.port)),
                *("-U", "postgres", "-d", "postgres"),
            ],
            env=self._env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=TIMEOUT,
            check=False,
        )
        return result.returncode == 0

    def start(self) -> None:
        """Start the server (after a stop or a kill: crash recovery) and wait until it
        accepts connections."""
        self._check_open()
        if self._postmaster_pid() is not None:
            self._wait_for(self.is_accepting, "accept connections")
            return
        for attempt in range(3):
            offset = self._log_size()
            options = " ".join(
                shlex.quote(part)
                for part in (
                    f"-p{self.port}",
                    f"-k{self.sockdir}",
                    "-clisten_addresses=127.0.0.1",
                    "-cfsync=off",
                    "-cmax_connections=200",
                )
            )
            result = self._run(
                "pg_ctl",
                "-D",
                str(self.datadir),
                "-o",
                options,
                "-l",
                str(self.logfile),
                "-w",
                "-t",
                str(int(TIMEOUT)),
                "start",
                check=False,
            )
            if result.returncode == 0:
                break
            # The free port was taken between choosing and binding it: choose another,
            # but only before anyone has seen this server's URL.
            if not self._ever_started and attempt < 2 and self._log_mentions_port_in_use(offset):
                self.port = _free_port()
                continue
            raise RuntimeError(self._failure("pg_ctl start failed", result))
        self._ever_started = True
        self._wait_for(self.is_accepting, "accept connections")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``smart``, ``fast`` or ``immediate``) and wait until it is
        fully down. A server that is already down is left so."""
        if mode not in _STOP_MODES:
            raise ValueError(f"mode must be one of {_STOP_MODES}, got {mode!r}")
        self._check_open()
        pid = self._postmaster_pid()
        if pid is None:
            return
        result = self._run(
            "pg_ctl",
            "-D",
            str(self.datadir),
            "-m",
            mode,
            "-w",
            "-t",
            str(int(TIMEOUT)),
            "stop",
            check=False,
        )
        if result.returncode != 0 and self._postmaster_pid() is not None:
            raise RuntimeError(self._failure(f"pg_ctl stop -m {mode} failed", result))
        self._wait_down(pid)

    def restart(self, mode: str = "fast") -> None:
        """Stop (``mode``) then start; returns once the server accepts connections."""
        self.stop(mode)
        self.start()

    def kill(self) -> None:
        """SIGKILL the postmaster, as a crash would, and wait until the port refuses
        connections and every server process is gone (so a ``start()`` can recover)."""
        self._check_open()
        pid = self._postmaster_pid()
        if pid is None:
            return
        os.kill(pid, signal.SIGKILL)
        self._wait_down(pid)
        if _pid_exists(pid):
            # The killed postmaster is a zombie its adoptive parent has not reaped yet; the
            # next postmaster would take its lock files for live ones. Every server process
            # is gone, so drop them (pg_control still says "in production": the next start
            # runs crash recovery all the same).
            (self.datadir / "postmaster.pid").unlink(missing_ok=True)
            (self.sockdir / f".s.PGSQL.{self.port}.lock").unlink(missing_ok=True)

    def stop_for(self, seconds: float) -> tuple[float, float]:
        """An outage of ``seconds``: stop (fast), wait, start.

        Returns ``(stopped_at, accepting_again_at)`` in ``time.monotonic()`` time.
        """
        self.stop()
        stopped_at = time.monotonic()
        time.sleep(seconds)  # the outage itself, not a wait for a condition
        self.start()
        return stopped_at, time.monotonic()

    def close(self) -> None:
        """Stop the server (immediate) and remove its directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            pid = self._postmaster_pid()
            if pid is not None:
                self._run(
                    "pg_ctl", "-D", str(self.datadir), "-m", "immediate", "-w", "stop", check=False
                )
                if _pid_alive(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                self._wait_down(pid, refuse_port=False)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log."""
        try:
            text = self.logfile.read_text(errors="replace")
        except OSError:
            return "(no server log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> PrivatePostgres:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PrivatePostgres(port={self.port}, root={str(self.root)!r})"

    # -- internals -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.setdefault("LC_ALL", "C")
        return env

    def _run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [*self._prefix, str(self.bindir / tool), *args],
            cwd=self.root,  # the server user may not be able to enter our cwd
            env=self._env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=TIMEOUT + 15,
            check=False,
        )
        if check and result.returncode != 0:
            raise RuntimeError(self._failure(f"{tool} failed", result))
        return result

    def _admin(self) -> psycopg.Connection[TupleRow]:
        return psycopg.connect(self.url, autocommit=True, connect_timeout=5)

    def _postmaster_pid(self) -> int | None:
        """The pid of a live postmaster of this cluster, from ``data/postmaster.pid``."""
        try:
            first = (self.datadir / "postmaster.pid").read_text().split("\n", 1)[0]
            pid = int(first.strip())
        except (OSError, ValueError):
            return None
        return pid if _pid_alive(pid) else None

    def _port_refuses(self) -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            try:
                s.connect(("127.0.0.1", self.port))
            except OSError:
                return True
            return False

    def _wait_down(self, pid: int, *, refuse_port: bool = True) -> None:
        """Wait until postmaster ``pid`` and all its children are gone (and the port
        refuses connections). Backends orphaned by a killed postmaster notice its death
        and exit; stragglers still alive after a grace period are SIGKILLed."""
        try:
            pgid = os.getpgid(pid)
        except ProcessLookupError:
            pgid = pid
        # pg_ctl starts the postmaster in a session of its own: its group is the server.
        own_group = pgid == pid

        def down() -> bool:
            if _pid_alive(pid):
                return False
            if own_group and _group_members(pgid):
                return False
            # Backends still exiting keep the shared memory attached: a postmaster started
            # meanwhile refuses to run ("pre-existing shared memory block is still in use").
            if _working_in(self.datadir):
                return False
            return not refuse_port or self._port_refuses()

        grace = time.monotonic() + 10.0
        deadline = time.monotonic() + TIMEOUT
        while not down():
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError(self._failure(f"the server (pid {pid}) did not go down"))
            if now > grace and not _pid_alive(pid):
                if own_group:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pgid, signal.SIGKILL)
                for straggler in _working_in(self.datadir):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(straggler, signal.SIGKILL)
            time.sleep(_POLL)

    def _wait_for(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + TIMEOUT
        while not condition():
            if time.monotonic() > deadline:
                raise RuntimeError(self._failure(f"the server did not {what} in {TIMEOUT:.0f} s"))
            time.sleep(_POLL)

    def _log_size(self) -> int:
        try:
            return self.logfile.stat().st_size
        except OSError:
            return 0

    def _log_mentions_port_in_use(self, offset: int) -> bool:
        try:
            with self.logfile.open("rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return False
        return "could not bind" in text or "Address already in use" in text

    def _failure(self, message: str, result: subprocess.CompletedProcess[str] | None = None) -> str:
        parts = [f"{message} ({self!r})"]
        if result is not None:
            parts.append(f"exit status {result.returncode}")
            if result.stdout.strip():
                parts.append(f"stdout:\n{result.stdout.strip()}")
            if result.stderr.strip():
                parts.append(f"stderr:\n{result.stderr.strip()}")
        parts.append(f"server log tail:\n{self.log_tail()}")
        return "\n".join(parts)
