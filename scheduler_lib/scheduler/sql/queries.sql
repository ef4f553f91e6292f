-- Named queries of the task scheduler, run through the broker's store
-- (Broker.use_queries("scheduler_lib.scheduler")). Times are seconds since the epoch.

-- name: target_get
-- A target service and the task kinds it runs.
SELECT * FROM scheduler_targets WHERE service_name = :service;

-- name: target_list
-- Every target service.
SELECT * FROM scheduler_targets ORDER BY service_name;

-- name: target_delete
-- Before (re)writing a target's settings.
DELETE FROM scheduler_targets WHERE service_name = :service;

-- name: target_insert
-- A target service's settings.
INSERT INTO scheduler_targets (
    service_name, queue_name, allowed_kinds, durable_start, updated_at
) VALUES (:service, :queue, :kinds, :durable_start, :now);

-- name: log_insert
-- ExecAsync: the task's row, written in the transaction that sends it.
INSERT INTO execution_log (
    caller_id, scheduler_handle, target_service, wave, task_name, task_kind, task_body,
    sent_at, start_time, status, attempts, dag_id, run_id, task_id
) VALUES (
    :caller_id, :handle, :target, :wave, :name, :kind, :body, :now, :now, 'QUEUED', 0,
    :dag_id, :run_id, :task_id
)
RETURNING log_id;

-- name: log_insert_copy
-- A task sent from another broker: this broker's row for its run (origin_log_id is the
-- initiator's log id; the Airflow ids are its message's); a copy already made for it (a
-- redelivery) is kept.
INSERT INTO execution_log (
    caller_id, scheduler_handle, target_service, wave, task_name, task_kind, task_body,
    sent_at, start_time, status, attempts, origin_log_id, dag_id, run_id, task_id
) VALUES (
    :caller_id, :handle, :target, :wave, :name, :kind, :body, :now, :now, 'QUEUED', 0,
    :origin_log_id, :dag_id, :run_id, :task_id
)
ON CONFLICT DO NOTHING;

-- name: log_of_origin
-- This broker's row of a task sent from another broker.
SELECT * FROM execution_log WHERE scheduler_handle = :handle AND origin_log_id = :origin_log_id;

-- name: log_complete_from_answer
-- The initiator's row of a task that ran on another broker, from its AsyncDone.
UPDATE execution_log
SET status = :status, error = :error, result = :result, worker_id = :worker,
    start_time = coalesce(:started_at, start_time), end_time = coalesce(:ended_at, :now),
    spark_application_id = :application_id, spark_job_group = :job_group,
    attempts = attempts + 1
WHERE log_id = :log_id AND scheduler_handle = :handle
-- A cancel here never reached the other broker: the task may have run all the same.
AND (end_time IS NULL OR (status = 'CANCELLED' AND worker_id IS NULL));

-- name: log_start
-- The executor starts the task (or, after its worker died, starts it again): who and
-- when — only while it holds the task's lease: a take committed without the WAL flush
-- is undone by a server crash before this durable commit (the message is back on its
-- queue, for another reader), and must not run here too. No row changed: the task was
-- cancelled (or already ended) meanwhile, or the lease is gone.
-- Where it will run on Spark, when the worker knows it already (saves a statement).
UPDATE execution_log
SET status = 'RUNNING', start_time = :now, worker_id = :worker,
    activated_task_id = :activated_task_id,
    attempts = attempts + CASE
        WHEN status = 'RUNNING' AND start_time = :now
            AND worker_id = CAST(:worker AS VARCHAR(256)) THEN 0 ELSE 1
    END,
    spark_application_id = :application_id, spark_job_group = :job_group,
    spark_ui_url = :ui_url
WHERE log_id = :log_id AND status IN ('QUEUED', 'RUNNING')
AND EXISTS (SELECT 1 FROM message_leases WHERE lease_id = :lease_id);

-- name: log_spark
-- The Spark application, its UI and the job group a task runs in.
UPDATE execution_log SET spark_application_id = :application_id, spark_job_group = :job_group,
    spark_ui_url = :ui_url
WHERE log_id = :log_id;

-- name: log_finish
-- The task ended: when, how, and what it returned or raised.
UPDATE execution_log
SET status = :status, end_time = :now, error = :error, result = :result
WHERE log_id = :log_id AND status = 'RUNNING' AND worker_id = :worker;

