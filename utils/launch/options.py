"""The launchers' options: what each run_*.sh runs by default, --help, and the parser (errors name the flag)."""
from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from utils.errors import UsageError
from utils.families import FAMILIES, family_info

CPU_MODEL = "tiny"
CPU_SEQ_LENGTH = 128
BUNDLED_DATASET = "data/squad_sample.json"
TEST_STEPS = 10
PID_FILE, CONSOLE_LOG = "training.pid", "training_console.log"


@dataclass(frozen=True)
class Launcher:
    """What one run_*.sh runs when the user names nothing: traced --test runs in the foreground (quick), or
    training in the background."""

    script: str
    families: tuple
    counts: tuple
    quick: bool
    positional: bool = False  # [NUM_GPUS] [BATCH_SIZE], as in ./run_gpt2.sh 8 4
    convert: bool = False     # convert_to_et.py on the traces afterwards

    @property
    def title(self) -> str:
        labels = " and ".join(family_info(name).label for name in self.families)
        counts = ", ".join(str(c) for c in self.counts[:-1]) + f" and {self.counts[-1]}" if len(self.counts) > 1 \
            else "1 (or NUM_GPUS)"
        if self.quick:
            then = ", then conversion to .et" if self.convert else ""
            return f"{labels} profiling: short traced runs at {counts} GPUs{then}"
        return f"{labels} training at {counts} GPUs (full training, background by default)"


LAUNCHERS = {launcher.script: launcher for launcher in (
    Launcher("run_all_profiling.sh", ("gpt2", "bert"), (1, 2, 4), quick=True, convert=True),
    Launcher("run_gpt2_quick.sh", ("gpt2",), (1, 2, 4), quick=True),
    Launcher("run_bert_quick.sh", ("bert",), (1, 2, 4), quick=True),
    Launcher("run_all_experiments.sh", ("gpt2", "bert"), (1, 2, 8), quick=False),
    Launcher("run_gpt2.sh", ("gpt2",), (1,), quick=False, positional=True),
    Launcher("run_bert.sh", ("bert",), (1,), quick=False, positional=True),
)}


def usage(launcher: Launcher) -> str:
    quick = launcher.quick
    default = {True: " (default)", False: ""}
    synopsis = f"./{launcher.script}{' [NUM_GPUS] [BATCH_SIZE]' if launcher.positional else ''} [options]"
    text = f"""{launcher.title}

Usage:
  {synopsis}     runs named <model>_<N>gpu{'_quick_trace' if quick else ''} (cpu instead of gpu without a GPU)

Mode:
  --test                  short run of {TEST_STEPS} optimizer steps, or of the trace window and the
                          untraced steps timed after it when tracing{default[quick]}
  --train                 full training for --num-epochs epochs{default[not quick]}
  --max-steps N           stop after N optimizer steps (with --test: instead of {TEST_STEPS})
  --num-epochs N          epochs in --train mode (default: 3)
  --trace / --no-trace    Chakra tracing (default: {'on' if quick else 'off'});
                          a traced run stops after the trace window (and the untraced steps timed
                          after it) unless --max-steps asks for more

Hyperparameters:
  --models NAME[,NAME...] model families, registered in utils/families.py (default: {','.join(launcher.families)};
                          known: {', '.join(FAMILIES)})
  --model-name NAME       gpt2, gpt2-medium, bert-base-uncased, tiny, a local model folder, ...
                          (default: {' / '.join(family_info(n).default_model for n in launcher.families)} on GPUs, \
{CPU_MODEL} on the CPU; applies to every model)
  --batch-size N          batch size per rank (default: 4)
  --learning-rate LR      (default: train.py's, 5e-5)
  --max-seq-length N      (default: train.py's on GPUs, {CPU_SEQ_LENGTH} on the CPU)
  --save-steps N          checkpoint every N steps, 0 for none (default: train.py's)
  --precision P           bf16, fp16 or fp32 (default: bf16 on GPUs that support it, else fp16; fp32 on the CPU)
  --bf16 / --fp16 / --fp32  the same as --precision P
  --compile / --no-compile  torch.compile (default: on for --train on GPUs, off for traced and CPU runs)
  --no-save-initial       do not save initial_model/ (default for quick runs)

Devices:
  --num-gpus N[,N...]     GPUs (or CPU ranks) per node; a list runs each count in turn
                          (default: {','.join(str(c) for c in launcher.counts)})
  --cpu                   run on the CPU with gloo, even when GPUs are present (automatic without a GPU)
  --nnodes N              multi-node: number of nodes (default: 1)
  --node-rank R           multi-node: this node's rank, 0..N-1
  --master-addr HOST      multi-node: address of node 0 (required with --nnodes > 1)
  --master-port PORT      rendezvous port (default: 29500 with --nnodes > 1, a free port on one node)

Data and outputs:
  --dataset-path PATH     a SQuAD JSON file (*.json), a JSONL corpus of {{"text": ...}} lines, or a folder of *.jsonl
                          (default: SQuAD from the HuggingFace hub on GPUs, which falls back to the bundled
                          {BUNDLED_DATASET} offline; the bundled sample on the CPU)
  --output-dir DIR        traces go to DIR/<run name>/ (default: ./outputs)
  --save-dir DIR          checkpoints go to DIR/<run name>/ (default: ./checkpoints)
  --logs-dir DIR          per-rank logs in DIR/<run name>/, background PID and console log in DIR (default: ./logs)

Execution:
  --foreground            run in this terminal{default[quick]}
  --background            run with nohup; PID in LOGS/{PID_FILE}, output appended to LOGS/{CONSOLE_LOG}{default[not quick]}
  --dry-run               check the environment, print the exact torchrun commands and stop
                          (with an explicit --background: rehearse the background start, commands go to the log)
  --verbose               more detail: device names, probe results, a log line every step
"""
    if launcher.convert:
        text += "  --no-convert            do not convert the traces to .et afterwards\n"
    return text + """  -h, --help              this help
  -- ARGS...              passed unchanged to train.py (e.g. -- --attn-implementation eager)

A count larger than the machine has (GPUs, or CPU cores in CPU mode) is skipped with a line saying so.
Exit status: 0 when no run failed (skipped counts are not failures), 1 when a run or the conversion failed,
2 for a bad option."""


