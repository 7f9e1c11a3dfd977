"""Tests of the Chakra trace capture (utils/chakra_tracer.py) on tiny models, one and two ranks."""
import errno
import gc
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from utils import chakra_tracer
from trace_tools.discover import read_run_info
from utils.chakra_tracer import (ChakraTracer, NullTracer, TraceDirLock, TraceError, build_tracer, check_trace_file,
                                 claim_trace_dir)
from utils.distributed import DistributedContext
from utils.host_memory import reason_to_leave_malloc_alone
from utils.run_config import parse_run_config

REPO_ROOT = Path(__file__).resolve().parent.parent
PG_INIT = "## process_group:init ##"
# The trainer's tiny models on the bundled data, short sequences, nothing saved or evaluated inside the window.
TINY_RUN = ["--model-name", "tiny", "--max-seq-length", "64", "--batch-size", "2", "--report-to", "none",
            "--no-save-initial", "--save-steps", "0", "--eval-steps", "0", "--eval-batches", "1", "--precision", "fp32",
            "--no-compile"]
ROOT_NODES = ("[pytorch|profiler|execution_trace|process]", "[pytorch|profiler|execution_trace|thread]")


# ---- helpers -------------------------------------------------------------------------------------------------
def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def tiny_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def train(model, tracer, steps, batch=None, fail_at=None):
    """A plain training loop: one tracer.step() per optimizer step, as utils/trainer.py does."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tracer:
        for step in range(steps):
            if step == fail_at:
                raise RuntimeError("boom")
            if batch is None:
                loss = model(torch.randn(8, 16)).pow(2).mean()
            else:
                loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            tracer.step()


def parse_tracing_args(*argv):
    """The trainer's own flags parser (utils/run_config.py), as gpt2/train.py parses them."""
    return parse_run_config("gpt2", list(argv))


def load(path):
    with open(path, "rb") as handle:
        return json.load(handle)


def host_ops(host):
    """(name, rf_id) of every operator node of a host trace (the observer's process/thread roots left out)."""
    ops = []
    for node in host["nodes"]:
        if node["name"] in ROOT_NODES:
            continue
        attrs = {a["name"]: a["value"] for a in node.get("attrs", [])}
        ops.append((node["name"], attrs.get("rf_id", node.get("rf_id"))))
    return ops


def kineto_record_ids(device):
    return {e["args"]["Record function id"] for e in device["traceEvents"] if "Record function id" in e.get("args", {})}


def rf_id_match_fraction(host, device):
    ops = [(name, rf) for name, rf in host_ops(host) if rf is not None]
    ids = kineto_record_ids(device)
    return sum(rf in ids for _, rf in ops) / len(ops), len(ops)


def step_annotations(trace_events):
    return sorted(e["name"] for e in trace_events if e.get("name", "").startswith("ProfilerStep#"))


# The window these tests reason about: one step skipped, one warm-up, one recorded (the default records three).
ONE_STEP_WINDOW = ("--trace-wait-steps", "1", "--trace-warmup-steps", "1", "--trace-active-steps", "1")


# ---- one rank ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_rank_gpt2(tmp_path_factory):
    """A tiny GPT-2 trained 5 steps with a window of wait 1, warmup 1, active 1."""
    out = tmp_path_factory.mktemp("one_rank")
    args = parse_tracing_args("--enable-tracing", "--trace-output-dir", str(out), *ONE_STEP_WINDOW)
    tracer = build_tracer(args, rank=0, world_size=1, local_rank=0, device="cpu",
                          run_info={"model": "gpt2", "model_config": {"n_layer": 2}, "batch_size_per_rank": 2,
                                    "sequence_length": 16, "precision": "fp32", "compile": False,
                                    "attention": "eager"})
    train(tiny_gpt2(), tracer, steps=5, batch=torch.randint(0, 100, (2, 16)))
    return out / "gpt2_1cpu"


def test_one_rank_writes_one_valid_host_device_and_stacks_file(one_rank_gpt2):
    names = sorted(p.name for p in one_rank_gpt2.iterdir())
    assert names == ["device.0.json", "host.0.json", "run.json", "stacks.0.txt"]
    assert check_trace_file(one_rank_gpt2 / "host.0.json", "host") is None
    assert check_trace_file(one_rank_gpt2 / "device.0.json", "device") is None
    assert "self_cpu_time_total" in (one_rank_gpt2 / "stacks.0.txt").read_text().splitlines()[0]
    assert "aten::addmm" in (one_rank_gpt2 / "stacks.0.txt").read_text()


def test_host_and_device_traces_cover_the_same_single_step(one_rank_gpt2):
    host = load(one_rank_gpt2 / "host.0.json")
    device = load(one_rank_gpt2 / "device.0.json")
    assert step_annotations(host["nodes"]) == ["ProfilerStep#2"]
    assert step_annotations(device["traceEvents"]) == ["ProfilerStep#2"]
    # The steps after the window (3 and 4) ran with the profiler gone: one optimizer step in the trace.
    assert sum(n["name"].startswith("Optimizer.step#") for n in host["nodes"]) == 1


def test_host_operators_have_kineto_events_with_the_same_record_function_id(one_rank_gpt2):
    fraction, count = rf_id_match_fraction(load(one_rank_gpt2 / "host.0.json"), load(one_rank_gpt2 / "device.0.json"))
    assert count > 500
    assert fraction >= 0.99


def test_run_json_holds_run_info_versions_and_step_times(one_rank_gpt2):
    info = load(one_rank_gpt2 / "run.json")
    assert info["model"] == "gpt2" and info["model_config"] == {"n_layer": 2}
    assert info["batch_size_per_rank"] == 2 and info["sequence_length"] == 16 and info["precision"] == "fp32"
    assert info["world_size"] == 1 and info["traced_steps"] == [2]
    assert info["first_log_step"] == 1 and info["resumed_from"] is None  # the log's step 3 is traced step 2
    assert info["untraced_steps"] == [0, 3]  # the wait step, and as many after the window (step 4 is not timed)
    assert info["versions"]["torch"] == torch.__version__
    assert info["versions"]["transformers"]
    [rank] = info["ranks"]
    assert rank["rank"] == 0 and rank["device"] == "cpu" and rank["device_name"]
    assert len(rank["step_wall_time_s"]) == 1 and 0 < rank["step_wall_time_s"][0] < 60
    assert rank["files"] == {"device": "device.0.json", "host": "host.0.json", "stacks": "stacks.0.txt"}
    # the training thread's own CPU time per step: part of the process's, which holds every thread's
    for thread_key, process_key, steps in (("step_thread_cpu_time_s", "step_cpu_time_s", 1),
                                           ("untraced_step_thread_cpu_time_s", "untraced_step_cpu_time_s", 2)):
        assert len(rank[thread_key]) == len(rank[process_key]) == steps
        assert all(0 < thread <= process + 1e-3 for thread, process in zip(rank[thread_key], rank[process_key]))
    if chakra_tracer.thread_page_faults() is not None:  # Linux: the training thread's page faults, per step
        assert len(rank["step_page_faults"]) == 1 and len(rank["untraced_step_page_faults"]) == 2
        assert min(rank["step_page_faults"] + rank["untraced_step_page_faults"]) >= 0
    assert rank["heap_reserved_bytes"] >= 0
    assert rank["collective_start_wait_s"] is None  # one rank: no collective to start
    assert rank["intra_op_threads"] == torch.get_num_threads()  # whether the ops ran on the training thread alone
    if chakra_tracer.run_queue_wait_s() is not None:  # Linux: the training thread's wait for a core, per step
        assert len(rank["step_run_queue_wait_s"]) == 1 and len(rank["untraced_step_run_queue_wait_s"]) == 2
        assert min(rank["step_run_queue_wait_s"] + rank["untraced_step_run_queue_wait_s"]) >= 0