-- name: log_fail
-- A task whose worker went silent (or that could not start) ended in failure.
UPDATE execution_log
SET status = 'FAILED', end_time = :now, error = :error
WHERE log_id = :log_id AND end_time IS NULL;

-- name: log_get
-- One row of the log.
SELECT * FROM execution_log WHERE log_id = :log_id;

-- name: log_cancel_queued
-- Fail fast: what this scheduler sent and nobody started yet will not run.
UPDATE execution_log SET status = 'CANCELLED', end_time = :now,
    error = :reason
WHERE scheduler_handle = :handle AND status = 'QUEUED';

-- name: log_cancel_running
-- Fail fast or release: ask the workers running this scheduler's tasks to stop them.
UPDATE execution_log SET cancel_requested_at = :now, cancel_reason = :reason
WHERE scheduler_handle = :handle AND status = 'RUNNING' AND cancel_requested_at IS NULL;

-- name: log_cancel_requests
-- Running tasks asked to stop (workers poll this while they run tasks; a small index).
SELECT log_id, cancel_reason FROM execution_log
WHERE cancel_requested_at IS NOT NULL AND end_time IS NULL;

-- name: log_of_scheduler
-- A scheduler's rows, in the order they were sent.
SELECT * FROM execution_log WHERE scheduler_handle = :handle ORDER BY log_id;

-- name: log_of_tasks
-- The rows of a scheduler's tasks from log id :first to :last (a wave an Airflow task
-- sent): the sensor's poll, a range on the scheduler's index.
SELECT log_id, task_name, wave, status, error, result, start_time, end_time
FROM execution_log
WHERE scheduler_handle = :handle AND log_id BETWEEN :first AND :last
ORDER BY log_id;

-- name: log_cancel_queued_task
-- The Execution Status page's cancel of one task that has not started: it will not run
-- (the executor answers it CANCELLED when it takes its message).
UPDATE execution_log SET status = 'CANCELLED', end_time = :now, error = :reason
WHERE log_id = :log_id AND status = 'QUEUED';

-- name: log_cancel_running_task
-- The Execution Status page's cancel of one running task: its worker is asked to stop it.
UPDATE execution_log SET cancel_requested_at = :now, cancel_reason = :reason
WHERE log_id = :log_id AND status = 'RUNNING' AND cancel_requested_at IS NULL;

-- name: log_recent
-- The most recent rows of the log.
SELECT * FROM execution_log ORDER BY log_id DESC LIMIT :limit;

-- name: status_list
-- The execution_status view: running activated readers with what they run now.
SELECT * FROM execution_status ORDER BY queue_name, reader_started_at;

-- name: semaphore_get
-- A named semaphore. (On PostgreSQL, locked: acquirers take turns.)
SELECT * FROM semaphores WHERE semaphore_name = :name;

-- name: semaphore_insert
-- Create a named semaphore.
INSERT INTO semaphores (semaphore_name, permits, created_at) VALUES (:name, :permits, :now);

-- name: semaphore_set_permits
-- Change how many may hold it at once.
UPDATE semaphores SET permits = :permits WHERE semaphore_name = :name;

-- name: semaphore_list
-- Every semaphore with how many hold it now.
SELECT s.semaphore_name, s.permits,
    (SELECT count(*) FROM semaphore_holders h
     WHERE h.semaphore_name = s.semaphore_name AND h.expires_at > :now) AS held
FROM semaphores s ORDER BY s.semaphore_name;

-- name: semaphore_expire
-- Permits whose holder stopped renewing them come back.
DELETE FROM semaphore_holders WHERE semaphore_name = :name AND expires_at <= :now;

-- name: semaphore_held
-- How many hold the semaphore now.
SELECT count(*) FROM semaphore_holders WHERE semaphore_name = :name;

-- name: semaphore_holder_insert
-- Take a permit.
INSERT INTO semaphore_holders (holder_id, semaphore_name, holder, acquired_at, expires_at)
VALUES (:holder_id, :name, :holder, :now, :expires_at);

-- name: semaphore_holder_renew
-- The holder is alive.
UPDATE semaphore_holders SET expires_at = :expires_at WHERE holder_id = :holder_id;

