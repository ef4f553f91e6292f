-- PostgreSQL overrides of queries.sql: same names, same binds, same result columns.

-- name: queue_notify
-- Wake receivers waiting on a queue, only when somebody waits (NOTIFY costs at commit).
SELECT pg_notify('scheduler_lib_broker', queue_name) FROM queues
WHERE queue_name = :name AND waiting_receivers > 0;

-- name: transmission_notify
-- Wake the transport endpoints: a committed transaction put messages in the transmission
-- queue.
SELECT pg_notify('scheduler_lib_broker', '<transmission>');

-- name: receive_pick_group
-- Lock the group of the first ready message whose group nobody else holds.
SELECT g.conversation_group_id FROM queue_messages m
JOIN conversation_groups g ON g.conversation_group_id = m.conversation_group_id
WHERE m.queue_name = :queue AND m.status = 1
ORDER BY m.priority DESC, m.fair_at, m.message_id
LIMIT 1
FOR UPDATE OF g SKIP LOCKED;

-- name: get_group_pick
-- GET CONVERSATION GROUP: lock the next group with ready messages.
SELECT g.conversation_group_id FROM queue_messages m
JOIN conversation_groups g ON g.conversation_group_id = m.conversation_group_id
WHERE m.queue_name = :queue AND m.status = 1
ORDER BY m.priority DESC, m.fair_at, m.message_id
LIMIT 1
FOR UPDATE OF g SKIP LOCKED;

-- name: receive_pick_aged
-- With aging on: lock the group of the oldest message waiting past the bound.
SELECT g.conversation_group_id FROM queue_messages m
JOIN conversation_groups g ON g.conversation_group_id = m.conversation_group_id
WHERE m.queue_name = :queue AND m.status = 1 AND m.enqueued_at <= :cutoff
ORDER BY m.enqueued_at, m.message_id
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
-- Endpoints whose lifetime has run out (states as in queries.sql); other processes' timer
-- threads skip these rows.
SELECT * FROM conversation_endpoints
WHERE lifetime_expires_at IS NOT NULL AND state IN ('SO', 'SI', 'CO', 'DO')
AND lifetime_expires_at <= :now
ORDER BY lifetime_expires_at
LIMIT :limit
FOR UPDATE SKIP LOCKED;

-- name: group_try_lock
-- The group lock if nobody holds it: lifetime expiry already holds an endpoint row, so it
-- never waits for a group (END waits the other way round: group, then endpoints).
SELECT conversation_group_id FROM conversation_groups WHERE conversation_group_id = :group_id
FOR UPDATE SKIP LOCKED;

-- name: endpoint_lock
-- Lock one endpoint's row (its own SENDs wait in turn: a first SEND that makes the
-- target endpoint); no other row, so it adds no lock order.
SELECT conversation_handle FROM conversation_endpoints WHERE conversation_handle = :handle
FOR UPDATE;

-- name: endpoints_lock
-- Lock both endpoints of a conversation, initiator first.
SELECT conversation_handle FROM conversation_endpoints
WHERE conversation_id = :conversation_id ORDER BY is_initiator DESC
FOR UPDATE;

