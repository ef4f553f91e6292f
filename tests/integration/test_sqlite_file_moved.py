"""The embedded default's file removed or replaced under a running ``scheduler-lib serve``
(``rm`` to start afresh, a backup copied back): serve says so and serves the file its path
names now — before, it went on serving the old file, which nobody else could reach, and
the user's tasks waited forever."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from multiproc import poll
from serving import Serving, init_by_hand, runs_a_task

from scheduler_lib.broker import Broker
from scheduler_lib.scheduler import init


def _remove(db: Path) -> None:
    for path in db.parent.glob(db.name + "*"):  # the file, its -wal and -shm
        path.unlink()


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_serve_follows_its_sqlite_file_when_it_is_removed_or_replaced(
    tmp_path: Path, how: str
) -> None:
    db = tmp_path / "scheduler.db"
    url = f"sqlite:///{db}"
    backup = tmp_path / "backup.db"
    with Broker(f"sqlite:///{backup}", timers=False) as broker:
        init(broker)  # a copy to put back, made as a user's would be
    with Broker(url, timers=False) as broker:
        init(broker)
    serve = Serving(url)
    try:
        runs_a_task(url)
        # Given its file removed under it, or replaced by another one
        if how == "removed":
            _remove(db)
        else:
            staged = tmp_path / "staged.db"
            shutil.copy(backup, staged)
            staged.replace(db)  # one rename, as a restore script would do it
        # Then it says so (removed or replaced: where one was removed, a connection of
        # another of its threads may have made a new, empty file before it looked)
        poll(
            serve.said("SQLite database file", "was removed or replaced"),
            30,
            f"serve to say its file was {how}",
            explain=serve.tail,
        )
        if how == "removed":
            # And, the file it opens again being empty, how to make it, once
            poll(
                serve.said("schema is missing", "scheduler-lib init"),
                30,
                "serve to say the schema is missing",
                explain=serve.tail,
            )
            serve.says_little()
            init_by_hand(url)
        # When a task is sent to the file its path names now, Then serve runs it
        runs_a_task(url)
        serve.stops_cleanly()
    finally:
        serve.close()


def test_a_broker_without_timers_reads_the_file_its_path_names_now(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The Airflow page's and the triggerer's brokers have no timer thread (they only
    read): their transactions look at the file instead. Before, they read the replaced file
    for ever, and a deferred sensor waited on a wave nobody could end."""
    db, backup, staged = tmp_path / "scheduler.db", tmp_path / "backup.db", tmp_path / "staged"
    with Broker(f"sqlite:///{backup}", timers=False) as broker:
        broker.create_queue("Restored")  # what tells the copy from the file it replaces
    with Broker(f"sqlite:///{db}", timers=False) as broker:
        broker.create_queue("Replaced")
    # As hooks.shared_broker makes them for the page and the triggers
    with Broker(f"sqlite:///{db}", migrate=False, timers=False) as reader:

        def names() -> set[str]:
            return {q.name for q in reader.queues()} & {"Restored", "Replaced"}

        assert names() == {"Replaced"}
        shutil.copy(backup, staged)
        staged.replace(db)  # one rename, as a restore script would do it
        poll(lambda: names() == {"Restored"}, 10, "the reader to read the restored file")
        for _ in range(3):
            assert names() == {"Restored"}
    said = [r.getMessage() for r in caplog.records if "was removed or replaced" in r.getMessage()]
    assert said == [
        f"the SQLite database file {db} was removed or replaced under this "
        "process: opening it again"
    ]
