"""The agent's own ground: configuration, identity files, devices, live settings, measurement maths; no servers, no training. May import: epochmesh."""
