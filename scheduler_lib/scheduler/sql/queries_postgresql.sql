-- PostgreSQL overrides of the scheduler's queries.sql.

-- name: semaphore_get
-- A named semaphore, locked: acquirers take turns (SQLite's write lock does this there).
SELECT * FROM semaphores WHERE semaphore_name = :name FOR UPDATE;
