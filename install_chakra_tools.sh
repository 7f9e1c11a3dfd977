#!/usr/bin/env bash
# Create or reuse the conversion environment (chakra-venv/): requirements-convert.txt (about 30 MB), optionally the
# report's matplotlib and the official et_replay.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REQUIREMENTS="$ROOT/requirements-convert.txt"
REPORT_REQUIREMENTS="$ROOT/requirements-report.txt"
VENV="${CHAKRA_VENV:-$ROOT/chakra-venv}"
WITH_OFFICIAL=0
WITH_REPORT=0
# How long to wait for GitHub before saying it cannot be reached (a machine without network must not hang).
NET_TIMEOUT="${CHAKRA_NET_TIMEOUT:-10}"
PARAM_REPO="https://github.com/facebookresearch/param.git"
PARAM_COMMIT="7b19f586dd8b267333114992833a0d7e0d601630"   # the et_replay chakra_trace_link was tested with
ET_REPLAY_SPEC="git+$PARAM_REPO@$PARAM_COMMIT#subdirectory=et_replay"
MARKER_NAME=".mosim-convert-requirements.sha256"
# Exit status when the environment is ready but --with-official could not install the official tools.
EXIT_OFFICIAL_UNAVAILABLE=3

usage() {
    cat <<EOF
Create or reuse the Python environment for converting traces to Chakra .et files.

Usage: ./install_chakra_tools.sh [--venv DIR] [--with-report] [--with-official]

Options:
  --venv DIR        environment to create or reuse (default: $ROOT/chakra-venv, or \$CHAKRA_VENV)
  --with-report     also install $(basename "$REPORT_REQUIREMENTS") (matplotlib), for trace_report.py and --report
  --with-official   also install the official et_replay (facebookresearch/param @ ${PARAM_COMMIT:0:8}) from
                    GitHub and HolisticTraceAnalysis, which chakra_trace_link needs; says so and goes on when
                    GitHub cannot be reached
  -h, --help        this help

Installs $(basename "$REQUIREMENTS") (mlc-chakra without its heavy dependencies, protobuf, orjson, tqdm) with
pip --no-deps: about 30 MB. A second run reuses the environment in seconds unless the requirements file changed.
Exit status: 0 ready; 1 the environment could not be made; 2 bad usage;
$EXIT_OFFICIAL_UNAVAILABLE ready, but the official tools asked for with --with-official could not be installed.
EOF
}

usage_error() {  # one line, as the Python command lines refuse theirs: the help would push it off screen
    echo "error: $1 (see ./install_chakra_tools.sh --help)" >&2
    exit 2
}

say() { echo "==> $*"; }

# timeout(1) where it exists (not on a stock macOS); otherwise a watchdog that kills the command.
run_with_timeout() {
    local seconds="$1"
    shift
    if command -v timeout >/dev/null 2>&1; then
        timeout "$seconds" "$@"
        return
    fi
    "$@" &
    local pid=$!
    (sleep "$seconds" && kill -TERM "$pid") >/dev/null 2>&1 &
    local watchdog=$!
    local rc=0
    wait "$pid" || rc=$?
    kill "$watchdog" >/dev/null 2>&1 || true
    wait "$watchdog" 2>/dev/null || true
    return "$rc"
}

requirements_hash() {
    "$1" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$REQUIREMENTS"
}

has_modules() {
    # $1: python; $2: conversion or report (utils/environment.py holds the module lists)
    "$1" "$ROOT/utils/environment.py" has "$2" >/dev/null 2>&1
}

# pip, quiet: its output goes to a log in the environment and is shown only when it fails.
quiet_pip() {
    local python="$1" log="$VENV/pip.log"
    shift
    if ! "$python" -m pip install --disable-pip-version-check --no-input "$@" >"$log" 2>&1; then
        tail -n 25 "$log" >&2
        return 1
    fi
}

install_official() {
    local python="$1"
    if "$python" -c "import et_replay" >/dev/null 2>&1; then
        say "Official et_replay already installed"
        return 0
    fi
    if ! command -v git >/dev/null 2>&1; then
        echo "warning: official et_replay not installed: git is not installed (pip needs it to install from GitHub);" \
             "the converter here does not need it" >&2
        return "$EXIT_OFFICIAL_UNAVAILABLE"
    fi
    if ! GIT_TERMINAL_PROMPT=0 run_with_timeout "$NET_TIMEOUT" git ls-remote --exit-code "$PARAM_REPO" HEAD >/dev/null 2>&1; then
        echo "warning: official et_replay not installed: cannot reach github.com (git ls-remote failed or took over ${NET_TIMEOUT} s:" \
             "no network, or GitHub blocked); the converter here does not need it" >&2
        return "$EXIT_OFFICIAL_UNAVAILABLE"
    fi
    say "Installing the official et_replay (param @ ${PARAM_COMMIT:0:8}) from GitHub"
    if ! GIT_TERMINAL_PROMPT=0 run_with_timeout 900 "$python" -m pip install --disable-pip-version-check --no-input \
            "$ET_REPLAY_SPEC" >"$VENV/pip.log" 2>&1; then
        tail -n 25 "$VENV/pip.log" >&2
        echo "warning: official et_replay not installed: pip could not install $ET_REPLAY_SPEC (see above)" >&2
        return "$EXIT_OFFICIAL_UNAVAILABLE"
    fi
    # The conversion installs mlc-chakra without its dependencies; chakra_trace_link imports HolisticTraceAnalysis
    # (as hta) and chakra's other tools networkx and pydot: install them all now.
    if ! "$python" -c "import hta" >/dev/null 2>&1 && ! quiet_pip "$python" -r "$REQUIREMENTS"; then
        echo "warning: mlc-chakra's dependencies (HolisticTraceAnalysis) could not be installed; chakra_trace_link needs them" >&2
        return "$EXIT_OFFICIAL_UNAVAILABLE"
    fi
    say "Official tools ready: $(dirname "$python")/chakra_trace_link, $(dirname "$python")/chakra_converter"
}

