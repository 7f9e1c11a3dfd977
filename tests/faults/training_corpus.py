"""Training-side fault corpus: each case breaks a tiny run the way a hostile user or a failing machine would,
runs gpt2/train.py or bert/train.py on it, and names the outcome.

    python tests/faults/training_corpus.py [--only CASE ...] [--keep DIR]

prints one line per case and the count of each outcome; `run_cases()` returns the same as a list of
{"case", "outcome", "message"} so the training and conversion corpora (tests/faults/conversion_corpus.py) can be
counted together. Outcomes, worst first:

    code executed       loading a checkpoint ran code planted in it
    lost data           a run's checkpoints were replaced or lost, or steps were trained only to be thrown away
    wrong-ok            a fault reported as success (exit status 0)
    traceback           a raw Python traceback instead of a message
    unclear             no `error:` line, or one that does not name what is wrong
    partial files left  a half-written folder of a dead process stays behind
    clear message       one `error:` line naming the file or flag, non-zero exit status
    handled             the documented recovery (a stale lock taken over, a signal's checkpoint, ...)

The cases build their inputs from two tiny reference runs (seconds each); read-only folders and a full disk are
real mounts in a private mount namespace (`unshare -m`, as root), or chmod for the read-only ones otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO_ROOT = Path(__file__).resolve().parents[2]

# Small and fast: 64-token sequences, two validation batches, no metric sink.
TINY = ["--model-name", "tiny", "--max-seq-length", "64", "--batch-size", "4", "--report-to", "none",
        "--eval-batches", "2", "--logging-steps", "1"]
LONG_RUN = ["--max-steps", "400", "--save-steps", "0", "--eval-steps", "0", "--no-save-initial"]
LOCK_FILE = ".training.lock"  # utils/checkpointing.py's name for the --save-dir lock
TOKENIZER_CACHE = REPO_ROOT / "data" / "tokenizers"  # utils/tokenization.py's TRAINED_TOKENIZER_CACHE

OUTCOMES = ("code executed", "lost data", "wrong-ok", "traceback", "unclear", "partial files left",
            "clear message", "handled")
BAD_OUTCOMES = OUTCOMES[:6]


# ---- running the trainer ------------------------------------------------------------------------------------------
@dataclass
class Run:
    status: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list:
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]

    @property
    def has_traceback(self) -> bool:
        text = self.stdout + self.stderr
        return "Traceback (most recent call last)" in text or "--- Logging error ---" in text

    def trained_steps(self) -> int:
        return len(re.findall(r"^step \d+/", self.stdout, re.M))


def default_signals() -> None:
    """In the child: Ctrl-C acts as in a terminal even when this script runs as a background job (SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def child_env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))


def train_command(family: str, save_dir: Path, log_dir: Path, *flags) -> list:
    return [sys.executable, str(REPO_ROOT / family / "train.py"), *TINY, "--save-dir", str(save_dir),
            "--log-dir", str(log_dir), *map(str, flags)]


def torchrun_command(launcher: list, family: str, save_dir: Path, log_dir: Path, *flags) -> list:
    """`launcher` is [python, -m, torch.distributed.run] (what users type) or [python, -m, utils.torchrun]."""
    return [*launcher, "--nproc_per_node=2", "--standalone",
            *train_command(family, save_dir, log_dir, *flags)[1:]]


def launcher_command(family: str, folder: Path, *train_flags, ranks: int = 2, max_steps: int = 400) -> list:
    """./run_<family>.sh in the foreground on `ranks` CPU ranks (through `python -m utils.torchrun`, as users start
    multi-rank runs): checkpoints in folder/ckpt/<run name>/, logs in folder/logs/<run name>/; `train_flags` go to
    train.py."""
    return ["env", f"PYTHON={sys.executable}", str(REPO_ROOT / f"run_{family}.sh"), "--cpu", "--foreground",
            "--num-gpus", str(ranks), "--model-name", "tiny", "--max-seq-length", "64", "--batch-size", "4",
            "--max-steps", str(max_steps), "--no-save-initial", "--save-dir", str(folder / "ckpt"),
            "--logs-dir", str(folder / "logs"), "--", "--report-to", "none", "--eval-batches", "2",
            "--logging-steps", "1", *map(str, train_flags)]


