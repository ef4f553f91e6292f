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
-- than log_insert_many's arrays). An INSERT ... SELECT without FROM: as SEND's `before`
-- it rides inside the SEND's own statement, which adds the FROM that writes it only
-- with the message (Broker.send); the casts type the binds a SELECT list leaves unknown.
INSERT INTO execution_log (
    log_id, caller_id, scheduler_handle, target_service, wave, task_name, task_kind,
    task_body, sent_at, start_time, status, attempts, dag_id, run_id, task_id
)
SELECT CAST(:log_id AS bigint), :caller_id, :handle, :target, CAST(:wave AS integer),
    :name, :kind, :body, CAST(:now AS double precision), CAST(:now AS double precision),
    'QUEUED', 0, :dag_id, :run_id, :task_id;

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

-- name: log_started_in_take
-- Which of a take's tasks log_start_taken started, when its reply was lost: the rows it
-- would have changed (this worker, the take's instant), by their primary keys.
SELECT log_id FROM execution_log
WHERE log_id = ANY (CAST(:log_ids AS BIGINT[])) AND worker_id = :worker
AND start_time = :taken_at AND status = 'RUNNING';

-- name: log_start_taken
-- log_start for the first task one take made, in the take's round trip (Broker.take_recorded:
-- a transaction of its own after the take's, committed durably, which flushes the take
-- too): the start is durable before the task runs, at no round trip of its own. The
-- leases :holder took at :taken_at; only task messages of this broker's own schedulers
-- (the row's conversation's initiator is here, and it is no copy of another broker's)
-- whose target runs their kind. One task only, the first by level and arrival: a take
-- of several (the executor's prefetch) runs the others later, each started when it
-- runs, so that no row says RUNNING before its task does. The executor starts every
-- other lease its own way.
-- MATERIALIZED: the few leases first, then each row by its primary key.
WITH taken AS MATERIALIZED (
    SELECT l.lease_id, l.service_name, i.conversation_handle AS scheduler_handle,
        CAST(convert_from(l.message_body, 'UTF8') AS jsonb) AS body, l.priority,
        l.enqueued_at, l.message_sequence_number
    FROM message_leases l
    JOIN conversation_endpoints t ON t.conversation_handle = l.conversation_handle
    JOIN conversation_endpoints i ON i.conversation_id = t.conversation_id AND i.is_initiator
    WHERE l.worker = :holder AND l.taken_at = :taken_at AND l.message_body IS NOT NULL
    AND l.message_type_name NOT IN (:end_dialog, :error)
), tasks AS MATERIALIZED (
    SELECT m.lease_id, m.scheduler_handle,
        CASE WHEN (m.body ->> 'log_id') ~ '^[0-9]{1,18}$'
            THEN CAST(m.body ->> 'log_id' AS BIGINT) END AS log_id
    FROM taken m JOIN scheduler_targets s ON s.service_name = m.service_name
    WHERE (m.body -> 'task' ->> 'kind') = ANY (string_to_array(s.allowed_kinds, ','))
    ORDER BY m.priority DESC, m.enqueued_at, m.message_sequence_number
    LIMIT 1
)
UPDATE execution_log e
SET status = 'RUNNING', start_time = :taken_at, worker_id = :worker,
    activated_task_id = :activated_task_id, attempts = e.attempts + 1,
    spark_application_id = NULL, spark_job_group = NULL, spark_ui_url = NULL
FROM tasks
WHERE e.log_id = tasks.log_id
-- The ids' range too, a condition on execution_log alone: it keeps the primary key in the
-- plan. The join alone lets a plan made while the log was small (a fresh database: the
-- driver prepares the statement, and the server keeps that plan) scan the whole log at
-- every start, however long it grows.
AND e.log_id BETWEEN (SELECT min(log_id) FROM tasks) AND (SELECT max(log_id) FROM tasks)
AND e.scheduler_handle = tasks.scheduler_handle AND e.origin_log_id IS NULL
AND e.status IN ('QUEUED', 'RUNNING')
RETURNING tasks.lease_id;
