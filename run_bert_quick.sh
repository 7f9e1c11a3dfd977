#!/usr/bin/env bash
# BERT profiling: short traced runs at 1, 2 and 4 GPUs (1 and 2 CPU ranks without a GPU); see --help.
# The launcher is utils/launch/: any Python 3 runs it, and it finds or makes the training environment itself.
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/utils/launch" "$(basename "$0")" "$@"
