CREATE TABLE broker_alembic_version (
    version_num VARCHAR(32) NOT NULL, 
    CONSTRAINT broker_alembic_version_pkc PRIMARY KEY (version_num)
);

-- Running upgrade  -> 0001

CREATE TABLE message_types (
    message_type_name VARCHAR(128) NOT NULL, 
    validation VARCHAR(16) NOT NULL, 
    created_at FLOAT NOT NULL, 
    PRIMARY KEY (message_type_name), 
    CONSTRAINT validation_known CHECK (validation IN ('NONE', 'EMPTY', 'WELL_FORMED_XML', 'JSON'))
);

CREATE TABLE contracts (
    contract_name VARCHAR(128) NOT NULL, 
    created_at FLOAT NOT NULL, 
    PRIMARY KEY (contract_name)
);

CREATE TABLE contract_message_types (
    contract_name VARCHAR(128) NOT NULL, 
    message_type_name VARCHAR(128) NOT NULL, 
    sent_by VARCHAR(9) NOT NULL, 
    PRIMARY KEY (contract_name, message_type_name), 
    CONSTRAINT sent_by_known CHECK (sent_by IN ('INITIATOR', 'TARGET', 'ANY')), 
    FOREIGN KEY(contract_name) REFERENCES contracts (contract_name) ON DELETE CASCADE, 
    FOREIGN KEY(message_type_name) REFERENCES message_types (message_type_name)
);

CREATE TABLE queues (
    queue_name VARCHAR(128) NOT NULL, 
    is_receive_enabled BOOLEAN NOT NULL, 
    is_retention_enabled BOOLEAN NOT NULL, 
    is_activation_enabled BOOLEAN NOT NULL, 
    activation_procedure VARCHAR(512), 
    max_readers INTEGER NOT NULL, 
    execute_as VARCHAR(128), 
    is_poison_message_handling_enabled BOOLEAN NOT NULL, 
    waiting_receivers INTEGER DEFAULT '0' NOT NULL, 
    created_at FLOAT NOT NULL, 
    modified_at FLOAT NOT NULL, 
    PRIMARY KEY (queue_name), 
    CONSTRAINT max_readers_not_negative CHECK (max_readers >= 0)
);

CREATE TABLE services (
    service_name VARCHAR(128) NOT NULL, 
    queue_name VARCHAR(128) NOT NULL, 
    created_at FLOAT NOT NULL, 
    PRIMARY KEY (service_name), 
    FOREIGN KEY(queue_name) REFERENCES queues (queue_name)
);

CREATE INDEX ix_services_queue_name ON services (queue_name);

CREATE TABLE service_contracts (
    service_name VARCHAR(128) NOT NULL, 
    contract_name VARCHAR(128) NOT NULL, 
    PRIMARY KEY (service_name, contract_name), 
    FOREIGN KEY(service_name) REFERENCES services (service_name) ON DELETE CASCADE, 
    FOREIGN KEY(contract_name) REFERENCES contracts (contract_name)
);

CREATE TABLE conversation_groups (
    conversation_group_id VARCHAR(36) NOT NULL, 
    queue_name VARCHAR(128) NOT NULL, 
    created_at FLOAT NOT NULL, 
    PRIMARY KEY (conversation_group_id)
);

CREATE TABLE conversation_endpoints (
    conversation_handle VARCHAR(36) NOT NULL, 
    conversation_id VARCHAR(36) NOT NULL, 
    is_initiator BOOLEAN NOT NULL, 
    service_name VARCHAR(128) NOT NULL, 
    far_service_name VARCHAR(128) NOT NULL, 
    contract_name VARCHAR(128) NOT NULL, 
    queue_name VARCHAR(128) NOT NULL, 
    conversation_group_id VARCHAR(36) NOT NULL, 
    state VARCHAR(2) NOT NULL, 
    priority SMALLINT NOT NULL, 
    send_sequence BIGINT NOT NULL, 
    receive_sequence BIGINT NOT NULL, 
    lifetime_expires_at FLOAT, 
    timer_due_at FLOAT, 
    created_at FLOAT NOT NULL, 
    PRIMARY KEY (conversation_handle), 
    CONSTRAINT uq_conversation_side UNIQUE (conversation_id, is_initiator), 
    CONSTRAINT state_known CHECK (state IN ('SO', 'SI', 'CO', 'DI', 'DO', 'ER', 'CD')), 
    CONSTRAINT priority_in_range CHECK (priority BETWEEN 1 AND 10)
);

CREATE INDEX ix_conversation_endpoints_group ON conversation_endpoints (conversation_group_id);

