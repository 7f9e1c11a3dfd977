#!/usr/bin/env bash
# Start the MOSIM LLMs container with the project's folders mounted: ./run.sh gpu|cpu [options] [-- COMMAND...]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")" && pwd)"

DOCKER="${DOCKER:-docker}"   # DOCKER=podman ./run.sh cpu works as well
TAG="mosim-llms:latest"
NAME=""
HOST_NETWORK=0
DRY_RUN=0
MODE=""
WORKDIR="/workspace/mosim-llms"
# Shared with docker-compose.yml (its hf-cache volume has this name).
HF_CACHE_VOLUME="mosim-llms-hf-cache"
MOUNTED_DIRS=(outputs data checkpoints logs)
PASSED_ENV=(WANDB_API_KEY HF_TOKEN NCCL_DEBUG)
COMMAND=()

usage() {
    cat <<EOF
Start the MOSIM LLMs container with outputs/, data/, checkpoints/ and logs/ mounted.

Usage: ./run.sh gpu|cpu [options] [-- COMMAND...]

  gpu                 all GPUs (docker run --gpus all); needs the NVIDIA container toolkit
  cpu                 no GPU (tests, trying the flow)

Options:
  --tag NAME          image to run (default: $TAG; build it with ./build.sh)
  --name NAME         container name (default: none, Docker picks one)
  --host-network      share the host's network (multi-node runs: NCCL and torchrun's rendezvous need it)
  --dry-run           print the docker run command and stop
  -h, --help          this help
  -- COMMAND...       run COMMAND instead of an interactive bash, e.g. ./run.sh gpu -- ./run_all_profiling.sh

Passed through from this shell when set: ${PASSED_ENV[*]}. Set DOCKER=podman to use podman.
EOF
}

usage_error() {  # one line, as the Python command lines refuse theirs: the help would push it off screen
    echo "error: $1 (see ./run.sh --help)" >&2
    exit 2
}

while [ $# -gt 0 ]; do
    case "$1" in
        gpu|cpu)
            [ -z "$MODE" ] || usage_error "gpu or cpu given twice"
            MODE="$1"; shift ;;
        --tag|--name)
            [ $# -ge 2 ] && [ -n "$2" ] || usage_error "$1 needs a value"
            if [ "$1" = --tag ]; then TAG="$2"; else NAME="$2"; fi
            shift 2 ;;
        --tag=*) TAG="${1#*=}"; shift ;;
        --name=*) NAME="${1#*=}"; shift ;;
        --host-network) HOST_NETWORK=1; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; COMMAND=("$@"); break ;;
        *) usage_error "unknown argument: $1" ;;
    esac
done
[ -n "$MODE" ] || usage_error "say gpu or cpu"

RUN_CMD=("$DOCKER" run --rm)
# -t only with a terminal: `./run.sh cpu -- cmd > log` must not ask for one.
if [ -t 0 ] && [ -t 1 ]; then RUN_CMD+=(-it); else RUN_CMD+=(-i); fi
[ -z "$NAME" ] || RUN_CMD+=(--name "$NAME")
[ "$MODE" = cpu ] || RUN_CMD+=(--gpus all)
# As in docker-compose.yml: host IPC (NCCL and DataLoader workers use /dev/shm), unlimited locked memory.
RUN_CMD+=(--ipc=host --ulimit memlock=-1 --ulimit stack=67108864)
[ "$HOST_NETWORK" = 0 ] || RUN_CMD+=(--network=host)
for dir in "${MOUNTED_DIRS[@]}"; do
    RUN_CMD+=(-v "$ROOT/$dir:$WORKDIR/$dir")
done
RUN_CMD+=(-v "$HF_CACHE_VOLUME:/root/.cache/huggingface")
for var in "${PASSED_ENV[@]}"; do
    RUN_CMD+=(-e "$var")
done
RUN_CMD+=(-w "$WORKDIR" "$TAG")
if [ "${#COMMAND[@]}" -gt 0 ]; then RUN_CMD+=("${COMMAND[@]}"); else RUN_CMD+=(bash); fi

quoted() { local a out=""; for a in "$@"; do out="$out $(printf '%q' "$a")"; done; printf '%s\n' "${out# }"; }

if [ "$DRY_RUN" = 1 ]; then
    quoted "${RUN_CMD[@]}"
    exit 0
fi

if ! command -v "$DOCKER" >/dev/null 2>&1; then
    echo "error: '$DOCKER' not found; install Docker Engine (https://docs.docker.com/engine/install/)" >&2
    exit 1
fi
if ! info_output="$("$DOCKER" info 2>&1)"; then
    reason="$(printf '%s\n' "$info_output" | grep -iE 'cannot connect|permission denied|error' | head -n 1 || true)"
    echo "error: the Docker engine is not reachable (${reason:-docker info failed}); start it (sudo systemctl start docker) or use sudo" >&2
    exit 1
fi
if [ "$MODE" = gpu ]; then
    # --gpus needs the NVIDIA container toolkit: a registered nvidia runtime, or its hook/CLI on the host.
    if ! printf '%s\n' "$info_output" | grep -qi nvidia \
        && ! command -v nvidia-container-runtime-hook >/dev/null 2>&1 \
        && ! command -v nvidia-container-cli >/dev/null 2>&1; then
        echo "error: the NVIDIA container runtime is missing, so --gpus all cannot work; install the NVIDIA Container Toolkit" >&2
        echo "  (https://docs.nvidia.com/datacenter/cloud-native/container-toolkit/latest/install-guide.html) or use ./run.sh cpu" >&2
        exit 1
    fi
fi
if ! "$DOCKER" image inspect "$TAG" >/dev/null 2>&1; then
    echo "error: image $TAG not found; build it first with ./build.sh${TAG:+ --tag $TAG}" >&2
    exit 1
fi

# Create the mounted folders as this user; Docker would create missing ones as root.
for dir in "${MOUNTED_DIRS[@]}"; do
    mkdir -p "$ROOT/$dir"
done
echo "\$ $(quoted "${RUN_CMD[@]}")"
exec "${RUN_CMD[@]}"
