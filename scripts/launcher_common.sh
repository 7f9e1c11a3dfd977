#!/usr/bin/env bash
# Shared library of the launchers (run_gpt2.sh, run_bert.sh, run_*_quick.sh, run_all_*.sh): option parsing,
# environment checks, torchrun command building, foreground/background runs, trace checks and conversion.
#
# Sourced, never executed. A launcher sets the LC_* settings below and calls `lc_main "$@"`:
#   LC_TITLE       one line shown in the banner and in --help
#   LC_SYNOPSIS    the usage line(s) of the launcher
#   LC_MODELS      "gpt2", "bert" or "gpt2 bert"
#   LC_COUNTS      default GPU counts, e.g. "1 2 4"
#   LC_KIND        "quick": traced --test runs in the foreground; "full": training (--train), in the background
#   LC_POSITIONAL  1: accepts [NUM_GPUS] [BATCH_SIZE] positionals (run_gpt2.sh 8 4)
#   LC_CONVERT     1: convert the traces with convert_to_et.py after the runs
#
# Written for bash 3.2 as well (macOS): no associative arrays, no mapfile, and empty arrays are expanded with
# "${a[@]+"${a[@]}"}" because `set -u` rejects "${a[@]}" on an empty array before bash 4.4.

LC_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/python_env.sh
source "$LC_ROOT/scripts/python_env.sh"

# CPU mode runs at most this many ranks unless the user names the counts (--num-gpus): more CPU ranks add
# minutes on a laptop and no new structure to the trace (the collectives are the same from two ranks on).
LC_CPU_DEFAULT_MAX_RANKS=2
LC_CPU_MODEL="tiny"
LC_CPU_SEQ_LENGTH=128
LC_BUNDLED_DATASET="data/squad_sample.json"
LC_TEST_STEPS=10
LC_PEEK_SECONDS=5

# ---------------------------------------------------------------------------------------------------------
# Output helpers
# ---------------------------------------------------------------------------------------------------------

lc_say() { printf '%s\n' "$*"; }
lc_err() { printf 'error: %s\n' "$*" >&2; }

# Print an array as one shell-quoted command line that can be pasted back into bash.
lc_quote_command() {
    local out="" arg
    for arg in "$@"; do
        out="$out $(printf '%q' "$arg")"
    done
    printf '%s\n' "${out# }"
}

