"""Report on a run's .et files: step time breakdown, timelines, top operators, communication and critical path."""
from __future__ import annotations

import importlib.util
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from chakra.schema.protobuf.et_def_pb2 import COMM_COLL_NODE, COMM_RECV_NODE, COMM_SEND_NODE
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from .atomic import folder_held, process_is_alive, publication
from .discover import find_runs
from .graph import longest_path, topological_order
from .intervals import clip_intervals, merge_intervals, subtract_intervals, total_length
from .layout import REPORT_FILE_RE, STEP_PREFIX, et_sets, ranks_sharing_a_file
from .link import COMM_TYPE_NAMES
from .load import read_trace_bytes
from .summary import (CONVERSION_SUMMARY, format_bytes, read_previous_results, recorded_ranks, reconvert_command,
                      records_set, unrecorded_et_file)
from .validate import EtFormatError, collectives_agree, group_members, misnamed_rank, read_et, serve_in_turn

logger = logging.getLogger(__name__)

REPORT_MD = "report.md"
REPORT_JSON = "report.json"
FIGURE_BREAKDOWN = "report_breakdown.png"
FIGURE_TIMELINE = "report_timeline_rank{rank}.png"
FIGURE_TOP = "report_top_ops.png"
FIGURE_COMM = "report_collectives.png"
# The folder a report is drawn in before it is moved in: .report.<pid>.<random> (a killed writer's is removed).
STAGING_RE = re.compile(r"\.report\.(?P<pid>\d+)\..+")
TOP_N = 20
# Collective rows written into report.md (all of them are in report.json).
MAX_COLLECTIVE_ROWS = 120
HTA_TIMEOUT_S = 600

COMPUTE, COMM, MEMCPY = "compute", "communication", "memcpy"
COMM_NODE_TYPES = (COMM_COLL_NODE, COMM_SEND_NODE, COMM_RECV_NODE)
COMM_NODE_NAMES = {COMM_COLL_NODE: "COMM_COLL", COMM_SEND_NODE: "COMM_SEND", COMM_RECV_NODE: "COMM_RECV"}
MEMCPY_PREFIXES = ("Memcpy", "Memset", "memcpy", "memset")
COLORS = {COMPUTE: "#1f77b4", COMM: "#d62728", MEMCPY: "#ff7f0e", "profiler": "#9467bd", "idle": "#d9d9d9",
          "span": "#bdbdbd"}


class ReportError(Exception):
    """A problem with a report's input, said in one line that names the file or folder."""


# ---------------------------------------------------------------------------------------------------------------
# Reading the .et files
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class EtNode:
    """What the report needs of one .et node."""

    id: int
    name: str
    type: int
    start: int
    dur: int
    deps: tuple[int, ...]  # data and ctrl dependencies (node ids)
    parent: int            # ctrl dependency (the caller), -1 when none
    attrs: dict[str, Any]
    on_gpu: bool
    category: str
    lane: tuple
    wait: int


@dataclass
class RankTrace:
    """One rank's .et: its nodes, the traced step window, and the derived busy intervals of every node."""

    rank: int
    path: Path
    meta: dict[str, Any]
    nodes: list[EtNode]
    step_name: str
    step_start: int
    step_dur: int
    step_from_metadata: bool
    work: list[list[tuple[int, int]]] = field(default_factory=list)     # per node: when it did its .et duration
    span: list[tuple[int, int]] = field(default_factory=list)           # per node: placed inclusive span
    traced_step_dur: int = 0  # the traced step; step_dur differs from it only for a straggler's file (stretch_step)

    @property
    def compute_scale(self) -> float:
        """A straggler's compute durations against the traced ones (scale_et.py --slow); 1 for other files."""
        return float(self.meta.get("compute_scale", 1.0) or 1.0)

    @property
    def step_end(self) -> int:
        return self.step_start + self.step_dur

    @property
    def has_gpu(self) -> bool:
        return any(n.on_gpu for n in self.nodes)


def _attrs(message) -> dict[str, Any]:
    out = {}
    for attr in message.attr:
        which = attr.WhichOneof("value")
        if which is not None:
            out[attr.name] = getattr(attr, which)
    return out


def node_category(node_type: int, name: str, attrs: dict[str, Any]) -> str:
    """compute, communication or memcpy: COMM node types; GPU memcpy/memset; everything else is compute."""
    if node_type in COMM_NODE_TYPES:
        return COMM
    if "device" in attrs and (name.startswith(MEMCPY_PREFIXES) or "bytes" in attrs):
        return MEMCPY
    return COMPUTE


def node_lane(on_gpu: bool, category: str, attrs: dict[str, Any]) -> tuple:
    """GPU work by (device, stream); CPU collectives on their own lane (they run on the backend's worker threads,
    while the .et gives them the caller's thread id); other CPU operators by thread id."""
    if on_gpu:
        return ("gpu", int(attrs.get("device", 0)), int(attrs.get("stream", 0)))
    if category == COMM:
        return ("cpu-comm", int(attrs.get("tid", 0)))
    return ("cpu", int(attrs.get("tid", 0)))


def load_rank(path: Path, rank: int) -> RankTrace:
    """Decode one .et; ReportError naming the file when it is not a readable Chakra trace."""
    try:
        metadata, raw_nodes = read_et(path)
    except (EtFormatError, OSError) as e:
        raise ReportError(str(e) if str(path) in str(e) else f"{path}: {e}") from None
    except Exception as e:  # protobuf's DecodeError and friends
        raise ReportError(f"{path}: not a Chakra .et ({type(e).__name__}: {e})") from None
    if not raw_nodes:
        raise ReportError(f"{path}: the .et holds no nodes")
    meta = _attrs(metadata)
    nodes = []
    for raw in raw_nodes:
        attrs = _attrs(raw)
        on_gpu = "device" in attrs
        category = node_category(raw.type, raw.name, attrs)
        ctrl = list(raw.ctrl_deps)
        nodes.append(EtNode(
            id=raw.id, name=raw.name, type=raw.type, start=int(raw.start_time_micros), dur=int(raw.duration_micros),
            deps=tuple(dict.fromkeys(list(raw.data_deps) + ctrl)), parent=ctrl[0] if ctrl else -1, attrs=attrs,
            on_gpu=on_gpu, category=category, lane=node_lane(on_gpu, category, attrs),
            wait=int(attrs.get("wait_micros", 0))))
    _join_step_thread(nodes)
    if "traced_step_micros" in meta and "traced_step_start_micros" in meta:
        step_start, step_dur, from_meta = int(meta["traced_step_start_micros"]), int(meta["traced_step_micros"]), True
    else:  # .et files of other converters: the span of the nodes stands for the step
        step_start = min(n.start for n in nodes)
        step_dur = max(n.start + n.dur for n in nodes) - step_start
        from_meta = False
    trace = RankTrace(rank=rank, path=path, meta=meta, nodes=nodes, step_name=str(meta.get("traced_step", "")),
                      step_start=step_start, step_dur=step_dur, step_from_metadata=from_meta, traced_step_dur=step_dur)
    place_work_intervals(trace)
    stretch_step(trace)
    return trace


def stretch_step(trace: RankTrace) -> None:
    """A straggler's file (scale_et.py --slow: compute durations times compute_scale, start times as traced) did its
    work at a pace nobody measured, so the traced step does not hold it: its step is taken to end where its placed
    work ends (at least the traced step), and the work is not clipped to the traced step (it had been: a rank slowed
    2x showed the compute of the traced step)."""
    if trace.compute_scale == 1.0:
        return
    ends = [e for intervals in trace.work for _, e in intervals]
    if ends:
        trace.step_dur = max(trace.step_dur, max(ends) - trace.step_start)


def _join_step_thread(nodes: list[EtNode]) -> None:
    """Put the step annotation's thread together with the host thread it is.

    Operators only the Kineto trace has carry Kineto's thread id, the others the host trace's numbering, so one
    thread can show as two. The thread that runs `ProfilerStep#N` is the training loop's: when only Kineto-only
    operators are on it, they join the host thread with the most operators.
    """
    host_lanes = Counter(n.lane for n in nodes if n.lane[0] == "cpu" and not n.attrs.get("kineto_only"))
    if not host_lanes:
        return
    main = host_lanes.most_common(1)[0][0]
    step_lanes = {n.lane for n in nodes if n.lane[0] == "cpu" and n.attrs.get("kineto_only")
                  and n.name.startswith(STEP_PREFIX)} - set(host_lanes)
    for node in nodes:
        if node.lane in step_lanes:
            node.lane = main