CREATE INDEX ix_conversation_endpoints_timer ON conversation_endpoints (timer_due_at) WHERE timer_due_at IS NOT NULL;

CREATE INDEX ix_conversation_endpoints_lifetime ON conversation_endpoints (lifetime_expires_at) WHERE lifetime_expires_at IS NOT NULL AND state <> 'ER';

CREATE TABLE queue_messages (
    message_id INTEGER NOT NULL, 
    queue_name VARCHAR(128) NOT NULL, 
    conversation_group_id VARCHAR(36) NOT NULL, 
    conversation_handle VARCHAR(36) NOT NULL, 
    message_sequence_number BIGINT NOT NULL, 
    message_type_name VARCHAR(128) NOT NULL, 
    message_body BLOB, 
    priority SMALLINT NOT NULL, 
    status SMALLINT NOT NULL, 
    service_name VARCHAR(128) NOT NULL, 
    service_contract_name VARCHAR(128) NOT NULL, 
    enqueued_at FLOAT NOT NULL, 
    PRIMARY KEY (message_id)
);

CREATE INDEX ix_queue_messages_ready ON queue_messages (queue_name, priority DESC, message_id) WHERE status = 1;

CREATE INDEX ix_queue_messages_group ON queue_messages (conversation_group_id, priority DESC, conversation_handle, message_sequence_number) WHERE status = 1;

CREATE INDEX ix_queue_messages_conversation ON queue_messages (conversation_handle, message_sequence_number);

CREATE TABLE transmission_queue (
    message_id INTEGER NOT NULL, 
    conversation_handle VARCHAR(36) NOT NULL, 
    to_queue_name VARCHAR(128) NOT NULL, 
    conversation_group_id VARCHAR(36) NOT NULL, 
    message_sequence_number BIGINT NOT NULL, 
    message_type_name VARCHAR(128) NOT NULL, 
    message_body BLOB, 
    priority SMALLINT NOT NULL, 
    to_service_name VARCHAR(128) NOT NULL, 
    service_contract_name VARCHAR(128) NOT NULL, 
    enqueued_at FLOAT NOT NULL, 
    transmission_status VARCHAR(1024) NOT NULL, 
    PRIMARY KEY (message_id)
);

CREATE INDEX ix_transmission_queue_to_queue ON transmission_queue (to_queue_name, message_id);

CREATE INDEX ix_transmission_queue_conversation ON transmission_queue (conversation_handle);

INSERT INTO message_types (message_type_name, validation, created_at) VALUES ('DEFAULT', 'NONE', 0);

INSERT INTO contracts (contract_name, created_at) VALUES ('DEFAULT', 0);

INSERT INTO contract_message_types (contract_name, message_type_name, sent_by) VALUES ('DEFAULT', 'DEFAULT', 'ANY');

INSERT INTO broker_alembic_version (version_num) VALUES ('0001') RETURNING version_num;

-- Running upgrade 0001 -> 0002

CREATE TABLE conversation_priorities (
    priority_name VARCHAR(128) NOT NULL, 
    contract_name VARCHAR(128), 
    local_service_name VARCHAR(128), 
    remote_service_name VARCHAR(128), 
    priority_level SMALLINT NOT NULL, 
    created_at FLOAT NOT NULL, 
    PRIMARY KEY (priority_name), 
    CONSTRAINT priority_level_in_range CHECK (priority_level BETWEEN 1 AND 10)
);

CREATE UNIQUE INDEX uq_conversation_priorities_match ON conversation_priorities (coalesce(contract_name, ''), coalesce(local_service_name, ''), coalesce(remote_service_name, ''));

CREATE TABLE broker_settings (
    setting_name VARCHAR(128) NOT NULL, 
    setting_value VARCHAR(256) NOT NULL, 
    PRIMARY KEY (setting_name)
);

INSERT INTO broker_settings (setting_name, setting_value) VALUES ('honor_broker_priority', 'false');

ALTER TABLE queues ADD COLUMN receive_aging_seconds FLOAT;

CREATE INDEX ix_queue_messages_age ON queue_messages (queue_name, enqueued_at) WHERE status = 1;

UPDATE broker_alembic_version SET version_num='0002' WHERE broker_alembic_version.version_num = '0001';

-- Running upgrade 0002 -> 0003

CREATE TABLE activated_tasks (
    task_id VARCHAR(36) NOT NULL, 
    queue_name VARCHAR(128) NOT NULL, 
    procedure_name VARCHAR(512) NOT NULL, 
    runtime_id VARCHAR(36) NOT NULL, 
    host_name VARCHAR(256) NOT NULL, 
    process_id INTEGER NOT NULL, 
    reader_name VARCHAR(256) NOT NULL, 
    execute_as VARCHAR(128), 
    started_at FLOAT NOT NULL, 
    heartbeat_at FLOAT NOT NULL, 
    PRIMARY KEY (task_id)
);

