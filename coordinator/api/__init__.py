"""gRPC adapters only: each servicer checks, translates and delegates to the engine or a query. May import: coordinator.engine and below, epochmesh."""
