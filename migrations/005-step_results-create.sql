-- Replies of steps that carried a client request id, so that a retried step (the client
-- timed out and sent it again) returns the recorded reply instead of acting twice.
CREATE TABLE step_results (
    instance_id TEXT NOT NULL REFERENCES instances(id),
    request_id TEXT NOT NULL,
    reply TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (instance_id, request_id)
);
