"""A job's program: the archive check and loading, the operator allow-list, inspection in a child and confinement. May import: epochmesh.ring, identity, wire and the flat modules."""
