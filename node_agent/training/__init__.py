"""What a task computes: benchmarks, parameter-server and ring training, checks of others' work. May import: node_agent.ring | sandbox | link | core, epochmesh."""
