-- Trials group instances for logging: trials/<name>/<instance_id>/ under the data dir.
CREATE TABLE trials (
    name TEXT PRIMARY KEY,
    created_at REAL NOT NULL
);
