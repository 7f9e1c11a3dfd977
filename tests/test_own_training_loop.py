"""A training loop that is not this project's trainer (examples/own_training_loop.py), traced with ChakraTracer: its
traces convert as the trainer's do, the profiler's cost taken out against the untraced steps it timed."""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import our_step_times
from bench.whatif_bench import parameter_count, step_cpu
from trace_tools.discover import find_runs
from trace_tools.layout import RUN_INFO, et_name
from trace_tools.pipeline import KEEPS_PROFILER_COST, convert_runs

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "own_training_loop.py"
# A small MLP: 3 layers of 256 and a head of 10, two ranks of 16 samples; a window of 2 traced steps with 3 untraced
# steps timed on each side of it, the first left out
MODEL = ["--width", "256", "--layers", "3", "--batch-size", "16"]
PARAMETERS = 3 * (256 * 256 + 256) + 256 * 10 + 10
WINDOW = ["--trace-wait-steps", "3", "--trace-active-steps", "2"]
STEPS = 10


def run_example(*args, cwd: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(EXAMPLE),
               *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def traced_loop(tmp_path_factory):
    """The example traced on two gloo ranks and converted: (its log folder, the conversion's RunResult)."""
    work = tmp_path_factory.mktemp("own_loop")
    done = run_example(*MODEL, *WINDOW, "--max-steps", str(STEPS), "--enable-tracing", "--trace-output-dir",
                       "traces", "--log-dir", "logs", cwd=work)
    assert done.returncode == 0, done.stderr[-3000:]
    result = convert_runs(find_runs([work / "traces" / "mlp_2r"]), jobs=2, progress=False)[0]
    return work / "logs", result


def test_a_loop_of_its_own_gives_every_rank_an_et_with_its_gradients_all_reduced(traced_loop):
    _, result = traced_loop
    assert result.ok, [r.error for r in result.ranks]
    for rank in result.ranks:
        assert Path(rank.et_path).name == et_name("mlp_2r", rank.rank) and Path(rank.et_path).is_file()
        # DDP's buckets hold every gradient once: fp32, 4 bytes a parameter
        assert rank.comm_by_type.get("ALL_REDUCE", 0) >= 1 and rank.comm_bytes == 4 * PARAMETERS


def test_its_et_durations_are_corrected_towards_the_untraced_steps_the_tracer_timed(traced_loop):
    _, result = traced_loop
    assert not any(KEEPS_PROFILER_COST in warning for warning in result.warnings)
    timed = {entry["rank"]: entry for entry in json.loads((result.run.folder / RUN_INFO).read_text())["ranks"]}
    for rank in result.ranks:
        # 3 untraced steps before the window and 3 after it, the run's first left out: the steps of run.json
        untraced = [1e6 * seconds for seconds in timed[rank.rank]["untraced_step_wall_time_s"][1:]]
        assert rank.untraced_steps_us == pytest.approx(untraced, abs=0.1) and len(untraced) == 5
        assert rank.untraced_step_us == pytest.approx(statistics.median(untraced), abs=0.1)
        # its training thread's ops take that thread's CPU time in those steps (how much that removed from the
        # traced ops depends on the machine's load while they ran, down to nothing)
        assert rank.overhead_rule == "untraced CPU time"


def test_its_step_lines_are_the_ones_the_what_if_bench_reads(traced_loop):
    logs, _ = traced_loop
    assert sorted(our_step_times(logs)) == list(range(1, STEPS + 1))
    assert sorted(step_cpu(logs / "training_rank_0.log")) == list(range(1, STEPS + 1))
    assert parameter_count(logs) == PARAMETERS


def test_the_cnns_batch_norm_statistics_broadcast_at_every_forward_are_collectives_of_every_rank(tmp_path):
    # 2 layers of 16 channels with batch norm: DDP broadcasts each norm's running mean and variance (fp32) and its
    # batch count (int64) from rank 0 before the forward, besides all-reducing the gradients
    channels, layers = 16, 2
    parameters = 3 * channels * 9 + channels * channels * 9 + layers * 2 * channels + channels * 10 + 10
    buffers = layers * (2 * channels * 4 + 8)
    done = run_example("--model", "cnn", "--width", str(channels), "--layers", str(layers), "--image-size", "8",
                       "--batch-size", "4", *WINDOW, "--max-steps", str(STEPS), "--enable-tracing",
                       "--trace-output-dir", "traces", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = convert_runs(find_runs([tmp_path / "traces" / "cnn_2r"]), jobs=2, progress=False)[0]
    assert result.ok, [r.error for r in result.ranks]
    for rank in result.ranks:
        assert rank.comm_by_type.get("BROADCAST", 0) >= 1 and rank.comm_by_type.get("ALL_REDUCE", 0) >= 1
        assert rank.comm_bytes == 4 * parameters + buffers


def test_a_window_that_the_run_would_end_inside_is_refused_before_training(tmp_path):
    done = subprocess.run([sys.executable, str(EXAMPLE), *WINDOW, "--enable-tracing", "--max-steps", "6"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and not list(tmp_path.iterdir())
    assert done.stderr == ("error: examples/own_training_loop.py: --max-steps 6 ends the run inside the trace window "
                           "(steps 1-6): give at least 7 (see examples/own_training_loop.py --help)\n")
