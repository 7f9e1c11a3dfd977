"""What-if fidelity of the .et: dependencies from causes, per-operator medians, and the profiler's cost removed."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from chakra.schema.protobuf.et_def_pb2 import COMM_COLL_NODE, COMP_NODE
from conversion_helpers import CPU_FIXTURES, close_window, read_et_with_protolib, read_json, scaled_trace, write_json
from trace_tools.graph import children_of, descendants as descendants_of
from trace_tools.link import GPU_OP, link_host_and_device, remove_recording_overhead
from trace_tools.load import load_device_trace, load_host_trace, tensor_storages
from trace_tools.pipeline import convert_rank
from trace_tools.summary import durations_text


def rank0_copy(source: Path, folder: Path, with_run_info: bool = False) -> Path:
    """Rank 0's host and device traces of `source` (and its run.json if asked) in a folder of their own."""
    folder.mkdir()
    for name in ("host.0.json.gz", "device.0.json.gz") + (("run.json",) if with_run_info else ()):
        (folder / name).write_bytes((source / name).read_bytes())
    return folder


def convert_rank0(folder: Path, et_path: Path):
    return convert_rank(folder / "host.0.json.gz", folder / "device.0.json.gz", et_path)


def link_folder(folder: Path, rank: int = 0):
    host = load_host_trace(next(folder.glob(f"host.{rank}.json*")))
    device = load_device_trace(next(folder.glob(f"device.{rank}.json*")))
    return link_host_and_device(host, device, rank)


def touches_buffer(linked, node: int, buffer: set[int]) -> bool:
    """The node, or the CPU op that launched it, reads or writes one of the storages in `buffer`."""
    op = linked.parent[node] if linked.kind[node] == GPU_OP else node
    h = linked.host_index[op] if op >= 0 else -1
    return h >= 0 and bool(buffer & set(linked.host.storages[h]))


def collective_buffer(linked, c: int) -> set[int]:
    buffer: set[int] = set()
    x = c if linked.kind[c] != GPU_OP else linked.parent[c]
    for _ in range(8):
        if x < 0:
            break
        if linked.host_index[x] >= 0:
            buffer |= set(linked.host.storages[linked.host_index[x]])
        x = linked.parent[x]
    return buffer


def test_tensor_storages_are_read_from_tensors_alone_and_in_lists():
    tensor = [7, 42, 0, 16, 4, "cpu"]
    assert tensor_storages([tensor, [3], 1], [[tensor, [8, 43, 0, 2, 4, "cpu"]]]) == (42, 43)
    assert tensor_storages(["<Object>", 5], None) == ()


@pytest.mark.parametrize("run,rank", [("gpt2_2x128_2r_buckets", 0), ("gpt2_2x128_2r_buckets", 1), ("gpt2_tiny_2r", 0),
                                      ("bert_tiny_2r_ours", 0)])
def test_ddp_bucket_all_reduce_gates_only_the_ops_that_consume_its_buffer(run, rank):
    # The bucket's all-reduce runs on the gloo worker while the backward goes on: no backward op may wait for it
    # (a slower network would delay the whole backward in the simulator); DDP's finalize, which reads the bucket,
    # must.
    linked = link_folder(CPU_FIXTURES / run, rank)
    children = children_of(linked.deps)
    buckets = [c for c, info in linked.comm.items() if info["comm_size"] > 100_000]
    assert buckets
    for c in buckets:
        consumers = [d for d in children[c] if d not in linked.comm]
        assert consumers, "the finalize that reads the bucket must wait for its all-reduce"
        assert all(touches_buffer(linked, d, collective_buffer(linked, c)) for d in consumers)
        backward_after_enqueue = [i for i in range(len(linked.kind)) if "Backward" in linked.name(i)
                                  and linked.ts[i] > linked.ts[c]]
        descendants = descendants_of(children, [c])
        assert not descendants & set(backward_after_enqueue)
    if run == "gpt2_2x128_2r_buckets":  # the first bucket is reduced while most of the backward is still to run
        first = min(buckets, key=lambda c: linked.ts[c])
        assert sum(1 for i in range(len(linked.kind)) if "Backward" in linked.name(i) and linked.ts[i] > linked.ts[first]) > 100
    assert linked.stats["dependency_rules"].get("consumer", 0) >= len(buckets)


def test_dlrm_data_parallel_all_reduce_gates_no_backward_kernel_that_does_not_read_its_result(shared_fixtures):
    linked = link_folder(shared_fixtures / "gpu" / "param_dlrm_v100_8r", 0)
    children = children_of(linked.deps)
    all_reduces = [c for c, info in linked.comm.items() if info["comm_type"] == 0]
    assert all_reduces
    for c in all_reduces:
        buffer = collective_buffer(linked, c)
        descendants = descendants_of(children, [c])
        for d in descendants:
            if linked.kind[d] == GPU_OP and d not in linked.comm:
                launcher = linked.name(linked.parent[d]) if linked.parent[d] >= 0 else ""
                assert "Backward" not in launcher or touches_buffer(linked, d, buffer), launcher


def test_megatron_tensor_parallel_all_reduce_still_gates_the_compute_that_uses_its_output(shared_fixtures):
    linked = link_folder(shared_fixtures / "gpu" / "astra-sim_megatron_tp8_a100_8r", 0)
    children = children_of(linked.deps)
    gated = 0
    for c in linked.comm:
        compute = [d for d in children[c] if d not in linked.comm and linked.kind[d] == GPU_OP
                   and linked.lane[d] != linked.lane[c]]
        gated += bool(compute)
    assert gated == len(linked.comm) == 84
    # and the all-reduce itself waits for the kernel that produced its input on the compute stream
    assert linked.stats["dependency_rules"]["stream wait"] == 84


def test_no_edge_between_streams_of_one_gpu_without_a_cause(shared_fixtures):
    for run in ("param_dlrm_v100_8r", "astra-sim_megatron_tp8_a100_8r", "param_resnet_2080ti_1r"):
        linked = link_folder(shared_fixtures / "gpu" / run, 0)
        allowed = {"launch", "consumer", "stream wait", "collective order"}
        for i, deps in enumerate(linked.deps):
            if linked.kind[i] != GPU_OP:
                continue
            for d in deps:
                if linked.kind[d] == GPU_OP and linked.lane[d] != linked.lane[i]:
                    assert d in linked.comm or i in linked.comm, (run, linked.name(d), linked.name(i))
        assert set(linked.stats["dependency_rules"]) - allowed - {"synchronising call", "thread handoff", "caller",
                                                                   "enqueue", "blocked caller"} == set()


def test_the_spread_warning_names_the_page_faults_of_the_traced_steps(tmp_path):
    """A traced step slowed by fresh pages (the profiler's records took the holes its tensors would have reused):
    where run.json counted the training thread's page faults, the warning gives them beside an untraced step's."""
    folder = _three_steps_one_slow(tmp_path, 3.0)
    step_s = 0.03
    (folder / "run.json").write_text(json.dumps({"ranks": [{
        "rank": 0, "step_wall_time_s": [step_s, step_s, 3 * step_s],
        "untraced_step_wall_time_s": [9 * step_s, step_s, step_s, step_s],
        "step_page_faults": [0, 0, 41234], "untraced_step_page_faults": [90000, 12, 0, 4]}]}))
    result = convert_rank(folder / "host.0.json", folder / "device.0.json", folder / "run.0.et")
    [warning] = [w for w in result.warnings if "differ by" in w]
    assert "page-faulted 0, 0, 41,234 pages in the traced steps and 4 in an untraced step (median)" in warning
    assert "trace again on a quieter machine" in warning  # run.json measured no machine load: the general advice