def test_the_machine_load_probe_runs_outside_the_traced_steps_annotations(tmp_path, monkeypatch):
    """The load probe around the window reads every process's /proc entry (2-7 ms on a 2-core machine): taken
    inside ProfilerStep#N it would count as the step's own time between operators, in the first and last traced
    steps."""
    from utils import metrics
    probes = []

    def slow_sample():
        probes.append(tracer._step)
        time.sleep(0.3)
        return metrics.sample_machine_load()

    monkeypatch.setattr(chakra_tracer, "sample_machine_load", slow_sample)
    for wait, warmup in ((1, 1), (0, 0)):
        probes.clear()
        tracer = ChakraTracer(tmp_path, f"load_{wait}_{warmup}", wait_steps=wait, warmup_steps=warmup, active_steps=2)
        train(tiny_mlp(), tracer, steps=wait + warmup + 3)
        assert len(probes) == 2  # one before the window, one after
        device = load(tmp_path / f"load_{wait}_{warmup}" / "device.0.json")
        steps = [e for e in device["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")]
        assert len(steps) == 2 and all(e["dur"] < 0.3e6 for e in steps)
        [rank] = load(tmp_path / f"load_{wait}_{warmup}" / "run.json")["ranks"]
        assert rank["machine_load"]["window_s"] > 0


def test_the_heap_is_reserved_once_before_the_warmup_step_and_its_time_is_returned(tmp_path, monkeypatch):
    """The tracer reserves heap for the profiler's records (utils/host_memory.py) at the end of the last untraced
    step, outside every timed step, and tells its caller how long that took, so the trainer's log leaves it out."""
    calls = []

    def reserve():
        calls.append(tracer._step)
        time.sleep(0.3)
        return 123 << 20, "host memory: reserved"

    monkeypatch.setattr(chakra_tracer, "reserve_heap_for_profiler", reserve)
    tracer = ChakraTracer(tmp_path, "reserve", wait_steps=2, warmup_steps=1, active_steps=1)
    model = tiny_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    returned = []
    with tracer:
        for _ in range(5):
            model(torch.randn(8, 16)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            returned.append(tracer.step())
    assert calls == [2]  # after the second (last untraced) step, before the warmup step
    # the export after the traced step (the fourth call) is the tracer's own work too; the other steps have none
    assert returned[1][0] >= 0.3 and returned[3][0] > 0.0
    assert all(wall == 0.0 for wall, _ in [returned[0], returned[2], returned[4]])
    [rank] = load(tmp_path / "reserve" / "run.json")["ranks"]
    assert rank["heap_reserved_bytes"] == 123 << 20
    assert max(rank["untraced_step_wall_time_s"] + rank["step_wall_time_s"]) < 0.3  # in no timed step


@pytest.mark.skipif(chakra_tracer.run_queue_wait_s() is None or not hasattr(os, "sched_setaffinity"),
                    reason="needs Linux's /proc/thread-self/schedstat and CPU affinity")
def test_run_queue_wait_counts_the_time_another_process_had_the_threads_core():
    """This thread and a busy process on one core: the thread, busy for 0.3 s of CPU, waits for the core about as
    long as it runs."""
    core = min(os.sched_getaffinity(0))
    before_affinity = os.sched_getaffinity(0)
    busy = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
    try:
        os.sched_setaffinity(0, {core})
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # until the busy process runs on the core
            if Path(f"/proc/{busy.pid}/stat").read_text().split(") ")[1].startswith("R"):
                break
        started_wait, started_cpu = chakra_tracer.run_queue_wait_s(), time.thread_time()
        while time.thread_time() - started_cpu < 0.3:
            pass
        waited = chakra_tracer.run_queue_wait_s() - started_wait
    finally:
        busy.kill()
        busy.wait()
        os.sched_setaffinity(0, before_affinity)
    assert waited > 0.1, f"waited {waited:.3f} s for a core shared with a busy process over 0.3 s of CPU"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir() or not hasattr(os, "sched_setaffinity"),
                    reason="needs Linux's /proc/self/task and CPU affinity")
def test_communication_threads_times_count_only_the_threads_named_like_gloos():
    """A busy thread that names itself as gloo's TCP loop does is counted, for about the CPU it used and, when a
    busy process shares its core, for the time it waited for the core; one with another name is not."""
    import ctypes
    import threading

    libc = ctypes.CDLL(None)
    core = min(os.sched_getaffinity(0))

    def times_of_a_busy_thread(name: bytes, shared: bool) -> tuple[float, float, float]:
        """What communication_threads_times_s counted (CPU, waiting) while a thread of this name ran 0.2 s of CPU
        on one core, and what it ran."""
        done, read, used = threading.Event(), threading.Event(), []

        def busy() -> None:
            libc.prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME: what /proc/self/task/<tid>/comm shows
            os.sched_setaffinity(0, {core})  # this thread only
            started = time.thread_time()
            while time.thread_time() - started < 0.2:
                pass
            used.append(time.thread_time() - started)
            done.set()
            read.wait()  # alive until read: an ended thread leaves the listing

        rival = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"]
                                 ) if shared else None
        try:
            if rival:
                deadline = time.monotonic() + 2.0
                while time.monotonic() < deadline:  # until the busy process runs on the core
                    if Path(f"/proc/{rival.pid}/stat").read_text().split(") ")[1].startswith("R"):
                        break
            before = chakra_tracer.communication_threads_times_s() or (0.0, 0.0)
            worker = threading.Thread(target=busy)
            worker.start()
            done.wait()
            after = chakra_tracer.communication_threads_times_s() or (0.0, 0.0)
            read.set()
            worker.join()
        finally:
            if rival:
                rival.kill()
                rival.wait()
        return after[0] - before[0], after[1] - before[1], used[0]

    on_cpu, waited, used = times_of_a_busy_thread(b"gloo_tcp_loop", shared=True)
    assert on_cpu == pytest.approx(used, rel=0.1) and used >= 0.2
    assert waited > 0.05, f"waited {waited:.3f} s for a core shared with a busy process over 0.2 s of CPU"
    on_cpu, waited, _ = times_of_a_busy_thread(b"pt_data_worker", shared=True)
    assert on_cpu == pytest.approx(0.0, abs=0.01) and waited == pytest.approx(0.0, abs=0.01)


