#!/usr/bin/env bash
# Full BERT training under torchrun (background by default): ./run_bert.sh [NUM_GPUS] [BATCH_SIZE] [options]; see --help.
# The launcher is utils/launch/: any Python 3 runs it, and it finds or makes the training environment itself.
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/utils/launch" "$(basename "$0")" "$@"
