-- Listing instances (GET /instances, newest rows last) must read only the page asked for.
-- Without these, a node with a night's worth of ended rows sorted the whole table on every
-- listing, about a second per 500k rows, holding the connection every write waits on.
-- (state, created_at) serves a listing of one state in order; it replaces the index on
-- state alone, of which it is a prefix.
DROP INDEX instances_state;
CREATE INDEX instances_state_created ON instances(state, created_at);
CREATE INDEX instances_created ON instances(created_at);
