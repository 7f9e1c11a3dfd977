"""The steps a traced run times (run.json's traced and untraced steps) hold training alone, never the trainer's
other work: the loss read and log line, an evaluation, a checkpoint."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import gpt2.train  # noqa: E402
from utils import hub  # noqa: E402
from utils.trainer import Trainer  # noqa: E402

# Each piece of the trainer's work between steps takes this much longer than it would: a timed step holding one
# lasts at least this long, a training step of the tiny model a few ms (step 0, with its start-up, some tens)
BETWEEN_STEPS_S = 0.5
TINY_TRACED_RUN = ["--model-name", "tiny", "--max-seq-length", "64", "--batch-size", "2", "--report-to", "none",
                   "--no-save-initial", "--eval-batches", "1", "--precision", "fp32", "--no-compile",
                   "--enable-tracing", "--trace-name", "between"]


@pytest.fixture
def offline(monkeypatch):
    threads = torch.get_num_threads()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "_decision", None)
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def slowed_between_steps(monkeypatch) -> list:
    """Make the trainer's loss read, evaluation and checkpoint each BETWEEN_STEPS_S slower; returns the list of
    (what, step, whether the profiler was recording) they append to as they run."""
    ran = []
    for name in ("_agree_on_loss_and_stop", "evaluate", "save"):
        def slowed(self, *args, _original=getattr(Trainer, name), _name=name, **kwargs):
            ran.append((_name, self.step, torch.autograd._profiler_enabled()))
            time.sleep(BETWEEN_STEPS_S)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(Trainer, name, slowed)
    return ran


@pytest.mark.slow
def test_loss_reads_evaluations_and_checkpoints_are_in_no_timed_step_and_never_recorded(tmp_path, monkeypatch,
                                                                                        offline):
    """A checkpoint and an evaluation after step 2 of a 2-rank GPT-2 tiny run took the next untraced step from 17
    to 102 ms, and after step 4 the first traced step from 36 to 95 ms (with the evaluation's forward pass in its
    trace): the step's clocks ran from the end of one step to the end of the next, over everything between."""
    ran = slowed_between_steps(monkeypatch)
    # wait 2 (steps 0-1), warm-up 1 (2), traced 3-5, timed after the window 6-7; the loss read after every step
    # outside the window, a checkpoint due after steps 3 and 6 and an evaluation after step 4, both inside the
    # window the first time
    status = train_tiny_traced(tmp_path, active=3, after=2, max_steps=9,
                               extra=("--save-steps", "3", "--eval-steps", "4"))
    assert status == 0
    info = json.loads((tmp_path / "outputs" / "between" / "run.json").read_text())
    assert info["traced_steps"] == [3, 4, 5] and info["untraced_steps"] == [0, 1, 6, 7]
    [rank] = info["ranks"]
    assert rank["step_micro_batches"] == [1, 1, 1] and rank["untraced_step_micro_batches"] == [1, 1, 1, 1]
    assert max(rank["step_wall_time_s"] + rank["untraced_step_wall_time_s"]) < BETWEEN_STEPS_S, rank
    assert max(rank["untraced_step_cpu_time_s"]) < BETWEEN_STEPS_S
    # None of it ran while the profiler recorded: the evaluation and the checkpoint due inside the window waited
    # for it to close (after step 5, the trainer's step 6)
    assert [entry for entry in ran if entry[2]] == []
    evaluations = [step for what, step, _ in ran if what == "evaluate"]
    checkpoints = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("checkpoint-"))
    assert evaluations[:2] == [6, 8] and checkpoints == ["checkpoint-6", "checkpoint-9"]
    assert "step 4: evaluation and checkpoint due, held until the trace window closes" in \
        (tmp_path / "logs" / "training_rank_0.log").read_text()


def test_the_logs_pace_leaves_out_the_tracers_export_and_publication(tmp_path, monkeypatch, offline):
    """The traces' export after the last traced step had been counted as that step's time (354.6 ms/step for a
    39 ms step), and the publication after the last timed step, left out of ms/step, was counted in tokens/s (478
    tok/s beside 8.8 ms/step, against 14,598 a step before). Both take BETWEEN_STEPS_S longer here."""
    from utils.chakra_tracer import ChakraTracer
    for name in ("_finalize_capture", "_conclude"):
        def slowed(self, *args, _original=getattr(ChakraTracer, name), **kwargs):
            time.sleep(BETWEEN_STEPS_S)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(ChakraTracer, name, slowed)
    status = train_tiny_traced(tmp_path, active=2, after=3, max_steps=9)
    assert status == 0
    lines, ms, tokens_per_step = logged_pace(tmp_path / "logs" / "training_rank_0.log")
    # traced steps 3-4 (log steps 4-5), timed after the window 5-7 (log 6-8): the window published after log step 8
    assert ms[5] < BETWEEN_STEPS_S * 1000 / 2, lines[5]
    assert ms[9] < BETWEEN_STEPS_S * 1000 / 2, lines[9]
    assert sorted(tokens_per_step) == [6, 7, 8, 9], lines
    assert all(100 < tokens <= 2 * 64 * 1.05 for tokens in tokens_per_step.values()), tokens_per_step


