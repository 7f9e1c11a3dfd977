#!/usr/bin/env bash
# Every training experiment: GPT-2 and BERT at 1, 2 and 8 GPUs, one after the other (background by default); see --help.
# The launcher is utils/launch/: any Python 3 runs it, and it finds or makes the training environment itself.
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/utils/launch" "$(basename "$0")" "$@"
