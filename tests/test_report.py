"""trace_report.py and trace_tools.report: numbers equal the sums over the .et nodes, figures and HTA, bad input."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict, deque
from pathlib import Path

import numpy as np
import orjson
import pytest
from chakra.schema.protobuf.et_def_pb2 import (
    ALL_REDUCE, COMM_COLL_NODE, COMM_RECV_NODE, COMM_SEND_NODE, COMP_NODE, AttributeProto, GlobalMetadata, Node,
)
from chakra.src.third_party.utils.protolib import encodeMessage
from matplotlib.image import imread

from conversion_helpers import read_et_with_protolib
from trace_tools.layout import made_from_et_files
from trace_tools import report as report_lib
from trace_tools.report import ReportError, write_report

REPO = Path(__file__).resolve().parent.parent
CPU_DATA = REPO / "tests" / "data" / "cpu"
CPU_RUNS = ["bert_tiny_2r", "gpt2_tiny_1r"]
GPU_RUNS = ["astra-sim_megatron_tp8_a100_8r", "hta_simple_add_a100_1r", "param_dlrm_v100_8r",
            "param_linear_2080ti_1r", "param_resnet_2080ti_1r"]
COMM_TYPES = (COMM_COLL_NODE, COMM_SEND_NODE, COMM_RECV_NODE)
COMM_TYPE_NAMES = {0: "ALL_REDUCE", 2: "ALL_GATHER", 5: "BROADCAST", 6: "ALL_TO_ALL", 7: "REDUCE_SCATTER"}


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, env=env, **kwargs)


def _convert(paths: list[Path], out: Path) -> None:
    done = _run(["convert_to_et.py", *map(str, paths), "--output-dir", str(out), "--no-progress", "--jobs", "2"])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------------------
# The fixtures, converted once per session, reported on through the command line
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def cpu_reports(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cpu_reports")
    _convert([CPU_DATA / name for name in CPU_RUNS], out)
    done = _run(["trace_report.py", str(out)])
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="session")
def gpu_reports(tmp_path_factory, shared_fixtures) -> Path:
    out = tmp_path_factory.mktemp("gpu_reports")
    _convert([shared_fixtures / "gpu" / name for name in GPU_RUNS], out)
    done = _run(["trace_report.py", str(out), "--traces", str(shared_fixtures / "gpu")])
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(params=CPU_RUNS + GPU_RUNS)
def run_dir(request) -> Path:
    base = request.getfixturevalue("cpu_reports" if request.param in CPU_RUNS else "gpu_reports")
    return base / request.param


def read_et_independently(path: Path) -> tuple[dict, list[Node]]:
    """Decode with chakra's own protolib (not the code under test); the metadata as a dict of attributes."""
    meta, nodes = read_et_with_protolib(path)
    return {a.name: getattr(a, a.WhichOneof("value")) for a in meta.attr}, nodes


def node_attrs(node: Node) -> dict:
    return {a.name: getattr(a, a.WhichOneof("value")) for a in node.attr}


def load_json(run: Path) -> dict:
    return orjson.loads((run / "report.json").read_bytes())


def et_files(run: Path) -> dict[int, Path]:
    return {int(p.name.rsplit(".", 2)[1]): p for p in run.glob("*.et")}


# ---------------------------------------------------------------------------------------------------------------
# Numbers equal the sums over the .et nodes
# ---------------------------------------------------------------------------------------------------------------
def test_operator_and_kernel_tables_equal_sums_over_et_nodes(run_dir):
    report = load_json(run_dir)
    for rank, path in et_files(run_dir).items():
        _, nodes = read_et_independently(path)
        ops: dict = defaultdict(lambda: {"count": 0, "exclusive_us": 0, "blocked_us": 0})
        kernels: dict = defaultdict(lambda: {"count": 0, "total_us": 0})
        for node in nodes:
            a = node_attrs(node)
            if "device" in a:
                kernels[node.name]["count"] += 1
                kernels[node.name]["total_us"] += node.duration_micros
            elif node.type not in COMM_TYPES:
                ops[node.name]["count"] += 1
                ops[node.name]["exclusive_us"] += node.duration_micros
                ops[node.name]["blocked_us"] += a.get("wait_micros", 0)
        ours = report["per_rank"][str(rank)]
        assert ours["operators"] == dict(ops)
        ours_kernels = {k: {"count": v["count"], "total_us": v["total_us"]} for k, v in ours["kernels"].items()}
        assert ours_kernels == dict(kernels)
    # the top-20 lists are the largest sums over all ranks
    totals: dict = defaultdict(int)
    for per_rank in report["per_rank"].values():
        for name, entry in per_rank["operators"].items():
            totals[name] += entry["exclusive_us"]
    expected = sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))[:20]
    assert [(e["name"], e["exclusive_us"]) for e in report["top_operators"]] == expected


