"""Converting every reference run to .et files that a simulator can run and that tell the truth about the step."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from chakra.schema.protobuf.et_def_pb2 import (ALL_REDUCE, ALL_TO_ALL, BROADCAST, COMM_COLL_NODE, COMP_NODE,
                                               METADATA_NODE, Node)

from conversion_helpers import CPU_FIXTURES, close_window, read_et_with_protolib, read_json, scaled_trace, write_json
from trace_tools import cli
from trace_tools.discover import find_runs
from trace_tools.pipeline import convert_rank, convert_runs
from trace_tools.summary import durations_text, replay_critical_path_us

GPU_RUNS = {"astra-sim_megatron_tp8_a100_8r": 8, "param_dlrm_v100_8r": 8, "hta_simple_add_a100_1r": 1,
            "param_resnet_2080ti_1r": 1, "param_linear_2080ti_1r": 1}
CPU_RUNS = {"gpt2_tiny_1r": 1, "bert_tiny_2r": 2, "gpt2_tiny_2r": 2, "bert_tiny_2r_ours": 2, "gpt2_2x128_2r_buckets": 2}


def attrs(node: Node) -> dict:
    return {a.name: getattr(a, a.WhichOneof("value")) for a in node.attr if a.WhichOneof("value")}


@pytest.fixture(scope="session")
def cpu_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("cpu_et")
    results = convert_runs(find_runs([CPU_FIXTURES]), output_dir=out, jobs=2, emit_merged=True, progress=False)
    return {r.run.name: r for r in results}


@pytest.fixture(scope="session")
def gpu_results(shared_fixtures, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_et")
    results = convert_runs(find_runs([shared_fixtures / "gpu"]), output_dir=out, jobs=2, emit_merged=True,
                           progress=False)
    return {r.run.name: r for r in results}


def all_results(cpu_results, gpu_results):
    return list(cpu_results.values()) + list(gpu_results.values())


def test_every_cpu_fixture_run_converts_every_rank(cpu_results):
    assert {name: len(r.ranks) for name, r in cpu_results.items()} == CPU_RUNS
    for result in cpu_results.values():
        assert result.ok, [rank.error for rank in result.ranks]
        for rank in result.ranks:
            assert Path(rank.et_path).name == f"{result.run.name}.{rank.rank}.et"
            assert Path(rank.et_path).is_file()
        assert (result.output_dir / "CONVERSION_SUMMARY.md").is_file()


def test_every_gpu_fixture_run_converts_every_rank(gpu_results):
    assert {name: len(r.ranks) for name, r in gpu_results.items()} == GPU_RUNS
    for result in gpu_results.values():
        assert result.ok, [rank.error for rank in result.ranks] + result.agreement_problems
        assert all(Path(rank.et_path).is_file() for rank in result.ranks)


def test_python_walk_issuing_nodes_whose_dependencies_are_done_visits_every_node(cpu_results, gpu_results):
    """As ASTRA-sim's feeder does: data and ctrl dependencies must all name existing nodes, and a node is issued
    once every dependency finished. Walked twice (newest-first and oldest-first) to catch order-dependent luck:
    a ctrl dependency must be finished whenever the data dependencies are (the feeder checks both)."""
    for result in all_results(cpu_results, gpu_results):
        for rank in result.ranks:
            _, nodes = read_et_with_protolib(Path(rank.et_path))
            by_id = {n.id: n for n in nodes}
            assert len(by_id) == len(nodes)
            children = {n.id: [] for n in nodes}
            read = set()
            for n in nodes:
                for dep in list(n.data_deps) + list(n.ctrl_deps):
                    assert dep in by_id, f"{rank.et_path}: node {n.id} depends on missing node {dep}"
                    # the feeder reads a window of nodes: a dependency later in the file makes it read further
                    assert dep in read, f"{rank.et_path}: node {n.id} comes before its dependency {dep}"
                read.add(n.id)
                for dep in set(n.data_deps):
                    children[dep].append(n.id)
            for newest_first in (True, False):
                waiting = {n.id: len(set(n.data_deps)) for n in nodes}
                ready = sorted((i for i, w in waiting.items() if w == 0), reverse=not newest_first)
                done = set()
                while ready:
                    node_id = ready.pop() if newest_first else ready.pop(0)
                    assert set(by_id[node_id].ctrl_deps) <= done, f"{rank.et_path}: ctrl dep of {node_id} not done"
                    done.add(node_id)
                    for child in children[node_id]:
                        waiting[child] -= 1
                        if waiting[child] == 0:
                            ready.append(child)
                assert len(done) == len(nodes), f"{rank.et_path}: only {len(done)} of {len(nodes)} nodes issued"


def test_no_node_type_or_attribute_that_astra_sim_rejects(cpu_results, gpu_results):
    for result in all_results(cpu_results, gpu_results):
        for rank in result.ranks:
            metadata, nodes = read_et_with_protolib(Path(rank.et_path))
            for node in nodes:
                assert node.type != METADATA_NODE
                a = attrs(node)
                assert "is_cpu_op" in a
                if node.type == COMM_COLL_NODE:
                    assert a["is_cpu_op"] is False  # ASTRA-sim issues is_cpu_op nodes as compute
                    assert a["comm_size"] > 0
                    assert a["comm_type"] in (ALL_REDUCE, ALL_TO_ALL, BROADCAST)
                assert node.start_time_micros > 0, "every node carries its traced start"
            meta = attrs(metadata)
            assert meta["rank"] == rank.rank and meta["schema"]


def test_megatron_and_dlrm_carry_their_nccl_collectives_on_every_rank(gpu_results):
    for rank in gpu_results["astra-sim_megatron_tp8_a100_8r"].ranks:
        assert rank.comm_by_type == {"ALL_REDUCE": 84}
        assert Counter(size for _, _, size in rank.collectives) == {64 << 20: 81, 32768: 3}
    for rank in gpu_results["param_dlrm_v100_8r"].ranks:
        assert rank.comm_by_type == {"ALL_REDUCE": 3, "ALL_TO_ALL": 5}
        assert all(size > 0 for _, _, size in rank.collectives)


def test_bert_two_rank_cpu_run_carries_its_gloo_collectives_and_they_agree(cpu_results):
    result = cpu_results["bert_tiny_2r"]
    assert not result.agreement_problems
    sequences = {rank.rank: [tuple(c) for c in rank.collectives] for rank in result.ranks}
    assert sequences[0] == sequences[1] == [("0", "BROADCAST", 2048), ("0", "ALL_REDUCE", 1127840),
                                            ("0", "ALL_REDUCE", 1108992)]


def test_collectives_agree_across_ranks_of_every_multi_rank_run(cpu_results, gpu_results):
    for result in all_results(cpu_results, gpu_results):
        assert not result.agreement_problems, result.agreement_problems


def assert_critical_path_within_ten_percent(results):
    for result in results:
        for rank in result.ranks:
            # the graph replayed with the traced durations gives back the traced step
            ratio = replay_critical_path_us(rank) / rank.traced_step_us
            assert 0.9 <= ratio <= 1.1, f"{result.run.name} rank {rank.rank}: critical path {ratio:.3f} of the step"


def test_critical_path_is_within_ten_percent_of_the_traced_step_on_cpu_runs(cpu_results):
    assert_critical_path_within_ten_percent(cpu_results.values())


def test_critical_path_is_within_ten_percent_of_the_traced_step_on_gpu_runs(gpu_results):
    assert_critical_path_within_ten_percent(gpu_results.values())


def test_fresh_two_rank_trace_counts_the_ddp_wait_for_its_all_reduce_once(cpu_results):
    """gpt2_tiny_2r, made with our tracer: rank 0 idled 52 ms in DDP's wait for a 55 ms gloo all-reduce. Counted
    both in the all-reduce and as the step's own time, the critical path was 1.22 of the step (and rank 1 had a
    cycle). The wait shows on the step annotation and the path stays within 10% of the step on both ranks."""
    result = cpu_results["gpt2_tiny_2r"]
    assert result.ok and [rank.comm_by_type for rank in result.ranks] == [{"ALL_REDUCE": 2}] * 2
    assert_critical_path_within_ten_percent([result])
    _, nodes = read_et_with_protolib(Path(result.ranks[0].et_path))
    step = next(n for n in nodes if n.name.startswith("ProfilerStep#"))
    longest = max((n for n in nodes if n.type == COMM_COLL_NODE), key=lambda n: n.duration_micros)
    assert longest.duration_micros > 50_000 and attrs(step)["wait_micros"] > 0.9 * longest.duration_micros


def test_wait_for_an_all_reduce_picked_up_late_by_its_worker_thread_is_counted_once(cpu_results):
    """bert_tiny_2r_ours rank 1: the main thread idled 19.6 ms in DDP's wait for a 19 ms gloo all-reduce that its
    worker thread began 2.7 ms into the wait (86% of the gap). Not taken for a wait, the gap was counted again as
    the step's own time and the critical path was 1.116 of the step. The op that resumed depends on the all-reduce,
    the wait shows on the step annotation and both ranks stay within 10% of the step."""
    result = cpu_results["bert_tiny_2r_ours"]
    assert result.ok and [rank.comm_by_type for rank in result.ranks] == [{"ALL_REDUCE": 2, "BROADCAST": 1}] * 2
    assert_critical_path_within_ten_percent([result])
    _, nodes = read_et_with_protolib(Path(result.ranks[1].et_path))
    by_id = {n.id: n for n in nodes}
    step = next(n for n in nodes if n.name.startswith("ProfilerStep#"))
    longest = max((n for n in nodes if n.type == COMM_COLL_NODE), key=lambda n: n.duration_micros)
    assert longest.duration_micros > 15_000 and attrs(step)["wait_micros"] > 0.85 * longest.duration_micros
    resumed = [n for n in nodes if longest.id in n.data_deps and attrs(n)["kineto_tid"] != attrs(longest)["kineto_tid"]]
    assert any(n.start_time_micros < longest.start_time_micros + attrs(longest)["inclusive_micros"]
               for n in resumed), "the first waiter resumed before the all-reduce's record closed"
    assert all(by_id[d].start_time_micros <= n.start_time_micros for n in resumed for d in n.data_deps)


def test_every_collective_is_waited_for_by_an_op_of_another_thread(cpu_results):
    """The op that waits on a gloo collective (DDP's bucket copy after its wait, the optimizer step) depends on it."""
    for name in ("bert_tiny_2r", "gpt2_tiny_2r", "bert_tiny_2r_ours"):
        for rank in cpu_results[name].ranks:
            _, nodes = read_et_with_protolib(Path(rank.et_path))
            thread = {n.id: attrs(n)["kineto_tid"] for n in nodes if "kineto_tid" in attrs(n)}
            waiters = {c: [n for n in nodes if c in n.data_deps and thread.get(n.id) != thread[c]]
                       for c in (n.id for n in nodes if n.type == COMM_COLL_NODE)}
            assert len(waiters) == (2 if name == "gpt2_tiny_2r" else 3)
            assert all(waiters.values()), f"{rank.et_path}: a collective nobody waits for"


def test_cpu_nodes_carry_the_kineto_thread_they_ran_on_and_their_inclusive_time(cpu_results):
    """kineto_tid: Kineto's thread id (a gloo collective's worker thread, not its caller's); `tid` stays the host's.
    inclusive_micros: the traced inclusive duration, beside the exclusive .et duration."""
    from trace_tools.load import load_device_trace

    for name in ("bert_tiny_2r", "gpt2_tiny_2r"):
        for rank in cpu_results[name].ranks:
            device = load_device_trace(CPU_FIXTURES / name / f"device.{rank.rank}.json.gz")
            kineto = {}
            for k, event in enumerate(device.cpu_names):
                kineto.setdefault((event, round(device.cpu_ts[k])), (device.cpu_tid[k], device.cpu_dur[k]))
            _, nodes = read_et_with_protolib(Path(rank.et_path))
            threads = Counter()
            for node in nodes:
                a = attrs(node)
                tid, dur = kineto[(node.name, node.start_time_micros)]
                assert a["kineto_tid"] == tid and a["inclusive_micros"] == round(dur)
                assert a["inclusive_micros"] + 1 >= node.duration_micros
                threads[(node.type == COMM_COLL_NODE, tid)] += 1
            main = {tid for (comm, tid) in threads if not comm}
            gloo = {tid for (comm, tid) in threads if comm}
            assert len(main) == 1 and gloo and not gloo & main, "collectives ran on the gloo worker threads"
            assert {attrs(n)["tid"] for n in nodes if n.type == COMM_COLL_NODE} == {1}, "the host's numbering"


@pytest.mark.parametrize("run,rank", [("gpt2_tiny_1r", 0), ("bert_tiny_2r", 0), ("bert_tiny_2r", 1)])
def test_et_holds_chakras_compute_operators_with_the_same_durations_minus_its_defects(cpu_results, shared_fixtures,
                                                                                      run, rank):
    _, official = read_et_with_protolib(shared_fixtures / "cpu" / run / "official" / f"trace.{rank}.et")
    _, ours = read_et_with_protolib(Path(cpu_results[run].ranks[rank].et_path))
    ours_by_id = {n.id: n for n in ours}  # same numbering as chakra_trace_link on host-only traces
    compared = 0
    for node in official:
        if node.type != COMP_NODE or node.name.startswith("[pytorch|profiler|"):
            continue  # the observer's thread node: no operator, untimed in chakra's output
        mine = ours_by_id[node.id]
        assert mine.name == node.name
        if node.name.startswith("ProfilerStep#") or node.name.startswith("Optimizer.step"):
            # chakra's defects: the step left untimed, Optimizer.step zeroed on purpose; ours keep their own time
            assert node.duration_micros == 0 and mine.duration_micros > 0
            continue
        waited = attrs(mine).get("wait_micros", 0)  # time spent blocked on another thread, on the path elsewhere
        assert abs(mine.duration_micros + waited - node.duration_micros) <= 1, node.name
        compared += 1
    assert compared > 2000
    # chakra's defects, absent here: METADATA_NODE, gloo collectives as COMP, no start times
    assert not any(n.type == METADATA_NODE for n in ours)
    assert all(n.start_time_micros == 0 for n in official) and all(n.start_time_micros > 0 for n in ours)
    if run == "bert_tiny_2r":
        assert any(n.type == METADATA_NODE for n in official)
        assert [n.type for n in official if n.name.startswith("gloo:")] == [COMP_NODE] * 3
        assert [n.type for n in ours if n.name.startswith("gloo:")] == [COMM_COLL_NODE] * 3


def test_chakra_converter_accepts_the_emitted_merged_json(cpu_results, gpu_results, tmp_path):
    converter = Path(sys.executable).with_name("chakra_converter")
    command = [str(converter)] if converter.exists() else ["chakra_converter"]
    for result in (cpu_results["bert_tiny_2r"], gpu_results["param_dlrm_v100_8r"],
                   gpu_results["astra-sim_megatron_tp8_a100_8r"]):
        rank = result.ranks[0]
        out = tmp_path / f"{result.run.name}.et"
        run = subprocess.run(command + ["PyTorch", "--input", rank.merged_path, "--output", str(out)],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        _, nodes = read_et_with_protolib(out)
        assert len(nodes) > 0.9 * rank.nodes
        if result.run.name != "bert_tiny_2r":  # chakra makes COMM nodes of NCCL kernels (not of gloo ones)
            assert sum(n.type == COMM_COLL_NODE for n in nodes) == rank.comm_ops


def test_summary_lists_each_rank_with_nodes_communication_and_times(cpu_results):
    text = (cpu_results["bert_tiny_2r"].output_dir / "CONVERSION_SUMMARY.md").read_text()
    assert "# Conversion summary: bert_tiny_2r" in text
    assert text.count("✅ ok") == 2
    assert "2 ALL_REDUCE, 1 BROADCAST" in text
    assert "collectives agree across the 2 ranks" in text
    assert "--workload-configuration=" in text


def test_outputs_are_written_beside_the_traces_by_default(tmp_path):
    run_dir = tmp_path / "gpt2_tiny_1r"
    run_dir.mkdir()
    for name in ("host.0.json.gz", "device.0.json.gz"):
        (run_dir / name).write_bytes((CPU_FIXTURES / "gpt2_tiny_1r" / name).read_bytes())
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    run = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "convert_to_et.py"),
                          str(tmp_path), "--no-progress"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert (run_dir / "gpt2_tiny_1r.0.et").is_file()
    assert (run_dir / "CONVERSION_SUMMARY.md").is_file()
    assert "gpt2_tiny_1r" in run.stdout and "ok" in run.stdout


def run_convert_to_et(*args) -> subprocess.CompletedProcess:
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(repo), MPLBACKEND="Agg")
    return subprocess.run([sys.executable, str(repo / "convert_to_et.py"), *map(str, args), "--no-progress"],
                          capture_output=True, text=True, env=env, timeout=600)


