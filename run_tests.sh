#!/usr/bin/env bash
# Run the test suite (CPU only, offline). Creates .venv when no suitable
# Python environment is active. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
# shellcheck source=scripts/python_env.sh
source scripts/python_env.sh
ensure_python_env test
# As if activated: the environment's own tools (torchrun, shellcheck, hadolint) come first.
PATH="$(dirname "$PYTHON"):$PATH"
export PATH
echo "==> Using $PYTHON (torch $PYTHON_ENV_TORCH)"
# One test worker per CPU, at most 4 (pytest-xdist), an idle one taking tests from a busy one (worksteal: the tests
# take from milliseconds to a minute): most tests wait on a subprocess or use one core, so on 2 cores the suite takes
# about 520-560 s against 846 s in one process. `-n 0` (after) runs it in one process.
workers="$(nproc 2>/dev/null || echo 1)"
if [ "$workers" -gt 4 ]; then workers=4; fi
if [ "$workers" -lt 2 ]; then workers=0; fi
exec "$PYTHON" -m pytest -n "$workers" --dist worksteal "$@"