CREATE INDEX ix_activated_tasks_queue ON activated_tasks (queue_name);

CREATE INDEX ix_activated_tasks_runtime ON activated_tasks (runtime_id);

CREATE TABLE queue_monitors (
    queue_name VARCHAR(128) NOT NULL, 
    state VARCHAR(24) NOT NULL, 
    last_empty_rowset_at FLOAT, 
    last_activated_at FLOAT, 
    last_notified_at FLOAT, 
    notified_head_message_id BIGINT, 
    updated_at FLOAT NOT NULL, 
    PRIMARY KEY (queue_name), 
    CONSTRAINT monitor_state_known CHECK (state IN ('INACTIVE', 'NOTIFIED', 'RECEIVES_OCCURRING'))
);

CREATE TABLE event_notifications (
    notification_name VARCHAR(128) NOT NULL, 
    queue_name VARCHAR(128) NOT NULL, 
    event_type VARCHAR(32) NOT NULL, 
    to_service_name VARCHAR(128) NOT NULL, 
    conversation_handle VARCHAR(36), 
    created_at FLOAT NOT NULL, 
    PRIMARY KEY (notification_name), 
    CONSTRAINT event_type_known CHECK (event_type IN ('QUEUE_ACTIVATION', 'BROKER_QUEUE_DISABLED'))
);

CREATE INDEX ix_event_notifications_queue ON event_notifications (queue_name);

INSERT INTO message_types (message_type_name, validation, created_at) VALUES ('EventNotification', 'JSON', 0);

INSERT INTO contracts (contract_name, created_at) VALUES ('PostEventNotification', 0);

INSERT INTO contract_message_types (contract_name, message_type_name, sent_by) VALUES ('PostEventNotification', 'EventNotification', 'INITIATOR');

UPDATE broker_alembic_version SET version_num='0003' WHERE broker_alembic_version.version_num = '0002';

-- Running upgrade 0003 -> 0004

ALTER TABLE queues ADD COLUMN consecutive_rollbacks INTEGER DEFAULT '0' NOT NULL;

ALTER TABLE queues ADD COLUMN disabled_reason VARCHAR(1024);

ALTER TABLE queues ADD COLUMN disabled_at FLOAT;

CREATE TABLE event_notifications_new (
    notification_name VARCHAR(128) NOT NULL, 
    queue_name VARCHAR(128) NOT NULL, 
    event_type VARCHAR(32) NOT NULL, 
    to_service_name VARCHAR(128) NOT NULL, 
    conversation_handle VARCHAR(36), 
    created_at FLOAT NOT NULL, 
    PRIMARY KEY (notification_name), 
    CONSTRAINT event_type_known CHECK (event_type IN ('QUEUE_ACTIVATION', 'BROKER_QUEUE_DISABLED', 'POISON_MESSAGE'))
);

INSERT INTO event_notifications_new SELECT notification_name, queue_name, event_type, to_service_name, conversation_handle, created_at FROM event_notifications;

DROP INDEX ix_event_notifications_queue;

DROP TABLE event_notifications;

ALTER TABLE event_notifications_new RENAME TO event_notifications;

CREATE INDEX ix_event_notifications_queue ON event_notifications (queue_name);

CREATE TABLE poison_message_details (
    incident_id INTEGER NOT NULL, 
    queue_name VARCHAR(128) NOT NULL, 
    conversation_handle VARCHAR(36) NOT NULL, 
    message_sequence_number BIGINT NOT NULL, 
    message_type_name VARCHAR(128) NOT NULL, 
    kind VARCHAR(8) NOT NULL, 
    error TEXT, 
    worker VARCHAR(256), 
    occurred_at FLOAT NOT NULL, 
    PRIMARY KEY (incident_id), 
    CONSTRAINT incident_kind_known CHECK (kind IN ('FAILED', 'EXPIRED', 'PARKED'))
);

CREATE INDEX ix_poison_message_details_message ON poison_message_details (conversation_handle, message_sequence_number);

