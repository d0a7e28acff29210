"""PURE. The rules of checking strangers' work: reputation, screening, snapshot checks, restart state. May import: coordinator.core, epochmesh."""
