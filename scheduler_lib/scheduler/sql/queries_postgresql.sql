-- PostgreSQL overrides of the scheduler's queries.sql.

-- name: semaphore_get
-- A named semaphore, locked: acquirers take turns (SQLite's write lock does this there).
SELECT * FROM semaphores WHERE semaphore_name = :name FOR UPDATE;

-- name: log_ids_next
-- Log ids for a wave of tasks, taken before their rows are written (the messages carry them).
SELECT nextval(pg_get_serial_sequence('execution_log', 'log_id'))
FROM generate_series(1, :n);

-- name: log_insert_one
-- ExecAsync of one task: its row, with the id taken above (plain binds: cheaper to send
-- than log_insert_many's arrays).
INSERT INTO execution_log (
    log_id, caller_id, scheduler_handle, target_service, wave, task_name, task_kind,
    task_body, sent_at, start_time, status, attempts, dag_id, run_id, task_id
) VALUES (
    :log_id, :caller_id, :handle, :target, :wave, :name, :kind, :body, :now, :now,
    'QUEUED', 0, :dag_id, :run_id, :task_id
);

-- name: log_insert_many
-- ExecAsync for a wave: every task's row in one statement, with the ids taken above.
INSERT INTO execution_log (
    log_id, caller_id, scheduler_handle, target_service, wave, task_name, task_kind,
    task_body, sent_at, start_time, status, attempts, dag_id, run_id, task_id
)
SELECT t.log_id, :caller_id, :handle, :target, :wave, t.name, t.kind, t.body, :now, :now,
    'QUEUED', 0, :dag_id, :run_id, :task_id
FROM unnest(
    CAST(:log_ids AS bigint[]), CAST(:names AS text[]), CAST(:kinds AS text[]),
    CAST(:bodies AS text[])
) AS t(log_id, name, kind, body);