-- name: group_lock
-- END CONVERSATION and MOVE CONVERSATION wait for the conversation group lock, as RECEIVE
-- holds it (MOVE takes both groups', in group id order). No row: the group is gone.
SELECT conversation_group_id FROM conversation_groups WHERE conversation_group_id = :group_id
FOR UPDATE;

-- name: send_fast
-- SEND in one round trip once both endpoints exist: check state, contract, direction and
-- the caller's cached validation, take the sequence number, enqueue, and NOTIFY only if a
-- receiver waits. No row back means "take the checked slow path" (it raises the precise
-- error, creates the target endpoint, holds the message for a disabled queue, or keeps a
-- copy on a sender's queue with retention, status 3); nothing
-- was written in that case, because every check guards the one UPDATE. With :lease_id it
-- also ends that lease, which must still be there (locked first: an expiry waits for this
-- statement's end) for anything to be written: a lost lease sends nothing either, so
-- that in autocommit this is a whole answer — the message, the lease's end and a
-- layer's row riding along (Store.riding) — or nothing (the checked path says why).
WITH lease AS (
    SELECT l.lease_id FROM message_leases l WHERE l.lease_id = :lease_id FOR UPDATE
), far AS (
    SELECT f.conversation_handle, f.queue_name, f.conversation_group_id, f.priority,
        f.service_name, f.contract_name, q.waiting_receivers, q.fair_share_quantum
    FROM conversation_endpoints s
    JOIN conversation_endpoints f
        ON f.conversation_id = s.conversation_id AND f.is_initiator <> s.is_initiator
    JOIN queues q ON q.queue_name = f.queue_name
    WHERE s.conversation_handle = :handle
    AND f.state IN ('SO', 'SI', 'CO') AND q.is_receive_enabled
    -- The sender's queue keeps what it sends (RETENTION): the checked path writes the copy.
    AND NOT EXISTS (
        SELECT 1 FROM queues sq WHERE sq.queue_name = s.queue_name AND sq.is_retention_enabled
    )
    AND EXISTS (
        SELECT 1 FROM contract_message_types c
        JOIN message_types mt ON mt.message_type_name = c.message_type_name
        WHERE c.contract_name = s.contract_name AND c.message_type_name = :message_type
        AND mt.validation = :validation
        AND c.sent_by IN ('ANY', CASE WHEN s.is_initiator THEN 'INITIATOR' ELSE 'TARGET' END)
    )
), sender AS (
    UPDATE conversation_endpoints s
    SET send_sequence = s.send_sequence + 1,
        state = CASE WHEN s.state = 'SI' THEN 'CO' ELSE s.state END,
        fair_clock = CASE WHEN far.fair_share_quantum IS NULL THEN s.fair_clock
            ELSE GREATEST(:now, s.fair_clock + far.fair_share_quantum) END
    FROM far
    WHERE s.conversation_handle = :handle AND s.state IN ('SO', 'SI', 'CO')
    AND (CAST(:lease_id AS TEXT) IS NULL OR EXISTS (SELECT 1 FROM lease))
    RETURNING s.send_sequence - 1 AS message_sequence_number,
        CASE WHEN far.fair_share_quantum IS NULL THEN 0 ELSE s.fair_clock END AS fair_at
), enqueued AS (
    INSERT INTO queue_messages (
        queue_name, conversation_group_id, conversation_handle, message_sequence_number,
        message_type_name, message_body, priority, status, service_name,
        service_contract_name, enqueued_at, fair_at
    )
    SELECT far.queue_name, far.conversation_group_id, far.conversation_handle,
        sender.message_sequence_number, :message_type, :body, far.priority, 1,
        far.service_name, far.contract_name, :now, sender.fair_at
    FROM far, sender
    RETURNING queue_name
), completed AS (
    -- SEND ... completing a lease (the answer to leased work): the lease ends with the
    -- answer, in the same statement; none when :lease_id is NULL.
    DELETE FROM message_leases l USING sender WHERE l.lease_id = :lease_id
    RETURNING l.lease_id
)
SELECT sender.message_sequence_number, far.queue_name,
    CASE WHEN far.waiting_receivers > 0
        THEN pg_notify('scheduler_lib_broker', far.queue_name) IS NOT NULL
        ELSE false END AS notified,
    c.n AS leases_completed
FROM far, sender, (SELECT count(*) AS n FROM enqueued) AS e,
    (SELECT count(*) AS n FROM completed) AS c;

-- fragment: free_group_first
-- The group of the first ready message of an enabled queue without retention or aging
-- (receive_fast's, receive_fast_one's and take_fast's condition; otherwise no group, and
-- the checked slow path runs), locked unless another holds it: by level, then fair turn,
-- then arrival.
    SELECT g.conversation_group_id FROM queue_messages m
    JOIN conversation_groups g ON g.conversation_group_id = m.conversation_group_id
    WHERE m.queue_name = :queue AND m.status = 1
    AND EXISTS (
        SELECT 1 FROM queues q
        WHERE q.queue_name = :queue AND q.is_receive_enabled AND NOT q.is_retention_enabled
        AND q.receive_aging_seconds IS NULL
    )
    ORDER BY m.priority DESC, m.fair_at, m.message_id
    LIMIT 1
    FOR UPDATE OF g SKIP LOCKED

-- fragment: group_served
-- A locked group's first :top ready messages by conversation: the group's first :top
-- ready rows by level and arrival hold the oldest ready message of every conversation
-- served (the group id as a scalar, so this walks ix_queue_messages_group, never the
-- queue); conversations by level, then the arrival of their oldest ready message, each in
-- sequence order (one range of ix_queue_messages_conversation).
firsts AS (
    SELECT m.conversation_handle, m.priority, m.message_id FROM queue_messages m
    WHERE m.conversation_group_id = (SELECT conversation_group_id FROM grp) AND m.status = 1
    ORDER BY m.priority DESC, m.message_id
    LIMIT :top
    FOR UPDATE
), conversations AS (
    SELECT conversation_handle, priority, min(message_id) AS arrived
    FROM firsts GROUP BY conversation_handle, priority
), picked AS (
    SELECT s.message_id, c.arrived FROM conversations c
    CROSS JOIN LATERAL (
        SELECT m.message_id, m.message_sequence_number FROM queue_messages m
        WHERE m.conversation_handle = c.conversation_handle AND m.status = 1
        ORDER BY m.message_sequence_number
        LIMIT :top
        FOR UPDATE
    ) s
    ORDER BY c.priority DESC, c.arrived, s.message_sequence_number
    LIMIT :top

-- fragment: rollbacks_reset
-- queue_reset_rollbacks, in the same round trip: writes only after a rollback (taken:
-- the messages the statement took).
    UPDATE queues q SET consecutive_rollbacks = 0
    WHERE q.queue_name = :queue AND q.consecutive_rollbacks > 0
    AND EXISTS (SELECT 1 FROM taken)

-- name: receive_fast
-- RECEIVE in one round trip from an enabled queue without retention or aging: lock the
-- first group nobody holds and take its first :top messages. No row back: nothing was
-- there, or the queue needs the checked slow path (unknown, disabled, retention, aging).
-- The message rows are read FOR UPDATE: the statement's snapshot predates the group lock,
-- so it still sees the messages that the group's last holder took and committed between
-- the two; a plain read picked them, the DELETE found them gone, and the RECEIVE came back
-- empty with the group's other messages ready (a tenth of the RECEIVEs of four readers on
-- eight conversations). A locking read re-checks each row and moves on past the gone ones.
WITH grp AS (
    -- include: free_group_first
),
-- include: group_served
), taken AS (
    DELETE FROM queue_messages m USING picked WHERE m.message_id = picked.message_id
    RETURNING m.queue_name, m.conversation_group_id, m.conversation_handle,
        m.message_sequence_number, m.message_type_name, m.message_body, m.priority,
        m.service_name, m.service_contract_name, m.enqueued_at, m.status, picked.arrived
), reset AS (
    -- include: rollbacks_reset
)
SELECT queue_name, conversation_group_id, conversation_handle, message_sequence_number,
    message_type_name, message_body, priority, service_name, service_contract_name,
    enqueued_at, status
FROM taken ORDER BY priority DESC, arrived, message_sequence_number;

-- name: receive_fast_one
-- receive_fast for one message (TOP 1, the drain of a consumer taking one at a time): the
-- same group locked, then its first ready message by level and arrival names the
-- conversation served, and that conversation's first ready message in sequence order is
-- taken — what receive_fast's firsts, conversations and picked come to for one row,
-- without the grouping and the sort they cost every message (a fifth more RECEIVEs per
-- second for four consumers). Rows read FOR UPDATE for the reason receive_fast gives.
WITH grp AS (
    -- include: free_group_first
), served AS (
    SELECT m.conversation_handle FROM queue_messages m
    WHERE m.conversation_group_id = (SELECT conversation_group_id FROM grp) AND m.status = 1
    ORDER BY m.priority DESC, m.message_id
    LIMIT 1
    FOR UPDATE
), picked AS (
    SELECT m.message_id FROM queue_messages m
    WHERE m.conversation_handle = (SELECT conversation_handle FROM served) AND m.status = 1
    ORDER BY m.message_sequence_number
    LIMIT 1
    FOR UPDATE
), taken AS (
    DELETE FROM queue_messages m USING picked WHERE m.message_id = picked.message_id
    RETURNING m.queue_name, m.conversation_group_id, m.conversation_handle,
        m.message_sequence_number, m.message_type_name, m.message_body, m.priority,
        m.service_name, m.service_contract_name, m.enqueued_at, m.status
), reset AS (
    -- include: rollbacks_reset
)
SELECT queue_name, conversation_group_id, conversation_handle, message_sequence_number,
    message_type_name, message_body, priority, service_name, service_contract_name,
    enqueued_at, status
FROM taken;

-- name: commit_without_fsync
-- For bookkeeping nobody must find after a crash (the waiting-receiver count): the
-- commit need not wait for the WAL flush, so the receiver returns sooner.
SET LOCAL synchronous_commit TO OFF;

-- name: monitor_lock
-- Lock a queue's monitor row: activation decisions of several runtimes take turns.
SELECT * FROM queue_monitors WHERE queue_name = :queue FOR UPDATE;

-- name: leases_expired
-- Leases whose worker stopped renewing them, and had a whole lease to renew them since
-- the database was last back — as this process saw it (:recovered_at), or since the
-- server started (a restart nobody here saw); other timer threads skip these rows.
SELECT * FROM message_leases
WHERE expires_at <= :now
  AND GREATEST(CAST(:recovered_at AS double precision),
               extract(epoch FROM pg_postmaster_start_time())) + (expires_at - heartbeat_at)
      <= :now
ORDER BY expires_at LIMIT :limit
FOR UPDATE SKIP LOCKED;

-- name: tasks_expire
-- Readers whose runtime stopped vouching for them are gone (a crashed process) — once
-- their runtime had a whole expiry to vouch for them since the database was last back,
-- as this process saw it (:recovered_at), or since the server started.
DELETE FROM activated_tasks
WHERE heartbeat_at < :cutoff
  AND GREATEST(CAST(:recovered_at AS double precision),
               extract(epoch FROM pg_postmaster_start_time())) <= :cutoff;

-- name: parked_due
-- Parked messages whose delay is over; other timer threads skip these rows.
SELECT * FROM poison_messages
WHERE state = 'PARKED' AND redeliver_at <= :now
ORDER BY redeliver_at
LIMIT :limit
FOR UPDATE SKIP LOCKED;

-- name: lease_get
-- One lease, locked: completing, abandoning and expiring it take turns.
SELECT * FROM message_leases WHERE lease_id = :lease_id FOR UPDATE;

-- name: endpoint_take_send_sequence
-- Assign the next sequence number; refuses (no row) unless the state allows sending.
-- With fair share on the target queue (:quantum not NULL) it also stamps the message.
UPDATE conversation_endpoints
SET send_sequence = send_sequence + 1,
    state = CASE WHEN state = 'SI' THEN 'CO' ELSE state END,
    fair_clock = CASE WHEN CAST(:quantum AS DOUBLE PRECISION) IS NULL THEN fair_clock
        ELSE GREATEST(CAST(:now AS DOUBLE PRECISION), fair_clock + :quantum) END
WHERE conversation_handle = :handle AND state IN ('SO', 'SI', 'CO')
RETURNING send_sequence - 1 AS message_sequence_number,
    CASE WHEN CAST(:quantum AS DOUBLE PRECISION) IS NULL THEN 0 ELSE fair_clock END AS fair_at;

-- name: receive_fast_conversation
-- RECEIVE ... WHERE conversation_handle = :handle in one round trip (Synchronization's
-- receive): lock the conversation's group unless another holds it, take its first :top
-- messages in sequence order. No row back: nothing there, or the checked path is needed.
-- Message rows read FOR UPDATE, as receive_fast says why.
WITH grp AS (
    SELECT g.conversation_group_id FROM conversation_endpoints e
    JOIN conversation_groups g ON g.conversation_group_id = e.conversation_group_id
    WHERE e.conversation_handle = :handle AND e.queue_name = :queue
    AND EXISTS (
        SELECT 1 FROM queues q
        WHERE q.queue_name = :queue AND q.is_receive_enabled AND NOT q.is_retention_enabled
    )
    AND EXISTS (
        SELECT 1 FROM queue_messages m
        WHERE m.conversation_handle = e.conversation_handle AND m.status = 1
    )
    FOR UPDATE OF g SKIP LOCKED
), picked AS (
    SELECT m.message_id FROM queue_messages m
    WHERE m.conversation_handle = :handle AND m.status = 1
    AND EXISTS (SELECT 1 FROM grp)
    ORDER BY m.message_sequence_number
    LIMIT :top
    FOR UPDATE
), taken AS (
    DELETE FROM queue_messages m USING picked WHERE m.message_id = picked.message_id
    RETURNING m.queue_name, m.conversation_group_id, m.conversation_handle,
        m.message_sequence_number, m.message_type_name, m.message_body, m.priority,
        m.service_name, m.service_contract_name, m.enqueued_at, m.status
), reset AS (
    -- include: rollbacks_reset
)
SELECT * FROM taken ORDER BY message_sequence_number;

-- name: take_fast
-- RECEIVE for long work in one round trip: take the first :top messages of the first
-- group nobody holds (as receive_fast) and put them under leases. Run in autocommit on a
-- connection whose commits do not wait for the WAL flush (Broker.take(durable=False)).
-- Message rows read FOR UPDATE, as receive_fast says why.
WITH grp AS (
    -- include: free_group_first
),
-- include: group_served
), taken AS (
    DELETE FROM queue_messages m USING picked WHERE m.message_id = picked.message_id
    RETURNING m.queue_name, m.conversation_group_id, m.conversation_handle,
        m.message_sequence_number, m.message_type_name, m.message_body, m.priority,
        m.service_name, m.service_contract_name, m.enqueued_at, picked.arrived
), reset AS (
    -- include: rollbacks_reset
)
INSERT INTO message_leases (
    lease_id, queue_name, conversation_group_id, conversation_handle,
    message_sequence_number, message_type_name, message_body, priority, service_name,
    service_contract_name, enqueued_at, worker, taken_at, heartbeat_at, expires_at
)
SELECT gen_random_uuid()::text, t.queue_name, t.conversation_group_id,
    t.conversation_handle, t.message_sequence_number, t.message_type_name, t.message_body,
    t.priority, t.service_name, t.service_contract_name, t.enqueued_at, :worker, :now, :now,
    :expires_at
FROM taken t
ORDER BY t.priority DESC, t.arrived, t.message_sequence_number
RETURNING lease_id, queue_name, conversation_group_id, conversation_handle,
    message_sequence_number, message_type_name, message_body, priority, service_name,
    service_contract_name, enqueued_at;

-- name: leases_taken
-- The leases one take_fast made (its holder, its instant), as take_fast returns them: found
-- again when its reply was lost.
SELECT lease_id, queue_name, conversation_group_id, conversation_handle,
    message_sequence_number, message_type_name, message_body, priority, service_name,
    service_contract_name, enqueued_at
FROM message_leases WHERE worker = :worker AND taken_at = :now
ORDER BY priority DESC, conversation_handle, message_sequence_number;

-- name: target_create_fast
-- The target endpoint of a conversation whose initiator here has sent nothing yet, made
-- as the checked path makes it with the first message (a new group of the target
-- service's queue, state SI, the level of the most specific matching priority), when the
-- first SEND would pass the checks send_fast makes of the initiator: it runs ahead of
-- that SEND in one round trip, in the SEND's transaction, so that a new conversation's
-- first message goes in one statement too. Writes nothing when the target endpoint
-- exists, the target is on another broker, the initiator sent before or cannot send this
-- type, or the service is unknown: the SEND after it then finds no target and the
-- checked path says why.
WITH near AS (
    SELECT n.conversation_id, n.service_name, n.far_service_name, n.contract_name,
        n.lifetime_expires_at, sv.queue_name
    FROM conversation_endpoints n
    JOIN services sv ON sv.service_name = n.far_service_name
    WHERE n.conversation_handle = :handle AND n.is_initiator AND NOT n.is_remote
    AND n.state = 'SO' AND n.send_sequence = 0
    AND NOT EXISTS (
        SELECT 1 FROM conversation_endpoints f
        WHERE f.conversation_id = n.conversation_id AND NOT f.is_initiator
    )
    AND EXISTS (
        SELECT 1 FROM contract_message_types c
        JOIN message_types mt ON mt.message_type_name = c.message_type_name
        WHERE c.contract_name = n.contract_name AND c.message_type_name = :message_type
        AND mt.validation = :validation AND c.sent_by IN ('ANY', 'INITIATOR')
    )
    -- The initiator locked first, as the checked path's endpoint_lock does before it makes
    -- the target (the SEND after this locks it anyway): two first SENDs at once wait in
    -- turn, and the second, its row sent on by then, writes nothing here.
    FOR UPDATE OF n
), grp AS (
    INSERT INTO conversation_groups (conversation_group_id, queue_name, created_at)
    SELECT :group_id, near.queue_name, :now FROM near
    RETURNING conversation_group_id
)
INSERT INTO conversation_endpoints (
    conversation_handle, conversation_id, is_initiator, service_name, far_service_name,
    contract_name, queue_name, conversation_group_id, state, priority, send_sequence,
    receive_sequence, lifetime_expires_at, timer_due_at, created_at, is_remote
)
SELECT :target_handle, near.conversation_id, false, near.far_service_name,
    near.service_name, near.contract_name, near.queue_name, grp.conversation_group_id,
    'SI', coalesce((
        -- as endpoint_insert: SQL Server's precedence (contract, local, remote), else 5
        SELECT p.priority_level FROM conversation_priorities p
        WHERE (p.contract_name IS NULL OR p.contract_name = near.contract_name)
        AND (p.local_service_name IS NULL OR p.local_service_name = near.far_service_name)
        AND (p.remote_service_name IS NULL OR p.remote_service_name = near.service_name)
        ORDER BY (p.contract_name IS NOT NULL) DESC, (p.local_service_name IS NOT NULL) DESC,
            (p.remote_service_name IS NOT NULL) DESC
        LIMIT 1
    ), 5), 0, 0, near.lifetime_expires_at, NULL, :now, false
FROM near, grp;

-- name: send_many_fast
-- SEND of several messages of one type on one conversation in one round trip (as
-- send_fast, for :n bodies): consecutive sequence numbers, fair-share stamps one quantum
-- apart, NOTIFY only if a receiver waits. No row back: take the checked path per message.
WITH far AS (
    SELECT f.conversation_handle, f.queue_name, f.conversation_group_id, f.priority,
        f.service_name, f.contract_name, q.waiting_receivers, q.fair_share_quantum
    FROM conversation_endpoints s
    JOIN conversation_endpoints f
        ON f.conversation_id = s.conversation_id AND f.is_initiator <> s.is_initiator
    JOIN queues q ON q.queue_name = f.queue_name
    WHERE s.conversation_handle = :handle
    AND f.state IN ('SO', 'SI', 'CO') AND q.is_receive_enabled
    -- The sender's queue keeps what it sends (RETENTION): the checked path writes the copy.
    AND NOT EXISTS (
        SELECT 1 FROM queues sq WHERE sq.queue_name = s.queue_name AND sq.is_retention_enabled
    )
    AND EXISTS (
        SELECT 1 FROM contract_message_types c
        JOIN message_types mt ON mt.message_type_name = c.message_type_name
        WHERE c.contract_name = s.contract_name AND c.message_type_name = :message_type
        AND mt.validation = :validation
        AND c.sent_by IN ('ANY', CASE WHEN s.is_initiator THEN 'INITIATOR' ELSE 'TARGET' END)
    )
), sender AS (
    UPDATE conversation_endpoints s
    SET send_sequence = s.send_sequence + :n,
        state = CASE WHEN s.state = 'SI' THEN 'CO' ELSE s.state END,
        fair_clock = CASE WHEN far.fair_share_quantum IS NULL THEN s.fair_clock
            ELSE GREATEST(:now, s.fair_clock + far.fair_share_quantum)
                + (:n - 1) * far.fair_share_quantum END
    FROM far
    WHERE s.conversation_handle = :handle AND s.state IN ('SO', 'SI', 'CO')
    RETURNING s.send_sequence - :n AS first_sequence_number,
        CASE WHEN far.fair_share_quantum IS NULL THEN 0
            ELSE s.fair_clock - (:n - 1) * far.fair_share_quantum END AS first_fair_at,
        coalesce(far.fair_share_quantum, 0) AS quantum
), bodies AS (
    SELECT b.body, b.ord FROM unnest(CAST(:bodies AS bytea[])) WITH ORDINALITY AS b(body, ord)
), enqueued AS (
    INSERT INTO queue_messages (
        queue_name, conversation_group_id, conversation_handle, message_sequence_number,
        message_type_name, message_body, priority, status, service_name,
        service_contract_name, enqueued_at, fair_at
    )
    SELECT far.queue_name, far.conversation_group_id, far.conversation_handle,
        sender.first_sequence_number + bodies.ord - 1, :message_type, bodies.body,
        far.priority, 1, far.service_name, far.contract_name, :now,
        sender.first_fair_at + (bodies.ord - 1) * sender.quantum
    FROM far, sender, bodies
    ORDER BY bodies.ord
    RETURNING queue_name
)
SELECT sender.first_sequence_number, far.queue_name,
    CASE WHEN far.waiting_receivers > 0
        THEN pg_notify('scheduler_lib_broker', far.queue_name) IS NOT NULL
        ELSE false END AS notified
FROM far, sender, (SELECT count(*) AS n FROM enqueued) AS e;

-- name: snapshot_begin
-- Broker.snapshot()'s first statement: every read of it from one snapshot (READ
-- COMMITTED would give each statement its own; a metrics scrape's figures are of one
-- moment), and nothing written.
SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY;

-- name: metrics_table_exists
-- Whether a table exists in the schema the broker's tables are in.
SELECT count(*) AS n FROM pg_tables
WHERE schemaname = current_schema() AND tablename = :name;

-- name: server_clock
-- The server's clock (epoch seconds), not the transaction's start: the timer thread
-- compares this host's clock with it (hosts that share the database compare their clocks
-- through its rows: leases, readers' heartbeats, queue monitors).
SELECT extract(epoch FROM clock_timestamp());