def test_communication_equals_the_comm_nodes(run_dir):
    report = load_json(run_dir)
    for rank, path in et_files(run_dir).items():
        _, nodes = read_et_independently(path)
        comm = sorted((n for n in nodes if n.type in COMM_TYPES), key=lambda n: (n.start_time_micros, n.id))
        expected = []
        by_pg: dict = defaultdict(lambda: {"count": 0, "bytes": 0})
        for n in comm:
            a = node_attrs(n)
            expected.append((n.id, COMM_TYPE_NAMES.get(a.get("comm_type")) if n.type == COMM_COLL_NODE else None,
                             a["comm_size"], n.duration_micros, a.get("pg_name", "")))
            by_pg[a.get("pg_name", "")]["count"] += 1
            by_pg[a.get("pg_name", "")]["bytes"] += a["comm_size"]
        ours = report["per_rank"][str(rank)]
        assert [(c["id"], c["comm_type"] if c["node_type"] == "COMM_COLL" else None, c["size_bytes"],
                 c["duration_us"], c["pg_name"]) for c in ours["collectives"]] == expected
        assert ours["bytes_by_process_group"] == dict(by_pg)
    if run_dir.name in ("bert_tiny_2r", "astra-sim_megatron_tp8_a100_8r", "param_dlrm_v100_8r"):
        assert all(r["collectives"] for r in report["per_rank"].values()), "this run communicates"
        md = (run_dir / "report.md").read_text()
        assert "ALL_REDUCE" in md and "Bytes per process group" in md


def longest_path(nodes: list[Node]) -> int:
    index = {n.id: i for i, n in enumerate(nodes)}
    children: list[list[int]] = [[] for _ in nodes]
    indegree = [0] * len(nodes)
    for i, n in enumerate(nodes):
        for dep in set(n.data_deps) | set(n.ctrl_deps):
            children[index[dep]].append(i)
            indegree[i] += 1
    start = [0] * len(nodes)
    queue = deque(i for i, d in enumerate(indegree) if d == 0)
    best = 0
    while queue:
        i = queue.popleft()
        end = start[i] + nodes[i].duration_micros
        best = max(best, end)
        for c in children[i]:
            start[c] = max(start[c], end)
            indegree[c] -= 1
            if indegree[c] == 0:
                queue.append(c)
    return best


def test_critical_path_and_step_time_equal_those_of_the_et(run_dir):
    report = load_json(run_dir)
    md = (run_dir / "report.md").read_text()
    for rank, path in et_files(run_dir).items():
        meta, nodes = read_et_independently(path)
        ours = report["per_rank"][str(rank)]
        assert ours["step_us"] == meta["traced_step_micros"]
        cp = longest_path(nodes)
        assert ours["critical_path"]["critical_path_us"] == cp
        assert ours["critical_path"]["gap_us"] == meta["traced_step_micros"] - cp
        assert re.search(rf"^\| {rank} \| {cp / 1000:.3f} \| {meta['traced_step_micros'] / 1000:.3f} \|", md, re.M)


def _mask(intervals, lo: int, hi: int) -> np.ndarray:
    mask = np.zeros(hi - lo, dtype=bool)
    for s, e in intervals:
        s, e = max(s, lo), min(e, hi)
        if e > s:
            mask[s - lo:e - lo] = True
    return mask


def test_breakdown_is_a_union_of_the_et_intervals(run_dir):
    """Each rank's parts add up to the step; on GPUs they equal a 1 µs raster of the GPU nodes' intervals, on CPUs
    compute is the sum of the operators' .et durations (one working thread) and communication the raster of the
    collectives."""
    report = load_json(run_dir)
    for rank, path in et_files(run_dir).items():
        meta, nodes = read_et_independently(path)
        b = report["per_rank"][str(rank)]["breakdown"]
        lo = meta["traced_step_start_micros"]
        hi = lo + meta["traced_step_micros"]
        parts = b["compute_us"] + b["communication_us"] + b["memcpy_us"] + b["profiler_us"] + b["idle_us"]
        assert parts == b["step_us"] == hi - lo
        assert b["profiler_us"] == min(meta.get("recording_overhead_micros", 0), b["idle_us"] + b["profiler_us"])
        kinds: dict = defaultdict(list)
        cpu_compute = 0
        threads = set()
        for n in nodes:
            a = node_attrs(n)
            interval = (n.start_time_micros, n.start_time_micros + n.duration_micros)
            if n.type in COMM_TYPES:
                kinds["comm"].append(interval)
            elif "device" in a:
                memory = n.name.startswith(("Memcpy", "Memset")) or "bytes" in a
                kinds["memcpy" if memory else "compute"].append(interval)
            else:
                cpu_compute += n.duration_micros
                threads.add(a.get("tid"))
        comm = _mask(kinds["comm"], lo, hi)
        assert b["communication_total_us"] == int(comm.sum())
        if report["kind"] == "gpu":
            compute, memcpy = _mask(kinds["compute"], lo, hi), _mask(kinds["memcpy"], lo, hi)
            assert b["compute_us"] == int(compute.sum())
            assert b["communication_us"] == int((comm & ~compute).sum())
            assert b["memcpy_us"] == int((memcpy & ~compute & ~comm).sum())
            assert b["idle_us"] + b["profiler_us"] == int((~(compute | comm | memcpy)).sum())
        else:
            assert threads == {1}
            # the .et durations are rounded one by one: their sum may pass the step end by a few µs, cut off there
            assert b["compute_us"] + b["outside_step_us"] == cpu_compute
            assert b["outside_step_us"] <= 0.001 * b["step_us"]
            assert b["memcpy_us"] == 0


