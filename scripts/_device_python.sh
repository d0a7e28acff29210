# Sourced by the GPU checks (scripts/gpu_check.sh, scripts/gpu_verify.sh): sets $py to a Python
# that runs the project. Where .venv exists (scripts/test.sh made it) that one; elsewhere (a GPU
# machine whose python3 holds a CUDA build of torch, and no network) the project and the wheels
# in .whl/ (scripts/gpu_check.sh wheels) are installed into that python3 without an index;
# torch stays the machine's own. $1: a folder for pip's log.
if [[ -x .venv/bin/python ]]; then
    py=.venv/bin/python
else
    py=${PYTHON:-python3}
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$py" -m pip install -q --no-index --no-deps --no-cache-dir .whl/*.whl
    fi
    "$py" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e . \
        >"$1/pip.log" 2>&1 || { cat "$1/pip.log" >&2; exit 1; }
fi
