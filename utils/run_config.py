"""The flags of gpt2/train.py and bert/train.py as frozen dataclasses, parsed by HfArgumentParser and checked once."""
import argparse
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

from transformers import HfArgumentParser

from utils.errors import wait_for_rank_zero_to_report
from utils.families import family_info

TEST_MODE_STEPS = 10
# Untraced steps before the trace window are timed (the first one, with its one-time start-up costs, is not used by
# the conversion); several active steps give per-operator medians instead of one sample. The run's first steps after
# step 0 still warm up: a 2-rank GPT-2 tiny run on 2 cores faulted 720-1442 heap pages a step in steps 1-3 and none
# from step 4, its steps 1-4 taking 31-57 ms against 21-25 after. With 5 wait steps (and so 5 after the window)
# those were 4 of the median's 9 samples, which it does not outlast: the median was the slowest steady step, and the
# steps lay 17-22% from it. With 10, they are 4 of 19, and the traced steps begin further past them.
DEFAULT_WAIT_STEPS, DEFAULT_WARMUP_STEPS, DEFAULT_ACTIVE_STEPS = 10, 1, 3
# The least a default window is shrunk to for a short --max-steps: one untraced step timed after the run's first (the
# conversion takes the profiler's cost out against it), one warm-up step (start-up costs stay out of the trace) and
# one traced step. Shrunk further, the .et would keep the profiler's cost, or trace step 0 and its start-up.
SHORTEST_WINDOW = (2, 1, 1)
# The least value of each numeric flag (a flag left out, None, is not checked).
MINIMUM = dict(seed=0, max_seq_length=16, eval_batches=0, batch_size=1, num_epochs=1, max_steps=1, warmup_steps=0,
               gradient_accumulation_steps=1, save_steps=0, logging_steps=1, loss_sync_steps=0, eval_steps=0,
               num_gpus=1, trace_wait_steps=0, trace_warmup_steps=0, trace_active_steps=1, trace_after_steps=0,
               weight_decay=0, max_grad_norm=0)
# The most: a seed is one 32-bit word to NumPy (set_seed refused 2**32 with a traceback after the folders were made)
MAXIMUM = dict(seed=2 ** 32 - 1)


class ConfigError(ValueError):
    """A flag value refused at parse time: `error: <message>` and exit status 2, before anything starts."""


