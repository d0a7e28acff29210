"""The market over the store: credit accounts and a job's billing and escrow. May import: coordinator.store and below, epochmesh."""
