"""Tests of the training core: tiny GPT-2 and BERT runs on the bundled data, one process and two gloo ranks."""
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import bert.train  # noqa: E402
import gpt2.train  # noqa: E402
from utils import hub  # noqa: E402
from utils.trainer import Trainer  # noqa: E402

ENTRY = {"gpt2": gpt2.train.main, "bert": bert.train.main}
# Small and fast: 64-token sequences, no metric sink, no initial checkpoint unless a test asks for one.
QUICK = ["--model-name", "tiny", "--max-seq-length", "64", "--batch-size", "4", "--report-to", "none"]
# The reference run the resume tests compare against; only --save-dir/--log-dir/--resume-from may differ.
RESUME_FLAGS = QUICK + ["--max-steps", "24", "--save-steps", "8", "--eval-steps", "6", "--learning-rate", "1e-3",
                        "--logging-steps", "1"]
INFO_FIELDS = {"step", "epoch", "loss", "learning_rate", "world_size", "tokens_seen", "elapsed_seconds", "arguments"}


@contextlib.contextmanager
def offline_single_thread():
    """No hub (decided from the environment, never the network) and one thread: the test machine is shared, and
    runs compared bit for bit must use the same thread count (it changes the order of floating-point sums)."""
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setattr(hub, "_decision", None)
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def offline():
    with offline_single_thread():
        yield


def train(family, tmp, *flags):
    """Run <family>/train.py's main() in this process; (exit status, save dir, log dir)."""
    save_dir, log_dir = Path(tmp) / "ckpt", Path(tmp) / "logs"
    status = ENTRY[family]([*flags, "--save-dir", str(save_dir), "--log-dir", str(log_dir)])
    return status, save_dir, log_dir


def subprocess_env():
    return dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))


def info(checkpoint):
    return json.loads((Path(checkpoint) / "training_info.json").read_text())


def logged_losses(log_dir, rank=0):
    """{step: loss} from the per-rank log file's step lines."""
    losses = {}
    for line in (Path(log_dir) / f"training_rank_{rank}.log").read_text().splitlines():
        if "| loss " in line and " step " in line:
            step = int(line.split(" step ")[1].split("/")[0])
            losses[step] = float(line.split("| loss ")[1].split()[0])
    return losses


def fingerprint_lines(log_dir, rank):
    text = (Path(log_dir) / f"training_rank_{rank}.log").read_text()
    return [line.split("final weights sha256 ")[1].split()[0] for line in text.splitlines() if "final weights sha256" in line]


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# ---- learning ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_loss_falls_clearly_in_30_steps_on_one_repeated_batch(family, tmp_path):
    status, _, logs = train(family, tmp_path, *QUICK, "--overfit-one-batch", "--max-steps", "30", "--learning-rate",
                            "3e-3", "--warmup-steps", "0", "--logging-steps", "1", "--eval-steps", "0",
                            "--save-steps", "0", "--no-save-initial")
    assert status == 0
    losses = logged_losses(logs)
    assert sorted(losses) == list(range(1, 31))
    assert losses[30] < 0.7 * losses[1], losses
    assert min(losses[s] for s in range(25, 31)) < min(losses[s] for s in range(1, 6))


def test_loss_sync_steps_reads_the_loss_only_every_nth_step_and_logs_the_time_in_between(tmp_path, monkeypatch):
    synced = []
    agree = Trainer._agree_on_loss_and_stop

    def recording(self, loss):
        synced.append(self.step)
        return agree(self, loss)

    monkeypatch.setattr(Trainer, "_agree_on_loss_and_stop", recording)
    status, _, logs = train("gpt2", tmp_path, *QUICK, "--max-steps", "7", "--logging-steps", "1",
                            "--loss-sync-steps", "3", "--eval-steps", "0", "--save-steps", "0", "--no-save-initial")
    assert status == 0
    assert synced == [1, 3, 6, 7] and sorted(logged_losses(logs)) == [1, 3, 6, 7]
    log = (logs / "training_rank_0.log").read_text()
    assert "host memory: " in log  # what the trainer did with malloc (tests/test_host_memory.py)
    lines = [line for line in log.splitlines() if " ms/step" in line]
    between = [line for line in lines if line.endswith("between loss reads (every 3 steps)")]
    assert [int(line.split(" step ")[1].split("/")[0]) for line in between] == [2, 4, 5]
    assert all("| loss " not in line and "| cpu " in line for line in between)