lc_usage() {
    cat <<EOF
$LC_TITLE

Usage:
$LC_SYNOPSIS

Mode:
  --test                  short run of $LC_TEST_STEPS optimizer steps$( [ "$LC_KIND" = quick ] && printf ' (default)')
  --train                 full training for --num-epochs epochs$( [ "$LC_KIND" = full ] && printf ' (default)')
  --max-steps N           stop after N optimizer steps (with --test: instead of $LC_TEST_STEPS)
  --num-epochs N          epochs in --train mode (default: 3)
  --trace / --no-trace    Chakra tracing (default: $( [ "$LC_KIND" = quick ] && printf 'on' || printf 'off'));
                          a traced run stops after the trace window unless --max-steps asks for more

Hyperparameters:
  --model-name NAME       gpt2, gpt2-medium, bert-base-uncased, tiny, a local model folder, ...
                          (default: gpt2 / bert-base-uncased on GPUs, $LC_CPU_MODEL on the CPU; applies to every model)
  --batch-size N          batch size per rank (default: 4)
  --learning-rate LR      (default: train.py's, 5e-5)
  --max-seq-length N      (default: train.py's on GPUs, $LC_CPU_SEQ_LENGTH on the CPU)
  --save-steps N          checkpoint every N steps (default: train.py's)
  --precision P           bf16, fp16 or fp32 (default: bf16 on GPUs that support it, else fp16; fp32 on the CPU)
  --bf16 / --fp16 / --fp32  the same as --precision P
  --compile / --no-compile  torch.compile (default: on for --train on GPUs, off for traced and CPU runs)
  --no-save-initial       do not save initial_model/ (default for quick runs)

Devices:
  --num-gpus N[,N...]     GPUs (or CPU ranks) per node; a list runs each count in turn
                          (default: $(printf '%s' "$LC_COUNTS" | tr ' ' ','))
  --cpu                   run on the CPU with gloo, even when GPUs are present (automatic without a GPU)
  --nnodes N              multi-node: number of nodes (default: 1)
  --node-rank R           multi-node: this node's rank, 0..N-1
  --master-addr HOST      multi-node: address of node 0 (required with --nnodes > 1)
  --master-port PORT      rendezvous port (default: 29500 with --nnodes > 1, a free port on one node)

Data and outputs:
  --dataset-path PATH     a SQuAD JSON file (*.json), a JSONL corpus of {"text": ...} lines, or a folder of *.jsonl
                          (default: SQuAD from the HuggingFace hub on GPUs, which falls back to the bundled
                          $LC_BUNDLED_DATASET offline; the bundled sample on the CPU)
  --output-dir DIR        traces go to DIR/<run name>/ (default: ./outputs)
  --save-dir DIR          checkpoints go to DIR/<run name>/ (default: ./checkpoints)
  --logs-dir DIR          per-rank logs in DIR/<run name>/, background PID and console log in DIR (default: ./logs)

Execution:
  --foreground            run in this terminal$( [ "$LC_KIND" = quick ] && printf ' (default)')
  --background            run with nohup; PID in LOGS/training.pid, output in LOGS/training_console.log$( [ "$LC_KIND" = full ] && printf ' (default)')
  --dry-run               check the environment, print the exact torchrun commands and stop
                          (with an explicit --background: rehearse the background start, commands go to the log)
  --verbose               more detail: device names, probe results, a log line every step
EOF
    if [ "${LC_CONVERT:-0}" = 1 ]; then
        cat <<EOF
  --no-convert            do not convert the traces to .et afterwards
EOF
    fi
    cat <<EOF
  -h, --help              this help
  -- ARGS...              passed unchanged to train.py (e.g. -- --attn-implementation eager)

A count larger than the machine has (GPUs, or CPU cores in CPU mode) is skipped with a line saying so.
Exit status: 0 when no run failed (skipped counts are not failures), 1 when a run or the conversion failed,
2 for a bad option.
EOF
}

lc_usage_error() {
    lc_err "$1"
    lc_say "" >&2
    lc_usage >&2
    exit 2
}

# ---------------------------------------------------------------------------------------------------------
# Option parsing
# ---------------------------------------------------------------------------------------------------------

lc_is_positive_int() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }
lc_is_count_list() { [[ "$1" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]]; }
lc_is_number() { [[ "$1" =~ ^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$ ]]; }

# Paths given on the command line are relative to where the user stands, not to the repository.
lc_abspath() {
    case "$1" in
        /*) printf '%s\n' "$1" ;;
        *) printf '%s\n' "$LC_CALLER_PWD/$1" ;;
    esac
}

lc_set_defaults() {
    LC_MODE=""               # test | train; empty: the kind's default
    LC_MAX_STEPS=""
    LC_NUM_EPOCHS=3
    LC_TRACE=""              # 1 | 0; empty: the kind's default
    LC_MODEL_NAME=""
    LC_BATCH_SIZE=4
    LC_LEARNING_RATE=""
    LC_MAX_SEQ_LENGTH=""
    LC_SAVE_STEPS=""
    LC_PRECISION=""
    LC_COMPILE=""            # 1 | 0; empty: decided once the device is known
    LC_SAVE_INITIAL=""       # 1 | 0; empty: the kind's default
    LC_NUM_GPUS=""           # explicit count list, comma separated
    LC_FORCE_CPU=0
    LC_NNODES=1
    LC_NODE_RANK=0
    LC_MASTER_ADDR=""
    LC_MASTER_PORT=""
    LC_DATASET_PATH=""
    LC_OUTPUT_DIR="outputs"
    LC_SAVE_DIR="checkpoints"
    LC_LOGS_DIR="logs"
    LC_BACKGROUND=""         # 1 | 0; empty: the kind's default
    LC_DRY_RUN=0
    LC_VERBOSE=0
    LC_DO_CONVERT="${LC_CONVERT:-0}"
    LC_EXTRA_ARGS=()
    LC_POSITIONALS=()
}

lc_parse_args() {
    local arg opt value inline
    while [ $# -gt 0 ]; do
        arg="$1"
        shift
        # --opt=value is the same as --opt value
        inline=0
        case "$arg" in
            --*=*) opt="${arg%%=*}"; inline=1; set -- "${arg#*=}" "$@" ;;
            *) opt="$arg" ;;
        esac
        case "$opt" in
            --max-steps|--num-epochs|--model-name|--batch-size|--learning-rate|--max-seq-length|--save-steps|\
            --precision|--num-gpus|--nnodes|--node-rank|--master-addr|--master-port|--dataset-path|\
            --output-dir|--save-dir|--logs-dir)
                if [ $# -eq 0 ] || [ -z "$1" ]; then
                    lc_usage_error "$opt needs a value"
                fi
                value="$1"
                shift
                ;;
            *)
                if [ "$inline" = 1 ]; then lc_usage_error "$opt takes no value ($arg)"; fi
                ;;
        esac
        case "$opt" in
            -h|--help) lc_usage; exit 0 ;;
            --test) LC_MODE="test" ;;
            --train) LC_MODE="train" ;;
            --max-steps)
                lc_is_positive_int "$value" || lc_usage_error "--max-steps: '$value' is not a positive integer"
                LC_MAX_STEPS="$value" ;;
            --num-epochs)
                lc_is_positive_int "$value" || lc_usage_error "--num-epochs: '$value' is not a positive integer"
                LC_NUM_EPOCHS="$value" ;;
            --trace) LC_TRACE=1 ;;
            --no-trace) LC_TRACE=0 ;;
            --model-name)
                # A local model folder (one with a config.json) is resolved from where the user stands.
                if [ -f "$value/config.json" ]; then value="$(lc_abspath "$value")"; fi
                LC_MODEL_NAME="$value" ;;
            --batch-size)
                lc_is_positive_int "$value" || lc_usage_error "--batch-size: '$value' is not a positive integer"
                LC_BATCH_SIZE="$value" ;;
            --learning-rate)
                lc_is_number "$value" || lc_usage_error "--learning-rate: '$value' is not a number"
                LC_LEARNING_RATE="$value" ;;
            --max-seq-length)
                lc_is_positive_int "$value" || lc_usage_error "--max-seq-length: '$value' is not a positive integer"
                LC_MAX_SEQ_LENGTH="$value" ;;
            --save-steps)
                lc_is_positive_int "$value" || lc_usage_error "--save-steps: '$value' is not a positive integer"
                LC_SAVE_STEPS="$value" ;;
            --precision)
                case "$value" in
                    bf16|fp16|fp32) LC_PRECISION="$value" ;;
                    *) lc_usage_error "--precision: '$value' is not one of bf16, fp16, fp32" ;;
                esac ;;
            --bf16|--fp16|--fp32) LC_PRECISION="${opt#--}" ;;
            --compile) LC_COMPILE=1 ;;
            --no-compile) LC_COMPILE=0 ;;
            --no-save-initial) LC_SAVE_INITIAL=0 ;;
            --num-gpus)
                lc_is_count_list "$value" || lc_usage_error "--num-gpus: '$value' is not a positive integer or a list like 1,2,4"
                LC_NUM_GPUS="$value" ;;
            --cpu) LC_FORCE_CPU=1 ;;
            --nnodes)
                lc_is_positive_int "$value" || lc_usage_error "--nnodes: '$value' is not a positive integer"
                LC_NNODES="$value" ;;
            --node-rank)
                [[ "$value" =~ ^[0-9]+$ ]] || lc_usage_error "--node-rank: '$value' is not a non-negative integer"
                LC_NODE_RANK="$value" ;;
            --master-addr) LC_MASTER_ADDR="$value" ;;
            --master-port)
                if ! lc_is_positive_int "$value" || [ "$value" -gt 65535 ]; then
                    lc_usage_error "--master-port: '$value' is not a port number (1-65535)"
                fi
                LC_MASTER_PORT="$value" ;;
            --dataset-path) LC_DATASET_PATH="$(lc_abspath "$value")" ;;
            --output-dir) LC_OUTPUT_DIR="$(lc_abspath "$value")" ;;
            --save-dir) LC_SAVE_DIR="$(lc_abspath "$value")" ;;
            --logs-dir) LC_LOGS_DIR="$(lc_abspath "$value")" ;;
            --foreground) LC_BACKGROUND=0 ;;
            --background) LC_BACKGROUND=1 ;;
            --dry-run) LC_DRY_RUN=1 ;;
            --verbose) LC_VERBOSE=1 ;;
            --no-convert)
                [ "${LC_CONVERT:-0}" = 1 ] || lc_usage_error "unknown option: --no-convert"
                LC_DO_CONVERT=0 ;;
            --) LC_EXTRA_ARGS=("$@"); break ;;
            -*) lc_usage_error "unknown option: $opt" ;;
            *)
                [ "${LC_POSITIONAL:-0}" = 1 ] || lc_usage_error "unexpected argument: $opt"
                LC_POSITIONALS+=("$opt") ;;
        esac
    done

    if [ "${#LC_POSITIONALS[@]}" -gt 2 ]; then
        lc_usage_error "too many arguments: ${LC_POSITIONALS[*]} (expected [NUM_GPUS] [BATCH_SIZE])"
    fi
    if [ "${#LC_POSITIONALS[@]}" -ge 1 ]; then
        lc_is_positive_int "${LC_POSITIONALS[0]}" || lc_usage_error "NUM_GPUS: '${LC_POSITIONALS[0]}' is not a positive integer"
        [ -z "$LC_NUM_GPUS" ] || lc_usage_error "NUM_GPUS given twice (positional and --num-gpus)"
        LC_NUM_GPUS="${LC_POSITIONALS[0]}"
    fi
    if [ "${#LC_POSITIONALS[@]}" -eq 2 ]; then
        lc_is_positive_int "${LC_POSITIONALS[1]}" || lc_usage_error "BATCH_SIZE: '${LC_POSITIONALS[1]}' is not a positive integer"
        LC_BATCH_SIZE="${LC_POSITIONALS[1]}"
    fi
    if [ "$LC_NNODES" -gt 1 ] && [ -z "$LC_MASTER_ADDR" ]; then
        lc_usage_error "--nnodes $LC_NNODES needs --master-addr (the address of node 0)"
    fi
    if [ "$LC_NODE_RANK" -ge "$LC_NNODES" ]; then
        lc_usage_error "--node-rank $LC_NODE_RANK must be below --nnodes $LC_NNODES"
    fi

    # The kind's defaults, for what the user did not choose.
    if [ "$LC_KIND" = quick ]; then
        : "${LC_MODE:=test}" "${LC_TRACE:=1}" "${LC_SAVE_INITIAL:=0}" "${LC_BACKGROUND:=0}"
    else
        : "${LC_MODE:=train}" "${LC_TRACE:=0}" "${LC_SAVE_INITIAL:=1}" "${LC_BACKGROUND:=1}"
    fi
}

# ---------------------------------------------------------------------------------------------------------
# Environment checks: PyTorch, CUDA and GPUs, dataset (one line each)
# ---------------------------------------------------------------------------------------------------------

# One Python start for everything we need to know. The results travel to a background child in LC_PROBE_*
# (with LC_PROBED=1); the tests use the same channel to describe machines they do not run on.
lc_probe() {
    "$PYTHON" - <<'PY'
import os
import torch
cuda = torch.cuda.is_available()
count = torch.cuda.device_count() if cuda else 0
try:
    cores = len(os.sched_getaffinity(0))
except AttributeError:  # macOS
    cores = os.cpu_count() or 1
bf16 = int(bool(cuda and torch.cuda.is_bf16_supported()))
names = ";".join(torch.cuda.get_device_name(i) for i in range(count))
print(torch.__version__)
print(count)
print(torch.version.cuda or "none")
print(bf16)
print(cores)
print(names)
PY
}

lc_check_environment() {
    lc_say "🔍 Checking the environment"
    if [ "${LC_PROBED:-0}" != 1 ]; then
        if ! ensure_python_env train; then
            lc_say "❌ PyTorch: no usable Python environment (see the messages above)"
            exit 1
        fi
        local probe probe_errors
        probe_errors="$(mktemp "${TMPDIR:-/tmp}/mosim-probe.XXXXXX")"
        # stderr apart: warnings printed while importing torch must not shift the lines read below
        if ! probe="$(lc_probe 2>"$probe_errors")"; then
            lc_say "❌ PyTorch: '$PYTHON' cannot import torch:"
            tail -n 3 "$probe_errors"
            rm -f "$probe_errors"
            exit 1
        fi
        rm -f "$probe_errors"
        # Line by line: torch version, GPU count, CUDA version, bf16 support, CPU cores, GPU names (;-separated)
        {
            IFS= read -r LC_PROBE_TORCH
            IFS= read -r LC_PROBE_GPUS
            IFS= read -r LC_PROBE_CUDA
            IFS= read -r LC_PROBE_BF16
            IFS= read -r LC_PROBE_CORES
            IFS= read -r LC_PROBE_GPU_NAMES || true
        } <<<"$probe"
        export LC_PROBE_TORCH LC_PROBE_GPUS LC_PROBE_CUDA LC_PROBE_BF16 LC_PROBE_CORES LC_PROBE_GPU_NAMES
    fi
    : "${LC_PROBE_CUDA:=none}" "${LC_PROBE_BF16:=0}" "${LC_PROBE_GPU_NAMES:=}"
    lc_say "✅ PyTorch $LC_PROBE_TORCH importable ($PYTHON)"

    if [ "$LC_FORCE_CPU" = 1 ]; then
        LC_DEVICE=cpu
        lc_say "ℹ️  CPU mode (--cpu): gloo, $LC_PROBE_CORES CPU cores, $LC_PROBE_GPUS GPUs left unused"
    elif [ "$LC_PROBE_GPUS" -gt 0 ]; then
        LC_DEVICE=gpu
        lc_say "✅ CUDA $LC_PROBE_CUDA: $LC_PROBE_GPUS GPU(s) available ($(printf '%s' "$LC_PROBE_GPU_NAMES" | cut -d';' -f1))"
        if [ "$LC_VERBOSE" = 1 ]; then
            local i=0 name
            local IFS=';'
            for name in $LC_PROBE_GPU_NAMES; do
                lc_say "   GPU $i: $name"
                i=$((i + 1))
            done
        fi
    else
        LC_DEVICE=cpu
        lc_say "⚠️  CUDA: no GPU found: CPU mode (gloo, $LC_PROBE_CORES CPU cores, $LC_CPU_MODEL model, fp32, no compile)"
    fi

    lc_check_dataset
    LC_PROBED=1
    export LC_PROBED PYTHON
}

lc_check_dataset() {
    LC_DATASET_ARGS=()
    if [ -n "$LC_DATASET_PATH" ]; then
        if [ -d "$LC_DATASET_PATH" ]; then
            local jsonl_files=("$LC_DATASET_PATH"/*.jsonl)
            if [ ! -f "${jsonl_files[0]}" ]; then
                lc_say "❌ Dataset: $LC_DATASET_PATH holds no *.jsonl file (--dataset-path)"
                exit 1
            fi
            LC_DATASET_ARGS=(--dataset-path "$LC_DATASET_PATH")
            lc_say "✅ Dataset: $LC_DATASET_PATH (folder of ${#jsonl_files[@]} JSONL files)"
            return 0
        fi
        if [ ! -f "$LC_DATASET_PATH" ]; then
            lc_say "❌ Dataset: $LC_DATASET_PATH not found (--dataset-path)"
            exit 1
        fi
        if [ ! -r "$LC_DATASET_PATH" ]; then
            lc_say "❌ Dataset: $LC_DATASET_PATH is not readable (--dataset-path)"
            exit 1
        fi
        case "$LC_DATASET_PATH" in
            *.json)
                LC_DATASET_ARGS=(--squad-file "$LC_DATASET_PATH")
                lc_say "✅ Dataset: $LC_DATASET_PATH (SQuAD JSON, $(lc_file_size "$LC_DATASET_PATH"))" ;;
            *)
                LC_DATASET_ARGS=(--dataset-path "$LC_DATASET_PATH")
                lc_say "✅ Dataset: $LC_DATASET_PATH (JSONL corpus, $(lc_file_size "$LC_DATASET_PATH"))" ;;
        esac
    elif [ "$LC_DEVICE" = cpu ]; then
        if [ ! -f "$LC_ROOT/$LC_BUNDLED_DATASET" ]; then
            lc_say "❌ Dataset: the bundled $LC_BUNDLED_DATASET is missing; restore it (git checkout) or pass --dataset-path"
            exit 1
        fi
        LC_DATASET_ARGS=(--squad-file "$LC_BUNDLED_DATASET")
        lc_say "✅ Dataset: $LC_BUNDLED_DATASET (bundled SQuAD sample, $(lc_file_size "$LC_ROOT/$LC_BUNDLED_DATASET"))"
    else
        # Reaching the hub cannot be checked without waiting on the network; train.py falls back by itself.
        if [ -f "$LC_ROOT/$LC_BUNDLED_DATASET" ]; then
            lc_say "✅ Dataset: SQuAD from the HuggingFace hub or its cache; offline fallback $LC_BUNDLED_DATASET present"
        else
            lc_say "⚠️  Dataset: SQuAD from the HuggingFace hub or its cache; no offline fallback ($LC_BUNDLED_DATASET missing)"
        fi
    fi
}

lc_file_size() {
    local bytes
    bytes="$(wc -c <"$1" | tr -d ' ')"
    if [ "$bytes" -ge 1048576 ]; then
        printf '%s MB' "$((bytes / 1048576))"
    else
        printf '%s KB' "$(((bytes + 1023) / 1024))"
    fi
}

# ---------------------------------------------------------------------------------------------------------
# Planning: which runs, with which settings
# ---------------------------------------------------------------------------------------------------------

lc_resolve_settings() {
    if [ "$LC_DEVICE" = cpu ]; then
        LC_UNIT=cpu
        : "${LC_PRECISION:=fp32}" "${LC_COMPILE:=0}" "${LC_MAX_SEQ_LENGTH:=$LC_CPU_SEQ_LENGTH}"
        LC_CAPACITY="$LC_PROBE_CORES"
    else
        LC_UNIT=gpu
        if [ -z "$LC_PRECISION" ]; then
            if [ "$LC_PROBE_BF16" = 1 ]; then LC_PRECISION=bf16; else LC_PRECISION=fp16; fi
        fi
        # Compiled graphs hide the eager operators a Chakra trace is made of, and compiling takes longer
        # than a 10-step run: compile only untraced training.
        if [ -z "$LC_COMPILE" ]; then
            if [ "$LC_MODE" = train ] && [ "$LC_TRACE" = 0 ]; then LC_COMPILE=1; else LC_COMPILE=0; fi
        fi
        LC_CAPACITY="$LC_PROBE_GPUS"
    fi
}

lc_model_script() { printf '%s/train.py' "$1"; }

lc_model_name() {
    if [ -n "$LC_MODEL_NAME" ]; then printf '%s' "$LC_MODEL_NAME"
    elif [ "$LC_DEVICE" = cpu ]; then printf '%s' "$LC_CPU_MODEL"
    elif [ "$1" = gpt2 ]; then printf 'gpt2'
    else printf 'bert-base-uncased'
    fi
}

lc_model_label() { if [ "$1" = gpt2 ]; then printf 'GPT-2'; else printf 'BERT'; fi; }

# <model>_<world><gpu|cpu>[_quick_trace]
lc_run_name() {
    local model="$1" world="$2"
    if [ "$LC_KIND" = quick ]; then
        printf '%s_%s%s_quick_trace' "$model" "$world" "$LC_UNIT"
    else
        printf '%s_%s%s' "$model" "$world" "$LC_UNIT"
    fi
}

# Sets LC_PLAN (counts to run, space separated) and prints a line for each skipped count.
lc_plan_counts() {
    local explicit=1 counts count
    if [ -n "$LC_NUM_GPUS" ]; then
        counts="$(printf '%s' "$LC_NUM_GPUS" | tr ',' ' ')"
    else
        explicit=0
        counts="$LC_COUNTS"
    fi
    LC_PLAN=""
    LC_SKIPPED=()
    for count in $counts; do
        if [ "$LC_DEVICE" = cpu ] && [ "$explicit" = 0 ] && [ "$count" -gt "$LC_CPU_DEFAULT_MAX_RANKS" ]; then
            lc_skip "$count" "CPU mode runs 1 and $LC_CPU_DEFAULT_MAX_RANKS ranks unless asked (--num-gpus $(printf '%s' "$counts" | tr ' ' ','))"
        elif [ "$count" -gt "$LC_CAPACITY" ]; then
            if [ "$LC_DEVICE" = gpu ]; then
                lc_skip "$count" "this machine has $LC_CAPACITY GPU(s)"
            elif [ "$LC_PROBE_GPUS" = 0 ]; then
                lc_skip "$count" "this machine has no GPU, and $LC_CAPACITY CPU cores for CPU ranks (one rank per core)"
            else
                lc_skip "$count" "CPU mode runs one rank per core and this machine has $LC_CAPACITY"
            fi
        else
            LC_PLAN="$LC_PLAN $count"
        fi
    done
    LC_PLAN="${LC_PLAN# }"
}

lc_skip() {
    local count="$1" why="$2" model
    local what="GPUs"
    [ "$LC_DEVICE" = cpu ] && what="CPU ranks"
    for model in $LC_MODELS; do
        lc_say "⏭️  Skipping $(lc_model_label "$model") at $count $what: $why"
        LC_SKIPPED+=("$(lc_run_name "$model" "$((count * LC_NNODES))")|$why")
    done
}

lc_print_settings() {
    local mode_line what
    if [ "$LC_MODE" = test ]; then
        mode_line="test (${LC_MAX_STEPS:-$LC_TEST_STEPS} steps)"
    else
        mode_line="train ($LC_NUM_EPOCHS epochs${LC_MAX_STEPS:+, at most $LC_MAX_STEPS steps})"
    fi
    what="GPUs"
    [ "$LC_DEVICE" = cpu ] && what="CPU ranks (gloo)"
    lc_say ""
    lc_say "📋 Run settings"
    lc_say "   • mode: $mode_line"
    local models="" m
    for m in $LC_MODELS; do models="$models $(lc_model_label "$m")=$(lc_model_name "$m")"; done
    lc_say "   • models:$models"
    lc_say "   • $what per node: ${LC_PLAN:-none}$( [ "$LC_NNODES" -gt 1 ] && printf ' · nodes: %s (this is node %s)' "$LC_NNODES" "$LC_NODE_RANK")"
    lc_say "   • batch size per rank: $LC_BATCH_SIZE · learning rate: ${LC_LEARNING_RATE:-train.py default} · max sequence length: ${LC_MAX_SEQ_LENGTH:-train.py default}"
    lc_say "   • precision: $LC_PRECISION · torch.compile: $( [ "$LC_COMPILE" = 1 ] && printf on || printf off) · save every: ${LC_SAVE_STEPS:-train.py default} steps · initial model saved: $( [ "$LC_SAVE_INITIAL" = 1 ] && printf yes || printf no)"
    lc_say "   • tracing: $( [ "$LC_TRACE" = 1 ] && printf 'on, traces in %s/<run name>/' "$LC_OUTPUT_DIR" || printf off)"
    lc_say "   • checkpoints: $LC_SAVE_DIR/<run name>/ · logs: $LC_LOGS_DIR/<run name>/"
    lc_say "   • execution: $( [ "$LC_BACKGROUND" = 1 ] && printf 'background (nohup)' || printf foreground)$( [ "$LC_DRY_RUN" = 1 ] && printf ', dry run')"
    if [ "${#LC_EXTRA_ARGS[@]}" -gt 0 ]; then
        lc_say "   • passed to train.py: ${LC_EXTRA_ARGS[*]}"
    fi
}

# ---------------------------------------------------------------------------------------------------------
# The torchrun command of one run (into LC_CMD)
# ---------------------------------------------------------------------------------------------------------

lc_torchrun() {
    # torchrun through the chosen Python (a .venv's torch runs the workers), wrapped so that a stop or a failed
    # rank ends in one line instead of torchrun's traceback.
    LC_CMD+=("$PYTHON" -m utils.torchrun)
}

lc_build_command() {
    local model="$1" nproc="$2" run_name="$3"
    local world=$((nproc * LC_NNODES))
    local threads
    LC_CMD=(env PYTHONUNBUFFERED=1)
    if [ "$LC_DEVICE" = cpu ]; then
        # One rank per core; torchrun would otherwise force 1 thread only for nproc > 1.
        threads=$((LC_PROBE_CORES / nproc))
        [ "$threads" -ge 1 ] || threads=1
        LC_CMD+=("OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads}")
    fi
    if [ "$LC_VERBOSE" = 1 ]; then
        LC_CMD+=(LOGLEVEL=INFO)
    fi
    lc_torchrun
    if [ "$LC_NNODES" -gt 1 ]; then
        LC_CMD+=(--nnodes="$LC_NNODES" --node_rank="$LC_NODE_RANK"
                 --master_addr="$LC_MASTER_ADDR" --master_port="${LC_MASTER_PORT:-29500}")
    elif [ -n "$LC_MASTER_PORT" ] || [ -n "$LC_MASTER_ADDR" ]; then
        LC_CMD+=(--nnodes=1 --node_rank=0 --master_addr="${LC_MASTER_ADDR:-localhost}" --master_port="${LC_MASTER_PORT:-29500}")
    else
        # --standalone picks a free port, so two launches on one machine never collide.
        LC_CMD+=(--standalone)
    fi
    LC_CMD+=(--nproc_per_node="$nproc" "$(lc_model_script "$model")"
             --model-name "$(lc_model_name "$model")"
             --num-gpus "$world"
             --batch-size "$LC_BATCH_SIZE")
    if [ "$LC_MODE" = test ]; then
        # A quick run is an experiment run again and again: it replaces its own earlier checkpoints.
        LC_CMD+=(--max-steps "${LC_MAX_STEPS:-$LC_TEST_STEPS}" --overwrite-output-dir)
    else
        LC_CMD+=(--num-epochs "$LC_NUM_EPOCHS")
        if [ -n "$LC_MAX_STEPS" ]; then LC_CMD+=(--max-steps "$LC_MAX_STEPS"); fi
    fi
    if [ -n "$LC_LEARNING_RATE" ]; then LC_CMD+=(--learning-rate "$LC_LEARNING_RATE"); fi
    if [ -n "$LC_MAX_SEQ_LENGTH" ]; then LC_CMD+=(--max-seq-length "$LC_MAX_SEQ_LENGTH"); fi
    if [ -n "$LC_SAVE_STEPS" ]; then LC_CMD+=(--save-steps "$LC_SAVE_STEPS"); fi
    LC_CMD+=(--precision "$LC_PRECISION")
    if [ "$LC_COMPILE" = 1 ]; then LC_CMD+=(--compile); else LC_CMD+=(--no-compile); fi
    if [ "$LC_SAVE_INITIAL" = 0 ]; then LC_CMD+=(--no-save-initial); fi
    LC_CMD+=(--save-dir "$LC_SAVE_DIR/$run_name" --log-dir "$LC_LOGS_DIR/$run_name")
    LC_CMD+=("${LC_DATASET_ARGS[@]+"${LC_DATASET_ARGS[@]}"}")
    if [ "$LC_TRACE" = 1 ]; then
        LC_CMD+=(--enable-tracing --trace-output-dir "$LC_OUTPUT_DIR" --trace-name "$run_name")
    fi
    if [ "$LC_VERBOSE" = 1 ]; then LC_CMD+=(--logging-steps 1); fi
    LC_CMD+=("${LC_EXTRA_ARGS[@]+"${LC_EXTRA_ARGS[@]}"}")
}

# ---------------------------------------------------------------------------------------------------------
# Running: foreground with signal forwarding, background with nohup
# ---------------------------------------------------------------------------------------------------------

LC_CHILD_PID=""
LC_INTERRUPTED=0
LC_STOP=0

lc_on_signal() {
    LC_INTERRUPTED=1
    LC_STOP=1
    if [ -n "$LC_CHILD_PID" ] && kill -0 "$LC_CHILD_PID" 2>/dev/null; then
        lc_say "🛑 Stopping: SIGTERM to torchrun (PID $LC_CHILD_PID); the trainer saves a checkpoint and exits"
        kill -TERM "$LC_CHILD_PID" 2>/dev/null || true
    fi
}

# Runs LC_CMD as a child and waits, so a `kill <launcher PID>` (background mode) or Ctrl-C reaches torchrun,
# which passes it on to its workers. Sets LC_RC.
lc_run_command() {
    "${LC_CMD[@]}" &
    LC_CHILD_PID=$!
    while :; do
        LC_INTERRUPTED=0
        LC_RC=0
        wait "$LC_CHILD_PID" || LC_RC=$?
        # A trap interrupts `wait` before the child ends; wait again for its real exit status.
        [ "$LC_INTERRUPTED" = 1 ] || break
    done
    LC_CHILD_PID=""
}

lc_start_background() {
    local pid_file="$LC_LOGS_DIR/training.pid" console_log="$LC_LOGS_DIR/training_console.log"
    local old_pid pid i
    mkdir -p "$LC_LOGS_DIR"
    if [ -f "$pid_file" ]; then
        old_pid="$(cat "$pid_file" 2>/dev/null || true)"
        if [[ "$old_pid" =~ ^[0-9]+$ ]] && kill -0 "$old_pid" 2>/dev/null; then
            lc_err "a background run is still going (PID $old_pid, $pid_file); stop it (kill $old_pid) or use another --logs-dir"
            exit 1
        fi
    fi
    lc_say ""
    lc_say "🎯 Starting in the background"
    lc_say "📋 Console log: $console_log"
    # The child is this same script in the foreground; it reuses the checks done here (LC_PROBED).
    LC_BACKGROUND_CHILD=1 nohup bash "$LC_SCRIPT_PATH" "${LC_ORIGINAL_ARGS[@]+"${LC_ORIGINAL_ARGS[@]}"}" --foreground \
        >"$console_log" 2>&1 </dev/null &
    pid=$!
    printf '%s\n' "$pid" >"$pid_file.tmp"
    mv "$pid_file.tmp" "$pid_file"
    lc_say "✅ Background run started"
    lc_say "🔢 Process ID: $pid"
    lc_say "📄 PID file: $pid_file"
    lc_say ""
    lc_say "🔍 Follow it with:"
    lc_say "  tail -f $console_log     # live log"
    lc_say "  ps -p $pid                             # still running?"
    lc_say "  kill $pid                              # stop it (a checkpoint is saved)"
    lc_say ""
    lc_say "📋 First log lines (up to ${LC_PEEK_SECONDS}s):"
    lc_say "----------------------------------------"
    i=0
    while [ "$i" -lt $((LC_PEEK_SECONDS * 2)) ] && kill -0 "$pid" 2>/dev/null; do
        sleep 0.5
        i=$((i + 1))
    done
    tail -n 20 "$console_log" || true
    lc_say "----------------------------------------"
    if kill -0 "$pid" 2>/dev/null; then
        lc_say "Still running in the background..."
        return 0
    fi
    local rc=0
    wait "$pid" || rc=$?
    if [ "$rc" = 0 ]; then
        lc_say "✅ The background run already finished (exit 0); full output in $console_log"
    else
        lc_say "❌ The background run already ended with exit code $rc; see $console_log"
    fi
    return "$rc"
}

# ---------------------------------------------------------------------------------------------------------
# After a traced run: every rank's host and device trace, and run.json, written by this run
# ---------------------------------------------------------------------------------------------------------

lc_check_trace_folder() {
    local dir="$1" nproc="$2" marker="$3"
    local first=$((LC_NODE_RANK * nproc)) last=$((LC_NODE_RANK * nproc + nproc - 1))
    local rank file missing=""
    for rank in $(seq "$first" "$last"); do
        for file in "host.$rank.json" "device.$rank.json"; do
            if [ ! -s "$dir/$file" ]; then
                missing="$missing $file"
            elif [ ! "$dir/$file" -nt "$marker" ]; then
                missing="$missing $file(stale)"
            fi
        done
    done
    if [ "$LC_NODE_RANK" = 0 ] && [ ! -s "$dir/run.json" ]; then
        missing="$missing run.json"
    fi
    if [ -n "$missing" ]; then
        lc_say "❌ Trace folder $dir is incomplete: missing${missing}"
        return 1
    fi
    lc_say "✅ Traces: $dir (ranks $first-$last: host, device, stacks$( [ "$LC_NODE_RANK" = 0 ] && printf ', run.json'); $(du -sh "$dir" 2>/dev/null | cut -f1))"
}

# ---------------------------------------------------------------------------------------------------------
# Conversion (run_all_profiling.sh): convert_to_et.py when it and its packages are there
# ---------------------------------------------------------------------------------------------------------

lc_convert() {
    local dirs=("$@")
    LC_CONVERT_STATUS="skipped"
    lc_say ""
    lc_say "🔄 Conversion to Chakra .et"
    if [ "${#dirs[@]}" -eq 0 ]; then
        lc_say "⏭️  Nothing to convert: no trace folder was written"
        return 0
    fi
    if [ ! -f "$LC_ROOT/convert_to_et.py" ]; then
        lc_say "⏭️  Conversion skipped: convert_to_et.py is not in this checkout"
        return 0
    fi
    if ! "$PYTHON" -c "import chakra.schema.protobuf.et_def_pb2, orjson" >/dev/null 2>&1; then
        lc_say "⏭️  Conversion skipped: $PYTHON cannot import chakra and orjson; convert later with ./setup_and_convert.sh $LC_OUTPUT_DIR"
        return 0
    fi
    LC_CMD=("$PYTHON" convert_to_et.py "${dirs[@]}")
    lc_say "\$ $(lc_quote_command "${LC_CMD[@]}")"
    if [ "$LC_DRY_RUN" = 1 ]; then
        LC_CONVERT_STATUS="dry run"
        return 0
    fi
    lc_run_command
    if [ "$LC_RC" = 0 ]; then
        LC_CONVERT_STATUS="ok"
        LC_NEXT_RUN="${dirs[${#dirs[@]}-1]}"  # the largest run: ASTRA-sim needs two NPUs or more
        lc_say "✅ Converted: <run name>.<rank>.et and CONVERSION_SUMMARY.md in each trace folder"
    else
        LC_CONVERT_STATUS="failed (exit $LC_RC)"
        lc_say "❌ Conversion failed (exit $LC_RC); the traces are kept, retry with: $PYTHON convert_remaining.py ${dirs[*]}"
        return 1
    fi
}

# ---------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------

lc_banner() {
    lc_say "========================================================"
    lc_say "  MOSIM LLMs · $LC_TITLE"
    lc_say "  torchrun + DDP · Chakra execution traces"
    lc_say "========================================================"
    lc_say ""
}

lc_main() {
    LC_ORIGINAL_ARGS=("$@")
    LC_CALLER_PWD="$(pwd)"
    LC_SCRIPT_PATH="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
    lc_set_defaults
    lc_parse_args "$@"
    cd "$LC_ROOT" || exit 1

    lc_banner
    lc_check_environment
    lc_resolve_settings
    lc_plan_counts
    lc_print_settings

    if [ "$LC_BACKGROUND" = 1 ] && [ "${LC_BACKGROUND_CHILD:-0}" != 1 ]; then
        # A plain --dry-run only prints; with an explicit --background it rehearses the background start.
        if [ "$LC_DRY_RUN" = 0 ] || lc_has_arg --background; then
            lc_start_background
            exit $?
        fi
    fi

    trap lc_on_signal INT TERM
    local model count run_name started elapsed marker failed=0
    local results=() trace_dirs=()
    marker="$(mktemp "${TMPDIR:-/tmp}/mosim-launch.XXXXXX")"
    # shellcheck disable=SC2064  # the marker path is fixed now
    trap "rm -f '$marker'" EXIT
    for model in $LC_MODELS; do
        for count in $LC_PLAN; do
            [ "$LC_STOP" = 0 ] || break 2
            run_name="$(lc_run_name "$model" "$((count * LC_NNODES))")"
            lc_build_command "$model" "$count" "$run_name"
            lc_say ""
            lc_say "▶ $(lc_model_label "$model") on $count $( [ "$LC_UNIT" = gpu ] && printf 'GPU(s)' || printf 'CPU rank(s)')$( [ "$LC_NNODES" -gt 1 ] && printf ' per node × %s nodes' "$LC_NNODES"): $run_name"
            lc_say "\$ $(lc_quote_command "${LC_CMD[@]}")"
            if [ "$LC_DRY_RUN" = 1 ]; then
                results+=("$run_name|dry run|-|$(lc_dir_label "$run_name")")
                continue
            fi
            touch "$marker"
            started=$SECONDS
            lc_run_command
            elapsed=$((SECONDS - started))
            if [ "$LC_RC" = 0 ] && [ "$LC_TRACE" = 1 ]; then
                lc_check_trace_folder "$LC_OUTPUT_DIR/$run_name" "$count" "$marker" || LC_RC=1
            fi
            if [ "$LC_STOP" = 1 ]; then
                lc_say "🛑 $run_name stopped by a signal after ${elapsed}s (exit $LC_RC); checkpoints in $LC_SAVE_DIR/$run_name/"
                results+=("$run_name|stopped|${elapsed}s|$LC_SAVE_DIR/$run_name/")
            elif [ "$LC_RC" = 0 ]; then
                lc_say "✅ $run_name finished in ${elapsed}s"
                results+=("$run_name|ok|${elapsed}s|$(lc_dir_label "$run_name")")
                if [ "$LC_TRACE" = 1 ]; then trace_dirs+=("$LC_OUTPUT_DIR/$run_name"); fi
            else
                lc_say "❌ $run_name failed (exit $LC_RC) after ${elapsed}s; per-rank logs in $LC_LOGS_DIR/$run_name/"
                results+=("$run_name|failed (exit $LC_RC)|${elapsed}s|$LC_LOGS_DIR/$run_name/")
                failed=1
            fi
        done
    done

    if [ "$LC_DO_CONVERT" = 1 ] && [ "$LC_TRACE" = 1 ] && [ "$LC_STOP" = 0 ]; then
        if [ "$LC_DRY_RUN" = 1 ]; then
            # Nothing was written yet: show the command on the folders the runs would write.
            trace_dirs=()
            for model in $LC_MODELS; do
                for count in $LC_PLAN; do trace_dirs+=("$LC_OUTPUT_DIR/$(lc_run_name "$model" "$((count * LC_NNODES))")"); done
            done
        fi
        lc_convert "${trace_dirs[@]+"${trace_dirs[@]}"}" || failed=1
    fi

    lc_print_summary "${results[@]+"${results[@]}"}"
    if [ "$LC_STOP" = 1 ]; then
        lc_say "🛑 Stopped by a signal"
        exit 130
    fi
    exit "$failed"
}

lc_has_arg() {
    local want="$1" arg
    for arg in "${LC_ORIGINAL_ARGS[@]+"${LC_ORIGINAL_ARGS[@]}"}"; do
        [ "$arg" = "--" ] && return 1
        [ "$arg" = "$want" ] && return 0
    done
    return 1
}

lc_dir_label() {
    if [ "$LC_TRACE" = 1 ]; then printf '%s/%s/' "$LC_OUTPUT_DIR" "$1"; else printf '%s/%s/' "$LC_SAVE_DIR" "$1"; fi
}

lc_print_summary() {
    local row name status took where
    lc_say ""
    lc_say "📊 Summary"
    for row in "$@"; do
        IFS='|' read -r name status took where <<<"$row"
        printf '   %-28s %-16s %-7s %s\n' "$name" "$status" "$took" "$where"
    done
    for row in "${LC_SKIPPED[@]+"${LC_SKIPPED[@]}"}"; do
        IFS='|' read -r name status <<<"$row"
        printf '   %-28s %-16s %-7s %s\n' "$name" "skipped" "-" "$status"
    done
    if [ "$LC_DO_CONVERT" = 1 ] && [ "$LC_TRACE" = 1 ]; then
        printf '   %-28s %s\n' "conversion to .et" "${LC_CONVERT_STATUS:-not run}"
    fi
    if [ -n "${LC_NEXT_RUN:-}" ]; then
        lc_say ""
        lc_say "👉 Next steps: the report: $PYTHON trace_report.py $LC_NEXT_RUN"
        lc_say "   ASTRA-sim (built by ./install_astra_sim.sh): $PYTHON simulate.py $LC_NEXT_RUN --bandwidth 100Gbit/s"
        lc_say "   or its workload path: --workload-configuration=$LC_NEXT_RUN/$(basename "$LC_NEXT_RUN") (docs/CHAKRA_SETUP.md)"
    fi
}