main() {
    while [ $# -gt 0 ]; do
        case "$1" in
            --venv)
                # Not empty, and not the next option: `--venv --with-report` would make a venv named --with-report.
                [ $# -ge 2 ] && [ -n "$2" ] && [ "${2#-}" = "$2" ] || usage_error "--venv needs a folder${2:+ (got $2)}"
                VENV="$2"
                shift 2 ;;
            --venv=*)
                [ -n "${1#--venv=}" ] || usage_error "--venv needs a folder"
                VENV="${1#--venv=}"
                shift ;;
            --with-official) WITH_OFFICIAL=1; shift ;;
            --with-report) WITH_REPORT=1; shift ;;
            -h|--help) usage; exit 0 ;;
            *) usage_error "unknown option: $1" ;;
        esac
    done
    if [ ! -f "$REQUIREMENTS" ]; then
        echo "error: $REQUIREMENTS not found; run this script from its repository" >&2
        exit 1
    fi
    local python="$VENV/bin/python"
    local marker="$VENV/$MARKER_NAME"
    if [ ! -x "$python" ]; then
        if [ -e "$VENV" ] && [ -n "$(ls -A "$VENV" 2>/dev/null)" ]; then
            echo "error: $VENV exists but is not a Python virtual environment (no bin/python); remove it or pass --venv" >&2
            exit 1
        fi
        local base_python
        base_python="$(command -v python3 || true)"
        if [ -z "$base_python" ]; then
            echo "error: python3 not found; install Python 3.9 or newer" >&2
            exit 1
        fi
        say "Creating $VENV ($("$base_python" --version 2>&1))"
        local existed=0 out reason
        [ ! -e "$VENV" ] || existed=1   # then an empty folder (checked above)
        if ! out="$("$base_python" -m venv "$VENV" 2>&1)"; then
            # Debian's python3 without python3-venv leaves a venv without pip, which the next run would take for a
            # made one: remove what this run made.
            if [ "$existed" = 1 ]; then find "$VENV" -mindepth 1 -delete; else rm -rf "$VENV"; fi
            reason="$(printf '%s\n' "$out" | grep -m 1 -iE 'ensurepip|error' || printf '%s\n' "$out" | tail -n 1)"
            echo "error: '$base_python -m venv $VENV' failed (${reason:-no message}); on Debian/Ubuntu:" \
                 "sudo apt-get install python3-venv" >&2
            exit 1
        fi
    fi
    local wanted
    wanted="$(requirements_hash "$python")"
    if [ -f "$marker" ] && [ "$(cat "$marker")" = "$wanted" ] && has_modules "$python" conversion; then
        say "Reusing $VENV (requirements already installed)"
    else
        say "Installing $(basename "$REQUIREMENTS") into $VENV (mlc-chakra without its heavy dependencies)"
        if ! quiet_pip "$python" --no-deps -r "$REQUIREMENTS"; then
            echo "error: pip could not install $REQUIREMENTS into $VENV (see above; pip needs PyPI)" >&2
            exit 1
        fi
        if ! has_modules "$python" conversion; then
            echo "error: $VENV still cannot import the conversion packages:" \
                 "$("$python" "$ROOT/utils/environment.py" has conversion 2>&1)" >&2
            exit 1
        fi
        echo "$wanted" >"$marker"
    fi
    if [ "$WITH_REPORT" = 1 ] && ! has_modules "$python" report; then
        say "Installing $(basename "$REPORT_REQUIREMENTS") into $VENV (matplotlib, for the report's figures)"
        if ! quiet_pip "$python" -r "$REPORT_REQUIREMENTS"; then
            echo "error: pip could not install $REPORT_REQUIREMENTS into $VENV (see above)" >&2
            exit 1
        fi
    fi
    local rc=0
    if [ "$WITH_OFFICIAL" = 1 ]; then
        install_official "$python" || rc=$?
    fi
    say "Conversion environment ready: $python  (activate with: source $(printf '%q' "$VENV")/bin/activate)"
    exit "$rc"
}

main "$@"
