"""PURE. The cluster scheduler's pass (which nodes serve which job, with a reason for every move) and a node's task queue. May import: coordinator.core, epochmesh."""