def test_longer_window_records_every_active_step_and_its_time(tmp_path):
    tracer = ChakraTracer(tmp_path, "mlp", wait_steps=0, warmup_steps=1, active_steps=3, run_info={"model": "mlp"})
    train(tiny_mlp(), tracer, steps=6)
    info = load(tmp_path / "mlp" / "run.json")
    assert info["traced_steps"] == [1, 2, 3]
    assert len(info["ranks"][0]["step_wall_time_s"]) == 3
    assert len(info["step_wall_time_s_max"]) == 3
    assert step_annotations(load(tmp_path / "mlp" / "device.0.json")["traceEvents"]) == [
        "ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]


def resident_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads resident memory from /proc")
def test_tensors_of_a_traced_step_are_freed_when_the_step_is_done(tmp_path):
    """The recording must not keep a step's gradients and optimizer temporaries alive until the window closes:
    each held step would put the next step's allocations on fresh pages, a cost the untraced run never pays
    (Kineto's record_shapes did: +96 MB a step here, 650 MB for GPT-2 124M)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048))  # 32 MB of weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracer = ChakraTracer(tmp_path, "alloc", wait_steps=1, warmup_steps=0, active_steps=4, run_info={})
    resident = []
    with tracer:
        for _ in range(5):
            model(torch.ones(8, 2048)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            gc.collect()
            resident.append(resident_mb())
            tracer.step()
    growth = resident[-1] - resident[1]  # over the last three traced steps; held, they would add 3 x 96 MB
    assert growth < 128, f"resident memory grew by {growth:.0f} MB over three traced steps ({resident})"


# ---- tracing off ---------------------------------------------------------------------------------------------
def test_tracing_off_creates_no_profiler_no_observer_and_no_files(tmp_path, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("tracing is off but the tracer built a profiler or observer")

    monkeypatch.setattr(chakra_tracer, "profile", forbidden)
    monkeypatch.setattr(chakra_tracer, "ExecutionTraceObserver", forbidden)
    args = parse_tracing_args("--trace-output-dir", str(tmp_path / "outputs"))
    tracer = build_tracer(args, rank=0, world_size=1, local_rank=0, device="cpu", run_info={"model": "mlp"})
    assert isinstance(tracer, NullTracer)
    seen_profiler = []
    model, optimizer = tiny_mlp(), None
    optimizer = torch.optim.AdamW(model.parameters())
    with tracer:
        for _ in range(4):
            model(torch.randn(8, 16)).sum().backward()
            optimizer.step()
            tracer.step()
            seen_profiler.append(torch.autograd.profiler._is_profiler_enabled)
    assert seen_profiler == [False] * 4
    assert not (tmp_path / "outputs").exists()


# ---- arguments and naming ------------------------------------------------------------------------------------
def test_tracing_flags_default_to_timed_untraced_steps_and_three_recorded_ones():
    tracing = parse_tracing_args().tracing
    assert not tracing.enable_tracing and tracing.trace_output_dir == "./outputs" and tracing.trace_name is None
    assert parse_tracing_args().trace_window == (10, 1, 3)
    assert sum(parse_tracing_args("--trace-wait-steps", "5", "--trace-active-steps", "10").trace_window) == 16


def test_untraced_steps_after_the_window_default_to_as_many_as_before_it_and_lengthen_an_open_ended_run():
    assert parse_tracing_args("--enable-tracing").trace_after_steps == 10
    assert parse_tracing_args("--trace-wait-steps", "8").trace_after_steps == 8
    assert parse_tracing_args("--trace-wait-steps", "8", "--trace-after-steps", "0").trace_after_steps == 0
    # without --max-steps a traced run runs its window, then the untraced steps timed after it, and stops
    assert parse_tracing_args("--enable-tracing").planned_steps(steps_per_epoch=1000) == 10 + 1 + 3 + 10
    assert parse_tracing_args("--enable-tracing", "--trace-after-steps", "2").planned_steps(1000) == 16
    assert parse_tracing_args("--enable-tracing", "--max-steps", "10").planned_steps(1000) == 10


def test_default_trace_name_counts_ranks_and_device_kind(tmp_path):
    args = parse_tracing_args("--enable-tracing", "--trace-output-dir", str(tmp_path))
    tracer = build_tracer(args, rank=0, world_size=2, local_rank=0, device="cpu", run_info={"model": "bert"})
    assert tracer.trace_dir == tmp_path / "bert_2cpu"
    assert chakra_tracer.default_trace_name("gpt2", 8, "cuda") == "gpt2_8gpu"
    assert chakra_tracer.default_trace_name("models/my-gpt/", 1, "cpu") == "models-my-gpt_1cpu"
    named = build_tracer(parse_tracing_args("--enable-tracing", "--trace-name", "mine"), rank=1, world_size=2,
                         local_rank=1, device="cpu", run_info={"model": "bert"})
    assert named.trace_dir.name == "mine" and named.host_path.name == "host.1.json"


@pytest.mark.parametrize("flags, message", [
    (["--max-steps", "2", "--trace-wait-steps", "5"], "--max-steps 2 is shorter than the trace window of 7 steps"),
    (["--trace-active-steps", "0"], "--trace-active-steps must be at least 1, got 0"),
    (["--trace-wait-steps", "-1"], "--trace-wait-steps must be at least 0, got -1"),
    (["--trace-after-steps", "-2"], "--trace-after-steps must be at least 0, got -2"),
])
def test_a_window_that_cannot_be_traced_is_refused_when_the_flags_are_parsed(flags, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_tracing_args("--enable-tracing", *flags)
    [line] = capsys.readouterr().err.splitlines()
    assert stopped.value.code == 2 and line.startswith(f"error: {message}"), line


def test_a_short_run_shrinks_the_default_window_to_fit_keeping_a_timed_untraced_step_and_a_warm_up():
    """Down to wait 2 (step 0, never a sample of the pace, and one timed step), warm-up 1 and active 1: shrunk further,
    --max-steps 3 traced steps 1-2 with no untraced step timed (the .et kept the profiler's cost) and --max-steps 20
    --trace-active-steps 20 traced step 0 and its start-up, both with exit 0."""
    assert parse_tracing_args("--max-steps", "4").trace_window == (2, 1, 1)
    assert parse_tracing_args("--max-steps", "5").trace_window == (2, 1, 2)
    assert parse_tracing_args("--max-steps", "8").trace_window == (4, 1, 3)
    assert parse_tracing_args("--max-steps", "5", "--trace-active-steps", "2").trace_window == (2, 1, 2)
    assert parse_tracing_args("--max-steps", "2", "--trace-wait-steps", "0", "--trace-warmup-steps", "0",
                              "--trace-active-steps", "2").trace_window == (0, 0, 2)  # as asked


@pytest.mark.parametrize("flags, window", [
    (["--max-steps", "3"], "4 steps (wait 2 + warmup 1 + active 1; the shortest default window: one untraced step "
                           "timed after the run's first, one warm-up step and one traced step)"),
    (["--max-steps", "20", "--trace-active-steps", "20"], "23 steps (wait 2 + warmup 1 + active 20)"),
])
def test_a_run_too_short_for_the_shortest_window_is_refused(flags, window, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_tracing_args("--enable-tracing", *flags)
    [line] = capsys.readouterr().err.splitlines()
    assert stopped.value.code == 2
    assert line.startswith(f"error: {flags[0]} {flags[1]} is shorter than the trace window of {window}; raise "
                           "--max-steps or lower the --trace-*-steps")


@pytest.mark.parametrize("flags, what", [
    (["--trace-wait-steps", "1", "--trace-after-steps", "0"], "--trace-wait-steps 1 and --trace-after-steps 0"),
    (["--trace-wait-steps", "0", "--trace-after-steps", "0"], "--trace-wait-steps 0 and --trace-after-steps 0"),
    (["--trace-wait-steps", "1", "--trace-warmup-steps", "1", "--trace-active-steps", "2", "--max-steps", "4"],
     "--trace-wait-steps 1 and --trace-after-steps 1 time no untraced step after the run's first (--max-steps ends"),
])
def test_a_window_that_times_no_untraced_step_after_the_first_is_warned_of(flags, what, caplog):
    """--trace-wait-steps 0 timed no untraced step at all (its after-steps defaulted to the wait steps), and wait 1
    only step 0, which the conversion leaves out as start-up: the GPT-2 tiny .et kept the profiler's cost, 39.5 ms for
    a 15.9 ms step, with exit 0 and no warning."""
    args = parse_tracing_args("--enable-tracing", *flags)
    with caplog.at_level("WARNING", logger="utils.chakra_tracer"):
        build_tracer(args, rank=0, world_size=1, local_rank=0, device="cpu", run_info={"model": "m"})
    assert what in caplog.text and "so the .et files will keep the profiler's cost: give --trace-wait-steps 2 or " \
                                   "more, or --trace-after-steps 1 or more" in caplog.text, caplog.text


@pytest.mark.parametrize("flags, start, says", [
    # the quick launchers' --max-steps 12: the default window shrinks to wait 8 and leaves no step after it
    (["--max-steps", "12"], 0, "--max-steps 12 ends the run 0 step(s) after the window, so 0 of the 8 untraced "
     "steps to time after it are timed and the untraced pace the .et is corrected towards comes only from the run's "
     "first steps, which still warm up: raise --max-steps to 20"),
    (["--max-steps", "8", "--trace-after-steps", "5"], 0, "so 0 of the 5 untraced steps"),
    (["--max-steps", "20", "--trace-wait-steps", "3"], 0, None),  # window 7 and 3 after: all reached
    # resumed at step 12: --max-steps 20 leaves 8 steps, the window 7 of them
    (["--max-steps", "20", "--trace-wait-steps", "3"], 12, "ends the run 1 step(s) after the window, so 1 of the 3 "
     "untraced steps to time after it are timed and the untraced pace the .et is corrected towards comes mostly from "
     "the run's first steps, which still warm up: raise --max-steps to 22"),
])
def test_after_steps_cut_by_max_steps_are_warned_of(flags, start, says, caplog):
    """The after-steps a --max-steps near the window leaves out were dropped without a word, an explicit
    --trace-after-steps 5 included."""
    args = parse_tracing_args("--enable-tracing", *flags)
    with caplog.at_level("WARNING", logger="utils.chakra_tracer"):
        build_tracer(args, rank=0, world_size=1, local_rank=0, device="cpu", run_info={"model": "m"},
                     first_log_step=start + 1)
    if says is None:
        assert "ends the run" not in caplog.text, caplog.text
    else:
        assert says in caplog.text, caplog.text


@pytest.mark.parametrize("wait, warmup, warned", [("0", "0", True), ("0", "1", False), ("1", "0", False)])
def test_a_window_that_traces_the_runs_first_step_is_warned_of(wait, warmup, warned, caplog):
    """Step 0 holds the run's start-up: traced, only PyTorch's 'Profiler won't be using warmup' hinted at it."""
    args = parse_tracing_args("--enable-tracing", "--trace-wait-steps", wait, "--trace-warmup-steps", warmup,
                              "--trace-after-steps", "2")
    with caplog.at_level("WARNING", logger="utils.chakra_tracer"):
        build_tracer(args, rank=0, world_size=1, local_rank=0, device="cpu", run_info={"model": "m"})
    assert ("trace the run's first step, whose start-up" in caplog.text) == warned, caplog.text


def test_the_steps_timed_after_the_window_default_to_the_wait_steps_and_at_least_one(caplog):
    assert parse_tracing_args("--enable-tracing", "--trace-wait-steps", "0").trace_after_steps == 1
    assert parse_tracing_args("--enable-tracing", "--trace-wait-steps", "3").trace_after_steps == 3
    with caplog.at_level("WARNING", logger="utils.chakra_tracer"):
        for wait in ("0", "1", "2"):
            args = parse_tracing_args("--enable-tracing", "--trace-wait-steps", wait)
            build_tracer(args, rank=0, world_size=1, local_rank=0, device="cpu", run_info={"model": "m"})
    assert "trace window" not in caplog.text


# ---- early ends and reruns -----------------------------------------------------------------------------------
def test_run_stopped_before_the_window_writes_nothing_and_says_why(tmp_path, caplog):
    tracer = ChakraTracer(tmp_path, "short", wait_steps=2, warmup_steps=1, active_steps=1, run_info={"model": "m"})
    with caplog.at_level("WARNING", logger="utils.chakra_tracer"):
        train(tiny_mlp(), tracer, steps=2)
    assert "no trace written: the run ended at step 2, before the first traced step, 4" in caplog.text
    assert list((tmp_path / "short").iterdir()) == []


def test_the_tracers_messages_number_steps_as_the_log_does_after_a_resume(tmp_path, caplog):
    """Resumed from checkpoint-10, a run logged 'step 11/20 ... in the trace window' while the tracer said it traced
    optimizer steps [6, 7, 8]: run.json's numbers, counted from 0 at the tracer's start."""
    tracer = ChakraTracer(tmp_path, "resumed", wait_steps=2, warmup_steps=1, active_steps=3, run_info={"model": "m"},
                          first_log_step=11)
    with caplog.at_level("INFO", logger="utils.chakra_tracer"):
        train(tiny_mlp(), tracer, steps=4)
    assert "tracing steps 14-16 of the log" in caplog.text and "run.json's traced_steps [3, 4, 5]" in caplog.text
    assert "the trace window (steps 14-16) was cut short after step 14 (the run ended at step 14)" in caplog.text


def test_run_json_of_a_resumed_run_gives_the_logs_numbering_and_the_checkpoint_it_resumed_from(tmp_path):
    """Resumed from checkpoint-10, the log said 'tracing steps 14-16' while run.json said traced_steps [3, 4, 5],
    with nothing to tell the two numberings apart; the conversion side reads the new keys without complaint."""
    args = parse_tracing_args("--enable-tracing", "--trace-output-dir", str(tmp_path), "--trace-name", "resumed",
                              "--trace-wait-steps", "2", "--trace-warmup-steps", "1", "--trace-active-steps", "3")
    tracer = build_tracer(args, rank=0, world_size=1, local_rank=0, device="cpu", run_info={"model": "m"},
                          first_log_step=11, resumed_from=tmp_path / "ckpt" / "checkpoint-10")
    train(tiny_mlp(), tracer, steps=9)
    info, problem = read_run_info(tmp_path / "resumed" / "run.json")
    assert problem is None
    assert info["traced_steps"] == [3, 4, 5] and info["first_log_step"] == 11
    assert [info["first_log_step"] + step for step in info["traced_steps"]] == [14, 15, 16]
    assert info["resumed_from"] == str(tmp_path / "ckpt" / "checkpoint-10")


def test_the_window_is_published_after_the_last_timed_step_while_the_run_goes_on(tmp_path):
    """A window complete at step 14 was published only when the run ended: a crash, kill -9 or non-finite loss
    at step 5000 lost it."""
    tracer = ChakraTracer(tmp_path, "early", wait_steps=1, warmup_steps=1, active_steps=1, after_steps=2,
                          run_info={"model": "m"})
    folder = tmp_path / "early"
    with pytest.raises(RuntimeError, match="boom"), tracer:
        for _ in range(4):  # up to the last step timed after the window (3): nothing published yet
            torch.ones(8) @ torch.ones(8)
            tracer.step()
        assert not (folder / "run.json").exists()
        torch.ones(8) @ torch.ones(8)
        tracer.step()  # step 4 ends: the last timed one
        assert sorted(p.name for p in folder.iterdir()) == ["device.0.json", "host.0.json", "run.json",
                                                           "stacks.0.txt"]  # no .partial, and the lock is gone
        raise RuntimeError("boom")  # the run fails later: the published window stays
    assert load(folder / "run.json")["traced_steps"] == [2] and load(folder / "run.json")["untraced_steps"] == [0, 3, 4]
    assert check_trace_file(folder / "host.0.json", "host") is None


def test_error_after_the_window_keeps_valid_traces_and_propagates(tmp_path):
    tracer = ChakraTracer(tmp_path, "err", wait_steps=0, warmup_steps=1, active_steps=1, run_info={"model": "m"})
    with pytest.raises(RuntimeError, match="boom"):
        train(tiny_mlp(), tracer, steps=5, fail_at=3)
    assert check_trace_file(tmp_path / "err" / "host.0.json", "host") is None
    assert check_trace_file(tmp_path / "err" / "device.0.json", "device") is None
    assert load(tmp_path / "err" / "run.json")["traced_steps"] == [1]


def folder_files(folder):
    """{relative path: bytes} of every file under `folder`, hidden ones included."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def traced_earlier(out, name="mid"):
    """A complete one-step trace of a first run in out/name; every file under `out` afterwards."""
    train(tiny_mlp(), ChakraTracer(out, name, wait_steps=0, warmup_steps=1, active_steps=1,
                                   run_info={"model": "m"}), steps=2)
    assert load(out / name / "run.json")["traced_steps"] == [1]
    return folder_files(out)


def test_error_inside_the_window_writes_nothing_and_keeps_the_earlier_trace(tmp_path, caplog):
    before = traced_earlier(tmp_path)
    tracer = ChakraTracer(tmp_path, "mid", wait_steps=0, warmup_steps=1, active_steps=3, run_info={"model": "m"})
    with caplog.at_level("WARNING", logger="utils.chakra_tracer"), pytest.raises(RuntimeError, match="boom"):
        train(tiny_mlp(), tracer, steps=6, fail_at=3)
    assert "no trace written: the trace window (steps 2-4) was cut short after step 3" in caplog.text
    assert folder_files(tmp_path) == before  # not moved to .previous/, no partial file left


def test_run_stopped_inside_the_window_by_a_signal_writes_nothing_and_keeps_the_earlier_trace(tmp_path, caplog):
    # The trainer's SIGTERM/Ctrl-C handler finishes the step and leaves the loop: the tracer sees a clean exit
    before = traced_earlier(tmp_path)
    tracer = ChakraTracer(tmp_path, "mid", wait_steps=1, warmup_steps=0, active_steps=20, run_info={"model": "m"})
    with caplog.at_level("WARNING", logger="utils.chakra_tracer"):
        train(tiny_mlp(), tracer, steps=4)
    assert "no trace written: the trace window (steps 2-21) was cut short after step 4 (the run ended at step 4" in caplog.text
    assert folder_files(tmp_path) == before


def test_rerun_under_the_same_name_replaces_the_earlier_runs_files(tmp_path):
    run_dir = tmp_path / "again"
    run_dir.mkdir()
    for stale in ("host.3.json", "device.3.json", "stacks.3.txt", "host.0.json.invalid", ".host.2.json.partial"):
        (run_dir / stale).write_text("{}")
    (run_dir / "notes.txt").write_text("mine")
    train(tiny_mlp(), ChakraTracer(tmp_path, "again", world_size=1, run_info={"model": "m"}), steps=3)
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "device.0.json", "host.0.json", "notes.txt", "run.json", "stacks.0.txt"]


@pytest.mark.parametrize("name, problem", [
    ("/tmp/absT", "a path, not a folder name"), ("../up", "a path, not a folder name"),
    ("a/b", "a path, not a folder name"), ("..", "starts with '.'"), (".", "starts with '.'"),
    (".previous", "starts with '.'"), ("", "empty"),
])
def test_a_trace_name_that_is_not_a_plain_folder_name_is_refused_when_the_flags_are_parsed(name, problem, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_tracing_args("--enable-tracing", "--trace-name", name)
    [line] = capsys.readouterr().err.splitlines()
    assert stopped.value.code == 2 and line.startswith(f"error: --trace-name {name!r}: {problem}"), line


def test_an_absolute_trace_name_never_removes_the_folder_it_names(tmp_path):
    mine = tmp_path / "absT"
    mine.mkdir()
    (mine / "keep.txt").write_text("precious")
    with pytest.raises(TraceError, match=r"trace name '.*absT': a path, not a folder name"):
        train(tiny_mlp(), ChakraTracer(tmp_path / "traces", str(mine), run_info={"model": "m"}), steps=3)
    assert (mine / "keep.txt").read_text() == "precious"


def test_a_second_run_tracing_into_the_same_folder_is_refused_and_the_first_is_untouched(tmp_path):
    first = ChakraTracer(tmp_path, "busy", wait_steps=0, warmup_steps=1, active_steps=2, run_info={"model": "m"})
    model, steps_done = tiny_mlp(), 0
    with first:
        for _ in range(2):  # inside the window: the first run's hidden partial files are being written
            model(torch.randn(8, 16)).sum().backward()
            first.step()
            steps_done += 1
        partials = sorted(p.name for p in (tmp_path / "busy").iterdir() if p.name.endswith(".partial"))
        second = ChakraTracer(tmp_path, "busy", wait_steps=0, warmup_steps=1, active_steps=1, run_info={"model": "m"})
        with pytest.raises(TraceError, match=r"busy: another run \(pid \d+ .*\) is tracing into this folder"):
            second.__enter__()
        assert sorted(p.name for p in (tmp_path / "busy").iterdir() if p.name.endswith(".partial")) == partials
        model(torch.randn(8, 16)).sum().backward()
        first.step()
    assert load(tmp_path / "busy" / "run.json")["traced_steps"] == [1, 2]
    assert check_trace_file(tmp_path / "busy" / "host.0.json", "host") is None
    # the lock goes with the run: the next one traces into the folder
    train(tiny_mlp(), ChakraTracer(tmp_path, "busy", run_info={"model": "m"}), steps=3)
    assert not (tmp_path / "busy" / ".tracing.lock").exists()


def test_the_trace_folder_claimed_for_the_run_refuses_a_second_one_and_the_tracer_uses_its_lock(tmp_path):
    """claim_trace_dir locks the folder before the run moves or writes anything; the tracer then traces under that
    lock (a second flock of this process would refuse it) and releases it once the window is published."""
    args = parse_tracing_args("--enable-tracing", "--trace-output-dir", str(tmp_path), "--trace-name", "claimed",
                              *ONE_STEP_WINDOW)
    ctx = DistributedContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None)
    lock_file = tmp_path / "claimed" / ".tracing.lock"
    with claim_trace_dir(args, ctx, "m"):
        assert json.loads(lock_file.read_text())["pid"] == os.getpid()
        with pytest.raises(TraceError, match=r"claimed: another run \(pid \d+ .*\) is tracing into this folder"):
            with claim_trace_dir(args, ctx, "m"):
                pass
        train(tiny_mlp(), build_tracer(args, rank=0, world_size=1, local_rank=0, device="cpu",
                                       run_info={"model": "m"}), steps=5)
        assert load(tmp_path / "claimed" / "run.json")["traced_steps"] == [2]
        assert not lock_file.exists()
    assert not lock_file.exists()


@pytest.mark.slow
def test_a_run_refused_by_the_trace_folders_lock_leaves_the_earlier_runs_checkpoints_where_they_were(tmp_path):
    """With --overwrite-output-dir, a run refused by the trace folder's lock had already moved the finished run's
    checkpoints into .previous/ (replacing the run kept there) and saved initial_model: retried twice, it lost them."""
    save_dir = tmp_path / "ckpt"
    for name in ("best_model", "final_model", ".previous/final_model"):
        (save_dir / name).mkdir(parents=True)
        (save_dir / name / "model.safetensors").write_text(name)
    before = folder_files(save_dir)
    busy = TraceDirLock(tmp_path / "outputs" / "busy")  # another run tracing into the folder: this process
    busy.acquire()
    try:
        for _ in range(2):
            result = subprocess.run(
                [sys.executable, "gpt2/train.py", *trainer_flags(tmp_path, "--overwrite-output-dir", "--max-steps", "4",
                                                                "--enable-tracing", "--trace-output-dir",
                                                                str(tmp_path / "outputs"), "--trace-name", "busy")],
                cwd=REPO_ROOT, env=trainer_env(), capture_output=True, text=True, timeout=600)
            assert result.returncode == 1, result.stderr[-3000:]
            errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
            assert len(errors) == 1 and "is tracing into this folder" in errors[0], result.stderr[-3000:]
            assert folder_files(save_dir) == before  # nothing moved aside, no initial_model
    finally:
        busy.release()


def test_a_window_cut_short_is_not_exported_and_an_interrupted_finish_leaves_no_partial_file(tmp_path, monkeypatch):
    """Stopping inside the window, the first Ctrl-C spent its time exporting the window that was then removed, and
    a second Ctrl-C during that left the .partial files behind."""
    exports = []
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", lambda self, path, *a, **k: exports.append(path))
    train(tiny_mlp(), ChakraTracer(tmp_path, "cut", wait_steps=0, warmup_steps=1, active_steps=5,
                                   run_info={"model": "m"}), steps=3)
    assert exports == [] and list((tmp_path / "cut").iterdir()) == []

    finalize = ChakraTracer._finalize_capture

    def second_ctrl_c(self, *args, **kwargs):
        finalize(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(ChakraTracer, "_finalize_capture", second_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_mlp(), ChakraTracer(tmp_path, "cut", wait_steps=0, warmup_steps=1, active_steps=5,
                                       run_info={"model": "m"}), steps=3)
    assert list((tmp_path / "cut").iterdir()) == []


def export_then_fill_the_disk(self, path, *args, **kwargs):
    """profile.export_chrome_trace on a disk that fills up half way through the file."""
    Path(path).write_text('{"traceEvents": [')
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def test_a_full_disk_fails_the_run_in_one_line_and_leaves_no_file_half_written(tmp_path, monkeypatch):
    before = traced_earlier(tmp_path, "full")
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", export_then_fill_the_disk)
    with pytest.raises(TraceError) as failed:
        train(tiny_mlp(), ChakraTracer(tmp_path, "full", run_info={"model": "m"}), steps=3)
    assert str(failed.value) == (f"{tmp_path / 'full'}: the file system is full (No space left on device); free space "
                                 "or choose another --trace-output-dir; no trace written, the folder's earlier files "
                                 "left in place")
    assert folder_files(tmp_path) == before


def test_a_file_the_profiler_left_out_on_a_full_disk_fails_the_run_and_keeps_the_earlier_trace(tmp_path, monkeypatch):
    # Kineto reports no write error: on a full disk its export leaves an empty <file>.tmp and returns
    before = traced_earlier(tmp_path, "full")
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace",
                        lambda self, path, *args, **kwargs: Path(path + ".tmp").write_text(""))
    usage = chakra_tracer.shutil.disk_usage
    monkeypatch.setattr(chakra_tracer.shutil, "disk_usage", lambda folder: usage(folder)._replace(free=4096))
    with pytest.raises(TraceError, match=r"full: the file system is full \(.*device\.0\.json.*\); free space"):
        train(tiny_mlp(), ChakraTracer(tmp_path, "full", run_info={"model": "m"}), steps=3)
    assert folder_files(tmp_path) == before


def test_the_stacks_table_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    written = chakra_tracer.write_text_atomic
    monkeypatch.setattr(chakra_tracer, "write_text_atomic",
                        lambda path, text: written(path, text) if Path(path).name == "run.json" else
                        (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))))
    with pytest.raises(TraceError, match="the file system is full"):
        train(tiny_mlp(), ChakraTracer(tmp_path, "stacks", run_info={"model": "m"}), steps=3)
    assert list((tmp_path / "stacks").iterdir()) == []


# ---- validation of the files ---------------------------------------------------------------------------------
def test_check_trace_file_names_the_problem(tmp_path):
    host = {"schema": "1.1.1-chakra.0.0.4", "nodes": [{"id": 1, "name": "x"}]}
    cases = {
        "ok.json": (json.dumps(host), None),
        "twice.json": (json.dumps(host) + "\n" + json.dumps(host), "2 JSON documents concatenated"),
        "cut.json": (json.dumps(host)[:-5], "truncated JSON"),
        "empty.json": ("  \n", "empty file"),
        "nan.json": ('{"schema": "1", "nodes": [{"v": NaN}]}', "not valid JSON"),
        "kineto.json": ('{"traceEvents": []}', "not an execution trace"),
        "trailing.json": (json.dumps(host) + "]", "unexpected data after the JSON document"),
    }
    for name, (text, expected) in cases.items():
        (tmp_path / name).write_text(text)
        problem = check_trace_file(tmp_path / name, "host")
        if expected is None:
            assert problem is None, name
        else:
            assert problem is not None and expected in problem, (name, problem)
    assert "not a Kineto trace" in check_trace_file(tmp_path / "ok.json", "device")
    assert check_trace_file(tmp_path / "kineto.json", "device") is None


def test_stacks_table_sorts_by_self_device_time_on_cuda_else_self_cpu_time():
    assert chakra_tracer.stacks_sort_key(False) == "self_cpu_time_total"
    on_cuda = chakra_tracer.stacks_sort_key(True)
    assert on_cuda in ("self_device_time_total", "self_cuda_time_total")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.randn(64, 64).matmul(torch.randn(64, 64))
    assert "aten::matmul" in prof.key_averages().table(sort_by=on_cuda, row_limit=-1)


def test_multi_rank_trace_without_process_group_warns_that_collectives_cannot_be_placed(tmp_path, caplog):
    tracer = ChakraTracer(tmp_path, "nopg", rank=1, world_size=2, run_info={"model": "m"})
    with caplog.at_level("WARNING", logger="utils.chakra_tracer"):
        train(tiny_mlp(), tracer, steps=3)
    assert "host.1.json: no '## process_group:init ##' node" in caplog.text
    assert not (tmp_path / "nopg" / "run.json").exists()  # rank 1 never writes run.json


# ---- end to end through the trainer (gpt2/train.py, bert/train.py) ---------------------------------------------
def trainer_env():
    return dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))


def run_trainer(command, tmp_path):
    result = subprocess.run(command, cwd=REPO_ROOT, env=trainer_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def trainer_flags(tmp_path, *extra):
    return [*TINY_RUN, "--save-dir", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "logs"), *extra]


@pytest.fixture(scope="module")
def gpt2_one_rank_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt2_1r")
    run_trainer([sys.executable, "gpt2/train.py", *trainer_flags(tmp, "--enable-tracing", "--trace-output-dir",
                                                               str(tmp / "outputs"), "--trace-name", "gpt2_1cpu",
                                                               *ONE_STEP_WINDOW)], tmp)
    return tmp / "outputs" / "gpt2_1cpu"


@pytest.fixture(scope="module")
def bert_two_rank_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bert_2r")
    run_trainer([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                 "bert/train.py", "--num-gpus", "2",
                 *trainer_flags(tmp, "--enable-tracing", "--trace-output-dir", str(tmp / "outputs"),
                                *ONE_STEP_WINDOW[:4], "--trace-active-steps", "2")], tmp)
    [trace_dir] = (tmp / "outputs").iterdir()
    return trace_dir


@pytest.mark.slow
def test_trainer_one_rank_gpt2_writes_linked_host_and_device_traces(gpt2_one_rank_run):
    assert sorted(p.name for p in gpt2_one_rank_run.iterdir()) == [
        "device.0.json", "host.0.json", "run.json", "stacks.0.txt"]
    host, device = load(gpt2_one_rank_run / "host.0.json"), load(gpt2_one_rank_run / "device.0.json")
    assert step_annotations(host["nodes"]) == step_annotations(device["traceEvents"]) == ["ProfilerStep#2"]
    fraction, count = rf_id_match_fraction(host, device)
    assert count > 500 and fraction >= 0.99
    info = load(gpt2_one_rank_run / "run.json")
    assert info["traced_steps"] == [2] and info["world_size"] == 1
    assert info["sequence_length"] == 64 and info["batch_size_per_rank"] == 2 and info["precision"] == "fp32"
    assert info["compile"] is False and info["attention"] and info["model_config"]["n_layer"] >= 1
    assert info["versions"]["torch"] == torch.__version__
    assert len(info["ranks"][0]["step_wall_time_s"]) == 1 and info["ranks"][0]["step_wall_time_s"][0] > 0
    assert info["ranks"][0]["ranks_on_machine"] == 1  # not under torchrun: the machine's interrupt time is its own


@pytest.mark.slow
def test_trainer_two_rank_bert_traces_every_rank_with_process_group_and_collectives(bert_two_rank_run):
    assert bert_two_rank_run.name.endswith("_2cpu")  # the default name: <model>_<N>cpu
    assert sorted(p.name for p in bert_two_rank_run.iterdir()) == [
        "device.0.json", "device.1.json", "host.0.json", "host.1.json", "run.json", "stacks.0.txt", "stacks.1.txt"]
    pids = set()
    for rank in (0, 1):
        host = load(bert_two_rank_run / f"host.{rank}.json")
        device = load(bert_two_rank_run / f"device.{rank}.json")
        assert check_trace_file(bert_two_rank_run / f"device.{rank}.json", "device") is None
        assert step_annotations(device["traceEvents"]) == ["ProfilerStep#2", "ProfilerStep#3"]
        fraction, _ = rf_id_match_fraction(host, device)
        assert fraction >= 0.99
        pids.add(host["pid"])
        names = {n["name"] for n in host["nodes"]}
        [init] = [n for n in host["nodes"] if n["name"] == PG_INIT]
        assert '"group_size": 2' in init["inputs"]["values"][0]
        assert {"c10d::allreduce_", "gloo:all_reduce"} <= names
    assert len(pids) == 2  # each rank's own process wrote its own files
    info = load(bert_two_rank_run / "run.json")
    assert info["world_size"] == 2 and info["backend"] == "gloo" and info["traced_steps"] == [2, 3]
    assert [r["rank"] for r in info["ranks"]] == [0, 1] and [r["local_rank"] for r in info["ranks"]] == [0, 1]
    assert all(len(r["step_wall_time_s"]) == 2 and min(r["step_wall_time_s"]) > 0 for r in info["ranks"])
    assert info["step_wall_time_s_max"] == [max(r["step_wall_time_s"][i] for r in info["ranks"]) for i in (0, 1)]
    # how long an all-reduce issued after compute waited to start, measured together: the same on every rank
    waits = {r["collective_start_wait_s"] for r in info["ranks"]}
    assert len(waits) == 1 and 0 <= waits.pop() < 1
    assert all(r["intra_op_threads"] >= 1 for r in info["ranks"])
    if Path("/proc/self/task").is_dir():
        # Linux: gloo's threads did the all-reduces' CPU work in every step, traced and untraced
        for r in info["ranks"]:
            assert len(r["step_communication_cpu_time_s"]) == 2
            assert len(r["untraced_step_communication_cpu_time_s"]) == len(r["untraced_step_wall_time_s"])
            assert min(r["step_communication_cpu_time_s"] + r["untraced_step_communication_cpu_time_s"][1:]) > 0
            assert len(r["step_communication_run_queue_wait_s"]) == 2
            assert len(r["untraced_step_communication_run_queue_wait_s"]) == len(r["untraced_step_wall_time_s"])
            assert min(r["step_communication_run_queue_wait_s"]
                       + r["untraced_step_communication_run_queue_wait_s"]) >= 0
            assert len(r["step_page_faults"]) == 2
            assert len(r["untraced_step_page_faults"]) == len(r["untraced_step_wall_time_s"])
            # the machine's interrupt time in every timed step, shared by the two ranks torchrun started here
            assert len(r["step_interrupt_cpu_time_s"]) == 2 and r["ranks_on_machine"] == 2
            assert len(r["untraced_step_interrupt_cpu_time_s"]) == len(r["untraced_step_wall_time_s"])
            assert min(r["step_interrupt_cpu_time_s"] + r["untraced_step_interrupt_cpu_time_s"]) >= 0
    if reason_to_leave_malloc_alone() is None:
        # the trainer keeps freed memory in the process, so the tracer faulted in the heap the window's records
        # displace before the window (utils/host_memory.py)
        assert all(r["heap_reserved_bytes"] > 0 for r in info["ranks"])


@pytest.mark.slow
def test_trainer_with_tracing_off_builds_no_profiler_and_writes_no_traces(tmp_path):
    # The tracer's profiler and observer are replaced by a function that fails the run if called.
    script = (
        "import runpy, sys\n"
        "from utils import chakra_tracer\n"
        "def forbidden(*args, **kwargs):\n"
        "    raise SystemExit('tracing is off but a profiler or observer was built')\n"
        "chakra_tracer.profile = chakra_tracer.ExecutionTraceObserver = forbidden\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path('gpt2/train.py', run_name='__main__')\n"
    )
    outputs = tmp_path / "outputs"
    run_trainer([sys.executable, "-c", script, "gpt2/train.py",
                 *trainer_flags(tmp_path, "--max-steps", "3", "--trace-output-dir", str(outputs))], tmp_path)
    assert not outputs.exists()
    assert (tmp_path / "ckpt" / "final_model").is_dir()


def test_host_trace_written_twice_fails_the_run_names_the_file_and_writes_no_run_json(tmp_path, monkeypatch):
    finalize = ChakraTracer._finalize_capture

    def finalize_then_write_twice(self):
        already = self._finalized
        finalize(self)
        partial = self._partial(self.host_path)
        if not already and partial.exists():
            partial.write_bytes(partial.read_bytes() * 2)  # what two observers on one file leave behind

    monkeypatch.setattr(ChakraTracer, "_finalize_capture", finalize_then_write_twice)
    with pytest.raises(TraceError, match=r"twice/host\.0\.json: 2 JSON documents concatenated .*host\.0\.json\.invalid"):
        train(tiny_mlp(), ChakraTracer(tmp_path, "twice", run_info={"model": "m"}), steps=3)
    assert sorted(p.name for p in (tmp_path / "twice").iterdir()) == [
        "device.0.json", "host.0.json.invalid", "stacks.0.txt"]


def test_run_json_holds_the_untraced_steps_after_the_window_as_well_numbered_apart(tmp_path, monkeypatch):
    reads_at_step = []
    read = chakra_tracer.StepClocks.read

    def counted_read(wall_s):
        reads_at_step.append(tracer._step)
        return read(wall_s)

    monkeypatch.setattr(chakra_tracer.StepClocks, "read", staticmethod(counted_read))
    tracer = ChakraTracer(tmp_path, "after", wait_steps=2, warmup_steps=1, active_steps=2, after_steps=2,
                          run_info={"model": "m"})
    with tracer:
        for _ in range(9):  # 2 wait, 1 warm-up, 2 traced (3 and 4), 2 timed after, 2 more not timed
            torch.ones(8) @ torch.ones(8)
            tracer.step()
    # Each timed step's clocks are read when it begins and when it ends; after step 6 (the last timed) ends, never
    assert max(reads_at_step) == 6 and reads_at_step.count(6) == 2 and reads_at_step.count(5) == 2
    info = json.loads((tmp_path / "after" / "run.json").read_text())
    rank = info["ranks"][0]
    assert info["traced_steps"] == [3, 4] and info["untraced_steps"] == [0, 1, 5, 6]
    for key in ("untraced_step_wall_time_s", "untraced_step_cpu_time_s", "untraced_step_thread_cpu_time_s"):
        assert len(rank[key]) == 4 and min(rank[key]) >= 0, key
    assert min(rank["untraced_step_wall_time_s"]) > 0


def test_cuda_runs_ask_kineto_for_synchronisation_events_and_cpu_runs_do_not():
    from utils.chakra_tracer import cuda_sync_events_config

    assert cuda_sync_events_config(False) == {}
    config = cuda_sync_events_config(True)["experimental_config"]  # torch 2.13 has the option
    assert type(config).__name__ == "_ExperimentalConfig"


def test_run_json_holds_the_untraced_step_times_before_the_window(tmp_path):
    tracer = ChakraTracer(tmp_path, "timed", wait_steps=3, warmup_steps=1, active_steps=2, run_info={"model": "m"})
    with tracer:
        for _ in range(6):
            torch.ones(8) @ torch.ones(8)
            tracer.step()
    info = json.loads((tmp_path / "timed" / "run.json").read_text())
    rank = info["ranks"][0]
    assert len(rank["untraced_step_wall_time_s"]) == 3 and len(rank["step_wall_time_s"]) == 2
    assert all(t > 0 for t in rank["untraced_step_wall_time_s"]) and info["untraced_steps"] == [0, 1, 2]
    assert rank["machine_load"]["window_s"] > 0 and info["machine_busy"] in (True, False, None)
    # What recording one operator costs on this machine (a CPU run), measured before the window: a few µs, not 0.
    assert 0.5 < rank["recording_cost_per_op_us"] < 1000


TRACER_WORK_ON_ONE_RANK = '''
import os, sys, time, json
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[2])
from utils import chakra_tracer
from utils.chakra_tracer import ChakraTracer
from utils.distributed import distributed_context

with distributed_context():  # the process group as the trainer holds it, torn down as a run ends
    rank = dist.get_rank()
    if rank == 0:  # this rank's tracer takes 1 s longer over its own work: the heap reserved, the traces exported
        reserve, finalize = chakra_tracer.reserve_heap_for_profiler, ChakraTracer._finalize_capture
        chakra_tracer.reserve_heap_for_profiler = lambda: (time.sleep(1.0), reserve())[1]
        ChakraTracer._finalize_capture = lambda self: (time.sleep(1.0) if not self._finalized else None,
                                                       finalize(self))[1]
    tracer = ChakraTracer(sys.argv[1], "slow_rank", wait_steps=2, warmup_steps=0, active_steps=1, after_steps=1,
                          rank=rank, world_size=2, run_info={"model": "m"})
    with tracer:
        for _ in range(5):  # 2 untraced, 1 traced (step 2), 1 untraced timed after the window (step 3), 1 more
            gradient = torch.ones(1000)
            dist.all_reduce(gradient)  # where a rank done first waits for the other
            tracer.step()
'''


@pytest.mark.slow
def test_every_rank_starts_the_step_after_the_tracers_own_work_together(tmp_path):
    """A rank done first with the heap reservation or the window's export waited for the slowest at the next step's
    collective, inside that step's clocks: the traced step, or the untraced one after the window (499 ms instead of
    68 in a 2-rank GPT-2 tiny run, the only untraced step it timed after the window)."""
    script = tmp_path / "two_ranks.py"
    script.write_text(TRACER_WORK_ON_ONE_RANK)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           str(script), str(tmp_path), str(REPO_ROOT)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    info = load(tmp_path / "slow_rank" / "run.json")
    assert info["traced_steps"] == [2] and info["untraced_steps"] == [0, 1, 3]
    for rank in info["ranks"]:  # rank 1 too: its traced step and the step after the window hold no wait for rank 0
        assert max(rank["step_wall_time_s"]) < 0.5, rank
        assert rank["untraced_step_wall_time_s"][-1] < 0.5, rank


TRACER_RUN_WHOSE_RANK_0_DIES = '''
import os, signal, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[2])
from utils.chakra_tracer import ChakraTracer
from utils.distributed import distributed_context

signal.signal(signal.SIGTERM, lambda *args: None)  # torchrun's, once rank 0 is gone: rank 1 says what it saw
with distributed_context():
    rank = dist.get_rank()
    # traced step 1, untraced step 2 timed after it: published when step 2 ends
    tracer = ChakraTracer(sys.argv[1], "run", wait_steps=1, warmup_steps=0, active_steps=1, after_steps=1,
                          rank=rank, world_size=2, run_info={"model": "m"})
    with tracer:
        for step in range(4):
            if rank == 0 and step == int(sys.argv[3]):
                os._exit(1)
            dist.all_reduce(torch.ones(1000))
            tracer.step()
'''


@pytest.mark.slow
def test_a_rank_gone_before_publishing_leaves_every_ranks_earlier_trace_in_place_and_after_it_the_window(tmp_path):
    """Each rank published its window alone: with rank 0 killed after the window, rank 1's new traces replaced its
    old ones beside rank 0's old ones and the earlier run.json (a folder of two runs), and the run before, in
    .previous, had been removed when the failed run started. And a window complete long before a rank was lost was
    published only when the run ended: never, in a multi-rank run."""
    script = tmp_path / "two_ranks.py"
    script.write_text(TRACER_RUN_WHOSE_RANK_0_DIES)

    def traced(rank_0_dies_at: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                               str(script), str(tmp_path), str(REPO_ROOT), str(rank_0_dies_at)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))

    for _ in range(2):  # two whole runs: the first goes to .previous/run/
        done = traced(-1)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    folder, previous = tmp_path / "run", tmp_path / ".previous" / "run"

    def files() -> dict:
        return {path: path.read_bytes() for path in (*folder.iterdir(), *previous.iterdir())
                if path.is_file() and not path.name.startswith(".")}

    kept = files()
    assert {"run.json", "device.0.json", "device.1.json", "host.0.json", "host.1.json"} <= {p.name for p in kept}
    done = traced(2)  # in the untraced step timed after the window, before the ranks publish it
    assert done.returncode != 0
    assert files() == kept, "the earlier runs' files, both generations, as they were"
    assert "rank 1: " + f"{folder}: no trace written: another rank was lost after the trace window" in done.stderr
    assert "this rank failed" not in done.stderr

    run_id = load(folder / "run.json")["run_id"]
    done = traced(3)  # once the window is published: it stays
    assert done.returncode != 0
    info = load(folder / "run.json")
    assert info["run_id"] != run_id and info["traced_steps"] == [1] and info["untraced_steps"] == [0, 2]
    assert load(previous / "run.json")["run_id"] == run_id
    for rank in (0, 1):
        assert check_trace_file(folder / f"host.{rank}.json", "host") is None
        assert check_trace_file(folder / f"device.{rank}.json", "device") is None


@pytest.mark.slow
def test_a_rank_killed_after_the_window_leaves_the_published_traces_and_the_other_rank_says_so_in_one_line(tmp_path):
    """kill -9 of one rank long after the window: the window had been lost, and the surviving rank printed 'this
    rank failed after the trace window' and gloo's 30-line traceback. The ranks start without torchrun, whose SIGTERM
    to the survivor would race its failed collective."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "gpt2/train.py", "--num-gpus", "2",
               *trainer_flags(tmp_path, "--max-steps", "20000", "--enable-tracing", "--trace-output-dir",
                              str(tmp_path / "outputs"), "--trace-name", "k", *ONE_STEP_WINDOW)]
    logs = [tmp_path / f"rank{rank}.log" for rank in (0, 1)]
    ranks = []
    for rank, log in enumerate(logs):
        with open(log, "w") as out:
            ranks.append(subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=dict(
                trainer_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")))
    try:
        for _ in range(1200):
            if "traces of steps" in logs[0].read_text() or ranks[0].poll() is not None:
                break
            time.sleep(0.1)
        assert "traces of steps 3 of the log from 2 rank(s)" in logs[0].read_text(), logs[0].read_text()[-3000:]
        ranks[1].kill()
        assert ranks[0].wait(timeout=300) == 1
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.wait()
    text = logs[0].read_text()
    [error] = [line for line in text.splitlines() if line.startswith("error:")]
    assert error.startswith("error: another rank was lost at step ") and "no checkpoint of this run was saved" in error
    assert "Traceback" not in text and "this rank failed" not in text, text[-3000:]
    info = load(tmp_path / "outputs" / "k" / "run.json")
    assert info["traced_steps"] == [2] and info["world_size"] == 2


def test_run_json_says_how_many_micro_batches_each_timed_step_took_and_warns_when_they_differ(tmp_path, caplog):
    """With --gradient-accumulation-steps 4 and 7 batches an epoch, every other step took 3 micro-batches: a GPT-2
    tiny run's untraced steps were 353 ms (3) and 465-477 ms (4), and run.json gave no way to tell them apart."""
    tracer = ChakraTracer(tmp_path, "unequal", wait_steps=2, warmup_steps=1, active_steps=2, after_steps=2,
                          run_info={"model": "m"})
    with caplog.at_level("WARNING", logger="utils.chakra_tracer"), tracer:
        for micro_batches in (4, 3, 4, 3, 4, 3, 4):
            torch.ones(8) @ torch.ones(8)
            tracer.step(micro_batches)
    rank = json.loads((tmp_path / "unequal" / "run.json").read_text())["ranks"][0]
    assert rank["untraced_step_micro_batches"] == [4, 3, 3, 4] and rank["step_micro_batches"] == [3, 4]
    # numbered as the log numbers them (from 1), the traced one said so
    assert "the timed steps 2 (3), 4 (3, traced), 6 (3) of the log took fewer micro-batches" in caplog.text
