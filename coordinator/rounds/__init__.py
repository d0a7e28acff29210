"""PURE. What a round is and which samples it covers: the epoch ledger, allocation, throughput, planning, ring verdicts. May import: coordinator.core, epochmesh."""
