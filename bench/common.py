"""Shared by the benchmarks: child processes with wall time and peak memory, step-time logs, tables, versions."""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Iterable, Sequence

from utils.families import family_info

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_SQUAD = REPO_ROOT / "data" / "squad_sample.json"
# Our trainer's per-step log line (utils/trainer.py, Trainer._log_step), e.g.
# "step 3/10 | epoch 0.02 | loss 6.67 | lr 3.3e-05 | grad norm 10.8 | 95 tok/s | 537.6 ms/step | cpu 501.2 ms/step".
STEP_LINE = re.compile(r"\bstep (\d+)/(\d+) \|.*\| ([0-9][0-9.,]*) ms/step")
STEP_CPU = re.compile(r"\| cpu ([0-9][0-9.,]*) ms/step")  # the process's CPU time per step (absent in older logs)
OUR_LOG_FILE = "training_rank_0.log"


class BenchError(Exception):
    """The benchmark could not measure what it claims; said in one line, the command exits 1."""


@dataclass
class ChildRun:
    """One finished child process: its exit status, wall time and peak resident memory."""

    argv: list[str]
    returncode: int
    wall_s: float
    peak_rss_mb: float
    stdout: str
    stderr: str
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def reason(self) -> str:
        """The child's own last error line (or the last line it wrote), for a one-line failure message."""
        if self.timed_out:
            return "timed out"
        lines = [line.strip() for line in (self.stderr + "\n" + self.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if line.lower().startswith(("error", "traceback")) or "Error:" in line]
        last = errors[-1] if errors else (lines[-1] if lines else "no output")
        return f"exit status {self.returncode}: {last[:300]}"


# Forks the command, waits for it and writes its ru_maxrss (itself and the descendants it waited for) to argv[1];
# exits with the command's status (128 + N for a signal, as a shell does). Started with -S, it stays a few MB.
_REAPER = """
import os, sys
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    except OSError as e:
        sys.stderr.write(f"error: {sys.argv[2]}: {e}\\n")
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
code = os.waitstatus_to_exitcode(status)
os._exit(code if code >= 0 else 128 - code)
"""


def run_child(argv: Sequence[str], *, env: dict | None = None, cwd: str | Path = REPO_ROOT,
              cpus: Iterable[int] | None = None, timeout_s: float | None = None) -> ChildRun:
    """Run a command to its end; wall time, and peak RSS from the kernel's rusage of exactly this child.

    os.wait4 gives the rusage of the one process waited for (and the descendants it waited for), unlike
    RUSAGE_CHILDREN, which is the maximum over every child this process ever had. The command is started by a
    small reaper (_REAPER) that forks it and reports its wait4 peak: on Linux ru_maxrss survives fork and execve,
    so a command forked straight from this (large) process would report this process's memory as its own. `cpus`
    pins the child (and everything it starts) to those cores. The child gets its own process group, so a timeout
    stops torchrun's workers too.
    """
    argv = [str(a) for a in argv]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile("r", suffix=".maxrss") as peak_file:
        reaped = [sys.executable, "-S", "-c", _REAPER, peak_file.name, *argv]
        cores = set(cpus or ())  # none: the child runs where this process may
        pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
        started = time.perf_counter()
        process = subprocess.Popen(reaped, cwd=str(cwd), env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                   preexec_fn=pin, start_new_session=True)
        expired = threading.Event()

        def stop():
            expired.set()
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(timeout_s, stop) if timeout_s else None
        if timer:
            timer.start()
        try:
            _, status, usage = os.wait4(process.pid, 0)
        except BaseException:  # Ctrl-C or SIGTERM of the benchmark: take the child's whole group down with it
            stop()
            process.wait()
            raise
        finally:
            if timer:
                timer.cancel()
        wall = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode("utf-8", "replace")
        stderr = err.read().decode("utf-8", "replace")
        peak_text = peak_file.read().strip()
    maxrss = int(peak_text) if peak_text else usage.ru_maxrss  # empty only when the reaper itself was killed
    peak_mb = maxrss / (1 << 20) if sys.platform == "darwin" else maxrss / 1024
    return ChildRun(argv, process.returncode, wall, peak_mb, stdout, stderr, expired.is_set())


def one_core() -> int:
    """The core single-core measurements run on: the last one this process may use (core 0 takes interrupts)."""
    return max(os.sched_getaffinity(0))


def child_env(threads: int | None = None, **extra: str) -> dict:
    """The environment of a measured child: offline hub (the benchmarks use bundled data, so no network waits),
    the repository importable, torchrun's folders nowhere, and a fixed thread count when given."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + paths)
    if threads is not None:
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[name] = str(threads)
    # torchrun's --log-dir: nowhere, so a benchmark's torchrun runs leave no /tmp/torchelastic_* folder each (a
    # failure is read from the ranks' own output)
    env.setdefault("PET_LOG_DIR", os.devnull)
    env.update(extra)
    return env


def train_script(family: str) -> Path:
    """<family>/train.py of a registered family (utils/families.py), wherever its folder is importable from."""
    return Path(importlib.util.find_spec(family_info(family).train_module).origin)


def full_vocab_tokenizer(model: str, model_name: str, env: dict) -> "tuple[Path, int, str]":
    """bench/full_vocab_tokenizer.py in a child: (folder for --tokenizer-path, its size, a line saying what it is)."""
    run = run_child([sys.executable, REPO_ROOT / "bench" / "full_vocab_tokenizer.py", "--model", model,
                     "--model-name", model_name], env=env, timeout_s=1800)
    if not run.ok:
        raise BenchError(f"could not prepare the {model} {model_name} tokenizer: {run.reason()}")
    before, target, folder = run.stdout.strip().splitlines()[-1].split(" ", 2)
    if int(before) < int(target):
        note = (f"tokenizer: the trainer's offline stand-in ({int(before):,} tokens) padded with unused tokens to "
                f"{int(target):,}, so {model} {model_name} has its published size")
    else:
        note = f"tokenizer: {int(before):,} tokens ({folder})"
    return Path(folder), max(int(before), int(target)), note


def our_step_times(log_dir: Path) -> dict[int, float]:
    """{optimizer step (1-based): seconds} from our trainer's rank-0 log, written with --logging-steps 1."""
    path = Path(log_dir) / OUR_LOG_FILE
    if not path.is_file():
        raise BenchError(f"{path}: our trainer wrote no log, so its step times are unknown")
    times = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        match = STEP_LINE.search(line)
        if match:
            times[int(match.group(1))] = float(match.group(3).replace(",", "")) / 1000.0
    if not times:
        raise BenchError(f"{path}: no 'step N/M | ... | X ms/step' lines; has utils/trainer.py's log format changed?")
    return times


def steps_between(times: dict[int, float], first: int, last: int, what: str) -> list[float]:
    """The step times of steps first..last (1-based, inclusive); BenchError when any is missing."""
    missing = [s for s in range(first, last + 1) if s not in times]
    if missing:
        raise BenchError(f"{what}: no step time for step(s) {missing[:5]} (the run logged {len(times)} steps)")
    return [times[s] for s in range(first, last + 1)]


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (readable in a terminal, pasteable into docs/BENCHMARKS.md); numbers right-aligned."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [all(_looks_numeric(row[i]) for row in cells[1:]) and len(cells) > 1 for i in range(len(headers))]

    def line(row):
        return "| " + " | ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(row, widths, numeric)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if n else ("-" * (w + 2)) for w, n in zip(widths, numeric)) + "|"
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


def _looks_numeric(text: str) -> bool:
    return bool(re.fullmatch(r"[-+]?[0-9][0-9.,]*\s*(x|%|s|ms|MB)?|n/a|-", text.strip()))


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_description(packages: Sequence[str] = ("torch", "transformers", "accelerate", "mlc-chakra")) -> str:
    """CPU model, cores, load, Python and package versions: the context every result needs."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), cpu)
    except OSError:
        pass
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    versions = ", ".join(f"{p} {package_version(p)}" for p in packages)
    huge_pages = transparent_huge_pages()
    pages = f"; transparent huge pages: {huge_pages}" if huge_pages else ""
    return (f"machine: {cpu}; {len(os.sched_getaffinity(0))} usable of {os.cpu_count()} cores; load average "
            f"{load} (1/5/15 min){pages}; Python {platform.python_version()}; {versions}")


def source_revision(root: Path = REPO_ROOT) -> str:
    """The commit of the code a result was measured with ("bb75604", "bb75604 with uncommitted changes"), or why
    there is none: results of one benchmark taken with other converters differ for that reason alone."""
    def git(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(root), *argv], capture_output=True, text=True, check=False)
    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return "not a git checkout"
        # the documentation a run writes its results into is no change to the code it measured
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)*.md").stdout.strip()
    except OSError:
        return "unknown (no git)"
    return head.stdout.strip() + (" with uncommitted changes" if changed else "")


def transparent_huge_pages(setting: Path = Path("/sys/kernel/mm/transparent_hugepage/enabled")) -> str | None:
    """The kernel's transparent huge page mode (the bracketed word of "always [madvise] never"), or None where the
    kernel does not say. Memory-bound steps run at another pace under another mode (docs/BENCHMARKS.md §4b), so a
    result names the mode it was measured in."""
    try:
        chosen = re.search(r"\[(\w+)\]", setting.read_text(encoding="utf-8"))
    except OSError:
        return None
    return chosen.group(1) if chosen else None


def below_minimum(args, minimums: Sequence[tuple[str, float]]) -> str | None:
    """'--flag N: must be at least M' for the first (attribute, least) in minimums whose parsed value is below its
    least; None when every one is at least that."""
    for name, least in minimums:
        value = getattr(args, name)
        if value < least:
            return f"--{name.replace('_', '-')} {value}: must be at least {least}"
    return None


_NOT_GIVEN = object()


def quick_settings(parser: argparse.ArgumentParser, argv: Sequence[str] | None, args: argparse.Namespace,
                   settings: dict) -> None:
    """--quick's smaller settings put into args, each only where the command line did not give that flag itself
    (--quick had overridden them: `--quick --ranks 4` ran 8 and 64 ranks). The command line (argv, or sys.argv's as
    parse_args takes None) is parsed again into a namespace preset to a marker: argparse leaves a preset attribute
    alone unless its flag is given."""
    given = parser.parse_args(argv, namespace=argparse.Namespace(**{name: _NOT_GIVEN for name in settings}))
    for name, value in settings.items():
        if getattr(given, name) is _NOT_GIVEN:
            setattr(args, name, value)


def exit_on_sigterm() -> None:
    """SIGTERM ends the benchmark like Ctrl-C does: children stopped, scratch folders removed (finally blocks run)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def foreign_checkout(script: str) -> str | None:
    """Why `script` (a bench script's __file__) would run another checkout's code, or None. Run by its path
    (`python bench/x.py`), a script imports the package `bench` from wherever the environment installed it: an
    editable install of another checkout (a worktree sharing one virtual environment) gives that checkout's
    REPO_ROOT, and with it its trainer and converter, while the results would be read as this one's."""
    own = Path(script).resolve().parent.parent
    if own == REPO_ROOT:
        return None
    name = Path(script).stem
    return (f"bench/{name}.py of {own} imports the bench package of {REPO_ROOT} (an editable install of that "
            f"checkout), so it would run that checkout's code; run it from {own} as `python -m bench.{name}`, or "
            f"with PYTHONPATH={own}")


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


class WorkFolder:
    """Where a benchmark's runs write their logs, traces and .et files: the --keep folder, which stays, or a new
    temporary one, removed when the benchmark ends, except after a failure: `fail` (or an exception other than an
    interrupt) keeps it and says where, so the logs its error line names are still there to read (the folder had been
    removed before the line was printed)."""

    def __init__(self, keep: str | Path | None, prefix: str) -> None:
        self.kept = keep is not None
        self.path = Path(keep) if keep is not None else Path(tempfile.mkdtemp(prefix=prefix))
        self.path.mkdir(parents=True, exist_ok=True)
        self.failed = False

    def fail(self, message: str) -> int:
        """fail(message), the temporary folder kept and named in the same line."""
        self.failed = True
        return fail(message if self.kept else f"{message} (the runs' files are kept in {self.path})")

    def __enter__(self) -> "WorkFolder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.kept:
            return
        if exc_type is not None and not issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
            self.failed = True
            print(f"note: the runs' files are kept in {self.path}", file=sys.stderr)
        if not self.failed:
            shutil.rmtree(self.path, ignore_errors=True)
