"""The ring's shared rules: the all-reduce schedule, audit evidence and sealed segments. May import: epochmesh.identity, epochmesh.wire and the flat modules."""