def train_tiny_traced(tmp_path: Path, *, active: int, after: int, max_steps: int, extra: tuple = ()) -> int:
    """gpt2/train.py in this process: 2 wait steps, 1 warm-up, `active` traced and `after` timed after the window,
    a log line every step; outputs, checkpoints and logs under tmp_path."""
    return gpt2.train.main([*TINY_TRACED_RUN, "--trace-wait-steps", "2", "--trace-warmup-steps", "1",
                            "--trace-active-steps", str(active), "--trace-after-steps", str(after), "--max-steps",
                            str(max_steps), "--logging-steps", "1", *extra, "--trace-output-dir",
                            str(tmp_path / "outputs"), "--save-dir", str(tmp_path / "ckpt"), "--log-dir",
                            str(tmp_path / "logs")])


def logged_pace(log: Path) -> tuple[dict, dict, dict]:
    """The log's step lines, their ms/step, and tokens a step on lines with tok/s after another with it: tok/s
    counts the tokens since the last line with a loss over the time since, so there tok/s x ms/step is one step's
    tokens (2 x 64 at most here)."""
    lines = {int(line.split("step ", 1)[1].split("/")[0]): line
             for line in log.read_text().splitlines() if "| epoch " in line and "ms/step" in line}
    ms = {step: float(line.split(" ms/step")[0].rsplit("| ", 1)[1].replace(",", "")) for step, line in lines.items()}
    rates = {step: float(line.split(" tok/s")[0].rsplit("| ", 1)[1].replace(",", ""))
             for step, line in lines.items() if "tok/s" in line}
    return lines, ms, {step: rates[step] * ms[step] / 1000 for step in rates if step - 1 in rates}


def test_tokens_per_second_and_ms_per_step_span_the_same_time(tmp_path, monkeypatch, offline):
    """The log line read the clock again for tokens/s: a process descheduled between the loop's reading and that one
    (a busy machine) had 2.8 ms less in tokens/s than in a 16 ms step, 155 tokens a step of 128. The line's own
    work stands for that pause here."""
    log_step, calls = Trainer._log_step, []

    def descheduled(self, *args):
        calls.append(self.step)
        if len(calls) == 3:  # once, after the window: the next line's interval holds the pause
            time.sleep(0.05)
        return log_step(self, *args)
    monkeypatch.setattr(Trainer, "_log_step", descheduled)
    status = train_tiny_traced(tmp_path, active=1, after=2, max_steps=8)
    assert status == 0
    lines, _, tokens_per_step = logged_pace(tmp_path / "logs" / "training_rank_0.log")
    assert len(tokens_per_step) >= 3, lines
    assert all(100 < tokens <= 2 * 64 * 1.05 for tokens in tokens_per_step.values()), tokens_per_step


RANK_ZERO_LOGS_SLOWLY = '''
import os, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from utils.trainer import Trainer
if os.environ.get("RANK") == "0":  # rank 0's log line (console, metric sinks) is its own work: slower here by the second argument
    log_step = Trainer._log_step
    Trainer._log_step = lambda self, *args: (time.sleep(float(sys.argv[2])), log_step(self, *args))[1]
import gpt2.train
torch.set_num_threads(1)
sys.exit(gpt2.train.main(sys.argv[3:]))
'''


@pytest.mark.slow
def test_a_rank_never_waits_in_a_timed_step_for_rank_zeros_own_work_between_steps(tmp_path):
    """Only rank 0 writes the log line and the metric sinks after the loss read: the other ranks, done first, met
    it at the next step's gradient all-reduce, inside their timed untraced step."""
    script = tmp_path / "rank_zero_logs_slowly.py"
    script.write_text(RANK_ZERO_LOGS_SLOWLY)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           str(script), str(REPO_ROOT), str(BETWEEN_STEPS_S), *TINY_TRACED_RUN, "--num-gpus", "2",
                           "--trace-wait-steps", "3", "--trace-warmup-steps", "1", "--trace-active-steps", "1",
                           "--trace-after-steps", "3", "--max-steps", "8", "--logging-steps", "1",
                           "--save-steps", "0", "--eval-steps", "0", "--trace-output-dir", str(tmp_path / "outputs"),
                           "--save-dir", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "logs")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    info = json.loads((tmp_path / "outputs" / "between" / "run.json").read_text())
    assert info["traced_steps"] == [4] and info["untraced_steps"] == [0, 1, 2, 5, 6, 7]
    for rank in info["ranks"]:  # rank 0 logged after steps 1, 2, 6 and 7 (the trainer's), each BETWEEN_STEPS_S slower
        assert max(rank["untraced_step_wall_time_s"] + rank["step_wall_time_s"]) < BETWEEN_STEPS_S, rank