@dataclass
class Options:
    """What the user asked for; None where the launcher's kind or the machine decides."""

    mode: Optional[str] = None  # test | train
    max_steps: Optional[int] = None
    num_epochs: int = 3
    trace: Optional[bool] = None
    models: Optional[tuple] = None
    model_name: Optional[str] = None
    batch_size: int = 4
    learning_rate: Optional[str] = None
    max_seq_length: Optional[int] = None
    save_steps: Optional[int] = None
    precision: Optional[str] = None
    compile: Optional[bool] = None
    save_initial: Optional[bool] = None
    num_gpus: Optional[tuple] = None
    cpu: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    dataset_path: Optional[str] = None
    output_dir: str = "outputs"
    save_dir: str = "checkpoints"
    logs_dir: str = "logs"
    background: Optional[bool] = None
    dry_run: bool = False
    verbose: bool = False
    convert: bool = False
    own_args: list = field(default_factory=list)  # the options before "--", for the background child
    extra: list = field(default_factory=list)     # after "--": passed to train.py


class ShowHelp(Exception):
    pass


def _matching(pattern: str, problem: str, convert=int):
    """A check of an option's text: its value, or ValueError(problem) when the whole text does not match pattern."""
    def check(text: str):
        if not re.fullmatch(pattern, text):
            raise ValueError(problem)
        return convert(text)
    return check


def _port(text: str) -> int:
    if not re.fullmatch(r"[1-9][0-9]*", text) or int(text) > 65535:
        raise ValueError("is not a port number (1-65535)")
    return int(text)


def _families(text: str) -> tuple:
    if any(name not in FAMILIES for name in text.split(",")):
        raise ValueError(f"is not a list of registered model families (known: {', '.join(FAMILIES)})")
    return _once_each(tuple(text.split(",")))