def find_et_files(folder: Path) -> tuple[str, dict[int, Path]]:
    """The run name and rank -> .et path of the `<name>.<rank>.et` files in a folder (one run per folder)."""
    runs = et_sets(folder)
    if not runs:
        raise ReportError(f"{folder}: no <name>.<rank>.et files")
    if len(runs) > 1:
        raise ReportError(f"{folder}: .et files of several runs ({', '.join(sorted(runs))}); "
                          f"keep one run per folder")
    name = next(iter(runs))
    return name, runs[name]


def check_against_summary(et_dir: Path, name: str, et_files: dict[int, Path]) -> None:
    """ReportError when an .et is not the file the folder's CONVERSION_SUMMARY.md recorded (another run's .et copied
    in, one left from an earlier conversion, one changed since), or when a rank it records converted has no .et
    (deleted, or a folder in its place: a report of the other ranks had called it a rank whose conversion failed):
    summary.unrecorded_et_file. Ranks it records as failed are the report's missing ranks."""
    problem = unrecorded_et_file(et_dir, name, et_files, every_recorded_rank=False)
    if problem:
        raise ReportError(f"{problem[0]}: {problem[1]}")


def check_unrecorded_ranks_agree(et_dir: Path, name: str, traces: dict[int, RankTrace],
                                 et_files: dict[int, Path]) -> None:
    """ReportError when .et files no summary records (copied out of their run folder) are not the ranks of one run:
    a file that holds another rank than its name says (one rank's file copied over another's: the same collectives,
    and a report of rank 0 twice), or ranks of different runs (their collectives differ, and a report would describe
    them as one run). `et_files`: every rank of the set (traces holds the lowest of the ranks sharing a file)."""
    if records_set(et_dir, name):
        return  # check_against_summary held them to the summary
    for first, sharing in ranks_sharing_a_file(et_files).items():
        for rank in sharing:  # a scaled set's files record no rank; a rank's file linked to another's names its own
            problem = misnamed_rank(et_files[rank], rank, traces[first].meta.get("rank"))
            if problem:
                raise ReportError(problem)
    world = len(et_files)
    members: dict[str, list[int]] = {}
    collectives = {}
    for rank, trace in traces.items():
        members.update(group_members(str(trace.meta.get("process_groups", "")), world))
        collectives[rank] = [(str(n.attrs.get("pg_name", "")), COMM_TYPE_NAMES.get(n.attrs.get("comm_type"),
                                                                                  str(n.attrs.get("comm_type"))),
                              int(n.attrs.get("comm_size", 0)))
                             for n in sorted(trace.nodes, key=lambda n: (n.start, n.id)) if n.type == COMM_COLL_NODE]
    problems = collectives_agree(collectives, members)
    if problems:
        raise ReportError(f"{et_dir}: the ranks of {name} do not run the same collectives ({problems[0]}): .et files "
                          "of different runs; keep one run per folder")


def place_work_intervals(trace: RankTrace) -> None:
    """When each node did the work its .et duration stands for.

    GPU work and CPU-thread collectives are where the trace put them. A CPU operator's .et duration is its
    exclusive time (its span less the spans of the operators it called on the same thread) less the time it spent
    blocked on another thread or the GPU (`wait_micros`); the .et has no inclusive spans, so they are rebuilt per
    thread: inclusive = duration + wait + the inclusive times of the callees, each node placed at its start time,
    callees kept inside their caller and apart from each other. The blocked time is taken out of the node's
    longest stretch of own time (a caller blocked on a collective shows as one long gap). So the work intervals of
    one thread never overlap and add up to the sum of the .et durations exactly.
    """
    nodes = trace.nodes
    n = len(nodes)
    work: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    span: list[tuple[int, int]] = [(0, 0)] * n
    index_of = {node.id: i for i, node in enumerate(nodes)}
    lanes: dict[tuple, list[int]] = defaultdict(list)
    in_turn = trace.compute_scale != 1.0  # a straggler's stream kernels, longer than traced, follow one another
    stream_free: dict[tuple, int] = {}
    # in start order where kernels are placed in turn; each node where the trace put it otherwise
    placed = sorted(enumerate(nodes), key=lambda item: (item[1].start, item[1].id)) if in_turn else enumerate(nodes)
    for i, node in placed:
        if node.on_gpu or node.lane[0] == "cpu-comm":  # CPU collectives may run at once on several worker threads
            start = max(node.start, stream_free.get(node.lane, node.start)) if in_turn and node.on_gpu else node.start
            stream_free[node.lane] = start + node.dur
            work[i] = [(start, start + node.dur)] if node.dur > 0 else []
            span[i] = (start, start + node.dur)
        else:
            lanes[node.lane].append(i)
    for members in lanes.values():
        in_lane = set(members)
        children: dict[int, list[int]] = defaultdict(list)
        roots = []
        for i in members:
            p = index_of.get(nodes[i].parent, -1)
            if p in in_lane and p != i and nodes[p].start <= nodes[i].start:
                children[p].append(i)
            else:
                roots.append(i)
        key = lambda i: (nodes[i].start, nodes[i].id)  # noqa: E731
        roots.sort(key=key)
        roots = _adopt_into_step_annotations(nodes, roots, children)
        for kids in children.values():
            kids.sort(key=key)
        # pre-order, then inclusive times bottom-up (iterative: real traces nest deeply)
        order: list[int] = []
        seen: set[int] = set()
        stack = list(reversed(roots))
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            order.append(i)
            stack.extend(reversed(children.get(i, ())))
        for i in members:  # a parent cycle would leave nodes unreached: treat them as roots
            if i not in seen:
                seen.add(i)
                order.append(i)
                roots.append(i)
                children.pop(i, None)
        incl = {}
        for i in reversed(order):
            incl[i] = nodes[i].dur + nodes[i].wait + sum(incl[c] for c in children.get(i, ()) if c in incl)
        cursor = None
        roots.sort(key=key)
        for root in roots:
            start = nodes[root].start if cursor is None else max(nodes[root].start, cursor)
            cursor = start + incl[root]
            todo = [(root, start)]
            while todo:
                i, s = todo.pop()
                e = s + incl[i]
                span[i] = (s, e)
                kids = [c for c in children.get(i, ()) if c in incl]
                remaining = sum(incl[c] for c in kids)
                own: list[tuple[int, int]] = []
                at = s
                for c in kids:
                    cs = min(max(nodes[c].start, at), e - remaining)
                    if cs > at:
                        own.append((at, cs))
                    todo.append((c, cs))
                    at = cs + incl[c]
                    remaining -= incl[c]
                if e > at:
                    own.append((at, e))
                work[i] = _remove_blocked(own, nodes[i].wait)
    trace.work = work
    trace.span = span


def _adopt_into_step_annotations(nodes: list[EtNode], roots: list[int], children: dict[int, list[int]]) -> list[int]:
    """Make the outermost operators that start inside a `ProfilerStep#N` annotation its callees.

    The converter keeps no ctrl dependency from the step annotation to the operators of the step (it puts the
    annotation last on its thread), but the annotation encloses them; its own time is the time between them.
    """
    steps = [i for i in roots if nodes[i].name.startswith(STEP_PREFIX)]
    if not steps:
        return roots
    kept = []
    k = -1
    for i in roots:  # sorted by start
        while k + 1 < len(steps) and nodes[steps[k + 1]].start <= nodes[i].start:
            k += 1
        if k >= 0 and i not in steps:
            children[steps[k]].append(i)
        else:
            kept.append(i)
    for step in steps:
        children[step].sort(key=lambda i: (nodes[i].start, nodes[i].id))
    return kept


def _remove_blocked(stretches: list[tuple[int, int]], blocked: int) -> list[tuple[int, int]]:
    """Take `blocked` time out of the longest stretches (from their ends)."""
    if blocked <= 0:
        return stretches
    by_length = sorted(range(len(stretches)), key=lambda k: stretches[k][0] - stretches[k][1])
    trimmed = list(stretches)
    for k in by_length:
        if blocked <= 0:
            break
        s, e = trimmed[k]
        cut = min(blocked, e - s)
        trimmed[k] = (s, e - cut)
        blocked -= cut
    return [(s, e) for s, e in trimmed if e > s]