def flag(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ModelArguments:
    _argument_group_name = "model"
    model_name: Optional[str] = flag(None, "a named size or a directory with a config.json (default: %(default)s)")
    tokenizer_path: Optional[str] = flag(None, "tokenizer directory; default: /workspace/pretrained_models/"
                                               "<model-name>, then the hub, then one trained on the training text")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = flag(
        "sdpa", "attention kernel (default: %(default)s; flash_attention_2 needs a GPU and flash-attn)")


@dataclass(frozen=True)
class DataArguments:
    _argument_group_name = "data"
    squad_file: Optional[str] = flag(None, "a local SQuAD v1.1/v2.0 JSON file instead of the hub's SQuAD")
    dataset_path: Optional[str] = flag(None, "a JSONL corpus of {\"text\": ...} lines, or a directory of *.jsonl files")
    cache_dir: Optional[str] = flag(None, "Hugging Face datasets/tokenizer cache directory")
    max_seq_length: int = flag(512, "tokens per sequence: GPT-2 packs text into blocks of it, BERT pads every batch "
                                    "to it (default: %(default)s)")
    validation_fraction: float = flag(0.1, "share of a local dataset held out for validation (default: %(default)s)")
    eval_batches: int = flag(50, "validation batches per evaluation and rank, 0 for all (default: %(default)s)")


@dataclass(frozen=True)
class OptimizationArguments:
    _argument_group_name = "training"
    batch_size: int = flag(4, "sequences per rank and micro-step (default: %(default)s)")
    learning_rate: float = flag(5e-5, "peak learning rate (default: %(default)s)")
    weight_decay: float = flag(0.01, "AdamW weight decay of matrices; biases and norms get none (default: %(default)s)")
    num_epochs: int = flag(3, "epochs when neither --max-steps nor --enable-tracing (which runs its window and the "
                              "untraced steps after it) sets the length (default: %(default)s)")
    max_steps: Optional[int] = flag(None, "optimizer steps; overrides --num-epochs")
    warmup_steps: Optional[int] = flag(None, "linear warm-up steps, then decay to 0 (default: 10%% of the steps)")
    lr_scheduler: Literal["linear", "cosine", "constant_with_warmup"] = flag(
        "linear", "transformers.get_scheduler type (default: %(default)s)")
    max_grad_norm: float = flag(1.0, "gradient clipping, 0 to disable (default: %(default)s)")
    gradient_accumulation_steps: int = flag(1, "micro-batches per optimizer step; DDP all-reduces only on the last")
    seed: int = flag(42, "random seed (default: %(default)s)")
    test: bool = flag(False, f"quick check: stop after {TEST_MODE_STEPS} optimizer steps, a traced run after its trace "
                             "window and the untraced steps timed after it if more (or --max-steps)")
    overfit_one_batch: bool = flag(False, "train on the first batch over and over: the loss must fall toward zero")


@dataclass(frozen=True)
class CheckpointArguments:
    _argument_group_name = "checkpoints and logs"
    save_dir: Optional[str] = flag(None, "checkpoint directory (default: %(default)s)")
    save_steps: int = flag(500, "checkpoint-<step>/ every N steps, 0 for none (default: %(default)s)")
    no_save_initial: bool = flag(False, "do not save initial_model/ before the first step")
    resume_from: Optional[str] = flag(None, "continue from a checkpoint: weights, optimizer, RNG and data position")
    overwrite_output_dir: bool = flag(False, "train into a --save-dir that holds an earlier run's checkpoints, "
                                             "moving them into <save-dir>/.previous/ (refused without it, unless "
                                             "--resume-from is one of them)")
    logging_steps: int = flag(10, "log line every N steps (default: %(default)s)")
    loss_sync_steps: int = flag(0, "read the loss and average it over the ranks only every N steps (an all-reduce "
                                   "and a host sync); the log lines in between give the step time only (default: "
                                   "0, on every log line)")
    eval_steps: int = flag(500, "validate every N steps (and at the end), 0 for only at the end (default: %(default)s)")
    log_dir: str = flag("./logs", "training_rank_<r>.log and TensorBoard runs (default: %(default)s)")
    report_to: Literal["tensorboard", "wandb", "none"] = flag(
        "tensorboard", "metric sink (default: %(default)s; wandb logs offline without WANDB_API_KEY)")


@dataclass(frozen=True)
class DeviceArguments:
    _argument_group_name = "devices and speed"
    num_gpus: Optional[int] = flag(None, "expected number of processes, checked against torchrun's WORLD_SIZE")
    precision: Optional[Literal["bf16", "fp16", "fp32"]] = flag(
        None, "autocast precision; fp16 uses a gradient scaler (default: bf16 on GPUs that support it, else fp16; "
              "fp32 on the CPU)")
    compile: bool = flag(False, "torch.compile the model (default: off)")
    peak_tflops: Optional[float] = flag(None, "peak TFLOP/s of one GPU for MFU, for GPUs not in utils/metrics.py")


@dataclass(frozen=True)
class TracingArguments:
    _argument_group_name = "Chakra tracing"
    enable_tracing: bool = flag(False, "capture host and device traces of the same steps on every rank; the run "
                                       "stops after the trace window and the untraced steps timed after it unless "
                                       "--max-steps asks for more")
    trace_output_dir: str = flag("./outputs", "traces go to <trace-output-dir>/<trace-name>/ (default: %(default)s)")
    trace_name: Optional[str] = flag(None, "this run's trace folder (default: <model>_<N>gpu, or <model>_<N>cpu)")
    trace_wait_steps: Optional[int] = flag(None, "steps run untraced before warm-up; all but the first are timed, "
                                                 f"to take the profiler's cost out (default: {DEFAULT_WAIT_STEPS})")
    trace_warmup_steps: Optional[int] = flag(None, "steps profiled but discarded, so start-up costs stay out of the "
                                                   f"trace (default: {DEFAULT_WARMUP_STEPS})")
    trace_active_steps: Optional[int] = flag(None, "steps recorded; the .et holds their median step (default: "
                                                   f"{DEFAULT_ACTIVE_STEPS})")
    trace_after_steps: Optional[int] = flag(None, "steps run untraced after the window and timed as the wait steps "
                                                  "are, so the untraced pace is sampled on both sides of the window "
                                                  "(default: as many as the wait steps, at least 1)")

    def window(self, max_steps: Optional[int]) -> "tuple[int, int, int]":
        """(wait, warmup, active) steps: the flags given, the defaults for the others; a --max-steps shorter than the
        default window shrinks the defaults to fit it, down to SHORTEST_WINDOW (a short run still gets a trace, with
        fewer timed steps). A window that still does not fit is refused (RunConfig)."""
        given = (self.trace_wait_steps, self.trace_warmup_steps, self.trace_active_steps)
        wait, warmup, active = (value if value is not None else default for value, default in
                                zip(given, (DEFAULT_WAIT_STEPS, DEFAULT_WARMUP_STEPS, DEFAULT_ACTIVE_STEPS)))
        least_wait, least_warmup, least_active = (value if value is not None else least
                                                  for value, least in zip(given, SHORTEST_WINDOW))
        if max_steps is not None and max_steps < wait + warmup + active:
            if given[2] is None:
                active = max(least_active, min(active, max_steps - least_wait - least_warmup))
            if given[0] is None:
                wait = max(least_wait, min(wait, max_steps - active - least_warmup))
            if given[1] is None:
                warmup = max(least_warmup, min(warmup, max_steps - active - wait))
        return wait, warmup, active


@dataclass(frozen=True)
class RunConfig:
    """Every flag of a training run, grouped as in --help; checked once when built, never changed after."""

    model: ModelArguments
    data: DataArguments
    optim: OptimizationArguments
    checkpoint: CheckpointArguments
    devices: DeviceArguments
    tracing: TracingArguments

    def __post_init__(self):
        for name, value in self.flags().items():
            if name in MINIMUM and value is not None and value < MINIMUM[name]:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least {MINIMUM[name]}, got {value}")
            if name in MAXIMUM and value is not None and value > MAXIMUM[name]:
                raise ConfigError(f"--{name.replace('_', '-')} must be at most {MAXIMUM[name]}, got {value}")
        if not 0 < self.data.validation_fraction < 1:
            raise ConfigError(f"--validation-fraction must be between 0 and 1, got {self.data.validation_fraction}")
        for name, value in (("learning-rate", self.optim.learning_rate), ("peak-tflops", self.devices.peak_tflops)):
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"--{name} must be a positive number, got {value}")
        for name, value in (("weight-decay", self.optim.weight_decay), ("max-grad-norm", self.optim.max_grad_norm)):
            if not math.isfinite(value):
                raise ConfigError(f"--{name} must be a number, got {value}")
        problem = folder_name_problem(self.tracing.trace_name)
        if problem:
            raise ConfigError(f"--trace-name {self.tracing.trace_name!r}: {problem}; give a plain folder name, made "
                              "inside --trace-output-dir")
        max_steps, window = self.optim.max_steps, self.trace_window
        if self.tracing.enable_tracing and max_steps is not None and max_steps < sum(window):
            shortest = ("; the shortest default window: one untraced step timed after the run's first, one warm-up "
                        "step and one traced step" if window == SHORTEST_WINDOW else "")
            raise ConfigError(f"--max-steps {max_steps} is shorter than the trace window of {sum(window)} steps (wait "
                              f"{window[0]} + warmup {window[1]} + active {window[2]}{shortest}); raise --max-steps "
                              "or lower the --trace-*-steps")

    @property
    def trace_window(self) -> "tuple[int, int, int]":
        return self.tracing.window(self.optim.max_steps)

    @property
    def trace_after_steps(self) -> int:
        """Untraced steps timed after the window: --trace-after-steps, else as many as the wait steps and at least one
        (wait 0 times none before the window). Not part of the window: a --max-steps that ends the run sooner leaves
        the tracer fewer to time."""
        after = self.tracing.trace_after_steps
        return after if after is not None else max(1, self.trace_window[0])

    def after_steps_reached(self, start_step: int = 0) -> int:
        """Of the untraced steps to time after the window, those the run reaches: a --max-steps that ends the run
        sooner leaves fewer (start_step: the step a resumed run continues after)."""
        after = self.trace_after_steps
        if self.optim.max_steps is not None:
            after = max(0, min(after, self.optim.max_steps - start_step - sum(self.trace_window)))
        return after

    def timed_untraced_steps(self, start_step: int = 0) -> int:
        """Untraced steps the tracer times that the conversion uses: the wait steps but the run's first, and the
        steps after the window that the run reaches."""
        return max(0, self.trace_window[0] - 1) + self.after_steps_reached(start_step)

    def planned_steps(self, steps_per_epoch: int, start_step: int = 0) -> int:
        """--max-steps, else --test's 10 (longer if the trace window needs it), else the trace window and the untraced
        steps timed after it, else epochs. The tracer starts counting at the run's first step: a traced run resumed
        at start_step runs its window and after-steps from there (it had stopped at the window's length from step 0,
        a run resumed at step 10 tracing steps 22-24 of 24 and timing none of its after-steps)."""
        if self.optim.max_steps is not None:
            return self.optim.max_steps
        window = start_step + sum(self.trace_window) + self.trace_after_steps if self.tracing.enable_tracing else 0
        return max(TEST_MODE_STEPS, window) if self.optim.test else window or self.optim.num_epochs * steps_per_epoch

    def flags(self) -> "dict[str, Any]":
        """{flag name with underscores: value} of every flag, as given or defaulted."""
        return {name: value for group in (self.model, self.data, self.optim, self.checkpoint, self.devices,
                                          self.tracing) for name, value in asdict(group).items()}


