"""Training faults: damaged, foreign or planted checkpoints, unwritable or shared output folders, a full disk and
signals each end in one clear line, run no planted code and lose no run (issue 10; the corpus that counts them is
tests/faults/training_corpus.py)."""
import errno
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from faults.training_corpus import (LOCK_FILE, can_mount, dead_pid, launcher_command, read_only_prefix,  # noqa: E402
                                    run, small_disk_prefix, torchrun_command, train_command, truncate,
                                    write_code_running_pickle, write_lock_file)
from test_training import (ENTRY, QUICK, error_lines, info, offline, offline_single_thread,  # noqa: E402,F401
                           train)  # offline: the autouse fixture of test_training.py, here too

import utils.trainer  # noqa: E402
from utils.trainer import Trainer  # noqa: E402

TWO_STEPS = [*QUICK, "--max-steps", "2"]


@pytest.fixture(scope="module")
def finished_gpt2(tmp_path_factory):
    """A finished 2-step tiny GPT-2 run: initial_model, checkpoint-1, checkpoint-2, best_model, final_model."""
    tmp = tmp_path_factory.mktemp("finished_gpt2")
    with offline_single_thread():
        status, save_dir, _ = train("gpt2", tmp, *TWO_STEPS, "--save-steps", "1")
    assert status == 0
    return save_dir


