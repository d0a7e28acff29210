"""Several coordinators on one PostgreSQL database: the lease that makes one active, and the gate that makes the others standbys. May import: coordinator.api and below, epochmesh."""