def test_markdown_tables_show_the_json_numbers(run_dir):
    report = load_json(run_dir)
    md = (run_dir / "report.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", md,
                      re.M)
    breakdown_rows = {int(r[0]): r[1:] for r in rows[:len(report["per_rank"])]}
    assert sorted(breakdown_rows) == report["ranks"]
    for rank, cells in breakdown_rows.items():
        b = report["per_rank"][str(rank)]["breakdown"]
        keys = ["step_us", "compute_us", "communication_us", "memcpy_us", "profiler_us", "idle_us"]
        assert list(cells) == [f"{b[k] / 1000:.3f}" for k in keys]
    for entry in report["top_operators"][:5]:
        assert f"| {entry['count']} | {entry['exclusive_us'] / 1000:.3f} |" in md


# ---------------------------------------------------------------------------------------------------------------
# Every fixture gets its report and figures
# ---------------------------------------------------------------------------------------------------------------
def test_report_and_figures_come_out_for_every_rank(run_dir):
    report = load_json(run_dir)
    md = (run_dir / "report.md").read_text()
    ranks = sorted(et_files(run_dir))
    assert report["ranks"] == ranks and not report["missing_ranks"]
    figures = ["report_breakdown.png", "report_top_ops.png"] + [f"report_timeline_rank{r}.png" for r in ranks]
    if any(r["collectives"] for r in report["per_rank"].values()):
        figures.append("report_collectives.png")
    assert sorted(report["figures"]) == sorted(figures)
    # a conversion that replaces the .et files removes exactly these (trace_tools.layout.made_from_et_files)
    assert all(made_from_et_files(name) for name in ["report.md", "report.json", *figures])
    for name in figures:
        assert f"]({name})" in md
        image = imread(run_dir / name)
        assert image.shape[0] > 150 and image.shape[1] > 400
        assert image[..., :3].std() > 0.05, f"{name} is blank"
    for heading in ("## Step time per rank", "## Critical path", "## Timeline", "## Top operators",
                    "## Communication", "## HolisticTraceAnalysis"):
        assert heading in md


def test_gpu_reports_use_hta_or_say_why_not(gpu_reports):
    hta_importable = _run(["-c", "import hta.trace_analysis"]).returncode == 0
    for name in GPU_RUNS:
        report = load_json(gpu_reports / name)
        md = (gpu_reports / name / "report.md").read_text()
        hta = report["hta"]
        if not hta_importable:
            assert hta["status"] == "unavailable" and "Not used:" in md
            continue
        assert hta["status"] in ("ok", "partial"), hta
        assert "HolisticTraceAnalysis 0.5" in md or "HolisticTraceAnalysis" in md
        temporal = {row["rank"]: row for row in hta["temporal_breakdown"]}
        assert sorted(temporal) == report["ranks"]
        for rank, row in temporal.items():
            ours = report["per_rank"][str(rank)]["breakdown"]["compute_us"]
            # HTA reads the device trace cut to the step: the same kernels, plus those launched before the step
            assert ours * 0.95 - 5 <= row["compute_time(us)"] <= ours * 1.25 + 5
    megatron = load_json(gpu_reports / "astra-sim_megatron_tp8_a100_8r")
    if hta_importable:
        assert megatron["hta"]["temporal_breakdown"][0]["compute_time(us)"] == \
            megatron["per_rank"]["0"]["breakdown"]["compute_us"]


def test_a_scaled_set_is_reported_once_per_distinct_file(cpu_reports, tmp_path):
    """Ranks replaying one traced rank are hard links to one file: a 1024-rank set had taken 198 s, drawn 1024
    timelines of 2 files and a breakdown figure 79,233 pixels wide. Each file is reported once, and the report says
    which ranks it stands for; a slowed rank has a file of its own."""
    scale = pytest.importorskip("trace_tools.scale")
    prefix = scale.scale_run(cpu_reports / "bert_tiny_2r", 16, output_dir=tmp_path / "scaled", name="big",
                             slow={5: 2.0}, assume_data_parallel=True)
    folder = prefix.parent
    write_report(folder, use_hta=False)
    report = load_json(folder)
    assert report["ranks"] == list(range(16)) and not report["missing_ranks"]
    assert sorted(map(int, report["per_rank"])) == [0, 1, 5]
    assert report["shared_files"] == {"0": list(range(0, 16, 2)), "1": [1, 3, 7, 9, 11, 13, 15]}
    assert sorted(p.name for p in folder.glob("report_timeline_rank*.png")) == \
        [f"report_timeline_rank{r}.png" for r in (0, 1, 5)]
    md = (folder / "report.md").read_text()
    assert md.splitlines()[2].startswith("16 rank(s) (CPU run")
    assert "- rank 0 stands for ranks 0, 2, 4, ..., 14 (8 ranks)" in md
    assert "- rank 1 stands for ranks 1, 3, 7, ..., 15 (7 ranks)" in md
    # rank 5 replays traced rank 1 at twice its compute: its step ends where its work does, not at the traced step's
    # end (its compute had been clipped to it)
    traced, slowed = report["per_rank"]["1"], report["per_rank"]["5"]
    assert slowed["compute_scale"] == 2.0 and traced["compute_scale"] == 1.0
    assert slowed["traced_step_us"] == traced["step_us"] == traced["traced_step_us"]
    assert slowed["breakdown"]["compute_us"] == pytest.approx(2 * traced["breakdown"]["compute_us"], rel=0.02)
    assert slowed["step_us"] > traced["step_us"] + traced["breakdown"]["compute_us"] * 0.9
    assert f"- rank 5: compute x2, step {slowed['step_us'] / 1000:.3f} ms (traced {traced['step_us'] / 1000:.3f} ms)" \
        in md