# ---- resume -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def uninterrupted_gpt2(tmp_path_factory):
    """24 uninterrupted steps with checkpoints every 8 and TensorBoard scalars: the reference run."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    with offline_single_thread():
        # TensorBoard on here only: metric sinks touch no random state, so the runs stay comparable.
        status, save_dir, log_dir = train("gpt2", tmp, *RESUME_FLAGS, "--report-to", "tensorboard")
    assert status == 0
    return save_dir, log_dir


def test_resumed_run_reaches_the_same_step_loss_and_weights_as_the_uninterrupted_one(uninterrupted_gpt2, tmp_path):
    reference, reference_logs = uninterrupted_gpt2
    status, save_dir, log_dir = train("gpt2", tmp_path, *RESUME_FLAGS, "--resume-from", str(reference / "checkpoint-8"))
    assert status == 0
    resumed, expected = info(save_dir / "final_model"), info(reference / "final_model")
    assert resumed["step"] == expected["step"] == 24
    assert resumed["loss"] == expected["loss"]
    assert resumed["weights_sha256"] == expected["weights_sha256"]
    assert resumed["tokens_seen"] == expected["tokens_seen"] == 24 * 4 * 64
    assert resumed["epoch"] == expected["epoch"]
    assert logged_losses(log_dir) == {s: loss for s, loss in logged_losses(reference_logs).items() if s > 8}
    assert not (save_dir / "initial_model").exists()  # a resumed run does not start over


def logged_learning_rates(log_dir):
    """{step: learning rate} from the step lines with a loss (printed with 3 significant digits)."""
    lines = (Path(log_dir) / "training_rank_0.log").read_text().splitlines()
    return {int(line.split(" step ")[1].split("/")[0]): float(line.split("| lr ")[1].split()[0])
            for line in lines if "| loss " in line and " step " in line}


def test_a_resumed_run_trains_with_its_own_learning_rate_weight_decay_and_schedule(tmp_path):
    """--learning-rate and --weight-decay given with --resume-from were replaced by the checkpoint's (its optimizer
    and scheduler states hold them) while training_info.json recorded the new ones; with another --max-steps the
    first resumed step still trained at the old schedule's learning rate."""
    common = [*QUICK, "--warmup-steps", "0", "--logging-steps", "1", "--eval-steps", "0", "--save-steps", "2",
              "--no-save-initial"]
    status, first, _ = train("gpt2", tmp_path / "first", *common, "--max-steps", "4", "--learning-rate", "1e-3")
    assert status == 0
    status, save_dir, logs = train("gpt2", tmp_path / "resumed", *common, "--max-steps", "6", "--learning-rate",
                                   "2e-3", "--weight-decay", "0.1", "--resume-from", str(first / "checkpoint-2"))
    assert status == 0
    # this run's linear decay from 2e-3 to 0 over 6 steps: step s trains at 2e-3 * (6 - (s - 1)) / 6
    assert logged_learning_rates(logs) == {s: pytest.approx(2e-3 * (7 - s) / 6, rel=5e-3) for s in range(3, 7)}
    state = torch.load(save_dir / "final_model" / "trainer_state.pt", weights_only=True)
    assert [(g["initial_lr"], g["weight_decay"]) for g in state["optimizer"]["param_groups"]] == [(2e-3, 0.1),
                                                                                                  (2e-3, 0.0)]
    assert state["scheduler"]["base_lrs"] == [2e-3, 2e-3]
    assert info(save_dir / "final_model")["arguments"]["learning_rate"] == 2e-3
    assert info(save_dir / "checkpoint-4")["learning_rate"] == pytest.approx(2e-3 * 2 / 6)  # the lr of step 5
    warning = [line for line in (logs / "training_rank_0.log").read_text().splitlines() if "apply from here" in line]
    assert len(warning) == 1
    for difference in ("--learning-rate 0.002 (the checkpoint's 0.001)", "--weight-decay 0.1 (the checkpoint's 0.01)",
                       "total steps 6 (the checkpoint's 4)", "step 3 trains at learning rate 0.00133"):
        assert difference in warning[0]


