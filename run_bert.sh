#!/usr/bin/env bash
# Full BERT training under torchrun (background by default): ./run_bert.sh [NUM_GPUS] [BATCH_SIZE] [options]; see --help.
set -euo pipefail
# shellcheck source=scripts/launcher_common.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/scripts/launcher_common.sh"

LC_TITLE="BERT training launcher (full training, background by default)"
LC_SYNOPSIS="  ./run_bert.sh [NUM_GPUS] [BATCH_SIZE] [options]     e.g. ./run_bert.sh 8 4"
LC_MODELS="bert"
LC_COUNTS="1"
LC_KIND=full
LC_POSITIONAL=1
LC_CONVERT=0
lc_main "$@"