def test_cpu_reports_explain_what_counts_and_skip_hta(cpu_reports):
    md = (cpu_reports / "bert_tiny_2r" / "report.md").read_text()
    assert "The step breakdown is about the CPU" in md
    assert "no GPU work in these traces" in md
    assert load_json(cpu_reports / "bert_tiny_2r")["hta"]["status"] == "not_applicable"


# ---------------------------------------------------------------------------------------------------------------
# Small hand-made .et files: exact expectations
# ---------------------------------------------------------------------------------------------------------------
def _attr(name: str, value) -> AttributeProto:
    if isinstance(value, bool):
        return AttributeProto(name=name, bool_val=value)
    if isinstance(value, str):
        return AttributeProto(name=name, string_val=value)
    if isinstance(value, float):
        return AttributeProto(name=name, double_val=value)
    return AttributeProto(name=name, int64_val=value)


def write_et(path: Path, step_start: int, step_us: int, nodes: list[dict], world_size: int = 1,
             meta: dict | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        encodeMessage(f, GlobalMetadata(version="0.0.4", attr=[
            _attr("rank", int(path.name.split(".")[-2])), _attr("traced_step", "ProfilerStep#1"),
            _attr("traced_step_start_micros", step_start), _attr("traced_step_micros", step_us),
            _attr("world_size", world_size), *(_attr(k, v) for k, v in (meta or {}).items())]))
        for spec in nodes:
            node = Node(id=spec["id"], name=spec["name"], type=spec.get("type", COMP_NODE),
                        start_time_micros=spec["ts"], duration_micros=spec["dur"])
            node.data_deps.extend(spec.get("deps", []))
            node.ctrl_deps.extend(spec.get("ctrl", []))
            node.attr.extend(_attr(k, v) for k, v in spec.get("attrs", {}).items())
            encodeMessage(f, node)
    return path


def test_gpu_breakdown_counts_overlapping_work_once(tmp_path):
    """Compute [10, 50), an all-reduce [30, 80) on another stream, a memcpy [70, 90) in a 100 µs step: compute 40,
    communication not under compute 30, memcpy under neither 10, idle 20; critical path 10 + 40 + 20 = 70."""
    gpu = {"is_cpu_op": False, "device": 0}
    write_et(tmp_path / "toy.0.et", 1000, 100, [
        {"id": 0, "name": "aten::mm", "ts": 1000, "dur": 10, "attrs": {"tid": 1, "is_cpu_op": True}},
        {"id": 1, "name": "gemm_kernel", "ts": 1010, "dur": 40, "ctrl": [0], "attrs": dict(gpu, stream=7)},
        {"id": 2, "name": "ncclDevKernel_AllReduce", "type": COMM_COLL_NODE, "ts": 1030, "dur": 50, "ctrl": [0],
         "attrs": dict(gpu, stream=24, comm_type=ALL_REDUCE, comm_size=4096, pg_name="0")},
        {"id": 3, "name": "Memcpy DtoH (Device -> Pageable)", "ts": 1070, "dur": 20, "deps": [1], "ctrl": [0],
         "attrs": dict(gpu, stream=7, bytes=4096)},
    ])
    write_report(tmp_path, use_hta=False)
    report = load_json(tmp_path)
    b = report["per_rank"]["0"]["breakdown"]
    assert (b["compute_us"], b["communication_us"], b["memcpy_us"], b["idle_us"]) == (40, 30, 10, 20)
    assert (b["communication_total_us"], b["communication_overlapped_us"], b["memcpy_total_us"]) == (50, 20, 20)
    cp = report["per_rank"]["0"]["critical_path"]
    assert (cp["critical_path_us"], cp["gap_us"], cp["path_nodes"]) == (70, 30, 3)
    assert cp["path_by_kind_us"] == {"cpu_compute": 10, "gpu_compute": 40, "gpu_memcpy": 20}
    assert report["per_rank"]["0"]["bytes_by_process_group"] == {"0": {"count": 1, "bytes": 4096}}
    md = (tmp_path / "report.md").read_text()
    assert "| 0 | 0.100 | 0.040 | 0.030 | 0.010 | 0.000 | 0.020 | 0.050 | 40.0% |" in md
    assert "Not used: HTA not run (--no-hta)" in md


def test_a_stragglers_kernels_follow_one_another_and_its_step_holds_them(tmp_path):
    """A straggler's file (scale_et.py --slow 0:2) keeps the traced start times with twice the durations: two kernels
    traced back to back on one stream, [10, 30) and [30, 50) of a 70 µs step, are now 40 µs each. They run one after
    the other, [10, 50) and [50, 90), so the step is 90 µs with 80 of compute (it had been 70 with 60: the kernels
    overlapping each other and cut at the traced step's end)."""
    gpu = {"is_cpu_op": False, "device": 0, "stream": 7}
    write_et(tmp_path / "toy.0.et", 1000, 70, [
        {"id": 0, "name": "aten::mm", "ts": 1000, "dur": 20, "attrs": {"tid": 1, "is_cpu_op": True}},
        {"id": 1, "name": "gemm_kernel", "ts": 1010, "dur": 40, "ctrl": [0], "attrs": gpu},
        {"id": 2, "name": "gemm_kernel", "ts": 1030, "dur": 40, "ctrl": [0], "attrs": gpu},
    ], meta={"compute_scale": 2.0})
    write_report(tmp_path, use_hta=False)
    rank = load_json(tmp_path)["per_rank"]["0"]
    assert (rank["step_us"], rank["traced_step_us"], rank["compute_scale"]) == (90, 70, 2.0)
    assert (rank["breakdown"]["compute_us"], rank["breakdown"]["idle_us"]) == (80, 10)
    assert "- rank 0: compute x2, step 0.090 ms (traced 0.070 ms)" in (tmp_path / "report.md").read_text()


def test_the_profilers_cost_taken_out_of_the_et_is_its_own_part_of_the_step_not_idle(tmp_path):
    """A 100 µs traced step whose .et holds 30 µs of operator work after the conversion took 60 µs of the profiler's
    cost out of it (recording_overhead_micros): 60 of the step is the profiler's, 10 idle (it had shown 70 idle,
    as a CPU sitting idle most of a step that the run spent computing)."""
    cpu = {"tid": 1, "is_cpu_op": True}
    nodes = [{"id": 1, "name": "ProfilerStep#1", "ts": 0, "dur": 10, "attrs": cpu},
             {"id": 2, "name": "aten::mm", "ts": 30, "dur": 20, "ctrl": [1], "attrs": cpu}]
    write_et(tmp_path / "toy.0.et", 0, 100, nodes, meta={"recording_overhead_micros": 60})
    write_report(tmp_path, use_hta=False)
    b = load_json(tmp_path)["per_rank"]["0"]["breakdown"]
    assert (b["compute_us"], b["profiler_us"], b["idle_us"]) == (30, 60, 10)
    assert "| 0 | 0.100 | 0.030 | 0.000 | 0.000 | 0.060 | 0.010 |" in (tmp_path / "report.md").read_text()
    # a cost larger than the step has room for is bounded by it
    write_et(tmp_path / "toy.0.et", 0, 100, nodes, meta={"recording_overhead_micros": 500})
    write_report(tmp_path, use_hta=False)
    b = load_json(tmp_path)["per_rank"]["0"]["breakdown"]
    assert (b["compute_us"], b["profiler_us"], b["idle_us"]) == (30, 70, 0)


def test_cpu_thread_layout_leaves_out_blocked_time(tmp_path):
    """A step annotation (own time 10), an operator X (.et duration 20, blocked 30) calling Y (10), and a gloo
    all-reduce [30, 70) on a worker thread: X waits for the all-reduce, so the thread works [0, 40) and the
    all-reduce is exposed for 30 µs; idle 30 of 100."""
    cpu = {"tid": 1, "is_cpu_op": True}
    write_et(tmp_path / "toy.0.et", 0, 100, [
        {"id": 1, "name": "ProfilerStep#1", "ts": 0, "dur": 10, "attrs": cpu},
        {"id": 2, "name": "X", "ts": 10, "dur": 20, "attrs": dict(cpu, wait_micros=30)},
        {"id": 3, "name": "Y", "ts": 15, "dur": 10, "ctrl": [2], "deps": [2], "attrs": cpu},
        {"id": 4, "name": "gloo:all_reduce", "type": COMM_COLL_NODE, "ts": 30, "dur": 40, "ctrl": [3], "deps": [3],
         "attrs": {"tid": 1, "is_cpu_op": False, "comm_type": ALL_REDUCE, "comm_size": 64, "pg_name": "0"}},
    ])
    write_report(tmp_path, use_hta=False)
    report = load_json(tmp_path)
    b = report["per_rank"]["0"]["breakdown"]
    assert (b["compute_us"], b["communication_us"], b["idle_us"], b["communication_total_us"]) == (40, 30, 30, 40)
    assert report["per_rank"]["0"]["operators"]["X"] == {"count": 1, "exclusive_us": 20, "blocked_us": 30}
    trace = report_lib.load_rank(tmp_path / "toy.0.et", 0)
    work = {n.name: trace.work[i] for i, n in enumerate(trace.nodes)}
    assert work == {"ProfilerStep#1": [(0, 10)], "X": [(10, 15), (25, 40)], "Y": [(15, 25)],
                    "gloo:all_reduce": [(30, 70)]}
    assert report["per_rank"]["0"]["critical_path"]["critical_path_us"] == 70  # X 20 + Y 10 + all-reduce 40


def test_dependency_cycle_is_reported_not_hidden(tmp_path):
    cpu = {"tid": 1, "is_cpu_op": True}
    write_et(tmp_path / "loop.0.et", 0, 50, [
        {"id": 1, "name": "a", "ts": 0, "dur": 10, "deps": [2], "attrs": cpu},
        {"id": 2, "name": "b", "ts": 10, "dur": 10, "deps": [1], "attrs": cpu},
    ])
    write_report(tmp_path, use_hta=False)
    cp = load_json(tmp_path)["per_rank"]["0"]["critical_path"]
    assert cp["critical_path_us"] is None and "2 nodes sit on a dependency cycle" in cp["problem"]
    assert "| 0 | n/a | 0.050 | n/a | n/a | n/a | 2 nodes sit on a dependency cycle |" in \
        (tmp_path / "report.md").read_text()


def test_missing_rank_is_named_and_stale_figures_go(tmp_path):
    cpu = {"tid": 1, "is_cpu_op": True}
    for rank in (0, 1):
        write_et(tmp_path / f"two.{rank}.et", 0, 50, [{"id": 1, "name": "a", "ts": 0, "dur": 10, "attrs": cpu}],
                 world_size=2)
    write_report(tmp_path, use_hta=False)
    assert (tmp_path / "report_timeline_rank1.png").is_file()
    (tmp_path / "two.1.et").unlink()
    write_report(tmp_path, use_hta=False)
    assert load_json(tmp_path)["missing_ranks"] == [1]
    assert "**Missing ranks:** no `.et` for rank(s) 1" in (tmp_path / "report.md").read_text()
    assert not (tmp_path / "report_timeline_rank1.png").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".report.")]


