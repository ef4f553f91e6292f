-- PostgreSQL overrides of queries.sql: same names, same binds, same result columns.

-- name: queue_notify
-- Wake receivers waiting on a queue, only when somebody waits (NOTIFY costs at commit).
SELECT pg_notify('scheduler_lib_broker', queue_name) FROM queues
WHERE queue_name = :name AND waiting_receivers > 0;

-- name: receive_pick_group
-- Lock the group of the first ready message whose group nobody else holds.
SELECT g.conversation_group_id FROM queue_messages m
JOIN conversation_groups g ON g.conversation_group_id = m.conversation_group_id
WHERE m.queue_name = :queue AND m.status = 1
ORDER BY m.priority DESC, m.message_id
LIMIT 1
FOR UPDATE OF g SKIP LOCKED;

-- name: get_group_pick
-- GET CONVERSATION GROUP: lock the next group with ready messages.
SELECT g.conversation_group_id FROM queue_messages m
JOIN conversation_groups g ON g.conversation_group_id = m.conversation_group_id
WHERE m.queue_name = :queue AND m.status = 1
ORDER BY m.priority DESC, m.message_id
LIMIT 1
FOR UPDATE OF g SKIP LOCKED;

-- name: receive_lock_group
-- Lock a named group of the queue, if it has ready messages and nobody else holds it.
SELECT g.conversation_group_id FROM conversation_groups g
WHERE g.conversation_group_id = :group_id AND g.queue_name = :queue
AND EXISTS (
    SELECT 1 FROM queue_messages m
    WHERE m.conversation_group_id = g.conversation_group_id AND m.status = 1
)
FOR UPDATE OF g SKIP LOCKED;

-- name: receive_lock_conversation
-- Lock the group of a conversation of the queue, if that conversation has ready messages.
SELECT g.conversation_group_id FROM conversation_endpoints e
JOIN conversation_groups g ON g.conversation_group_id = e.conversation_group_id
WHERE e.conversation_handle = :handle AND e.queue_name = :queue
AND EXISTS (
    SELECT 1 FROM queue_messages m
    WHERE m.conversation_handle = e.conversation_handle AND m.status = 1
)
FOR UPDATE OF g SKIP LOCKED;

-- name: timers_due
-- Conversation timers that have fired; other processes' timer threads skip these rows.
SELECT * FROM conversation_endpoints
WHERE timer_due_at IS NOT NULL AND timer_due_at <= :now
ORDER BY timer_due_at
LIMIT :limit
FOR UPDATE SKIP LOCKED;

-- name: lifetimes_due
-- Conversations whose lifetime has run out.
SELECT * FROM conversation_endpoints
WHERE lifetime_expires_at IS NOT NULL AND state <> 'ER' AND lifetime_expires_at <= :now
ORDER BY lifetime_expires_at
LIMIT :limit
FOR UPDATE SKIP LOCKED;
