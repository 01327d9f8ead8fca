-- A scheduler's start reads the routes of unfinished creates and counts live routes per
-- node. routes_node_state (node_url first) served neither without reading every route,
-- and a night of episodes leaves millions of ended ones. (state, node_url) serves both
-- from the few routes not yet ended; nothing looks routes up by node alone.
DROP INDEX routes_node_state;
CREATE INDEX routes_state_node ON routes(state, node_url);
