"""PURE. Money rules: what a round's parts cost and earn, double-entry books in integer micro-credits. May import: coordinator.core, epochmesh."""
