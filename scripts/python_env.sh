#!/usr/bin/env bash
# Sourced by run_tests.sh and the launchers: pick a Python that has what the
# project needs, or create .venv with it. Sets PYTHON.
#
# torch is installed as torch==2.13.0 *before* requirements.txt: a bare
# "torch>=2.4" on a machine without torch would pull a multi-GB CUDA build.

PROJECT_TORCH_VERSION="${PROJECT_TORCH_VERSION:-2.13.0}"

_python_env_is_suitable() {
    # $1: python executable; $2: "train", "convert" or "test"
    local need="torch transformers datasets tokenizers tqdm orjson google.protobuf chakra.schema.protobuf.et_def_pb2"
    [ "$2" = "test" ] && need="$need pytest yaml"
    "$1" - "$need" <<'PY' >/dev/null 2>&1
import importlib, sys
for name in sys.argv[1].split():
    importlib.import_module(name)
import torch
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
if (major, minor) < (2, 4):
    sys.exit(1)
# transformers 5 quietly switches off torch older than 2.6: such a pair imports but builds no model.
from transformers.utils import is_torch_available
sys.exit(0 if is_torch_available() else 1)
PY
}

ensure_python_env() {
    # $1: "train", "convert" or "test" (what the caller is about to run)
    local purpose="${1:-test}"
    local root
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    local candidate="${PYTHON:-}"
    if [ -z "$candidate" ]; then
        if [ -n "${VIRTUAL_ENV:-}" ]; then candidate="$VIRTUAL_ENV/bin/python"
        elif [ -x "$root/.venv/bin/python" ]; then candidate="$root/.venv/bin/python"
        else candidate="$(command -v python3 || true)"
        fi
    fi
    if [ -n "$candidate" ] && _python_env_is_suitable "$candidate" "$purpose"; then
        PYTHON="$candidate"
        export PYTHON
        return 0
    fi
    local base_python
    base_python="$(command -v python3 || true)"
    if [ -z "$base_python" ]; then
        echo "error: python3 not found; install Python 3.9 or newer" >&2
        return 1
    fi
    echo "==> No suitable Python environment active; creating $root/.venv (once)" >&2
    [ -x "$root/.venv/bin/python" ] || "$base_python" -m venv "$root/.venv"
    local venv_python="$root/.venv/bin/python"
    "$venv_python" -m pip install -q --upgrade pip >&2 || true
    if ! "$venv_python" -c "import torch" >/dev/null 2>&1; then
        echo "==> Installing torch==$PROJECT_TORCH_VERSION (CPU wheel) first" >&2
        "$venv_python" -m pip install -q "torch==$PROJECT_TORCH_VERSION" >&2
    fi
    echo "==> Installing requirements into .venv" >&2
    "$venv_python" -m pip install -q -r "$root/requirements.txt" -r "$root/requirements-convert.txt" >&2
    if [ "$purpose" = "test" ]; then
        "$venv_python" -m pip install -q -r "$root/requirements-test.txt" >&2
    fi
    if ! _python_env_is_suitable "$venv_python" "$purpose"; then
        echo "error: $root/.venv was created but still lacks a package; see the pip output above" >&2
        return 1
    fi
    PYTHON="$venv_python"
    export PYTHON
}
