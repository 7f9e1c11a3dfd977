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
exec "$PYTHON" -m pytest "$@"