def test_a_warm_up_as_long_as_the_run_is_warned_of(tmp_path, capsys):
    """--warmup-steps 100 over 3 steps trained at 0, 5e-07 and 1e-06 of a 5e-05 rate, with no word of it."""
    status, _, _ = train("gpt2", tmp_path, *QUICK, "--max-steps", "3", "--warmup-steps", "100", "--eval-steps", "0",
                         "--save-steps", "0", "--no-save-initial")
    assert status == 0
    assert ("--warmup-steps 100 is not below the run's 3 steps: the learning rate never reaches --learning-rate 5e-05"
            in capsys.readouterr().err)


def test_resuming_a_checkpoint_already_past_max_steps_warns_that_nothing_is_trained(tmp_path, capsys):
    """A checkpoint at step 3 resumed with --max-steps 2 ended "done: 3 steps", exit 0, with an info line only: a
    user who meant to raise --max-steps is told, on stderr."""
    common = [*QUICK, "--eval-steps", "0", "--save-steps", "0", "--no-save-initial"]
    status, first, _ = train("gpt2", tmp_path / "first", *common, "--max-steps", "3")
    assert status == 0
    capsys.readouterr()
    status, _, _ = train("gpt2", tmp_path / "again", *common, "--max-steps", "2", "--resume-from",
                         str(first / "final_model"))
    assert status == 0
    assert (f"--resume-from {first / 'final_model'}: already at step 3, and this run ends at step 2: nothing to train; "
            "raise --max-steps (or --num-epochs) to train on") in capsys.readouterr().err


