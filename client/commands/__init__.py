"""The CLI's commands, one module per group; each exposes ``register(subparsers, common)``. May import: client.upload | plot | config | render | rpc, epochmesh."""
