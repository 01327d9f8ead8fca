-- A node's own id, made at its first start and kept for its life: it labels the node's
-- containers, so two nodes that share a host and its Docker engine never take each
-- other's for their own. One row at most. A configured node_id takes precedence and is
-- not stored here.
CREATE TABLE node_identity (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    node_id TEXT NOT NULL,
    created_at REAL NOT NULL
);
