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
# Two phases. The unit and integration tests (and the architecture checks) run in two
# pytest-xdist workers: they use under one core in one process (waits on loopback servers,
# children starting), so two overlap them (6:53 against 11:50 here). The system tests (whole
# clusters of processes, 1.4 cores busy on average, timed scenarios) run in one process: on 2
# cores two workers made them slower and flakier (docs/benchmarks.md). EPOCHMESH_TEST_WORKERS
# sets the second phase's workers (more cores, more workers); arguments run one pytest with
# them instead (e.g. scripts/test.sh tests/unit -x). Both phases and their workers share one
# export cache and one directory of program-check verdicts (EPOCHMESH_TEST_SHARED_CACHE), and
# workers run torch on one thread each (tests/conftest.py).
# The 25 slowest tests of each phase are listed at its end: where the suite's time goes. With
# EPOCHMESH_TEST_CPU_LOG=FILE every test also appends its wall time and the machine's busy CPU
# meanwhile to FILE (one JSON line each, tests/conftest.py): which tests wait, which compute.
pytest=(.venv/bin/python -m pytest -q --durations=25 --dist worksteal)
if [ "$#" -gt 0 ]; then
    exec "${pytest[@]}" -n "${EPOCHMESH_TEST_WORKERS:-0}" "$@"
fi
EPOCHMESH_TEST_SHARED_CACHE=$(mktemp -d -t epochmesh-test-cache-XXXXXX)
export EPOCHMESH_TEST_SHARED_CACHE
trap 'rm -rf "$EPOCHMESH_TEST_SHARED_CACHE"' EXIT
status=0
"${pytest[@]}" -n 2 --ignore=tests/system tests || status=$?
"${pytest[@]}" -n "${EPOCHMESH_TEST_WORKERS:-0}" tests/system || status=$?
exit "$status"
