#!/usr/bin/env bash
# One command from trace folders to validated Chakra .et files: set up chakra-venv/, repair host traces, convert.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${CHAKRA_VENV:-$ROOT/chakra-venv}"
VENV_GIVEN="${CHAKRA_VENV:-}"
PYTHON_GIVEN="${CHAKRA_PYTHON:-}"
WITH_OFFICIAL=0
JOBS=""
DIRS=()
CONVERT_ARGS=()
# install_chakra_tools.sh's exit status for "ready, but the official tools could not be installed".
EXIT_OFFICIAL_UNAVAILABLE=3

usage() {
    cat <<EOF
Convert trace folders into Chakra .et files (one per rank) that ASTRA-sim reads.

Usage: ./setup_and_convert.sh [options] [DIR ...] [-- CONVERT_OPTIONS]

DIR: a run folder (host.<rank>.json[.gz] + device.<rank>.json[.gz], or <name>_host.json + <name>_device.json),
a folder of run folders, or a trace file (default: ./outputs).

Options:
  --jobs N          ranks converted in parallel (default: convert_to_et.py's, min(ranks, CPUs))
  --with-official   also try to install the official et_replay from GitHub (not needed here)
  --venv DIR        environment to create or reuse (default: $ROOT/chakra-venv, or \$CHAKRA_VENV)
  --python PY       use this Python instead, when it already has the conversion packages (or \$CHAKRA_PYTHON)
  -h, --help        this help

Steps: pick an environment (--python; else an existing chakra-venv/; else the active virtual environment or
$ROOT/.venv when it has the conversion packages; else install_chakra_tools.sh creates chakra-venv/, about 30 MB),
fix_host_traces.py (repairs host traces, keeping <file>.orig), convert_to_et.py (link, convert, validate,
CONVERSION_SUMMARY.md). With -- --report, the environment also gets matplotlib for the figures. The last line
names the Python for the commands that follow (scale_et.py, simulate.py, trace_report.py).
Everything after -- goes to convert_to_et.py (and to the convert_remaining.py retry printed when a rank fails),
e.g. -- --emit-merged --output-dir converted
Exit status: convert_to_et.py's (non-zero when a rank failed; the others are still converted); 1 when a folder
is missing, holds no traces, a host trace cannot be repaired or the environment cannot be made; 2 bad usage.
EOF
}

usage_error() {  # one line, as the Python command lines refuse theirs: the help would push it off screen
    echo "error: $1 (see ./setup_and_convert.sh --help)" >&2
    exit 2
}

say() { echo "==> $*"; }

has_modules() {
    # $1: python; $2: conversion or report (utils/environment.py holds the module lists)
    "$1" "$ROOT/utils/environment.py" has "$2" >/dev/null 2>&1
}

# "report" when convert_to_et.py is asked for the report (it draws figures with matplotlib), else "conversion".
needed_side() {
    local arg
    for arg in "${CONVERT_ARGS[@]+"${CONVERT_ARGS[@]}"}"; do
        [ "$arg" = "--report" ] && { echo report; return; }
    done
    echo conversion
}

has_traces() {
    # A trace file the converter can pick up: $1 itself, or anywhere below it (environments and hidden folders
    # skipped). Another file given had been checked by fix_host_traces.py and convert_to_et.py, two errors, exit 2.
    if [ -f "$1" ]; then
        case "$(basename "$1")" in
            host*.json|host*.json.gz|*_host*.json|*_host*.json.gz) return 0 ;;
            device*.json|device*.json.gz|*_device*.json|*_device*.json.gz) return 0 ;;
            *) return 1 ;;
        esac
    fi
    [ -n "$(find "$1" -mindepth 1 \( -name 'chakra-venv' -o -name '.venv' -o -name '.*' \) -prune -o -type f \
        \( -name 'host*.json' -o -name 'host*.json.gz' -o -name '*_host*.json' -o -name '*_host*.json.gz' \) \
        -print 2>/dev/null | head -n 1)" ]
}