@pytest.mark.slow
def test_resuming_with_another_number_of_ranks_names_it_as_why_the_data_order_restarts(tmp_path):
    """The warning blamed "a different batch size or dataset" when only the number of ranks had changed."""
    status, first, _ = train("gpt2", tmp_path / "one", *QUICK, "--max-steps", "2", "--save-steps", "2",
                             "--eval-steps", "0", "--no-save-initial")
    assert status == 0
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "gpt2/train.py",
               *QUICK, "--max-steps", "3", "--eval-steps", "0", "--save-steps", "0", "--num-gpus", "2",
               "--resume-from", str(first / "checkpoint-2"), "--save-dir", str(tmp_path / "two"),
               "--log-dir", str(tmp_path / "two-logs")]
    result = subprocess.run(command, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = [line for line in result.stderr.splitlines() if "data order restarts" in line]
    assert "batch size or dataset" not in line
    assert "batches a rank with 1 rank(s), and is " in line and "with this run's 2" in line


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_exits_cleanly_and_the_resumed_run_matches(uninterrupted_gpt2, tmp_path):
    reference, _ = uninterrupted_gpt2
    interrupted_dir = tmp_path / "interrupted"
    command = [sys.executable, "gpt2/train.py", *RESUME_FLAGS, "--save-dir", str(interrupted_dir),
               "--log-dir", str(tmp_path / "interrupted-logs")]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=subprocess_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    for line in process.stdout:
        if line.startswith("step 2/24"):
            process.send_signal(signal.SIGTERM)
            break
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr and "SIGTERM received" in stderr
    saved = [p for p in interrupted_dir.glob("checkpoint-*") if info(p)["kind"] == "interrupted"]
    assert len(saved) == 1
    stopped_at = info(saved[0])["step"]
    assert 2 <= stopped_at < 24 and not (interrupted_dir / "final_model").exists()
    assert f"resume with --resume-from {saved[0]}" in stderr

    status, save_dir, _ = train("gpt2", tmp_path / "resumed", *RESUME_FLAGS, "--resume-from", str(saved[0]))
    assert status == 0
    resumed, expected = info(save_dir / "final_model"), info(reference / "final_model")
    assert (resumed["step"], resumed["loss"], resumed["weights_sha256"]) == \
        (expected["step"], expected["loss"], expected["weights_sha256"])


def test_resuming_from_an_earlier_checkpoint_of_the_run_keeps_the_checkpoints_it_saved_later(tmp_path, capsys):
    """Resuming from checkpoint-3 in the run's own --save-dir wrote over its checkpoint-6, final_model and best_model
    (with a worse model, from the step-3 state's best). Refused now; --overwrite-output-dir moves those, and only
    those, into .previous/."""
    flags = [*QUICK, "--save-steps", "3", "--eval-steps", "3", "--learning-rate", "1e-3"]
    status, save_dir, _ = train("gpt2", tmp_path, *flags, "--max-steps", "6")
    assert status == 0
    saved = {p.name: info(p) for p in save_dir.iterdir() if not p.name.startswith(".")}
    later = sorted(name for name, record in saved.items() if record["step"] > 3)
    assert {"checkpoint-6", "final_model"} <= set(later)
    capsys.readouterr()

    resume = ["--max-steps", "9", "--resume-from", str(save_dir / "checkpoint-3")]
    status, _, _ = train("gpt2", tmp_path, *flags, *resume)
    assert status == 1
    [error] = error_lines(capsys.readouterr().err)
    assert error.startswith(f"error: --resume-from {save_dir / 'checkpoint-3'}: {save_dir} holds what that run saved "
                            "after step 3 (") and "checkpoint-6" in error and "final_model of step 6" in error
    assert f"resume from {save_dir / 'checkpoint-6'} to continue the run" in error and "--overwrite-output-dir" in error
    assert {p.name: info(p) for p in save_dir.iterdir() if not p.name.startswith(".")} == saved  # all untouched

    status, _, _ = train("gpt2", tmp_path, *flags, *resume, "--overwrite-output-dir")
    assert status == 0
    assert sorted(p.name for p in (save_dir / ".previous").iterdir()) == later
    for name in later:
        assert info(save_dir / ".previous" / name) == saved[name]
    for name in ("initial_model", "checkpoint-3"):
        assert info(save_dir / name) == saved[name]  # the run's own up to its starting point stay
    assert info(save_dir / "final_model")["step"] == info(save_dir / "checkpoint-9")["step"] == 9


def test_a_run_that_saved_no_trained_step_does_not_push_the_kept_run_out_of_previous(tmp_path, capsys, monkeypatch):
    """--overwrite-output-dir over a --save-dir holding only the initial_model of a run that failed in its first step
    (a quick launcher run passes the flag every time) replaced .previous/'s run, the last trained one, with it."""
    one_step = [*QUICK, "--max-steps", "1", "--save-steps", "0", "--eval-steps", "0", "--overwrite-output-dir"]
    assert train("gpt2", tmp_path, *one_step)[0] == 0
    assert train("gpt2", tmp_path, *one_step)[0] == 0  # the first run now in .previous

    def out_of_memory(self, accumulation):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "_optimizer_step", out_of_memory)
        status, save_dir, _ = train("gpt2", tmp_path, *one_step)
    assert status == 1 and sorted(p.name for p in save_dir.iterdir() if not p.name.startswith(".")) == ["initial_model"]
    kept = info(save_dir / ".previous" / "final_model")  # the second run, moved aside by the failed one
    capsys.readouterr()

    assert train("gpt2", tmp_path, *one_step)[0] == 0
    assert sorted(p.name for p in (save_dir / ".previous").iterdir()) == ["best_model", "final_model", "initial_model"]
    assert info(save_dir / ".previous" / "final_model") == kept
    assert (f"deleted the earlier run's initial_model from {save_dir} (that run saved no trained step); "
            f"{save_dir / '.previous'} keeps the run before it") in capsys.readouterr().err