# ---------------------------------------------------------------------------------------------------------------
# HTA: optional, and its failures fall back to our numbers
# ---------------------------------------------------------------------------------------------------------------
def _gpu_toy_run(folder: Path) -> None:
    write_et(folder / "toy.0.et", 1000, 100, [
        {"id": 0, "name": "aten::add", "ts": 1000, "dur": 10, "attrs": {"tid": 1, "is_cpu_op": True}},
        {"id": 1, "name": "add_kernel", "ts": 1010, "dur": 40, "ctrl": [0],
         "attrs": {"is_cpu_op": False, "device": 0, "stream": 7}},
    ])
    (folder / "device.0.json").write_bytes(orjson.dumps({"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "add_kernel", "ts": 1010, "dur": 40, "pid": 0, "tid": 7,
         "args": {"stream": 7, "device": 0, "correlation": 5}}]}))


def test_hta_failure_falls_back_to_our_numbers(tmp_path, monkeypatch):
    fake = tmp_path / "fake_hta"
    (fake / "hta").mkdir(parents=True)
    (fake / "hta" / "__init__.py").write_text("")
    (fake / "hta" / "trace_analysis.py").write_text(
        "class TraceAnalysis:\n    def __init__(self, *args, **kwargs):\n"
        "        raise ValueError(\"Cannot specify both 'axis' and 'index'/'columns'\")\n")
    monkeypatch.setenv("PYTHONPATH", str(fake))
    monkeypatch.syspath_prepend(str(fake))
    run = tmp_path / "run"
    _gpu_toy_run(run)
    write_report(run)
    report = load_json(run)
    assert report["hta"]["status"] in ("failed", "unavailable")
    md = (run / "report.md").read_text()
    if report["hta"]["status"] == "failed":  # the fake HTA imported (the normal case)
        assert "HTA could not load the device traces (ValueError: Cannot specify both" in report["hta"]["reason"]
        assert "HTA failed, so the numbers above are our own" in md
    assert report["per_rank"]["0"]["breakdown"]["compute_us"] == 40


