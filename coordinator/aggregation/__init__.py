"""PURE. Tensors in, tensors out: the parameter server's update and robust aggregation rules. May import: coordinator.core, epochmesh."""
