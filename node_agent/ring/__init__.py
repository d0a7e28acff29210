"""The agent-to-agent data plane: the peer service, bulk transfers, the ring all-reduce and its links. May import: node_agent.core, epochmesh."""