def folder_name_problem(name: Optional[str]) -> Optional[str]:
    """Why `name` cannot be a folder made inside another (a path, '.', '..', hidden, empty), or None if it can. A
    trace name that escaped --trace-output-dir would let the tracer's clean-up of <trace-output-dir>/.previous/<name>
    reach the run's own folder, or any other."""
    if name is None:
        return None
    if not name.strip():
        return "empty"
    if any(sep and sep in name for sep in ("/", "\\", os.sep, os.altsep)):
        return "a path, not a folder name"
    if name.startswith("."):
        return "starts with '.'"
    return None


@dataclass(frozen=True)
class RunSettings:
    """What the flags leave open, settled once before training (utils/trainer.py's settle_run): the model trained (a
    checkpoint's own with --resume-from), the name of its runs and traces, the precision, the sequence length (at most
    the model's positions). Device, rank and world size: DistributedContext (utils/distributed.py)."""

    model_name: str
    run_name: str
    precision: str
    max_seq_length: int
    resume_from: Optional[Path]


ARGUMENT_GROUPS = (ModelArguments, DataArguments, OptimizationArguments, CheckpointArguments, DeviceArguments,
                   TracingArguments)


class RunArgumentParser(HfArgumentParser):
    """HfArgumentParser whose refusals are one `error:` line (exit status 2), like every error of this project; under
    torchrun every rank parses the same flags, and rank 0 alone says what is wrong."""

    def error(self, message: str):
        line = f"{message} (see {self.prog} --help)"
        rank = os.environ.get("RANK", "0")
        if not rank.isdigit() or rank == "0":
            self.exit(2, f"error: {line}\n")
        wait_for_rank_zero_to_report(line, int(rank))
        self.exit(2)


