#!/usr/bin/env bash
# Set up .venv (if missing), install epochmesh with its dev extras, build the documentation site
# and run the whole test suite.
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
# The PostgreSQL store's tests start their own PostgreSQL server (tests/pg.py) from Debian's
# programs: install them where missing (those tests skip themselves when they cannot be).
if ! command -v pg_ctl >/dev/null && ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
    if command -v apt-get >/dev/null; then
        SUDO=""
        [ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
        echo "installing postgresql for the PostgreSQL store's tests" >&2
        { $SUDO apt-get update -qq && \
          DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq postgresql; } \
          >&2 || echo "could not install postgresql: its tests will be skipped" >&2
    fi
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Types ([tool.mypy] in pyproject.toml: the pure packages and the seams strict). The layer
# contracts (import-linter) and the purity and circle checks run in tests/test_architecture.py.
.venv/bin/mypy
# The documentation site (mkdocs.yml): warnings are errors, so a broken link or a page missing
# from the nav fails the test command. Built into a temporary folder, removed afterwards.
site_dir=$(mktemp -d)
.venv/bin/mkdocs build --strict --site-dir "$site_dir"
rm -rf "$site_dir"
# One pytest process by default; EPOCHMESH_TEST_WORKERS=2 runs two pytest-xdist workers (the
# workers share one export cache and one directory of program-check verdicts and run torch on
# one thread each, tests/conftest.py; they take the system and integration tests first and
# steal from each other at the end, so that neither waits idle behind a many-minute cluster
# test the other was handed last). On 2 cores two workers gain nothing: the suite is bound by
# CPU, the balanced run took 37:27 against 32:46 for one process, and scenarios timed for one
# process fail more often under the doubled load (docs/benchmarks.md). More cores, more workers.
# The 25 slowest tests are listed at the end: where the suite's time goes. With
# EPOCHMESH_TEST_CPU_LOG=FILE every test also appends its wall time and the machine's busy CPU
# meanwhile to FILE (one JSON line each, tests/conftest.py): which tests wait, which compute.
exec .venv/bin/python -m pytest -q --durations=25 -n "${EPOCHMESH_TEST_WORKERS:-0}" --dist worksteal "$@"
