"""Code shared by the epochmesh programs: generated stubs, tensor codec, job spec, identity, programs, helpers. May import: no app (client, coordinator, node_agent)."""

__version__ = "0.1.0"