def test_without_hta_the_report_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(report_lib, "hta_available", lambda: False)
    _gpu_toy_run(tmp_path)
    write_report(tmp_path)
    assert load_json(tmp_path)["hta"]["status"] == "unavailable"
    assert "Not used: HolisticTraceAnalysis is not installed" in (tmp_path / "report.md").read_text()


def test_hta_is_not_given_a_device_trace_the_et_was_not_made_from(tmp_path, shared_fixtures):
    """A run traced again and not converted since: HTA would cut the new device trace to the old .et's step."""
    run = tmp_path / "run"
    shutil.copytree(shared_fixtures / "gpu" / "hta_simple_add_a100_1r", run, copy_function=shutil.copyfile)
    run.chmod(0o755)  # the shared fixtures are read-only
    _convert([run], run)
    write_report(run)
    assert load_json(run)["hta"]["status"] != "skipped"
    device = run / "device.0.json.gz"
    recorded = device.stat().st_size
    device.write_bytes(device.read_bytes() + b"\0" * 10)  # gzip ignores trailing zeros: still a readable trace
    write_report(run)
    hta = load_json(run)["hta"]
    assert hta["status"] == "skipped"
    assert hta["reason"] == (f"{device}: not the device trace rank 0's .et was made from ({run}/CONVERSION_SUMMARY.md "
                             f"records {recorded:,} bytes, it has {recorded + 10:,}); {sys.executable} "
                             f"{REPO}/convert_remaining.py {run} converts the run again")
    assert f"Not used: {hta['reason']}" in (run / "report.md").read_text()


def test_hta_without_device_traces_says_where_it_looked(tmp_path):
    _gpu_toy_run(tmp_path)
    (tmp_path / "device.0.json").unlink()
    write_report(tmp_path)
    hta = load_json(tmp_path)["hta"]
    if report_lib.hta_available():
        assert hta["status"] == "failed" and "no device traces" in hta["reason"]