# ---- checkpoints ------------------------------------------------------------------------------------------------
def test_checkpoints_load_with_from_pretrained_and_record_the_training_info(uninterrupted_gpt2):
    from transformers import AutoTokenizer, GPT2LMHeadModel
    save_dir, _ = uninterrupted_gpt2
    names = sorted(p.name for p in save_dir.iterdir())
    assert names == ["best_model", "checkpoint-16", "checkpoint-24", "checkpoint-8", "final_model", "initial_model"]
    for name, step in [("initial_model", 0), ("checkpoint-8", 8), ("best_model", None), ("final_model", 24)]:
        checkpoint = save_dir / name
        record = info(checkpoint)
        assert INFO_FIELDS <= set(record), name
        assert {"trainer_state.pt", "rng_state.pt", "config.json", "tokenizer.json"} <= {p.name for p in checkpoint.iterdir()}
        assert record["world_size"] == 1 and record["arguments"]["model_name"] == "tiny"
        if step is not None:
            assert record["step"] == step and record["tokens_seen"] == step * 4 * 64
        model = GPT2LMHeadModel.from_pretrained(checkpoint)
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        ids = tokenizer("Who founded the town?", return_tensors="pt")["input_ids"]
        assert torch.isfinite(model(input_ids=ids, labels=ids).loss)
    best, final = info(save_dir / "best_model"), info(save_dir / "final_model")
    assert best["val_loss"] == best["best_val_loss"] == final["best_val_loss"]
    assert best["step"] in (6, 12, 18, 24) and final["kind"] == "final" and len(final["weights_sha256"]) == 64


def test_training_writes_tensorboard_scalars(uninterrupted_gpt2):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    _, log_dir = uninterrupted_gpt2
    runs = list((log_dir / "tensorboard").glob("*/*"))  # <model>/<start>-<pid>: a folder per run
    assert len(runs) == 1
    events = EventAccumulator(str(runs[0]))
    events.Reload()
    assert {"train/loss", "train/learning_rate", "train/tokens_per_second", "eval/loss"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 25))


def test_the_final_evaluation_reaches_tensorboard_when_the_run_does_not_end_on_an_eval_step(tmp_path):
    """The sinks were closed before the final evaluation: a run shorter than --eval-steps, or not ending on a
    multiple of it, had no eval/* scalars of its last step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    status, _, log_dir = train("gpt2", tmp_path, *QUICK, "--report-to", "tensorboard", "--max-steps", "5",
                               "--eval-steps", "3", "--logging-steps", "4", "--save-steps", "0", "--no-save-initial")
    assert status == 0
    [run] = (log_dir / "tensorboard").glob("*/*")
    events = EventAccumulator(str(run))
    events.Reload()
    evaluations = [line for line in (log_dir / "training_rank_0.log").read_text().splitlines() if "eval at step" in line]
    assert len(evaluations) == 2 and "eval at step 5 " in evaluations[1]
    for tag in ("eval/loss", "eval/perplexity"):
        assert [e.step for e in events.Scalars(tag)] == [3, 5], tag


# ---- two ranks --------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_gloo_ranks_under_torchrun_end_with_identical_weights(tmp_path):
    from transformers import BertForMaskedLM
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
               "bert/train.py", *QUICK, "--max-steps", "6", "--num-gpus", "2",
               "--gradient-accumulation-steps", "2", "--save-steps", "3", "--eval-steps", "3", "--no-save-initial",
               "--learning-rate", "1e-3", "--save-dir", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "logs")]
    result = subprocess.run(command, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rank0, rank1 = fingerprint_lines(tmp_path / "logs", 0), fingerprint_lines(tmp_path / "logs", 1)
    assert len(rank0) == len(rank1) == 1 and rank0 == rank1
    final = info(tmp_path / "ckpt" / "final_model")
    assert final["world_size"] == 2 and final["global_batch_size"] == 4 * 2 * 2
    assert final["weights_sha256"] == rank0[0] and final["tokens_seen"] == 6 * 4 * 2 * 2 * 64
    assert "weights identical on all 2 ranks" in result.stdout
    assert logged_losses(tmp_path / "logs", 0) == logged_losses(tmp_path / "logs", 1)  # the all-reduced loss
    for name in ("checkpoint-3", "best_model", "final_model"):
        assert BertForMaskedLM.from_pretrained(tmp_path / "ckpt" / name).config.num_hidden_layers == 2
    assert len(torch.load(tmp_path / "ckpt" / "final_model" / "rng_state.pt", weights_only=False)) == 2


GLOO_TEARDOWN = """
import os, sys
import torch.distributed as dist
from utils.distributed import distributed_context