def build_parser(family: str, description: str = "", size_names: Sequence[str] = ()) -> RunArgumentParser:
    """The parser of <family>/train.py: every flag, with the family's default --model-name and --save-dir."""
    info = family_info(family)
    parser = RunArgumentParser(ARGUMENT_GROUPS, prog=info.train_script, description=description or None,
                               formatter_class=argparse.HelpFormatter,
                               epilog=f"One process: python {info.train_script} ...; N processes: torchrun "
                                      f"--nproc_per_node=N {info.train_script} ... (see docs/TRAINING.md)")
    for action in parser._actions:  # one spelling per flag, the one the docs use (HfArgumentParser adds --a_b too)
        for option in [o for o in action.option_strings if "_" in o and len(action.option_strings) > 1]:
            action.option_strings.remove(option)
            del parser._option_string_actions[option]
    devices = next(g for g in parser._action_groups if g.title == DeviceArguments._argument_group_name)
    devices.add_argument("--no-compile", dest="compile", action="store_false", help="do not torch.compile (default)")
    parser.set_defaults(model_name=info.default_model, save_dir=f"./checkpoints/{info.name}")
    if size_names:
        parser._option_string_actions["--model-name"].help = (
            f"{', '.join(size_names)}, or a directory with a config.json (default: %(default)s)")
    return parser


def parse_run_config(family: str, argv: Optional[Sequence[str]] = None, *, description: str = "",
                     size_names: Sequence[str] = ()) -> RunConfig:
    """The flags of <family>/train.py; a refused value exits with one `error:` line and status 2."""
    parser = build_parser(family, description, size_names)
    given = vars(parser.parse_args(argv))
    try:
        return RunConfig(*(group(**{f.name: given[f.name] for f in fields(group)}) for group in ARGUMENT_GROUPS))
    except ConfigError as exc:
        parser.error(str(exc))
