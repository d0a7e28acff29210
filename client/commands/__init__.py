"""The CLI's commands, one module per group; each exposes ``register(subparsers, common)``."""
