-- The trial viewer reads one trial's instances (GET /trials/<trial>/episodes, newest
-- first, and its summary): without this index every such read scanned the whole table.
CREATE INDEX instances_trial_created ON instances(trial, created_at);