CREATE TABLE poison_messages (
    poison_id INTEGER NOT NULL, 
    state VARCHAR(8) NOT NULL, 
    queue_name VARCHAR(128) NOT NULL, 
    conversation_group_id VARCHAR(36) NOT NULL, 
    conversation_handle VARCHAR(36) NOT NULL, 
    message_sequence_number BIGINT NOT NULL, 
    message_type_name VARCHAR(128) NOT NULL, 
    message_body BLOB, 
    priority SMALLINT NOT NULL, 
    service_name VARCHAR(128) NOT NULL, 
    service_contract_name VARCHAR(128) NOT NULL, 
    enqueued_at FLOAT NOT NULL, 
    failures INTEGER NOT NULL, 
    cycles INTEGER NOT NULL, 
    last_error TEXT, 
    dispositions VARCHAR(256) NOT NULL, 
    recorded_at FLOAT NOT NULL, 
    redeliver_at FLOAT, 
    PRIMARY KEY (poison_id), 
    CONSTRAINT poison_state_known CHECK (state IN ('LOGGED', 'PARKED'))
);

CREATE INDEX ix_poison_messages_redeliver ON poison_messages (redeliver_at) WHERE state = 'PARKED';

CREATE INDEX ix_poison_messages_queue ON poison_messages (queue_name, poison_id);

CREATE TABLE poison_policies (
    queue_name VARCHAR(128) NOT NULL, 
    threshold INTEGER NOT NULL, 
    dispositions TEXT NOT NULL, 
    updated_at FLOAT NOT NULL, 
    PRIMARY KEY (queue_name), 
    CONSTRAINT threshold_positive CHECK (threshold >= 1), 
    FOREIGN KEY(queue_name) REFERENCES queues (queue_name) ON DELETE CASCADE
);

CREATE TABLE message_leases (
    lease_id VARCHAR(36) NOT NULL, 
    queue_name VARCHAR(128) NOT NULL, 
    conversation_group_id VARCHAR(36) NOT NULL, 
    conversation_handle VARCHAR(36) NOT NULL, 
    message_sequence_number BIGINT NOT NULL, 
    message_type_name VARCHAR(128) NOT NULL, 
    message_body BLOB, 
    priority SMALLINT NOT NULL, 
    service_name VARCHAR(128) NOT NULL, 
    service_contract_name VARCHAR(128) NOT NULL, 
    enqueued_at FLOAT NOT NULL, 
    worker VARCHAR(256) NOT NULL, 
    taken_at FLOAT NOT NULL, 
    heartbeat_at FLOAT NOT NULL, 
    expires_at FLOAT NOT NULL, 
    PRIMARY KEY (lease_id)
);

CREATE INDEX ix_message_leases_expires ON message_leases (expires_at);

CREATE INDEX ix_message_leases_conversation ON message_leases (conversation_handle);

UPDATE broker_alembic_version SET version_num='0004' WHERE broker_alembic_version.version_num = '0003';

-- Running upgrade 0004 -> 0005

ALTER TABLE queues ADD COLUMN fair_share_quantum FLOAT;

ALTER TABLE conversation_endpoints ADD COLUMN fair_clock FLOAT DEFAULT '0' NOT NULL;

ALTER TABLE queue_messages ADD COLUMN fair_at FLOAT DEFAULT '0' NOT NULL;

ALTER TABLE transmission_queue ADD COLUMN fair_at FLOAT DEFAULT '0' NOT NULL;

DROP INDEX ix_queue_messages_ready;

CREATE INDEX ix_queue_messages_ready ON queue_messages (queue_name, priority DESC, fair_at, message_id) WHERE status = 1;

UPDATE broker_alembic_version SET version_num='0005' WHERE broker_alembic_version.version_num = '0004';

-- Running upgrade 0005 -> 0006

CREATE TABLE routes (
    route_name VARCHAR(128) NOT NULL, 
    remote_service_name VARCHAR(128) NOT NULL, 
    broker_instance VARCHAR(36), 
    address VARCHAR(256) NOT NULL, 
    created_at FLOAT NOT NULL, 
    PRIMARY KEY (route_name)
);

CREATE INDEX ix_routes_service ON routes (remote_service_name);

ALTER TABLE conversation_endpoints ADD COLUMN is_remote BOOLEAN DEFAULT 0 NOT NULL;

ALTER TABLE conversation_endpoints ADD COLUMN closed_at FLOAT;

CREATE INDEX ix_conversation_endpoints_closed ON conversation_endpoints (closed_at) WHERE closed_at IS NOT NULL;

ALTER TABLE transmission_queue ADD COLUMN is_outgoing BOOLEAN DEFAULT 0 NOT NULL;

ALTER TABLE transmission_queue ADD COLUMN conversation_id VARCHAR(36);

ALTER TABLE transmission_queue ADD COLUMN is_initiator BOOLEAN;

ALTER TABLE transmission_queue ADD COLUMN from_service_name VARCHAR(128);

