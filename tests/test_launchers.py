"""The shell launchers: options, the torchrun commands they build, skips, background runs, and real CPU runs."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LAUNCHERS = ["run_gpt2.sh", "run_bert.sh", "run_gpt2_quick.sh", "run_bert_quick.sh",
             "run_all_profiling.sh", "run_all_experiments.sh"]


def cuda_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def launch(script: str, *args: str, env: dict | None = None, timeout: int = 120, cwd: Path = REPO):
    full_env = dict(os.environ)
    # The launchers' ensure_python_env then takes the interpreter running the tests instead of creating .venv.
    full_env.setdefault("PYTHON", sys.executable)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env or {})
    return subprocess.run([str(REPO / script), *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def this_machine() -> dict:
    """This machine as the probe would describe it (no GPU here), for real runs whose subject is not the probe."""
    import torch
    # at least 2 cores, so the two-rank runs are not skipped on a one-core CI machine
    return machine(gpus=cuda_count(), cores=max(2, os.cpu_count() or 1), torch_version=torch.__version__)


def free_port() -> int:
    """A free port outside the kernel's ephemeral range, where the --standalone runs of other tests bind theirs."""
    import random
    for _ in range(100):
        port = random.randint(20000, 30000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-30000")


def machine(gpus: int = 0, cores: int = 4, bf16: bool = True, torch_version: str = "2.4.0") -> dict:
    """Describe a machine to the launchers, as they describe this one to their background child (LC_PROBE_*).

    Skips the environment probe (a Python start importing torch, seconds each), and lets the tests check the
    commands for GPU machines that CI does not have. Tests marked "real probe" leave it out.
    """
    return {"LC_PROBED": "1", "PYTHON": os.environ.get("PYTHON", sys.executable), "LC_PROBE_TORCH": torch_version,
            "LC_PROBE_GPUS": str(gpus), "LC_PROBE_CUDA": "12.4" if gpus else "none",
            "LC_PROBE_BF16": "1" if gpus and bf16 else "0", "LC_PROBE_CORES": str(cores),
            "LC_PROBE_GPU_NAMES": ";".join(["NVIDIA H100 80GB HBM3"] * gpus)}


def torchrun_commands(stdout: str) -> list[list[str]]:
    """The printed commands ("$ env ... torchrun ..."), split as bash would."""
    return [shlex.split(line[2:]) for line in stdout.splitlines()
            if line.startswith("$ ") and ("torchrun" in line or "torch.distributed.run" in line)]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture
def squad_file(tmp_path) -> Path:
    """A small SQuAD v1.1 file, for runs that must not depend on the bundled sample."""
    paragraphs = [{
        "context": f"Paragraph {i} says the tower in town {i} was built in year {1800 + i} by builder number {i}.",
        "qas": [{"id": f"q{i}", "question": f"When was the tower in town {i} built?",
                 "answers": [{"text": str(1800 + i), "answer_start": 0}]}],
    } for i in range(80)]
    path = tmp_path / "squad_small.json"
    path.write_text(json.dumps({"version": "1.1", "data": [{"title": "towers", "paragraphs": paragraphs}]}))
    return path


# ---------------------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("script", LAUNCHERS)
def test_help_lists_the_shared_options(script):
    result = launch(script, "--help")
    assert result.returncode == 0, result.stderr
    for option in ("--test", "--train", "--max-steps", "--batch-size", "--learning-rate", "--max-seq-length",
                   "--save-steps", "--precision", "--no-compile", "--num-gpus", "--dataset-path", "--output-dir",
                   "--logs-dir", "--foreground", "--background", "--dry-run", "--verbose", "--cpu", "--nnodes",
                   "--node-rank", "--master-addr", "--master-port"):
        assert option in result.stdout, f"{script} --help lacks {option}"


def test_the_launcher_imports_no_torch_so_help_and_option_errors_are_instant():
    result = subprocess.run([sys.executable, "-c", "import sys, utils.launch.run; print(sorted(m for m in sys.modules "
                             "if m.split('.')[0] in ('torch', 'transformers', 'numpy')))"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.stdout.strip() == "[]", result.stderr


@pytest.mark.parametrize("script", LAUNCHERS)
def test_unknown_option_is_one_line_pointing_at_the_help_and_exits_2(script):
    result = launch(script, "--bogus-option")
    assert result.returncode == 2
    assert result.stderr == f"error: unknown option: --bogus-option (see ./{script} --help)\n"
    assert result.stdout == ""


@pytest.mark.parametrize("args, shown", [(["--overwrite-output-dir"], "--overwrite-output-dir"),
                                         (["--resume-from", "ckpt/checkpoint-5"], "--resume-from ckpt/checkpoint-5"),
                                         (["--seed=3"], "--seed=3")])
def test_a_train_py_flag_given_to_the_launcher_is_shown_after_the_double_dash(args, shown):
    """train.py's advice (pass --overwrite-output-dir, resume with --resume-from) names its own flags, which a
    launcher had called `unknown option`, with nothing saying they go after --."""
    result = launch("run_gpt2.sh", "1", *args, "--dry-run")
    assert result.returncode == 2
    assert result.stderr == (f"error: {args[0].split('=')[0]} is train.py's flag, not the launcher's: give it after "
                             f"--, as in ./run_gpt2.sh ... -- {shown} (see ./run_gpt2.sh --help)\n")


@pytest.mark.parametrize("args, mode", [
    ([], "train (3 epochs)"),
    (["--max-steps", "5000", "--num-epochs", "1"], "train (5000 steps: --max-steps sets the length, not --num-epochs)"),
    (["--trace"], "train (the trace window and the untraced steps timed after it, not 3 epochs: --trace; --max-steps "
                  "for more)"),
])
def test_the_settings_say_what_sets_a_training_runs_length(args, mode):
    """train.py runs --max-steps steps, else a traced run's window and after-steps, else the epochs: the line had
    said "1 epochs, at most 5000 steps" of a run that trained 5000, and "3 epochs" of a traced run of 24 steps."""
    result = launch("run_gpt2.sh", "1", *args, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert f"• mode: {mode}\n" in result.stdout


def test_the_launchers_list_of_train_py_flags_is_train_py_parsers():
    """The launcher reads train.py's flags from utils/run_config.py's source (it runs under a python3 without
    transformers): every one of them is a flag of the real parser."""
    from utils.launch.options import train_flags
    from utils.run_config import build_parser
    flags = train_flags()
    assert {"--resume-from", "--overwrite-output-dir", "--seed", "--enable-tracing"} <= flags
    assert flags <= set(build_parser("gpt2")._option_string_actions)


@pytest.mark.parametrize("args, message", [
    (["--batch-size", "abc"], "--batch-size: 'abc' is not a positive integer"),
    (["--batch-size"], "--batch-size needs a value"),
    (["--precision", "fp8"], "--precision: 'fp8' is not one of bf16, fp16, fp32"),
    (["--num-gpus", "0"], "--num-gpus: '0' is not a positive integer or a list like 1,2,4"),
    (["--learning-rate", "fast"], "--learning-rate: 'fast' is not a number"),
    (["--nnodes", "2"], "--nnodes 2 needs --master-addr"),
    (["--nnodes", "2", "--master-addr", "h", "--node-rank", "2"], "--node-rank 2 must be below --nnodes 2"),
    (["--master-port", "70000"], "--master-port: '70000' is not a port number"),
    (["--save-steps", "-1"], "--save-steps: '-1' is not a non-negative integer (0: no checkpoints)"),
    (["--test=yes"], "--test takes no value"),
    (["1", "2", "3"], "too many arguments"),
    (["eight"], "NUM_GPUS: 'eight' is not a positive integer"),
    (["--models", "gpt2,llama"], "--models: 'gpt2,llama' is not a list of registered model families (known: gpt2, bert"),
    # a value twice planned one run twice, whose second start found the first's lock: "already being run by another
    # launcher (PID <its own>)"
    (["--num-gpus", "1,2,1"], "--num-gpus: '1,2,1' names 1 more than once"),
    (["--models", "gpt2,bert,gpt2"], "--models: 'gpt2,bert,gpt2' names gpt2 more than once"),
])
def test_bad_values_give_a_one_line_error_and_exit_2(args, message):
    result = launch("run_gpt2.sh", *args)
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: {message}")


def test_an_option_missing_its_value_does_not_swallow_the_next_option(tmp_path):
    """`--output-dir --dry-run` once ran for real, into ./--dry-run, replacing the last run's checkpoints."""
    result = launch("run_gpt2_quick.sh", "--output-dir", "--dry-run", env=machine(), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("error: --output-dir needs a value (got the option --dry-run; write "
                                    "--output-dir=--dry-run if you mean it)")
    assert result.stdout == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [["--bogus", "--help"], ["--batch-size", "x", "-h"], ["--num-gpus", "--help"]])
def test_help_anywhere_before_the_double_dash_prints_the_help(args):
    result = launch("run_gpt2.sh", *args)
    assert result.returncode == 0 and "Usage:" in result.stdout and result.stderr == ""


def test_help_after_the_double_dash_goes_to_train_py(squad_file):
    result = launch("run_gpt2.sh", "1", "--dry-run", "--foreground", "--dataset-path", str(squad_file), "--", "--help",
                    env=machine())
    assert result.returncode == 0, result.stderr
    [argv] = torchrun_commands(result.stdout)
    assert argv[-1] == "--help"


@pytest.mark.parametrize("flag_name", ["--output-dir", "--save-dir", "--logs-dir"])
def test_a_folder_that_cannot_be_made_is_named_before_anything_runs(tmp_path, flag_name):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    result = launch("run_gpt2_quick.sh", "--num-gpus", "1", "--dry-run", flag_name, str(blocker / "sub"),
                    env=machine())
    assert result.returncode == 1
    assert f"❌ {flag_name} {blocker}/sub cannot be made: {blocker} is a file, not a folder" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr and "$ env" not in result.stdout


@pytest.mark.parametrize("background", [False, True])
def test_a_folder_that_is_a_dangling_link_is_named_before_anything_runs(tmp_path, background):
    """A link to a missing folder passed the check (its parent is writable), then the logs folder's mkdir raised
    FileExistsError as a traceback, in the foreground and in the background start."""
    dangling = tmp_path / "logs"
    dangling.symlink_to(tmp_path / "gone" / "logs")
    mode = ["--background", "--dry-run"] if background else []
    result = launch("run_gpt2_quick.sh", "--num-gpus", "1", *mode, "--logs-dir", str(dangling),
                    "--output-dir", str(tmp_path / "out"), "--save-dir", str(tmp_path / "ck"), env=machine())
    assert result.returncode == 1
    assert (f"❌ --logs-dir {dangling} cannot be made: {dangling} is a link to {tmp_path / 'gone' / 'logs'}, which "
            "does not exist") in result.stdout
    assert "Traceback" not in result.stdout + result.stderr and not (tmp_path / "out").exists()


def test_an_unresolvable_master_address_is_one_line_not_minutes_of_torchrun_retries(tmp_path):
    result = launch("run_gpt2_quick.sh", "--num-gpus", "1", "--dry-run", "--nnodes", "2", "--node-rank", "1",
                    "--master-addr", "no-such-node.invalid", "--output-dir", str(tmp_path / "out"), env=machine())
    assert result.returncode == 1
    errors = [line for line in result.stdout.splitlines() if line.startswith("❌")]
    [error] = errors  # the reason in the parentheses is the C library's
    assert error.startswith("❌ --master-addr no-such-node.invalid: this machine cannot resolve it (")
    assert error.endswith("); give node 0's IP address, or a host name in /etc/hosts or DNS")
    assert "$ env" not in result.stdout and not (tmp_path / "out").exists()


def test_a_signal_to_the_whole_process_group_is_passed_to_torchrun_once(tmp_path, capsys):
    """`timeout` and `kill -- -PGID` signal the launcher and its process group: the launcher passed it on a second
    time and said so twice."""
    from utils.launch.run import Foreground
    counted = tmp_path / "signals"
    child = (f"import os, signal, time\nseen = []\nsignal.signal(signal.SIGTERM, lambda *a: seen.append(1))\n"
             f"os.kill(os.getppid(), signal.SIGTERM); os.kill(os.getppid(), signal.SIGTERM)\n"
             f"end = time.time() + 2\nwhile time.time() < end: time.sleep(0.05)\n"
             f"open({str(counted)!r}, 'w').write(str(len(seen)))\n")
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        foreground = Foreground()
        assert foreground.run([sys.executable, "-c", child]) == 0
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert foreground.stopped and counted.read_text() == "1"
    assert capsys.readouterr().out.count("🛑 Stopping: SIGTERM to torchrun") == 1


def test_a_stopped_run_names_only_the_checkpoints_it_wrote(tmp_path):
    """A run stopped before its first checkpoint was said to have left "checkpoints in" its --save-dir."""
    from utils.launch.run import written_since
    started = time.time()
    (tmp_path / "checkpoint-4").mkdir()  # an earlier run's, written an hour before
    os.utime(tmp_path / "checkpoint-4", (started - 3600, started - 3600))
    (tmp_path / ".previous").mkdir()
    assert written_since(tmp_path, started) == [] and written_since(tmp_path / "none", started) == []
    (tmp_path / "checkpoint-6").mkdir()
    (tmp_path / "final_model").mkdir()
    assert written_since(tmp_path, started) == ["checkpoint-6", "final_model"]


def test_quick_scripts_take_no_positional_arguments():
    result = launch("run_gpt2_quick.sh", "2")
    assert result.returncode == 2
    assert "error: unexpected argument: 2" in result.stderr


# ---------------------------------------------------------------------------------------------------------
# The commands (--dry-run)
# ---------------------------------------------------------------------------------------------------------

def test_dry_run_prints_the_torchrun_command_with_nproc_per_node(squad_file, tmp_path):
    result = launch("run_gpt2.sh", "2", "3", "--cpu", "--dry-run", "--dataset-path", str(squad_file),
                    "--output-dir", str(tmp_path / "out"), env=machine(cores=4))
    assert result.returncode == 0, result.stdout + result.stderr
    [argv] = torchrun_commands(result.stdout)
    assert argv[0] == "env" and "PYTHONUNBUFFERED=1" in argv
    assert "OMP_NUM_THREADS=2" in argv or "OMP_NUM_THREADS=1" in argv
    assert "--nproc_per_node=2" in argv and "--standalone" in argv
    assert "gpt2/train.py" in argv
    assert flag(argv, "--num-gpus") == "2"
    assert flag(argv, "--batch-size") == "3"
    # --train is the default of the full-training scripts; CPU mode picks the tiny model, fp32, no compile
    assert flag(argv, "--num-epochs") == "3" and "--max-steps" not in argv
    assert flag(argv, "--model-name") == "tiny"
    assert flag(argv, "--precision") == "fp32" and "--no-compile" in argv
    assert flag(argv, "--max-seq-length") == "128"
    assert flag(argv, "--squad-file") == str(squad_file)
    assert flag(argv, "--save-dir") == "checkpoints/gpt2_2cpu"
    assert "--enable-tracing" not in argv
    # a dry run writes nothing
    assert not (tmp_path / "out").exists()


def test_environment_checks_print_one_line_each(squad_file):
    """Real probe of this machine."""
    result = launch("run_bert.sh", "1", "--cpu", "--dry-run", "--dataset-path", str(squad_file))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len([l for l in lines if l.startswith("✅ PyTorch ") and "importable" in l]) == 1
    assert len([l for l in lines if "CPU mode (--cpu)" in l]) == 1
    assert len([l for l in lines if l.startswith(f"✅ Dataset: {squad_file} (SQuAD JSON")]) == 1


@pytest.mark.skipif(cuda_count() > 0, reason="this machine has a GPU")
def test_without_a_gpu_the_launchers_fall_back_to_the_cpu(squad_file):
    """Real probe of this machine."""
    result = launch("run_bert.sh", "--dry-run", "--dataset-path", str(squad_file))
    assert result.returncode == 0, result.stderr
    assert "⚠️  CUDA: no GPU found: CPU mode (gloo" in result.stdout
    [argv] = torchrun_commands(result.stdout)
    assert "bert/train.py" in argv and flag(argv, "--model-name") == "tiny"
    assert "--nproc_per_node=1" in argv


def test_asking_for_more_gpus_than_the_machine_has_is_skipped_not_a_crash(squad_file):
    """Real probe of this machine."""
    count = max(8, (os.cpu_count() or 1) + 1, cuda_count() + 1)
    result = launch("run_gpt2.sh", str(count), "4", "--dry-run", "--dataset-path", str(squad_file))
    assert result.returncode == 0, result.stdout + result.stderr
    assert torchrun_commands(result.stdout) == []
    if cuda_count() == 0:
        assert f"⏭️  Skipping GPT-2 at {count} CPU ranks: this machine has no GPU" in result.stdout
    else:
        assert f"⏭️  Skipping GPT-2 at {count} GPUs: this machine has {cuda_count()} GPU(s)" in result.stdout
    assert re.search(rf"gpt2_{count}[cg]pu\s+skipped", result.stdout)


def test_on_a_two_gpu_machine_quick_profiling_runs_1_and_2_gpus_and_skips_4():
    result = launch("run_gpt2_quick.sh", "--dry-run", "--verbose", env=machine(gpus=2))
    assert result.returncode == 0, result.stderr
    assert "✅ CUDA 12.4: 2 GPU(s) available (NVIDIA H100 80GB HBM3)" in result.stdout
    assert "   GPU 1: NVIDIA H100 80GB HBM3" in result.stdout
    commands = torchrun_commands(result.stdout)
    assert [flag(c, "--trace-name") for c in commands] == ["gpt2_1gpu_quick_trace", "gpt2_2gpu_quick_trace"]
    for argv in commands:
        assert flag(argv, "--model-name") == "gpt2" and flag(argv, "--precision") == "bf16"
        assert "--no-compile" in argv  # traced runs stay eager
        assert not any(a.startswith("OMP_NUM_THREADS") for a in argv)
        assert "--max-seq-length" not in argv and "--squad-file" not in argv  # train.py's defaults, SQuAD from the hub
    assert "⏭️  Skipping GPT-2 at 4 GPUs: this machine has 2 GPU(s)" in result.stdout


def test_full_training_on_eight_gpus_compiles_and_falls_back_to_fp16_without_bf16():
    result = launch("run_bert.sh", "8", "4", "--dry-run", env=machine(gpus=8, bf16=False))
    assert result.returncode == 0, result.stderr
    [argv] = torchrun_commands(result.stdout)
    assert "--nproc_per_node=8" in argv and flag(argv, "--num-gpus") == "8"
    assert flag(argv, "--model-name") == "bert-base-uncased" and flag(argv, "--batch-size") == "4"
    assert flag(argv, "--precision") == "fp16" and "--compile" in argv
    assert flag(argv, "--save-dir") == "checkpoints/bert_8gpu"


def test_cpu_flag_wins_over_present_gpus(squad_file):
    result = launch("run_gpt2.sh", "1", "--cpu", "--dry-run", "--dataset-path", str(squad_file), env=machine(gpus=4))
    assert "ℹ️  CPU mode (--cpu): gloo, 4 CPU cores, 4 GPUs left unused" in result.stdout
    [argv] = torchrun_commands(result.stdout)
    assert flag(argv, "--model-name") == "tiny" and flag(argv, "--save-dir") == "checkpoints/gpt2_1cpu"


def test_missing_dataset_path_is_an_error_before_anything_runs(tmp_path):
    result = launch("run_gpt2_quick.sh", "--dry-run", "--dataset-path", str(tmp_path / "nope.jsonl"), env=machine())
    assert result.returncode == 1
    assert f"❌ Dataset: {tmp_path / 'nope.jsonl'} not found (--dataset-path)" in result.stdout
    assert torchrun_commands(result.stdout) == []


def test_jsonl_dataset_goes_to_dataset_path_and_relative_paths_follow_the_caller(tmp_path):
    (tmp_path / "corpus.jsonl").write_text('{"text": "안녕하세요 hello"}\n')
    result = launch("run_gpt2.sh", "--dry-run", "--dataset-path", "corpus.jsonl", "--output-dir", "traces",
                    "--trace", cwd=tmp_path, env=machine())
    assert result.returncode == 0, result.stdout + result.stderr
    [argv] = torchrun_commands(result.stdout)
    assert flag(argv, "--dataset-path") == f"{tmp_path}/corpus.jsonl"
    assert flag(argv, "--trace-output-dir") == f"{tmp_path}/traces"
    assert flag(argv, "--trace-name") == "gpt2_1cpu"


def test_quick_script_traces_each_count_under_its_own_name(squad_file):
    result = launch("run_bert_quick.sh", "--dry-run", "--dataset-path", str(squad_file), env=machine(cores=8))
    assert result.returncode == 0, result.stderr
    commands = torchrun_commands(result.stdout)
    assert [next(a for a in c if a.startswith("--nproc_per_node=")) for c in commands] == \
        ["--nproc_per_node=1", "--nproc_per_node=2"]
    for argv, count in zip(commands, (1, 2)):
        assert "bert/train.py" in argv and "--enable-tracing" in argv
        assert flag(argv, "--trace-name") == f"bert_{count}cpu_quick_trace"
        assert flag(argv, "--trace-output-dir") == "outputs"
        # --test is the default of the quick scripts: train.py runs the trace window and the untraced steps timed
        # after it (a --max-steps 10 had cut those to one)
        assert "--test" in argv and "--max-steps" not in argv
        assert "--no-save-initial" in argv and "--no-compile" in argv
    # on the CPU, 4 ranks only when asked, even with 8 cores
    assert "⏭️  Skipping BERT at 4 CPU ranks: CPU mode runs 1 and 2 ranks unless asked (--num-gpus 1,2,4)" \
        in result.stdout
    asked = launch("run_bert_quick.sh", "--dry-run", "--num-gpus", "4", "--dataset-path", str(squad_file),
                   env=machine(cores=8))
    [argv] = torchrun_commands(asked.stdout)
    assert "--nproc_per_node=4" in argv and flag(argv, "--trace-name") == "bert_4cpu_quick_trace"


def test_run_all_profiling_dry_run_covers_both_models_then_conversion():
    """The README's main command, as planned on a machine without a GPU: bundled data, 1 and 2 CPU ranks."""
    result = launch("run_all_profiling.sh", "--dry-run", env=machine())
    assert result.returncode == 0, result.stdout + result.stderr
    commands = torchrun_commands(result.stdout)
    names = [flag(c, "--trace-name") for c in commands]
    assert names == ["gpt2_1cpu_quick_trace", "gpt2_2cpu_quick_trace", "bert_1cpu_quick_trace", "bert_2cpu_quick_trace"]
    assert {flag(c, "--squad-file") for c in commands} == {"data/squad_sample.json"}
    convert = [l for l in result.stdout.splitlines() if l.startswith("$ ") and "convert_to_et.py" in l]
    assert len(convert) == 1
    assert shlex.split(convert[0][2:])[-5:] == ["convert_to_et.py"] + [f"outputs/{n}" for n in names]
    assert "--no-convert" in launch("run_all_profiling.sh", "--help").stdout


def test_run_all_experiments_trains_both_models_at_1_2_and_8():
    result = launch("run_all_experiments.sh", "--dry-run", "--max-steps", "50", env=machine(gpus=8))
    assert result.returncode == 0, result.stderr
    commands = torchrun_commands(result.stdout)
    assert [(next(a for a in c if a.endswith("/train.py")), next(a for a in c if a.startswith("--nproc")))
            for c in commands] == [(m, f"--nproc_per_node={n}") for m in ("gpt2/train.py", "bert/train.py")
                                   for n in (1, 2, 8)]
    for argv in commands:
        assert "--enable-tracing" not in argv
        assert flag(argv, "--num-epochs") == "3" and flag(argv, "--max-steps") == "50"
    assert "execution: background (nohup), dry run" in result.stdout  # full training defaults to the background
    on_two = launch("run_all_experiments.sh", "--dry-run", env=machine(gpus=2))
    assert len(torchrun_commands(on_two.stdout)) == 4
    assert "⏭️  Skipping BERT at 8 GPUs: this machine has 2 GPU(s)" in on_two.stdout


def test_options_reach_train_py(squad_file):
    result = launch("run_gpt2_quick.sh", "--dry-run", "--num-gpus", "1", "--dataset-path", str(squad_file),
                    "--max-steps", "5", "--batch-size", "2", "--learning-rate", "1e-4", "--max-seq-length", "64",
                    "--save-steps", "7", "--precision", "bf16", "--compile", "--model-name", "gpt2",
                    "--save-dir", "/tmp/ck", "--logs-dir", "/tmp/lg", "--verbose",
                    "--", "--attn-implementation", "eager", env=machine())
    assert result.returncode == 0, result.stderr
    [argv] = torchrun_commands(result.stdout)
    assert flag(argv, "--max-steps") == "5" and flag(argv, "--batch-size") == "2"
    assert flag(argv, "--learning-rate") == "1e-4" and flag(argv, "--max-seq-length") == "64"
    assert flag(argv, "--save-steps") == "7" and flag(argv, "--precision") == "bf16"
    assert "--compile" in argv and "--no-compile" not in argv
    assert flag(argv, "--model-name") == "gpt2"
    assert flag(argv, "--save-dir") == "/tmp/ck/gpt2_1cpu_quick_trace"
    assert flag(argv, "--log-dir") == "/tmp/lg/gpt2_1cpu_quick_trace"
    assert flag(argv, "--logging-steps") == "1" and "LOGLEVEL=INFO" in argv
    assert argv[-2:] == ["--attn-implementation", "eager"]


def test_save_steps_0_reaches_train_py_as_no_checkpoints(squad_file):
    """train.py takes --save-steps 0 as no checkpoints; the launchers pass it on and say so."""
    result = launch("run_gpt2_quick.sh", "--dry-run", "--num-gpus", "1", "--dataset-path", str(squad_file),
                    "--save-steps", "0", env=machine())
    assert result.returncode == 0, result.stderr
    [argv] = torchrun_commands(result.stdout)
    assert flag(argv, "--save-steps") == "0" and "save every: never" in result.stdout


def test_multi_node_options_become_torchrun_rendezvous_arguments():
    result = launch("run_gpt2_quick.sh", "--dry-run", "--num-gpus", "8", "--nnodes", "2", "--node-rank", "1",
                    "--master-addr", "10.1.2.3", "--master-port", "29555", env=machine(gpus=8))
    assert result.returncode == 0, result.stderr
    [argv] = torchrun_commands(result.stdout)
    for expected in ("--nnodes=2", "--node_rank=1", "--master_addr=10.1.2.3", "--master_port=29555",
                     "--nproc_per_node=8"):
        assert expected in argv
    assert "--standalone" not in argv
    assert flag(argv, "--num-gpus") == "16"  # the world size
    assert flag(argv, "--trace-name") == "gpt2_16gpu_quick_trace"


def test_a_family_registered_in_one_line_is_planned_by_the_launchers(monkeypatch, capsys):
    """Adding a model = a folder with a train.py + one registry line: the launcher plans its runs from the registry's
    name, label, default model and train script (the folder need not exist for a dry run)."""
    from utils import families
    from utils.launch.run import main
    monkeypatch.setitem(families.FAMILIES, "toy", families.FamilyInfo("toy", "Toy", "toy-small", "causal"))
    for name, value in machine(gpus=2).items():
        monkeypatch.setenv(name, value)
    assert main(["run_all_profiling.sh", "--dry-run", "--models", "toy"]) == 0
    out = capsys.readouterr().out
    commands = torchrun_commands(out)
    assert [flag(c, "--trace-name") for c in commands] == ["toy_1gpu_quick_trace", "toy_2gpu_quick_trace"]
    for argv in commands:
        assert "toy/train.py" in argv and flag(argv, "--model-name") == "toy-small"
    assert "▶ Toy on 2 GPU(s): toy_2gpu_quick_trace" in out and "models: Toy=toy-small" in out
    assert "⏭️  Skipping Toy at 4 GPUs: this machine has 2 GPU(s)" in out
    convert = [shlex.split(l[2:]) for l in out.splitlines() if l.startswith("$ ") and "convert_to_et.py" in l]
    assert convert[0][-2:] == ["outputs/toy_1gpu_quick_trace", "outputs/toy_2gpu_quick_trace"]


# ---------------------------------------------------------------------------------------------------------
# Background mode
# ---------------------------------------------------------------------------------------------------------

def test_a_run_ended_by_a_signal_is_said_as_a_shell_says_it():
    """A background run killed while starting had been reported as `exit -15` (Popen's sign for a signal)."""
    from utils.launch.run import exit_text
    assert [exit_text(rc) for rc in (0, 1, 143, -15, -9)] == ["exit 0", "exit 1", "exit 143", "killed by SIGTERM",
                                                               "killed by SIGKILL"]


def test_help_piped_into_a_reader_that_stops_early_ends_without_a_traceback():
    """`./run_gpt2.sh --help | head -5` had ended in a BrokenPipeError traceback about half the time: the help
    is written line by line, and head closes the pipe after five."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line: every write fails (EPIPE)
    try:
        done = subprocess.run([str(REPO / "run_gpt2.sh"), "--help"], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write_end)
    assert done.returncode == 0 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_background_mode_writes_the_pid_file_and_the_console_log(squad_file, tmp_path):
    logs = tmp_path / "logs"
    result = launch("run_gpt2.sh", "1", "--cpu", "--dry-run", "--background", "--dataset-path", str(squad_file),
                    "--logs-dir", str(logs))
    assert result.returncode == 0, result.stdout + result.stderr
    pid = (logs / "training.pid").read_text().strip()
    assert pid.isdigit()
    assert f"🔢 Process ID: {pid}" in result.stdout
    assert f"tail -f {logs}/training_console.log" in result.stdout
    assert f"ps -p {pid}" in result.stdout and f"kill {pid}" in result.stdout
    # the background child ran the same plan, and its output went to the console log, not to this terminal
    console = (logs / "training_console.log").read_text()
    assert "execution: foreground, dry run" in console
    [argv] = torchrun_commands(console)
    assert "--nproc_per_node=1" in argv and flag(argv, "--log-dir") == f"{logs}/gpt2_1cpu"
    assert torchrun_commands(result.stdout.split("First log lines")[0]) == []


def test_background_mode_refuses_to_start_over_a_live_run(squad_file, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    # a live process with the background launcher's command line (python <repo>/utils/launch ...)
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", str(REPO / "utils" / "launch")])
    try:
        (logs / "training.pid").write_text(f"{running.pid}\n")
        result = launch("run_gpt2.sh", "--cpu", "--background", "--dataset-path", str(squad_file), "--logs-dir",
                        str(logs))
    finally:
        running.kill()
        running.wait()
    assert result.returncode == 1
    assert f"error: a background run is still going (PID {running.pid}" in result.stderr
    assert not (logs / "training_console.log").exists()


def test_flags_train_py_refuses_stop_the_launch_before_any_run_starts(squad_file, tmp_path):
    """A traced run whose --max-steps cannot hold its trace window: train.py refuses it, and the launcher now says
    so before torchrun starts (it had started a run per family and count, each importing torch to refuse it)."""
    result = launch("run_gpt2_quick.sh", "--cpu", "--num-gpus", "1,2", "--max-steps", "3", "--dataset-path",
                    str(squad_file), "--output-dir", str(tmp_path / "traces"), "--save-dir", str(tmp_path / "ckpt"),
                    "--logs-dir", str(tmp_path / "logs"), env=machine(cores=2))
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = [line for line in result.stdout.splitlines() if line.startswith("❌")]
    assert line.startswith("❌ train.py refuses these flags: --max-steps 3 is shorter than the trace window"), line
    assert line.endswith("(see gpt2/train.py --help)"), line
    assert "▶" not in result.stdout and not (tmp_path / "traces").exists() and not (tmp_path / "ckpt").exists()


def test_a_background_start_with_flags_train_py_refuses_does_not_detach(squad_file, tmp_path):
    """The background child had started, told the user it was running, and ended in its console log with
    train.py's refusal; now the refusal is the launcher's own output and nothing is left running or written."""
    logs = tmp_path / "logs"
    result = launch("run_gpt2.sh", "1", "--cpu", "--background", "--dataset-path", str(squad_file), "--logs-dir",
                    str(logs), "--save-dir", str(tmp_path / "ckpt"), "--", "--seed", "-1", env=machine())
    assert result.returncode == 2, result.stdout + result.stderr
    assert "❌ train.py refuses these flags: --seed must be at least 0, got -1 (see gpt2/train.py --help)" in \
        result.stdout
    assert "Background run started" not in result.stdout
    assert not (logs / "training.pid").exists() and not (logs / "training_console.log").exists()


def test_a_training_python_without_transformers_is_named_by_the_flag_check(squad_file, tmp_path):
    """The check runs in the training Python: one that lacks a training package says so in require's line, not as
    a refusal of the flags."""
    python = tmp_path / "python-without-site-packages"
    python.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -S \"$@\"\n")
    python.chmod(0o755)
    result = launch("run_gpt2.sh", "1", "--cpu", "--foreground", "--dataset-path", str(squad_file), "--logs-dir",
                    str(tmp_path / "logs"), "--save-dir", str(tmp_path / "ckpt"),
                    env={**machine(), "PYTHON": str(python)})
    assert result.returncode == 1, result.stdout + result.stderr
    said = result.stdout.split(f"❌ {python} could not check train.py's flags:\n", 1)[1].splitlines()[0]
    assert " has no " in said and "use the project's environment" in said, said
    assert "refuses" not in result.stdout and "▶" not in result.stdout


def test_a_pid_file_naming_another_process_is_left_from_an_ended_run(squad_file, tmp_path):
    """The PID file outlives its run; after a reboot or when PIDs wrap, the number belongs to another process, and
    the launcher had refused to start and told the user to kill that process (here: this test)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "training.pid").write_text(f"{os.getpid()}\n")
    result = launch("run_gpt2.sh", "1", "--cpu", "--dry-run", "--background", "--dataset-path", str(squad_file),
                    "--logs-dir", str(logs))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"note: {logs}/training.pid names PID {os.getpid()}, which is not a launcher of this checkout" in \
        result.stdout
    assert "kill" not in result.stderr and (logs / "training.pid").read_text().strip() != str(os.getpid())


def test_background_mode_with_an_unusable_logs_folder_is_one_line_not_a_traceback(squad_file, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    result = launch("run_gpt2.sh", "1", "--dry-run", "--background", "--dataset-path", str(squad_file),
                    "--logs-dir", str(blocker / "logs"), env=machine())
    assert result.returncode == 1
    assert f"❌ --logs-dir {blocker}/logs cannot be made: {blocker} is a file, not a folder" in result.stdout
    assert "Traceback" not in result.stderr


def test_background_mode_prints_a_tail_command_that_works_with_spaces(squad_file, tmp_path):
    logs = tmp_path / "my logs"
    result = launch("run_gpt2.sh", "1", "--dry-run", "--background", "--dataset-path", str(squad_file),
                    "--logs-dir", str(logs), env=machine())
    assert result.returncode == 0, result.stdout + result.stderr
    [tail] = [line.split("#")[0].strip() for line in result.stdout.splitlines() if "tail -f" in line]
    assert shlex.split(tail) == ["tail", "-f", f"{logs}/training_console.log"]


def test_a_second_background_start_keeps_the_first_console_log(squad_file, tmp_path):
    logs = tmp_path / "logs"
    for batch in ("3", "5"):
        result = launch("run_gpt2.sh", "1", batch, "--dry-run", "--background", "--dataset-path", str(squad_file),
                        "--logs-dir", str(logs), env=machine())
        assert result.returncode == 0, result.stdout + result.stderr
    console = (logs / "training_console.log").read_text()
    assert [flag(argv, "--batch-size") for argv in torchrun_commands(console)] == ["3", "5"]
    assert console.count("===== ") == 2 and "./run_gpt2.sh 1 5 --dry-run --background" in console
    # the second start shows its own first lines, not the first run's
    assert [flag(argv, "--batch-size") for argv in torchrun_commands(result.stdout.split("First log lines")[1])] \
        == ["5"]


def test_a_second_launcher_on_the_same_runs_stops_before_it_starts(squad_file, tmp_path):
    import fcntl
    logs = tmp_path / "logs"
    logs.mkdir()
    with open(logs / ".gpt2_1cpu.node0.lock", "w") as lock:  # as a launcher running gpt2_1cpu holds it
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write("4242\n")
        lock.flush()
        result = launch("run_gpt2.sh", "1", "--foreground", "--max-steps", "1", "--dataset-path", str(squad_file),
                        "--logs-dir", str(logs), "--save-dir", str(tmp_path / "ck"), env=machine())
    assert result.returncode == 1
    assert (f"❌ gpt2_1cpu is already being run by another launcher (PID 4242, {logs}/.gpt2_1cpu.node0.lock)"
            in result.stdout)
    assert "▶ GPT-2" not in result.stdout and not (tmp_path / "ck").exists()


def test_ctrl_c_while_checking_the_environment_is_one_line_not_a_traceback(tmp_path):
    slow_python = tmp_path / "venv" / "bin" / "python"  # the active environment, which the check waits on
    slow_python.parent.mkdir(parents=True)
    slow_python.write_text("#!/bin/sh\nsleep 30\n")
    slow_python.chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHON", "LC_PROBED")}
    # SIGINT as a terminal's shell leaves it, also when the tests run as a background job (`./run_tests.sh &`
    # starts them with SIGINT ignored, which every child would inherit)
    launcher = subprocess.Popen([str(REPO / "run_gpt2.sh"), "1", "--dry-run"], cwd=REPO,
                                env={**env, "VIRTUAL_ENV": str(tmp_path / "venv")}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(3)
    os.killpg(launcher.pid, signal.SIGINT)  # as Ctrl-C in a terminal: to the whole foreground process group
    out, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 130
    assert "Traceback" not in err and err.strip() == "🛑 Stopped (Ctrl-C) before any run started", err


# ---------------------------------------------------------------------------------------------------------
# Real runs (CPU, tiny models)
# ---------------------------------------------------------------------------------------------------------

def trace_files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


@pytest.mark.slow
def test_quick_run_on_the_cpu_leaves_a_trace_folder(tmp_path):
    """Through the launcher as a user runs it: bundled data, tiny model, tracing on, two ranks."""
    out, logs, ckpt = tmp_path / "outputs", tmp_path / "logs", tmp_path / "checkpoints"
    result = launch("run_gpt2_quick.sh", "--cpu", "--num-gpus", "2", "--max-steps", "4", "--output-dir", str(out),
                    "--logs-dir", str(logs), "--save-dir", str(ckpt), env=this_machine(), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    folder = out / "gpt2_2cpu_quick_trace"
    files = trace_files(folder)
    for rank in range(2):
        assert {f"host.{rank}.json", f"device.{rank}.json", f"stacks.{rank}.txt"} <= files
        json.loads((folder / f"host.{rank}.json").read_text())  # one valid document
    assert json.loads((folder / "run.json").read_text())["world_size"] == 2
    assert f"✅ Traces: {folder} (ranks 0-1" in result.stdout
    assert re.search(r"gpt2_2cpu_quick_trace\s+ok", result.stdout)


@pytest.mark.slow
def test_run_all_profiling_traces_both_models_and_converts_them(tmp_path):
    """The README's main command, one rank per model to keep it short: traces, then .et files and summaries."""
    out = tmp_path / "outputs"
    result = launch("run_all_profiling.sh", "--num-gpus", "1", "--max-steps", "4", "--output-dir", str(out),
                    "--logs-dir", str(tmp_path / "logs"), "--save-dir", str(tmp_path / "ck"), env=this_machine(),
                    timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    unit = "gpu" if cuda_count() else "cpu"
    for model in ("gpt2", "bert"):
        folder = out / f"{model}_1{unit}_quick_trace"
        assert (folder / f"{model}_1{unit}_quick_trace.0.et").stat().st_size > 0
        assert (folder / "CONVERSION_SUMMARY.md").exists()
    assert re.search(r"conversion to \.et\s+ok", result.stdout)


@pytest.mark.slow
def test_a_failing_run_is_reported_and_makes_the_exit_status_1(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    result = launch("run_bert.sh", "1", "--cpu", "--foreground", "--max-steps", "2", "--dataset-path", str(broken),
                    "--logs-dir", str(tmp_path / "logs"), "--save-dir", str(tmp_path / "ck"), env=this_machine(),
                    timeout=300)
    assert result.returncode == 1
    assert re.search(r"❌ bert_1cpu failed \(exit \d+\)", result.stdout)
    assert re.search(r"bert_1cpu\s+failed", result.stdout)


@pytest.mark.slow
def test_two_nodes_on_one_machine_share_one_trace_folder(tmp_path):
    """--nnodes/--node-rank/--master-addr/--master-port, with both 'nodes' on this machine."""
    port = free_port()
    out = tmp_path / "outputs"
    common = ["--cpu", "--num-gpus", "1", "--max-steps", "4", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(port), "--output-dir", str(out), "--save-dir", str(tmp_path / "ck")]
    env = dict(os.environ, OMP_NUM_THREADS="1", **this_machine())
    nodes = [subprocess.Popen([str(REPO / "run_bert_quick.sh"), *common, "--node-rank", str(rank),
                               "--logs-dir", str(tmp_path / f"logs{rank}")],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-3000:]
    folder = out / "bert_2cpu_quick_trace"
    assert {"host.0.json", "host.1.json", "device.0.json", "device.1.json", "run.json"} <= trace_files(folder)
    assert "ranks 0-0" in outputs[0] and "ranks 1-1" in outputs[1]


@pytest.mark.slow
def test_kill_stops_a_background_run_and_its_workers(tmp_path):
    logs = tmp_path / "logs"
    result = launch("run_gpt2.sh", "1", "--cpu", "--train", "--num-epochs", "1000", "--logs-dir", str(logs),
                    "--save-dir", str(tmp_path / "ck"), env=this_machine(), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    pid = int((logs / "training.pid").read_text())
    console = logs / "training_console.log"
    deadline = time.time() + 240
    # wait until training is under way
    while time.time() < deadline and not re.search(r"step\s*\d+|\bloss\b", console.read_text(), re.I):
        assert _alive(pid), console.read_text()[-3000:]
        time.sleep(1)
    workers = _children(pid)
    assert workers, "no torchrun under the launcher"
    os.kill(pid, signal.SIGTERM)
    while time.time() < deadline and (_alive(pid) or any(_alive(w) for w in workers)):
        time.sleep(0.5)
    assert not _alive(pid) and not any(_alive(w) for w in workers)
    text = console.read_text()
    assert "🛑 Stopping: SIGTERM to torchrun" in text
    assert re.search(r"gpt2_1cpu\s+stopped", text) and "🛑 Stopped by a signal" in text
    assert re.search(r"🛑 gpt2_1cpu stopped by a signal after \d+s \(exit \d+\); checkpoints in \S+ \(this run wrote "
                     r".*checkpoint-\d+", text), text[-3000:]
    # the trainer saved where it stopped, as the launcher promised ("kill PID: stop it, a checkpoint is saved")
    assert list((tmp_path / "ck" / "gpt2_1cpu").glob("checkpoint-*")), text[-3000:]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, IndexError):
        return True


def _children(pid: int) -> list[int]:
    """All descendants of pid (from /proc), so the test can check that none outlives the kill."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, IndexError, ProcessLookupError):
                continue
            if int(fields[1]) == parent:
                child = int(stat.parent.name)
                found.append(child)
                queue.append(child)
    return found


@pytest.mark.parametrize("name", ["squad.json", "SQUAD.JSON"])
def test_a_squad_file_is_passed_as_one_whatever_the_case_of_its_suffix(squad_file, tmp_path, name):
    """data/S.JSON was taken for a JSONL corpus, and train.py then refused it ("pass it with --squad-file")."""
    from utils.launch.plan import dataset_arguments
    path = tmp_path / name
    path.write_bytes(squad_file.read_bytes())
    assert dataset_arguments(str(path), "cpu") == ["--squad-file", str(path)]


def test_a_data_file_goes_to_the_flag_its_content_needs_whatever_its_suffix(squad_file, tmp_path):
    """A JSONL corpus named .json went to --squad-file (train.py: "pass it with --dataset-path", which the user had
    done) and a SQuAD file named .jsonl to --dataset-path."""
    from utils.launch.plan import dataset_arguments
    corpus, squad = tmp_path / "corpus.json", tmp_path / "squad.jsonl"
    corpus.write_text('\n{"text": "첫 문장 one"}\n{"text": "second"}\n', encoding="utf-8")
    squad.write_bytes(squad_file.read_bytes())
    pretty = tmp_path / "pretty.jsonl"  # a SQuAD document spread over lines, as editors save it
    pretty.write_text(json.dumps(json.loads(squad_file.read_text()), indent=2))
    assert dataset_arguments(str(corpus), "cpu") == ["--dataset-path", str(corpus)]
    assert dataset_arguments(str(squad), "cpu") == ["--squad-file", str(squad)]
    assert dataset_arguments(str(pretty), "cpu") == ["--squad-file", str(pretty)]


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_an_empty_data_file_is_refused_in_one_line_before_anything_runs(tmp_path, content):
    empty = tmp_path / "corpus.jsonl"
    empty.write_text(content)
    result = launch("run_gpt2_quick.sh", "--dry-run", "--dataset-path", str(empty), env=machine())
    assert result.returncode == 1
    assert [line for line in result.stdout.splitlines() if "Dataset" in line] == \
        [f"❌ Dataset: {empty} is empty (--dataset-path)"]
    assert torchrun_commands(result.stdout) == []
