-- The node id last seen answering at each node URL (a good health check's). A restarted
-- scheduler reads them back, so it still tells a new node at an earlier node's URL (a new
-- Slurm job on the same host and port, a pod given an earlier pod's address) from the
-- node its routes there were sent to. Written only when the id at a URL changes.
CREATE TABLE node_ids (
    url TEXT PRIMARY KEY,
    node_id TEXT NOT NULL,
    seen_at REAL NOT NULL
);