@pytest.fixture(scope="module")
def finished_bert(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("finished_bert")
    with offline_single_thread():
        status, save_dir, _ = train("bert", tmp, *TWO_STEPS, "--save-steps", "1", "--no-save-initial")
    assert status == 0
    return save_dir


def copy_checkpoint(source: Path, tmp_path: Path, name: str = "checkpoint-1") -> Path:
    copy = tmp_path / "resume-from"
    shutil.copytree(source / name, copy)
    return copy


def fails_with_one_line(status, capsys, *expected) -> str:
    captured = capsys.readouterr()
    errors = error_lines(captured.err)
    assert status == 1 and len(errors) == 1, captured.err
    assert "Traceback" not in captured.err + captured.out
    for text in expected:
        assert text in errors[0], errors[0]
    return errors[0]


# ---- planted code ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("state_file", ["trainer_state.pt", "rng_state.pt"])
def test_code_planted_in_a_checkpoint_is_refused_and_never_runs(state_file, finished_gpt2, tmp_path, capsys):
    checkpoint = copy_checkpoint(finished_gpt2, tmp_path)
    marker = tmp_path / "planted-code-ran"
    write_code_running_pickle(checkpoint / state_file, marker)
    status, save_dir, _ = train("gpt2", tmp_path, *TWO_STEPS, "--resume-from", str(checkpoint))
    error = fails_with_one_line(status, capsys, f"{checkpoint / state_file}: refused", "system")
    assert not marker.exists(), error
    assert not any(p.name.startswith("checkpoint-") for p in save_dir.iterdir())


def test_resume_state_is_written_as_plain_data_that_loads_with_weights_only(finished_gpt2):
    for name in ("trainer_state.pt", "rng_state.pt"):
        state = torch.load(finished_gpt2 / "checkpoint-1" / name, weights_only=True)
        assert state
    [rank0] = torch.load(finished_gpt2 / "checkpoint-1" / "rng_state.pt", weights_only=True)
    assert set(rank0) >= {"python", "numpy", "torch"}


def test_checkpoint_of_an_earlier_version_resumes_to_the_same_weights(finished_gpt2, tmp_path):
    """rng_state.pt written before this change held NumPy arrays: still loaded (as arrays only), same result."""
    import numpy as np
    current = copy_checkpoint(finished_gpt2, tmp_path / "current")
    legacy = copy_checkpoint(finished_gpt2, tmp_path / "legacy")
    states = torch.load(legacy / "rng_state.pt", weights_only=True)
    for state in states:
        kind, key, *rest = state["numpy"]
        state["numpy"] = (kind, key.numpy().astype(np.uint32), *rest)
    torch.save(states, legacy / "rng_state.pt")
    flags = [*QUICK, "--max-steps", "3", "--no-save-initial"]
    assert train("gpt2", tmp_path / "current", *flags, "--resume-from", str(current))[0] == 0
    assert train("gpt2", tmp_path / "legacy", *flags, "--resume-from", str(legacy))[0] == 0
    assert (info(tmp_path / "legacy" / "ckpt" / "final_model")["weights_sha256"]
            == info(tmp_path / "current" / "ckpt" / "final_model")["weights_sha256"])


# ---- damaged and foreign checkpoints ----------------------------------------------------------------------------
def _drop_tokenizer(checkpoint: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        (checkpoint / name).unlink(missing_ok=True)


DAMAGE = {
    "truncated model.safetensors": ("model.safetensors", truncate, "damaged or cut off"),
    "empty model.safetensors": ("model.safetensors", lambda p: p.write_bytes(b""), "empty (0 bytes)"),
    "missing model.safetensors": ("model.safetensors", Path.unlink, "missing"),
    "truncated trainer_state.pt": ("trainer_state.pt", truncate, "damaged or cut off"),
    "empty trainer_state.pt": ("trainer_state.pt", lambda p: p.write_bytes(b""), "empty (0 bytes)"),
    "truncated rng_state.pt": ("rng_state.pt", truncate, "damaged or cut off"),
    "invalid config.json": ("config.json", lambda p: p.write_text('{"model_type": "gpt2",'), "not valid JSON"),
    "config.json not an object": ("config.json", lambda p: p.write_text("[]"), "not a JSON object"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_checkpoint_names_the_file_before_anything_trains(damage, finished_gpt2, tmp_path, capsys):
    name, how, problem = DAMAGE[damage]
    checkpoint = copy_checkpoint(finished_gpt2, tmp_path)
    how(checkpoint / name)
    status, save_dir, log_dir = train("gpt2", tmp_path, *TWO_STEPS, "--resume-from", str(checkpoint))
    fails_with_one_line(status, capsys, f"error: {checkpoint / name}: {problem}")
    assert not log_dir.exists()  # refused while checking the flags: no process group, no logs, no steps


def test_cut_off_shard_of_sharded_weights_is_named(finished_gpt2, tmp_path):
    from transformers import GPT2LMHeadModel
    from utils.checkpointing import check_resumable
    from utils.errors import CheckpointError
    checkpoint = copy_checkpoint(finished_gpt2, tmp_path)
    (checkpoint / "model.safetensors").unlink()
    GPT2LMHeadModel.from_pretrained(finished_gpt2 / "checkpoint-1").save_pretrained(checkpoint, max_shard_size="300KB")
    shards = sorted(checkpoint.glob("model-*.safetensors"))
    assert len(shards) > 1 and (checkpoint / "model.safetensors.index.json").is_file()
    check_resumable(checkpoint, model_type="gpt2")
    truncate(shards[-1])
    with pytest.raises(CheckpointError, match=f"^{shards[-1]}: damaged or cut off"):
        check_resumable(checkpoint, model_type="gpt2")


def test_checkpoint_without_tokenizer_files_asks_for_the_tokenizer(finished_gpt2, tmp_path, capsys):
    checkpoint = copy_checkpoint(finished_gpt2, tmp_path)
    _drop_tokenizer(checkpoint)
    status, _, _ = train("gpt2", tmp_path, *TWO_STEPS, "--resume-from", str(checkpoint))
    error = fails_with_one_line(status, capsys, f"{checkpoint}: no tokenizer files", "--tokenizer-path")
    assert "validation split" not in error


def test_checkpoint_without_tokenizer_files_resumes_with_tokenizer_path(finished_gpt2, tmp_path):
    checkpoint = copy_checkpoint(finished_gpt2, tmp_path)
    _drop_tokenizer(checkpoint)
    status, save_dir, _ = train("gpt2", tmp_path, *QUICK, "--max-steps", "2", "--resume-from", str(checkpoint),
                                "--tokenizer-path", str(finished_gpt2 / "final_model"))
    assert status == 0 and info(save_dir / "final_model")["step"] == 2


def _tokenizer_with_one_more_token(checkpoint: Path, folder: Path) -> None:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.add_tokens(["<one-more-token>"])
    tokenizer.save_pretrained(folder)


def _tokenizer_with_two_ids_swapped(checkpoint: Path, folder: Path) -> None:
    """As many tokens as the checkpoint's tokenizer, but two words map to each other's ids."""
    shutil.copytree(checkpoint, folder, ignore=lambda _, names: [n for n in names if not n.startswith("tokenizer")])
    document = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = document["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (folder / "tokenizer.json").write_text(json.dumps(document), encoding="utf-8")


@pytest.mark.parametrize("other_tokenizer, expected", [
    (_tokenizer_with_one_more_token, "has {rows_plus_one} tokens, but the model of --resume-from {checkpoint} has "
                                     "{rows}: not the tokenizer it was trained with"),
    (_tokenizer_with_two_ids_swapped, "its vocabulary differs from the tokenizer saved in --resume-from {checkpoint}"),
], ids=["one more token", "two ids swapped"])
def test_resuming_with_another_tokenizer_than_the_checkpoints_is_refused(other_tokenizer, expected, finished_gpt2,
                                                                         tmp_path, capsys):
    from transformers import AutoConfig
    checkpoint = copy_checkpoint(finished_gpt2, tmp_path)
    other = tmp_path / "other-tokenizer"
    other_tokenizer(checkpoint, other)
    rows = AutoConfig.from_pretrained(checkpoint).vocab_size
    status, save_dir, _ = train("gpt2", tmp_path, *TWO_STEPS, "--max-steps", "3", "--resume-from", str(checkpoint),
                                "--tokenizer-path", str(other))
    fails_with_one_line(status, capsys, f"error: --tokenizer-path {other}: "
                        + expected.format(rows=rows, rows_plus_one=rows + 1, checkpoint=checkpoint))
    assert not (save_dir / "final_model").exists()


@pytest.mark.parametrize("saved, resumed_by", [("bert", "gpt2"), ("gpt2", "bert")])
def test_checkpoint_of_the_other_model_family_is_refused(saved, resumed_by, finished_gpt2, finished_bert, tmp_path,
                                                        capsys):
    checkpoint = copy_checkpoint(finished_gpt2 if saved == "gpt2" else finished_bert, tmp_path)
    status, _, _ = train(resumed_by, tmp_path, *TWO_STEPS, "--resume-from", str(checkpoint))
    fails_with_one_line(status, capsys, f"a '{saved}' checkpoint, but {resumed_by}/train.py trains '{resumed_by}' models",
                        f"resume it with {saved}/train.py")


def test_a_checkpoint_config_without_model_type_is_named_as_such(finished_gpt2, tmp_path, capsys):
    """config.json of {}: the refusal had called it "a None checkpoint"."""
    checkpoint = copy_checkpoint(finished_gpt2, tmp_path)
    (checkpoint / "config.json").write_text("{}")
    status, _, _ = train("gpt2", tmp_path, *TWO_STEPS, "--resume-from", str(checkpoint))
    fails_with_one_line(status, capsys, f"{checkpoint}/config.json: has no model_type, so it is no checkpoint "
                        "gpt2/train.py saved; resume from one it saved")


def test_a_checkpoint_without_its_rng_state_says_the_file_is_missing(finished_gpt2, tmp_path, capsys):
    """rng_state.pt deleted: the warning had said the checkpoint "holds RNG state for 0 rank(s)"."""
    checkpoint = copy_checkpoint(finished_gpt2, tmp_path)
    (checkpoint / "rng_state.pt").unlink()
    status, _, _ = train("gpt2", tmp_path, *TWO_STEPS, "--max-steps", "2", "--resume-from", str(checkpoint))
    assert status == 0
    assert (f"{checkpoint} has no rng_state.pt: dropout and masking will not repeat the original run"
            in capsys.readouterr().err)


# ---- output folders ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--save-dir", "--log-dir", "--trace-output-dir"])
def test_output_folder_that_is_a_file_fails_before_the_first_step(flag, tmp_path, capsys):
    folders = {"--save-dir": tmp_path / "ckpt", "--log-dir": tmp_path / "logs", "--trace-output-dir": tmp_path / "out"}
    folders[flag].write_text("a file\n")
    status = ENTRY["gpt2"]([*QUICK, "--enable-tracing", "--max-steps", "4", "--save-steps", "1",
                            *[x for f, path in folders.items() for x in (f, str(path))]])
    fails_with_one_line(status, capsys, f"{flag} {folders[flag]}: is a file, not a folder")
    assert not (tmp_path / "ckpt").is_dir() or not any((tmp_path / "ckpt").iterdir())


@pytest.mark.parametrize("trace_name", [None, "my-trace"])
def test_trace_folder_that_is_a_file_fails_before_the_first_step(trace_name, tmp_path, capsys):
    from utils.chakra_tracer import default_trace_name
    out = tmp_path / "out"
    out.mkdir()
    name = trace_name or default_trace_name("gpt2-tiny", 1, "cuda" if torch.cuda.is_available() else "cpu")
    (out / name).write_text("a file\n")
    named = ["--trace-name", trace_name] if trace_name else []
    status, save_dir, _ = train("gpt2", tmp_path, *QUICK, "--enable-tracing", "--max-steps", "4",
                                "--trace-output-dir", str(out), *named)
    fails_with_one_line(status, capsys, f"--trace-output-dir {out}: {out / name} is a file, not a folder",
                        "--trace-name")
    assert (out / name).read_text() == "a file\n"
    assert not save_dir.is_dir() or not any(save_dir.iterdir())


needs_read_only = pytest.mark.skipif(os.geteuid() == 0 and not can_mount(),
                                     reason="as root a read-only folder needs a private mount namespace (unshare)")


@pytest.mark.slow
@needs_read_only
@pytest.mark.parametrize("flag", ["--save-dir", "--log-dir", "--trace-output-dir"])
def test_read_only_output_folder_fails_before_the_first_step(flag, tmp_path):
    folders = {"--save-dir": tmp_path / "ckpt", "--log-dir": tmp_path / "logs", "--trace-output-dir": tmp_path / "out"}
    folders[flag].mkdir()
    prefix = read_only_prefix(folders[flag]) if os.geteuid() == 0 else ()
    if not prefix:
        folders[flag].chmod(0o555)
    try:
        done = run(train_command("gpt2", folders["--save-dir"], folders["--log-dir"], "--max-steps", "4",
                                 "--save-steps", "1", "--enable-tracing", "--trace-output-dir", folders["--trace-output-dir"]),
                   prefix=prefix)
    finally:
        folders[flag].chmod(0o755)
    assert done.status == 1 and not done.has_traceback, done.stderr
    assert done.error_lines == [f"error: {flag} {folders[flag]}: cannot write there "
                                f"({'Read-only file system' if prefix else 'Permission denied'})"]
    assert done.trained_steps() == 0


# ---- one run per save dir ---------------------------------------------------------------------------------------
def test_save_dir_in_use_by_a_live_run_is_refused(tmp_path, capsys):
    from utils.checkpointing import SaveDirLock
    with SaveDirLock(tmp_path / "ckpt") as holder:  # this process stands in for the other run
        holder.acquire()
        status, save_dir, _ = train("gpt2", tmp_path, *TWO_STEPS)
        fails_with_one_line(status, capsys, f"--save-dir {save_dir}: another run (pid {os.getpid()} on",
                            "is writing checkpoints there", LOCK_FILE)
        assert sorted(p.name for p in save_dir.iterdir()) == [LOCK_FILE]


def test_save_dir_of_a_finished_run_is_refused_without_overwrite_output_dir(finished_gpt2, tmp_path, capsys):
    save_dir = tmp_path / "ckpt"
    shutil.copytree(finished_gpt2, save_dir)
    before = info(save_dir / "final_model")
    status, _, _ = train("gpt2", tmp_path, *QUICK, "--max-steps", "3", "--seed", "7")
    fails_with_one_line(status, capsys, f"--save-dir {save_dir}: holds the checkpoints of an earlier run",
                        f"resume with --resume-from {save_dir / 'checkpoint-2'}", "--overwrite-output-dir")
    assert info(save_dir / "final_model") == before and not (save_dir / LOCK_FILE).exists()


def test_overwrite_output_dir_reuses_a_save_dir_deliberately(finished_gpt2, tmp_path):
    shutil.copytree(finished_gpt2, tmp_path / "ckpt")
    status, save_dir, _ = train("gpt2", tmp_path, *QUICK, "--max-steps", "3", "--overwrite-output-dir")
    assert status == 0 and info(save_dir / "final_model")["step"] == 3


def test_overwrite_output_dir_moves_every_folder_of_the_earlier_run_aside(finished_gpt2, tmp_path, capsys):
    """Nothing of the earlier run stays beside the new one's (its checkpoint-2 or final_model would pass for this
    run's); it is kept in .previous/ until the next --overwrite-output-dir replaces it."""
    save_dir = tmp_path / "ckpt"
    shutil.copytree(finished_gpt2, save_dir)
    earlier = sorted(p.name for p in save_dir.iterdir())
    one_step = [*QUICK, "--max-steps", "1", "--save-steps", "0", "--no-save-initial", "--overwrite-output-dir"]
    assert train("gpt2", tmp_path, *one_step)[0] == 0
    assert f"--overwrite-output-dir: moved the earlier run's {', '.join(earlier)} from {save_dir} into " \
           f"{save_dir / '.previous'}" in capsys.readouterr().err
    assert sorted(p.name for p in save_dir.iterdir() if not p.name.startswith(".")) == ["best_model", "final_model"]
    assert info(save_dir / "final_model")["step"] == info(save_dir / "best_model")["step"] == 1
    assert sorted(p.name for p in (save_dir / ".previous").iterdir()) == earlier
    assert info(save_dir / ".previous" / "final_model")["step"] == 2

    assert train("gpt2", tmp_path, *one_step)[0] == 0  # the next overwrite keeps only the run it replaces
    assert "(deleting the run kept there before)" in capsys.readouterr().err
    assert sorted(p.name for p in (save_dir / ".previous").iterdir()) == ["best_model", "final_model"]
    assert info(save_dir / ".previous" / "final_model")["step"] == 1


def test_resuming_from_a_checkpoint_of_the_save_dir_needs_no_flag(finished_gpt2, tmp_path):
    shutil.copytree(finished_gpt2, tmp_path / "ckpt")
    status, save_dir, _ = train("gpt2", tmp_path, *QUICK, "--max-steps", "3", "--resume-from",
                                str(tmp_path / "ckpt" / "checkpoint-2"))
    assert status == 0 and info(save_dir / "final_model")["step"] == 3


def test_lock_of_a_dead_run_is_taken_over_with_a_warning(tmp_path, capsys):
    pid = dead_pid()
    write_lock_file(tmp_path / "ckpt", pid)
    status, save_dir, _ = train("gpt2", tmp_path, *TWO_STEPS, "--no-save-initial")
    assert status == 0
    assert f"took over the lock of pid {pid}" in capsys.readouterr().err
    assert not (save_dir / LOCK_FILE).exists()  # released at the end


def test_without_flock_the_lock_holders_pid_decides(tmp_path, monkeypatch):
    import utils.checkpointing
    from utils.checkpointing import SaveDirLock
    from utils.errors import UsageError
    monkeypatch.setattr(utils.checkpointing, "fcntl", None)  # a file system or platform without flock
    write_lock_file(tmp_path, os.getpid())
    with pytest.raises(UsageError, match=f"pid {os.getpid()} on .* if that run is gone, delete the lock file"):
        SaveDirLock(tmp_path).acquire()
    pid = dead_pid()
    write_lock_file(tmp_path, pid)
    with SaveDirLock(tmp_path) as lock:
        assert lock.acquire()["pid"] == pid
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not (tmp_path / LOCK_FILE).exists()


def test_partial_folders_of_a_killed_save_are_cleaned_up_and_a_moved_aside_best_model_restored(finished_gpt2,
                                                                                               tmp_path, capsys):
    save_dir = tmp_path / "ckpt"
    shutil.copytree(finished_gpt2, save_dir)
    pid = dead_pid()
    shutil.copytree(save_dir / "checkpoint-2", save_dir / f".checkpoint-3.tmp-{pid}")  # killed mid-write
    truncate(save_dir / f".checkpoint-3.tmp-{pid}" / "model.safetensors")
    (save_dir / "best_model").rename(save_dir / f".best_model.old-{pid}")  # killed between the two renames
    status, _, _ = train("gpt2", tmp_path, *TWO_STEPS, "--resume-from", str(save_dir / "checkpoint-2"))
    assert status == 0
    assert not [p.name for p in save_dir.iterdir() if p.name.startswith(".")]
    assert info(save_dir / "best_model")["kind"] == "best"
    out = capsys.readouterr().out
    assert f"removed .checkpoint-3.tmp-{pid}" in out and f"restored best_model/ from .best_model.old-{pid}/" in out


# ---- the step plan: epochs and the trace window ------------------------------------------------------------------
@pytest.mark.parametrize("steps, window, left, enough", [
    ("4", ("1", "1", "1"), 2, 5),   # fewer steps left after the checkpoint than the window
    ("2", ("0", "0", "1"), 0, 3),   # the checkpoint is already at the planned last step
])
def test_resumed_run_with_fewer_steps_left_than_the_trace_window_is_refused(steps, window, left, enough,
                                                                           finished_gpt2, tmp_path, capsys):
    checkpoint = copy_checkpoint(finished_gpt2, tmp_path, "checkpoint-2")
    out = tmp_path / "out"
    wait, warmup, active = window
    status, save_dir, _ = train("gpt2", tmp_path, *QUICK, "--max-steps", steps, "--resume-from", str(checkpoint),
                                "--enable-tracing", "--trace-output-dir", str(out), "--trace-wait-steps", wait,
                                "--trace-warmup-steps", warmup, "--trace-active-steps", active,
                                "--trace-after-steps", "1")  # a step timed untraced after the window
    fails_with_one_line(status, capsys, f"--resume-from {checkpoint}: resumes at step 2 of {steps}, leaving {left} "
                        f"step(s), fewer than the trace window of {sum(map(int, window))}",
                        f"raise --max-steps to at least {enough}")
    assert not out.exists() or not any(out.iterdir())
    assert not (save_dir / "final_model").exists()


def test_a_resumed_traced_run_runs_its_window_and_after_steps_from_the_checkpoint(finished_gpt2, tmp_path):
    """Without --max-steps a traced run stops after its window and the untraced steps timed after it, counted from
    the step it resumes at: it had stopped at the window's length from step 0, timing none of its after-steps."""
    checkpoint = copy_checkpoint(finished_gpt2, tmp_path, "checkpoint-2")
    out = tmp_path / "out"
    status, save_dir, _ = train("gpt2", tmp_path, *QUICK, "--resume-from", str(checkpoint), "--enable-tracing",
                                "--trace-output-dir", str(out), "--trace-wait-steps", "3", "--no-save-initial")
    assert status == 0
    assert info(save_dir / "final_model")["step"] == 2 + 3 + 1 + 3 + 3  # resumed + wait + warmup + active + after
    [run_json] = out.glob("*/run.json")
    run = json.loads(run_json.read_text())
    assert run["traced_steps"] == [4, 5, 6] and run["untraced_steps"] == [0, 1, 2, 7, 8, 9]


def test_num_epochs_trains_whole_epochs_when_accumulation_leaves_micro_batches_over(tmp_path):
    """The last optimizer step of an epoch takes the micro-batches left, as transformers.Trainer does."""
    status, save_dir, log_dir = train("gpt2", tmp_path, *QUICK, "--batch-size", "16", "--gradient-accumulation-steps",
                                      "10", "--num-epochs", "2", "--save-steps", "0", "--eval-steps", "0",
                                      "--no-save-initial", "--logging-steps", "1")
    assert status == 0
    final = info(save_dir / "final_model")
    batches = torch.load(save_dir / "final_model" / "trainer_state.pt", weights_only=True)["data"]["batches_per_epoch"]
    assert batches % 10 != 0  # what this test is about: the epoch does not split into whole optimizer steps
    per_epoch = -(-batches // 10)
    assert final["step"] == 2 * per_epoch and final["epoch"] == 2.0
    assert final["tokens_seen"] == 2 * batches * 16 * 64
    assert final["learning_rate"] == 0.0  # the schedule's end is the run's end
    log = (log_dir / "training_rank_0.log").read_text()
    assert f"step {per_epoch}/{2 * per_epoch} | epoch 1.00 |" in log


def test_gradient_accumulation_beyond_an_epochs_batches_is_refused(tmp_path, capsys):
    status, save_dir, _ = train("gpt2", tmp_path, *QUICK, "--batch-size", "16", "--gradient-accumulation-steps",
                                "1000", "--num-epochs", "1", "--no-save-initial")
    fails_with_one_line(status, capsys, "--gradient-accumulation-steps 1000 is more than the ", " batches of an epoch",
                        "--batch-size 16 x 1 rank(s)")
    assert not (save_dir / "final_model").exists()


# ---- a full disk ------------------------------------------------------------------------------------------------
def test_full_disk_during_a_save_names_the_last_good_checkpoint_and_leaves_no_partial_folder(tmp_path, capsys,
                                                                                              monkeypatch):
    real_save = torch.save

    def disk_fills_at_checkpoint_2(obj, f, *args, **kwargs):
        if "checkpoint-2" in str(f):
            Path(f).write_bytes(b"\0" * 1000)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_fills_at_checkpoint_2)
    status, save_dir, _ = train("gpt2", tmp_path, *QUICK, "--max-steps", "4", "--save-steps", "1", "--no-save-initial")
    fails_with_one_line(status, capsys, f"{save_dir / 'checkpoint-2'}: could not write the checkpoint: the disk is full",
                        f"the last good checkpoint is {save_dir / 'checkpoint-1'}",
                        f"--resume-from {save_dir / 'checkpoint-1'}")
    assert sorted(p.name for p in save_dir.iterdir()) == ["checkpoint-1"]


@pytest.mark.slow
@pytest.mark.skipif(not can_mount(), reason="needs root and unshare for a small tmpfs")
def test_full_disk_for_real_names_the_last_good_checkpoint(tmp_path):
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    done = run(train_command("gpt2", save_dir, tmp_path / "logs", "--max-steps", "4", "--save-steps", "1",
                             "--no-save-initial", "--eval-steps", "0"), prefix=small_disk_prefix(save_dir, "4500k"))
    assert done.status == 1 and not done.has_traceback, done.stderr
    [error] = done.error_lines
    assert f"{save_dir / 'checkpoint-2'}: could not write the checkpoint: the disk is full" in error
    assert f"--resume-from {save_dir / 'checkpoint-1'}" in error


class FullDisk:
    """A file object on a full disk: every write fails with ENOSPC."""

    def write(self, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self):
        pass

    def close(self):
        pass


def test_log_file_that_cannot_be_written_warns_once_and_training_goes_on(tmp_path, capsys):
    from utils.trainer import setup_logging, teardown_logging
    handlers = setup_logging(tmp_path, rank=0, world_size=1)
    handlers[0].stream.close()
    handlers[0].stream = FullDisk()
    log = logging.getLogger("test_full_log_dir")
    try:
        log.info("step 1/10")
        log.info("step 2/10")
    finally:
        teardown_logging(handlers)
    captured = capsys.readouterr()
    assert "Logging error" not in captured.err and "Traceback" not in captured.err
    assert captured.err.count(f"{tmp_path / 'training_rank_0.log'}: cannot write the log file "
                              "(No space left on device); logging to the console only") == 1
    assert "step 2/10" in captured.out


def test_tensorboard_on_a_disk_that_fills_mid_run_warns_once_and_training_goes_on(tmp_path, capfd, caplog):
    """TensorBoard's writer thread re-raises the failed write (Python prints that thread's traceback), and the next
    add_scalar raises it again: one warning instead, and no more events."""
    pytest.importorskip("tensorboard")
    from utils.metrics import MetricSinks
    sinks = MetricSinks("tensorboard", tmp_path, "run", {}, enabled=True)
    sinks.log({"train/loss": 7.0}, step=1)
    sinks.tensorboard.file_writer.event_writer._async_writer._writer._writer = FullDisk()  # the events file
    with caplog.at_level(logging.WARNING):
        for step in range(2, 6):
            sinks.log({"train/loss": 7.0}, step=step)
            time.sleep(0.2)  # the writer thread takes the event off its queue and fails
        sinks.close()
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err and "Exception in thread" not in captured.err
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"{sinks.tensorboard_dir}: cannot write TensorBoard events (No space left on device); "
                        "TensorBoard logging stopped, training goes on"]
    assert sinks.tensorboard_dir.parent == tmp_path / "tensorboard" / "run"


def test_each_run_writes_its_tensorboard_events_into_a_folder_of_its_own(tmp_path):
    """Every run into one --log-dir (reruns, failed runs) had added its events to tensorboard/<model>/, which
    TensorBoard draws as one curve going back and forth over the same steps."""
    pytest.importorskip("tensorboard")
    from utils.metrics import MetricSinks
    folders = []
    for _ in range(2):
        sinks = MetricSinks("tensorboard", tmp_path, "run", {}, enabled=True)
        sinks.log({"train/loss": 7.0}, step=1)
        sinks.close()
        folders.append(sinks.tensorboard_dir)
        time.sleep(1.1)  # the folder's name has the start time to the second
    assert folders[0] != folders[1] and all(f.parent == tmp_path / "tensorboard" / "run" for f in folders)
    assert all(len(list(f.glob("events.out.tfevents.*"))) == 1 for f in folders)


def test_tensorboard_folder_that_cannot_be_made_costs_the_curves_not_the_run(tmp_path, caplog):
    pytest.importorskip("tensorboard")
    from utils.metrics import MetricSinks
    (tmp_path / "tensorboard").write_text("a file where the folder should be\n")
    with caplog.at_level(logging.WARNING):
        sinks = MetricSinks("tensorboard", tmp_path, "run", {}, enabled=True)
    sinks.log({"train/loss": 7.0}, step=1)
    sinks.close()
    assert sinks.tensorboard is None
    assert any("cannot write TensorBoard events" in r.getMessage() for r in caplog.records)


def test_tokenizer_cache_half_written_by_a_killed_run_is_removed(tmp_path, caplog):
    from utils.tokenization import TokenizerRequest, trained_tokenizer
    partial = tmp_path / f".gpt2-byte-level-bpe-300-0123456789ab-tok0.0.tmp-{dead_pid()}"
    partial.mkdir()
    (partial / "vocab.json").write_text("{")
    live = tmp_path / f".gpt2-byte-level-bpe-300-0123456789ab-tok0.0.tmp-{os.getpid()}"  # a run saving now
    live.mkdir()
    request = TokenizerRequest("gpt2", "byte-level-bpe", "tiny", None, 300)
    with caplog.at_level(logging.INFO):
        tokenizer, cache_dir = trained_tokenizer(request, ["the cat sat on the mat"] * 20, cache_root=tmp_path)
    assert not partial.exists() and live.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([cache_dir.name, live.name])
    assert f"removed {partial} (a tokenizer cache left half-written by a stopped run)" in caplog.text


# ---- signals ----------------------------------------------------------------------------------------------------
def test_ctrl_c_during_setup_says_nothing_was_saved(tmp_path, capsys, monkeypatch):
    def interrupted(self):
        raise KeyboardInterrupt
    monkeypatch.setattr(Trainer, "setup", interrupted)
    status, _, _ = train("gpt2", tmp_path, *TWO_STEPS)
    captured = capsys.readouterr()
    assert status == 130 and "Traceback" not in captured.err
    assert error_lines(captured.err) == ["error: interrupted by Ctrl-C before training started: nothing was saved"]


def test_second_ctrl_c_stops_at_once_and_names_the_last_checkpoint(tmp_path, capsys, monkeypatch):
    step = Trainer._optimizer_step

    def ctrl_c_twice_in_step_3(self, accumulation):
        result = step(self, accumulation)
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(Trainer, "_optimizer_step", ctrl_c_twice_in_step_3)
    status, save_dir, _ = train("gpt2", tmp_path, *QUICK, "--max-steps", "10", "--save-steps", "2",
                                "--no-save-initial")
    captured = capsys.readouterr()
    assert status == 130 and "Traceback" not in captured.err
    assert error_lines(captured.err) == [
        f"error: interrupted by a second Ctrl-C at step 2: stopped at once; the last checkpoint is "
        f"{save_dir / 'checkpoint-2'} (step 2): resume with --resume-from {save_dir / 'checkpoint-2'}"]


def test_ctrl_c_during_the_final_save_still_finishes_it(tmp_path, monkeypatch):
    write = utils.trainer.write_checkpoint

    def ctrl_c_then_write(target, **kwargs):
        if Path(target).name == "final_model":
            os.kill(os.getpid(), signal.SIGINT)
        return write(target, **kwargs)

    monkeypatch.setattr(utils.trainer, "write_checkpoint", ctrl_c_then_write)
    status, save_dir, _ = train("gpt2", tmp_path, *TWO_STEPS, "--no-save-initial")
    assert status == 0 and info(save_dir / "final_model")["step"] == 2


def test_trace_error_is_one_line(tmp_path, capsys, monkeypatch):
    from utils.chakra_tracer import NullTracer, TraceError

    class FailingTracer(NullTracer):
        def __exit__(self, *exc):
            raise TraceError("outputs/x/host.0.json: 2 JSON objects concatenated")

    monkeypatch.setattr(utils.trainer, "build_tracer", lambda *a, **k: FailingTracer())
    status, _, _ = train("gpt2", tmp_path, *TWO_STEPS, "--no-save-initial")
    fails_with_one_line(status, capsys, "error: outputs/x/host.0.json: 2 JSON objects concatenated")


@pytest.mark.slow
@pytest.mark.parametrize("signum, when, expected", [
    # one second in, torch and transformers are still importing
    (signal.SIGINT, None, "error: interrupted by SIGINT while starting up; nothing was written"),
    (signal.SIGTERM, "SQuAD from the Hugging Face hub is not available",
     "error: interrupted by SIGTERM before training started: nothing was saved"),
])
def test_signal_before_training_gives_one_line(signum, when, expected, tmp_path):
    done = run(train_command("gpt2", tmp_path / "ckpt", tmp_path / "logs", "--max-steps", "400"),
               signals=(signum,), when=when, delay=1.0)
    assert done.status == 128 + signum and not done.has_traceback, done.stderr
    assert len(done.error_lines) == 1 and done.error_lines[0].startswith("error: interrupted by "), done.stderr
    assert done.error_lines[0] == expected or when is None  # a very fast machine may be past its imports


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_to_utils_torchrun_saves_on_every_rank_and_ends_in_one_line(tmp_path, signum):
    """SIGHUP too (a closed terminal, a dropped SSH session, to the whole process group): it ended every rank at once
    with no checkpoint, under torchrun's line that each was asked to save one."""
    launcher = [sys.executable, "-m", "utils.torchrun"]
    done = run(torchrun_command(launcher, "gpt2", tmp_path / "ckpt", tmp_path / "logs", "--max-steps", "400",
                                "--save-steps", "0", "--no-save-initial"), signals=(signum,), when=r"^step 2/")
    assert done.status == 128 + signum and not done.has_traceback, done.stderr[-3000:]
    assert done.error_lines == [f"error: torchrun stopped by {signal.Signals(signum).name}: every rank was asked to "
                                "save a checkpoint and stop (their lines above say where)"]
    [saved] = (tmp_path / "ckpt").glob("checkpoint-*")
    assert info(saved)["kind"] == "interrupted" and info(saved)["world_size"] == 2


@pytest.mark.slow
def test_a_launchers_sigterm_just_after_ctrl_c_is_not_a_second_signal_to_the_ranks(tmp_path):
    """Ctrl-C at a terminal reaches the launcher, torchrun and the ranks; the launcher then passes SIGTERM on to
    torchrun. torchrun had sent the ranks that too, and a second signal stops a rank at once, without its checkpoint."""
    launcher = [sys.executable, "-m", "utils.torchrun"]
    done = run(torchrun_command(launcher, "gpt2", tmp_path / "ckpt", tmp_path / "logs", "--max-steps", "400",
                                "--save-steps", "0", "--no-save-initial"), signals=(signal.SIGINT,),
               to_leader=(signal.SIGTERM,), when=r"^step 2/")
    assert done.status == 130 and not done.has_traceback, done.stderr[-3000:]
    assert done.error_lines == ["error: torchrun stopped by SIGINT: every rank was asked to save a checkpoint and "
                                "stop (their lines above say where)"]
    [saved] = (tmp_path / "ckpt").glob("checkpoint-*")
    assert info(saved)["kind"] == "interrupted" and info(saved)["world_size"] == 2


@pytest.mark.slow
def test_failing_rank_under_utils_torchrun_ends_without_a_traceback(tmp_path):
    done = run(torchrun_command([sys.executable, "-m", "utils.torchrun"], "gpt2", tmp_path / "ckpt",
                                tmp_path / "logs", "--max-steps", "2", "--dataset-path", tmp_path / "missing.jsonl"))
    assert done.status == 1 and not done.has_traceback, done.stderr[-3000:]
    assert "missing.jsonl" in done.error_lines[0]


def test_a_flag_train_py_refuses_under_the_launcher_names_no_log_it_did_not_write(tmp_path):
    """train.py refuses its flags before it logs anything: the launcher had pointed at training_rank_0.log and a
    per-rank logs folder that were never written, under torchrun's own `E... failed (exitcode: 2)` line. (The
    launcher checks the flags before it starts torchrun; LC_FLAGS_CHECKED, as its background child has it, skips
    that check, so a refusal still reaches the ranks here.)"""
    done = run(["env", "LC_FLAGS_CHECKED=1", *launcher_command("gpt2", tmp_path, "--seed", "-1", ranks=2,
                                                                max_steps=3)])
    assert done.status == 1 and not done.has_traceback, done.stderr[-3000:]
    assert "error: --seed must be at least 0, got -1" in done.stderr
    assert re.search(r"^error: torchrun: rank \d \(pid \d+\) refused its flags \(exit status 2\); its message is "
                     r"above$", done.stderr, re.M), done.stderr
    assert not re.search(r"^E\d{4} ", done.stderr, re.M), done.stderr
    assert "it wrote no log (its messages are above)" in done.stdout and "per-rank logs" not in done.stdout


def test_the_largest_seed_trains_on_every_rank(tmp_path):
    """Each rank seeds its dropout and masking with --seed + rank: rank 1 of --seed 4294967295 had raised NumPy's
    'Seed must be between 0 and 2**32 - 1' (and rank 0 called it a lost rank). The per-rank seed wraps around."""
    done = run(torchrun_command([sys.executable, "-m", "utils.torchrun"], "gpt2", tmp_path / "ckpt", tmp_path / "logs",
                                "--max-steps", "1", "--seed", "4294967295", "--no-save-initial"))
    assert done.status == 0 and not done.error_lines, done.stderr[-3000:]


@pytest.mark.parametrize("exit_code", [0, 3])
def test_utils_torchrun_leaves_no_folder_in_tmp(tmp_path, exit_code):
    """torchrun made a /tmp/torchelastic_* folder for every run and left it there (850 on one machine): under
    utils.torchrun the folder is removed when torchrun ends, whether the ranks succeeded or not, and a --log-dir
    given to torchrun is the user's, kept."""
    script = tmp_path / "rank.py"
    script.write_text(f"import sys\nprint('rank ran', flush=True)\nsys.exit({exit_code})\n")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = dict(os.environ, TMPDIR=str(scratch), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    env.pop("PET_LOG_DIR", None)  # torchrun's --log-dir from the environment (tests/conftest.py sets it)
    done = subprocess.run([sys.executable, "-m", "utils.torchrun", "--standalone", "--nproc_per_node=1", str(script),
                           "--log-dir", "not-torchruns"], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == (1 if exit_code else 0), done.stderr[-2000:]
    assert "rank ran" in done.stdout
    assert not list(scratch.glob("torchelastic_*")), list(scratch.iterdir())
    given = tmp_path / "torchruns-own"
    done = subprocess.run([sys.executable, "-m", "utils.torchrun", "--log-dir", str(given), "--standalone",
                           "--nproc_per_node=1", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == (1 if exit_code else 0) and given.is_dir() and list(given.iterdir())
    assert not list(scratch.glob("torchelastic_*"))


@pytest.mark.parametrize("flags, named", [(["--dataset-path", "missing.jsonl"], "missing.jsonl"),
                                          (["--batch-size", "0"], "--batch-size")])
def test_error_every_rank_hits_is_printed_even_when_rank_0_is_the_slowest(tmp_path, monkeypatch, flags, named):
    """Rank 0 alone prints an error every rank hits; had rank 1 failed first, torchrun would stop rank 0 before it
    printed. Here rank 0 starts 5 s late (a sitecustomize on PYTHONPATH), so rank 1 always fails first."""
    slow_start = tmp_path / "slow_rank_0"
    slow_start.mkdir()
    (slow_start / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('RANK') == '0':\n    time.sleep(5)\n")
    monkeypatch.setenv("PYTHONPATH", str(slow_start))
    flags = [str(tmp_path / flag) if flag.endswith(".jsonl") else flag for flag in flags]
    done = run(torchrun_command([sys.executable, "-m", "utils.torchrun"], "gpt2", tmp_path / "ckpt",
                                tmp_path / "logs", "--max-steps", "2", *flags))
    # a flag refused while parsing exits 2 under utils.torchrun as in one process; a missing file, found later, 1
    assert done.status == (2 if named.startswith("--") else 1) and not done.has_traceback, done.stderr[-3000:]
    assert named in done.error_lines[0] and "[rank 1]" not in done.stderr, done.stderr[-3000:]
    assert done.error_lines[1].startswith("error: torchrun: rank 0 "), done.error_lines


def waiting_rank_1(grace_s: float) -> dict:
    """subprocess arguments of a rank 1 under torchrun that hit an error every rank hits, with a grace of grace_s."""
    code = (f"import utils.errors as e; e.SHARED_ERROR_GRACE_S = {grace_s}; print('waiting', flush=True); "
            "e.wait_for_rank_zero_to_report('--dataset-path d.jsonl: no such file', 1)")
    env = dict(os.environ, TORCHELASTIC_RUN_ID="test", WORLD_SIZE="2", PYTHONPATH=str(Path(__file__).parents[1]))
    return dict(args=[sys.executable, "-c", code], env=env, text=True)


def test_rank_waiting_for_rank_0_is_stopped_quietly_by_torchrun():
    waiting = subprocess.Popen(**waiting_rank_1(60), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert waiting.stdout.readline() == "waiting\n"
    time.sleep(0.5)
    waiting.send_signal(signal.SIGTERM)  # what torchrun sends once rank 0 has failed
    out, err = waiting.communicate(timeout=30)
    assert waiting.returncode == -signal.SIGTERM and err == ""


def test_rank_0_that_never_fails_leaves_the_error_to_the_rank_that_hit_it():
    done = subprocess.run(**waiting_rank_1(0.2), capture_output=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "error: [rank 1] --dataset-path d.jsonl: no such file\n"