# ---------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------
def test_cli_refuses_a_truncated_et_and_writes_nothing_there(tmp_path, cpu_reports):
    bad = tmp_path / "bad"
    bad.mkdir()
    data = (cpu_reports / "gpt2_tiny_1r" / "gpt2_tiny_1r.0.et").read_bytes()
    (bad / "gpt2_tiny_1r.0.et").write_bytes(data[: len(data) // 2])
    good = tmp_path / "good"
    shutil.copytree(cpu_reports / "gpt2_tiny_1r", good)
    (good / "report.md").unlink()
    done = _run(["trace_report.py", str(bad), str(good), "--no-hta"])
    assert done.returncode == 1
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"error: {bad / 'gpt2_tiny_1r.0.et'}: truncated")
    assert sorted(p.name for p in bad.iterdir()) == ["gpt2_tiny_1r.0.et"]
    assert (good / "report.md").is_file()


def test_folder_without_et_files_is_an_error(tmp_path):
    done = _run(["trace_report.py", str(tmp_path)])
    assert done.returncode == 1
    assert done.stderr.strip() == f"error: {tmp_path}: no <name>.<rank>.et files in it or in its sub-folders"
    with pytest.raises(ReportError, match="nowhere: no such folder$"):  # as simulate.py and scale_et.py say it
        write_report(tmp_path / "nowhere")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ReportError, match="a_file: not a folder$"):
        write_report(tmp_path / "a_file")


def test_two_runs_in_one_folder_are_refused(tmp_path):
    cpu = {"tid": 1, "is_cpu_op": True}
    for name in ("a", "b"):
        write_et(tmp_path / f"{name}.0.et", 0, 10, [{"id": 1, "name": "x", "ts": 0, "dur": 1, "attrs": cpu}])
    with pytest.raises(ReportError, match=r"\.et files of several runs \(a, b\)"):
        write_report(tmp_path, use_hta=False)


# ---------------------------------------------------------------------------------------------------------------
# The report describes the .et files there now, and only those
# ---------------------------------------------------------------------------------------------------------------
def _two_ranks_with_an_all_reduce(folder: Path) -> None:
    cpu = {"tid": 1, "is_cpu_op": True}
    for rank in (0, 1):
        write_et(folder / f"two.{rank}.et", 0, 100, [
            {"id": 1, "name": "a", "ts": 0, "dur": 10, "attrs": cpu},
            {"id": 2, "name": "gloo:all_reduce", "type": COMM_COLL_NODE, "ts": 10, "dur": 40, "ctrl": [1],
             "deps": [1], "attrs": {"tid": 1, "is_cpu_op": False, "comm_type": ALL_REDUCE, "comm_size": 64,
                                    "pg_name": "0"}},
        ], world_size=2)


def test_ranks_of_two_runs_no_summary_records_are_refused(tmp_path):
    """.et files copied out of their folders, rank 1 of another run with a bigger bucket: the report described the
    pair as one run, with exit 0."""
    _two_ranks_with_an_all_reduce(tmp_path)
    write_report(tmp_path, use_hta=False)  # the two ranks as written agree
    cpu = {"tid": 1, "is_cpu_op": True}
    write_et(tmp_path / "two.1.et", 0, 100, [
        {"id": 1, "name": "a", "ts": 0, "dur": 10, "attrs": cpu},
        {"id": 2, "name": "gloo:all_reduce", "type": COMM_COLL_NODE, "ts": 10, "dur": 40, "ctrl": [1], "deps": [1],
         "attrs": {"tid": 1, "is_cpu_op": False, "comm_type": ALL_REDUCE, "comm_size": 4096, "pg_name": "0"}},
    ], world_size=2)
    with pytest.raises(ReportError, match=rf"^{tmp_path}: the ranks of two do not run the same collectives \(.*"
                                          r"\): \.et files of different runs; keep one run per folder$"):
        write_report(tmp_path, use_hta=False)


def test_an_earlier_reports_figures_that_this_one_does_not_draw_go(tmp_path, monkeypatch):
    _two_ranks_with_an_all_reduce(tmp_path)
    write_report(tmp_path, use_hta=False)
    assert (tmp_path / "report_collectives.png").is_file() and (tmp_path / "report_top_ops.png").is_file()
    for et in tmp_path.glob("*.et"):  # another run in the folder now: one rank, no communication
        et.unlink()
    write_et(tmp_path / "one.0.et", 0, 50, [{"id": 1, "name": "b", "ts": 0, "dur": 10,
                                            "attrs": {"tid": 1, "is_cpu_op": True}}])

    def broken(*args):
        raise ValueError("no room for the labels")

    monkeypatch.setattr(report_lib, "plot_top", broken)
    write_report(tmp_path, use_hta=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.0.et", "report.json", "report.md",
                                                          "report_breakdown.png", "report_timeline_rank0.png"]
    md = (tmp_path / "report.md").read_text()
    assert "# Trace report: one" in md and "- report_top_ops.png: ValueError: no room for the labels" in md


