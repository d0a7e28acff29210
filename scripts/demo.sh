#!/usr/bin/env bash
# The epochmesh demo: sets up .venv if missing, starts a coordinator and three agents of
# different speeds on this machine, trains a small transformer, and stops everything again.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv
exec .venv/bin/python scripts/demo.py "$@"
