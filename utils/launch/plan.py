"""The machine (the training Python, torch, GPUs, cores), the dataset, and the plan: one torchrun per model family and
GPU count, with the settings the machine decides."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from utils.data_files import EMPTY, SQUAD, sniff_data_file
from utils.families import FamilyInfo, family_info
from utils.launch.options import BUNDLED_DATASET, CPU_MODEL, CPU_SEQ_LENGTH, TEST_STEPS, Launcher, Options

ROOT = Path(__file__).resolve().parent.parent.parent
# CPU mode runs at most this many ranks unless the user names the counts (--num-gpus): more CPU ranks add minutes on
# a laptop and no new structure to the trace (the collectives are the same from two ranks on).
CPU_DEFAULT_MAX_RANKS = 2
# The probe's results travel to a background child in these variables; the tests describe machines with them.
PROBE_VARIABLES = ("LC_PROBE_TORCH", "LC_PROBE_GPUS", "LC_PROBE_CUDA", "LC_PROBE_BF16", "LC_PROBE_CORES",
                   "LC_PROBE_GPU_NAMES")
PROBE = """
import os, torch
cuda = torch.cuda.is_available()
count = torch.cuda.device_count() if cuda else 0
try:
    cores = len(os.sched_getaffinity(0))
except AttributeError:  # macOS
    cores = os.cpu_count() or 1
print(torch.__version__, count, torch.version.cuda or "none", int(bool(cuda and torch.cuda.is_bf16_supported())),
      cores, ";".join(torch.cuda.get_device_name(i) for i in range(count)), sep="\\n")
"""


class LaunchError(Exception):
    """A check that failed before anything ran; its message is already a full line (❌ ...)."""

    status = 1  # the launcher's exit status


class FlagsRefused(LaunchError):
    """train.py's parser refused a run's flags: a usage error, exit status 2 as train.py's own."""

    status = 2


@dataclass(frozen=True)
class Machine:
    python: str
    torch: str
    gpus: int
    cuda: str
    bf16: bool
    cores: int
    gpu_names: tuple

    def variables(self) -> dict:
        """The probe's results for a background child (LC_PROBED=1 skips its probe)."""
        values = (self.torch, self.gpus, self.cuda, int(self.bf16), self.cores, ";".join(self.gpu_names))
        return {"LC_PROBED": "1", "PYTHON": self.python, **dict(zip(PROBE_VARIABLES, map(str, values)))}


def probe_machine() -> Machine:
    """The machine as described by LC_PROBE_* (LC_PROBED=1), else the training Python's own report."""
    if os.environ.get("LC_PROBED") == "1":
        python, lines = os.environ.get("PYTHON", sys.executable), [os.environ.get(v, "") for v in PROBE_VARIABLES]
    else:
        found = subprocess.run(["bash", str(ROOT / "scripts" / "python_env.sh"), "train"], stdout=subprocess.PIPE,
                               text=True)
        if found.returncode != 0 or not found.stdout.strip():
            raise LaunchError("❌ PyTorch: no usable Python environment (see the messages above)")
        python = found.stdout.strip().splitlines()[-1]
        # stderr apart: warnings printed while importing torch must not shift the lines read here
        probe = subprocess.run([python, "-c", PROBE], capture_output=True, text=True)
        if probe.returncode != 0:
            raise LaunchError("\n".join([f"❌ PyTorch: '{python}' cannot import torch:",
                                         *probe.stderr.strip().splitlines()[-3:]]))
        lines = probe.stdout.split("\n")
    torch, gpus, cuda, bf16, cores, names = (lines + [""] * 6)[:6]
    return Machine(python, torch, int(gpus or 0), cuda or "none", bf16 == "1", int(cores or 1),
                   tuple(n for n in names.split(";") if n))


def report_machine(machine: Machine, opts: Options) -> str:
    """Prints one line per check; returns the device the runs use: gpu or cpu."""
    print(f"✅ PyTorch {machine.torch} importable ({machine.python})")
    if opts.cpu:
        print(f"ℹ️  CPU mode (--cpu): gloo, {machine.cores} CPU cores, {machine.gpus} GPUs left unused")
        return "cpu"
    if machine.gpus == 0:
        print(f"⚠️  CUDA: no GPU found: CPU mode (gloo, {machine.cores} CPU cores, {CPU_MODEL} model, fp32, no compile)")
        return "cpu"
    first = machine.gpu_names[0] if machine.gpu_names else "unknown"
    print(f"✅ CUDA {machine.cuda}: {machine.gpus} GPU(s) available ({first})")
    if opts.verbose:
        for i, name in enumerate(machine.gpu_names):
            print(f"   GPU {i}: {name}")
    return "gpu"