def test_report_option_writes_the_trace_report_beside_the_et_files(tmp_path):
    run_dir = tmp_path / "gpt2_tiny_2r"
    shutil.copytree(CPU_FIXTURES / "gpt2_tiny_2r", run_dir)
    run = run_convert_to_et(run_dir, "--report")
    assert run.returncode == 0, run.stderr
    assert f"report: {run_dir / 'report.md'}" in run.stdout
    for name in ("report.md", "report.json", "report_breakdown.png", "report_timeline_rank0.png",
                 "report_timeline_rank1.png", "report_top_ops.png", "report_collectives.png"):
        assert (run_dir / name).stat().st_size > 0, name
    text = (run_dir / "report.md").read_text()
    assert "# Trace report: gpt2_tiny_2r" in text and "## Critical path" in text
    assert (run_dir / "report_breakdown.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_that_cannot_be_written_is_one_error_line_and_a_failing_exit(tmp_path):
    run_dir = tmp_path / "gpt2_tiny_1r"
    shutil.copytree(CPU_FIXTURES / "gpt2_tiny_1r", run_dir)
    (run_dir / "other_run.0.et").write_bytes(b"")  # a second run's .et in the folder: the report refuses to mix them
    run = run_convert_to_et(run_dir, "--report")
    assert run.returncode == 1
    assert (run_dir / "gpt2_tiny_1r.0.et").is_file() and not (run_dir / "report.md").exists()
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "several runs" in errors[0], run.stderr


# --gradient-accumulation-steps 4 over 30 batches a rank (239 GPT-2 sequences, 2 ranks, batch 4): 7 full steps of 4
# micro-batches an epoch, then a short last one of 2 (0-based step 7). Its trace is the bundled GPT-2 step, which
# run.json below says took 2 micro-batches.
QUIET_MACHINE = {"other_processes_cpu_share": 0.0, "busy": False}


def step_durations_s(device: dict) -> list[float]:
    steps = sorted((e for e in device["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")),
                   key=lambda e: e["ts"])
    return [e["dur"] / 1e6 for e in steps]


def short_then_full_step(folder: Path) -> list[float]:
    """Rank 0's GPT-2 step twice (ProfilerStep#2 and #3), the first with every CPU op half as long: an epoch's short
    last step, then the next epoch's first, full one. Returns the two steps' durations in seconds."""
    source = CPU_FIXTURES / "gpt2_tiny_2r"
    host, device = scaled_trace(read_json(source / "host.0.json.gz"), read_json(source / "device.0.json.gz"), 2)
    events = [e for e in device["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    second = min(e["ts"] for e in events if e["name"] == "ProfilerStep#3")
    origin = min(e["ts"] for e in events)
    for e in events:
        if e["ts"] < second:
            e["ts"] = origin + (e["ts"] - origin) * 0.5
            e["dur"] = e["dur"] * 0.5
    close_window(device)
    folder.mkdir()
    write_json(folder / "host.0.json", host)
    write_json(folder / "device.0.json", device)
    return step_durations_s(device)


def write_run_json(folder: Path, traced_s: list[float], traced_steps: list[int], micro_batches: list[int],
                   untraced_s: list[float], untraced_micro_batches: list[int], ranks: int = 1) -> None:
    rank = {"step_wall_time_s": traced_s, "step_micro_batches": micro_batches,
            "untraced_step_wall_time_s": untraced_s, "untraced_step_micro_batches": untraced_micro_batches,
            "machine_load": QUIET_MACHINE}
    (folder / "run.json").write_text(json.dumps({
        "world_size": ranks, "gradient_accumulation_steps": 4, "traced_steps": traced_steps,
        "untraced_steps": [0, 1, 2, 3, 4, 5, 8, 9, 10][:len(untraced_s)],
        "ranks": [dict(rank, rank=r) for r in range(ranks)]}))


def test_the_et_is_a_full_step_when_the_traced_window_also_holds_an_epochs_short_last_step(tmp_path):
    """Traced steps of 2 and 4 micro-batches: the step of median duration was the short one (the shorter of two),
    calibrated to the full steps' untraced time; and the spread warning blamed the run itself, not the micro-batches."""
    folder = tmp_path / "run"
    short_s, full_s = short_then_full_step(folder)
    untraced_full_s = 0.7 * full_s
    write_run_json(folder, [short_s, full_s], [2, 3], [2, 4], [3 * full_s] + [untraced_full_s] * 6, [4] * 7)
    result = convert_rank(folder / "host.0.json", folder / "device.0.json", folder / "run.0.et")
    assert result.traced_step == "ProfilerStep#3" and result.steps_left_out == ["ProfilerStep#2"]
    assert (result.micro_batches, result.full_micro_batches) == (4, 4)
    assert result.untraced_step_us == pytest.approx(untraced_full_s * 1e6)  # measured against full steps alone
    assert len(result.traced_steps_us) == 1 and not any("differ by" in w for w in result.warnings)
    [warning] = [w for w in result.warnings if "micro-batches" in w]
    assert "ProfilerStep#2: 2 in" in warning and "ProfilerStep#3: 4 in" in warning
    assert "the .et holds the steps of 4 (ProfilerStep#3) and leaves out ProfilerStep#2" in warning
    assert not any("the run's own" in w for w in result.warnings)
    assert "one traced step of 4 micro-batches (the run's full step), ProfilerStep#2 of other micro-batches left " \
           "out" in durations_text(result)
    assert result.untraced_left_out == 0 and "more left out" not in durations_text(result)


@pytest.mark.parametrize("untraced_micro_batches, calibrated", [([4, 4, 4, 4, 4], False), ([4, 4, 2, 4, 4], True)])
def test_a_window_of_only_an_epochs_short_last_step_is_never_calibrated_to_a_full_steps_time(
        tmp_path, untraced_micro_batches, calibrated):
    """The window held only the short step (2 of 4 micro-batches): calibrated to the full steps' untraced time it
    became an .et of a 2-micro-batch step that took a 4-micro-batch step's time. It is measured against an untraced
    step of 2 when run.json times one (an earlier epoch's end), else it keeps the profiler's cost; either way the
    warning says the .et is a short step and what to do."""
    folder = rank0_of_gpt2_tiny(tmp_path / "run")
    [traced_s] = step_durations_s(read_json(folder / "device.0.json.gz"))
    untraced = [3 * traced_s] + [0.8 * traced_s if n == 4 else 0.4 * traced_s for n in untraced_micro_batches[1:]]
    write_run_json(folder, [traced_s], [2], [2], untraced, untraced_micro_batches)
    result = convert_rank(folder / "host.0.json.gz", folder / "device.0.json.gz", folder / "run.0.et")
    if calibrated:
        assert result.untraced_step_us == pytest.approx(0.4 * traced_s * 1e6) and result.recording_overhead_us > 0
        # the 3 untraced steps of 4 micro-batches are left out, and the summary says so (it had said nothing)
        assert result.untraced_left_out == 3
        assert "one untraced step (3 more left out: they took other micro-batches than the traced step" \
            in durations_text(result)
    else:
        assert result.untraced_step_us == 0 and result.recording_overhead_us == 0
        _, nodes = read_et_with_protolib(folder / "run.0.et")
        assert sum(n.duration_micros for n in nodes) > 0.9 * traced_s * 1e6  # not cut to a full step's time
    [warning] = [w for w in result.warnings if "short last step" in w]
    assert "ProfilerStep#2 took 2 micro-batches where the run's full step takes 4" in warning
    assert "--gradient-accumulation-steps that divides an epoch's batches" in warning
    assert "window away from an epoch's end" in warning
    assert ("no untraced step took 2, so the .et keeps the profiler's cost" in warning) == (not calibrated)
    assert (result.micro_batches, result.full_micro_batches) == (2, 4)
    assert ("profiler cost not removed (no untraced step took 2 micro-batches" in durations_text(result)) \
        == (not calibrated)


def rank0_of_gpt2_tiny(folder: Path) -> Path:
    folder.mkdir()
    for name in ("host.0.json.gz", "device.0.json.gz"):
        shutil.copy(CPU_FIXTURES / "gpt2_tiny_2r" / name, folder / name)
    return folder


@pytest.mark.parametrize("untraced_steps", [[], [0]])
def test_a_run_json_that_times_no_untraced_step_after_the_first_is_one_warning_for_the_run(tmp_path, capsys,
                                                                                             untraced_steps):
    """--trace-wait-steps 0 (untraced_steps []) or 1 (only step 0, the start-up, which the conversion leaves out)
    and no step timed after the window: the .et kept the profiler's cost, about 2x a GPT-2 tiny step, and the
    summary said the cost was removed."""
    folder = tmp_path / "gpt2_tiny_2r"
    shutil.copytree(CPU_FIXTURES / "gpt2_tiny_2r", folder)
    info = json.loads((folder / "run.json").read_text())
    info["untraced_steps"] = untraced_steps
    for entry in info["ranks"]:
        entry["untraced_step_wall_time_s"] = [0.4] * len(untraced_steps)
    (folder / "run.json").write_text(json.dumps(info))
    assert cli.main([str(folder), "--no-progress"]) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"warning: gpt2_tiny_2r: {folder / 'run.json'} times no untraced step after the "
                                  f"run's first (untraced_steps {untraced_steps})")
    assert "every .et keeps the profiler's cost" in warnings[0]
    assert "--trace-wait-steps 2 or more, or --trace-after-steps 1 or more" in warnings[0]
    summary = (folder / "CONVERSION_SUMMARY.md").read_text()
    assert "with the profiler's cost kept" in summary and "profiler's cost removed" not in summary
    assert sum(line.startswith("- ") and "keeps the profiler's cost" in line for line in summary.splitlines()) == 1
    assert "profiler cost not removed (run.json times no untraced step after the run's first)" in summary
