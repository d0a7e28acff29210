"""The program child: a job's exported program run confined in a process of its own. May import: node_agent.core, epochmesh."""