def size_text(path: Path) -> str:
    total = path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return f"{total // (1 << 20)} MB" if total >= 1 << 20 else f"{(total + 1023) // 1024} KB"


def dataset_arguments(path: Optional[str], device: str) -> list:
    """train.py's data flags for --dataset-path (or the default), after one line saying where the data comes from."""
    if path is None:
        bundled = ROOT / BUNDLED_DATASET
        if device == "cpu":
            if not bundled.is_file():
                raise LaunchError(f"❌ Dataset: the bundled {BUNDLED_DATASET} is missing; restore it (git checkout) "
                                  "or pass --dataset-path")
            print(f"✅ Dataset: {BUNDLED_DATASET} (bundled SQuAD sample, {size_text(bundled)})")
            return ["--squad-file", BUNDLED_DATASET]
        # Reaching the hub cannot be checked without waiting on the network; train.py falls back by itself.
        print(f"✅ Dataset: SQuAD from the HuggingFace hub or its cache; offline fallback {BUNDLED_DATASET} present"
              if bundled.is_file() else
              f"⚠️  Dataset: SQuAD from the HuggingFace hub or its cache; no offline fallback ({BUNDLED_DATASET} missing)")
        return []
    if os.path.isdir(path):
        corpus = sorted(Path(path).glob("*.jsonl"))
        if not corpus:
            raise LaunchError(f"❌ Dataset: {path} holds no *.jsonl file (--dataset-path)")
        print(f"✅ Dataset: {path} (folder of {len(corpus)} JSONL files)")
        return ["--dataset-path", path]
    if not os.path.isfile(path):
        raise LaunchError(f"❌ Dataset: {path} not found (--dataset-path)")
    if not os.access(path, os.R_OK):
        raise LaunchError(f"❌ Dataset: {path} is not readable (--dataset-path)")
    # By content, not by name: a corpus named .json or a SQuAD file named .jsonl goes to the reader that takes it.
    kind = sniff_data_file(Path(path))
    if kind == EMPTY:
        raise LaunchError(f"❌ Dataset: {path} is empty (--dataset-path)")
    if kind is None:  # train.py's reader says what is wrong with it
        squad = path.lower().endswith(".json")
        print(f"⚠️  Dataset: {path} is neither SQuAD JSON nor a JSONL corpus of {{\"text\": ...}} lines as far as "
              f"its start shows; passed as {'SQuAD JSON' if squad else 'a JSONL corpus'} (its suffix)")
    else:
        squad = kind == SQUAD
        print(f"✅ Dataset: {path} ({'SQuAD JSON' if squad else 'JSONL corpus'}, {size_text(Path(path))})")
    return ["--squad-file" if squad else "--dataset-path", path]


def check_folders(opts: Options) -> None:
    """Each folder the runs write (relative ones under the repository) can be made and written: found here, not by a
    rank after it has trained (or by the background start, as a traceback)."""
    folders = [("--output-dir", opts.output_dir)] if opts.trace else []
    for flag, text in folders + [("--save-dir", opts.save_dir), ("--logs-dir", opts.logs_dir)]:
        path = ROOT / text
        existing = path
        while not existing.exists() and not existing.is_symlink() and existing != existing.parent:
            existing = existing.parent
        if existing.is_symlink() and not existing.exists():
            raise LaunchError(f"❌ {flag} {text} cannot be made: {existing} is a link to {os.readlink(existing)}, "
                              "which does not exist")
        if not existing.is_dir():
            what = "is a file" if existing == path else f"cannot be made: {existing} is a file"
            raise LaunchError(f"❌ {flag} {text} {what}, not a folder")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise LaunchError(f"❌ {flag} {text} cannot be written: {existing} is not writable by this user")


