"""The epochmesh CLI: main > commands > upload | plot | config | render > rpc. May import: epochmesh."""