# ---------------------------------------------------------------------------------------------------------------
# Per-rank numbers
# ---------------------------------------------------------------------------------------------------------------
def step_breakdown(trace: RankTrace) -> dict[str, int]:
    """Where the traced step went, in µs, as unions of intervals so that overlapping work counts once.

    GPU runs: compute, communication and memory copies are the GPU work of each kind (kernels, NCCL kernels,
    memcpy/memset), over all streams; CPU runs: the CPU operators' work and the CPU-thread collectives (gloo).
    The parts add up to the traced step: compute first, then communication not hidden under compute, then memory
    copies under neither, then the profiler's cost the conversion took out of the .et durations (its metadata's
    recording_overhead_micros: the traced step still lasts as long, while its nodes no longer hold that time, so
    without it the time showed as idle, 43 of a 68 ms GPT-2 tiny step), at most what is left; idle is the rest.
    """
    lo, hi = trace.step_start, trace.step_end
    gpu_run = trace.has_gpu
    sets: dict[str, list[tuple[int, int]]] = {COMPUTE: [], COMM: [], MEMCPY: []}
    cpu: list[tuple[int, int]] = []
    outside = 0
    for i, node in enumerate(trace.nodes):
        intervals = trace.work[i]
        if not node.on_gpu:
            cpu.extend(intervals)
        if gpu_run and not node.on_gpu and node.category != COMM:
            continue
        sets[node.category].extend(intervals)
        outside += sum(max(0, e - max(s, hi)) + max(0, min(e, lo) - s) for s, e in intervals)
    compute = clip_intervals(merge_intervals(sets[COMPUTE]), lo, hi)
    comm = clip_intervals(merge_intervals(sets[COMM]), lo, hi)
    memcpy = clip_intervals(merge_intervals(sets[MEMCPY]), lo, hi)
    comm_exposed = subtract_intervals(comm, compute)
    memcpy_exposed = subtract_intervals(memcpy, merge_intervals(compute + comm))
    busy = merge_intervals(compute + comm + memcpy)
    left = max(0, trace.step_dur - total_length(busy))
    profiler = min(left, max(0, int(trace.meta.get("recording_overhead_micros", 0) or 0)))
    result = {
        "step_us": trace.step_dur,
        "compute_us": total_length(compute),
        "communication_us": total_length(comm_exposed),
        "memcpy_us": total_length(memcpy_exposed),
        "profiler_us": profiler,
        "idle_us": left - profiler,
        "communication_total_us": total_length(comm),
        "communication_overlapped_us": total_length(comm) - total_length(comm_exposed),
        "memcpy_total_us": total_length(memcpy),
        "cpu_busy_us": total_length(clip_intervals(merge_intervals(cpu), lo, hi)),
        "outside_step_us": outside,
    }
    return result


def critical_path(trace: RankTrace) -> dict[str, Any]:
    """Longest chain of .et durations through the data and ctrl dependencies (Kahn's order, linear time)."""
    nodes = trace.nodes
    index_of = {node.id: i for i, node in enumerate(nodes)}
    parents = [[index_of[dep] for dep in node.deps if dep in index_of] for node in nodes]
    dangling = sum(len(node.deps) for node in nodes) - sum(map(len, parents))
    order = topological_order(parents)
    visited = len(order)
    result: dict[str, Any] = {"dangling_deps": dangling, "unreached_nodes": len(nodes) - visited}
    if visited < len(nodes):
        result.update(critical_path_us=None, problem=f"{len(nodes) - visited} nodes sit on a dependency cycle")
        return result
    durations = [node.dur for node in nodes]
    serve_in_turn(sorted((node.start, str(node.attrs.get("pg_name", "")), i) for i, node in enumerate(nodes)
                         if node.type == COMM_COLL_NODE), durations)
    finish, best_pred = longest_path(parents, durations, order)
    end = max(range(len(nodes)), key=lambda i: finish[i])
    path = []
    i = end
    while i >= 0:
        path.append(i)
        i = best_pred[i]
    by_category: dict[str, int] = defaultdict(int)
    for i in path:
        side = "gpu" if nodes[i].on_gpu else "cpu"
        by_category[f"{side}_{nodes[i].category}"] += durations[i]
    cp = finish[end]
    step = trace.step_dur
    result.update(critical_path_us=cp, step_us=step, gap_us=step - cp, ratio=cp / step if step else None,
                  path_nodes=len(path), path_by_kind_us=dict(sorted(by_category.items())),
                  path_end=nodes[end].name)
    return result


def operator_table(trace: RankTrace) -> tuple[dict[str, dict], dict[str, dict]]:
    """CPU operators and GPU kernels by name: calls and summed .et durations (exclusive time for CPU operators)."""
    ops: dict[str, dict] = {}
    kernels: dict[str, dict] = {}
    for node in trace.nodes:
        if node.on_gpu:
            entry = kernels.setdefault(node.name, {"count": 0, "total_us": 0, "category": node.category})
            entry["count"] += 1
            entry["total_us"] += node.dur
        elif node.category != COMM:
            entry = ops.setdefault(node.name, {"count": 0, "exclusive_us": 0, "blocked_us": 0})
            entry["count"] += 1
            entry["exclusive_us"] += node.dur
            entry["blocked_us"] += node.wait
    return ops, kernels


def collective_list(trace: RankTrace) -> list[dict]:
    """Every communication node in start order: type, size, duration, process group, peers."""
    out = []
    for node in sorted((n for n in trace.nodes if n.category == COMM), key=lambda n: (n.start, n.id)):
        a = node.attrs
        if node.type == COMM_COLL_NODE:
            comm_type = COMM_TYPE_NAMES.get(a.get("comm_type"), str(a.get("comm_type")))
        else:
            comm_type = COMM_NODE_NAMES[node.type].replace("COMM_", "")
        entry = {"id": node.id, "name": node.name, "node_type": COMM_NODE_NAMES[node.type], "comm_type": comm_type,
                 "size_bytes": int(a.get("comm_size", 0)), "duration_us": node.dur,
                 "start_offset_us": node.start - trace.step_start, "pg_name": str(a.get("pg_name", "")),
                 "on_gpu": node.on_gpu}
        for key in ("comm_src", "comm_dst"):
            if key in a:
                entry[key] = int(a[key])
        out.append(entry)
    return out


