-- One row per episode ever created on this node; rows are never deleted, only moved
-- through states, so that a restarted node knows every instance it has had.
CREATE TABLE instances (
    id TEXT PRIMARY KEY,
    environment TEXT NOT NULL,
    task_id TEXT NOT NULL,
    trial TEXT NOT NULL REFERENCES trials(name),
    node_id TEXT NOT NULL,
    sandbox TEXT NOT NULL,
    sandbox_handle TEXT,
    state TEXT NOT NULL CHECK (state IN ('creating', 'active', 'done', 'released', 'expired', 'failed', 'lost')),
    params TEXT NOT NULL DEFAULT '{}',
    observation TEXT,
    env_state TEXT NOT NULL DEFAULT '{}',
    step_count INTEGER NOT NULL DEFAULT 0,
    reward REAL,
    evaluation TEXT,
    error TEXT,
    created_at REAL NOT NULL,
    last_active_at REAL NOT NULL,
    ended_at REAL
);
CREATE INDEX instances_state ON instances(state);
CREATE INDEX instances_task ON instances(environment, task_id);
