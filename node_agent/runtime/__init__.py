"""The agent's runtime: the worker loop and the dispatch of tasks to their handlers. May import: node_agent.training and below, epochmesh."""
