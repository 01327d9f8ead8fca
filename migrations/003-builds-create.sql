-- Image builds: one row per attempt to build a task's image. The tag is derived from a
-- hash of the build context, so an unchanged task finds its ready row after a restart.
CREATE TABLE builds (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    environment TEXT NOT NULL,
    task_id TEXT NOT NULL,
    context_hash TEXT NOT NULL,
    image TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('building', 'ready', 'failed')),
    log_path TEXT,
    error TEXT,
    started_at REAL NOT NULL,
    finished_at REAL
);
CREATE INDEX builds_image ON builds(image, state);
