-- Named queries of the broker. Each starts with "-- name: <name>" and a one-line
-- description. Binds use SQLAlchemy's ":name" style so one text serves SQLite and
-- PostgreSQL; queries_postgresql.sql overrides a few where PostgreSQL can do better.

-- name: message_type_insert
-- Create a message type.
INSERT INTO message_types (message_type_name, validation, created_at)
VALUES (:name, :validation, :now);

-- name: message_type_get
-- One message type.
SELECT message_type_name, validation FROM message_types WHERE message_type_name = :name;

-- name: message_type_list
-- All message types.
SELECT message_type_name, validation FROM message_types ORDER BY message_type_name;

-- name: message_type_set_validation
-- ALTER MESSAGE TYPE ... VALIDATION.
UPDATE message_types SET validation = :validation WHERE message_type_name = :name;

-- name: message_type_contracts
-- Contracts that use a message type.
SELECT contract_name FROM contract_message_types WHERE message_type_name = :name
ORDER BY contract_name;

-- name: message_type_delete
-- Drop a message type.
DELETE FROM message_types WHERE message_type_name = :name;

-- name: contract_insert
-- Create a contract.
INSERT INTO contracts (contract_name, created_at) VALUES (:name, :now);

-- name: contract_message_type_insert
-- Allow a message type on a contract, sent by one side or both.
INSERT INTO contract_message_types (contract_name, message_type_name, sent_by)
VALUES (:contract, :message_type, :sent_by);

-- name: contract_message_types
-- The message types of a contract; an empty result for an unknown contract.
SELECT message_type_name, sent_by FROM contract_message_types WHERE contract_name = :name
ORDER BY message_type_name;

-- name: contract_exists
-- Whether a contract exists.
SELECT 1 FROM contracts WHERE contract_name = :name;

-- name: contract_services
-- Services that accept a contract.
SELECT service_name FROM service_contracts WHERE contract_name = :name ORDER BY service_name;

-- name: contract_endpoint_count
-- Conversations that still use a contract.
SELECT count(*) FROM conversation_endpoints WHERE contract_name = :name;

-- name: contract_delete
-- Drop a contract (its message type rows go with it).
DELETE FROM contracts WHERE contract_name = :name;

-- name: queue_insert
-- Create a queue.
INSERT INTO queues (
    queue_name, is_receive_enabled, is_retention_enabled, is_activation_enabled,
    activation_procedure, max_readers, execute_as, is_poison_message_handling_enabled,
    receive_aging_seconds, fair_share_quantum, is_activation_eager, waiting_receivers,
    created_at, modified_at
) VALUES (
    :name, :status, :retention, :activation_status, :activation_procedure, :max_readers,
    :execute_as, :poison_message_handling, :receive_aging, :fair_share, :eager_activation, 0,
    :now, :now
);

-- name: queue_get
-- One queue's settings.
SELECT * FROM queues WHERE queue_name = :name;

-- name: queue_list
-- All queues.
SELECT * FROM queues ORDER BY queue_name;

-- name: queue_update
-- ALTER QUEUE: write every setting (the caller merged the changes).
UPDATE queues SET
    is_receive_enabled = :status,
    is_retention_enabled = :retention,
    is_activation_enabled = :activation_status,
    activation_procedure = :activation_procedure,
    max_readers = :max_readers,
    execute_as = :execute_as,
    is_poison_message_handling_enabled = :poison_message_handling,
    receive_aging_seconds = :receive_aging,
    fair_share_quantum = :fair_share,
    is_activation_eager = :eager_activation,
    disabled_reason = :disabled_reason,
    disabled_at = :disabled_at,
    consecutive_rollbacks = CASE
        WHEN is_receive_enabled = :status
        AND is_poison_message_handling_enabled = :poison_message_handling
        THEN consecutive_rollbacks ELSE 0 END,
    modified_at = :now
WHERE queue_name = :name;

-- name: queue_count_rollback
-- A transaction that received from the queue rolled back: count it, where poison
-- message handling is on and the queue is enabled. Returns the count after this one.
UPDATE queues SET consecutive_rollbacks = consecutive_rollbacks + 1
WHERE queue_name = :name AND is_poison_message_handling_enabled AND is_receive_enabled
RETURNING consecutive_rollbacks;

-- name: queue_reset_rollbacks
-- A transaction received from the queue: if it commits, the run of rollbacks is over
-- (if it rolls back, so does this). Writes, and locks the row, only after a rollback.
UPDATE queues SET consecutive_rollbacks = 0
WHERE queue_name = :name AND consecutive_rollbacks > 0;

-- name: queue_disable
-- Poison message handling turns the queue off, saying why.
UPDATE queues SET is_receive_enabled = false, disabled_reason = :reason, disabled_at = :now,
    consecutive_rollbacks = 0, modified_at = :now
WHERE queue_name = :name AND is_receive_enabled;

-- name: queue_services
-- Services bound to a queue.
SELECT service_name FROM services WHERE queue_name = :name ORDER BY service_name;

-- name: queue_delete
-- Drop a queue.
DELETE FROM queues WHERE queue_name = :name;

-- name: queue_add_waiter
-- A receiver starts to wait on the queue (PostgreSQL senders NOTIFY only when > 0).
UPDATE queues SET waiting_receivers = waiting_receivers + 1 WHERE queue_name = :name;

-- name: queue_remove_waiter
-- A receiver stops waiting.
UPDATE queues SET waiting_receivers = CASE WHEN waiting_receivers > 0
    THEN waiting_receivers - 1 ELSE 0 END WHERE queue_name = :name;

-- name: queue_notify
-- Wake receivers waiting on a queue; a no-op on SQLite (its wakeups are in-process).
SELECT 1 WHERE 1 = 0;

