"""The HTTP port: Prometheus metrics, the dashboard and its login, gRPC metrics, the views they read. May import: coordinator.engine and below, epochmesh."""
