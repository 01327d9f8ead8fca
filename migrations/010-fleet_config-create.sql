-- The fleet's config as a scheduler keeps it: one row per accepted POST /config, the
-- change as it was sent and the fleet's whole config after it. The row with the highest
-- version is the config in force: a restarted scheduler reads it and pushes it again to
-- every node, as it does to a node that restarts, comes back up or joins the fleet.
CREATE TABLE fleet_config (
    version INTEGER PRIMARY KEY CHECK (version > 0),
    change TEXT NOT NULL,
    config TEXT NOT NULL,
    created_at REAL NOT NULL
);
