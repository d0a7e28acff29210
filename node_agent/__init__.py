"""The node agent: layers from the top main > testing > runtime > training > ring | sandbox | link > core. May import: epochmesh."""
