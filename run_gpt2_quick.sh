#!/usr/bin/env bash
# GPT-2 profiling: traced 10-step runs at 1, 2 and 4 GPUs (1 and 2 CPU ranks without a GPU); see --help.
set -euo pipefail
# shellcheck source=scripts/launcher_common.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/scripts/launcher_common.sh"

LC_TITLE="GPT-2 quick profiling: traced 10-step runs at 1, 2 and 4 GPUs"
LC_SYNOPSIS="  ./run_gpt2_quick.sh [options]     traces in outputs/gpt2_<N>gpu_quick_trace/ (gpt2_<N>cpu_quick_trace/ on the CPU)"
LC_MODELS="gpt2"
LC_COUNTS="1 2 4"
LC_KIND=quick
LC_POSITIONAL=0
LC_CONVERT=0
lc_main "$@"
