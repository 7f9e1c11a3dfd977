#!/usr/bin/env bash
# Every training experiment: GPT-2 and BERT at 1, 2 and 8 GPUs, one after the other (background by default).
set -euo pipefail
# shellcheck source=scripts/launcher_common.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/scripts/launcher_common.sh"

LC_TITLE="All experiments: GPT-2 and BERT training at 1, 2 and 8 GPUs"
LC_SYNOPSIS="  ./run_all_experiments.sh [options]"
LC_MODELS="gpt2 bert"
LC_COUNTS="1 2 8"
LC_KIND=full
LC_POSITIONAL=0
LC_CONVERT=0
lc_main "$@"