with distributed_context():
    import torch._dynamo  # as the profiler and torch.compile import it, once the group exists
    everyone = [None, None]
    dist.all_gather_object(everyone, dist.get_rank())  # a collective of Python tensors, released by gloo's threads
names = [open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")]
print(f"gloo threads left: {sum('gloo' in name for name in names)}")  # one write: the ranks print at once
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the process's threads from /proc (Linux)")
def test_the_process_group_is_torn_down_at_the_end_even_after_torch_dynamo_was_imported(tmp_path):
    """torch.distributed.nn took the world group as a default argument when torch._dynamo imported it inside a run
    (the profiler does): destroy_process_group then left gloo's threads running into the interpreter's exit, where
    one releasing a Python tensor aborted the rank ("terminate called without an active exception", exit -6) after
    a run that had succeeded: 1 run in 10 of a 2-rank traced script on a busy 2-core machine."""
    script = tmp_path / "teardown.py"
    script.write_text(GLOO_TEARDOWN)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           str(script)], cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("gloo threads left: 0") == 2, done.stdout


# ---- data sources -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_jsonl_corpus_with_korean_text_trains(family, tmp_path):
    from transformers import AutoTokenizer
    corpus = tmp_path / "mixed.jsonl"
    lines = [f"{i}번째 문장: 서울과 부산은 한국의 도시입니다. Sentence {i} mixes Korean and English text." for i in range(60)]
    corpus.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in lines), encoding="utf-8")
    status, save_dir, _ = train(family, tmp_path, *QUICK, "--dataset-path", str(corpus), "--max-steps", "3",
                                "--no-save-initial")
    assert status == 0
    final = info(save_dir / "final_model")
    assert final["data_source"] == f"jsonl:{corpus}" and final["step"] == 3
    tokenizer = AutoTokenizer.from_pretrained(save_dir / "final_model")
    decoded = tokenizer.decode(tokenizer(lines[7])["input_ids"], skip_special_tokens=True)
    if family == "gpt2":
        assert decoded == lines[7]  # byte-level BPE round-trips any UTF-8
    else:
        assert "서울과 부산은" in unicodedata.normalize("NFC", decoded)  # uncased WordPiece decomposes Hangul (NFD)
    assert tokenizer.unk_token_id not in tokenizer(lines[7])["input_ids"]


def test_tracing_without_max_steps_stops_after_the_trace_window_and_the_untraced_steps_timed_after_it(tmp_path):
    status, save_dir, _ = train("gpt2", tmp_path, *QUICK, "--enable-tracing", "--trace-output-dir",
                                str(tmp_path / "outputs"), "--no-save-initial")
    assert status == 0
    assert info(save_dir / "final_model")["step"] == 24  # wait 10 (timed) + warmup 1 + active 3 + 10 timed after
    trace_dir = tmp_path / "outputs" / "gpt2-tiny_1cpu"
    assert {"host.0.json", "device.0.json", "run.json"} <= {p.name for p in trace_dir.iterdir()}
    run = json.loads((trace_dir / "run.json").read_text())
    assert run["traced_steps"] == [11, 12, 13] and run["untraced_steps"] == [*range(0, 10), *range(14, 24)]
    assert "gpt2-tiny" in json.dumps(run) and "64" in json.dumps(run)


def test_test_mode_runs_ten_steps(tmp_path):
    status, save_dir, _ = train("bert", tmp_path, *QUICK, "--test", "--no-save-initial", "--eval-steps", "0")
    assert status == 0 and info(save_dir / "final_model")["step"] == 10


