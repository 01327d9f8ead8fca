-- A scheduler with retention_hours deletes, every health round, the routes that ended
-- before a cutoff. (state, updated_at) finds exactly those; without it each round would
-- read every ended route to check its time, and a night leaves millions. It serves the
-- start-up queries of migration 007 by its state prefix too, so it replaces that index.
DROP INDEX routes_state_node;
CREATE INDEX routes_state_updated ON routes(state, updated_at);
