#!/usr/bin/env bash
# Set up .venv (if missing), install epochmesh with its dev extras, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Two workers: the suite's tests mostly wait on the processes they start (coordinators, agents,
# CLI calls), so two run side by side on two cores in little more than half the time of one.
exec .venv/bin/python -m pytest -q -n "${EPOCHMESH_TEST_WORKERS:-2}" "$@"