# ---- failures ---------------------------------------------------------------------------------------------------
def test_nan_loss_stops_with_a_clear_error_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    status, save_dir, _ = train("gpt2", tmp_path, *QUICK, "--learning-rate", "1e30", "--warmup-steps", "0",
                                "--max-steps", "10", "--save-steps", "1", "--no-save-initial")
    assert status == 1
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and "loss is nan at step 2" in errors[0]
    assert f"Last good checkpoint: {save_dir / 'checkpoint-1'}" in errors[0]
    assert sorted(p.name for p in save_dir.iterdir()) == ["checkpoint-1"]  # no NaN checkpoint, no final model
    assert torch.isfinite(torch.tensor(info(save_dir / "checkpoint-1")["loss"]))


def test_cuda_out_of_memory_names_the_flags_to_lower(tmp_path, capsys, monkeypatch):
    def out_of_memory(self, accumulation):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(Trainer, "_optimizer_step", out_of_memory)
    status, _, _ = train("gpt2", tmp_path, *QUICK, "--max-steps", "2", "--no-save-initial")
    assert status == 1
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and errors[0].startswith("error: CUDA out of memory")
    for flag in ("--batch-size 4", "--max-seq-length 64", "--gradient-accumulation-steps", "--precision"):
        assert flag in errors[0]


@pytest.mark.parametrize("flags, message", [
    (["--dataset-path", "{tmp}/bad.jsonl"], "{tmp}/bad.jsonl:2: not valid JSON"),
    (["--squad-file", "{tmp}/missing.json"], "{tmp}/missing.json: file not found (--squad-file)"),
    (["--model-name", "gpt3"], "--model-name 'gpt3': not one of gpt2, gpt2-medium, gpt2-large, gpt2-xl, tiny"),
    (["--model-name", "{tmp}"], "{tmp}: no config.json"),
    (["--num-gpus", "2"], "--num-gpus 2 but WORLD_SIZE is 1"),
    (["--precision", "fp16"], "--precision fp16 needs a CUDA GPU"),
    (["--resume-from", "{tmp}"], "{tmp}: not a resumable checkpoint"),
])
def test_bad_input_gives_one_error_line_and_a_nonzero_status(flags, message, tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n', encoding="utf-8")
    flags = [f.format(tmp=tmp_path) for f in flags]
    status, save_dir, _ = train("gpt2", tmp_path, *QUICK, "--max-steps", "2", *flags)
    captured = capsys.readouterr()
    assert status == 1
    errors = error_lines(captured.err)
    assert len(errors) == 1 and errors[0].startswith(f"error: {message.format(tmp=tmp_path)}"), captured.err
    assert "Traceback" not in captured.err
    assert not save_dir.exists() or not any(save_dir.iterdir())


@pytest.mark.parametrize("flags, message", [
    (["--enable-tracing", "--trace-active-steps", "0"], "--trace-active-steps must be at least 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    # were taken: -1 as "no clipping", a negative decay trained, a negative peak gave a negative MFU
    (["--max-grad-norm", "-1"], "--max-grad-norm must be at least 0, got -1.0"),
    (["--weight-decay", "-5"], "--weight-decay must be at least 0, got -5.0"),
    (["--weight-decay", "nan"], "--weight-decay must be a number, got nan"),
    (["--peak-tflops", "-3"], "--peak-tflops must be a positive number, got -3.0"),
    (["--learning-rate", "inf"], "--learning-rate must be a positive number, got inf"),
    # NumPy's seed is one 32-bit word: set_seed had raised a traceback after the folders were made
    (["--seed", "4294967296"], "--seed must be at most 4294967295, got 4294967296"),
])
def test_a_flag_value_that_can_never_work_is_refused_while_parsing_before_anything_starts(flags, message, tmp_path,
                                                                                            capsys):
    with pytest.raises(SystemExit) as stopped:
        train("gpt2", tmp_path, *QUICK, *flags)
    [line] = capsys.readouterr().err.splitlines()
    assert stopped.value.code == 2 and line.startswith(f"error: {message}") and "gpt2/train.py --help" in line, line
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "logs").exists()


def test_bad_model_name_exits_nonzero_from_the_command_line():
    result = subprocess.run([sys.executable, "bert/train.py", "--model-name", "bert-huge"], cwd=REPO_ROOT,
                            env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: --model-name 'bert-huge': not one of bert-base-uncased, bert-large-uncased, tiny, "
        "and not a directory with a config.json"]


# ---- speed and metric options -----------------------------------------------------------------------------------
def test_compiled_model_trains_and_saves_plain_transformers_checkpoints(tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel
    real_compile = torch.compile
    # Dynamo's eager backend: the same wrapping (OptimizedModule) without minutes of C++ code generation on a CPU.
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real_compile(model, backend="eager", **kw))
    status, save_dir, logs = train("gpt2", tmp_path, *QUICK, "--compile", "--max-steps", "2", "--no-save-initial",
                                   "--logging-steps", "1")
    assert status == 0 and sorted(logged_losses(logs)) == [1, 2]
    keys = load_file(save_dir / "final_model" / "model.safetensors")
    assert not any(key.startswith("_orig_mod") for key in keys)
    assert info(save_dir / "final_model")["arguments"]["compile"] is True
    GPT2LMHeadModel.from_pretrained(save_dir / "final_model")


@pytest.mark.slow
def test_wandb_logs_offline_without_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "")  # unset for the run; restored afterwards
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    status, _, log_dir = train("gpt2", tmp_path, *QUICK, "--report-to", "wandb", "--max-steps", "2",
                               "--no-save-initial", "--logging-steps", "1")
    assert status == 0
    runs = list((log_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and b"train/loss" in runs[0].read_bytes()


# ---- models -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family, name, parameters", [
    ("gpt2", "gpt2", 124_439_808), ("gpt2", "gpt2-medium", 354_823_168), ("gpt2", "gpt2-large", 774_030_080),
    ("gpt2", "gpt2-xl", 1_557_611_200), ("bert", "bert-base-uncased", 109_514_298),
    ("bert", "bert-large-uncased", 335_174_458)])