-- name: queue_peek
-- The queue's rows without receiving them (SELECT * FROM queue), in the order RECEIVE
-- serves them when nobody holds a group and each RECEIVE takes its group whole: groups by
-- their first ready message (level, fair-share stamp, arrival: as receive_pick_group),
-- inside a group conversations by level, then by the arrival of their oldest ready
-- message (as RECEIVE), each in sequence order (a DialogTimer, then an Error, ahead of
-- the rest). Rows a retention queue keeps stay in their conversation's order; a
-- conversation, and a group, with nothing left to receive come after the others.
-- Aging's pick of an overdue group is not foreseen. Not a hot path: the windows read
-- the whole queue.
SELECT m.* FROM (
    SELECT queue_messages.*,
           min(CASE WHEN status = 1 THEN message_id END)
               OVER (PARTITION BY conversation_handle) AS arrived
    FROM queue_messages WHERE queue_name = :name
) m
JOIN (
    SELECT conversation_group_id, min(pick) AS pick FROM (
        SELECT conversation_group_id,
               row_number() OVER (
                   ORDER BY status <> 1, priority DESC, fair_at, message_id
               ) AS pick
        FROM queue_messages WHERE queue_name = :name
    ) ranked
    GROUP BY conversation_group_id
) g ON g.conversation_group_id = m.conversation_group_id
ORDER BY g.pick, m.priority DESC, m.arrived IS NULL, m.arrived, m.conversation_handle,
    m.message_sequence_number, m.message_id;

-- name: service_insert
-- Create a service on a queue.
INSERT INTO services (service_name, queue_name, created_at) VALUES (:name, :queue, :now);

-- name: service_contract_insert
-- A service accepts a contract as target.
INSERT INTO service_contracts (service_name, contract_name) VALUES (:name, :contract);

-- name: service_contract_delete
-- A service no longer accepts a contract.
DELETE FROM service_contracts WHERE service_name = :name AND contract_name = :contract;

-- name: service_get
-- One service.
SELECT service_name, queue_name FROM services WHERE service_name = :name;

-- name: service_list
-- All services.
SELECT service_name, queue_name FROM services ORDER BY service_name;

-- name: service_contracts
-- Contracts a service accepts.
SELECT contract_name FROM service_contracts WHERE service_name = :name ORDER BY contract_name;

-- name: service_accepts
-- Whether a service accepts a contract.
SELECT 1 FROM service_contracts WHERE service_name = :name AND contract_name = :contract;

-- name: service_endpoint_count
-- Conversation endpoints of a service, or addressed to it (a dialog begun but not sent).
SELECT count(*) FROM conversation_endpoints
WHERE service_name = :name OR far_service_name = :name;

-- name: service_set_queue
-- ALTER SERVICE ... ON QUEUE.
UPDATE services SET queue_name = :queue WHERE service_name = :name;

-- name: service_move_endpoints
-- ALTER SERVICE ... ON QUEUE moves the service's conversations to the new queue.
UPDATE conversation_endpoints SET queue_name = :queue WHERE service_name = :name;

-- name: service_move_messages
-- ... and their messages.
UPDATE queue_messages SET queue_name = :queue WHERE service_name = :name;

-- name: service_move_groups
-- ... and their groups.
UPDATE conversation_groups SET queue_name = :queue
WHERE conversation_group_id IN (
    SELECT conversation_group_id FROM conversation_endpoints WHERE service_name = :name
);

-- name: service_move_held
-- ... and what waits for it in the transmission queue.
UPDATE transmission_queue SET to_queue_name = :queue
WHERE to_service_name = :name AND NOT is_outgoing;

-- name: service_delete
-- Drop a service.
DELETE FROM services WHERE service_name = :name;

-- name: group_insert
-- Create a conversation group (idempotent: RELATED_CONVERSATION_GROUP may name a new one).
INSERT INTO conversation_groups (conversation_group_id, queue_name, created_at)
VALUES (:group_id, :queue, :now)
ON CONFLICT (conversation_group_id) DO NOTHING;

-- name: group_get
-- One conversation group.
SELECT conversation_group_id, queue_name FROM conversation_groups
WHERE conversation_group_id = :group_id;

-- name: group_delete_if_empty
-- Drop a group once no endpoint belongs to it.
DELETE FROM conversation_groups WHERE conversation_group_id = :group_id
AND NOT EXISTS (
    SELECT 1 FROM conversation_endpoints e WHERE e.conversation_group_id = :group_id
);

-- name: endpoint_insert
-- Create a conversation endpoint.
INSERT INTO conversation_endpoints (
    conversation_handle, conversation_id, is_initiator, service_name, far_service_name,
    contract_name, queue_name, conversation_group_id, state, priority, send_sequence,
    receive_sequence, lifetime_expires_at, timer_due_at, created_at, is_remote
) VALUES (
    :handle, :conversation_id, :is_initiator, :service, :far_service, :contract, :queue,
    :group_id, :state, coalesce((
        -- The endpoint's level, fixed now: the most specific matching priority, in SQL
        -- Server's precedence (contract, local, remote), else the default 5.
        SELECT p.priority_level FROM conversation_priorities p
        WHERE (p.contract_name IS NULL OR p.contract_name = CAST(:contract AS VARCHAR))
        AND (p.local_service_name IS NULL OR p.local_service_name = CAST(:service AS VARCHAR))
        AND (p.remote_service_name IS NULL
            OR p.remote_service_name = CAST(:far_service AS VARCHAR))
        ORDER BY (p.contract_name IS NOT NULL) DESC, (p.local_service_name IS NOT NULL) DESC,
            (p.remote_service_name IS NOT NULL) DESC
        LIMIT 1
    ), 5), 0, 0, :lifetime_expires_at, NULL, :now, :is_remote
);

-- name: endpoint_get
-- One endpoint by handle. An initiator shows CO once the target has sent: derived here
-- rather than written on every send, so a SEND only ever writes its own endpoint's row
-- (two endpoints sending at once can then never deadlock).
SELECT e.*, CASE WHEN e.state = 'SO' AND EXISTS (
    SELECT 1 FROM conversation_endpoints f
    WHERE f.conversation_id = e.conversation_id AND f.is_initiator <> e.is_initiator
    AND f.send_sequence > 0
) THEN 'CO' ELSE e.state END AS effective_state
FROM conversation_endpoints e WHERE e.conversation_handle = :handle;

-- name: endpoint_far
-- The other endpoint of a conversation.
SELECT * FROM conversation_endpoints
WHERE conversation_id = :conversation_id AND is_initiator <> :is_initiator;

-- name: endpoint_list
-- Every endpoint (sys.conversation_endpoints), states as endpoint_get derives them.
SELECT e.*, CASE WHEN e.state = 'SO' AND EXISTS (
    SELECT 1 FROM conversation_endpoints f
    WHERE f.conversation_id = e.conversation_id AND f.is_initiator <> e.is_initiator
    AND f.send_sequence > 0
) THEN 'CO' ELSE e.state END AS effective_state
FROM conversation_endpoints e ORDER BY e.created_at, e.conversation_handle;