def run(command: list, *, prefix: tuple = (), timeout: float = 600, signals: tuple = (),
        when: Optional[str] = None, delay: float = 0.0, wait_for_start: Optional[Callable] = None,
        to_leader: tuple = ()) -> Run:
    """Run a command to its end; with `signals`, send them to its process group (as a terminal's Ctrl-C does) once
    `when` (a regex) appears in its output, or after `delay` seconds; then `to_leader` to the command's own process
    only (as a launcher passes a signal on to torchrun)."""
    with tempfile.TemporaryDirectory() as scratch:
        out_path, err_path = Path(scratch) / "out", Path(scratch) / "err"
        with open(out_path, "w") as out, open(err_path, "w") as err:
            process = subprocess.Popen([*prefix, *command], cwd=REPO_ROOT, env=child_env(), stdout=out, stderr=err,
                                       start_new_session=True, preexec_fn=default_signals)
            if signals:
                started = time.monotonic()
                while process.poll() is None and time.monotonic() - started < timeout:
                    text = out_path.read_text(errors="replace") + err_path.read_text(errors="replace")
                    if (when and re.search(when, text, re.M)) or (not when and time.monotonic() - started >= delay):
                        break
                    time.sleep(0.05)
                for number in signals:
                    if process.poll() is None:
                        os.killpg(process.pid, number)
                    time.sleep(0.3)
                for number in to_leader:
                    if process.poll() is None:
                        process.send_signal(number)
                    time.sleep(0.3)
            try:
                status = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                status = process.wait()
        return Run(status, out_path.read_text(errors="replace"), err_path.read_text(errors="replace"))


def start(command: list, log: Path) -> subprocess.Popen:
    handle = open(log, "w")
    return subprocess.Popen(command, cwd=REPO_ROOT, env=child_env(), stdout=handle, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=default_signals)


# ---- fault builders (the tests use them too) ---------------------------------------------------------------------
class RunsShellCommand:
    """Pickles as a call of os.system: what a hostile checkpoint's .pt file holds."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def write_code_running_pickle(path: Path, marker: Path) -> None:
    """A .pt file whose unpickling (torch.load with weights_only=False) creates `marker`."""
    import torch
    torch.save({"step": 1, "payload": RunsShellCommand(f"touch {shlex.quote(str(marker))}")}, path)


def truncate(path: Path, keep: float = 0.5) -> None:
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:int(len(data) * keep)])


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def write_lock_file(save_dir: Path, pid: int, host: Optional[str] = None) -> Path:
    path = Path(save_dir) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "started": "2024-01-01T00:00:00",
                                "command": "gpt2/train.py"}) + "\n")
    return path


def can_mount() -> bool:
    """Root with unshare: real read-only and size-limited mounts in a private mount namespace."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


def read_only_prefix(folder: Path) -> tuple:
    """Command prefix that runs the command with `folder` bind-mounted read-only (a private mount namespace)."""
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"'
    return ("unshare", "-m", "sh", "-c", script, str(folder))


