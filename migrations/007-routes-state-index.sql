-- Routes are read by state: a scheduler's start reads the unfinished creates and counts
-- live routes per node, and with retention_hours each health round deletes the routes
-- that ended before a cutoff. routes_node_state (node_url first) served none of these
-- without reading every route, and a night of episodes leaves millions of ended ones.
-- (state, updated_at) seeks all three; nothing looks routes up by node alone.
DROP INDEX routes_node_state;
CREATE INDEX routes_state_updated ON routes(state, updated_at);
