BEGIN;

CREATE TABLE scheduler_alembic_version (
    version_num VARCHAR(32) NOT NULL, 
    CONSTRAINT scheduler_alembic_version_pkc PRIMARY KEY (version_num)
);

-- Running upgrade  -> s0001

CREATE TABLE scheduler_targets (
    service_name VARCHAR(128) NOT NULL, 
    queue_name VARCHAR(128) NOT NULL, 
    allowed_kinds VARCHAR(1024) NOT NULL, 
    updated_at FLOAT(53) NOT NULL, 
    PRIMARY KEY (service_name)
);

CREATE TABLE execution_log (
    log_id BIGSERIAL NOT NULL, 
    caller_id VARCHAR(256) NOT NULL, 
    scheduler_handle VARCHAR(36) NOT NULL, 
    target_service VARCHAR(128) NOT NULL, 
    wave INTEGER, 
    task_name VARCHAR(256) NOT NULL, 
    task_kind VARCHAR(64) NOT NULL, 
    task_body TEXT NOT NULL, 
    worker_id VARCHAR(256), 
    activated_task_id VARCHAR(36), 
    spark_application_id VARCHAR(128), 
    spark_job_group VARCHAR(128), 
    sent_at FLOAT(53) NOT NULL, 
    start_time FLOAT(53) NOT NULL, 
    end_time FLOAT(53), 
    status VARCHAR(10) NOT NULL, 
    error TEXT, 
    result TEXT, 
    attempts INTEGER DEFAULT '0' NOT NULL, 
    dag_id VARCHAR(250), 
    run_id VARCHAR(250), 
    task_id VARCHAR(250), 
    PRIMARY KEY (log_id), 
    CONSTRAINT execution_status_known CHECK (status IN ('QUEUED', 'RUNNING', 'SUCCEEDED', 'FAILED', 'CANCELLED'))
);

CREATE INDEX ix_execution_log_scheduler ON execution_log (scheduler_handle, log_id);

CREATE INDEX ix_execution_log_open ON execution_log (activated_task_id) WHERE end_time IS NULL;

CREATE VIEW execution_status AS
SELECT t.task_id AS reader_task_id, t.queue_name, t.host_name, t.process_id,
    t.reader_name, t.started_at AS reader_started_at, t.heartbeat_at AS reader_heartbeat_at,
    l.log_id, l.caller_id, l.scheduler_handle, l.target_service, l.wave, l.task_name,
    l.task_kind, l.worker_id, l.spark_application_id, l.spark_job_group, l.sent_at,
    l.start_time, l.status, l.attempts, l.dag_id, l.run_id, l.task_id
FROM activated_tasks t
LEFT JOIN execution_log l ON l.activated_task_id = t.task_id AND l.end_time IS NULL;

CREATE TABLE semaphores (
    semaphore_name VARCHAR(128) NOT NULL, 
    permits INTEGER NOT NULL, 
    created_at FLOAT(53) NOT NULL, 
    PRIMARY KEY (semaphore_name), 
    CONSTRAINT permits_positive CHECK (permits >= 1)
);

CREATE TABLE semaphore_holders (
    holder_id VARCHAR(36) NOT NULL, 
    semaphore_name VARCHAR(128) NOT NULL, 
    holder VARCHAR(256) NOT NULL, 
    acquired_at FLOAT(53) NOT NULL, 
    expires_at FLOAT(53) NOT NULL, 
    PRIMARY KEY (holder_id), 
    FOREIGN KEY(semaphore_name) REFERENCES semaphores (semaphore_name) ON DELETE CASCADE
);

CREATE INDEX ix_semaphore_holders_name ON semaphore_holders (semaphore_name);

INSERT INTO scheduler_alembic_version (version_num) VALUES ('s0001') RETURNING scheduler_alembic_version.version_num;

-- Running upgrade s0001 -> s0002

DROP VIEW execution_status;

ALTER TABLE execution_log ADD COLUMN cancel_requested_at FLOAT(53);

ALTER TABLE execution_log ADD COLUMN cancel_reason TEXT;

ALTER TABLE execution_log ADD COLUMN spark_ui_url VARCHAR(512);

CREATE INDEX ix_execution_log_cancel ON execution_log (log_id) WHERE cancel_requested_at IS NOT NULL AND end_time IS NULL;

CREATE VIEW execution_status AS
SELECT t.task_id AS reader_task_id, t.queue_name, t.host_name, t.process_id,
    t.reader_name, t.started_at AS reader_started_at, t.heartbeat_at AS reader_heartbeat_at,
    l.log_id, l.caller_id, l.scheduler_handle, l.target_service, l.wave, l.task_name,
    l.task_kind, l.worker_id, l.spark_application_id, l.spark_job_group, l.spark_ui_url,
    l.sent_at, l.start_time, l.status, l.attempts, l.cancel_requested_at, l.dag_id,
    l.run_id, l.task_id
FROM activated_tasks t
LEFT JOIN execution_log l ON l.activated_task_id = t.task_id AND l.end_time IS NULL;

UPDATE scheduler_alembic_version SET version_num='s0002' WHERE scheduler_alembic_version.version_num = 's0001';

-- Running upgrade s0002 -> s0003

CREATE INDEX ix_execution_log_airflow ON execution_log (dag_id, run_id, log_id);

UPDATE scheduler_alembic_version SET version_num='s0003' WHERE scheduler_alembic_version.version_num = 's0002';

-- Running upgrade s0003 -> s0004

ALTER TABLE execution_log ADD COLUMN origin_log_id BIGINT;

CREATE UNIQUE INDEX ix_execution_log_origin ON execution_log (scheduler_handle, origin_log_id) WHERE origin_log_id IS NOT NULL;

UPDATE scheduler_alembic_version SET version_num='s0004' WHERE scheduler_alembic_version.version_num = 's0003';

-- Running upgrade s0004 -> s0005

UPDATE execution_log SET wave = wave + 1 WHERE wave IS NOT NULL;

UPDATE scheduler_alembic_version SET version_num='s0005' WHERE scheduler_alembic_version.version_num = 's0004';

-- Running upgrade s0005 -> s0006

ALTER TABLE scheduler_targets ADD COLUMN durable_start BOOLEAN DEFAULT true NOT NULL;

UPDATE scheduler_alembic_version SET version_num='s0006' WHERE scheduler_alembic_version.version_num = 's0005';

-- Running upgrade s0006 -> s0007

CREATE INDEX ix_execution_log_failed ON execution_log (log_id) WHERE status = 'FAILED';

UPDATE scheduler_alembic_version SET version_num='s0007' WHERE scheduler_alembic_version.version_num = 's0006';

COMMIT;