-- name: semaphore_holder_delete
-- Give a permit back.
DELETE FROM semaphore_holders WHERE holder_id = :holder_id;

-- name: semaphore_holders
-- Who holds a semaphore now.
SELECT * FROM semaphore_holders WHERE semaphore_name = :name ORDER BY acquired_at;

-- ---------------------------------------------------------------------------------------
-- The Execution Status page (scheduler_lib.scheduler.monitor): the log's rows for a
-- screen, newest first, without task bodies and results (they can be large). One query
-- per filter shape, so each one walks an index newest first and stops at :limit: by
-- scheduler the scheduler's index (scheduler_handle, log_id), by DAG or run the Airflow
-- index (dag_id, run_id, log_id), failed rows their partial index, unfiltered the primary
-- key. Every shape takes the same narrowing filters (target, kind, a time range of
-- sent_at; NULL: any) and :before, the log id to continue below (the page reads on when
-- the user may see too few of the rows read).
-- ---------------------------------------------------------------------------------------

-- fragment: monitor_log_row
-- A row as the page shows it.
SELECT log_id, caller_id, scheduler_handle, target_service, wave, task_name, task_kind,
    worker_id, spark_application_id, spark_job_group, spark_ui_url, sent_at, start_time,
    end_time, status, error, attempts, cancel_requested_at, dag_id, run_id, task_id
FROM execution_log

-- fragment: monitor_log_narrowed
-- The filters every shape takes, newest first, a screen's worth.
AND log_id < :before
AND (CAST(:target AS VARCHAR(128)) IS NULL OR target_service = :target)
AND (CAST(:kind AS VARCHAR(64)) IS NULL OR task_kind = :kind)
AND (CAST(:since AS FLOAT) IS NULL OR sent_at >= :since)
AND (CAST(:until AS FLOAT) IS NULL OR sent_at < :until)
ORDER BY log_id DESC LIMIT :limit;

-- name: monitor_log_recent
-- The newest rows of the log (the primary key).
-- include: monitor_log_row
WHERE 1 = 1
-- include: monitor_log_narrowed

-- name: monitor_log_of_scheduler
-- The newest rows one scheduler handle sent.
-- include: monitor_log_row
WHERE scheduler_handle = :handle
-- include: monitor_log_narrowed

-- name: monitor_log_of_dag
-- The newest rows the runs of one Airflow DAG sent.
-- include: monitor_log_row
WHERE dag_id = :dag_id
-- include: monitor_log_narrowed

-- name: monitor_log_of_run
-- The newest rows one Airflow DAG run sent.
-- include: monitor_log_row
WHERE dag_id = :dag_id AND run_id = :run_id
-- include: monitor_log_narrowed

-- name: monitor_log_of_scheduler_in_dag
-- The newest rows one scheduler handle sent for one DAG (the scheduler's index).
-- include: monitor_log_row
WHERE scheduler_handle = :handle AND dag_id = :dag_id
-- include: monitor_log_narrowed

-- name: monitor_log_of_scheduler_in_run
-- The newest rows one scheduler handle sent for one DAG run (the scheduler's index).
-- include: monitor_log_row
WHERE scheduler_handle = :handle AND dag_id = :dag_id AND run_id = :run_id
-- include: monitor_log_narrowed

-- name: monitor_log_failed
-- The newest failed rows, any other filter applied on the way (the failed rows'
-- partial index: failures are few, so walking them all is cheap).
-- include: monitor_log_row
WHERE status = 'FAILED'
AND (CAST(:handle AS VARCHAR(36)) IS NULL OR scheduler_handle = :handle)
AND (CAST(:dag_id AS VARCHAR(250)) IS NULL OR dag_id = :dag_id)
AND (CAST(:run_id AS VARCHAR(250)) IS NULL OR run_id = :run_id)
-- include: monitor_log_narrowed

-- name: monitor_task
-- One row, as the page shows it (before the page acts on it).
-- include: monitor_log_row
WHERE log_id = :log_id;

-- name: metrics_tasks_open
-- /metrics: tasks queued or running, by status, kind and target (the open rows' index).
SELECT status, task_kind, target_service, count(*) AS tasks
FROM execution_log WHERE end_time IS NULL
GROUP BY status, task_kind, target_service ORDER BY status, task_kind, target_service;
