"""Who may do what: the CA, join tokens, enrollment and every RPC's role and ownership checks. May import: coordinator.store and below, epochmesh."""
