-- The scheduler's routing: which node holds each instance it created, and which node
-- last got each task (affinity), so a restarted scheduler routes exactly as before.
CREATE TABLE routes (
    instance_id TEXT PRIMARY KEY,
    node_url TEXT NOT NULL,
    environment TEXT NOT NULL,
    task_id TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('creating', 'live', 'ended')),
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX routes_node_state ON routes(node_url, state);

CREATE TABLE affinity (
    task_key TEXT PRIMARY KEY,
    node_url TEXT NOT NULL,
    updated_at REAL NOT NULL
);
