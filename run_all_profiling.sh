#!/usr/bin/env bash
# The main job: GPT-2 and BERT traced at 1, 2 and 4 GPUs (1 and 2 CPU ranks without a GPU), then converted to .et.
set -euo pipefail
# shellcheck source=scripts/launcher_common.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/scripts/launcher_common.sh"

LC_TITLE="All profiling: GPT-2 and BERT at 1, 2 and 4 GPUs, then conversion to .et"
LC_SYNOPSIS="  ./run_all_profiling.sh [options]     no GPU: 1 and 2 CPU ranks on the bundled data"
LC_MODELS="gpt2 bert"
LC_COUNTS="1 2 4"
LC_KIND=quick
LC_POSITIONAL=0
LC_CONVERT=1
lc_main "$@"
