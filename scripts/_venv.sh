# Sourced by scripts/test.sh and scripts/demo.sh: create .venv and install epochmesh (with dev extras).
ensure_venv() {
    local py=${PYTHON:-python3}
    if [ ! -x .venv/bin/python ]; then
        "$py" -m venv .venv
    fi
    local stamp=.venv/.epochmesh-installed
    local want
    want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
        echo "installing epochmesh into .venv (torch is pinned through constraints.txt)" >&2
        .venv/bin/python -m pip install -q --upgrade pip >&2 || true
        .venv/bin/python -m pip install -q -c constraints.txt -e ".[dev]" >&2
        echo "$want" > "$stamp"
    fi
}
