#!/usr/bin/env bash
# Build the MOSIM LLMs Docker image and say which step failed when it does.
set -euo pipefail
CALLER_PWD="$(pwd)"
cd "$(dirname "$0")"

DOCKER="${DOCKER:-docker}"   # DOCKER=podman ./build.sh works as well
TAG="mosim-llms:latest"
# The Dockerfile's ARG is the one place the default base image is written.
BASE_IMAGE="$(sed -n 's/^ARG BASE_IMAGE=//p' Dockerfile)"
NO_CACHE=0
DRY_RUN=0
BUILD_LOG="logs/docker_build.log"

usage() {
    cat <<EOF
Build the MOSIM LLMs Docker image.

Usage: ./build.sh [options]

Options:
  --tag NAME          image name and tag (default: $TAG)
  --base-image IMAGE  base image with PyTorch and CUDA (default: $BASE_IMAGE)
  --no-cache          rebuild every layer
  --log FILE          keep the full build output here (default: $BUILD_LOG)
  --dry-run           print the docker build command and stop
  -h, --help          this help

The full build output is kept in the log file. Set DOCKER=podman to use podman.
On success: ✓ Docker image built successfully!  Then: ./run.sh gpu  (or docker-compose up -d)
EOF
}

usage_error() {  # one line, as the Python command lines refuse theirs: the help would push it off screen
    echo "error: $1 (see ./build.sh --help)" >&2
    exit 2
}

while [ $# -gt 0 ]; do
    case "$1" in
        --tag|--base-image|--log)
            [ $# -ge 2 ] && [ -n "$2" ] || usage_error "$1 needs a value"
            case "$1" in
                --tag) TAG="$2" ;;
                --base-image) BASE_IMAGE="$2" ;;
                --log) BUILD_LOG="$2" ;;
            esac
            shift 2 ;;
        --tag=*) TAG="${1#*=}"; shift ;;
        --base-image=*) BASE_IMAGE="${1#*=}"; shift ;;
        --log=*) BUILD_LOG="${1#*=}"; shift ;;
        --no-cache) NO_CACHE=1; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) usage_error "unknown option: $1" ;;
    esac
done
case "$BUILD_LOG" in
    /*|logs/docker_build.log) ;;
    *) BUILD_LOG="$CALLER_PWD/$BUILD_LOG" ;;  # a path given by the user is relative to where they stand
esac
[ -n "$BASE_IMAGE" ] || { echo "error: Dockerfile: no 'ARG BASE_IMAGE=' line; pass --base-image" >&2; exit 1; }

BUILD_CMD=("$DOCKER" build --build-arg "BASE_IMAGE=$BASE_IMAGE" -t "$TAG")
[ "$NO_CACHE" = 0 ] || BUILD_CMD+=(--no-cache)
BUILD_CMD+=(.)

quoted() { local a out=""; for a in "$@"; do out="$out $(printf '%q' "$a")"; done; printf '%s\n' "${out# }"; }

if [ "$DRY_RUN" = 1 ]; then
    quoted "${BUILD_CMD[@]}"
    exit 0
fi

echo "[1/3] Checking Docker"
if ! command -v "$DOCKER" >/dev/null 2>&1; then
    echo "✗ Docker build failed at step 1/3: '$DOCKER' not found; install Docker Engine (https://docs.docker.com/engine/install/)" >&2
    exit 1
fi
if ! info_output="$("$DOCKER" info 2>&1)"; then
    reason="$(printf '%s\n' "$info_output" | grep -iE 'cannot connect|permission denied|error' | head -n 1 || true)"
    echo "✗ Docker build failed at step 1/3: the Docker engine is not reachable (${reason:-docker info failed})" >&2
    echo "  Start it (sudo systemctl start docker), or run as a user in the docker group (or with sudo)." >&2
    exit 1
fi
echo "      $("$DOCKER" --version 2>/dev/null || echo "$DOCKER")"

echo "[2/3] Building $TAG from $BASE_IMAGE"
echo "      \$ $(quoted "${BUILD_CMD[@]}")"
mkdir -p "$(dirname "$BUILD_LOG")"
build_rc=0
# Plain progress: one line per event, so the log can be searched for the failing step.
BUILDKIT_PROGRESS=plain "${BUILD_CMD[@]}" 2>&1 | tee "$BUILD_LOG" || build_rc=$?
if [ "$build_rc" != 0 ]; then
    # BuildKit: "#12 ERROR: ..." names the failing vertex, whose title line is "#12 [4/9] RUN ...".
    # The classic builder: the last "Step 4/9 : RUN ..." line before the error.
    step=""
    vertex="$(grep -oE '^#[0-9]+ ERROR' "$BUILD_LOG" | tail -n 1 | cut -d' ' -f1 || true)"
    if [ -n "$vertex" ]; then
        step="$(grep -E "^$vertex \[" "$BUILD_LOG" | head -n 1 | cut -d' ' -f2- || true)"
    fi
    [ -n "$step" ] || step="$(grep -E '^Step [0-9]+/[0-9]+ : ' "$BUILD_LOG" | tail -n 1 || true)"
    [ -n "$step" ] || step="$(grep -iE 'error' "$BUILD_LOG" | tail -n 1 || true)"
    echo "✗ Docker build failed at step 2/3 (docker build, exit $build_rc): ${step:-see the log}" >&2
    echo "  Full output: $BUILD_LOG" >&2
    exit "$build_rc"
fi

echo "[3/3] Checking the image"
if ! size="$("$DOCKER" image inspect "$TAG" --format '{{.Size}}' 2>&1)"; then
    echo "✗ Docker build failed at step 3/3: the image $TAG is not there after the build ($size)" >&2
    exit 1
fi
echo "      $TAG: $((size / 1000000)) MB"
echo "✓ Docker image built successfully!"
echo "  Next: ./run.sh gpu   (or: docker-compose up -d && docker-compose exec mosim-llms bash)"
