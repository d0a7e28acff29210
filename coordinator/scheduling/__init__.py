"""PURE. The cluster scheduler's pass: which nodes serve which job, with a reason for every move. May import: coordinator.core, epochmesh."""
