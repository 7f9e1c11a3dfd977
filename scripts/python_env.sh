#!/usr/bin/env bash
# Pick a Python that has what the project needs, or create .venv with it.
# Sourced by run_tests.sh (sets PYTHON); run by the launcher (utils/launch/)
# as `bash scripts/python_env.sh train`, which prints the interpreter's path.
#
# torch is installed as torch==2.13.0 *before* requirements.txt: a bare
# "torch>=2.4" on a machine without torch would pull a multi-GB CUDA build.
# requirements-convert.txt goes in with --no-deps (it lists everything the
# conversion imports; mlc-chakra's own dependencies are not used). The project
# itself goes in last, editable and without dependencies (pyproject.toml), so
# `python gpt2/train.py` and `python bench/<bench>.py` import it from anywhere.

PROJECT_TORCH_VERSION="${PROJECT_TORCH_VERSION:-2.13.0}"

_python_env_requirement_files() {
    # $1: project root; $2: "train" or "test". Sets PYTHON_ENV_FILES: every file whose requirements the
    # environment must meet (an array, not command output: bash 3.2 on macOS has no mapfile).
    PYTHON_ENV_FILES=("$1/requirements.txt" "$1/requirements-convert.txt" "$1/requirements-report.txt")
    if [ "$2" = "test" ]; then PYTHON_ENV_FILES+=("$1/requirements-test.txt"); fi
}

_python_env_is_suitable() {
    # $1: python executable; $2: "train" or "test"; $3: project root. Sets PYTHON_ENV_TORCH (torch's version).
    _python_env_requirement_files "$3" "$2"
    "$1" "$3/utils/environment.py" check-requirements "${PYTHON_ENV_FILES[@]}" >/dev/null 2>&1 || return 1
    # shellcheck disable=SC2034  # read by run_tests.sh
    PYTHON_ENV_TORCH="$("$1" - <<'PY' 2>/dev/null
import sys
import torch
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
if (major, minor) < (2, 4):
    sys.exit(1)
# transformers 5 quietly switches off torch older than 2.6: such a pair imports but builds no model.
from transformers.utils import is_torch_available
print(torch.__version__)
sys.exit(0 if is_torch_available() else 1)
PY
)"
}

_python_env_project_folder() {
    # $1: python executable. Prints the folder `import trace_tools` finds the project in from another folder (a
    # checkout, for an editable install), or nothing where it finds none.
    (cd / && "$1" -c 'import os, trace_tools
print(os.path.dirname(os.path.dirname(os.path.realpath(trace_tools.__file__))))') 2>/dev/null
}

_python_env_install_project() {
    # $1: python executable; $2: project root. Unless $1 already imports the project from this checkout: the project,
    # editable and without dependencies (the requirement files went in apart), with the environment's own setuptools
    # when it has one, else with one pip downloads.
    [ "$(_python_env_project_folder "$1")" = "$(cd "$2" && pwd -P)" ] && return 0
    echo "==> Installing this project into $1 (pip install --no-deps -e $2)" >&2
    "$1" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$2" >/dev/null 2>&1 ||
        "$1" -m pip install -q --disable-pip-version-check --no-deps -e "$2" >&2
}

_python_env_other_checkout() {
    # $1: python executable; $2: project root. Prints the other checkout of this project that $1 imports it from
    # (an editable install of another clone: a checkout has scripts/python_env.sh, an installed wheel has not), or
    # nothing.
    local folder
    folder="$(_python_env_project_folder "$1")"
    if [ -n "$folder" ] && [ "$folder" != "$(cd "$2" && pwd -P)" ] && [ -f "$folder/scripts/python_env.sh" ]; then
        echo "$folder"
    fi
}

ensure_python_env() {
    # $1: "train" or "test" (what the caller is about to run)
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
    # An environment that runs this project from another checkout (its .venv, active in this shell) stays that
    # checkout's: installing this one into it would make the other checkout's commands run this one's code.
    if [ -n "$candidate" ] && [ "$candidate" != "$root/.venv/bin/python" ]; then
        local other
        other="$(_python_env_other_checkout "$candidate" "$root")"
        if [ -n "$other" ]; then
            echo "==> $candidate runs this project from $other; leaving it to that checkout, this one uses" \
                 "$root/.venv" >&2
            candidate="$root/.venv/bin/python"
        fi
    fi
    if [ -n "$candidate" ] && _python_env_is_suitable "$candidate" "$purpose" "$root"; then
        _python_env_install_project "$candidate" "$root" || return 1
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
    local venv_python="$root/.venv/bin/python"
    if [ -x "$venv_python" ]; then
        echo "==> $root/.venv lacks packages for $purpose; installing them" >&2
    else
        echo "==> No suitable Python environment active; creating $root/.venv (once)" >&2
        local out reason existed=0
        [ ! -e "$root/.venv" ] || existed=1
        if ! out="$("$base_python" -m venv "$root/.venv" 2>&1)"; then
            # Debian's python3 without python3-venv leaves a .venv without pip, which the next run would take for a
            # made one: remove what this run made.
            [ "$existed" = 1 ] || rm -rf "$root/.venv"
            reason="$(printf '%s\n' "$out" | grep -m 1 -iE 'ensurepip|error' || printf '%s\n' "$out" | tail -n 1)"
            echo "error: '$base_python -m venv $root/.venv' failed (${reason:-no message}); on Debian/Ubuntu:" \
                 "sudo apt-get install python3-venv" >&2
            return 1
        fi
    fi
    if ! "$venv_python" -c "import torch" >/dev/null 2>&1; then
        echo "==> Installing torch==$PROJECT_TORCH_VERSION (CPU wheel) first" >&2
        "$venv_python" -m pip install -q --disable-pip-version-check "torch==$PROJECT_TORCH_VERSION" >&2
    fi
    local requirement_args=() file
    _python_env_requirement_files "$root" "$purpose"
    local files=("${PYTHON_ENV_FILES[@]}")
    for file in "${files[@]}"; do
        [ "$file" = "$root/requirements-convert.txt" ] || requirement_args+=(-r "$file")
    done
    echo "==> Installing $(for file in "${files[@]}"; do basename "$file"; done | tr '\n' ' ')into .venv" >&2
    "$venv_python" -m pip install -q --disable-pip-version-check "${requirement_args[@]}" >&2
    "$venv_python" -m pip install -q --disable-pip-version-check --no-deps -r "$root/requirements-convert.txt" >&2
    if ! _python_env_is_suitable "$venv_python" "$purpose" "$root"; then
        echo "error: $root/.venv was set up but still lacks a package:" >&2
        "$venv_python" "$root/utils/environment.py" check-requirements "${files[@]}" >&2 || true
        return 1
    fi
    _python_env_install_project "$venv_python" "$root" || return 1
    PYTHON="$venv_python"
    export PYTHON
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    set -euo pipefail
    ensure_python_env "${1:-train}" >&2
    printf '%s\n' "$PYTHON"
fi
