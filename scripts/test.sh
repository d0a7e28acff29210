#!/usr/bin/env bash
# Set up .venv (if missing), install epochmesh with its dev extras, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv
# The dashboard's browser test drives Debian's headless Chromium through selenium: install it
# where it is missing (the test skips itself when it cannot be installed).
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    if command -v apt-get >/dev/null; then
        SUDO=""
        [ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
        echo "installing chromium and chromium-driver for the dashboard's browser test" >&2
        { $SUDO apt-get update -qq && \
          DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver; } \
          >&2 || echo "could not install chromium: the browser test will be skipped" >&2
    fi
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Two workers: the suite's tests mostly wait on the processes they start (coordinators, agents,
# CLI calls). Measured on these 2 cores: one worker ~21 min, two ~17.5 min, three ~17.5 min
# (each test slower), two with the longest tests first ~17.3 min: the suite is ~25 CPU-minutes.
# EPOCHMESH_TEST_WORKERS overrides the count.
exec .venv/bin/python -m pytest -q -n "${EPOCHMESH_TEST_WORKERS:-2}" "$@"
