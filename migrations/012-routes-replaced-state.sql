-- A route may now be `replaced`: another node (a new node id) answers at its node's URL,
-- as when a Slurm job or a Kubernetes pod takes a host and port, or an address, that an
-- earlier node had. The instance went with the earlier node: calls for it answer 410.
-- SQLite cannot change a CHECK constraint in place, so the table is made anew.
CREATE TABLE routes_new (
    instance_id TEXT PRIMARY KEY,
    node_url TEXT NOT NULL,
    environment TEXT NOT NULL,
    task_id TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('creating', 'live', 'ended', 'replaced')),
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
INSERT INTO routes_new SELECT instance_id, node_url, environment, task_id, state, created_at, updated_at FROM routes;
DROP TABLE routes;
ALTER TABLE routes_new RENAME TO routes;
CREATE INDEX routes_state_updated ON routes(state, updated_at);