def check_master_address(opts: Options) -> None:
    """--master-addr names a host this machine can resolve: torchrun would otherwise retry an unknown name for
    minutes (a warning every few seconds) before it gives up."""
    if not opts.master_addr:
        return
    try:
        socket.getaddrinfo(opts.master_addr, opts.master_port or 29500, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else "not a valid host name"
        raise LaunchError(f"❌ --master-addr {opts.master_addr}: this machine cannot resolve it ({reason}); give node "
                          f"0's IP address, or a host name in /etc/hosts or DNS") from None


# train.py's own parser on each run's flags, in the training Python (the launcher imports no transformers): a flag it
# refuses stops the launch here, before a background start detaches (that run had ended in its log, after the launcher
# had said it was running) and before the first of several runs imports torch to refuse it.
FLAG_CHECK = """
import json, sys
from utils.environment import require
require("training")
from utils.run_config import parse_run_config
for family, argv in json.loads(sys.argv[1]):
    parse_run_config(family, argv)
"""


def check_train_flags(plan: "Plan") -> None:
    """Every run's train.py flags pass train.py's parser (RunConfig's checks included), in one Python; a refusal
    raises FlagsRefused with train.py's own line."""
    argvs = []
    for run in plan.runs():
        flags = run.argv[run.argv.index(run.family.train_script) + 1:]
        if [run.family.name, flags] not in argvs:
            argvs.append([run.family.name, flags])
    if not argvs:
        return
    result = subprocess.run([plan.machine.python, "-c", FLAG_CHECK, json.dumps(argvs)], capture_output=True,
                            text=True, cwd=ROOT, env={**os.environ, "RANK": "0"})
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        said = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
        if said and result.returncode == 2:  # the parser's status
            raise FlagsRefused(f"❌ train.py refuses these flags: {said[-1]}")
        # the environment (require's line), or a traceback
        raise LaunchError("\n".join([f"❌ {plan.machine.python} could not check train.py's flags:",
                                     *(said[-1:] or lines[-3:])]))


def run_name(family: FamilyInfo, world: int, device: str, quick: bool) -> str:
    """<model>_<world size><gpu|cpu>[_quick_trace]: the trace, checkpoint and log folders' name."""
    return f"{family.name}_{world}{device}{'_quick_trace' if quick else ''}"


@dataclass(frozen=True)
class Run:
    """One torchrun: a family on nproc GPUs (or CPU ranks) per node."""

    family: FamilyInfo
    nproc: int
    name: str
    argv: list


@dataclass(frozen=True)
class Plan:
    """Everything derived from the options and the machine; nothing here changes once made."""

    launcher: Launcher
    opts: Options
    machine: Machine
    device: str  # gpu | cpu
    precision: str
    compile: bool
    max_seq_length: Optional[int]
    counts: tuple
    skipped: tuple  # (run name, why)
    dataset_args: list

    @property
    def families(self) -> list:
        return [family_info(name) for name in self.opts.models]

    def model_name(self, family: FamilyInfo) -> str:
        return self.opts.model_name or (CPU_MODEL if self.device == "cpu" else family.default_model)

    def runs(self) -> list:
        names = [(f, n, run_name(f, n * self.opts.nnodes, self.device, self.launcher.quick))
                 for f in self.families for n in self.counts]
        return [Run(f, n, name, torchrun_command(self, f, n, name)) for f, n, name in names]


def make_plan(launcher: Launcher, opts: Options, machine: Machine, device: str, dataset_args: list) -> Plan:
    """Settings for this device, and the counts to run; prints a line per family for each count skipped."""
    cpu = device == "cpu"
    precision = opts.precision or ("fp32" if cpu else "bf16" if machine.bf16 else "fp16")
    # Compiled graphs hide the eager operators a Chakra trace is made of, and compiling takes longer than a 10-step
    # run: compile only untraced training on GPUs.
    compile_ = opts.compile if opts.compile is not None else (not cpu and opts.mode == "train" and not opts.trace)
    seq = opts.max_seq_length or (CPU_SEQ_LENGTH if cpu else None)
    counts, skipped = [], []
    requested = opts.num_gpus or launcher.counts
    capacity = machine.cores if cpu else machine.gpus
    for count in requested:
        if cpu and not opts.num_gpus and count > CPU_DEFAULT_MAX_RANKS:
            why = f"CPU mode runs 1 and {CPU_DEFAULT_MAX_RANKS} ranks unless asked (--num-gpus " \
                  f"{','.join(map(str, requested))})"
        elif count > capacity and not cpu:
            why = f"this machine has {capacity} GPU(s)"
        elif count > capacity and machine.gpus == 0:
            why = f"this machine has no GPU, and {capacity} CPU cores for CPU ranks (one rank per core)"
        elif count > capacity:
            why = f"CPU mode runs one rank per core and this machine has {capacity}"
        else:
            counts.append(count)
            continue
        for name in opts.models:
            family = family_info(name)
            print(f"⏭️  Skipping {family.label} at {count} {'CPU ranks' if cpu else 'GPUs'}: {why}")
            skipped.append((run_name(family, count * opts.nnodes, device, launcher.quick), why))
    return Plan(launcher, opts, machine, device, precision, compile_, seq, tuple(counts), tuple(skipped), dataset_args)


def torchrun_command(plan: Plan, family: FamilyInfo, nproc: int, run_name: str) -> list:
    """env ... python -m utils.torchrun ... <family>/train.py <flags>: one run, as printed and as run."""
    opts = plan.opts
    argv = ["env", "PYTHONUNBUFFERED=1"]
    if plan.device == "cpu":
        # One rank per core; torchrun would otherwise force 1 thread only for nproc > 1.
        argv.append(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS') or max(1, plan.machine.cores // nproc)}")
    if opts.verbose:
        argv.append("LOGLEVEL=INFO")
    # utils.torchrun: torchrun ending in one line instead of a traceback when stopped or when a rank fails
    argv += [plan.machine.python, "-m", "utils.torchrun"]
    if opts.nnodes > 1 or opts.master_addr or opts.master_port:
        argv += [f"--nnodes={opts.nnodes}", f"--node_rank={opts.node_rank}",
                 f"--master_addr={opts.master_addr or 'localhost'}", f"--master_port={opts.master_port or 29500}"]
    else:
        argv.append("--standalone")  # a free port, so two launches on one machine never collide
    argv += [f"--nproc_per_node={nproc}", family.train_script, "--model-name", plan.model_name(family),
             "--num-gpus", str(nproc * opts.nnodes), "--batch-size", str(opts.batch_size)]
    if opts.mode == "test":
        # A quick run is an experiment run again and again: it replaces its own earlier checkpoints. Without
        # --max-steps, train.py's --test runs TEST_STEPS steps, or a traced run's whole window and the untraced steps
        # timed after it when those are more (a --max-steps 10 had left 1 of the 5 after-steps, and the untraced
        # median the .et is corrected towards came mostly from the run's first, warming-up steps)
        argv += (["--max-steps", str(opts.max_steps)] if opts.max_steps else ["--test"]) + ["--overwrite-output-dir"]
    else:
        argv += ["--num-epochs", str(opts.num_epochs)] + (["--max-steps", str(opts.max_steps)] if opts.max_steps else [])
    for flag, value in (("--learning-rate", opts.learning_rate), ("--max-seq-length", plan.max_seq_length),
                        ("--save-steps", opts.save_steps)):
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--precision", plan.precision, "--compile" if plan.compile else "--no-compile"]
    argv += [] if opts.save_initial else ["--no-save-initial"]
    argv += ["--save-dir", f"{opts.save_dir}/{run_name}", "--log-dir", f"{opts.logs_dir}/{run_name}",
             *plan.dataset_args]
    if opts.trace:
        argv += ["--enable-tracing", "--trace-output-dir", opts.output_dir, "--trace-name", run_name]
    return argv + (["--logging-steps", "1"] if opts.verbose else []) + opts.extra


def print_settings(plan: Plan) -> None:
    opts = plan.opts
    test_steps = f"{opts.max_steps} steps" if opts.max_steps else \
        "the trace window and the untraced steps timed after it" if opts.trace else f"{TEST_STEPS} steps"
    # train.py's rule: --max-steps, else a traced run's window and after-steps, else the epochs (the line had said
    # "1 epochs, at most 5000 steps" of a run that trained 5000 steps, and "3 epochs" of a traced run's 24)
    train_steps = f"{opts.max_steps} steps: --max-steps sets the length, not --num-epochs" if opts.max_steps else \
        f"the trace window and the untraced steps timed after it, not {opts.num_epochs} epochs: --trace; " \
        "--max-steps for more" if opts.trace else f"{opts.num_epochs} epochs"
    mode = f"test ({test_steps})" if opts.mode == "test" else f"train ({train_steps})"
    nodes = f" · nodes: {opts.nnodes} (this is node {opts.node_rank})" if opts.nnodes > 1 else ""
    default = "train.py default"
    print(f"""
📋 Run settings
   • mode: {mode}
   • models: {' '.join(f'{f.label}={plan.model_name(f)}' for f in plan.families)}
   • {'CPU ranks (gloo)' if plan.device == 'cpu' else 'GPUs'} per node: {' '.join(map(str, plan.counts)) or 'none'}{nodes}
   • batch size per rank: {opts.batch_size} · learning rate: {opts.learning_rate or default} · max sequence length: \
{plan.max_seq_length or default}
   • precision: {plan.precision} · torch.compile: {'on' if plan.compile else 'off'} · save every: \
{default if opts.save_steps is None else (f"{opts.save_steps} steps" if opts.save_steps else "never")} · initial model saved: {'yes' if opts.save_initial else 'no'}
   • tracing: {f'on, traces in {opts.output_dir}/<run name>/' if opts.trace else 'off'}
   • checkpoints: {opts.save_dir}/<run name>/ · logs: {opts.logs_dir}/<run name>/
   • execution: {'background (nohup)' if opts.background else 'foreground'}{', dry run' if opts.dry_run else ''}""")
    if opts.extra:
        print(f"   • passed to train.py: {' '.join(opts.extra)}")
