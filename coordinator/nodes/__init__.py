"""The node registry: agents' registrations, leases, offers, cordons and strikes. May import: coordinator.store and below, epochmesh."""
