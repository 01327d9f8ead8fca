-- Nodes that joined a scheduler by themselves (`envhub serve --role node --join URL`),
-- beside those its nodes file lists. A restarted scheduler reads them back, so its
-- fleet is whole before the nodes' next announcements. `seen_at` is the wall-clock time
-- of the node's last announcement or good health check as the scheduler last wrote it;
-- a node silent for `join_ttl` seconds is deleted (it left the fleet).
CREATE TABLE joined_nodes (
    url TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    node_id TEXT,
    slots INTEGER NOT NULL CHECK (slots > 0),
    joined_at REAL NOT NULL,
    seen_at REAL NOT NULL
);
