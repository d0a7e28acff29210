"""The connection to the coordinator: registration, heartbeats, task streams, the blob cache, client metrics. May import: node_agent.core, epochmesh."""
