"""Code shared by the epochmesh programs: generated stubs, tensor codec, job spec, helpers."""

__version__ = "0.1.0"