def small_disk_prefix(folder: Path, size: str) -> tuple:
    """Command prefix that runs the command with a tmpfs of `size` mounted on `folder` (a private namespace)."""
    return ("unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size={size} tmpfs "$0" && exec "$@"', str(folder))


def training_info(checkpoint: Path) -> dict:
    return json.loads((Path(checkpoint) / "training_info.json").read_text())


# ---- outcomes ---------------------------------------------------------------------------------------------------
@dataclass
class Verdict:
    outcome: str
    message: str


def first_line(run_: Run) -> str:
    lines = run_.error_lines or [l for l in run_.stderr.splitlines() if l.strip()] or [f"exit status {run_.status}"]
    return lines[0][:300]


def judge(run_: Run, *, expect, mention: tuple = (), lost: Optional[str] = None, code_ran: bool = False,
          left: Optional[str] = None, must_not_train: bool = False) -> Verdict:
    """expect "error": one `error:` line naming every string of `mention`, non-zero status.
    expect an int: that exit status (0 for a run that should succeed), with every `mention` on the console."""
    if code_ran:
        return Verdict("code executed", first_line(run_))
    if lost:
        return Verdict("lost data", lost)
    if must_not_train and run_.trained_steps():
        return Verdict("lost data", f"trained {run_.trained_steps()} step(s) before failing: {first_line(run_)}")
    if expect == "error" and run_.status == 0:
        return Verdict("wrong-ok", "exit status 0: " + (run_.stdout.strip().splitlines() or [""])[-1][:200])
    if run_.has_traceback:
        lines = [l for l in run_.stderr.splitlines() if l.strip() and not l.startswith(" ")]
        return Verdict("traceback", (lines[-1] if lines else "Traceback")[:300])
    if expect == "error":
        if not run_.error_lines:
            return Verdict("unclear", f"no error line (exit status {run_.status}): {first_line(run_)}")
        missing = [m for m in mention if m not in run_.error_lines[0]]
        if missing:
            return Verdict("unclear", f"does not name {', '.join(missing)}: {run_.error_lines[0][:300]}")
    else:
        if run_.status != expect:
            return Verdict("unclear", f"exit status {run_.status}, expected {expect}: {first_line(run_)}")
        console = run_.stdout + run_.stderr
        missing = [m for m in mention if m not in console]
        if missing:
            return Verdict("unclear", f"does not say {', '.join(missing)}: {first_line(run_)}")
    if left:
        return Verdict("partial files left", left)
    if expect == "error":
        return Verdict("clear message", first_line(run_))
    console = (run_.stdout + run_.stderr).splitlines()
    said = [line for line in console for m in mention if m in line] or console[-1:] or [f"exit status {run_.status}"]
    return Verdict("handled", said[0][:300])


# ---- the cases ----------------------------------------------------------------------------------------------------
@dataclass
class Workspace:
    root: Path
    gpt2: Path = field(init=False)   # save dir of a finished 2-step tiny GPT-2 run
    bert: Path = field(init=False)   # and of a tiny BERT run

    def __post_init__(self):
        self.gpt2, self.bert = self.root / "ref-gpt2" / "ckpt", self.root / "ref-bert" / "ckpt"

    def build(self) -> None:
        for family, save_dir in (("gpt2", self.gpt2), ("bert", self.bert)):
            if (save_dir / "final_model").is_dir():
                continue
            done = run(train_command(family, save_dir, save_dir.parent / "logs", "--max-steps", "2", "--save-steps", "1"))
            if done.status != 0:
                raise RuntimeError(f"reference {family} run failed:\n{done.stderr[-3000:]}")

    def case_dir(self, name: str) -> Path:
        folder = self.root / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        return folder

    def checkpoint_copy(self, name: str, family: str = "gpt2", checkpoint: str = "checkpoint-1") -> "tuple[Path, Path]":
        """(case folder, a copy of the reference run's checkpoint inside it)."""
        folder = self.case_dir(name)
        copy = folder / "resume-from"
        shutil.copytree((self.gpt2 if family == "gpt2" else self.bert) / checkpoint, copy)
        return folder, copy


CASES: "dict[str, Callable[[Workspace], Verdict]]" = {}


def case(function):
    CASES[function.__name__.removeprefix("case_")] = function
    return function


def resume(ws: Workspace, folder: Path, checkpoint: Path, family: str = "gpt2", *flags) -> Run:
    return run(train_command(family, folder / "ckpt", folder / "logs", "--resume-from", checkpoint, "--max-steps", "2",
                             *flags))


@case
def case_resume_code_in_trainer_state(ws):
    folder, checkpoint = ws.checkpoint_copy("resume_code_in_trainer_state")
    marker = folder / "code-ran"
    write_code_running_pickle(checkpoint / "trainer_state.pt", marker)
    done = resume(ws, folder, checkpoint)
    return judge(done, expect="error", mention=("trainer_state.pt",), code_ran=marker.exists())


@case
def case_resume_code_in_rng_state(ws):
    folder, checkpoint = ws.checkpoint_copy("resume_code_in_rng_state")
    marker = folder / "code-ran"
    write_code_running_pickle(checkpoint / "rng_state.pt", marker)
    done = resume(ws, folder, checkpoint)
    return judge(done, expect="error", mention=("rng_state.pt",), code_ran=marker.exists())


def _damaged_file_case(name: str, file: str, damage: Callable[[Path], None], mention: str = None):
    def damaged(ws):
        folder, checkpoint = ws.checkpoint_copy(name)
        damage(checkpoint / file)
        return judge(resume(ws, folder, checkpoint), expect="error", mention=(mention or file,), must_not_train=True)
    damaged.__name__ = f"case_{name}"
    return case(damaged)


_damaged_file_case("resume_truncated_model_safetensors", "model.safetensors", truncate)
_damaged_file_case("resume_empty_model_safetensors", "model.safetensors", lambda p: p.write_bytes(b""))
_damaged_file_case("resume_missing_model_safetensors", "model.safetensors", Path.unlink)
_damaged_file_case("resume_truncated_trainer_state", "trainer_state.pt", truncate)
_damaged_file_case("resume_empty_trainer_state", "trainer_state.pt", lambda p: p.write_bytes(b""))
_damaged_file_case("resume_truncated_rng_state", "rng_state.pt", truncate)
_damaged_file_case("resume_invalid_config_json", "config.json", lambda p: p.write_text('{"model_type": "gpt2",'))
_damaged_file_case("resume_invalid_training_info", "training_info.json", lambda p: p.write_text("{"))


@case
def case_resume_bert_checkpoint_with_gpt2(ws):
    folder, checkpoint = ws.checkpoint_copy("resume_bert_checkpoint_with_gpt2", family="bert")
    return judge(resume(ws, folder, checkpoint, "gpt2"), expect="error", mention=("bert",), must_not_train=True)


@case
def case_resume_gpt2_checkpoint_with_bert(ws):
    folder, checkpoint = ws.checkpoint_copy("resume_gpt2_checkpoint_with_bert", family="gpt2")
    return judge(resume(ws, folder, checkpoint, "bert"), expect="error", mention=("gpt2",), must_not_train=True)


@case
def case_resume_without_tokenizer_files(ws):
    folder, checkpoint = ws.checkpoint_copy("resume_without_tokenizer_files")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        (checkpoint / name).unlink(missing_ok=True)
    return judge(resume(ws, folder, checkpoint), expect="error", mention=("tokenizer",), must_not_train=True)


@case
def case_resume_checkpoint_of_an_earlier_version(ws):
    """rng_state.pt as the trainer wrote it before weights_only loading: NumPy's state as an array."""
    import numpy as np
    import torch
    folder, checkpoint = ws.checkpoint_copy("resume_checkpoint_of_an_earlier_version")
    states = torch.load(checkpoint / "rng_state.pt", weights_only=False)
    for state in states:
        state["numpy"] = np.random.get_state()
    torch.save(states, checkpoint / "rng_state.pt")
    return judge(resume(ws, folder, checkpoint), expect=0, mention=("resumed from",))


def _output_folder_case(name: str, flag: str, make_bad: str, tracing: bool = False):
    """make_bad: "read-only" (a read-only mount, or chmod 555 without root) or "file" (the path is a file)."""
    def bad_folder(ws):
        folder = ws.case_dir(name)
        paths = {"--save-dir": folder / "ckpt", "--log-dir": folder / "logs", "--trace-output-dir": folder / "traces"}
        bad, prefix = paths[flag], ()
        if make_bad == "file":
            bad.write_text("not a folder\n")
        else:
            bad.mkdir()
            if can_mount():
                prefix = read_only_prefix(bad)
            elif os.geteuid() != 0:
                bad.chmod(0o555)
            else:
                return Verdict("handled", "skipped: needs unshare to make a read-only folder as root")
        flags = ["--max-steps", "3", "--save-steps", "2", "--no-save-initial"]
        if tracing:
            flags += ["--enable-tracing", "--trace-output-dir", paths["--trace-output-dir"]]
        command = train_command("gpt2", paths["--save-dir"], paths["--log-dir"], *flags)
        try:
            done = run(command, prefix=prefix)
        finally:
            if bad.is_dir():
                bad.chmod(0o755)
        return judge(done, expect="error", mention=(flag,), must_not_train=True)
    bad_folder.__name__ = f"case_{name}"
    return case(bad_folder)


_output_folder_case("save_dir_read_only", "--save-dir", "read-only")
_output_folder_case("log_dir_read_only", "--log-dir", "read-only")
_output_folder_case("trace_output_dir_read_only", "--trace-output-dir", "read-only", tracing=True)
_output_folder_case("save_dir_is_a_file", "--save-dir", "file")
_output_folder_case("log_dir_is_a_file", "--log-dir", "file")
_output_folder_case("trace_output_dir_is_a_file", "--trace-output-dir", "file", tracing=True)


@case
def case_two_runs_at_once_in_one_save_dir(ws):
    folder = ws.case_dir("two_runs_at_once_in_one_save_dir")
    # The first run must outlast the second one's start-up (imports take 10-20 s on a busy machine).
    first = start(train_command("gpt2", folder / "ckpt", folder / "logs-1", "--max-steps", "600", "--save-steps", "300",
                                "--eval-steps", "0", "--no-save-initial"), folder / "first.log")
    try:
        deadline = time.monotonic() + 300
        while first.poll() is None and time.monotonic() < deadline:
            if re.search(r"^step 1/", (folder / "first.log").read_text(errors="replace"), re.M):
                break
            time.sleep(0.1)
        second = run(train_command("gpt2", folder / "ckpt", folder / "logs-2", "--max-steps", "3", "--no-save-initial"))
        overlapped = first.poll() is None
    finally:
        first_status = first.wait(timeout=900)
    lost = None
    final = folder / "ckpt" / "final_model"
    if first_status != 0:
        lost = f"the first run failed (exit status {first_status})"
    elif not final.is_dir() or training_info(final)["max_steps"] != 600:
        lost = "the second run replaced the first run's final_model"
    if not overlapped and not lost:
        return Verdict("unclear", "the first run ended before the second one started: nothing was tested")
    return judge(second, expect="error", mention=("--save-dir", "another run"), lost=lost)


@case
def case_second_run_into_a_finished_save_dir(ws):
    folder = ws.case_dir("second_run_into_a_finished_save_dir")
    shutil.copytree(ws.gpt2, folder / "ckpt")
    before = training_info(folder / "ckpt" / "final_model")["weights_sha256"]
    done = run(train_command("gpt2", folder / "ckpt", folder / "logs", "--max-steps", "3", "--seed", "7"))
    after = training_info(folder / "ckpt" / "final_model")["weights_sha256"]
    lost = "the earlier run's final_model was replaced" if after != before else None
    return judge(done, expect="error", mention=("--save-dir", "--overwrite-output-dir"), lost=lost)


@case
def case_deliberate_reuse_with_overwrite_output_dir(ws):
    folder = ws.case_dir("deliberate_reuse_with_overwrite_output_dir")
    shutil.copytree(ws.gpt2, folder / "ckpt")
    done = run(train_command("gpt2", folder / "ckpt", folder / "logs", "--max-steps", "3", "--overwrite-output-dir"))
    return judge(done, expect=0, mention=("done: 3 steps",))


@case
def case_resume_into_its_own_save_dir(ws):
    folder = ws.case_dir("resume_into_its_own_save_dir")
    shutil.copytree(ws.gpt2, folder / "ckpt")
    done = run(train_command("gpt2", folder / "ckpt", folder / "logs", "--max-steps", "3", "--resume-from",
                             folder / "ckpt" / "checkpoint-2"))
    return judge(done, expect=0, mention=("resumed from",))


@case
def case_stale_lock_of_a_dead_run(ws):
    folder = ws.case_dir("stale_lock_of_a_dead_run")
    write_lock_file(folder / "ckpt", dead_pid())
    done = run(train_command("gpt2", folder / "ckpt", folder / "logs", "--max-steps", "2", "--no-save-initial"))
    return judge(done, expect=0, mention=("no longer running",))


@case
def case_partial_checkpoints_of_a_killed_run(ws):
    """A save killed mid-write leaves .checkpoint-N.tmp-<pid>; one killed between its two renames leaves the old
    best_model only as .best_model.old-<pid>. The next run in that folder removes the first and restores the second."""
    folder = ws.case_dir("partial_checkpoints_of_a_killed_run")
    save_dir = folder / "ckpt"
    shutil.copytree(ws.gpt2, save_dir)
    pid = dead_pid()
    partial = save_dir / f".checkpoint-3.tmp-{pid}"
    shutil.copytree(ws.gpt2 / "checkpoint-2", partial)
    truncate(partial / "model.safetensors")
    old_best = save_dir / f".best_model.old-{pid}"
    (save_dir / "best_model").rename(old_best)
    done = run(train_command("gpt2", save_dir, folder / "logs", "--max-steps", "2", "--resume-from",
                             save_dir / "checkpoint-2", "--eval-steps", "0"))
    leftovers = sorted(p.name for p in save_dir.glob(".*") if p.name != LOCK_FILE)
    lost = None if (save_dir / "best_model").is_dir() or old_best.is_dir() else "the previous best_model is gone"
    return judge(done, expect=0, mention=(f"removed {partial.name}", f"restored best_model/ from {old_best.name}/"),
                 lost=lost, left=", ".join(leftovers) or None)


@case
def case_disk_full_during_a_save(ws):
    folder = ws.case_dir("disk_full_during_a_save")
    save_dir = folder / "ckpt"
    save_dir.mkdir()
    if not can_mount():
        return Verdict("handled", "skipped: needs root and unshare for a small tmpfs")
    # Room for one tiny checkpoint (about 3 MB) but not two.
    done = run(train_command("gpt2", save_dir, folder / "logs", "--max-steps", "4", "--save-steps", "1",
                             "--no-save-initial", "--eval-steps", "0"), prefix=small_disk_prefix(save_dir, "4500k"))
    return judge(done, expect="error", mention=("checkpoint-1", "--resume-from"))


@case
def case_disk_full_in_the_log_dir(ws):
    folder = ws.case_dir("disk_full_in_the_log_dir")
    log_dir = folder / "logs"
    log_dir.mkdir()
    if not can_mount():
        return Verdict("handled", "skipped: needs root and unshare for a small tmpfs")
    done = run(train_command("gpt2", folder / "ckpt", log_dir, "--max-steps", "40", "--save-steps", "0",
                             "--no-save-initial", "--eval-steps", "0"), prefix=small_disk_prefix(log_dir, "4k"))
    return judge(done, expect=0, mention=("training_rank_0.log",))


@case
def case_ctrl_c_while_starting_up(ws):
    folder = ws.case_dir("ctrl_c_while_starting_up")
    done = run(train_command("gpt2", folder / "ckpt", folder / "logs", *LONG_RUN), signals=(signal.SIGINT,), delay=1.0)
    return judge(done, expect="error", mention=("interrupted",))


@case
def case_ctrl_c_during_setup(ws):
    folder = ws.case_dir("ctrl_c_during_setup")
    done = run(train_command("gpt2", folder / "ckpt", folder / "logs", *LONG_RUN), signals=(signal.SIGINT,),
               when=r"SQuAD from the Hugging Face hub is not available")
    return judge(done, expect="error", mention=("interrupted",), must_not_train=True)


@case
def case_ctrl_c_during_training(ws):
    folder = ws.case_dir("ctrl_c_during_training")
    done = run(train_command("gpt2", folder / "ckpt", folder / "logs", *LONG_RUN), signals=(signal.SIGINT,),
               when=r"^step 2/")
    saved = list((folder / "ckpt").glob("checkpoint-*"))
    return judge(done, expect=130, mention=("--resume-from",), lost=None if saved else "no checkpoint saved")


@case
def case_ctrl_c_twice_during_training(ws):
    folder = ws.case_dir("ctrl_c_twice_during_training")
    done = run(train_command("gpt2", folder / "ckpt", folder / "logs", *LONG_RUN),
               signals=(signal.SIGINT, signal.SIGINT), when=r"^step 2/")
    # The line must name the newest checkpoint there is (the first Ctrl-C's, if the second came after its save).
    saved = sorted((folder / "ckpt").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return judge(done, expect="error", mention=("interrupted", *(["--resume-from " + str(saved[-1])] if saved else [])))


@case
def case_sigterm_during_setup(ws):
    folder = ws.case_dir("sigterm_during_setup")
    done = run(train_command("gpt2", folder / "ckpt", folder / "logs", *LONG_RUN), signals=(signal.SIGTERM,),
               when=r"SQuAD from the Hugging Face hub is not available")
    return judge(done, expect="error", mention=("SIGTERM",))


@case
def case_sigterm_during_training(ws):
    folder = ws.case_dir("sigterm_during_training")
    done = run(train_command("gpt2", folder / "ckpt", folder / "logs", *LONG_RUN), signals=(signal.SIGTERM,),
               when=r"^step 2/")
    saved = list((folder / "ckpt").glob("checkpoint-*"))
    return judge(done, expect=143, mention=("--resume-from",), lost=None if saved else "no checkpoint saved")


def _sigterm_at_step_2(ws, name: str, command: Callable[[Path], list], expect: int) -> Verdict:
    folder = ws.case_dir(name)
    done = run(command(folder), signals=(signal.SIGTERM,), when=r"^step 2/")
    # SIGTERM to the whole process group (as a job scheduler or a terminal sends it); every rank saves and stops.
    saved = list((folder / "ckpt").rglob("checkpoint-*"))
    return judge(done, expect=expect, mention=("--resume-from",), lost=None if saved else "no checkpoint saved")


@case
def case_launcher_sigterm(ws):
    """./run_gpt2.sh on 2 CPU ranks, as users start a multi-rank run: exit status 130 (the launcher's "stopped")."""
    return _sigterm_at_step_2(ws, "launcher_sigterm",
                              lambda folder: launcher_command("gpt2", folder, "--save-steps", "0", "--eval-steps", "0"),
                              expect=130)


@case
def case_utils_torchrun_sigterm(ws):
    """`python -m utils.torchrun`, the launcher's torchrun (plain torchrun prints its own SignalException traceback:
    docs/TRAINING.md says to start ranks through utils.torchrun)."""
    return _sigterm_at_step_2(ws, "utils_torchrun_sigterm",
                              lambda folder: torchrun_command([sys.executable, "-m", "utils.torchrun"], "gpt2",
                                                              folder / "ckpt", folder / "logs", *LONG_RUN),
                              expect=143)


@case
def case_launcher_failing_rank(ws):
    """A rank that fails (here: a --resume-from that does not exist) under ./run_gpt2.sh: the rank's line first."""
    folder = ws.case_dir("launcher_failing_rank")
    done = run(launcher_command("gpt2", folder, "--resume-from", folder / "no-such-checkpoint", max_steps=2))
    return judge(done, expect="error", mention=("no-such-checkpoint", "--resume-from"), must_not_train=True)


@case
def case_utils_torchrun_bad_flag(ws):
    folder = ws.case_dir("utils_torchrun_bad_flag")
    done = run(torchrun_command([sys.executable, "-m", "utils.torchrun"], "gpt2", folder / "ckpt", folder / "logs",
                                "--max-steps", "2", "--dataset-path", folder / "missing.jsonl"))
    return judge(done, expect="error", mention=("missing.jsonl",))


@case
def case_tensorboard_on_a_full_log_disk(ws):
    """--report-to tensorboard with a log disk that fills mid-run: TensorBoard's writer thread fails (a traceback
    from that thread, then one from add_scalar) unless the sink stops with a warning, as the log file does."""
    folder = ws.case_dir("tensorboard_on_a_full_log_disk")
    log_dir = folder / "logs"
    log_dir.mkdir()
    if not can_mount():
        return Verdict("handled", "skipped: needs root and unshare for a small tmpfs")
    done = run(train_command("gpt2", folder / "ckpt", log_dir, "--max-steps", "150", "--save-steps", "0",
                             "--no-save-initial", "--eval-steps", "0", "--report-to", "tensorboard"),
               prefix=small_disk_prefix(log_dir, "20k"))
    return judge(done, expect=0, mention=("cannot write TensorBoard events",))


@case
def case_tokenizer_cache_left_half_written(ws):
    """A run killed while it saved its trained tokenizer leaves data/tokenizers/.<name>.tmp-<pid>: the next run
    that trains or reuses a tokenizer removes it."""
    folder = ws.case_dir("tokenizer_cache_left_half_written")
    TOKENIZER_CACHE.mkdir(parents=True, exist_ok=True)
    partial = TOKENIZER_CACHE / f".gpt2-byte-level-bpe-2048-000000000000-tok0.0.tmp-{dead_pid()}"
    partial.mkdir()
    (partial / "vocab.json").write_text("{")
    done = run(train_command("gpt2", folder / "ckpt", folder / "logs", "--max-steps", "2", "--no-save-initial"))
    left = str(partial) if partial.exists() else None
    shutil.rmtree(partial, ignore_errors=True)
    return judge(done, expect=0, mention=() if left else (f"removed {partial}",), left=left)


# ---- running the corpus -------------------------------------------------------------------------------------------
def run_cases(names: Optional[list] = None, work_dir: Optional[Path] = None, progress: bool = False) -> list:
    """Run the cases (all, or those named) and return [{"case", "outcome", "message"}] in order."""
    unknown = sorted(set(names or []) - set(CASES))
    if unknown:
        raise ValueError(f"unknown case(s): {', '.join(unknown)}; known: {', '.join(CASES)}")
    with work_folder(work_dir) as root:
        ws = Workspace(root)
        ws.build()
        results = []
        for name, function in CASES.items():
            if names and name not in names:
                continue
            started = time.monotonic()
            try:
                verdict = function(ws)
            except Exception as exc:  # a broken case must not hide the others' results
                verdict = Verdict("unclear", f"the case itself failed: {type(exc).__name__}: {exc}")
            results.append({"case": name, "outcome": verdict.outcome, "message": verdict.message})
            if progress:
                print(f"{verdict.outcome:>18}  {name}  ({time.monotonic() - started:.0f} s)\n{'':>20}{verdict.message}",
                      flush=True)
        return results


@contextlib.contextmanager
def work_folder(folder: Optional[Path]):
    """The given folder (kept), or a temporary one (removed afterwards)."""
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        yield Path(folder).resolve()
        return
    with tempfile.TemporaryDirectory(prefix="training_faults-") as tmp:
        yield Path(tmp)


def count_outcomes(results: list) -> Counter:
    return Counter(r["outcome"] for r in results)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="CASE", help=f"run only these cases ({len(CASES)} in all)")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="build the cases in DIR and keep it")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    results = run_cases(args.only, args.keep, progress=True)
    counts = count_outcomes(results)
    print(f"\n{len(results)} training fault cases: " + ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if counts[o]))
    if args.json:
        args.json.write_text(json.dumps({"results": results, "counts": dict(counts)}, indent=2) + "\n")
    return 1 if any(counts[o] for o in BAD_OUTCOMES) else 0


if __name__ == "__main__":
    sys.exit(main())
