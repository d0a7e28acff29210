"""Test-only behaviour (cheating agents for the verification tests), installed only by the test entry point. May import: node_agent.runtime and below, epochmesh."""