def _once_each(values: tuple) -> tuple:
    """A list flag's values, each at most once: a value twice would plan the same run twice, into the same folders
    (the launcher then found its own lock on the run and refused it as "already being run by another launcher")."""
    repeated = sorted({str(v) for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(f"names {', '.join(repeated)} more than once (each run would be made twice, into the same "
                         "folders)")
    return values


def _path(text: str) -> str:
    """Paths on the command line are relative to where the user stands, not to the repository."""
    return os.path.join(os.getcwd(), text)


def _model_name(text: str) -> str:
    return _path(text) if os.path.isfile(os.path.join(text, "config.json")) else text


_positive = _matching(r"[1-9][0-9]*", "is not a positive integer")
# option: (Options field, check of its text)
VALUE_OPTIONS = {
    "--max-steps": ("max_steps", _positive),
    "--num-epochs": ("num_epochs", _positive),
    "--models": ("models", _families),
    "--model-name": ("model_name", _model_name),
    "--batch-size": ("batch_size", _positive),
    "--learning-rate": ("learning_rate", _matching(r"[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?", "is not a number", str)),
    "--max-seq-length": ("max_seq_length", _positive),
    "--save-steps": ("save_steps", _matching("[0-9]+", "is not a non-negative integer (0: no checkpoints)")),
    "--precision": ("precision", _matching("bf16|fp16|fp32", "is not one of bf16, fp16, fp32", str)),
    "--num-gpus": ("num_gpus", _matching(r"[1-9][0-9]*(,[1-9][0-9]*)*", "is not a positive integer or a list like 1,2,4",
                                         lambda text: _once_each(tuple(map(int, text.split(",")))))),
    "--nnodes": ("nnodes", _positive),
    "--node-rank": ("node_rank", _matching("[0-9]+", "is not a non-negative integer")),
    "--master-addr": ("master_addr", str),
    "--master-port": ("master_port", _port),
    "--dataset-path": ("dataset_path", _path),
    "--output-dir": ("output_dir", _path),
    "--save-dir": ("save_dir", _path),
    "--logs-dir": ("logs_dir", _path),
}
# option: (Options field, value)
FLAGS = {
    "--test": ("mode", "test"), "--train": ("mode", "train"), "--trace": ("trace", True), "--no-trace": ("trace", False),
    "--bf16": ("precision", "bf16"), "--fp16": ("precision", "fp16"), "--fp32": ("precision", "fp32"),
    "--compile": ("compile", True), "--no-compile": ("compile", False), "--no-save-initial": ("save_initial", False),
    "--cpu": ("cpu", True), "--foreground": ("background", False), "--background": ("background", True),
    "--dry-run": ("dry_run", True), "--verbose": ("verbose", True), "--no-convert": ("convert", False),
}


def parse_options(launcher: Launcher, argv: list) -> Options:
    """The options in argv (UsageError naming the flag, ShowHelp for -h); the kind's defaults for the rest."""
    opts = Options(convert=launcher.convert)
    args, positionals = list(argv), []
    ours = args[:args.index("--")] if "--" in args else args
    if "-h" in ours or "--help" in ours:  # help wins wherever it stands, as with argparse
        raise ShowHelp
    while args:
        arg = args.pop(0)
        if arg == "--":
            opts.extra = args
            break
        opts.own_args.append(arg)
        opt, inline, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if opt in VALUE_OPTIONS:
            if not inline:
                value = args.pop(0) if args else ""
                opts.own_args.append(value)
                # `--output-dir --dry-run` lost its value: taking the next option as the value would run for real
                # into ./--dry-run. A value that starts with a dash can still be given as --output-dir=-x.
                if value == "--":
                    raise UsageError(f"{opt} needs a value")
                if re.match(r"--?[A-Za-z]", value):
                    raise UsageError(f"{opt} needs a value (got the option {value}; write {opt}={value} if you mean it)")
            if not value:
                raise UsageError(f"{opt} needs a value")
            name, check = VALUE_OPTIONS[opt]
            try:
                setattr(opts, name, check(value))
            except ValueError as exc:
                raise UsageError(f"{opt}: '{value}' {exc}") from None
        elif opt not in FLAGS and opt.startswith("--") and opt in train_flags():
            # the trainer's advice names its own flags (--resume-from, --overwrite-output-dir): it had been `unknown
            # option`, with nothing saying they go after --
            value = f" {args[0]}" if args and not inline and not args[0].startswith("-") else ""
            raise UsageError(f"{opt} is train.py's flag, not the launcher's: give it after --, as in "
                             f"./{launcher.script} ... -- {arg}{value}")
        elif inline:
            raise UsageError(f"{opt} takes no value ({arg})")
        elif opt in FLAGS and (opt != "--no-convert" or launcher.convert):
            setattr(opts, *FLAGS[opt])
        elif opt.startswith("-"):
            raise UsageError(f"unknown option: {opt}")
        elif launcher.positional:
            positionals.append(opt)
        else:
            raise UsageError(f"unexpected argument: {opt}")
    _take_positionals(opts, positionals)
    if opts.nnodes > 1 and not opts.master_addr:
        raise UsageError(f"--nnodes {opts.nnodes} needs --master-addr (the address of node 0)")
    if opts.node_rank >= opts.nnodes:
        raise UsageError(f"--node-rank {opts.node_rank} must be below --nnodes {opts.nnodes}")
    kind = dict(mode="test", trace=True, save_initial=False, background=False) if launcher.quick else \
        dict(mode="train", trace=False, save_initial=True, background=True)
    for name, value in kind.items():
        if getattr(opts, name) is None:
            setattr(opts, name, value)
    if opts.models is None:
        opts.models = launcher.families
    return opts


def train_flags() -> set:
    """train.py's flags, read from the fields of utils/run_config.py's *Arguments dataclasses without importing it
    (it needs transformers; the launcher runs under any python3)."""
    source = Path(__file__).resolve().parent.parent / "run_config.py"
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return set()
    return {"--" + node.target.id.replace("_", "-")
            for cls in tree.body if isinstance(cls, ast.ClassDef) and cls.name.endswith("Arguments")
            for node in cls.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            and not node.target.id.startswith("_")}


def _take_positionals(opts: Options, positionals: list) -> None:
    """[NUM_GPUS] [BATCH_SIZE] of run_gpt2.sh and run_bert.sh."""
    if len(positionals) > 2:
        raise UsageError(f"too many arguments: {' '.join(positionals)} (expected [NUM_GPUS] [BATCH_SIZE])")
    for name, text in zip(("NUM_GPUS", "BATCH_SIZE"), positionals):
        try:
            value = _positive(text)
        except ValueError as exc:
            raise UsageError(f"{name}: '{text}' {exc}") from None
        if name == "BATCH_SIZE":
            opts.batch_size = value
        elif opts.num_gpus:
            raise UsageError("NUM_GPUS given twice (positional and --num-gpus)")
        else:
            opts.num_gpus = (value,)