parse_args() {
    while [ $# -gt 0 ]; do
        case "$1" in
            --jobs)
                [ $# -ge 2 ] || usage_error "--jobs needs a number"
                JOBS="$2"
                shift 2 ;;
            --jobs=*) JOBS="${1#--jobs=}"; shift ;;
            --with-official) WITH_OFFICIAL=1; shift ;;
            --venv|--python)
                # Not empty, and not the next option: `--venv --with-official` would make a venv named --with-official.
                [ $# -ge 2 ] && [ -n "$2" ] && [ "${2#-}" = "$2" ] || usage_error "$1 needs a value${2:+ (got $2)}"
                if [ "$1" = --venv ]; then VENV="$2"; VENV_GIVEN="$2"; else PYTHON_GIVEN="$2"; fi
                shift 2 ;;
            --venv=*|--python=*)
                [ -n "${1#*=}" ] || usage_error "${1%%=*} needs a value"
                if [ "${1%%=*}" = --venv ]; then VENV="${1#*=}"; VENV_GIVEN="$VENV"; else PYTHON_GIVEN="${1#*=}"; fi
                shift ;;
            -h|--help) usage; exit 0 ;;
            --) shift; CONVERT_ARGS=("$@"); break ;;
            -*) usage_error "unknown option: $1" ;;
            *) DIRS+=("$1"); shift ;;
        esac
    done
    if [ -n "$JOBS" ] && ! [[ "$JOBS" =~ ^[1-9][0-9]*$ ]]; then
        usage_error "--jobs needs a positive whole number, not '$JOBS'"
    fi
    [ ${#DIRS[@]} -gt 0 ] || DIRS=("outputs")
}

check_dirs() {
    local failed=0 dir
    for dir in "${DIRS[@]}"; do
        if [ ! -e "$dir" ]; then
            echo "error: $dir: no such folder" >&2
            failed=1
        elif ! has_traces "$dir"; then
            echo "error: $dir: no traces found (expected host.<rank>.json[.gz] + device.<rank>.json[.gz]," \
                 "or <name>_host.json + <name>_device.json)" >&2
            failed=1
        fi
    done
    [ "$failed" = 0 ] || exit 1
}

check_given_python() {
    if [ -n "$PYTHON_GIVEN" ]; then
        if ! command -v "$PYTHON_GIVEN" >/dev/null 2>&1; then
            echo "error: $PYTHON_GIVEN: no such Python" >&2
            exit 1
        fi
        # Its exit status alone is no answer: --python /bin/true passed every check and "converted" nothing.
        if [ "$("$PYTHON_GIVEN" -c 'import sys; print(sys.version_info[0])' 2>/dev/null)" != 3 ]; then
            echo "error: $PYTHON_GIVEN: not a Python 3 interpreter" >&2
            exit 1
        fi
        if ! has_modules "$PYTHON_GIVEN" "$(needed_side)"; then
            local missing
            missing="$("$PYTHON_GIVEN" "$ROOT/utils/environment.py" has "$(needed_side)" 2>&1 | sed 's/^missing: //' || true)"
            if [ "$(needed_side)" = report ] && has_modules "$PYTHON_GIVEN" conversion; then
                # it converts; only the report's figures are missing (the conversion hint had sent the user to an
                # install that does not add them)
                echo "error: $PYTHON_GIVEN cannot draw the report (-- --report) without $missing: install it there" \
                     "(pip install -r $ROOT/requirements-report.txt), drop --python to use chakra-venv/ (it is" \
                     "added there), or leave out --report" >&2
            else
                echo "error: $PYTHON_GIVEN cannot import the conversion packages ($missing);" \
                     "drop --python to use chakra-venv/, or run ./install_chakra_tools.sh" >&2
            fi
            exit 1
        fi
        [ "$WITH_OFFICIAL" = 0 ] || echo "note: --with-official is ignored with --python (nothing is installed into $PYTHON_GIVEN)" >&2
    fi
}

# An environment that already has the conversion packages, when no chakra-venv/ exists yet and none was named:
# the active virtual environment, then the project's .venv (the main job's, which has them all).
existing_environment() {
    [ -z "$VENV_GIVEN" ] && [ "$WITH_OFFICIAL" = 0 ] && [ ! -x "$VENV/bin/python" ] || return 1
    local candidate
    for candidate in "${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}" "$ROOT/.venv/bin/python"; do
        if [ -n "$candidate" ] && [ -x "$candidate" ] && has_modules "$candidate" "$(needed_side)"; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

pick_python() {
    if [ -n "$PYTHON_GIVEN" ]; then
        PYTHON="$PYTHON_GIVEN"
        say "Using $PYTHON (it has the conversion packages; no chakra-venv/ needed)"
        return
    fi
    local existing
    if existing="$(existing_environment)"; then
        PYTHON="$existing"
        say "Using $(dirname "$(dirname "$PYTHON")") (it has the conversion packages; no chakra-venv/ needed)"
        return
    fi
    local install=("$ROOT/install_chakra_tools.sh" --venv "$VENV")
    [ "$WITH_OFFICIAL" = 1 ] && install+=(--with-official)
    [ "$(needed_side)" = report ] && install+=(--with-report)
    local rc=0
    "${install[@]}" || rc=$?
    if [ "$rc" = "$EXIT_OFFICIAL_UNAVAILABLE" ]; then
        say "Going on without the official tools"
    elif [ "$rc" != 0 ]; then
        echo "error: could not set up $VENV (install_chakra_tools.sh exit $rc)" >&2
        exit 1
    fi
    PYTHON="$VENV/bin/python"
}

# The interpreter for the commands that follow a conversion (scale_et.py, simulate.py, trace_report.py): the
# environment picked here (.venv, chakra-venv/, --python) is the one that has their packages. Shell-quoted, relative
# to the current folder when it is below it, with the activate line that makes it python3 when it is a venv's.
follow_up_python() {
    local python="$PYTHON" activate
    case "$python" in "$PWD"/*) python="${python#"$PWD"/}" ;; esac
    activate="$(dirname "$python")/activate"
    if [ "$python" != "$(basename "$python")" ] && [ -f "$activate" ]; then
        echo "$(printf '%q' "$python") (or python3 after: source $(printf '%q' "$activate"))"
    else
        printf '%q\n' "$python"
    fi
}

# convert_to_et.py's own parser on the options after -- (and the folders), before fix_host_traces.py repairs
# anything: a bad option had been refused only after the host traces were checked and rewritten. -h/--help there
# shows convert_to_et.py's help.
check_convert_args() {
    [ ${#CONVERT_ARGS[@]} -gt 0 ] || return 0
    local arg
    for arg in "${CONVERT_ARGS[@]}"; do
        case "$arg" in -h|--help) "$PYTHON" "$ROOT/convert_to_et.py" --help; exit 0 ;; esac
    done
    local rc=0
    "$PYTHON" -c 'import sys; sys.path.insert(0, sys.argv.pop(1)); from trace_tools.cli import build_parser
build_parser(remaining=False).parse_args(sys.argv[1:])' "$ROOT" "${DIRS[@]}" "${CONVERT_ARGS[@]}" || rc=$?
    [ "$rc" = 0 ] || exit "$rc"  # argparse has said what is wrong, in one line
}

main() {
    parse_args "$@"
    check_dirs
    check_given_python
    if [ ! -f "$ROOT/convert_to_et.py" ]; then
        echo "error: $ROOT/convert_to_et.py not found; this checkout has no converter" >&2
        exit 1
    fi
    pick_python
    check_convert_args
    say "Checking host traces: fix_host_traces.py ${DIRS[*]}"
    local fix_rc=0
    "$PYTHON" "$ROOT/fix_host_traces.py" "${DIRS[@]}" || fix_rc=$?
    local convert=("$PYTHON" "$ROOT/convert_to_et.py")
    [ -n "$JOBS" ] && convert+=(--jobs "$JOBS")
    convert+=("${DIRS[@]}")
    [ ${#CONVERT_ARGS[@]} -gt 0 ] && convert+=("${CONVERT_ARGS[@]}")
    say "Converting: convert_to_et.py ${convert[*]:2}"
    local convert_rc=0
    "${convert[@]}" || convert_rc=$?
    if [ "$convert_rc" = 1 ]; then  # ranks failed; 2 is a usage error, which convert_to_et.py has said
        # convert_remaining.py takes convert_to_et.py's options (--jobs and those after --): the same --output-dir
        local retry
        retry=$(printf '%q ' "$PYTHON" "$ROOT/convert_remaining.py" "${convert[@]:2}")
        echo "error: convert_to_et.py exit $convert_rc; failed ranks are listed above and in CONVERSION_SUMMARY.md;" \
             "retry them with: ${retry% }" >&2
    fi
    if [ "$convert_rc" != 0 ]; then
        exit "$convert_rc"
    fi
    if [ "$fix_rc" != 0 ]; then
        echo "error: some host traces could not be repaired (see above)" >&2
        exit "$fix_rc"
    fi
    say "Done"
    say "Python for scale_et.py, simulate.py and trace_report.py: $(follow_up_python)"
}

main "$@"