def test_named_sizes_have_the_published_parameter_counts(family, name, parameters):
    spec = gpt2.train.GPT2_FAMILY if family == "gpt2" else bert.train.BERT_FAMILY
    with torch.device("meta"):  # shapes only: no memory, no initialisation time
        model = spec.model_class(spec.resolve_config(name))
    assert sum(p.numel() for p in model.parameters()) == parameters


def test_local_config_directory_of_the_other_family_is_refused(tmp_path):
    from transformers import BertConfig
    from utils.errors import UsageError
    BertConfig(num_hidden_layers=1).save_pretrained(tmp_path)
    with pytest.raises(UsageError, match="model_type is 'bert', but gpt2/train.py trains 'gpt2' models"):
        gpt2.train.GPT2_FAMILY.resolve_config(str(tmp_path))
    assert bert.train.BERT_FAMILY.resolve_config(str(tmp_path)).num_hidden_layers == 1


def test_warnings_and_info_still_reach_the_console_while_the_progress_bar_is_shown(tmp_path, capsys):
    from utils.trainer import console_logging_around_bar, setup_logging, teardown_logging
    handlers = setup_logging(tmp_path, rank=0, world_size=1)  # binds capsys's stdout and stderr
    log = logging.getLogger("test_progress_bar")
    try:
        with console_logging_around_bar():
            log.info("step 3/10: loss 2.5")
            log.warning("SIGTERM: saving a checkpoint")
    finally:
        teardown_logging(handlers)
    captured = capsys.readouterr()
    assert "step 3/10: loss 2.5" in captured.out and "SIGTERM" not in captured.out
    assert "SIGTERM: saving a checkpoint" in captured.err
    assert all(type(h) is not logging.StreamHandler or not hasattr(h.stream, "stream") for h in handlers)