def bytes_by_process_group(collectives: list[dict]) -> dict[str, dict]:
    groups: dict[str, dict] = {}
    for c in collectives:
        entry = groups.setdefault(c["pg_name"], {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += c["size_bytes"]
    return dict(sorted(groups.items()))


def rank_summary(trace: RankTrace) -> dict[str, Any]:
    ops, kernels = operator_table(trace)
    collectives = collective_list(trace)
    return {
        "et_file": trace.path.name,
        "step_name": trace.step_name,
        "step_start_us": trace.step_start,
        "step_us": trace.step_dur,
        "traced_step_us": trace.traced_step_dur,
        "compute_scale": trace.compute_scale,
        "step_from_metadata": trace.step_from_metadata,
        "host_trace_repaired": str(trace.meta.get("host_trace_repaired", "")),
        "nodes": len(trace.nodes),
        "gpu_nodes": sum(1 for n in trace.nodes if n.on_gpu),
        "lanes": sorted({"/".join(str(x) for x in n.lane) for n in trace.nodes}),
        "breakdown": step_breakdown(trace),
        "critical_path": critical_path(trace),
        "operators": ops,
        "kernels": kernels,
        "collectives": collectives,
        "bytes_by_process_group": bytes_by_process_group(collectives),
    }


def top_entries(per_rank: dict[int, dict[str, dict]], key: str, n: int = TOP_N) -> list[dict]:
    """The n names with the largest summed `key` over all ranks, with calls and the per-rank mean."""
    totals: dict[str, dict] = {}
    for table in per_rank.values():
        for name, entry in table.items():
            t = totals.setdefault(name, {"name": name, "count": 0, key: 0, "ranks": 0})
            t["count"] += entry["count"]
            t[key] += entry[key]
            t["ranks"] += 1
            if "category" in entry:
                t["category"] = entry["category"]
    ranked = sorted(totals.values(), key=lambda t: (-t[key], t["name"]))[:n]
    for t in ranked:
        t["per_rank_mean_us"] = t[key] / len(per_rank) if per_rank else 0
    return ranked


# ---------------------------------------------------------------------------------------------------------------
# HolisticTraceAnalysis (optional; run in a child process: it reconfigures logging and may crash or hang)
# ---------------------------------------------------------------------------------------------------------------
def hta_available() -> bool:
    return importlib.util.find_spec("hta") is not None


def run_hta(device_traces: dict[int, Path], windows: dict[int, tuple[int, int]],
            timeout_s: int = HTA_TIMEOUT_S) -> dict[str, Any]:
    """HTA's temporal breakdown, communication/computation overlap and kernel breakdown on the traced step of
    each rank's device trace. Never raises: {'status': 'ok'|'partial'|'failed'|'unavailable', 'reason': ...}."""
    if not hta_available():
        return {"status": "unavailable", "reason": "HolisticTraceAnalysis is not installed in this environment"}
    with tempfile.TemporaryDirectory(prefix="hta_") as work:
        spec = {"ranks": {str(r): {"path": str(p), "start": windows[r][0], "end": windows[r][1]}
                          for r, p in sorted(device_traces.items())}, "work_dir": work}
        spec_path = Path(work) / "spec.json"
        out_path = Path(work) / "result.json"
        spec_path.write_bytes(orjson.dumps(spec))
        package_root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            done = subprocess.run([sys.executable, "-m", "trace_tools.report", "--hta-worker", str(spec_path),
                                   str(out_path)], capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            return {"status": "failed", "reason": f"HTA did not finish within {timeout_s} s"}
        if out_path.is_file():
            return orjson.loads(out_path.read_bytes())
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": "failed", "reason": f"HTA worker exited with code {done.returncode}: {last[:300]}"}


def trim_device_trace(path: Path, rank: int, start: int, end: int, out: Path) -> int:
    """Write the Kineto trace cut to the traced step (events overlapping [start, end], all metadata events), with
    `distributedInfo.rank` set, which HTA needs to tell ranks apart. Returns the number of events kept."""
    doc = orjson.loads(read_trace_bytes(path))
    events = doc.get("traceEvents") or []
    kept = []
    for event in events:
        if not isinstance(event, dict):
            continue
        ph = event.get("ph")
        ts = event.get("ts")
        if ph == "M" or not isinstance(ts, (int, float)):
            kept.append(event)
            continue
        dur = event.get("dur", 0) if isinstance(event.get("dur", 0), (int, float)) else 0
        if ts <= end and ts + dur >= start:
            kept.append(event)
    doc["traceEvents"] = kept
    info = dict(doc.get("distributedInfo") or {})
    info["rank"] = rank
    doc["distributedInfo"] = info
    out.write_bytes(orjson.dumps(doc))
    return len(kept)


def _records(frame) -> list[dict]:
    rows = []
    for row in frame.to_dict("records"):
        clean = {}
        for k, v in row.items():
            if hasattr(v, "item"):
                v = v.item()
            if isinstance(v, float) and math.isnan(v):
                v = None
            clean[str(k)] = v
        rows.append(clean)
    return rows


def _hta_worker(spec_path: str, out_path: str) -> int:
    """Child-process side of run_hta: writes the result JSON (also when HTA fails)."""
    spec = orjson.loads(Path(spec_path).read_bytes())
    result: dict[str, Any] = {}
    try:
        from importlib.metadata import version

        from hta.trace_analysis import TraceAnalysis
        result["hta_version"] = version("HolisticTraceAnalysis")
        result["pandas_version"] = version("pandas")
    except Exception as e:
        result.update(status="unavailable",
                      reason=f"HolisticTraceAnalysis cannot be imported ({type(e).__name__}: {e})")
        Path(out_path).write_bytes(orjson.dumps(result))
        return 0
    logging.getLogger("hta").setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)
    trace_dir = Path(spec["work_dir"]) / "traces"
    trace_dir.mkdir()
    try:
        files = {}
        for rank, info in spec["ranks"].items():
            files[int(rank)] = str(trace_dir / f"rank{rank}.json")
            trim_device_trace(Path(info["path"]), int(rank), info["start"], info["end"], Path(files[int(rank)]))
        # ranks named explicitly: HTA's own search reads them from the text with a regex that compact JSON defeats
        analysis = TraceAnalysis(trace_files=files, trace_dir=str(trace_dir))
        logging.getLogger("hta").setLevel(logging.ERROR)
    except Exception as e:
        result.update(status="failed", reason=f"HTA could not load the device traces ({type(e).__name__}: {e})")
        Path(out_path).write_bytes(orjson.dumps(result))
        return 0
    errors = {}
    calls = {
        "temporal_breakdown": lambda: [analysis.get_temporal_breakdown(visualize=False)],
        "comm_comp_overlap": lambda: [analysis.get_comm_comp_overlap(visualize=False)],
        "kernel_breakdown": lambda: list(analysis.get_gpu_kernel_breakdown(visualize=False)),
    }
    for key, call in calls.items():
        try:
            frames = call()
            result[key] = _records(frames[0])
            if key == "kernel_breakdown" and len(frames) > 1:
                result["kernels"] = _records(frames[1])
        except Exception as e:
            errors[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    result["errors"] = errors
    if not errors:
        result["status"] = "ok"
    elif len(errors) < len(calls):
        result["status"] = "partial"
        result["reason"] = "; ".join(f"{k}: {v}" for k, v in errors.items())
    else:
        result["status"] = "failed"
        result["reason"] = "; ".join(f"{k}: {v}" for k, v in errors.items())
    Path(out_path).write_bytes(orjson.dumps(result))
    return 0


def find_device_traces(et_dir: Path, name: str, ranks: list[int],
                       trace_dirs: list[Path]) -> tuple[dict[int, Path], str]:
    """Device traces of the run: beside the .et files, else in the given trace folders (a run folder, or a folder of
    run folders with the run's name). Returns rank -> path and where they were found (empty when nowhere)."""
    candidates = [et_dir]
    for d in trace_dirs:
        candidates.extend([d / name, d])
    for folder in candidates:
        if not folder.is_dir():
            continue
        runs = [r for r in find_runs([folder]) if r.folder.resolve() == folder.resolve() and r.devices]
        if not runs:
            continue
        named = [r for r in runs if r.name == name]
        run = named[0] if named else (runs[0] if len(runs) == 1 else None)
        if run is None:
            continue
        found = {r: p for r, p in run.devices.items() if r in ranks}
        if found:
            return found, str(folder)
    return {}, ""


def changed_device_trace(et_dir: Path, name: str, devices: dict[int, Path]) -> str | None:
    """Why HTA may not read these device traces: one is not the file its rank's .et was made from (the run traced
    again and not converted since), so HTA, which cuts it to the .et's step, would describe another run. Compared by
    size, which CONVERSION_SUMMARY.md records with the name (a copy keeps the size, not the modification time); a
    trace compressed or uncompressed since has another name and is not compared."""
    recorded = {rank: r for rank, r in (read_previous_results(et_dir) or {}).items() if r.run == name}
    for rank, path in sorted(devices.items()):
        expected = (recorded[rank].inputs or {}).get("device") if rank in recorded else None
        if not expected or expected.get("name") != path.name:
            continue
        size = path.stat().st_size
        if size != expected.get("size"):
            return (f"{path}: not the device trace rank {rank}'s .et was made from ({et_dir / CONVERSION_SUMMARY} "
                    f"records {expected.get('size'):,} bytes, it has {size:,}); {reconvert_command(et_dir)} converts "
                    f"the run again")
    return None


# ---------------------------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------------------------
def _save(fig: Figure, path: Path) -> None:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)


def plot_breakdown(ranks: dict[int, dict], gpu_run: bool, path: Path) -> None:
    fig = Figure(figsize=(max(7.5, 3.5 + 0.7 * len(ranks)), 4.5), layout="constrained")
    ax = fig.add_subplot()
    xs = list(range(len(ranks)))
    bottom = [0.0] * len(ranks)
    parts = [("compute_us", COMPUTE, "compute"), ("communication_us", COMM, "communication (not under compute)"),
             ("memcpy_us", MEMCPY, "memory copies (exposed)"),
             ("profiler_us", "profiler", "profiler's cost (not in the .et)"), ("idle_us", "idle", "idle")]
    for key, color, label in parts:
        values = [ranks[r]["breakdown"][key] / 1000 for r in sorted(ranks)]
        ax.bar(xs, values, bottom=bottom, color=COLORS[color], label=label, width=0.6)
        bottom = [b + v for b, v in zip(bottom, values)]
    cps = [ranks[r]["critical_path"].get("critical_path_us") for r in sorted(ranks)]
    if any(c is not None for c in cps):
        ax.scatter([x for x, c in zip(xs, cps) if c is not None], [c / 1000 for c in cps if c is not None],
                   marker="D", color="black", zorder=3, label="critical path of the .et")
    ax.set_xticks(xs, [str(r) for r in sorted(ranks)])
    ax.set_xlabel("rank")
    ax.set_ylabel("ms")
    basis = "GPU work (all streams)" if gpu_run else "CPU operators and CPU-thread collectives"
    ax.set_title(f"Traced step per rank\n({basis})", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    _save(fig, path)


def _lane_label(lane: tuple, kineto_only: bool = False) -> str:
    if lane[0] == "gpu":
        return f"GPU {lane[1]} stream {lane[2]}"
    if lane[0] == "cpu-comm":
        return "CPU collectives"
    # operators only the Kineto trace has carry Kineto's thread id, the others the host trace's
    return f"CPU thread {lane[1]}" + (" (Kineto id)" if kineto_only else "")


def plot_timeline(trace: RankTrace, path: Path) -> None:
    """Lanes for CPU threads, CPU collectives and GPU streams; bars where each node did its work."""
    kind_order = {"cpu": 0, "cpu-comm": 1, "gpu": 2}
    lanes = sorted({n.lane for n in trace.nodes}, key=lambda lane: (kind_order[lane[0]],) + lane[1:])
    row = {lane: k for k, lane in enumerate(lanes)}
    t0 = trace.step_start
    bars: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)
    spans: dict[int, list[tuple[int, int]]] = defaultdict(list)
    end = trace.step_end
    index_of = {n.id: i for i, n in enumerate(trace.nodes)}
    for i, node in enumerate(trace.nodes):
        r = row[node.lane]
        bars[(r, node.category)].extend(trace.work[i])
        if trace.work[i]:
            end = max(end, trace.work[i][-1][1])
        if node.lane[0] == "cpu":
            p = index_of.get(node.parent, -1)
            if p < 0 or trace.nodes[p].lane != node.lane:  # outermost operators: the thread is inside them
                spans[r].append(trace.span[i])
    # Thousands of back-to-back operators: draw their union, with gaps narrower than a pixel closed; and never
    # narrower than a pixel, so that a 1 µs memcpy still shows.
    pixel = max(1, (end - t0) // 1500)

    def as_bars(intervals):
        return [((s - t0) / 1000, max(e - s, pixel) / 1000)
                for s, e in _close_gaps(merge_intervals(intervals), pixel)]

    fig = Figure(figsize=(14, max(2.4, 0.5 * len(lanes) + 1.4)), layout="constrained")
    ax = fig.add_subplot()
    for r, items in spans.items():
        ax.broken_barh(as_bars(items), (r - 0.4, 0.8), facecolors=COLORS["span"], linewidth=0)
    for (r, category), items in bars.items():
        if category == COMM:  # each collective on its own, outlined
            ax.broken_barh([((s - t0) / 1000, max(e - s, pixel) / 1000) for s, e in items], (r - 0.35, 0.7),
                           facecolors=COLORS[COMM], edgecolor="black", linewidth=0.5)
        else:
            ax.broken_barh(as_bars(items), (r - 0.35, 0.7), facecolors=COLORS[category], linewidth=0)
    ax.axvline(trace.step_dur / 1000, color="black", linestyle="--", linewidth=0.8)
    kineto_lanes = {n.lane for n in trace.nodes if n.attrs.get("kineto_only")}
    kineto_lanes -= {n.lane for n in trace.nodes if not n.attrs.get("kineto_only")}
    ax.set_yticks(range(len(lanes)), [_lane_label(lane, lane in kineto_lanes) for lane in lanes])
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlim(0, max(end - t0, 1) / 1000)
    ax.set_xlabel(f"ms since the start of {trace.step_name or 'the traced window'}")
    ax.set_title(f"Rank {trace.rank}: one traced step ({trace.step_dur / 1000:.2f} ms; dashed line = step end)")
    handles = [Patch(color=COLORS[COMPUTE], label="compute"), Patch(color=COLORS[COMM], label="collective / p2p"),
               Patch(color=COLORS[MEMCPY], label="memcpy / memset"),
               Patch(color=COLORS["span"], label="inside an operator, not working (blocked or between calls)")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    _save(fig, path)


def _close_gaps(merged: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for s, e in merged:
        if out and s - out[-1][1] < gap:
            out[-1][1] = e
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _short(name: str, width: int = 60) -> str:
    """A kernel's name without its argument list and leading `void`, cut to `width`."""
    if name.endswith(")"):
        depth = 0
        for k in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[k], 0)
            if depth == 0:
                if k > 0 and name[k - 1] != " ":  # `Memcpy HtoD (Pageable -> Device)` keeps its brackets
                    name = name[:k]
                break
    name = name.removeprefix("void ")
    return name if len(name) <= width else name[:width - 1] + "…"


def plot_top(top_ops: list[dict], top_kernels: list[dict], path: Path) -> None:
    panels = [("CPU operators: exclusive time, mean per rank", top_ops, "exclusive_us")]
    if top_kernels:
        panels.append(("GPU kernels: time, mean per rank", top_kernels, "total_us"))
    fig = Figure(figsize=(14 if len(panels) == 2 else 8, 6.5), layout="constrained")
    for k, (title, entries, key) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), k + 1)
        names = [f"{_short(e['name'], 45)} ({e['count']})" for e in entries][::-1]
        values = [e["per_rank_mean_us"] / 1000 for e in entries][::-1]
        colors = [COLORS.get(e.get("category", COMPUTE), COLORS[COMPUTE]) for e in entries][::-1]
        ax.barh(range(len(values)), values, color=colors)
        ax.set_yticks(range(len(values)), names, fontsize=7)
        ax.set_xlabel("ms per rank (calls over all ranks in brackets)")
        ax.set_title(title, fontsize=10)
    _save(fig, path)


def plot_collectives(ranks: dict[int, dict], path: Path) -> None:
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for r in sorted(ranks):
        durations = [c["duration_us"] / 1000 for c in ranks[r]["collectives"]]
        ax.plot(range(1, len(durations) + 1), durations, marker="o", markersize=3, linewidth=0.8, label=f"rank {r}")
    ax.set_xlabel("collective / p2p operation, in start order")
    ax.set_ylabel("duration (ms)")
    ax.set_title("Duration of each communication operation per rank")
    ax.legend(fontsize=8, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _save(fig, path)


# ---------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------
def _ms(us: float | None) -> str:
    return "n/a" if us is None else f"{us / 1000:.3f}"


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def build_report(et_dir: Path, trace_dirs: list[Path] | None = None, use_hta: bool = True) -> tuple[dict, list]:
    """Everything the report says, as a dict for report.json, plus the traces (for the figures)."""
    name, et_files = find_et_files(et_dir)
    check_against_summary(et_dir, name, et_files)
    sharing = ranks_sharing_a_file(et_files)
    traces = {rank: load_rank(et_files[rank], rank) for rank in sorted(sharing)}
    check_unrecorded_ranks_agree(et_dir, name, traces, et_files)
    world = max((int(t.meta["world_size"]) for t in traces.values() if "world_size" in t.meta), default=0)
    expected = set(range(max(world, max(et_files) + 1)))
    per_rank = {rank: rank_summary(t) for rank, t in traces.items()}
    gpu_run = any(t.has_gpu for t in traces.values())
    first = next(iter(traces.values()))
    report: dict[str, Any] = {
        "run": name,
        "folder": str(et_dir),
        "kind": "gpu" if gpu_run else "cpu",
        "ranks": sorted(et_files),
        "missing_ranks": sorted(expected - set(et_files)),
        # of those, the ranks CONVERSION_SUMMARY.md records as failed (the others no conversion here records)
        "failed_ranks": sorted(r for r, result in recorded_ranks(et_dir, name).items()
                               if not result.ok and r not in et_files),
        # ranks whose .et is one file (a scaled set's hard links): reported once, under the lowest of them
        "shared_files": {str(first): members for first, members in sharing.items() if len(members) > 1},
        "world_size": world or None,
        "backend": first.meta.get("backend"),
        "converter": first.meta.get("converter"),
        "per_rank": {str(r): s for r, s in per_rank.items()},
        "top_operators": top_entries({r: s["operators"] for r, s in per_rank.items()}, "exclusive_us"),
        "top_kernels": top_entries({r: s["kernels"] for r, s in per_rank.items()}, "total_us") if gpu_run else [],
    }
    if not gpu_run:
        report["hta"] = {"status": "not_applicable",
                         "reason": "no GPU work in these traces; HTA's analyses are about GPU kernels"}
    elif not use_hta:
        report["hta"] = {"status": "skipped", "reason": "HTA not run (--no-hta)"}
    else:
        devices, where = find_device_traces(et_dir, name, sorted(traces), trace_dirs or [])
        if not devices:
            report["hta"] = {"status": "failed",
                             "reason": f"no device traces (device.<rank>.json) beside {et_dir} or in the given "
                                       f"trace folders; HTA reads the Kineto traces, not the .et"}
        elif changed := changed_device_trace(et_dir, name, devices):
            report["hta"] = {"status": "skipped", "reason": changed}
        else:
            windows = {r: (traces[r].step_start, traces[r].step_end) for r in devices}
            report["hta"] = run_hta(devices, windows)
            report["hta"]["device_traces"] = where
            report["hta"]["ranks"] = sorted(devices)
    return report, traces


def _rank_list(ranks: list[int]) -> str:
    if len(ranks) <= 6:
        return ", ".join(map(str, ranks))
    return f"{', '.join(map(str, ranks[:3]))}, ..., {ranks[-1]}"


def _why_missing(missing: list[int], failed: list[int]) -> str:
    """Why ranks have no .et, as far as CONVERSION_SUMMARY.md says: their conversion failed, or none is recorded (a
    set copied out of its folder, a rank never traced). A rank it records converted never gets here: its .et was
    removed since, and check_against_summary refuses the folder."""
    failed = [r for r in missing if r in failed]
    unrecorded = [r for r in missing if r not in failed]
    if not unrecorded:
        return "see CONVERSION_SUMMARY.md for why they failed"
    if not failed:
        return "no conversion of theirs is recorded here"
    return (f"see CONVERSION_SUMMARY.md for why rank(s) {', '.join(map(str, failed))} failed; no conversion of "
            f"rank(s) {', '.join(map(str, unrecorded))} is recorded here")


def _intro_lines(report: dict, ranks: dict[int, dict], gpu_run: bool) -> list[str]:
    """The run, its missing or repaired ranks, and what counts as what."""
    lines = [f"# Trace report: {report['run']}", ""]
    step_names = sorted({s["step_name"] for s in ranks.values() if s["step_name"]})
    lines.append(f"{len(report['ranks'])} rank(s) ({'GPU' if gpu_run else 'CPU'} run"
                 + (f", backend {report['backend']}" if report.get("backend") else "")
                 + (f", world size {report['world_size']}" if report.get("world_size") else "")
                 + f"), traced step {', '.join(step_names) or 'not annotated (the span of the traced operators)'}; "
                   f"from the `.et` files in `{report['folder']}`"
                 + (f" (written by {report['converter']})." if report.get("converter") else "."))
    if report.get("shared_files"):
        lines += ["", f"**Ranks sharing a file:** the {len(report['ranks'])} ranks are {len(ranks)} distinct `.et` "
                      "files (ranks that replay one traced rank share its file, as scale_et.py writes them), each "
                      "reported once, under its lowest rank; the totals over ranks below count each file once:"]
        lines += [f"- rank {first} stands for ranks {_rank_list(members)} ({len(members)} ranks)"
                  for first, members in sorted((int(f), m) for f, m in report["shared_files"].items())]
    stragglers = {r: s for r, s in sorted(ranks.items()) if s.get("compute_scale", 1.0) != 1.0}
    if stragglers:
        lines += ["", "**Stragglers:** these files have their compute durations scaled against the traced ones "
                      "(scale_et.py --slow); no step was measured at that pace, so their step here ends where their "
                      "work ends, never before the traced step:"]
        lines += [f"- rank {r}: compute x{s['compute_scale']:g}, step {_ms(s['step_us'])} ms (traced "
                  f"{_ms(s['traced_step_us'])} ms)" for r, s in stragglers.items()]
    if report["missing_ranks"]:
        lines += ["", f"**Missing ranks:** no `.et` for rank(s) {', '.join(map(str, report['missing_ranks']))} "
                      f"({_why_missing(report['missing_ranks'], report.get('failed_ranks', []))})."]
    repaired = {r: s["host_trace_repaired"] for r, s in sorted(ranks.items()) if s.get("host_trace_repaired")}
    if repaired:
        lines += ["", "**Repaired host traces:** what fix_host_traces.py dropped is not in the `.et`, so these ranks "
                      "hold less than was traced:"] + [f"- rank {r}: {text}" for r, text in repaired.items()]
    if any(not s["step_from_metadata"] for s in ranks.values()):
        lines += ["", "Some `.et` files carry no traced step in their metadata: the span of their nodes stands for "
                      "the step there."]
    lines += ["", "## What counts as what", ""]
    if gpu_run:
        lines += ["- The step breakdown is about the GPU (all streams of the rank's device): **compute** = time when "
                  "a computation kernel ran, **communication** = NCCL kernels (COMM nodes) not overlapped by compute, "
                  "**memory copies** = memcpy/memset not overlapped by either, **profiler** = " + _PROFILER_PART
                  + ", **idle** = the rest of the step. "
                  "Unions of intervals, so work on several streams at once counts once. **CPU busy** is the union of "
                  "the CPU operators' work on all host threads, for comparison."]
    else:
        lines += ["- The step breakdown is about the CPU: **compute** = the work of the CPU operators (each node's "
                  ".et duration: its exclusive time less the time it was blocked on another thread), "
                  "**communication** = the CPU-thread collectives (gloo) when no operator worked at the same time, "
                  "**memory copies** = none on a CPU run (tensor copies are operators, so compute), **profiler** = "
                  + _PROFILER_PART + ", **idle** = the rest of the step. Unions of intervals, so threads working at "
                  "once count once.",
                  f"- Annotations (`{STEP_PREFIX}N`, `DistributedDataParallel.forward`, `Optimizer.step`...) are "
                  "nodes too: their own time is Python and framework work between operators, which the .et gives a "
                  "simulator as compute, so it counts as compute here; the operator table shows how much it is."]
    lines += ["- A CPU node's place on its thread is rebuilt from its start time, its .et duration, its blocked time "
              "(`wait_micros`) and its callees, since the .et holds exclusive durations only.",
              "- Every number is computed from the `.et` nodes (report.json has them all, per rank); the HTA section "
              "reads the Kineto device traces instead, cut to the same step.", ""]
    return lines


_PROFILER_PART = ("the profiler's cost the conversion took out of the `.et` durations (CONVERSION_SUMMARY.md), which the "
                  "traced step still holds; the step less it is the untraced step the `.et` estimates")


def _breakdown_lines(ranks: dict[int, dict], gpu_run: bool) -> list[str]:
    """Step time per rank: compute, communication, memory copies, the profiler's cost removed, idle."""
    lines = ["## Step time per rank", "", f"![step breakdown]({FIGURE_BREAKDOWN})", ""]
    header = "| rank | step (ms) | compute (ms) | communication (ms) | memory copies (ms) | profiler (ms) | idle (ms) | " \
             "comm. total (ms) | comm. under compute | "
    header += "CPU busy (ms) |" if gpu_run else ""
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    for r, s in sorted(ranks.items()):
        b = s["breakdown"]
        row = (f"| {r} | {_ms(b['step_us'])} | {_ms(b['compute_us'])} | {_ms(b['communication_us'])} | "
               f"{_ms(b['memcpy_us'])} | {_ms(b['profiler_us'])} | {_ms(b['idle_us'])} | "
               f"{_ms(b['communication_total_us'])} | "
               f"{_pct(b['communication_overlapped_us'], b['communication_total_us'])} |")
        if gpu_run:
            row += f" {_ms(b['cpu_busy_us'])} |"
        lines.append(row)
    outside = {r: s["breakdown"]["outside_step_us"] for r, s in ranks.items() if s["breakdown"]["outside_step_us"]}
    if outside:
        lines += ["", "Work outside the step window (launched inside it, ran before or after it; not in the "
                      "breakdown): " + ", ".join(f"rank {r}: {_ms(us)} ms" for r, us in sorted(outside.items())) + "."]
    return lines


def _critical_path_lines(ranks: dict[int, dict]) -> list[str]:
    """The critical path of each .et beside the traced step."""
    lines = ["", "## Critical path of each .et", "",
              "Longest chain of node durations (collectives at their traced durations, one after another in a "
              "process group as the .et runs them) through the data and "
              "control dependencies: the time a simulator replaying the .et as traced would take. Beside it the "
              "traced step time; a path longer than the step means the .et serialises work that overlapped, a "
              "much shorter one that it lost waits.", "",
              "| rank | critical path (ms) | traced step (ms) | gap (ms) | path / step | nodes on path "
              "| path made of |",
              "|---|---|---|---|---|---|---|"]
    for r, s in sorted(ranks.items()):
        cp = s["critical_path"]
        if cp.get("critical_path_us") is None:
            lines.append(f"| {r} | n/a | {_ms(s['step_us'])} | n/a | n/a | n/a | {cp.get('problem', '')} |")
            continue
        made_of = ", ".join(f"{k.replace('_', ' ')} {_ms(v)} ms" for k, v in cp["path_by_kind_us"].items() if v)
        ratio = f"{cp['ratio']:.3f}" if cp.get("ratio") is not None else "n/a"
        lines.append(f"| {r} | {_ms(cp['critical_path_us'])} | {_ms(s['step_us'])} | {_ms(cp['gap_us'])} | "
                     f"{ratio} | {cp['path_nodes']} | {made_of} |")
    problems = [(r, s["critical_path"]) for r, s in sorted(ranks.items())
                if s["critical_path"]["dangling_deps"] or s["critical_path"]["unreached_nodes"]]
    for r, cp in problems:
        lines.append(f"\nRank {r}: {cp['dangling_deps']} dependencies name missing nodes, "
                     f"{cp['unreached_nodes']} nodes unreachable.")
    return lines


def _top_lines(report: dict, ranks: dict[int, dict], gpu_run: bool) -> list[str]:
    """The operators (and GPU kernels) with the most time."""
    lines = ["## Top operators", "", f"![top operators]({FIGURE_TOP})", "",
              f"The {TOP_N} CPU operators with the most exclusive time (.et duration), summed over all ranks.", "",
              "| operator | calls | exclusive (ms, all ranks) | mean per rank (ms) | blocked (ms, all ranks) |",
              "|---|---|---|---|---|"]
    for e in report["top_operators"]:
        lines.append(f"| `{_cell(_short(e['name'], 80))}` | {e['count']} | {_ms(e['exclusive_us'])} | "
                     f"{_ms(e['per_rank_mean_us'])} | {_ms(_blocked(ranks, e['name']))} |")
    if gpu_run:
        lines += ["", f"The {TOP_N} GPU kernels (and memcpy/memset) with the most time, summed over all ranks.", "",
                  "| kernel | kind | calls | time (ms, all ranks) | mean per rank (ms) |", "|---|---|---|---|---|"]
        for e in report["top_kernels"]:
            lines.append(f"| `{_cell(_short(e['name'], 80))}` | {e.get('category', '')} | {e['count']} | "
                         f"{_ms(e['total_us'])} | {_ms(e['per_rank_mean_us'])} |")
    return lines


def _communication_lines(ranks: dict[int, dict]) -> list[str]:
    """Bytes per process group and every collective per rank."""
    lines = ["", "## Communication", ""]
    any_comm = any(s["collectives"] for s in ranks.values())
    if not any_comm:
        lines += ["No communication nodes in these `.et` files (a single-rank run, or no collectives traced)."]
    else:
        groups = sorted({pg for s in ranks.values() for pg in s["bytes_by_process_group"]})
        lines += ["Bytes per process group (sum of `comm_size` over its collectives and p2p operations):", "",
                  "| process group | " + " | ".join(f"rank {r}" for r in sorted(ranks)) + " |",
                  "|---|" + "---|" * len(ranks)]
        for pg in groups:
            cells = []
            for r in sorted(ranks):
                g = ranks[r]["bytes_by_process_group"].get(pg)
                cells.append(f"{g['bytes']} B ({format_bytes(g['bytes'])}) in {g['count']}" if g else "-")
            lines.append(f"| {pg or '(unnamed)'} | " + " | ".join(cells) + " |")
        lines += ["", f"![collectives]({FIGURE_COMM})", "",
                  "Each operation in start order: type, size and duration per rank (the same k-th operation of the "
                  "process group on every rank).", ""]
        lines += _collective_rows(ranks)
    return lines


def render_markdown(report: dict, figures: dict[str, Any]) -> str:
    """report.md: the run, then one section per question (step breakdown, critical path, timelines, top
    operators, communication, HTA)."""
    ranks = {int(r): s for r, s in report["per_rank"].items()}
    gpu_run = report["kind"] == "gpu"
    lines = _intro_lines(report, ranks, gpu_run) + _breakdown_lines(ranks, gpu_run) + _critical_path_lines(ranks)
    lines += ["", "## Timeline of the traced step", "",
              "Lanes: CPU threads (by the thread id in the .et), the CPU-thread collectives, GPU streams. Coloured: "
              "where a node did its work; grey: the thread was inside an operator but not working in it (blocked "
              "on another thread or the GPU, or between callees); red with a black edge: collectives.", ""]
    for r in sorted(ranks):
        lines += [f"![timeline rank {r}]({FIGURE_TIMELINE.format(rank=r)})", ""]
    lines += _top_lines(report, ranks, gpu_run) + _communication_lines(ranks)
    lines += ["", "## HolisticTraceAnalysis", ""]
    lines += _hta_section(report, ranks)
    if figures.get("errors"):
        lines += ["", "## Figures that could not be drawn", ""] + [f"- {e}" for e in figures["errors"]]
    return "\n".join(lines) + "\n"


def _blocked(ranks: dict[int, dict], name: str) -> int:
    return sum(s["operators"].get(name, {}).get("blocked_us", 0) for s in ranks.values())


def _collective_rows(ranks: dict[int, dict]) -> list[str]:
    order = sorted(ranks)
    by_group: dict[int, dict[str, list[dict]]] = {}
    for r in order:
        groups: dict[str, list[dict]] = defaultdict(list)
        for c in ranks[r]["collectives"]:
            groups[c["pg_name"]].append(c)
        by_group[r] = groups
    lines = ["| # | process group | type | size | " + " | ".join(f"rank {r} (ms)" for r in order) + " |",
             "|---|---|---|---|" + "---|" * len(order)]
    rows = 0
    total = 0
    for pg in sorted({pg for g in by_group.values() for pg in g}):
        count = max(len(by_group[r].get(pg, [])) for r in order)
        for k in range(count):
            total += 1
            if rows >= MAX_COLLECTIVE_ROWS:
                continue
            entries = [by_group[r].get(pg, [])[k] if k < len(by_group[r].get(pg, [])) else None for r in order]
            present = [e for e in entries if e]
            types = sorted({e["comm_type"] for e in present})
            sizes = sorted({e["size_bytes"] for e in present})
            size = f"{sizes[0]} B" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]} B (varies)"
            lines.append(f"| {k + 1} | {pg or '(unnamed)'} | {'/'.join(types)} | {size} | "
                         + " | ".join(_ms(e["duration_us"]) if e else "-" for e in entries) + " |")
            rows += 1
    if total > rows:
        lines += ["", f"({total - rows} more operations in report.json.)"]
    return lines


def _hta_section(report: dict, ranks: dict[int, dict]) -> list[str]:
    hta = report["hta"]
    status = hta["status"]
    if status == "not_applicable":
        return [f"Not used: {hta['reason']}."]
    if status in ("unavailable", "skipped"):
        return [f"Not used: {hta['reason']}. The numbers above are our own, from the `.et` nodes."]
    if status == "failed":
        return [f"HTA failed, so the numbers above are our own, from the `.et` nodes. Reason: {hta['reason']}."]
    lines = [f"HolisticTraceAnalysis {hta.get('hta_version', '')} (pandas {hta.get('pandas_version', '')}) ran on the "
             f"Kineto device traces in `{hta.get('device_traces', '')}`, each cut to the rank's traced step. It "
             f"reads the device trace, not the .et, so it is an independent check: it also counts kernels that "
             f"ran in the step but were launched before it, which the .et leaves out (they belong to the step "
             f"before)."]
    if status == "partial":
        lines.append(f"Some of its analyses failed, and for those the numbers above (our own) stand alone: "
                     f"{hta['reason']}.")
    temporal = {int(row["rank"]): row for row in hta.get("temporal_breakdown", [])}
    overlap = {int(row["rank"]): row for row in hta.get("comm_comp_overlap", [])}
    if temporal:
        lines += ["", "Temporal breakdown (HTA counts from the first to the last kernel; communication and memory "
                      "kernels are its non-compute time), beside our compute time:", "",
                  "| rank | HTA span (ms) | HTA idle (ms) | HTA compute (ms) | HTA non-compute (ms) | our compute (ms) "
                  "| HTA comm. under compute |", "|---|---|---|---|---|---|---|"]
        for r in sorted(temporal):
            row = temporal[r]
            ours = ranks[r]["breakdown"]["compute_us"] if r in ranks else None
            ov = overlap.get(r, {}).get("comp_comm_overlap_pctg")
            lines.append(f"| {r} | {_ms(row.get('kernel_time(us)'))} | {_ms(row.get('idle_time(us)'))} | "
                         f"{_ms(row.get('compute_time(us)'))} | {_ms(row.get('non_compute_time(us)'))} | {_ms(ours)} | "
                         f"{'n/a (no communication)' if ov is None else f'{ov:.1f}%'} |")
    kinds = hta.get("kernel_breakdown", [])
    if kinds:
        lines += ["", "Kernel time by type over all ranks (HTA):", "", "| kernel type | time (ms) | share |",
                  "|---|---|---|"]
        for row in kinds:
            lines.append(f"| {row.get('kernel_type')} | {_ms(row.get('sum'))} | {row.get('percentage')}% |")
    return lines


def write_report(et_dir: str | Path, trace_dirs: list[str | Path] | None = None, use_hta: bool = True) -> Path:
    """Write report.md, report.json and the figures beside the .et files of a run; returns report.md's path.

    Everything is written to a temporary folder first and moved in at the end: a failure leaves no partial report.
    Raises ReportError (one line, naming the file) on unreadable input.
    """
    et_dir = Path(et_dir)
    if not et_dir.is_dir():
        raise ReportError(f"{et_dir}: {'not a folder' if et_dir.exists() else 'no such folder'}")
    # reports side by side, but none while a conversion rewrites the .et files (pipeline.only_conversion_in)
    with folder_held(et_dir, lambda: ReportError(f"{et_dir}: a conversion is writing into this folder now; report on it "
                                                 "when it has ended"), shared=True):
        return _write_report(et_dir, trace_dirs, use_hta)


def _remove_dead_writers_staging(et_dir: Path) -> None:
    """The staging folders of reports that were killed (SIGKILL, a power cut) before they could remove them."""
    for entry in et_dir.iterdir():
        match = STAGING_RE.fullmatch(entry.name)
        if match and entry.is_dir() and not process_is_alive(int(match["pid"])):
            shutil.rmtree(entry, ignore_errors=True)


def check_report_paths(et_dir: Path) -> None:
    """ReportError when a folder stands where the report has a file (report.md, report.json, a figure): the report
    could neither move its file in nor remove an earlier figure there. Said before anything is written (a folder at
    report.md had been found after report.json was moved in: a traceback and half a report)."""
    try:
        entries = sorted(et_dir.iterdir())
    except OSError as e:
        raise ReportError(f"{et_dir}: cannot read the folder ({e.strerror or e})") from None
    for entry in entries:
        if REPORT_FILE_RE.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink():
            raise ReportError(f"{entry}: a folder, where trace_report.py writes its {entry.name}; move it away and "
                              "report again")


def _write_report(et_dir: Path, trace_dirs: list[str | Path] | None, use_hta: bool) -> Path:
    check_report_paths(et_dir)
    report, traces = build_report(et_dir, [Path(d) for d in trace_dirs or []], use_hta)
    ranks = {int(r): s for r, s in report["per_rank"].items()}
    try:
        _remove_dead_writers_staging(et_dir)
        staging = Path(tempfile.mkdtemp(prefix=f".report.{os.getpid()}.", dir=et_dir))
    except OSError as e:
        raise ReportError(f"{et_dir}: cannot write the report here ({e.strerror})") from None
    try:
        figures: dict[str, Any] = {"files": [], "errors": []}
        jobs = [(FIGURE_BREAKDOWN, lambda p: plot_breakdown(ranks, report["kind"] == "gpu", p)),
                (FIGURE_TOP, lambda p: plot_top(report["top_operators"], report["top_kernels"], p))]
        for rank, trace in traces.items():
            jobs.append((FIGURE_TIMELINE.format(rank=rank), lambda p, t=trace: plot_timeline(t, p)))
        if any(s["collectives"] for s in ranks.values()):
            jobs.append((FIGURE_COMM, lambda p: plot_collectives(ranks, p)))
        for name, draw in jobs:
            try:
                draw(staging / name)
                figures["files"].append(name)
            except Exception as e:  # a figure that fails must not cost the numbers
                logger.warning("%s: figure %s failed: %s", et_dir, name, e)
                figures["errors"].append(f"{name}: {type(e).__name__}: {e}")
        report["figures"] = figures["files"]
        try:
            (staging / REPORT_MD).write_text(render_markdown(report, figures))
            (staging / REPORT_JSON).write_bytes(orjson.dumps(report,
                                                             option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
        except OSError as e:  # a full disk, a quota
            raise ReportError(f"{et_dir}: cannot write the report here ({e.strerror or e}); the earlier report is "
                              "kept as it was") from None
        # one report or the other, never the new numbers beside the old figures: a signal waits for the last rename
        with publication(lambda: et_dir / REPORT_MD):
            _publish(staging, et_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return et_dir / REPORT_MD


def _publish(staging: Path, et_dir: Path) -> None:
    """Move the staged report into et_dir in place of the earlier one, whose figures this one has not drawn go
    (ranks gone, no collectives): all of it, or when a rename fails, none of it (the earlier report is put back from
    links kept beside it, and ReportError names the file that could not be moved)."""
    written = sorted(item.name for item in staging.iterdir())
    earlier = sorted(old.name for old in et_dir.iterdir() if REPORT_FILE_RE.fullmatch(old.name))
    try:
        kept = Path(tempfile.mkdtemp(prefix=f".report.{os.getpid()}.", dir=et_dir))  # STAGING_RE's: gone after a kill
    except OSError as e:
        raise ReportError(f"{et_dir}: cannot write the report here ({e.strerror or e}); the earlier report is kept "
                          "as it was") from None
    moved_in: list[str] = []
    target = et_dir
    try:
        for name in earlier:
            target = et_dir / name
            if name in written:  # kept as a second link: the new file replaces it in one rename
                _keep_a_copy(target, kept / name)
            else:
                os.replace(target, kept / name)
        for name in written:
            target = et_dir / name
            os.replace(staging / name, target)
            moved_in.append(name)
    except BaseException as e:
        restored = _put_back(et_dir, kept, earlier, moved_in)
        if not isinstance(e, OSError):
            raise
        outcome = ("the earlier report is kept as it was" if restored else
                   "the folder holds part of it; run trace_report.py again")
        raise ReportError(f"{target}: cannot move the report in ({e.strerror or e}); {outcome}") from None
    finally:
        shutil.rmtree(kept, ignore_errors=True)


def _keep_a_copy(path: Path, copy: Path) -> None:
    try:
        os.link(path, copy, follow_symlinks=False)
    except (OSError, NotImplementedError):  # a file system without hard links
        shutil.copy2(path, copy, follow_symlinks=False)


def _put_back(et_dir: Path, kept: Path, earlier: list[str], moved_in: list[str]) -> bool:
    """Undo _publish as far as it went: the new files out, the earlier ones back. False when that failed too."""
    restored = True
    for name in moved_in:
        if name not in earlier:
            try:
                (et_dir / name).unlink()
            except OSError:
                restored = False
    for name in earlier:
        if (kept / name).exists() or (kept / name).is_symlink():
            try:
                os.replace(kept / name, et_dir / name)
            except OSError:
                restored = False
    return restored


def find_report_folders(path: Path) -> list[Path]:
    """The folder itself when it holds .et files, else its sub-folders (two levels) that do."""
    def has_et(folder: Path) -> bool:
        return bool(et_sets(folder))

    if not path.is_dir():
        raise ReportError(f"{path}: {'not a folder' if path.exists() else 'no such folder'}")
    if has_et(path):
        return [path]
    found = []
    for child in sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if has_et(child):
            found.append(child)
            continue
        found.extend(g for g in sorted(p for p in child.iterdir() if p.is_dir() and not p.name.startswith("."))
                     if has_et(g))
    if not found:
        raise ReportError(f"{path}: no <name>.<rank>.et files in it or in its sub-folders")
    return found


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--hta-worker":
    sys.exit(_hta_worker(sys.argv[2], sys.argv[3]))
