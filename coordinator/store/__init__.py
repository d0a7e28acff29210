"""Persistence: the Store interface and its SQLite backend, blobs, events, checkpoints, garbage collection. May import: the pure packages, coordinator.core, epochmesh."""