-- name: endpoint_lock
-- Lock one endpoint's row (its own SENDs wait in turn: a first SEND that makes the
-- target endpoint); no other row, so it adds no lock order (a no-op on SQLite).
SELECT conversation_handle FROM conversation_endpoints WHERE conversation_handle = :handle;

-- name: endpoints_lock
-- Lock both endpoints of a conversation, initiator first, so END CONVERSATION from both
-- sides at once waits instead of deadlocking (a no-op on SQLite, whose lock is global).
SELECT conversation_handle FROM conversation_endpoints
WHERE conversation_id = :conversation_id ORDER BY is_initiator DESC;

-- name: group_lock
-- END CONVERSATION and MOVE CONVERSATION wait for the conversation group lock, as RECEIVE
-- holds it (MOVE takes both groups', in group id order). No row: the group is gone.
SELECT conversation_group_id FROM conversation_groups WHERE conversation_group_id = :group_id;

-- name: endpoint_take_send_sequence
-- Assign the next sequence number; refuses (no row) unless the state allows sending.
-- With fair share on the target queue (:quantum not NULL) it also stamps the message.
UPDATE conversation_endpoints
SET send_sequence = send_sequence + 1,
    state = CASE WHEN state = 'SI' THEN 'CO' ELSE state END,
    fair_clock = CASE WHEN :quantum IS NULL THEN fair_clock
        ELSE max(:now, fair_clock + :quantum) END
WHERE conversation_handle = :handle AND state IN ('SO', 'SI', 'CO')
RETURNING send_sequence - 1 AS message_sequence_number,
    CASE WHEN :quantum IS NULL THEN 0 ELSE fair_clock END AS fair_at;

-- name: endpoint_take_system_sequence
-- Sequence number for EndDialog / Error, sent from any state but closed.
UPDATE conversation_endpoints SET send_sequence = send_sequence + 1
WHERE conversation_handle = :handle
RETURNING send_sequence - 1 AS message_sequence_number;

-- name: endpoint_take_send_sequences
-- Assign :n sequence numbers at once (SEND of several messages to another broker); the
-- first comes back, none unless the state allows sending.
UPDATE conversation_endpoints
SET send_sequence = send_sequence + :n,
    state = CASE WHEN state = 'SI' THEN 'CO' ELSE state END
WHERE conversation_handle = :handle AND state IN ('SO', 'SI', 'CO')
RETURNING send_sequence - :n AS first_sequence_number;

-- name: endpoint_accept
-- Accept message number :seq arriving from another broker, exactly once and in order:
-- no row back means a duplicate (or a gap), and the message is dropped.
UPDATE conversation_endpoints
SET receive_sequence = receive_sequence + 1
WHERE conversation_handle = :handle AND receive_sequence = :seq AND state <> 'CD'
RETURNING queue_name, conversation_group_id, priority, service_name, contract_name, state;

-- name: endpoint_accept_run
-- Accept :n messages from :seq on at once (they arrived whole and in order).
UPDATE conversation_endpoints
SET receive_sequence = receive_sequence + :n
WHERE conversation_handle = :handle AND receive_sequence = :seq AND state IN ('SI', 'CO')
RETURNING queue_name, conversation_group_id, priority, service_name, contract_name, state;

-- name: endpoint_set_state
-- Move an endpoint to a state.
UPDATE conversation_endpoints SET state = :state WHERE conversation_handle = :handle;

-- name: endpoint_set_timer
-- BEGIN CONVERSATION TIMER: one timer per endpoint, a new call replaces it.
UPDATE conversation_endpoints SET timer_due_at = :due WHERE conversation_handle = :handle;

-- name: endpoint_delete
-- Remove an endpoint.
DELETE FROM conversation_endpoints WHERE conversation_handle = :handle;

-- name: endpoint_move
-- MOVE CONVERSATION: the endpoint joins another group.
UPDATE conversation_endpoints SET conversation_group_id = :group_id
WHERE conversation_handle = :handle;

-- name: message_insert
-- Put a message on a queue.
INSERT INTO queue_messages (
    queue_name, conversation_group_id, conversation_handle, message_sequence_number,
    message_type_name, message_body, priority, status, service_name, service_contract_name,
    enqueued_at, fair_at
) VALUES (
    :queue, :group_id, :handle, :seq, :message_type, :body, :priority, 1, :service,
    :contract, :now, :fair_at
);

-- name: message_retain_sent
-- RETENTION on the sending endpoint's queue: a copy of the message it sent stays there
-- (status 3, under its handle and group) until the conversation ends; nothing otherwise.
INSERT INTO queue_messages (
    queue_name, conversation_group_id, conversation_handle, message_sequence_number,
    message_type_name, message_body, priority, status, service_name, service_contract_name,
    enqueued_at, fair_at
)
SELECT e.queue_name, e.conversation_group_id, e.conversation_handle, :seq, :message_type,
    :body, e.priority, 3, e.service_name, e.contract_name, :now, 0
FROM conversation_endpoints e JOIN queues q ON q.queue_name = e.queue_name
WHERE e.conversation_handle = :handle AND q.is_retention_enabled;

-- name: messages_move
-- MOVE CONVERSATION: the conversation's messages follow it.
UPDATE queue_messages SET conversation_group_id = :group_id WHERE conversation_handle = :handle;

-- name: messages_delete_conversation
-- END CONVERSATION removes the conversation's messages from the local queue.
DELETE FROM queue_messages WHERE conversation_handle = :handle;

-- name: transmission_insert
-- Hold a message whose local target queue is off.
INSERT INTO transmission_queue (
    conversation_handle, to_queue_name, conversation_group_id, message_sequence_number,
    message_type_name, message_body, priority, to_service_name, service_contract_name,
    enqueued_at, transmission_status, fair_at
) VALUES (
    :handle, :queue, :group_id, :seq, :message_type, :body, :priority, :service, :contract,
    :now, :transmission_status, :fair_at
);

-- name: transmission_release
-- The queue is on: move the messages held for it in, in arrival order, at their
-- endpoint's level (the one it had at SEND, unless held_reprioritize just gave it one).
INSERT INTO queue_messages (
    queue_name, conversation_group_id, conversation_handle, message_sequence_number,
    message_type_name, message_body, priority, status, service_name, service_contract_name,
    enqueued_at, fair_at
)
SELECT t.to_queue_name, t.conversation_group_id, t.conversation_handle,
    t.message_sequence_number, t.message_type_name, t.message_body,
    coalesce(e.priority, t.priority), 1, t.to_service_name, t.service_contract_name,
    t.enqueued_at, t.fair_at
FROM transmission_queue t
LEFT JOIN conversation_endpoints e ON e.conversation_handle = t.conversation_handle
WHERE t.to_queue_name = :queue AND NOT t.is_outgoing ORDER BY t.message_id;

-- name: transmission_delete_queue
-- ... and leave the transmission queue.
DELETE FROM transmission_queue WHERE to_queue_name = :queue AND NOT is_outgoing;

-- name: held_to_check
-- Held messages of :queue whose type's validation is not NONE (or whose type is gone),
-- in arrival order: their bodies are checked again as they arrive (arrival.py). No row
-- in the usual case, and the release stays set-based.
SELECT t.message_id, t.conversation_handle, t.message_sequence_number,
    t.message_type_name, t.message_body, mt.validation
FROM transmission_queue t
LEFT JOIN message_types mt ON mt.message_type_name = t.message_type_name
WHERE t.to_queue_name = :queue AND NOT t.is_outgoing
AND t.message_type_name NOT IN ('EndDialog', 'Error', 'DialogTimer')
AND (mt.validation IS NULL OR mt.validation <> 'NONE')
ORDER BY t.message_id;

-- name: held_drop_from
-- A held message failed its check on arrival: it and what its conversation has held
-- after it are not delivered.
DELETE FROM transmission_queue
WHERE conversation_handle = :handle AND NOT is_outgoing AND message_id >= :message_id;

-- name: held_reprioritize
-- A target endpoint whose first message (number 0) is held for :queue takes its level
-- as that message reaches the queue (seed 001): the most specific matching priority
-- that exists now, as endpoint_insert chooses it, else 5.
UPDATE conversation_endpoints SET priority = coalesce((
    SELECT p.priority_level FROM conversation_priorities p
    WHERE (p.contract_name IS NULL
        OR p.contract_name = conversation_endpoints.contract_name)
    AND (p.local_service_name IS NULL
        OR p.local_service_name = conversation_endpoints.service_name)
    AND (p.remote_service_name IS NULL
        OR p.remote_service_name = conversation_endpoints.far_service_name)
    ORDER BY (p.contract_name IS NOT NULL) DESC, (p.local_service_name IS NOT NULL) DESC,
        (p.remote_service_name IS NOT NULL) DESC
    LIMIT 1
), 5)
WHERE NOT is_initiator AND conversation_handle IN (
    SELECT conversation_handle FROM transmission_queue
    WHERE to_queue_name = :queue AND NOT is_outgoing AND message_sequence_number = 0
);

-- name: transmission_delete_conversation
-- Ending or cleaning up a conversation drops what it still had in transit.
DELETE FROM transmission_queue WHERE conversation_handle = :handle;

-- name: outgoing_present
-- The ids and sequence numbers of outgoing messages up to the cursor (the transmitter
-- forgets what it holds in memory that is gone: its conversation was cleaned up).
SELECT message_id, conversation_handle, message_sequence_number FROM transmission_queue
WHERE is_outgoing AND message_id <= :upto
ORDER BY message_id
LIMIT :limit;

-- name: transmission_delete_held
-- END CONVERSATION of a remote conversation: the messages held for this endpoint go, its
-- own outgoing ones (sent before the EndDialog that follows them) stay.
DELETE FROM transmission_queue WHERE conversation_handle = :handle AND NOT is_outgoing;

-- name: transmission_list
-- sys.transmission_queue.
SELECT * FROM transmission_queue ORDER BY message_id;

-- name: receive_pick_group
-- The group of the first ready message in priority order. The write lock that SQLite's
-- BEGIN IMMEDIATE took is the group lock there.
SELECT conversation_group_id FROM queue_messages
WHERE queue_name = :queue AND status = 1
ORDER BY priority DESC, fair_at, message_id
LIMIT 1;

-- name: receive_pick_aged
-- With aging on: the group of the oldest message that has waited past the queue's bound,
-- served ahead of every level.
SELECT conversation_group_id FROM queue_messages
WHERE queue_name = :queue AND status = 1 AND enqueued_at <= :cutoff
ORDER BY enqueued_at, message_id
LIMIT 1;

-- name: receive_lock_group
-- Lock a named group of the queue, if it has ready messages and nobody else holds it.
SELECT g.conversation_group_id FROM conversation_groups g
WHERE g.conversation_group_id = :group_id AND g.queue_name = :queue
AND EXISTS (
    SELECT 1 FROM queue_messages m
    WHERE m.conversation_group_id = g.conversation_group_id AND m.status = 1
);

-- name: receive_lock_conversation
-- Lock the group of a conversation of the queue, if that conversation has ready messages.
SELECT g.conversation_group_id FROM conversation_endpoints e
JOIN conversation_groups g ON g.conversation_group_id = e.conversation_group_id
WHERE e.conversation_handle = :handle AND e.queue_name = :queue
AND EXISTS (
    SELECT 1 FROM queue_messages m
    WHERE m.conversation_handle = e.conversation_handle AND m.status = 1
);

-- name: get_group_pick
-- GET CONVERSATION GROUP: lock the next group with ready messages.
SELECT conversation_group_id FROM queue_messages
WHERE queue_name = :queue AND status = 1
ORDER BY priority DESC, fair_at, message_id
LIMIT 1;

-- name: receive_group_firsts
-- The first :top ready messages of a locked group by level, then arrival: they hold the
-- oldest ready message of every conversation a RECEIVE TOP (:top) serves from (the rows
-- ahead of a conversation's oldest one are those of the conversations served before it),
-- so RECEIVE orders the group's conversations from :top rows of ix_queue_messages_group.
SELECT conversation_handle, priority, message_id FROM queue_messages
WHERE conversation_group_id = :group_id AND status = 1
ORDER BY priority DESC, message_id
LIMIT :top;

-- name: receive_take_conversation
-- Take up to :top ready messages of one conversation, in order.
DELETE FROM queue_messages WHERE message_id IN (
    SELECT message_id FROM queue_messages
    WHERE conversation_handle = :handle AND status = 1
    ORDER BY message_sequence_number
    LIMIT :top
)
RETURNING *;

-- name: receive_take_conversation_retained
-- The same on a RETENTION queue.
UPDATE queue_messages SET status = 0 WHERE message_id IN (
    SELECT message_id FROM queue_messages
    WHERE conversation_handle = :handle AND status = 1
    ORDER BY message_sequence_number
    LIMIT :top
)
RETURNING *;

-- name: timers_due
-- Conversation timers that have fired.
SELECT * FROM conversation_endpoints
WHERE timer_due_at IS NOT NULL AND timer_due_at <= :now
ORDER BY timer_due_at
LIMIT :limit;

-- name: lifetimes_due
-- Endpoints whose lifetime has run out: open ones (SO, SI, CO) get the lifetime Error; one
-- this side already ended (DO) is closed. DI and ER already hold the message that tells
-- their application to END (next_deadline uses the same states).
SELECT * FROM conversation_endpoints
WHERE lifetime_expires_at IS NOT NULL AND state IN ('SO', 'SI', 'CO', 'DO')
AND lifetime_expires_at <= :now
ORDER BY lifetime_expires_at
LIMIT :limit;

-- name: group_try_lock
-- The group lock if nobody holds it (lifetime expiry never waits; a no-op on SQLite).
SELECT conversation_group_id FROM conversation_groups WHERE conversation_group_id = :group_id;

-- name: lifetime_retry
-- A due endpoint whose group another transaction holds: look again at :retry_at.
UPDATE conversation_endpoints SET lifetime_expires_at = :retry_at
WHERE conversation_handle = :handle;

-- name: lifetime_expire
-- Put an endpoint whose lifetime ran out into the error state; it sends nothing more.
UPDATE conversation_endpoints SET state = 'ER', timer_due_at = NULL
WHERE conversation_handle = :handle;

-- name: timer_clear
-- A fired timer is gone.
UPDATE conversation_endpoints SET timer_due_at = NULL WHERE conversation_handle = :handle;

-- name: next_deadline
-- The soonest timer, lifetime expiry, lease expiry or parked message's return, so the
-- timer thread sleeps just long enough.
SELECT min(t) FROM (
    SELECT min(timer_due_at) AS t FROM conversation_endpoints WHERE timer_due_at IS NOT NULL
    UNION ALL
    SELECT min(lifetime_expires_at) FROM conversation_endpoints
    WHERE lifetime_expires_at IS NOT NULL AND state IN ('SO', 'SI', 'CO', 'DO')
    UNION ALL
    SELECT min(expires_at) FROM message_leases
    UNION ALL
    SELECT min(redeliver_at) FROM poison_messages WHERE state = 'PARKED'
) AS deadlines;

-- name: priority_insert
-- CREATE BROKER PRIORITY.
INSERT INTO conversation_priorities (
    priority_name, contract_name, local_service_name, remote_service_name, priority_level,
    created_at
) VALUES (:name, :contract, :local_service, :remote_service, :level, :now);

-- name: priority_get
-- One priority.
SELECT * FROM conversation_priorities WHERE priority_name = :name;

-- name: priority_list
-- sys.conversation_priorities.
SELECT * FROM conversation_priorities ORDER BY priority_name;

-- name: priority_same_match
-- Another priority with the same contract / local / remote triple (ANY = NULL).
SELECT priority_name FROM conversation_priorities
WHERE coalesce(contract_name, '') = coalesce(CAST(:contract AS VARCHAR), '')
AND coalesce(local_service_name, '') = coalesce(CAST(:local_service AS VARCHAR), '')
AND coalesce(remote_service_name, '') = coalesce(CAST(:remote_service AS VARCHAR), '')
AND priority_name <> :name;

-- name: priority_update
-- ALTER BROKER PRIORITY (the caller merged the changes); endpoints keep their level.
UPDATE conversation_priorities SET contract_name = :contract,
    local_service_name = :local_service, remote_service_name = :remote_service,
    priority_level = :level
WHERE priority_name = :name;

-- name: priority_delete
-- DROP BROKER PRIORITY.
DELETE FROM conversation_priorities WHERE priority_name = :name;

-- name: setting_get
-- A broker-wide setting.
SELECT setting_value FROM broker_settings WHERE setting_name = :name;

-- name: setting_set
-- Change a broker-wide setting.
UPDATE broker_settings SET setting_value = :value WHERE setting_name = :name;

-- name: setting_insert_once
-- Create a broker-wide setting unless it exists.
INSERT INTO broker_settings (setting_name, setting_value) VALUES (:name, :value)
ON CONFLICT (setting_name) DO NOTHING;

-- name: monitor_ensure
-- A queue monitor row for a queue that activates (idempotent).
INSERT INTO queue_monitors (queue_name, state, updated_at) VALUES (:queue, 'INACTIVE', :now)
ON CONFLICT (queue_name) DO NOTHING;

-- name: monitor_lock
-- Lock a queue's monitor row: activation decisions of several runtimes take turns.
SELECT * FROM queue_monitors WHERE queue_name = :queue;

-- name: monitor_list
-- sys.dm_broker_queue_monitors, with the readers running and messages ready.
SELECT m.*,
    (SELECT count(*) FROM activated_tasks t WHERE t.queue_name = m.queue_name) AS tasks_running,
    (SELECT count(*) FROM queue_messages q
     WHERE q.queue_name = m.queue_name AND q.status = 1) AS messages_ready
FROM queue_monitors m ORDER BY m.queue_name;

-- name: monitor_record_empty
-- An unfiltered RECEIVE came back empty: somebody is there to take work.
UPDATE queue_monitors SET last_empty_rowset_at = :now, state = 'RECEIVES_OCCURRING',
    updated_at = :now
WHERE queue_name = :queue;

-- name: monitor_activated
-- The monitor started a reader.
UPDATE queue_monitors SET last_activated_at = :now, state = 'RECEIVES_OCCURRING',
    updated_at = :now
WHERE queue_name = :queue;

-- name: monitor_notified
-- The monitor posted a QUEUE_ACTIVATION event; it waits for a RECEIVE or the timeout.
UPDATE queue_monitors SET last_notified_at = :now, notified_head_message_id = :head,
    state = 'NOTIFIED', updated_at = :now
WHERE queue_name = :queue;

-- name: monitor_served
-- A runtime that runs this queue's monitor vouches for it at each heartbeat, idle or not:
-- a fresh updated_at says the queue is served (what `scheduler-lib run` waits for).
UPDATE queue_monitors SET updated_at = :now WHERE queue_name = :queue;

-- name: monitor_idle
-- Nothing to do on the queue.
UPDATE queue_monitors SET state = 'INACTIVE', updated_at = :now
WHERE queue_name = :queue AND state <> 'INACTIVE';

-- name: monitor_delete_unused
-- Monitors of queues that no longer activate or no longer exist.
DELETE FROM queue_monitors WHERE queue_name NOT IN (
    SELECT queue_name FROM queues WHERE is_activation_enabled
    UNION SELECT queue_name FROM event_notifications WHERE event_type = 'QUEUE_ACTIVATION'
);

-- name: queue_head
-- The first ready message of a queue (the monitor's view of "is there work").
SELECT min(message_id) FROM queue_messages WHERE queue_name = :queue AND status = 1;

-- name: queue_ready_count
-- Ready messages of a queue, counted up to :cap (eager activation wants no more).
SELECT count(*) FROM (
    SELECT 1 FROM queue_messages WHERE queue_name = :queue AND status = 1 LIMIT :cap
) AS ready;

-- name: queue_lease_count
-- Messages of a queue its readers hold under leases: readers busy with them.
SELECT count(*) FROM message_leases WHERE queue_name = :queue;

-- name: queues_activating
-- Queues that need a monitor: activation on, or a QUEUE_ACTIVATION subscriber.
SELECT queue_name FROM queues WHERE is_activation_enabled
UNION SELECT queue_name FROM event_notifications WHERE event_type = 'QUEUE_ACTIVATION';

-- name: task_insert
-- A reader starts (sys.dm_broker_activated_tasks).
INSERT INTO activated_tasks (
    task_id, queue_name, procedure_name, runtime_id, host_name, process_id, reader_name,
    execute_as, started_at, heartbeat_at
) VALUES (
    :task_id, :queue, :procedure, :runtime_id, :host, :pid, :reader, :execute_as, :now, :now
);

-- name: task_delete
-- A reader has exited.
DELETE FROM activated_tasks WHERE task_id = :task_id;

-- name: task_count
-- Readers running on a queue.
SELECT count(*) FROM activated_tasks WHERE queue_name = :queue;

-- name: task_list
-- sys.dm_broker_activated_tasks.
SELECT * FROM activated_tasks ORDER BY queue_name, started_at;

-- name: tasks_heartbeat
-- A runtime vouches for its readers.
UPDATE activated_tasks SET heartbeat_at = :now WHERE runtime_id = :runtime_id;

-- name: tasks_of_runtime
-- The readers a runtime has rows for (a row whose reader is gone is removed by it).
SELECT task_id FROM activated_tasks WHERE runtime_id = :runtime_id;

-- name: tasks_expire
-- Readers whose runtime stopped vouching for them are gone (a crashed process) — once
-- their runtime had a whole expiry to vouch for them since the database was last back
-- (:recovered_at, as this process saw it).
DELETE FROM activated_tasks WHERE heartbeat_at < :cutoff AND :recovered_at <= :cutoff;

-- name: event_notification_insert
-- CREATE EVENT NOTIFICATION.
INSERT INTO event_notifications (
    notification_name, queue_name, event_type, to_service_name, conversation_handle,
    created_at
) VALUES (:name, :queue, :event_type, :to_service, NULL, :now);

-- name: event_notification_get
-- One event notification.
SELECT * FROM event_notifications WHERE notification_name = :name;

-- name: event_notification_list
-- Every event notification.
SELECT * FROM event_notifications ORDER BY notification_name;

-- name: event_notifications_for
-- The subscribers of one event on one queue.
SELECT * FROM event_notifications WHERE queue_name = :queue AND event_type = :event_type
ORDER BY notification_name;

-- name: event_notification_set_dialog
-- The dialog a subscription's events travel on.
UPDATE event_notifications SET conversation_handle = :handle WHERE notification_name = :name;

-- name: event_notification_delete
-- DROP EVENT NOTIFICATION.
DELETE FROM event_notifications WHERE notification_name = :name;

-- name: poison_history
-- Failures and parkings of one message, oldest first (the detector counts them).
SELECT * FROM poison_message_details
WHERE conversation_handle = :handle AND message_sequence_number = :seq
ORDER BY incident_id;

-- name: poison_history_conversation
-- Failures and parkings of a conversation's messages (one query for a received batch).
SELECT * FROM poison_message_details WHERE conversation_handle = :handle
ORDER BY incident_id;

-- name: poison_incident_insert
-- Record a failure (or a parking) of a message, outside the transaction that failed.
INSERT INTO poison_message_details (
    queue_name, conversation_handle, message_sequence_number, message_type_name, kind,
    error, worker, occurred_at
) VALUES (:queue, :handle, :seq, :message_type, :kind, :error, :worker, :now);

-- name: poison_history_delete
-- Forget a message's failures: it was handled, replayed or dropped.
DELETE FROM poison_message_details
WHERE conversation_handle = :handle AND message_sequence_number = :seq;

-- name: poison_history_delete_conversation
-- A closed conversation's failures go with it.
DELETE FROM poison_message_details WHERE conversation_handle = :handle;

-- name: poison_message_insert
-- Take a poison message into the log (LOGGED) or the holding queue (PARKED).
INSERT INTO poison_messages (
    state, queue_name, conversation_group_id, conversation_handle, message_sequence_number,
    message_type_name, message_body, priority, service_name, service_contract_name,
    enqueued_at, failures, cycles, last_error, dispositions, recorded_at, redeliver_at
) VALUES (
    :state, :queue, :group_id, :handle, :seq, :message_type, :body, :priority, :service,
    :contract, :enqueued_at, :failures, :cycles, :last_error, :dispositions, :now,
    :redeliver_at

)
RETURNING poison_id;

-- name: poison_message_get
-- One poison message.
SELECT * FROM poison_messages WHERE poison_id = :poison_id;

-- name: poison_message_list
-- Poison messages, optionally of one queue and/or state, oldest first.
SELECT * FROM poison_messages
WHERE (CAST(:queue AS VARCHAR(128)) IS NULL OR queue_name = :queue)
AND (CAST(:state AS VARCHAR(8)) IS NULL OR state = :state)
ORDER BY poison_id;

-- name: poison_message_delete
-- A poison message leaves the log / holding queue (replayed, redelivered or dropped).
DELETE FROM poison_messages WHERE poison_id = :poison_id;

-- name: poison_message_to_log
-- A parked message whose conversation ended meanwhile stays, logged, for an operator.
UPDATE poison_messages SET state = 'LOGGED', redeliver_at = NULL, last_error = :last_error,
    dispositions = :dispositions
WHERE poison_id = :poison_id;

-- name: parked_due
-- Parked messages whose delay is over.
SELECT * FROM poison_messages
WHERE state = 'PARKED' AND redeliver_at <= :now
ORDER BY redeliver_at
LIMIT :limit;

-- name: poison_policy_get
-- A queue's poison policy.
SELECT * FROM poison_policies WHERE queue_name = :queue;

-- name: poison_policy_delete
-- Back to the default policy.
DELETE FROM poison_policies WHERE queue_name = :queue;

-- name: poison_policy_insert
-- Set a queue's poison policy.
INSERT INTO poison_policies (queue_name, threshold, dispositions, updated_at)
VALUES (:queue, :threshold, :dispositions, :now);

-- name: lease_insert
-- A message taken for long work: it waits here, off its queue, under its worker's lease.
INSERT INTO message_leases (
    lease_id, queue_name, conversation_group_id, conversation_handle,
    message_sequence_number, message_type_name, message_body, priority, service_name,
    service_contract_name, enqueued_at, worker, taken_at, heartbeat_at, expires_at
) VALUES (
    :lease_id, :queue_name, :conversation_group_id, :conversation_handle,
    :message_sequence_number, :message_type_name, :message_body, :priority, :service_name,
    :service_contract_name, :enqueued_at, :worker, :now, :now, :expires_at
);

-- name: lease_renew
-- The worker is alive: push the lease's expiry out.
UPDATE message_leases SET heartbeat_at = :now, expires_at = :expires_at
WHERE lease_id = :lease_id;

-- name: lease_get
-- One lease (to complete or abandon it).
SELECT * FROM message_leases WHERE lease_id = :lease_id;

-- name: lease_delete
-- The lease ends: the work was answered, or the message went back or to its disposition.
DELETE FROM message_leases WHERE lease_id = :lease_id;

-- name: lease_list
-- Leases held now, oldest first.
SELECT * FROM message_leases
WHERE CAST(:queue AS VARCHAR(128)) IS NULL OR queue_name = :queue
ORDER BY taken_at;

-- name: leases_expired
-- Leases whose worker stopped renewing them, and had a whole lease to renew them since
-- the database was last back (:recovered_at): a live worker is never lost to an outage.
SELECT * FROM message_leases
WHERE expires_at <= :now AND :recovered_at + (expires_at - heartbeat_at) <= :now
ORDER BY expires_at LIMIT :limit;

-- name: leases_delete_conversation
-- A closed conversation's leased messages go with it.
DELETE FROM message_leases WHERE conversation_handle = :handle;


-- ---------------------------------------------------------------------------------
-- Broker-to-broker transport: routes, outgoing messages, fragments, events.
-- ---------------------------------------------------------------------------------

-- name: route_insert
-- CREATE ROUTE.
INSERT INTO routes (route_name, remote_service_name, broker_instance, address, created_at)
VALUES (:name, :service, :broker_instance, :address, :now);

-- name: route_update
-- ALTER ROUTE.
UPDATE routes SET remote_service_name = :service, broker_instance = :broker_instance,
    address = :address
WHERE route_name = :name;

-- name: route_get
-- One route.
SELECT * FROM routes WHERE route_name = :name;

-- name: route_list
-- Every route (sys.routes).
SELECT * FROM routes ORDER BY route_name;

-- name: route_delete
-- DROP ROUTE.
DELETE FROM routes WHERE route_name = :name;

-- name: routes_for_service
-- The routes that can carry a service's messages: one of a named broker instance first.
SELECT * FROM routes WHERE remote_service_name = :service
ORDER BY broker_instance IS NULL, route_name;

-- name: outgoing_insert
-- A message for a service on another broker: it waits here until that broker acknowledges.
INSERT INTO transmission_queue (
    conversation_handle, conversation_id, is_initiator, from_service_name, to_service_name,
    service_contract_name, message_sequence_number, message_type_name, message_body,
    priority, lifetime_expires_at, enqueued_at, transmission_status, fair_at, is_outgoing,
    to_queue_name, conversation_group_id
) VALUES (
    :handle, :conversation_id, :is_initiator, :from_service, :to_service, :contract, :seq,
    :message_type, :body, :priority, :lifetime_expires_at, :now, '', 0, TRUE, '', :group_id
);

-- name: outgoing_after
-- Outgoing messages past the transmitter's cursor, in arrival order.
SELECT message_id, conversation_handle, conversation_id, is_initiator, from_service_name,
    to_service_name, service_contract_name, message_sequence_number, message_type_name,
    message_body, priority, lifetime_expires_at, enqueued_at
FROM transmission_queue
WHERE is_outgoing AND message_id > :after
ORDER BY message_id
LIMIT :limit;

-- name: outgoing_upto
-- Outgoing messages at or before the cursor (the periodic look for late commits).
SELECT message_id, conversation_handle, conversation_id, is_initiator, from_service_name,
    to_service_name, service_contract_name, message_sequence_number, message_type_name,
    message_body, priority, lifetime_expires_at, enqueued_at
FROM transmission_queue
WHERE is_outgoing AND message_id <= :upto
ORDER BY message_id
LIMIT :limit;

-- name: outgoing_delete
-- The far broker acknowledged the message: it leaves the transmission queue. Matched on
-- its sequence number too: SQLite reuses a deleted row's id, and this message may have
-- gone already (its conversation ended) and another taken the id.
DELETE FROM transmission_queue
WHERE message_id = :message_id AND is_outgoing AND conversation_handle = :handle
AND message_sequence_number = :seq;

-- name: outgoing_set_status
-- The last outcome of transmitting a message (sys.transmission_queue.transmission_status).
UPDATE transmission_queue
SET transmission_status = :status, attempts = attempts + :attempts, last_attempt_at = :now
WHERE message_id = :message_id AND is_outgoing AND conversation_handle = :handle
AND message_sequence_number = :seq;

-- name: outgoing_list
-- Outgoing messages with their last error, oldest first.
SELECT message_id, conversation_handle, to_service_name, message_sequence_number,
    message_type_name, priority, enqueued_at, transmission_status, attempts, last_attempt_at
FROM transmission_queue WHERE is_outgoing ORDER BY message_id LIMIT :limit;

-- name: endpoint_of_conversation
-- The endpoint of one side of a conversation (the transport's lookup by conversation id).
SELECT * FROM conversation_endpoints
WHERE conversation_id = :conversation_id AND is_initiator = :is_initiator;

-- name: endpoint_tombstone
-- A remote conversation's endpoint closes but stays (state CD) so that late copies of
-- its messages are known for duplicates.
UPDATE conversation_endpoints
SET state = 'CD', closed_at = :now, timer_due_at = NULL, lifetime_expires_at = NULL
WHERE conversation_handle = :handle;

-- name: endpoints_closed_before
-- Tombstones old enough to go.
SELECT conversation_handle, conversation_group_id FROM conversation_endpoints
WHERE closed_at IS NOT NULL AND closed_at < :before
LIMIT :limit;

-- name: fragment_insert
-- A fragment (or a whole message ahead of its turn) waiting to be delivered; a copy of
-- one already here changes nothing.
INSERT INTO transport_fragments (
    conversation_id, is_initiator, message_sequence_number, fragment_index, fragment_count,
    message_type_name, message_body, received_at
) VALUES (:conversation_id, :is_initiator, :seq, :fragment_index, :fragment_count,
    :message_type, :body, :now)
ON CONFLICT DO NOTHING;

-- name: fragments_of_message
-- The fragments of one message that have arrived, in order.
SELECT fragment_index, fragment_count, message_type_name, message_body
FROM transport_fragments
WHERE conversation_id = :conversation_id AND is_initiator = :is_initiator
AND message_sequence_number = :seq
ORDER BY fragment_index;

-- name: fragments_delete_message
-- A message was delivered whole: its fragments go.
DELETE FROM transport_fragments
WHERE conversation_id = :conversation_id AND is_initiator = :is_initiator
AND message_sequence_number = :seq;

-- name: fragments_delete_conversation
-- A conversation closed: whatever of it was still waiting goes.
DELETE FROM transport_fragments
WHERE conversation_id = :conversation_id AND is_initiator = :is_initiator;

-- name: fragments_any_of_conversation
-- Whether anything of a conversation (in one direction) is still waiting.
SELECT 1 AS waiting FROM transport_fragments
WHERE conversation_id = :conversation_id AND is_initiator = :is_initiator
LIMIT 1;

-- name: fragments_waiting
-- The conversations that have something waiting (read once when a transport starts).
SELECT DISTINCT conversation_id, is_initiator FROM transport_fragments;

-- name: transport_event_insert
-- Something the transport refused: a corrupted frame, a connection, a message.
INSERT INTO transport_events (occurred_at, event_type, peer, detail)
VALUES (:now, :event_type, :peer, :detail);

-- name: transport_event_list
-- The newest transport events first.
SELECT * FROM transport_events ORDER BY event_id DESC LIMIT :limit;

-- name: transport_events_prune_age
-- Transport events older than their retention.
DELETE FROM transport_events WHERE occurred_at < :before;

-- name: transport_events_prune_count
-- All but the newest :keep transport events.
DELETE FROM transport_events WHERE event_id <= (
    SELECT event_id FROM transport_events ORDER BY event_id DESC LIMIT 1 OFFSET :keep
);

-- name: transport_connections_clear
-- An endpoint's connections are written anew (or it stopped).
DELETE FROM transport_connections WHERE endpoint_id = :endpoint_id;

-- name: transport_connection_insert
-- One connection of a running endpoint.
INSERT INTO transport_connections (
    endpoint_id, connection_number, endpoint_address, host_name, process_id, direction,
    peer, peer_address, peer_broker, opened_at, last_activity_at, frames_sent,
    frames_received, bytes_sent, bytes_received, corrupted_frames, carries_messages,
    written_at
) VALUES (
    :endpoint_id, :connection_number, :endpoint_address, :host_name, :process_id,
    :direction, :peer, :peer_address, :peer_broker, :opened_at, :last_activity_at,
    :frames_sent, :frames_received, :bytes_sent, :bytes_received, :corrupted_frames,
    :carries_messages, :now
);

-- name: transport_connections_stale
-- Rows of endpoints that stopped writing (a killed process): gone after :before.
DELETE FROM transport_connections WHERE written_at < :before;

-- name: transport_connection_list
-- sys.dm_broker_connections: every running endpoint's connections.
SELECT * FROM transport_connections ORDER BY endpoint_id, opened_at;

-- name: metrics_queues
-- Per queue, for /metrics (scheduler_lib.scheduler.metrics): its settings, the messages
-- ready and leased, the oldest ready message's enqueue time, leases past their expiry
-- (a worker that stopped renewing), the readers running. The ready messages and readers
-- are ranges of indexes; the leases (no queue index) are as few as the tasks running.
SELECT q.queue_name, q.is_receive_enabled, q.max_readers,
    (SELECT count(*) FROM queue_messages m
     WHERE m.queue_name = q.queue_name AND m.status = 1) AS ready,
    (SELECT min(m.enqueued_at) FROM queue_messages m
     WHERE m.queue_name = q.queue_name AND m.status = 1) AS oldest_ready_at,
    (SELECT count(*) FROM message_leases l WHERE l.queue_name = q.queue_name) AS leased,
    (SELECT count(*) FROM message_leases l
     WHERE l.queue_name = q.queue_name AND l.expires_at <= :now) AS leases_expired,
    (SELECT count(*) FROM activated_tasks t WHERE t.queue_name = q.queue_name) AS readers
FROM queues q ORDER BY q.queue_name;

-- name: metrics_transmission
-- Messages waiting for a remote broker (the transmission queue's outgoing rows, by their
-- partial index) and the oldest's enqueue time.
SELECT count(*) AS waiting, min(enqueued_at) AS oldest_at FROM transmission_queue
WHERE is_outgoing;

-- name: metrics_held
-- Messages held for a local queue that is off (they enter it when it is on again), per
-- queue.
SELECT to_queue_name, count(*) AS held FROM transmission_queue
WHERE NOT is_outgoing GROUP BY to_queue_name ORDER BY to_queue_name;

-- name: metrics_table_exists
-- Whether a table exists (the metrics of a layer whose schema may be absent).
SELECT count(*) AS n FROM sqlite_master WHERE type = 'table' AND name = :name;

-- name: metrics_transport
-- Live transport connections by direction, with the corrupted frames they met.
SELECT direction, count(*) AS connections, coalesce(sum(corrupted_frames), 0) AS corrupted
FROM transport_connections GROUP BY direction ORDER BY direction;

-- name: health_ping
-- /healthz: the database answers.
SELECT 1 AS ok;
