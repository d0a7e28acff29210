"""Test and benchmark tooling shipped with the library (the WAN emulator); no program imports it. May import: the rest of epochmesh."""