ALTER TABLE transmission_queue ADD COLUMN lifetime_expires_at FLOAT;

ALTER TABLE transmission_queue ADD COLUMN attempts INTEGER DEFAULT '0' NOT NULL;

ALTER TABLE transmission_queue ADD COLUMN last_attempt_at FLOAT;

CREATE INDEX ix_transmission_queue_outgoing ON transmission_queue (message_id) WHERE is_outgoing;

CREATE TABLE transport_fragments (
    conversation_id VARCHAR(36) NOT NULL, 
    is_initiator BOOLEAN NOT NULL, 
    message_sequence_number BIGINT NOT NULL, 
    fragment_index INTEGER NOT NULL, 
    fragment_count INTEGER NOT NULL, 
    message_type_name VARCHAR(128) NOT NULL, 
    message_body BLOB, 
    received_at FLOAT NOT NULL, 
    PRIMARY KEY (conversation_id, is_initiator, message_sequence_number, fragment_index)
);

CREATE TABLE transport_events (
    event_id INTEGER NOT NULL, 
    occurred_at FLOAT NOT NULL, 
    event_type VARCHAR(32) NOT NULL, 
    peer VARCHAR(256), 
    detail VARCHAR(1024) NOT NULL, 
    PRIMARY KEY (event_id), 
    CONSTRAINT transport_event_known CHECK (event_type IN ('CORRUPTED_MESSAGE', 'CONNECTION_REJECTED', 'MESSAGE_REJECTED'))
);

CREATE INDEX ix_transport_events_occurred ON transport_events (occurred_at);

CREATE TABLE transport_connections (
    endpoint_id VARCHAR(36) NOT NULL, 
    connection_number INTEGER NOT NULL, 
    endpoint_address VARCHAR(256), 
    host_name VARCHAR(256) NOT NULL, 
    process_id INTEGER NOT NULL, 
    direction VARCHAR(8) NOT NULL, 
    peer VARCHAR(256) NOT NULL, 
    peer_address VARCHAR(256), 
    peer_broker VARCHAR(36), 
    opened_at FLOAT NOT NULL, 
    last_activity_at FLOAT NOT NULL, 
    frames_sent BIGINT NOT NULL, 
    frames_received BIGINT NOT NULL, 
    bytes_sent BIGINT NOT NULL, 
    bytes_received BIGINT NOT NULL, 
    corrupted_frames BIGINT NOT NULL, 
    carries_messages BOOLEAN NOT NULL, 
    written_at FLOAT NOT NULL, 
    PRIMARY KEY (endpoint_id, connection_number)
);

UPDATE broker_alembic_version SET version_num='0006' WHERE broker_alembic_version.version_num = '0005';

-- Running upgrade 0006 -> 0007

ALTER TABLE queues ADD COLUMN is_activation_eager BOOLEAN DEFAULT 0 NOT NULL;

UPDATE broker_alembic_version SET version_num='0007' WHERE broker_alembic_version.version_num = '0006';

-- Running upgrade 0007 -> 0008

DROP INDEX ix_queue_messages_conversation;

CREATE INDEX ix_queue_messages_conversation ON queue_messages (conversation_handle, status, message_sequence_number);

DROP INDEX ix_queue_messages_group;

CREATE INDEX ix_queue_messages_group ON queue_messages (conversation_group_id, priority DESC, message_id) WHERE status = 1;

UPDATE broker_alembic_version SET version_num='0008' WHERE broker_alembic_version.version_num = '0007';

-- Running upgrade 0008 -> 0009

CREATE TABLE _alembic_tmp_transport_events (
    event_id INTEGER NOT NULL, 
    occurred_at FLOAT NOT NULL, 
    event_type VARCHAR(32) NOT NULL, 
    peer VARCHAR(256), 
    detail VARCHAR(1024) NOT NULL, 
    PRIMARY KEY (event_id), 
    CONSTRAINT transport_event_known CHECK (event_type IN ('CORRUPTED_MESSAGE', 'CONNECTION_REJECTED', 'MESSAGE_REJECTED', 'REPLAYED_FRAME'))
);

INSERT INTO _alembic_tmp_transport_events (event_id, occurred_at, event_type, peer, detail) SELECT transport_events.event_id, transport_events.occurred_at, transport_events.event_type, transport_events.peer, transport_events.detail 
FROM transport_events;

DROP TABLE transport_events;

ALTER TABLE _alembic_tmp_transport_events RENAME TO transport_events;

CREATE INDEX ix_transport_events_occurred ON transport_events (occurred_at);

UPDATE broker_alembic_version SET version_num='0009' WHERE broker_alembic_version.version_num = '0008';

