"""Errors, ids, configuration and the caller's principal: no I/O, imported by every layer. May import: epochmesh."""