def _three_steps_one_slow(tmp_path: Path, slow_factor: float) -> Path:
    """The bundled GPT-2 step three times, the last with every CPU op `slow_factor` times longer."""
    source = CPU_FIXTURES / "gpt2_tiny_2r"
    host, device = scaled_trace(read_json(source / "host.0.json.gz"), read_json(source / "device.0.json.gz"), 3)
    events = [e for e in device["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    last_start = steps[-1]["ts"]
    origin = min(e["ts"] for e in events if e["ts"] >= last_start)
    for e in events:
        if e["ts"] >= last_start:
            e["ts"] = origin + (e["ts"] - origin) * slow_factor
            e["dur"] = e["dur"] * slow_factor
    close_window(device)
    folder = tmp_path / "run"
    folder.mkdir()
    write_json(folder / "host.0.json", host)
    write_json(folder / "device.0.json", device)
    return folder


def test_one_slow_traced_step_does_not_make_the_et(tmp_path):
    folder = _three_steps_one_slow(tmp_path, 3.0)
    result = convert_rank(folder / "host.0.json", folder / "device.0.json", folder / "run.0.et")
    single = convert_rank(CPU_FIXTURES / "gpt2_tiny_2r" / "host.0.json.gz",
                          CPU_FIXTURES / "gpt2_tiny_2r" / "device.0.json.gz", tmp_path / "one.0.et")
    assert len(result.traced_steps_us) == 3
    assert result.step_spread > 1.0 and any("differ by" in w for w in result.warnings)
    # the .et is the median step: as long as one of the two normal steps, not the slow one
    assert result.nodes == single.nodes
    assert result.critical_path_us == pytest.approx(single.critical_path_us, rel=0.02)
    _, nodes = read_et_with_protolib(folder / "run.0.et")
    _, single_nodes = read_et_with_protolib(tmp_path / "one.0.et")
    total = sum(n.duration_micros for n in nodes)
    assert total == pytest.approx(sum(n.duration_micros for n in single_nodes), rel=0.02)


def _steps_stretched(tmp_path: Path, name: str, windows: list, factor: float = 2.0) -> Path:
    """The bundled GPT-2 step (rank 0) once per entry of `windows`: in each, the part of the step between the two
    fractions of it that the entry gives (None: no part) runs `factor` times slower (every CPU event in it longer,
    what follows it later), as a descheduling or a late peer slows one step and not the next."""
    source = CPU_FIXTURES / "gpt2_tiny_2r"
    host, device = scaled_trace(read_json(source / "host.0.json.gz"), read_json(source / "device.0.json.gz"),
                                len(windows))
    events = [e for e in device["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    bounds = [s["ts"] for s in steps[1:]] + [float("inf")]
    slow = [(step["ts"] + w[0] * step["dur"], step["ts"] + w[1] * step["dur"]) if w else (0.0, 0.0)
            for step, w in zip(steps, windows)]

    def moved(t: float) -> float:
        shift = 0.0
        for (a, b), bound in zip(slow, bounds):
            shift += (factor - 1) * max(0.0, min(t, b) - a)
            if t < bound:
                break
        return t + shift

    for e in events:
        end = moved(e["ts"] + e["dur"])
        e["ts"] = moved(e["ts"])
        e["dur"] = end - e["ts"]
    close_window(device)
    folder = tmp_path / name
    folder.mkdir()
    write_json(folder / "host.0.json", host)
    write_json(folder / "device.0.json", device)
    return folder


def _et_total(folder: Path) -> int:
    host, device = sorted(folder.glob("host.0.json*"))[0], sorted(folder.glob("device.0.json*"))[0]
    assert convert_rank(host, device, folder / "run.0.et").status == "ok"
    _, nodes = read_et_with_protolib(folder / "run.0.et")
    return sum(n.duration_micros for n in nodes if n.type == COMP_NODE)


def test_per_operator_medians_keep_the_time_of_a_typical_step(tmp_path):
    # Three steps, each with a different third slowed: every op is slow in one step of three, so its median is its
    # fast time, yet every step took longer. The .et must take about as long as one of those steps, not the fast
    # sum of the medians (which the old per-operator medians gave: 8% over the unslowed step, 11% under all three).
    thirds = [(k / 3, (k + 1) / 3) for k in range(3)]
    mixed = _et_total(_steps_stretched(tmp_path, "mixed", thirds))
    alone = [_et_total(_steps_stretched(tmp_path, f"alone{k}", [third])) for k, third in enumerate(thirds)]
    unslowed = _et_total(rank0_copy(CPU_FIXTURES / "gpt2_tiny_2r", tmp_path / "unslowed"))
    assert min(alone) > 1.15 * unslowed
    assert 0.99 * min(alone) <= mixed <= 1.01 * max(alone)


def test_a_longer_wait_in_another_step_is_not_taken_for_compute(tmp_path):
    # Rank 0's thread idles 54 ms in its step while the all-reduce runs (it waits for rank 1). A second step where
    # that wait took twice as long: the .et holds the first (the shorter) step, whose wait is measured; its idle
    # time must not become the median of both steps' idle time, 54 ms of which would then count as compute.
    linked = link_folder(CPU_FIXTURES / "gpt2_tiny_2r")
    waiter = max(range(len(linked.kind)), key=lambda i: linked.wait[i])
    assert linked.wait[waiter] > 40_000
    collective = next(iter(linked.comm))
    span = ((linked.ts[collective] - linked.step_start) / linked.step_dur,
            (linked.ts[collective] + linked.dur[collective] - linked.step_start) / linked.step_dur)
    two = _steps_stretched(tmp_path, "two", [None, span])
    one = rank0_copy(CPU_FIXTURES / "gpt2_tiny_2r", tmp_path / "one")
    assert convert_rank(two / "host.0.json", two / "device.0.json", two / "run.0.et").traced_steps_us[1] > \
        1.15 * convert_rank0(one, one / "run.0.et").traced_step_us
    assert _et_total(two) == pytest.approx(_et_total(one), rel=0.03)


def test_profiler_cost_measured_by_the_tracer_is_taken_out_of_the_durations(tmp_path):
    folder = rank0_copy(CPU_FIXTURES / "gpt2_tiny_2r", tmp_path / "run")
    plain = convert_rank0(folder, tmp_path / "plain.0.et")
    traced_s = plain.traced_step_us / 1e6
    untraced_s = 0.7 * traced_s
    (folder / "run.json").write_text(json.dumps({"ranks": [{
        "rank": 0, "step_wall_time_s": [traced_s],
        "untraced_step_wall_time_s": [5 * traced_s, untraced_s, untraced_s]}]}))
    result = convert_rank0(folder, folder / "run.0.et")
    assert result.untraced_step_us == pytest.approx(untraced_s * 1e6)
    # the durations are calibrated so that replaying the .et's graph takes the untraced step
    assert result.critical_path_us == pytest.approx(untraced_s * 1e6, rel=0.005)
    assert result.recording_overhead_us == pytest.approx(plain.critical_path_us - untraced_s * 1e6, rel=0.01)
    metadata, nodes = read_et_with_protolib(folder / "run.0.et")
    meta = {a.name: a for a in metadata.attr}
    assert meta["untraced_step_micros"].int64_val == round(untraced_s * 1e6)
    raw = {n.id: next((a.int64_val for a in n.attr if a.name == "traced_micros"), n.duration_micros) for n in nodes}
    assert sum(raw.values()) > sum(n.duration_micros for n in nodes)  # the traced durations are kept beside


def test_untraced_steps_after_the_window_count_and_only_the_runs_first_step_is_left_out(tmp_path):
    from trace_tools.step_timing import read_step_times

    rank = {"rank": 0, "step_wall_time_s": [0.05], "untraced_step_wall_time_s": [0.09, 0.03, 0.02, 0.02, 0.02],
            "untraced_step_thread_cpu_time_s": [0.08, 0.03, 0.02, 0.02, 0.02]}
    (tmp_path / "run.json").write_text(json.dumps({"untraced_steps": [0, 1, 6, 7, 8], "ranks": [rank]}))
    times = read_step_times(tmp_path, 0)
    # step 0 (start-up) left out; the early step 1 is outweighed by the three timed after the window
    assert times.untraced_us == pytest.approx([3e4, 2e4, 2e4, 2e4]) and times.untraced_median_us == pytest.approx(2e4)
    assert times.untraced_thread_cpu_us == pytest.approx([3e4, 2e4, 2e4, 2e4])
    # a window with no wait steps: every untraced step is after it, and none is the run's first
    (tmp_path / "run.json").write_text(json.dumps({"untraced_steps": [4, 5, 6, 7, 8], "ranks": [rank]}))
    assert len(read_step_times(tmp_path, 0).untraced_us) == 5
    # an older run.json without the step numbers: its first untraced step is step 0
    (tmp_path / "run.json").write_text(json.dumps({"ranks": [rank]}))
    assert len(read_step_times(tmp_path, 0).untraced_us) == 4


def test_untraced_steps_of_other_micro_batches_than_the_traced_ones_are_left_out(tmp_path):
    """--gradient-accumulation-steps 4 with 7 batches an epoch: every other step took 3 micro-batches (353 ms
    against 465-477 in a GPT-2 tiny run), and the untraced median mixed the two kinds of step."""
    from trace_tools.step_timing import read_step_times

    def rank(number):
        return {"rank": number, "step_wall_time_s": [0.47, 0.46], "step_micro_batches": [4, 4],
                "untraced_step_wall_time_s": [0.9, 0.35, 0.47, 0.35, 0.46, 0.35],
                "untraced_step_thread_cpu_time_s": [0.8, 0.3, 0.4, 0.3, 0.4, 0.3],
                "untraced_step_micro_batches": [4, 3, 4, 3, 4, 3]}
    run = {"world_size": 2, "untraced_steps": [0, 1, 2, 6, 7, 8], "ranks": [rank(0), rank(1)]}
    (tmp_path / "run.json").write_text(json.dumps(run))
    times = read_step_times(tmp_path, 0)
    assert times.untraced_us == pytest.approx([4.7e5, 4.6e5])  # step 0 and the 3-micro-batch steps left out
    assert times.untraced_thread_cpu_us == pytest.approx([4e5, 4e5]) and times.slowest_rank_scale == 1.0
    # every untraced step took other micro-batches than the traced ones: none is a sample of them, none is used
    # (the converter then keeps the profiler's cost and says why: test_conversion_convert.py)
    for entry in run["ranks"]:
        entry["untraced_step_micro_batches"] = [3] * 6
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert read_step_times(tmp_path, 0) is None


def test_the_runs_full_step_is_its_largest_micro_batch_count_even_where_short_steps_are_as_many(tmp_path):
    """7 batches an epoch at --gradient-accumulation-steps 4 alternate steps of 4 and 3: as many short steps as full
    ones, and a window of one short step made the traced steps' count of 3 the one the untraced steps were
    matched to. The trainer refuses an accumulation above an epoch's batches, so the largest count is the full step."""
    from trace_tools.step_timing import micro_batches_of, read_step_times

    rank = {"rank": 0, "step_wall_time_s": [0.36], "step_micro_batches": [3],
            "untraced_step_wall_time_s": [0.9, 0.35, 0.47, 0.35, 0.46], "untraced_step_micro_batches": [4, 3, 4, 3, 4]}
    info = {"traced_steps": [5], "untraced_steps": [0, 1, 2, 3, 4], "ranks": [rank]}
    (tmp_path / "run.json").write_text(json.dumps(info))
    counts = micro_batches_of(info, 0)
    assert counts.full == 4 and counts.of("ProfilerStep#5") == 3
    assert read_step_times(tmp_path, 0) is None  # no traced full step to measure against the untraced ones
    assert read_step_times(tmp_path, 0, micro_batches=3).untraced_us == pytest.approx([3.5e5, 3.5e5])
    # every timed step short (the window at an epoch's end, one untraced step before it): run.json's accumulation
    rank.update(untraced_step_wall_time_s=[0.9, 0.35], untraced_step_micro_batches=[3, 3])
    assert micro_batches_of(dict(info, gradient_accumulation_steps=4), 0).full == 4


def test_untraced_step_times_without_a_usable_sample_leave_durations_alone(tmp_path):
    folder = rank0_copy(CPU_FIXTURES / "gpt2_tiny_2r", tmp_path / "run")
    (folder / "run.json").write_text(json.dumps({"ranks": [{"rank": 0, "step_wall_time_s": [0.3],
                                                             "untraced_step_wall_time_s": [0.2]}]}))
    result = convert_rank0(folder, folder / "run.0.et")
    assert result.untraced_step_us == 0 and result.recording_overhead_us == 0


def _two_stream_run(tmp_path: Path, with_sync_event: bool) -> Path:
    """A tiny GPU step by hand: `producer` launches a kernel on stream 7, `consumer` one on stream 20 after a
    cudaStreamWaitEvent on stream 7's recorded event; the kernels are far apart in time either way."""
    attrs = lambda rf: [{"name": "rf_id", "type": "uint64", "value": rf}, {"name": "tid", "type": "uint64", "value": 1}]
    io = {"values": [], "shapes": [], "types": []}
    host = {"schema": "1.1.1-chakra.0.0.4", "pid": 1, "time": "t", "start_ts": 0, "finish_ts": 0, "nodes": [
        {"id": 1, "name": "[pytorch|profiler|execution_trace|process]", "ctrl_deps": 0, "inputs": io, "outputs": io,
         "attrs": attrs(0)},
        {"id": 2, "name": "[pytorch|profiler|execution_trace|thread]", "ctrl_deps": 1, "inputs": io, "outputs": io,
         "attrs": attrs(0)},
        {"id": 3, "name": "ProfilerStep#0", "ctrl_deps": 2, "inputs": io, "outputs": io, "attrs": attrs(1)},
        {"id": 4, "name": "producer", "ctrl_deps": 3, "inputs": io, "outputs": io, "attrs": attrs(2)},
        {"id": 5, "name": "consumer", "ctrl_deps": 3, "inputs": io, "outputs": io, "attrs": attrs(3)}]}
    cpu = lambda name, rf, ts, dur, cat="cpu_op": {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts,
                                                  "dur": dur, "args": {"External id": rf, "Record function id": rf}}
    rt = lambda name, corr, ts: {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 1, "tid": 1, "ts": ts,
                                 "dur": 5, "args": {"correlation": corr}}
    kernel = lambda name, corr, stream, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream,
                                                  "ts": ts, "dur": dur, "args": {"device": 0, "stream": stream,
                                                                                 "correlation": corr}}
    events = [cpu("ProfilerStep#0", 1, 0, 1000, "user_annotation"), cpu("producer", 2, 10, 100),
              rt("cudaLaunchKernel", 11, 20), rt("cudaEventRecord", 12, 40), cpu("consumer", 3, 200, 100),
              rt("cudaStreamWaitEvent", 13, 210), rt("cudaLaunchKernel", 14, 230),
              kernel("produce_kernel", 11, 7, 300, 400), kernel("consume_kernel", 14, 20, 800, 50)]
    if with_sync_event:
        events.append({"ph": "X", "cat": "cuda_sync", "name": "Stream Wait Event", "pid": 0, "tid": 20, "ts": 212,
                       "dur": 0, "args": {"device": 0, "stream": 20, "correlation": 13, "wait_on_stream": 7,
                                          "wait_on_cuda_event_record_corr_id": 12}})
    folder = tmp_path / ("with" if with_sync_event else "without")
    folder.mkdir()
    write_json(folder / "host.0.json", host)
    write_json(folder / "device.0.json", {"traceEvents": events})
    return folder


@pytest.mark.parametrize("with_sync_event", [True, False])
def test_a_recorded_stream_wait_orders_two_streams_and_nothing_else_does(tmp_path, with_sync_event):
    linked = link_folder(_two_stream_run(tmp_path, with_sync_event))
    produce = next(i for i in range(len(linked.kind)) if linked.name(i) == "produce_kernel")
    consume = next(i for i in range(len(linked.kind)) if linked.name(i) == "consume_kernel")
    assert (produce in linked.deps[consume]) == with_sync_event
    assert linked.stats["dependency_rules"].get("cuda stream wait event", 0) == int(with_sync_event)


GPU_TRACE = Path(__file__).parent / "data" / "gpu" / "gpt2_tiny_1gpu"


def test_gpu_trace_is_calibrated_through_the_autograd_thread(tmp_path):
    """On a GPU the backward pass runs on the autograd thread while the training thread waits for it: the profiler's
    cost is on both threads, and the .et replays the untraced step only if both lose it."""
    folder = rank0_copy(GPU_TRACE, tmp_path / "run", with_run_info=True)
    plain_folder = rank0_copy(GPU_TRACE, tmp_path / "plain")
    result = convert_rank0(folder, folder / "run.0.et")
    plain = convert_rank0(plain_folder, plain_folder / "p.0.et")
    untraced = json.loads((GPU_TRACE / "run.json").read_text())["ranks"][0]["untraced_step_wall_time_s"][1:]
    assert result.untraced_step_us == pytest.approx(sorted(untraced)[len(untraced) // 2] * 1e6, rel=0.5)
    assert plain.critical_path_us > 3 * result.untraced_step_us
    assert result.critical_path_us == pytest.approx(result.untraced_step_us, rel=0.005)

    def attr(node, name):
        return next((getattr(a, a.WhichOneof("value")) for a in node.attr if a.name == name), None)

    _, nodes = read_et_with_protolib(folder / "run.0.et")
    _, plain_nodes = read_et_with_protolib(plain_folder / "p.0.et")
    plain_duration = {n.id: n.duration_micros for n in plain_nodes}
    kernels = [n for n in nodes if attr(n, "is_cpu_op") is False]
    assert kernels and all(n.duration_micros == plain_duration[n.id] for n in kernels)  # no recording cost on a GPU
    shortened = {attr(n, "kineto_tid") for n in nodes if attr(n, "is_cpu_op")
                 and n.duration_micros < plain_duration[n.id]}
    assert len(shortened) >= 2  # the training thread and the autograd thread


@pytest.mark.parametrize("thread_times", [False, True])
def test_measured_cpu_time_sets_the_profiler_cost_even_when_the_network_hid_it(tmp_path, thread_times):
    """A run traced on a slow network: its traced and untraced steps take the same wall-clock time (both wait for
    the network), but the tracer's CPU times show what recording cost; exactly that leaves the CPU ops. The
    recording runs on the thread that runs the ops: where run.json has the training thread's CPU time, its
    difference is the cost, not the process's, which also holds the communication threads' bursts (here 10% of a
    step more in the traced steps, unrelated to recording)."""
    folder = rank0_copy(CPU_FIXTURES / "gpt2_tiny_2r", tmp_path / "run")
    plain = convert_rank0(folder, tmp_path / "plain.0.et")
    step_s = plain.traced_step_us / 1e6
    cost_s, burst_s = 0.2 * step_s, (0.1 * step_s if thread_times else 0.0)
    rank = {"rank": 0, "step_wall_time_s": [step_s], "untraced_step_wall_time_s": [9 * step_s, step_s, step_s],
            "step_cpu_time_s": [0.9 * step_s + burst_s],
            "untraced_step_cpu_time_s": [5 * step_s] + [0.9 * step_s - cost_s] * 2}
    if thread_times:
        rank.update(step_thread_cpu_time_s=[0.8 * step_s],
                    untraced_step_thread_cpu_time_s=[5 * step_s] + [0.8 * step_s - cost_s] * 2)
    (folder / "run.json").write_text(json.dumps({"ranks": [rank]}))
    result = convert_rank0(folder, folder / "run.0.et")
    assert result.overhead_rule == "CPU time"
    _, nodes = read_et_with_protolib(folder / "run.0.et")
    _, plain_nodes = read_et_with_protolib(tmp_path / "plain.0.et")
    removed = sum(p.duration_micros - n.duration_micros for n, p in zip(nodes, plain_nodes))
    assert removed == pytest.approx(cost_s * 1e6, rel=0.01)
    assert result.recording_overhead_us > 0 and result.critical_path_us < plain.critical_path_us


@pytest.mark.parametrize("intra_op_threads, rule, kept", [(1, "untraced CPU time", 0.5), (4, "CPU time", 0.7),
                                                           (None, "CPU time", 0.7)])
def test_ops_run_on_the_training_thread_alone_take_its_untraced_cpu_time(tmp_path, intra_op_threads, rule, kept):
    """A CPU run whose ops all ran on the training thread (one intra-op thread): untraced, that thread runs an op,
    waits for a core or blocks in a collective, so its ops take its untraced CPU time. Here the traced ops held
    a fifth of their time off the CPU (the profiler's writes), which the CPU-time difference misses: the .et's CPU
    ops sum to the untraced thread's CPU time, not to that difference's remainder. With helper threads (or no
    record of them) an op also waits for its helpers, and the difference stays the rule."""
    folder = rank0_copy(CPU_FIXTURES / "gpt2_tiny_2r", tmp_path / "run")
    plain = convert_rank0(folder, tmp_path / "plain.0.et")
    _, plain_nodes = read_et_with_protolib(tmp_path / "plain.0.et")
    ops_s = sum(n.duration_micros for n in plain_nodes if n.type == COMP_NODE) / 1e6
    step_s = plain.traced_step_us / 1e6
    rank = {"rank": 0, "step_wall_time_s": [step_s], "untraced_step_wall_time_s": [9 * step_s, step_s, step_s],
            "step_cpu_time_s": [ops_s], "untraced_step_cpu_time_s": [5 * step_s, 0.5 * ops_s, 0.5 * ops_s],
            "step_thread_cpu_time_s": [0.8 * ops_s],
            "untraced_step_thread_cpu_time_s": [5 * step_s, 0.5 * ops_s, 0.5 * ops_s]}
    if intra_op_threads is not None:
        rank["intra_op_threads"] = intra_op_threads
    (folder / "run.json").write_text(json.dumps({"ranks": [rank]}))
    result = convert_rank0(folder, folder / "run.0.et")
    assert result.overhead_rule == rule
    _, nodes = read_et_with_protolib(folder / "run.0.et")
    assert sum(n.duration_micros for n in nodes if n.type == COMP_NODE) / 1e6 == pytest.approx(kept * ops_s, rel=0.01)
    if intra_op_threads == 1:
        assert "so the training thread's ops take its CPU time in an untraced step" in durations_text(result)


@pytest.mark.parametrize("other_rank, scale", [
    ([0.6, 0.4, 0.6, 0.4, 0.5], 1.2),   # the ranks take turns being slower: each step waits for 0.6
    ([0.52, 0.4, 0.52, 0.4, 0.5], 1.04),  # the same, closer together
    ([0.6, 0.6, 0.6, 0.6, 0.6], 1.0),   # rank 1 is always the slower: the simulator already waits for it
    (None, 1.0),                        # run.json holds rank 0's times only: nothing to compare with
    ([0.6, 0.4, 0.6, 0.4], 1.0),        # rank 1 timed fewer steps: which step is which cannot be told
])
def test_every_ranks_ops_are_scaled_to_the_slowest_rank_of_each_step(tmp_path, other_rank, scale):
    """The ranks meet at every collective, so a real step lasts as long as that step's slowest rank. Where the ranks
    take turns being slower, the median of each step's slowest CPU time is more than any rank's median, and the
    .et's ops (each rank's medians) are scaled by that ratio; a rank that is always the faster one keeps its own
    smaller time, since the simulator waits for the slower rank anyway."""
    folder = rank0_copy(CPU_FIXTURES / "gpt2_tiny_2r", tmp_path / "run")
    plain = convert_rank0(folder, tmp_path / "plain.0.et")
    _, plain_nodes = read_et_with_protolib(tmp_path / "plain.0.et")
    ops_s = sum(n.duration_micros for n in plain_nodes if n.type == COMP_NODE) / 1e6
    step_s = plain.traced_step_us / 1e6

    def rank(number, thread_cpu):
        return {"rank": number, "intra_op_threads": 1, "step_wall_time_s": [step_s],
                "untraced_step_wall_time_s": [9 * step_s] + [step_s] * 5,
                "step_cpu_time_s": [ops_s], "untraced_step_cpu_time_s": [5 * step_s] + [0.5 * ops_s] * 5,
                "step_thread_cpu_time_s": [ops_s],
                "untraced_step_thread_cpu_time_s": [5 * step_s] + [share * ops_s for share in thread_cpu]}

    ranks = [rank(0, [0.4, 0.6, 0.4, 0.6, 0.5])] + ([rank(1, other_rank)] if other_rank else [])
    (folder / "run.json").write_text(json.dumps({"world_size": 2, "untraced_steps": [0, 1, 2, 3, 4, 5],
                                                 "ranks": ranks}))
    result = convert_rank0(folder, folder / "run.0.et")
    assert result.overhead_rule == "untraced CPU time"
    assert result.slowest_rank_scale == pytest.approx(scale)
    _, nodes = read_et_with_protolib(folder / "run.0.et")
    assert sum(n.duration_micros for n in nodes if n.type == COMP_NODE) / 1e6 == pytest.approx(0.5 * scale * ops_s,
                                                                                                rel=0.01)
    assert (f"scaled by {scale:.3f}: in each step the ranks wait for that step's slowest" in durations_text(result)) \
        == (scale != 1.0)
    # 20% is beyond the fidelity bound: the ranks' compute changed too much from step to step to trust the scale
    flagged = [w for w in result.warnings if "more training-thread CPU time than the slowest rank's median" in w]
    assert len(flagged) == (scale > 1.1)
    if flagged:
        assert "20.0% more" in flagged[0] and "not known to that bound; trace again" in flagged[0]


def test_a_warning_every_rank_gives_is_said_once_for_all_of_them(tmp_path, capsys):
    """The slowest-rank scale is a fact about the run that each rank measures: a conversion of 2 ranks said it twice,
    in the console and in CONVERSION_SUMMARY.md, and of 8 ranks eight times."""
    from trace_tools import cli

    folder = tmp_path / "gpt2_tiny_2r"
    shutil.copytree(CPU_FIXTURES / "gpt2_tiny_2r", folder, ignore=shutil.ignore_patterns("run.json"))
    plain = convert_rank(folder / "host.0.json.gz", folder / "device.0.json.gz", tmp_path / "plain.0.et")
    _, nodes = read_et_with_protolib(tmp_path / "plain.0.et")
    ops_s = sum(n.duration_micros for n in nodes if n.type == COMP_NODE) / 1e6
    step_s = plain.traced_step_us / 1e6
    ranks = []
    # the ranks take turns being slower (as in the test above): each step waits for 0.6, a scale of 1.2
    for number, shares in enumerate(([0.4, 0.6, 0.4, 0.6, 0.5], [0.6, 0.4, 0.6, 0.4, 0.5])):
        ranks.append({"rank": number, "intra_op_threads": 1, "step_wall_time_s": [step_s],
                      "untraced_step_wall_time_s": [9 * step_s] + [step_s] * 5,
                      "step_cpu_time_s": [ops_s], "untraced_step_cpu_time_s": [5 * step_s] + [0.5 * ops_s] * 5,
                      "step_thread_cpu_time_s": [ops_s],
                      "untraced_step_thread_cpu_time_s": [5 * step_s] + [share * ops_s for share in shares]})
    info = json.loads((CPU_FIXTURES / "gpt2_tiny_2r" / "run.json").read_text())
    info.update(untraced_steps=[0, 1, 2, 3, 4, 5], ranks=[{**old, **new} for old, new in zip(info["ranks"], ranks)])
    (folder / "run.json").write_text(json.dumps(info))
    assert cli.main([str(folder), "--no-progress", "--jobs", "1"]) == 0
    said = "more training-thread CPU time than the slowest rank's median"
    console = [line for line in capsys.readouterr().out.splitlines() if said in line]
    assert len(console) == 1 and console[0].startswith("warning: gpt2_tiny_2r ranks 0-1: "), console
    summary = [line for line in (folder / "CONVERSION_SUMMARY.md").read_text().splitlines()
               if line.startswith("- ") and said in line]
    assert len(summary) == 1 and summary[0].startswith("- ranks 0-1: in the untraced steps"), summary


@pytest.mark.parametrize("numbers, said", [
    ([3], "rank 3"), ([1, 0], "ranks 0-1"), (list(range(8)), "ranks 0-7"), ([0, 2, 3, 4, 7], "ranks 0, 2-4, 7"),
    ([0, 1, 3, 4], "ranks 0-1, 3-4"),  # as SCALE_SUMMARY.md names ranks
])
def test_the_ranks_a_warning_was_given_for_are_named_in_order_with_ranges(numbers, said):
    from trace_tools.summary import RankResult, rank_warnings

    ranks = [RankResult(run="r", rank=n, warnings=["the same fact", "the same fact"]) for n in numbers]
    assert rank_warnings(ranks) == [(said, "the same fact")]


@pytest.mark.parametrize("intra_op_threads, rule", [(1, "untraced CPU time"), (4, "CPU time")])
def test_the_training_threads_untraced_cpu_time_is_not_overridden_by_the_measured_cost_per_op(tmp_path,
                                                                                            intra_op_threads, rule):
    """Where the training thread ran every op, its untraced CPU time is a measurement of what the ops take untraced:
    a cost per recorded op from the tracer's loop on one small op (run.json's recording_cost_per_op_us; it moves
    6.5-16.1 µs between processes on one machine) that would take more out does not. Under the "CPU time" rule
    (helper threads), where no such measurement exists, it is still the least taken out."""
    folder = rank0_copy(CPU_FIXTURES / "gpt2_tiny_2r", tmp_path / "run")
    plain = convert_rank0(folder, tmp_path / "plain.0.et")
    _, plain_nodes = read_et_with_protolib(tmp_path / "plain.0.et")
    compute = [n.duration_micros for n in plain_nodes if n.type == COMP_NODE]
    ops_s = sum(compute) / 1e6
    step_s = plain.traced_step_us / 1e6
    rank = {"rank": 0, "step_wall_time_s": [step_s], "untraced_step_wall_time_s": [9 * step_s, step_s, step_s],
            "step_cpu_time_s": [ops_s], "untraced_step_cpu_time_s": [5 * step_s, 0.5 * ops_s, 0.5 * ops_s],
            "step_thread_cpu_time_s": [ops_s],
            "untraced_step_thread_cpu_time_s": [5 * step_s, 0.5 * ops_s, 0.5 * ops_s],
            # times the ops: 0.8 of their traced time, more than the 0.5 the CPU times differ by
            "recording_cost_per_op_us": 0.8 * ops_s * 1e6 / len(compute),
            "intra_op_threads": intra_op_threads}
    (folder / "run.json").write_text(json.dumps({"ranks": [rank]}))
    result = convert_rank0(folder, folder / "run.0.et")
    assert result.overhead_rule == rule
    _, nodes = read_et_with_protolib(folder / "run.0.et")
    kept = sum(n.duration_micros for n in nodes if n.type == COMP_NODE) / 1e6 / ops_s
    if rule == "untraced CPU time":
        assert kept == pytest.approx(0.5, rel=0.01)
    else:
        assert kept < 0.45


@pytest.mark.parametrize("threads", [1, 2])
def test_the_training_threads_cpu_time_only_sets_the_ops_of_a_trace_that_holds_no_other_thread(tmp_path, threads):
    """The training thread's CPU time covers its own ops: a trace with another thread's ops keeps the CPU-time
    difference as its rule (here one op moved to a second thread)."""
    linked = link_folder(rank0_copy(CPU_FIXTURES / "gpt2_tiny_2r", tmp_path / "run"))
    cpu_ops = [i for i in range(len(linked.kind)) if linked.kind[i] != GPU_OP and i not in linked.comm]
    if threads == 2:
        linked.lanes.append(("cpu", -1))
        linked.lane[cpu_ops[-1]] = len(linked.lanes) - 1
    total = sum(linked.work(i) for i in cpu_ops)
    remove_recording_overhead(linked, total, total / 2, recording_cpu_us=0.1 * total, untraced_op_us=0.5 * total)
    assert linked.stats["recording_overhead_rule"] == ("untraced CPU time" if threads == 1 else "CPU time")
    kept = sum(linked.work(i) for i in cpu_ops) / total
    assert kept == pytest.approx(0.5 if threads == 1 else 0.9, rel=0.01)


@pytest.mark.parametrize("cpu_times", [True, False])
def test_the_tracers_per_operator_measurement_is_the_least_cost_taken_out(tmp_path, cpu_times):
    """run.json's recording_cost_per_op_us (the tracer timed one op untraced and recorded) is the least each
    recorded op loses: with CPU times that show no extra CPU (the "CPU time" rule's floor), and alone (the
    "calibrated" rule)."""
    folder = rank0_copy(CPU_FIXTURES / "gpt2_tiny_2r", tmp_path / "run")
    plain = convert_rank0(folder, tmp_path / "plain.0.et")
    step_s, per_op_us = plain.traced_step_us / 1e6, 1.0
    rank = {"rank": 0, "step_wall_time_s": [step_s], "untraced_step_wall_time_s": [9 * step_s, step_s, step_s],
            "recording_cost_per_op_us": per_op_us}
    if cpu_times:
        rank.update(step_cpu_time_s=[0.5 * step_s], untraced_step_cpu_time_s=[5 * step_s, 0.5 * step_s, 0.5 * step_s])
    (folder / "run.json").write_text(json.dumps({"ranks": [rank]}))
    result = convert_rank0(folder, folder / "run.0.et")
    assert result.overhead_rule == ("CPU time" if cpu_times else "calibrated")
    _, nodes = read_et_with_protolib(folder / "run.0.et")
    _, plain_nodes = read_et_with_protolib(tmp_path / "plain.0.et")
    removed = sum(p.duration_micros - n.duration_micros for n, p in zip(nodes, plain_nodes))
    recorded_ops = sum(1 for n in plain_nodes if n.type == COMP_NODE and n.duration_micros > 0)
    # Each op's cost lands half in its own span, half in its caller's: between half and all of per_op_us x ops.
    assert per_op_us * recorded_ops / 2 * 0.95 <= removed <= per_op_us * recorded_ops * 1.05


@pytest.mark.parametrize("untraced_share, warned", [(0.25, True), (0.02, False)])
def test_the_training_threads_wait_for_a_core_is_reported_and_warned_beyond_the_bound(tmp_path, untraced_share,
                                                                                        warned):
    """run.json's run-queue waits (the time the training thread was ready but another thread had its core) are
    read per step and reported; without gloo's CPU time (which trace_tools.core_sharing needs), a wait beyond a
    tenth of the untraced step is a warning: the .et holds it as compute, and another network changes it."""
    folder = rank0_copy(CPU_FIXTURES / "gpt2_tiny_2r", tmp_path / "run")
    step_s = 0.05
    (folder / "run.json").write_text(json.dumps({"ranks": [{
        "rank": 0, "step_wall_time_s": [2 * step_s, 2 * step_s, 2 * step_s],
        "untraced_step_wall_time_s": [9 * step_s, step_s, step_s, step_s],
        "step_run_queue_wait_s": [0.004, 0.006, 0.1],
        # the first untraced step (start-up) is left out, as for the step times
        "untraced_step_run_queue_wait_s": [1.0, untraced_share * step_s, untraced_share * step_s, 0.0]}]}))
    result = convert_rank0(folder, folder / "run.0.et")
    assert result.run_queue_wait_us == pytest.approx(6000)
    assert result.untraced_run_queue_wait_us == pytest.approx(untraced_share * step_s * 1e6)
    warnings = [w for w in result.warnings if "waited for a core" in w]
    assert len(warnings) == int(warned)
    if warned:
        assert f"{untraced_share:.0%} of an untraced step" in warnings[0]
    assert "the training thread waited for a core 6.0 ms per traced step" in durations_text(result)


def _core_sharing_run(tmp_path: Path, communication_cpu: bool) -> tuple[Path, float]:
    """Rank 0 of the tiny 2-rank run with a run.json whose training thread waited for a core 20% of a traced step,
    and (if asked) whose gloo threads used 30% of a step's time in CPU."""
    folder = rank0_copy(CPU_FIXTURES / "gpt2_tiny_2r", tmp_path / ("shared" if communication_cpu else "plain"))
    step_s = 0.05
    rank = {"rank": 0, "step_wall_time_s": [step_s] * 3, "untraced_step_wall_time_s": [9 * step_s] + [step_s] * 3,
            "step_run_queue_wait_s": [0.2 * step_s] * 3, "untraced_step_run_queue_wait_s": [0.2 * step_s] * 4}
    if communication_cpu:
        # the first untraced step (start-up) is left out, as for the step times
        # gloo's CPU work comes in bursts: 0.1, 0.1 and 0.7 of a step (median 0.1, mean 0.3)
        rank.update(step_communication_cpu_time_s=[0.5 * step_s] * 3,
                    untraced_step_communication_cpu_time_s=[5 * step_s] + [0.1 * step_s, 0.7 * step_s, 0.1 * step_s],
                    # and they waited for a core 0.2, 0.2 and 0.5 of a step (mean 0.3)
                    untraced_step_communication_run_queue_wait_s=[5 * step_s] + [0.2 * step_s, 0.2 * step_s,
                                                                                 0.5 * step_s],
                    # an all-reduce issued after compute waited 2.5 ms to start (utils/collective_start.py)
                    collective_start_wait_s=0.0025)
    (folder / "run.json").write_text(json.dumps({"ranks": [rank]}))
    return folder, step_s


def _convert_without_communication_wait(tmp_path: Path, folder: Path) -> Path:
    """Convert a copy of `folder` whose run.json lacks the collectives' start-up wait; returns the .et."""
    older = tmp_path / "older"
    shutil.copytree(folder, older)
    info = json.loads((older / "run.json").read_text())
    for rank in info["ranks"]:
        del rank["collective_start_wait_s"]
    (older / "run.json").write_text(json.dumps(info))
    convert_rank0(older, older / "run.0.et")
    return older / "run.0.et"


def test_communication_cpu_runs_beside_each_collective_and_the_wait_for_a_core_leaves_the_training_thread(tmp_path):
    """With the communication threads' CPU time measured, each collective gets a CPU node with its share by bytes,
    after the collective's inputs and before its consumers, and the training thread's traced wait for a core leaves
    its ops (trace_tools.core_sharing): the mean of its bursts, each of which adds to the step, not their median.
    Without that time the .et keeps the wait and warns."""
    plain_folder, step_s = _core_sharing_run(tmp_path, communication_cpu=False)
    folder, _ = _core_sharing_run(tmp_path, communication_cpu=True)
    plain = convert_rank0(plain_folder, plain_folder / "run.0.et")
    result = convert_rank0(folder, folder / "run.0.et")
    assert any("waited for a core" in w for w in plain.warnings) and plain.communication_cpu_us == 0
    assert not any("waited for a core" in w for w in result.warnings)
    assert result.communication_cpu_us == pytest.approx(0.3 * step_s * 1e6)
    assert result.run_queue_removed_us == pytest.approx(0.2 * step_s * 1e6)
    assert result.cores_shared and result.untraced_run_queue_wait_us == pytest.approx(0.2 * step_s * 1e6)
    assert result.communication_run_queue_wait_us == pytest.approx(0.3 * step_s * 1e6)
    assert plain.communication_run_queue_wait_us == 0
    assert ("gloo's threads used 15.0 ms of CPU per untraced step on average and waited 15.0 ms for a core (summed "
            "over them, so overlapping)" in durations_text(result))
    assert "(10.0 ms) taken out" in durations_text(result)

    _, plain_nodes = read_et_with_protolib(plain_folder / "run.0.et")
    _, nodes = read_et_with_protolib(folder / "run.0.et")
    attrs = [{a.name: a for a in n.attr} for n in nodes]
    by_id = {n.id: n for n in nodes}
    collectives = [n for n in nodes if n.type == COMM_COLL_NODE]
    collective_ids = {n.id for n in collectives}
    cpu_work = [(n, a) for n, a in zip(nodes, attrs) if "communication_cpu_of" in a]
    waits = {a["communication_wait_of"].int64_val: n for n, a in zip(nodes, attrs) if "communication_wait_of" in a}
    assert collectives and len(cpu_work) == len(collectives) == len(waits)
    assert len(nodes) - len(plain_nodes) == 2 * len(collectives)
    total_bytes = sum(next(a.int64_val for a in c.attr if a.name == "comm_size") for c in collectives)
    for node, a in cpu_work:
        collective = by_id[a["communication_cpu_of"].int64_val]
        size = next(x.int64_val for x in collective.attr if x.name == "comm_size")
        assert node.type == COMP_NODE and a["is_cpu_op"].bool_val
        assert node.duration_micros == pytest.approx(0.3 * step_s * 1e6 * size / total_bytes, abs=1)
        # the threads' wait for a core comes first, holding no core (ASTRA-sim runs it beside the CPU ops), after
        # what produced the collective's input
        wait = waits[collective.id]
        assert list(node.data_deps) == [wait.id]
        assert wait.type == COMP_NODE and not next(x.bool_val for x in wait.attr if x.name == "is_cpu_op")
        assert wait.duration_micros == 2500  # every collective's start, whatever its size
        assert set(wait.data_deps) == {d for d in collective.data_deps if d not in collective_ids}
        consumers = [n for n in nodes if collective.id in n.data_deps and n.type != COMM_COLL_NODE]
        assert consumers and all(node.id in n.data_deps for n in consumers)
        # the next collective of the group waits for the network, not for this CPU work
        assert not any(node.id in n.data_deps or wait.id in n.data_deps for n in collectives)
    assert "each after a wait of 2.50 ms that holds no core" in durations_text(result)
    # Without the start-up wait measured (a run of an older tracer) the CPU work follows the inputs directly
    _, older_nodes = read_et_with_protolib(_convert_without_communication_wait(tmp_path, folder))
    older_cpu_work = [n for n in older_nodes if any(a.name == "communication_cpu_of" for a in n.attr)]
    assert len(older_nodes) == len(nodes) - len(collectives) and older_cpu_work
    assert not any(any(a.name == "communication_wait_of" for a in n.attr) for n in older_nodes)
    # The wait left the training thread's compute: the other compute nodes lost it, about in total
    plain_compute = sum(n.duration_micros for n in plain_nodes if n.type == COMP_NODE)
    compute = sum(n.duration_micros for n, a in zip(nodes, attrs) if n.type == COMP_NODE and
                  "communication_cpu_of" not in a and "communication_wait_of" not in a)
    assert plain_compute - compute == pytest.approx(0.2 * step_s * 1e6, rel=0.02)


def test_the_wait_for_a_core_leaves_the_ops_that_ran_while_a_collective_was_in_flight(tmp_path):
    """The training thread waits for a core while the communication threads work, so the wait leaves the ops inside
    the collectives' traced spans: the forward before the first collective keeps its time (on a slow network it is
    on the path), and the ops that overlapped collectives lose the wait between them."""
    plain_folder, step_s = _core_sharing_run(tmp_path, communication_cpu=False)
    folder, _ = _core_sharing_run(tmp_path, communication_cpu=True)
    info = json.loads((folder / "run.json").read_text())
    wait_s = 0.001  # less than the fixture's ops inside its collectives' spans
    info["ranks"][0]["step_run_queue_wait_s"] = [wait_s] * 3
    (folder / "run.json").write_text(json.dumps(info))
    convert_rank0(plain_folder, plain_folder / "run.0.et")
    result = convert_rank0(folder, folder / "run.0.et")
    assert result.run_queue_removed_us == pytest.approx(wait_s * 1e6)
    _, plain_nodes = read_et_with_protolib(plain_folder / "run.0.et")
    _, nodes = read_et_with_protolib(folder / "run.0.et")
    plain_by_id = {n.id: n for n in plain_nodes}
    index = {n.id: i for i, n in enumerate(plain_nodes)}
    parents = [[index[d] for d in list(n.data_deps) + list(n.ctrl_deps) if d in index] for n in plain_nodes]
    first = next(i for i, n in enumerate(plain_nodes) if n.type == COMM_COLL_NODE)
    before = descendants_of(parents, [first])  # along the parents: everything the first collective waited for
    before_ids = {plain_nodes[i].id for i in before if plain_nodes[i].type == COMP_NODE}
    lost = {n.id: plain_by_id[n.id].duration_micros - n.duration_micros for n in nodes
            if n.type == COMP_NODE and n.id in plain_by_id}
    assert before_ids and sum(lost.values()) == pytest.approx(wait_s * 1e6, abs=len(lost) / 2)
    # Spread over all ops alike, the ops before the first collective would lose their share of the compute; they
    # lose a fraction of that (what they lose is their callers' time around the collectives: autograd's, the step's)
    work = {n.id: n.duration_micros for n in plain_nodes if n.id in lost}
    share_of_work = sum(work[i] for i in before_ids) / sum(work.values())
    share_of_wait = sum(lost[i] for i in before_ids) / sum(lost.values())
    assert share_of_work > 0.2 and share_of_wait < share_of_work / 3
    assert all(taken >= -1 for taken in lost.values())  # nothing gained time (1 µs of rounding)


@pytest.mark.parametrize("cpus", [2, 16, None])
def test_the_kernels_interrupt_time_is_reported_and_not_added_to_the_collectives_cpu_work(tmp_path, cpus):
    """The machine's interrupt and softirq time is divided among the ranks on the machine and reported, the mean of
    the untraced steps after the run's first. The collectives' CPU nodes hold gloo's threads' time alone, however
    many cores the machine has: a kernel without CONFIG_IRQ_TIME_ACCOUNTING already counts interrupt time in the
    threads it interrupted, and adding it would count it twice."""
    folder, step_s = _core_sharing_run(tmp_path, communication_cpu=True)
    info = json.loads((folder / "run.json").read_text())
    # machine-wide, in 10 ms ticks: start-up 0.5 s (left out), then 20, 30 and 40 ms (mean 30 ms), two ranks
    info["ranks"][0].update(untraced_step_interrupt_cpu_time_s=[0.5, 0.02, 0.03, 0.04],
                            step_interrupt_cpu_time_s=[0.05] * 3, ranks_on_machine=2, intra_op_threads=1)
    if cpus is not None:
        info["ranks"][0]["machine_load"] = {"cpus": cpus, "other_processes_cpu_share": 0.0, "busy": False}
    (folder / "run.json").write_text(json.dumps(info))
    threads_folder = tmp_path / "threads_only"
    shutil.copytree(folder, threads_folder)
    del info["ranks"][0]["untraced_step_interrupt_cpu_time_s"], info["ranks"][0]["step_interrupt_cpu_time_s"]
    (threads_folder / "run.json").write_text(json.dumps(info))

    result = convert_rank0(folder, folder / "run.0.et")
    threads_only = convert_rank0(threads_folder, threads_folder / "run.0.et")
    assert result.interrupt_cpu_us == pytest.approx(15_000) and threads_only.interrupt_cpu_us == 0
    assert result.communication_cpu_us == threads_only.communication_cpu_us == pytest.approx(0.3 * step_s * 1e6)

    def communication_cpu_us(et: Path) -> tuple[int, float]:
        _, nodes = read_et_with_protolib(et)
        work = [n.duration_micros for n in nodes if any(a.name == "communication_cpu_of" for a in n.attr)]
        return len(work), sum(work)

    count, work_us = communication_cpu_us(folder / "run.0.et")
    assert count and work_us == pytest.approx(0.3 * step_s * 1e6, abs=count)
    assert communication_cpu_us(threads_folder / "run.0.et") == (count, work_us)
    text = durations_text(result)
    assert "the kernel spent 15.0 ms per untraced step in interrupt context" in text
    assert "reported only" in text and "gloo's CPU time given to the collectives as CPU nodes" in text
    assert "interrupt context" not in durations_text(threads_only)


def test_a_run_that_timed_only_its_traced_steps_interrupts_gives_their_mean(tmp_path):
    """Without untraced steps measuring it the traced steps' interrupt time stands in (it is the network's, which
    the profiler does not change); one rank on the machine keeps it all; nothing measured gives None."""
    from trace_tools.step_timing import read_step_times
    rank = {"rank": 0, "step_wall_time_s": [0.05] * 3, "untraced_step_wall_time_s": [0.4, 0.05, 0.05],
            "step_interrupt_cpu_time_s": [0.0, 0.01, 0.02]}
    (tmp_path / "run.json").write_text(json.dumps({"untraced_steps": [0, 1, 2], "ranks": [rank]}))
    times = read_step_times(tmp_path, 0)
    assert times.ranks_on_machine == 1 and times.interrupt_cpu_per_step_us == pytest.approx(10_000)
    del rank["step_interrupt_cpu_time_s"]
    (tmp_path / "run.json").write_text(json.dumps({"untraced_steps": [0, 1, 2], "ranks": [rank]}))
    assert read_step_times(tmp_path, 0).interrupt_cpu_per_step_us is None


@pytest.mark.parametrize("busy, share, says", [
    (True, 0.4, "other processes used 40% of the machine's CPUs in the traced window, so trace again on a quieter"),
    (False, 0.0, "the machine was otherwise quiet in the traced window (other processes used 0% of its CPUs), so the "
                 "spread is the run's own"),
])
def test_the_spread_warning_says_whether_the_machine_was_busy(tmp_path, busy, share, says):
    """A quiet machine (a dedicated GPU server) is not told to trace again on a quieter one: the warning follows
    the other processes' share of the CPUs that the tracer measured in the window."""
    folder = _three_steps_one_slow(tmp_path, 3.0)
    step_s = 0.03
    (folder / "run.json").write_text(json.dumps({"ranks": [{
        "rank": 0, "step_wall_time_s": [step_s, step_s, 3 * step_s],
        "untraced_step_wall_time_s": [9 * step_s, step_s, step_s, step_s],
        "machine_load": {"other_processes_cpu_share": share, "busy": busy}}]}))
    result = convert_rank(folder / "host.0.json", folder / "device.0.json", folder / "run.0.et")
    [warning] = [w for w in result.warnings if "differ by" in w]
    assert says in warning
    assert ("quieter machine" in warning) == busy


@pytest.mark.parametrize("ranks_on_machine, threads, cpus, warned", [
    (2, 1, 1, True),    # two single-threaded ranks on one core: each waits for the other's compute
    (2, 2, 2, True),    # two ranks of two intra-op threads on two cores
    (2, 1, 2, False),   # a core a rank: the what-if bench's runs
    (2, None, 1, False),  # run.json without the thread count: nothing to judge by
])
def test_ranks_that_shared_cores_are_warned_of(tmp_path, ranks_on_machine, threads, cpus, warned):
    """A CPU run whose ranks had fewer CPUs than compute threads made each rank's compute wait for another's, which
    no .et holds: the conversion says so, naming the counts run.json recorded (docs/BENCHMARKS.md §5 measured
    such runs replaying at 0.47-0.84 of their step)."""
    folder = rank0_copy(CPU_FIXTURES / "gpt2_tiny_2r", tmp_path / "run")
    step_s = 0.05
    rank = {"rank": 0, "step_wall_time_s": [step_s] * 3, "untraced_step_wall_time_s": [9 * step_s] + [step_s] * 3,
            "ranks_on_machine": ranks_on_machine, "machine_load": {"cpus": cpus}}
    if threads is not None:
        rank["intra_op_threads"] = threads
    (folder / "run.json").write_text(json.dumps({"ranks": [rank]}))
    result = convert_rank0(folder, folder / "run.0.et")
    said = [w for w in result.warnings if "compute threads" in w]
    assert len(said) == int(warned)
    if warned:
        assert (f"the {ranks_on_machine} ranks on this machine ran {ranks_on_machine * threads} compute threads "
                f"({threads} intra-op thread(s) each) on {cpus} CPU(s)") in said[0]


@pytest.mark.parametrize("untraced_s, warned", [
    ([0.300, 0.030, 0.042], True),          # two steps 40% apart: their median is 17% from each
    ([0.300, 0.030, 0.031, 0.087], False),  # one unusual step (the first after the window) among three
    ([0.300, 0.030], False),                # one step: nothing to tell it by
])
def test_untraced_steps_far_from_their_median_are_warned_of(tmp_path, untraced_s, warned):
    """The untraced steps' median is what the profiler's cost is measured against and what simulate.py compares a
    prediction with: when a typical untraced step lies further from it than the fidelity bound, the conversion says
    so and names the steps; one unusual step among three moves neither the median nor the warning."""
    folder = _three_steps_one_slow(tmp_path, 1.0)
    (folder / "run.json").write_text(json.dumps({"ranks": [{
        "rank": 0, "step_wall_time_s": [0.04, 0.04, 0.04], "untraced_step_wall_time_s": untraced_s}]}))
    result = convert_rank(folder / "host.0.json", folder / "device.0.json", folder / "run.0.et")
    samples = untraced_s[1:]  # the run's first step, its start-up, is no sample
    assert result.untraced_steps_us == pytest.approx([t * 1e6 for t in samples])
    assert result.untraced_step_us == pytest.approx(sorted(samples)[len(samples) // 2] * 1e6
                                                    if len(samples) % 2 else sum(samples) / 2 * 1e6)
    loose = [w for w in result.warnings if "from their median" in w]
    assert bool(loose) == warned
    if warned:
        assert loose[0].startswith("the 2 untraced steps run.json timed (30.0, 42.0 ms) lie typically 16.7% from "
                                   "their median 36.0 ms (more than 10%)")
    text = durations_text(result)
    assert {1: "one untraced step", 2: "median of 2 untraced steps, typically 16.7% from it",
            3: "median of 3 untraced steps, typically 3.2% from it"}[len(samples)] in text