def test_et_files_the_summary_did_not_record_are_refused(tmp_path, cpu_reports):
    """A rank's .et replaced by another run's (same file name): CONVERSION_SUMMARY.md recorded other bytes. The folder
    holds no traces, so the command to convert again reads them where the conversion did."""
    run = tmp_path / "bert_tiny_2r"
    shutil.copytree(cpu_reports / "bert_tiny_2r", run)
    before = (run / "report.md").read_bytes()
    shutil.copy(cpu_reports / "gpt2_tiny_1r" / "gpt2_tiny_1r.0.et", run / "bert_tiny_2r.1.et")
    done = _run(["trace_report.py", str(run)])
    assert done.returncode == 1
    assert done.stderr.strip() == (f"error: {run / 'bert_tiny_2r.1.et'}: not the file {run / 'CONVERSION_SUMMARY.md'} "
                                   "recorded (another run's .et, or changed or cut short since it was written); "
                                   f"{sys.executable} {REPO}/convert_remaining.py {CPU_DATA / 'bert_tiny_2r'} "
                                   f"--output-dir {run} makes it again")
    assert (run / "report.md").read_bytes() == before
    assert not [p for p in run.iterdir() if p.name.startswith(".report.")]
    # the command runs as printed, pasted into a shell anywhere (it had been a bare `convert_remaining.py`: command
    # not found), and converts the rank again
    command = done.stderr.strip().split("; ")[-1].removesuffix(" makes it again")
    again = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert _run(["trace_report.py", str(run), "--no-hta"]).returncode == 0


def test_no_report_while_a_conversion_writes_into_the_folder(tmp_path):
    from trace_tools.pipeline import only_conversion_in

    _two_ranks_with_an_all_reduce(tmp_path)
    with only_conversion_in(tmp_path), \
            pytest.raises(ReportError, match="a conversion is writing into this folder now; report on it when"):
        write_report(tmp_path, use_hta=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["two.0.et", "two.1.et"]


def test_a_killed_reports_staging_folder_is_removed_by_the_next(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f".report.{int(gone.stdout)}.k3x9q2ab"
    dead.mkdir()
    (dead / "report_breakdown.png").write_bytes(b"half")
    alive = tmp_path / f".report.{os.getppid()}.a1b2c3d4"  # another report still drawing
    alive.mkdir()
    _two_ranks_with_an_all_reduce(tmp_path)
    write_report(tmp_path, use_hta=False)
    assert not dead.exists() and alive.is_dir()


@pytest.mark.parametrize("signal_name, code, how", [("SIGINT", 130, "Ctrl-C"), ("SIGTERM", 143, "SIGTERM")])
def test_interrupted_report_says_so_in_one_line_and_keeps_the_earlier_one(tmp_path, signal_name, code, how):
    _two_ranks_with_an_all_reduce(tmp_path)
    write_report(tmp_path, use_hta=False)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    # the signal arrives while a figure is drawn, as a Ctrl-C or a job scheduler's kill would
    # SIGINT handled as Python does when it starts in a terminal, also when the tests run as a background job
    # (`./run_tests.sh &` starts them with SIGINT ignored)
    done = _run(["-c", "import os, signal, sys, trace_report, trace_tools.report as r\n"
                       "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                       f"r.plot_top = lambda *a: os.kill(os.getpid(), signal.{signal_name})\n"
                       f"sys.exit(trace_report.main([{str(tmp_path)!r}]))"])
    assert done.returncode == code
    assert done.stderr.strip() == (f"interrupted: trace_report.py stopped by {how}; the report being written was not "
                                   "moved in (its folder keeps the earlier one, if any); the reports printed above "
                                   "are complete")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_signal_while_the_report_is_moved_in_waits_for_the_whole_report(tmp_path):
    """SIGTERM between the moves had left the new report.md and report.json beside the earlier figures, under a line
    saying the report was not moved in."""
    _two_ranks_with_an_all_reduce(tmp_path)
    write_report(tmp_path, use_hta=False)
    before = {p.name: p.stat().st_ino for p in tmp_path.iterdir() if p.name.startswith("report")}
    done = _run(["-c", "import os, signal, sys, trace_report, trace_tools.report as r\n"
                       "replace = os.replace\n"
                       "def killed_while_moving(source, target):\n"
                       "    replace(source, target)\n"
                       "    if str(target).endswith('report.json'):\n"
                       "        os.kill(os.getpid(), signal.SIGTERM)\n"
                       "r.os.replace = killed_while_moving\n"
                       f"sys.exit(trace_report.main([{str(tmp_path)!r}]))"])
    assert done.returncode == 143
    assert done.stderr.strip() == (f"interrupted: trace_report.py stopped by SIGTERM once {tmp_path / 'report.md'} "
                                   "was written; the reports printed above are complete too")
    after = {p.name: p.stat().st_ino for p in tmp_path.iterdir() if p.name.startswith("report")}
    # every file of the report moved in anew (report.md among them), none left from before
    assert sorted(after) == sorted(before) and not set(after.values()) & set(before.values())
    assert not list(tmp_path.glob(".report.*"))


def test_a_traces_folder_that_does_not_exist_is_a_usage_error(tmp_path):
    _two_ranks_with_an_all_reduce(tmp_path)
    done = _run(["trace_report.py", str(tmp_path), "--traces", str(tmp_path / "nowhere")])
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: --traces {tmp_path / 'nowhere'}: no such folder"
    assert not (tmp_path / "report.md").exists()
