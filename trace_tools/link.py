"""Link a host execution trace with its Kineto trace: match operators, attach GPU work, time and order every node."""
from __future__ import annotations

import bisect
import logging
import re
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

from chakra.schema.protobuf.et_def_pb2 import (
    ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BROADCAST, COMM_COLL_NODE, COMM_RECV_NODE, COMM_SEND_NODE, COMP_NODE, GATHER,
    REDUCE, REDUCE_SCATTER, SCATTER, CollectiveCommType, NodeType,
)

from .graph import longest_path, topological_order
from .intervals import BusyTime
from .layout import PG_INIT_NODE, STEP_PREFIX
from .load import DeviceTrace, HostTrace, TraceError, is_structural
from .step_timing import MicroBatches

logger = logging.getLogger(__name__)

# Node kinds in the linked graph
HOST_OP, KINETO_OP, GPU_OP = 0, 1, 2
# A node the trace has no op for: the CPU work of a collective's communication threads (trace_tools.core_sharing)
COMMUNICATION_CPU_OP = 3
COMMUNICATION_CPU_ATTR = "communication_cpu_of"  # its .et attribute: the id of the collective whose work it is
# Another: the time those threads waited for a core before that work, which holds no core (trace_tools.core_sharing)
COMMUNICATION_WAIT_OP = 4
COMMUNICATION_WAIT_ATTR = "communication_wait_of"
COMMUNICATION_NODE_KINDS = (COMMUNICATION_CPU_OP, COMMUNICATION_WAIT_OP)
# Names of chakra's enums (et_def_pb2) in messages and summaries: ALL_REDUCE, COMP...
COMM_TYPE_NAMES = {value: name for name, value in CollectiveCommType.items()}
NODE_TYPE_NAMES = {t: NodeType.Name(t).removesuffix("_NODE") for t in (COMP_NODE, COMM_SEND_NODE, COMM_RECV_NODE,
                                                                          COMM_COLL_NODE)}
# Host-side names of the collective itself (the record function that carries the communicated tensor).
COLLECTIVE_PREFIXES = ("nccl:", "gloo:", "mpi:", "ucc:", "xccl:")
# Collectives that run on CPU threads become COMM nodes themselves (there is no GPU kernel to stand for them).
CPU_COLLECTIVE_PREFIXES = ("gloo:", "mpi:", "ucc:")
# Host-side calls that enqueue a collective (the tensors they hold are the collective's buffer).
COMM_CALL_PREFIXES = COLLECTIVE_PREFIXES + ("c10d::", "record_param_comms")
# Runtime calls after which the CPU has waited for GPU work.
SYNC_CALLS = {"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpy2D", "cudaMemcpyFromSymbol", "cudaMemcpyToSymbol", "cuCtxSynchronize",
              "cuStreamSynchronize", "cuEventSynchronize", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2",
              "hipDeviceSynchronize", "hipStreamSynchronize", "hipEventSynchronize", "hipMemcpy"}
# A thread waiting on another thread's work resumes when the work completes, before the work's record function
# closes (torch marks a gloo future complete, which wakes its waiters, then ends the record; on a busy machine the
# worker may not run again for milliseconds). A thread idle through a gap that another thread's op covered (this
# share of the gap at least) waited for that op when it resumed before the op closed by at most this share of the gap.
BLOCKED_COVER = 0.9
COMPLETION_SLACK_SHARE = 0.5
# A collective may start well into the waiting thread's idle gap (its worker thread picks the work up late on a busy
# machine): one that ran from its start past the resume explains the gap when it covered this share of it.
COLLECTIVE_COVER = 0.5
# Fewer matched host operators than this means the two traces do not belong together.
MIN_MATCH_RATE = 0.1
# Anchors for the External-id offset search: names that repeat more often than this are too ambiguous to vote.
MAX_ANCHOR_HOST_REPEATS = 4
MAX_ANCHOR_KINETO_REPEATS = 4096


@dataclass
class LinkedTrace:
    """The linked graph of one rank: nodes as parallel columns, dependencies as lists of node indices."""

    rank: int
    host: HostTrace
    device: DeviceTrace
    kind: list[int] = field(default_factory=list)        # HOST_OP, KINETO_OP, GPU_OP or COMMUNICATION_*_OP
    src: list[int] = field(default_factory=list)         # index into the Kineto cpu table or gpu table (the
                                                         # collective's node for a COMMUNICATION_*_OP)
    host_index: list[int] = field(default_factory=list)  # index into host columns, -1 when none
    ts: list[float] = field(default_factory=list)
    dur: list[float] = field(default_factory=list)       # inclusive
    excl: list[float] = field(default_factory=list)      # exclusive (same thread)
    lane: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)      # node index of the caller (ctrl dependency), -1 when none
    lane_parent: list[int] = field(default_factory=list) # innermost node around it on its own thread, -1 when none
    wait: list[float] = field(default_factory=list)      # part of the exclusive time spent waiting for other lanes
    node_type: list[int] = field(default_factory=list)
    comm: dict[int, dict] = field(default_factory=dict)  # node index -> comm_type/comm_size/pg_name/src/dst/tag
    deps: list[list[int]] = field(default_factory=list)  # data dependencies (node indices)
    node_id: list[int] = field(default_factory=list)     # id written to the .et
    lanes: list[tuple] = field(default_factory=list)     # lane index -> ("cpu", tid) or ("gpu", device, stream)
    launcher_of_rt: dict[int, int] = field(default_factory=dict)  # runtime call -> CPU node it ran in
    inter_thread_dep: dict[int, int] = field(default_factory=dict)  # strongest cross-thread dep (merged JSON)
    sync_deps: dict[int, list[int]] = field(default_factory=dict)   # GPU nodes a CPU node waited for
    launch_ts: dict[int, float] = field(default_factory=dict)       # GPU node -> start of the call that enqueued it
    rule_edges: Counter = field(default_factory=Counter)            # cross-lane edges added, by the rule that added them
    traced_steps: list[int] = field(default_factory=list)           # Kineto indices of the steps traced
    traced_excl: list[float] = field(default_factory=list)          # exclusive times as traced, before medians
    step_samples: dict[int, list] = field(default_factory=dict)     # node -> its time in each traced step (None: absent)
    overhead: list[float] = field(default_factory=list)             # profiler cost taken out of each node's time
    queued: list[float] = field(default_factory=list)               # its thread's wait for a core, taken out too
    untraced_step_us: float = 0.0                                   # the run's step without the profiler, if measured
    step_name: str = ""
    step_start: float = 0.0
    step_dur: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.kind)

    def work(self, i: int) -> float:
        """Duration written to the .et: exclusive time less the time the node waited for another lane, less
        the profiler's own cost (when the untraced step time is known) and less its thread's wait for a core (when
        measured)."""
        overhead = self.overhead[i] if self.overhead else 0.0
        queued = self.queued[i] if self.queued else 0.0
        return max(0.0, self.excl[i] - self.wait[i] - overhead - queued)

    def traced_work(self, i: int) -> float:
        """The duration as traced in the chosen step (no median, no overhead correction)."""
        excl = self.traced_excl[i] if self.traced_excl and i < len(self.traced_excl) else self.excl[i]
        return max(0.0, excl - self.wait[i])

    def name(self, i: int) -> str:
        k = self.kind[i]
        if k == HOST_OP:
            return self.host.names[self.host_index[i]]
        if k == KINETO_OP:
            return self.device.cpu_names[self.src[i]]
        if k == COMMUNICATION_CPU_OP:
            return f"{self.name(self.src[i])} (communication threads' CPU work)"
        if k == COMMUNICATION_WAIT_OP:
            return f"{self.name(self.src[i])} (communication threads' wait for a core)"
        return self.device.gpu_names[self.src[i]]


# ---------------------------------------------------------------------------------------------------------------
# Kineto CPU operators: nesting and exclusive time
# ---------------------------------------------------------------------------------------------------------------
def kineto_nesting(dev: DeviceTrace) -> tuple[list[int], list[float]]:
    """Parent (enclosing op on the same thread, -1 for none) and exclusive duration of every op.

    Exclusive time is the inclusive time minus the time of the ops nested in it on the same thread, as chakra
    computes it (children are ops that start and end inside the parent).
    """
    n = len(dev.cpu_names)
    ts, dur, tids, ext = dev.cpu_ts, dev.cpu_dur, dev.cpu_tid, dev.cpu_ext
    tid_rank: dict[Any, int] = {}
    for t in tids:
        if t not in tid_rank:
            tid_rank[t] = len(tid_rank)
    order = sorted(range(n), key=lambda i: (tid_rank[tids[i]], ts[i], -dur[i], ext[i], i))
    parent = [-1] * n
    excl = list(dur)
    stack: list[int] = []
    current_tid = object()
    for i in order:
        if tids[i] != current_tid:
            stack.clear()
            current_tid = tids[i]
        start, end = ts[i], ts[i] + dur[i]
        while stack:
            top = stack[-1]
            if start >= ts[top] and end <= ts[top] + dur[top]:
                break
            stack.pop()
        if stack:
            top = stack[-1]
            parent[i] = top
            excl[top] -= dur[i]
        stack.append(i)
    for i in range(n):
        if excl[i] < 0:  # overlapping siblings (clock rounding): never below zero
            excl[i] = 0.0
    return parent, excl


# ---------------------------------------------------------------------------------------------------------------
# Host <-> Kineto matching
# ---------------------------------------------------------------------------------------------------------------
def match_by_record_function_id(host: HostTrace, dev: DeviceTrace, candidates: list[int]) -> tuple[list[int], dict]:
    """host index -> Kineto cpu index through rf_id == 'Record function id' (torch >= 2.3 traces)."""
    by_rf: dict[int, int] = {}
    for k, rf in enumerate(dev.cpu_rf):
        if rf >= 0 and rf not in by_rf:
            by_rf[rf] = k
    match = [-1] * len(host)
    names_differ = 0
    for h in candidates:
        k = by_rf.get(host.rf_ids[h])
        if k is None:
            continue
        if dev.cpu_names[k] != host.names[h]:
            names_differ += 1
            continue
        match[h] = k
    return match, {"mode": "rf_id", "name_mismatches": names_differ}


def match_by_external_id_offset(host: HostTrace, dev: DeviceTrace, candidates: list[int],
                                kparent: list[int]) -> tuple[list[int], dict]:
    """host index -> Kineto cpu index for traces without 'Record function id' (torch <= 2.2).

    Kineto's External id of a CPU op is the host rf_id plus an offset that holds along a stretch of one thread: Kineto
    hands each thread External ids in blocks, the host numbers all threads with one counter, and a device trace of
    many steps has one offset per step. So per host thread: anchors vote for (Kineto thread, External id - rf_id)
    (an op with the same name and autograd sequence number is near-unique and weighs most; names rare on the thread
    weigh one); the best-voted offset gives the first matches (same name required); the host ops between and around
    them are then aligned, in order and by name, with the Kineto ops of that thread between the same matches. Last,
    every match must nest inside its matched parent.
    """
    ext_to_k: dict[int, int] = {}
    for k, ext in enumerate(dev.cpu_ext):
        if ext >= 0 and ext not in ext_to_k:
            ext_to_k[ext] = k
    k_names, k_tids, k_ext, k_ts, k_dur = dev.cpu_names, dev.cpu_tid, dev.cpu_ext, dev.cpu_ts, dev.cpu_dur
    h_names, h_rf, h_seq = host.names, host.rf_ids, host.seq_ids
    by_thread: dict[int, list[int]] = defaultdict(list)
    for h in candidates:
        if h_rf[h] >= 0:
            by_thread[host.tids[h]].append(h)
    k_by_name: dict[str, list[int]] = defaultdict(list)
    k_by_name_seq: dict[tuple, list[int]] = defaultdict(list)
    k_thread: dict[Any, list[int]] = defaultdict(list)
    for k, name in enumerate(k_names):
        k_by_name[name].append(k)
        k_thread[k_tids[k]].append(k)
        if dev.cpu_seq[k] >= 0:
            k_by_name_seq[(name, dev.cpu_seq[k])].append(k)
    k_position = [0] * len(k_names)
    for ks in k_thread.values():
        ks.sort(key=lambda k: (k_ts[k], -k_dur[k], k_ext[k]))
        for position, k in enumerate(ks):
            k_position[k] = position
    match = [-1] * len(host)
    claimed: set[int] = set()
    threads_info: list[dict] = []
    for htid in sorted(by_thread):
        hs = sorted(by_thread[htid], key=lambda h: h_rf[h])
        votes = _vote_offsets(hs, h_names, h_rf, h_seq, k_by_name, k_by_name_seq, k_tids, k_ext)
        if not votes:
            continue
        (ktid, offset), _ = max(votes.items(), key=lambda item: (item[1], -abs(item[0][1])))
        anchors: list[tuple[int, int]] = []  # (index in hs, position in the Kineto thread)
        for i, h in enumerate(hs):
            k = ext_to_k.get(h_rf[h] + offset)
            if k is not None and k not in claimed and k_tids[k] == ktid and k_names[k] == h_names[h]:
                anchors.append((i, k_position[k]))
        anchors = _longest_increasing(anchors)
        if not anchors:
            continue
        ks = k_thread[ktid]
        pairs = list(anchors)
        # between anchors, before the first and after the last: align in order by name
        bounds = [(-1, -1)] + anchors + [(len(hs), len(ks))]
        for (ia, ka), (ib, kb) in zip(bounds, bounds[1:]):
            if ib - ia <= 1:
                continue
            host_segment = list(range(ia + 1, ib))
            if ia < 0:  # leading: walk backwards from the first anchor
                lo = max(0, kb - 2 * len(host_segment) - 64)
                kineto_segment = list(range(kb - 1, lo - 1, -1))
                host_segment.reverse()
            elif ib >= len(hs):  # trailing: walk forwards from the last anchor
                hi = min(len(ks), ka + 1 + 2 * len(host_segment) + 64)
                kineto_segment = list(range(ka + 1, hi))
            else:
                kineto_segment = list(range(ka + 1, kb))
            for a, b in _align_by_name([h_names[hs[i]] for i in host_segment],
                                       [k_names[ks[p]] for p in kineto_segment]):
                pairs.append((host_segment[a], kineto_segment[b]))
        matched_here = 0
        for i, p in pairs:
            k = ks[p]
            if k in claimed:
                continue
            match[hs[i]] = k
            claimed.add(k)
            matched_here += 1
        threads_info.append({"host_tid": htid, "kineto_tid": ktid, "offset": offset, "anchors": len(anchors),
                             "matched": matched_here, "host_ops": len(hs)})
    # Confirm by nesting: a matched node whose matched host parent is on the same Kineto thread must lie inside it.
    index_of = {nid: i for i, nid in enumerate(host.ids)}
    nesting_violations = 0
    for h in candidates:
        k = match[h]
        if k < 0:
            continue
        p = index_of.get(host.parents[h], -1)
        kp = match[p] if p >= 0 else -1
        if kp < 0 or k_tids[kp] != k_tids[k]:
            continue
        if not _inside(dev, k, kp):
            nesting_violations += 1
            match[h] = -1
    return match, {"mode": "external_id_offset", "threads": threads_info, "nesting_rejected": nesting_violations}


def _longest_increasing(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The longest subsequence of (host position, Kineto position) pairs increasing in both (O(n log n))."""
    tails: list[int] = []
    tail_index: list[int] = []
    previous = [-1] * len(pairs)
    for idx, (_, kp) in enumerate(pairs):
        p = bisect.bisect_left(tails, kp)
        if p == len(tails):
            tails.append(kp)
            tail_index.append(idx)
        else:
            tails[p] = kp
            tail_index[p] = idx
        previous[idx] = tail_index[p - 1] if p > 0 else -1
    result = []
    idx = tail_index[-1] if tail_index else -1
    while idx >= 0:
        result.append(pairs[idx])
        idx = previous[idx]
    result.reverse()
    return result


def _align_by_name(a: list[str], b: list[str], window: int = 48) -> list[tuple[int, int]]:
    """Greedy in-order alignment of two nearly equal name sequences (ops missing on either side are skipped)."""
    pairs = []
    i = j = 0
    na, nb = len(a), len(b)
    while i < na and j < nb:
        if a[i] == b[j]:
            pairs.append((i, j))
            i += 1
            j += 1
            continue
        if i + 1 < na and j + 1 < nb and a[i] == b[j + 1] and a[i + 1] == b[j]:
            # a caller and its callee with the same start and duration (whole-microsecond clocks) sort either way
            pairs.append((i, j + 1))
            pairs.append((i + 1, j))
            i += 2
            j += 2
            continue
        skip_b = skip_a = None
        for d in range(1, window):
            if skip_b is None and j + d < nb and b[j + d] == a[i] and (i + 1 >= na or j + d + 1 >= nb
                                                                     or a[i + 1] == b[j + d + 1]):
                skip_b = d
            if skip_a is None and i + d < na and a[i + d] == b[j] and (j + 1 >= nb or i + d + 1 >= na
                                                                     or a[i + d + 1] == b[j + 1]):
                skip_a = d
            if skip_a is not None or skip_b is not None:
                break
        if skip_b is not None and (skip_a is None or skip_b <= skip_a):
            j += skip_b
        elif skip_a is not None:
            i += skip_a
        else:
            i += 1
            j += 1
    return pairs


def _inside(dev: DeviceTrace, k: int, kp: int, tolerance: float = 1.0) -> bool:
    ts, dur = dev.cpu_ts, dev.cpu_dur
    return ts[k] + tolerance >= ts[kp] and ts[k] + dur[k] <= ts[kp] + dur[kp] + tolerance


def _vote_offsets(pending: list[int], h_names, h_rf, h_seq, k_by_name, k_by_name_seq, k_tids, k_ext) -> Counter:
    """Votes for (Kineto thread, offset): same name and sequence number weigh 16, a rare name 1."""
    votes: Counter = Counter()
    name_repeats = Counter(h_names[h] for h in pending)
    for h in pending:
        rf = h_rf[h]
        seq = h_seq[h]
        name = h_names[h]
        if seq >= 0:
            for k in k_by_name_seq.get((name, seq), ()):
                if k_ext[k] >= 0:
                    votes[(k_tids[k], k_ext[k] - rf)] += 16
        if name_repeats[name] <= MAX_ANCHOR_HOST_REPEATS:
            ks = k_by_name.get(name, ())
            if len(ks) <= MAX_ANCHOR_KINETO_REPEATS:
                for k in ks:
                    if k_ext[k] >= 0:
                        votes[(k_tids[k], k_ext[k] - rf)] += 1
    if not votes:  # nothing rare: let every op vote, but only for a bounded number of candidates
        for h in pending[:2000]:
            for k in k_by_name.get(h_names[h], ())[:64]:
                if k_ext[k] >= 0:
                    votes[(k_tids[k], k_ext[k] - h_rf[h])] += 1
    return votes


# ---------------------------------------------------------------------------------------------------------------
# Collective classification
# ---------------------------------------------------------------------------------------------------------------
_COMM_PATTERNS = [
    (re.compile(r"reduce_?scatter|reducescatter"), REDUCE_SCATTER),
    (re.compile(r"all_?gather|allgather"), ALL_GATHER),
    (re.compile(r"all_?reduce|allreduce"), ALL_REDUCE),
    (re.compile(r"all_?to_?all|alltoall"), ALL_TO_ALL),
    (re.compile(r"broadcast|bcast"), BROADCAST),
    (re.compile(r"barrier"), ALL_REDUCE),  # NCCL implements a barrier as a one-element all-reduce
    (re.compile(r"reduce"), REDUCE),
    (re.compile(r"gather"), GATHER),
    (re.compile(r"scatter"), SCATTER),
]
_P2P_SEND = re.compile(r"(^|[:_])send")
_P2P_RECV = re.compile(r"(^|[:_])recv")


def classify_collective(name: str) -> tuple[int, int] | None:
    """(node type, comm type) named by a collective's operator or kernel name, None when it names none."""
    lowered = name.lower()
    for pattern, comm_type in _COMM_PATTERNS:
        if pattern.search(lowered):
            return COMM_COLL_NODE, comm_type
    if _P2P_SEND.search(lowered):
        return COMM_SEND_NODE, -1
    if _P2P_RECV.search(lowered):
        return COMM_RECV_NODE, -1
    return None


def tensor_bytes(values: list, types: list) -> int:
    """Bytes of the tensors among an operator's inputs (tensor value = [id, storage, offset, numel, itemsize, device])."""
    total = 0
    for value, type_ in zip(values, types):
        if not isinstance(type_, str) or "Tensor" not in type_:
            continue
        items = value if type_.startswith("GenericList[") else [value]
        for item in items if isinstance(items, list) else []:
            if isinstance(item, list) and len(item) >= 5 and isinstance(item[3], int) and isinstance(item[4], int):
                total += item[3] * item[4]
    return total


def _string_inputs(values: list, types: list) -> list[str]:
    return [v for v, t in zip(values, types) if t == "String" and isinstance(v, str)]


def _int_inputs(values: list, types: list) -> list[int]:
    return [v for v, t in zip(values, types) if t == "Int" and isinstance(v, int)]


# ---------------------------------------------------------------------------------------------------------------
# The linker
# ---------------------------------------------------------------------------------------------------------------
def link_host_and_device(host: HostTrace, dev: DeviceTrace, rank: int = 0, include_kineto_only: bool = True,
                         micro_batches: MicroBatches | None = None) -> LinkedTrace:
    """Match, time and order one rank's host and device traces; TraceError when they do not belong together.
    micro_batches: what run.json says each traced step took, to keep the run's full steps (_select_step)."""
    _check_same_process(host, dev)
    kparent, kexcl = kineto_nesting(dev)
    structural = [is_structural(name) for name in host.names]
    candidates = [h for h in range(len(host)) if not structural[h] and host.names[h] != PG_INIT_NODE]
    if dev.has_record_function_ids and any(rf >= 0 for rf in host.rf_ids):
        match, match_info = match_by_record_function_id(host, dev, candidates)
    else:
        match, match_info = match_by_external_id_offset(host, dev, candidates, kparent)
    matched = [h for h in candidates if match[h] >= 0]
    stats: dict[str, Any] = {"match": match_info, "host_ops": len(candidates), "host_ops_matched": len(matched),
                             "match_rate": len(matched) / len(candidates) if candidates else 0.0,
                             "structural_nodes_dropped": sum(structural)}
    if len(matched) < MIN_MATCH_RATE * len(candidates):
        found = f"{len(matched)} of {len(candidates)} host operators match" if matched else "no host operator matches"
        if dev.past_window_end:  # the operators the host trace holds may be among those left out
            left_out = sum(dev.past_window_end.values())
            raise TraceError(host.path, f"{found} an operator of {dev.path} (by {match_info['mode']}), which "
                                        f"ends at its \"Record Window End\" before {left_out} of its events: the "
                                        "device trace was cut, joined or edited since the profiler wrote it")
        raise TraceError(host.path, f"{found} an operator of {dev.path} (by {match_info['mode']}): the traces "
                                    "come from different runs or cover different steps")

    linked = LinkedTrace(rank=rank, host=host, device=dev, stats=stats)
    steps = _select_step(linked, match, matched, micro_batches)
    if not steps:
        # No step annotation: the main thread's host node stands for the thread's time between operators (Python),
        # as ProfilerStep#N does otherwise. It gets the thread's span; its exclusive time is then that gap time.
        thread_event = _time_main_thread_node(host, dev, match, matched, structural, linked.step_start,
                                              linked.step_start + linked.step_dur)
        if thread_event is not None:
            h, k = thread_event
            match[h] = k
            matched.append(h)
            kparent, kexcl = kineto_nesting(dev)
    node_of_k = _add_cpu_nodes(linked, match, matched, set(steps), kexcl, include_kineto_only)
    _link_callers(linked, match, matched, node_of_k, kparent)
    lanes: dict[tuple, int] = {}
    cpu_lane = [lanes.setdefault(("cpu", dev.cpu_tid[k]), len(lanes)) for k in linked.src]
    syncs = _add_gpu_work(linked, cpu_lane, lanes, bool(steps))
    linked.lane = cpu_lane + [lanes[("gpu", dev.gpu_device[linked.src[i]], dev.gpu_stream[linked.src[i]])]
                              for i in range(len(cpu_lane), len(linked.kind))]
    linked.lanes = [key for key, _ in sorted(lanes.items(), key=lambda item: item[1])]
    linked.wait = [0.0] * len(linked.kind)

    host_index_of_id = {nid: i for i, nid in enumerate(host.ids)}
    host_parent_idx = [host_index_of_id.get(p, -1) for p in host.parents]
    _classify_communication(linked, [i for i, k in enumerate(linked.kind) if k == GPU_OP], host_parent_idx)
    use_median_durations(linked, kexcl)
    _build_dependencies(linked, syncs)
    keep_step_totals(linked)
    _assign_ids(linked)
    stats["nodes"] = len(linked.kind)
    stats["unmatched_host_ops"] = len(candidates) - stats["host_ops_matched"]
    return linked


def _select_step(linked: LinkedTrace, match: list[int], matched: list[int],
                 micro_batches: MicroBatches | None = None) -> list[int]:
    """The step the .et stands for: of the ProfilerStep#N annotations around the matched operators (a device trace
    may hold more steps than the host trace), those of the run's full step (_steps_of_the_full_step) are its samples,
    and the one of median duration among them is the step; else the span of the matched operators. Drops from
    `matched` the operators of the other steps. Returns the chosen step annotation(s)."""
    dev = linked.device
    ts, dur, names = dev.cpu_ts, dev.cpu_dur, dev.cpu_names
    ops = [match[h] for h in matched if not names[match[h]].startswith(STEP_PREFIX)] or [match[h] for h in matched]
    span_start = min(ts[k] for k in ops)
    span_end = max(ts[k] + dur[k] for k in ops)
    traced = sorted((k for k, name in enumerate(names) if name.startswith(STEP_PREFIX)
                     and ts[k] < span_end and ts[k] + dur[k] > span_start), key=lambda k: ts[k])
    spanned = traced  # every step the matched operators reach into, a step the host trace was cut in included
    traced = _steps_the_host_trace_holds(linked, traced, {match[h] for h in matched}, span_end)
    steps = _steps_of_the_full_step(traced, dev, micro_batches)
    linked.stats["steps_in_device_trace"] = sum(1 for name in names if name.startswith(STEP_PREFIX))
    linked.stats["step_durations_us"] = [round(dur[k], 1) for k in steps]
    linked.stats["steps_left_out"] = [[names[k], round(dur[k], 1)] for k in traced if k not in steps]
    linked.traced_steps = steps
    if not steps:
        linked.step_start, linked.step_dur, linked.step_name = span_start, span_end - span_start, ""
        return steps
    chosen = _median_step(steps, dur, ts)
    linked.step_start, linked.step_dur, linked.step_name = ts[chosen], dur[chosen], names[chosen]
    if len(steps) > 1:
        durations = sorted(dur[k] for k in steps)
        middle = durations[len(durations) // 2] if len(durations) % 2 else \
            (durations[len(durations) // 2 - 1] + durations[len(durations) // 2]) / 2
        linked.stats["step_spread"] = (durations[-1] - durations[0]) / middle if middle > 0 else 0.0
    if len(spanned) > 1:  # the operators of a step left out (a step cut short among them) go with it
        lo, hi = ts[chosen], ts[chosen] + dur[chosen]
        matched[:] = [h for h in matched if lo <= ts[match[h]] < hi or (match[h] == chosen)]
    return [chosen]


# The operators by which a rank calls a collective (torch.distributed's c10d ops; the backends' annotations)
COLLECTIVE_CALL_PREFIXES = ("c10d::", "gloo:", "nccl:")


def _steps_the_host_trace_holds(linked: LinkedTrace, traced: list[int], matched_ops: set[int],
                                host_end: float) -> list[int]:
    """The traced steps whose every operator the host trace holds. The execution trace observer records each
    operator the step runs, in order, so a device-trace operator that starts inside a step after the host trace's
    last operator has ended is one the host trace lost: a host trace cut short (a process killed while writing it,
    a copy cut off, closed by fix_host_traces.py), whose .et would lack the rest of that step, its collectives
    included, and simulate no communication for them. Such a step is left out (stats "steps_cut"); with no whole
    step left, TraceError."""
    dev = linked.device
    ts, dur, names = dev.cpu_ts, dev.cpu_dur, dev.cpu_names
    if not traced:
        return traced
    last = traced[-1]  # only the step the host trace ends in can be cut: the later ones are not among `traced`
    lost = [k for k in range(len(names)) if ts[last] <= ts[k] < ts[last] + dur[last] and ts[k] >= host_end
            and k not in matched_ops and not dev.cpu_is_annotation[k]]
    if not lost:
        return traced
    collectives = sorted({names[k] for k in lost if names[k].startswith(COLLECTIVE_CALL_PREFIXES)})
    linked.stats["steps_cut"] = [[names[last], len(lost)]]
    whole = traced[:-1]
    if whole:
        return whole
    raise TraceError(linked.host.path,
                     f"ends inside {names[last]}: {len(lost)} operators the device trace has in that step start after "
                     f"its last node" + (f", among them {', '.join(collectives)}" if collectives else "")
                     + " (the host trace was cut short: a process killed while writing it, or closed by "
                     "fix_host_traces.py); an .et of it would lack them, so no whole traced step is left: trace "
                     "the run again")


def _median_step(steps: list[int], dur: list[float], ts: list[float]) -> int:
    """The step of median duration (the shorter of the middle two of an even count)."""
    return sorted(steps, key=lambda k: (dur[k], ts[k]))[(len(steps) - 1) // 2]


def _steps_of_the_full_step(steps: list[int], dev: DeviceTrace, micro_batches: MicroBatches | None) -> list[int]:
    """The traced steps that sample one kind of step: those that took the run's full micro-batch count (run.json,
    trace_tools.step_timing.MicroBatches). An epoch's short last step runs fewer forward and backward passes: it is
    neither the step the run repeats nor a sample of one (per-operator medians pair ops by their occurrence in the
    step, which a step of other passes shifts). With no full step traced, the steps of the count of the median one
    (in practice all alike: every epoch's last step takes as many); every step when run.json records no counts."""
    if micro_batches is None or not steps:
        return steps
    count = {k: micro_batches.of(dev.cpu_names[k]) for k in steps}
    full = [k for k in steps if count[k] == micro_batches.full]
    if full:
        return full
    known = [k for k in steps if count[k] is not None]
    if not known:
        return steps
    chosen = count[_median_step(known, dev.cpu_dur, dev.cpu_ts)]
    return [k for k in steps if count[k] == chosen]


def use_median_durations(linked: LinkedTrace, kexcl: list[float]) -> None:
    """Per-operator medians over the traced steps: every CPU op and GPU kernel of the chosen step gets the median
    of its own duration and those of the same op in the other steps (same thread or stream, same name, same
    occurrence of that name in the step), so one slow sample does not make the .et. A collective gets its shortest
    sample instead: its time on one rank is the transfer plus the wait for the last rank to arrive, a wait the
    simulator makes itself from the other ranks' graphs, and the least-waited sample is the nearest to the
    transfer alone. keep_step_totals then scales the medians to a typical step's total, and an op that waited takes
    back the chosen step's time (_build_dependencies). The raw durations stay in the `traced_micros` attribute of
    each node."""
    steps = linked.traced_steps
    if len(steps) < 2:
        return
    dev = linked.device
    windows = [(dev.cpu_ts[k], dev.cpu_ts[k] + dev.cpu_dur[k]) for k in steps]
    starts = [w[0] for w in windows]

    def step_of(t: float) -> int:
        q = bisect.bisect_right(starts, t) - 1
        return q if q >= 0 and t < windows[q][1] else -1

    samples: dict[tuple, list[list[float]]] = {}
    seen: dict[tuple, int] = Counter()
    cpu_order = sorted(range(len(dev.cpu_names)), key=lambda k: (dev.cpu_ts[k], -dev.cpu_dur[k]))
    key_of_cpu: dict[int, tuple] = {}
    for k in cpu_order:
        s = step_of(dev.cpu_ts[k])
        if s < 0 or dev.cpu_names[k].startswith(STEP_PREFIX):
            continue
        base = ("cpu", dev.cpu_tid[k], dev.cpu_names[k], s)
        occurrence = seen[base]
        seen[base] += 1
        key = ("cpu", dev.cpu_tid[k], dev.cpu_names[k], occurrence)
        samples.setdefault(key, [[] for _ in steps])[s].append(kexcl[k])
        key_of_cpu[k] = key
    gpu_order = sorted(range(len(dev.gpu_names)), key=lambda g: dev.gpu_ts[g])
    key_of_gpu: dict[int, tuple] = {}
    for g in gpu_order:
        s = step_of(dev.gpu_ts[g])
        if s < 0:
            continue
        base = ("gpu", dev.gpu_device[g], dev.gpu_stream[g], dev.gpu_names[g], s)
        occurrence = seen[base]
        seen[base] += 1
        key = ("gpu", dev.gpu_device[g], dev.gpu_stream[g], dev.gpu_names[g], occurrence)
        samples.setdefault(key, [[] for _ in steps])[s].append(dev.gpu_dur[g])
        key_of_gpu[g] = key
    linked.traced_excl = list(linked.excl)
    replaced = 0
    for i, kind in enumerate(linked.kind):
        if kind != GPU_OP and dev.cpu_names[linked.src[i]].startswith(STEP_PREFIX):
            continue
        key = (key_of_gpu if kind == GPU_OP else key_of_cpu).get(linked.src[i])
        if key is None:
            continue
        values = sorted(v[0] for v in samples[key] if v)
        if 2 * len(values) <= len(steps):  # the op is not part of most steps: keep what was traced
            continue
        if i in linked.comm:
            linked.excl[i] = values[0]
        else:
            linked.excl[i] = statistics.median(values)
            linked.step_samples[i] = [v[0] if v else None for v in samples[key]]
        replaced += 1
    # The step annotation's own time (the thread between operators) as the median over the steps too.
    for i, kind in enumerate(linked.kind):
        if kind != GPU_OP and linked.src[i] in steps:
            linked.excl[i] = sorted(kexcl[k] for k in steps)[len(steps) // 2]
    linked.stats["median_durations"] = replaced


def keep_step_totals(linked: LinkedTrace) -> None:
    """Scale the per-operator medians to the traced steps' typical total, CPU and GPU apart.

    An op's time is skewed to the right (a descheduling, a cache refill or a page fault lands on one op in one step),
    so a sum of per-operator medians falls short of every step: a step's total, the sum of thousands of such times,
    sits at the sum of their means. The medians keep how the time is spread over the ops; the total becomes the
    median over the traced steps of the same ops' total in each step. Collectives and ops that blocked in the chosen
    step (their time is a wait, which the simulator makes itself) take no part."""
    samples = linked.step_samples
    for gpu in (False, True):
        ops = [i for i in samples if (linked.kind[i] == GPU_OP) == gpu and linked.wait[i] <= 0.0 and i not in linked.comm]
        current = sum(linked.excl[i] for i in ops)
        if not ops or current <= 0.0:
            continue
        typical = statistics.median(sum(linked.excl[i] if samples[i][s] is None else samples[i][s] for i in ops)
                                    for s in range(len(linked.traced_steps)))
        for i in ops:
            linked.excl[i] *= typical / current
        linked.stats.setdefault("median_scales", {})["GPU" if gpu else "CPU"] = round(typical / current, 4)


def remove_recording_overhead(linked: LinkedTrace, traced_step_us: float, untraced_step_us: float,
                              recording_cpu_us: float | None = None, per_op_us: float | None = None,
                              untraced_op_us: float | None = None, traced_run_queue_us: float = 0.0) -> float:
    """Take the profiler's own cost out of the CPU durations; returns the cost c per recorded op (µs).

    Recording costs about the same for every op it records (the observer's and Kineto's callbacks at its start
    and end), and that cost lands both inside the op's span and in the time of what encloses it on its thread
    (the gaps between callees are the caller's exclusive time; between top-level ops, the step annotation's). So
    a CPU op loses min(c x (1 + the ops recorded directly inside it), its own time), for one cost c. GPU
    durations are the device's and carry no recording cost. c comes from one of four measurements, named in the
    summary:
    - "untraced CPU time": a CPU run whose ops all ran on the training thread (one intra-op thread, and no other
      thread's ops in the trace) and whose tracer timed that thread's CPU time in untraced steps (untraced_op_us,
      trace_tools.step_timing): its ops untraced take that time and no more, so c takes out what the step's CPU ops
      hold beyond it and beyond the traced run-queue wait (which trace_tools.core_sharing takes out next): the
      recording's CPU time and the traced steps' time off the CPU outside the collectives (one trace of GPT-2 tiny
      had 4 ms of it a step). That thread's untraced CPU time is a measurement of the very quantity the ops stand
      for, so no bound from another measurement overrides it: the tracer's cost of one recorded op (below), taken
      on a small op in a loop, moves 6.5-16.1 µs between processes on one machine, and as a floor it took 259 ms a
      step out of one BERT base rank whose traced steps used 166 ms more CPU than its untraced ones, leaving its ops
      below the thread's CPU time in every one of its untraced steps (docs/BENCHMARKS.md §4b, twenty-sixth
      session).
    - "CPU time": the tracer timed the training thread's CPU time (the process's in older runs) in untraced and
      traced steps; on a CPU-only run their difference is what recording costs a step, whatever the step waited
      for (a slow network hides the cost in the wall-clock step, not in the CPU time), so c takes that much out of
      the step's CPU ops; at least the work the tracer measured for one recorded op (run.json's
      recording_cost_per_op_us) times the ops.
    - "calibrated": a CPU run with that per-op measurement but no CPU times: the formula counts each op's cost
      twice (in its own span and in its caller's), so c is half of it. Timed on one small op in a loop, it is a
      lower bound: nine traces of GPT-2 tiny and 124M spent 1-4x as much per op.
    - "critical path": otherwise (a GPU run, whose runtime may spin on the CPU while it waits for the device, or
      a run.json without CPU times), c is the cost at which the .et's critical path equals the untraced step:
      the path, not one thread, because on a GPU the backward runs on the autograd thread while the training
      thread waits for it.
    """
    count = len(linked.kind)
    linked.overhead = [0.0] * count
    cpu_ops = [i for i in range(count) if linked.kind[i] != GPU_OP and i not in linked.comm]
    if (recording_cpu_us is None and per_op_us is None and untraced_op_us is None
            and traced_step_us <= untraced_step_us) or \
            not linked.traced_steps or not cpu_ops:
        return 0.0
    own = {i: max(0.0, linked.excl[i] - linked.wait[i]) for i in cpu_ops}
    recorded = Counter(p for p in linked.lane_parent if p >= 0)
    weight = {i: 1 + recorded[i] for i in cpu_ops}
    before = [list(deps) + ([linked.parent[i]] if linked.parent[i] >= 0 else []) for i, deps in enumerate(linked.deps)]
    order = topological_order(before)  # a node runs once its caller and dependencies are done (validate's issue loop)
    base = [linked.work(i) for i in range(count)]

    def path_with_cost(c: float) -> float:
        durations = list(base)
        for i in cpu_ops:
            durations[i] = own[i] - min(c * weight[i], own[i])
        return max(longest_path(before, durations, order)[0], default=0.0)

    def removed_with_cost(c: float) -> float:
        return sum(min(c * weight[i], own[i]) for i in cpu_ops)

    as_traced = path_with_cost(0.0)
    cpu_run, highest = GPU_OP not in linked.kind, max(own[i] / weight[i] for i in cpu_ops)
    one_thread = len({linked.lane[i] for i in cpu_ops}) == 1  # what the training thread's CPU time covers
    if untraced_op_us is not None and cpu_run and one_thread:
        rule = "untraced CPU time"
        beyond = sum(own.values()) - max(0.0, traced_run_queue_us) - untraced_op_us
        cost = _smallest_cost(lambda c: removed_with_cost(c) > beyond, highest)
    elif recording_cpu_us is not None and cpu_run:
        rule = "CPU time"
        least = (per_op_us or 0.0) * len(cpu_ops)  # recording costs at least its measured work
        cost = _smallest_cost(lambda c: removed_with_cost(c) > max(recording_cpu_us, least), highest)
    elif per_op_us is not None and cpu_run:
        rule, cost = "calibrated", max(0.0, per_op_us / 2)
    else:
        rule = "critical path"
        if as_traced <= untraced_step_us:
            return 0.0
        cost = _smallest_cost(lambda c: path_with_cost(c) < untraced_step_us, highest)
    for i in cpu_ops:
        linked.overhead[i] = min(cost * weight[i], own[i])
    linked.stats["recording_overhead_rule"] = rule
    linked.stats["recording_overhead_per_op_us"] = round(cost, 3)
    linked.stats["recording_overhead_us"] = round(as_traced - path_with_cost(cost), 1)
    return cost


def _smallest_cost(too_much: Callable[[float], bool], high: float) -> float:
    """The cost per op where `too_much` turns true (it only grows with the cost), to 0.01 µs; 0 when it is true from
    the start (a measured cost of 0 or less), `high` when never."""
    if too_much(0.0):
        return 0.0
    if not too_much(high):
        return high
    low = 0.0
    while high - low > max(0.01, 1e-4 * high):
        middle = (low + high) / 2
        if too_much(middle):
            high = middle
        else:
            low = middle
    return low


def _add_cpu_nodes(linked: LinkedTrace, match: list[int], matched: list[int], steps: set[int],
                   kexcl: list[float], include_kineto_only: bool) -> dict[int, int]:
    """CPU nodes: the matched host operators, then the Kineto operators of the step on the same threads that the
    host trace lacks (their time is real CPU time); returns Kineto index -> node index."""
    dev = linked.device
    ts, dur, names, tids = dev.cpu_ts, dev.cpu_dur, dev.cpu_names, dev.cpu_tid
    k_to_h = {match[h]: h for h in matched}
    emitted = [match[h] for h in matched]
    kineto_only: list[int] = []
    if include_kineto_only:
        threads = {tids[k] for k in emitted}
        lo, hi = linked.step_start - 1e-3, linked.step_start + linked.step_dur + 1e-3
        for k in range(len(names)):
            if k in k_to_h or tids[k] not in threads or ts[k] < lo or ts[k] + dur[k] > hi:
                continue
            if names[k].startswith(STEP_PREFIX) and k not in steps:
                continue
            kineto_only.append(k)
    linked.stats["kineto_only_ops"] = len(kineto_only)
    node_of_k: dict[int, int] = {}
    for k in emitted + kineto_only:
        node_of_k[k] = len(linked.kind)
        h = k_to_h.get(k, -1)
        linked.kind.append(HOST_OP if h >= 0 else KINETO_OP)
        linked.src.append(k)
        linked.host_index.append(h)
        linked.ts.append(ts[k])
        linked.dur.append(dur[k])
        linked.excl.append(kexcl[k])
        linked.node_type.append(COMP_NODE)
    return node_of_k


def _link_callers(linked: LinkedTrace, match: list[int], matched: list[int], node_of_k: dict[int, int],
                  kparent: list[int]) -> None:
    """Each CPU node's caller (its nearest emitted host ancestor, else the Kineto op around it) and the innermost
    node around it on its own thread.

    A host ancestor on the node's own thread that does not enclose it in time is not its caller: the observer keeps
    one stack of open operators per thread, and a record function that another thread closes (a gloo collective
    finished by its worker, DDP's reducer) pops whatever is on top of that stack then, leaving an op that has ended
    on it; later ops are filed under it (GPT-2 124M on CPU: 5-7% of a rank's ops under an earlier AccumulateGrad).
    Such a node takes the Kineto op around it instead, and the count is kept in stats["stale_host_parents"]."""
    host, dev = linked.host, linked.device
    host_index_of_id = {nid: i for i, nid in enumerate(host.ids)}
    host_parent_idx = [host_index_of_id.get(p, -1) for p in host.parents]
    host_node_of = [-1] * len(host)
    for h in matched:
        host_node_of[h] = node_of_k[match[h]]
    nearest = _nearest_emitted_host_ancestor(host_parent_idx, host_node_of)
    n_cpu = len(linked.kind)
    linked.parent = [-1] * n_cpu
    linked.lane_parent = [-1] * n_cpu
    stale = 0
    for i in range(n_cpu):
        k = linked.src[i]
        kp = kparent[k]
        while kp >= 0 and kp not in node_of_k:
            kp = kparent[kp]
        around = node_of_k[kp] if kp >= 0 else -1
        h = linked.host_index[i]
        caller = nearest[h] if h >= 0 else -1
        if caller >= 0 and dev.cpu_tid[linked.src[caller]] == dev.cpu_tid[k] \
                and not _inside(dev, k, linked.src[caller]):
            caller, stale = -1, stale + 1
        linked.parent[i] = caller if caller >= 0 else around
        linked.lane_parent[i] = around
    linked.stats["stale_host_parents"] = stale


def _add_gpu_work(linked: LinkedTrace, cpu_lane: list[int], lanes: dict[tuple, int],
                  has_step_annotation: bool) -> list[tuple[int, int, float]]:
    """GPU kernels, memcpy and memset, each attached through its runtime call's correlation id to the CPU node the
    call ran in (GPU work launched outside the step is left out). Returns the synchronising calls."""
    dev = linked.device
    launcher_of_rt, syncs = _attach_runtime_calls(linked, dev, cpu_lane, lanes)
    linked.launcher_of_rt = launcher_of_rt
    rt_of_corr: dict[int, int] = {}
    for r, corr in enumerate(dev.rt_corr):
        if corr >= 0:
            rt_of_corr.setdefault(corr, r)
    # CUPTI gives every GPU activity the correlation id of the runtime call that launched it, counting up: work
    # whose id is below the first call's was launched before the profiler started; work whose call is missing
    # otherwise cannot be attached to the CPU op that launched it (lost runtime events, or ids the loader could not
    # read) and is counted apart from the work launched outside the step.
    first_call = min(rt_of_corr, default=None)
    added = before_trace = without_launch = 0
    for g in range(len(dev.gpu_names)):
        r = rt_of_corr.get(dev.gpu_corr[g], -1)
        if r < 0:
            if first_call is not None and 0 <= dev.gpu_corr[g] < first_call:
                before_trace += 1
            else:
                without_launch += 1
            continue
        launcher = launcher_of_rt.get(r, -1)
        if launcher < 0:
            continue
        g_start, g_end = dev.gpu_ts[g], dev.gpu_ts[g] + dev.gpu_dur[g]
        linked.launch_ts[len(linked.kind)] = dev.rt_ts[r]
        linked.kind.append(GPU_OP)
        linked.src.append(g)
        linked.host_index.append(-1)
        linked.ts.append(g_start)
        linked.dur.append(dev.gpu_dur[g])
        linked.excl.append(dev.gpu_dur[g])
        linked.parent.append(launcher)
        linked.lane_parent.append(-1)
        linked.node_type.append(COMP_NODE)
        lanes.setdefault(("gpu", dev.gpu_device[g], dev.gpu_stream[g]), len(lanes))
        added += 1
        # A launch call that ran through most of its own GPU work (pageable memcpy, blocking copy) waited for it.
        rt_start, rt_end = dev.rt_ts[r], dev.rt_ts[r] + dev.rt_dur[r]
        if dev.rt_names[r] not in SYNC_CALLS and \
                min(rt_end, g_end) - max(rt_start, g_start) > 0.5 * (g_end - g_start) > 0:
            syncs.append((cpu_lane[launcher], r, rt_end))
    if not has_step_annotation and added:  # no step annotation: the step is the traced span, GPU work included
        gpu_end = max(linked.ts[i] + linked.dur[i] for i in range(len(linked.kind) - added, len(linked.kind)))
        linked.step_dur = max(linked.step_dur, gpu_end - linked.step_start)
    linked.stats["gpu_ops"] = added
    linked.stats["gpu_ops_in_device_trace"] = len(dev.gpu_names)
    linked.stats["gpu_ops_outside_step"] = len(dev.gpu_names) - added - without_launch
    linked.stats["gpu_ops_launched_before_trace"] = before_trace
    linked.stats["gpu_ops_without_launch"] = without_launch
    # The other way round: a kernel launch in the step whose kernel the trace lacks (CUPTI's activity records lost)
    gpu_corrs = set(dev.gpu_corr)
    linked.stats["kernel_launches_without_kernel"] = sum(
        1 for r in launcher_of_rt if is_kernel_launch(dev.rt_names[r]) and dev.rt_corr[r] not in gpu_corrs)
    linked.stats["kernel_launches"] = sum(1 for r in launcher_of_rt if is_kernel_launch(dev.rt_names[r]))
    return syncs


def is_kernel_launch(name: str) -> bool:
    """cudaLaunchKernel, cuLaunchKernel, cudaLaunchCooperativeKernel, hipLaunchKernel, hipModuleLaunchKernel...: calls
    that run one kernel each (not cudaLaunchHostFunc, which runs none, nor cudaGraphLaunch)."""
    return "Launch" in name and "Kernel" in name


def _time_main_thread_node(host: HostTrace, dev: DeviceTrace, match: list[int], matched: list[int],
                           structural: list[bool], start: float, end: float) -> tuple[int, int] | None:
    """Append a Kineto-table event spanning the main thread's traced window for the host's thread node of the
    thread that ran the first matched operator; (host index, new Kineto index), or None."""
    first = min(matched, key=lambda h: dev.cpu_ts[match[h]])
    host_tid = host.tids[first]
    kineto_tid = dev.cpu_tid[match[first]]
    thread_nodes = [h for h in range(len(host)) if structural[h] and host.names[h].endswith("|thread]")
                    and host.tids[h] == host_tid]
    if not thread_nodes:
        return None
    lane_end = max(dev.cpu_ts[match[h]] + dev.cpu_dur[match[h]] for h in matched if dev.cpu_tid[match[h]] == kineto_tid)
    k = len(dev.cpu_names)
    dev.cpu_names.append(host.names[thread_nodes[0]])
    dev.cpu_ts.append(start)
    dev.cpu_dur.append(min(end, lane_end) - start)
    dev.cpu_tid.append(kineto_tid)
    dev.cpu_ext.append(-1)
    dev.cpu_rf.append(-1)
    dev.cpu_seq.append(-1)
    dev.cpu_is_annotation.append(True)
    return thread_nodes[0], k


def _check_same_process(host: HostTrace, dev: DeviceTrace) -> None:
    pids = {p for p in dev.pids if isinstance(p, int)}
    if host.pid is not None and pids and host.pid not in pids:
        raise TraceError(host.path, f"host trace of process {host.pid} but {dev.path} traced process "
                                    f"{', '.join(str(p) for p in sorted(pids))}: not the same run")


def _nearest_emitted_host_ancestor(parent_idx: list[int], node_of: list[int]) -> list[int]:
    """For every host node, the linked node of its nearest emitted strict ancestor (-1 for none); iterative."""
    n = len(parent_idx)
    result = [-2] * n  # -2: not computed yet
    for start in range(n):
        if result[start] != -2:
            continue
        path = []
        h = start
        answer = -1
        steps = 0
        while True:
            p = parent_idx[h]
            if p < 0 or p == h or steps > n:
                answer = -1
                break
            path.append(h)
            if node_of[p] >= 0:
                answer = node_of[p]
                break
            if result[p] != -2:
                answer = result[p]
                break
            h = p
            steps += 1
        for x in path:
            result[x] = answer
        if result[start] == -2:
            result[start] = answer
    return result


def _attach_runtime_calls(linked: LinkedTrace, dev: DeviceTrace, cpu_lane: list[int],
                          lanes: dict[tuple, int]) -> tuple[dict[int, int], list[tuple[int, int, float]]]:
    """Runtime call -> innermost emitted CPU node around it; and the sync calls as (lane, runtime index, end)."""
    by_lane_nodes: dict[int, list[int]] = defaultdict(list)
    for i, lane in enumerate(cpu_lane):
        by_lane_nodes[lane].append(i)
    by_lane_rt: dict[int, list[int]] = defaultdict(list)
    for r, tid in enumerate(dev.rt_tid):
        lane = lanes.get(("cpu", tid))
        if lane is not None:
            by_lane_rt[lane].append(r)
    ts, dur = linked.ts, linked.dur
    launcher: dict[int, int] = {}
    syncs: list[tuple[int, int, float]] = []
    for lane, nodes in by_lane_nodes.items():
        rts = by_lane_rt.get(lane)
        if not rts:
            continue
        nodes = sorted(nodes, key=lambda i: (ts[i], -dur[i], i))
        rts.sort(key=lambda r: dev.rt_ts[r])
        stack: list[int] = []
        j = 0
        for r in rts:
            t = dev.rt_ts[r]
            while j < len(nodes) and ts[nodes[j]] <= t:
                node = nodes[j]
                while stack and ts[stack[-1]] + dur[stack[-1]] < ts[node]:
                    stack.pop()
                stack.append(node)
                j += 1
            while stack and ts[stack[-1]] + dur[stack[-1]] < t:
                stack.pop()
            if stack:
                launcher[r] = stack[-1]
                if dev.rt_names[r] in SYNC_CALLS:
                    syncs.append((lane, r, t + dev.rt_dur[r]))
    return launcher, syncs


def _classify_communication(linked: LinkedTrace, gpu_nodes: list[int], host_parent_idx: list[int]) -> None:
    """COMM nodes: NCCL kernels (typed by their host collective) and CPU-thread collectives (gloo)."""
    host, dev = linked.host, linked.device
    default_pg = _default_process_group(linked)

    def describe(h: int, fallback_name: str) -> dict | None:
        return _describe_collective(linked, host_parent_idx, default_pg, h, fallback_name)

    for i in gpu_nodes:
        g = linked.src[i]
        name = dev.gpu_names[g]
        if "nccl" not in name.lower() and "rccl" not in name.lower():
            continue
        launcher = linked.parent[i]
        h = linked.host_index[launcher] if launcher >= 0 else -1
        kernel_hint = name
        if "SendRecv" in name and h >= 0:
            kernel_hint = ""  # SendRecv kernels carry all-to-all, send or recv: the host op says which
        info = describe(h, kernel_hint) if h >= 0 else describe_kernel_only(name)
        if info is None:
            info = describe_kernel_only(name)
        if info is None:
            continue
        if g in dev.gpu_pg_name:
            info["pg_name"] = dev.gpu_pg_name[g]
        linked.node_type[i] = info.pop("node_type")
        linked.comm[i] = info
    for i, kind in enumerate(linked.kind):
        if kind != HOST_OP:
            continue
        h = linked.host_index[i]
        if not host.names[h].startswith(CPU_COLLECTIVE_PREFIXES):
            continue
        info = describe(h, host.names[h])
        if info is None:
            continue
        linked.node_type[i] = info.pop("node_type")
        linked.comm[i] = info
    linked.stats["comm_nodes"] = len(linked.comm)


def _default_process_group(linked: LinkedTrace) -> str:
    """The name of the run's only process group, "" when there are several or none is recorded."""
    process_groups = linked.host.process_groups
    if len(process_groups) == 1:
        return str(process_groups[0].get("pg_name", ""))
    distributed = linked.device.distributed
    pg_config = distributed.get("pg_config") if isinstance(distributed, dict) and not process_groups else None
    if isinstance(pg_config, list) and len(pg_config) == 1 and isinstance(pg_config[0], dict):
        return str(pg_config[0].get("pg_name", ""))
    return ""


def _describe_collective(linked: LinkedTrace, host_parent_idx: list[int], default_pg: str, h: int,
                         fallback_name: str) -> dict | None:
    """The COMM node host op h stands for (type, size, process group, peer), from the collective's record function,
    record_param_comms and c10d op found walking up from h; None when it names no collective."""
    host = linked.host
    collective = rpc = c10d = -1
    x, depth = h, 0
    while x >= 0 and depth < 12:
        name = host.names[x]
        if collective < 0 and name.startswith(COLLECTIVE_PREFIXES):
            collective = x
        elif rpc < 0 and name.startswith("record_param_comms"):
            rpc = x
        elif c10d < 0 and name.startswith("c10d::"):
            c10d = x
        p = host_parent_idx[x]
        x = p if p != x else -1
        depth += 1
    kinds = None
    for candidate in (collective, c10d):
        if candidate >= 0:
            kinds = classify_collective(host.names[candidate].split(":", 1)[-1])
            if kinds:
                break
    if kinds is None and rpc >= 0:
        values, types = host.comm_inputs.get(rpc, ([], []))
        for s in _string_inputs(values, types):
            kinds = classify_collective(s)
            if kinds:
                break
    if kinds is None:
        kinds = classify_collective(fallback_name)
    if kinds is None:
        return None
    size = 0
    for source in (collective, rpc, c10d):
        if source >= 0 and source in host.comm_inputs:
            size = tensor_bytes(*host.comm_inputs[source])
            if size:
                break
    info = {"node_type": kinds[0], "comm_type": kinds[1], "comm_size": size, "pg_name": default_pg}
    if rpc >= 0:
        values, types = host.comm_inputs.get(rpc, ([], []))
        strings = _string_inputs(values, types)
        names = [s for s in strings if classify_collective(s)]
        if names and strings.index(names[0]) > 0:  # torch >= 2.3: (..., pg_name, pg_desc, collective, ...)
            info["pg_name"] = strings[0]
    if kinds[0] in (COMM_SEND_NODE, COMM_RECV_NODE) and c10d >= 0:
        values, types = host.comm_inputs.get(c10d, ([], []))
        ints = _int_inputs(values, types)
        if ints:
            peer = ints[0]
            if kinds[0] == COMM_SEND_NODE:
                info.update(comm_src=linked.rank, comm_dst=peer)
            else:
                info.update(comm_src=peer, comm_dst=linked.rank)
            info["comm_tag"] = ints[1] if len(ints) > 1 else 0
    return info


def describe_kernel_only(name: str) -> dict | None:
    kinds = classify_collective(name.replace("SendRecv", "alltoall"))
    if kinds is None:
        return None
    return {"node_type": kinds[0], "comm_type": kinds[1], "comm_size": 0, "pg_name": ""}


@dataclass
class _Timeline:
    """The linked nodes by lane, shared by the dependency phases."""

    linked: LinkedTrace
    deps: list[list[int]]
    lane_nodes: dict[int, list[int]]   # lane -> its nodes in lane order (the step annotation last)
    position: list[int]                # node -> place in its lane's order
    step_node: list[bool]              # the step annotation and the observer's thread nodes
    lane_ops: dict[int, list[int]]     # lane -> its nodes but the step annotation, by start
    lane_starts: dict[int, list[float]]
    busy: dict[int, BusyTime]         # lane -> when its operators kept it busy
    cpu_lanes: list[int]
    own_ends: dict[int, list[float]]   # lane -> end times of its nodes, sorted
    launched: "_EnqueueOrder"          # CPU lane -> GPU work it enqueued
    on_stream: "_EnqueueOrder"         # GPU lane -> its work

    def add(self, source: int, target: int, rule: str) -> bool:
        """Edge source -> target when source started first (so every edge keeps the graph acyclic)."""
        ts = self.linked.ts
        if source == target or ts[source] > ts[target] or source in self.deps[target]:
            return False
        if ts[source] == ts[target] and self.linked.lane[source] == self.linked.lane[target] and \
                self.position[source] > self.position[target]:
            return False
        self.deps[target].append(source)
        self.linked.rule_edges[rule] += 1
        return True

    def first_op_from(self, lane: int, t: float) -> int:
        """The first operator of a lane starting at or after time t (-1 for none)."""
        p = bisect.bisect_left(self.lane_starts[lane], t)
        return self.lane_ops[lane][p] if p < len(self.lane_ops[lane]) else -1

    def note_wait(self, waiter: int, source_lane: int) -> None:
        """The waiter's thread sat idle before it while `source_lane` worked: that time is waiting (already on the
        path through the other lane), charged to what spans the idle gap on the waiter's thread."""
        linked = self.linked
        lane = linked.lane[waiter]
        ends = self.own_ends[lane]
        start = linked.ts[waiter]
        idle_from = own_ends_before(ends, start)
        overlap = self.busy[source_lane].overlap(idle_from, start)
        p = self.position[waiter]
        if overlap <= 0 or p == 0:
            return
        holder = _innermost_around(linked, self.lane_nodes[lane][p - 1], (idle_from + start) / 2)
        if holder >= 0:
            linked.wait[holder] += overlap


@dataclass
class _EnqueueOrder:
    """GPU nodes grouped by a lane, each group in the order it was enqueued (with the enqueue times, for bisect)."""

    nodes: dict[int, list[int]]
    times: dict[int, list[float]]

    @classmethod
    def of(cls, linked: LinkedTrace, key) -> "_EnqueueOrder":
        groups: dict[int, list[int]] = defaultdict(list)
        for g in linked.launch_ts:
            lane = key(g)
            if lane >= 0:
                groups[lane].append(g)
        for nodes in groups.values():
            nodes.sort(key=lambda g: linked.launch_ts[g])
        return cls(groups, {lane: [linked.launch_ts[g] for g in nodes] for lane, nodes in groups.items()})

    def last_before(self, lane: int, t: float, inclusive: bool = True) -> int:
        """Position in the lane's group of the last node enqueued before t (at t too when inclusive), or -1."""
        times = self.times.get(lane, [])
        return (bisect.bisect_right(times, t) if inclusive else bisect.bisect_left(times, t)) - 1


def _build_dependencies(linked: LinkedTrace, syncs: list[tuple[int, int, float]]) -> None:
    """Data dependencies from what orders two nodes in the program, never from a coincidence of the timeline.

    A simulator replays the graph on another network: an edge that the program does not impose (a collective that
    merely finished before some backward op started) would make that op wait for the slower collective. So:
    1. order_lanes: a thread runs its calls in order, a stream its kernels.
    2. link_launches: GPU work after the CPU op that launched it; a collective after the op that enqueued it.
    3. order_collectives: the collectives of one process group run one after another (one communicator).
    4. link_collective_consumers: the first op that touches a collective's buffer after enqueuing it, or waits on
       its work (DDP's finalize, the optimizer, `wait`), waits for it; on a GPU, the first kernel enqueued from then.
    5. link_blocked_callers: a call that blocked until its collective completed (a synchronous broadcast) is
       followed by the next op of its thread only after the collective.
    6. link_thread_handoffs: on the CPU, an op waits for the non-communication ops other threads finished before it
       started (forward -> autograd thread -> optimizer); no communication is linked this way.
    7. link_unexplained_waits: only for a collective without a consumer found in 4-5 (traces without tensor
       records): the op its thread resumed with after idling through the collective's end.
    8. link_stream_waits: a stream that waited on another's event (Kineto's CUDA sync events, when recorded) runs
       its next kernel after the last one enqueued on the other stream before the event was recorded; without
       those events, a collective kernel waits for the last kernel its thread enqueued on another stream before it
       (ProcessGroupNCCL makes its stream wait on the current one).
    9. link_synchronizing_calls: the first CPU op after a synchronising runtime call waits for the last GPU work
       enqueued before the call on the stream(s) it synchronised.
    Edges between the streams of one GPU come only from 2, 4, 8 and 9: kernels that the program let overlap stay
    free to. Every edge goes from an earlier start to a later one, so the graph is acyclic.

    Time a CPU op spent blocked (idle or inside a synchronising call while the lane it then depends on was busy) is
    recorded in `wait` and left out of its .et duration, so the critical path does not count it twice; such an op
    keeps the time of the chosen step, where its wait was measured, rather than its median over the steps.
    """
    timeline = order_lanes(linked)
    link_launches(timeline)
    order_collectives(timeline)
    consumed = link_collective_consumers(timeline)
    consumed |= link_blocked_callers(timeline)
    link_thread_handoffs(timeline)
    link_unexplained_waits(timeline, [i for i in linked.comm if i not in consumed])
    link_stream_waits(timeline)
    link_synchronizing_calls(timeline, syncs)
    deps = timeline.deps
    wait = linked.wait
    for i in range(len(linked.kind)):
        if len(deps[i]) > 1:
            deps[i] = list(dict.fromkeys(deps[i]))
        if wait[i] > 0.0 and linked.traced_excl:
            # Its wait was measured in the chosen step: so is its time (a median over the steps would mix in other
            # steps' waits, as the step annotation's idle time at a slow rate, and leave some of them as compute).
            linked.excl[i] = linked.traced_excl[i]
        if wait[i] > linked.excl[i]:
            wait[i] = linked.excl[i]
    linked.deps = deps
    linked.stats["sync_edges"] = linked.rule_edges["synchronising call"]
    linked.stats["dependency_rules"] = dict(sorted(linked.rule_edges.items()))
    linked.stats["lanes"] = len(linked.lanes)
    linked.stats["wait_us"] = round(sum(wait), 1)


def order_lanes(linked: LinkedTrace) -> _Timeline:
    """Chain every lane's nodes in order: by start, callers before callees; the step annotation last (its own time
    is the thread's time between operators, spread over the step: paths leaving the thread mid-step must not carry
    the rest of the step's gaps). A caller placed after its callee stops being the callee's ctrl dependency."""
    n = len(linked.kind)
    ts, dur, lane_of, kind = linked.ts, linked.dur, linked.lane, linked.kind
    deps: list[list[int]] = [[] for _ in range(n)]
    lane_nodes: dict[int, list[int]] = defaultdict(list)
    for i in range(n):
        lane_nodes[lane_of[i]].append(i)
    tiebreak = _tiebreak_keys(linked)
    step_node = [kind[i] != GPU_OP and (linked.name(i).startswith(STEP_PREFIX) or is_structural(linked.name(i)))
                 for i in range(n)]
    position = [0] * n
    for lane, nodes in lane_nodes.items():
        nodes.sort(key=lambda i: (ts[i] + dur[i], 1, 0, tiebreak[i]) if step_node[i] else
                   (ts[i], 0, -dur[i], tiebreak[i]))
        for p, i in enumerate(nodes):
            position[i] = p
        for a, b in zip(nodes, nodes[1:]):
            deps[b].append(a)
    for i in range(n):
        p = linked.parent[i]
        if p >= 0 and lane_of[p] == lane_of[i] and position[p] > position[i]:
            linked.parent[i] = -1
    lane_ops = {lane: [i for i in nodes if not step_node[i]] for lane, nodes in lane_nodes.items()}
    for nodes in lane_ops.values():
        nodes.sort(key=lambda i: (ts[i], position[i]))
    return _Timeline(
        linked=linked, deps=deps, lane_nodes=lane_nodes, position=position, step_node=step_node, lane_ops=lane_ops,
        lane_starts={lane: [ts[i] for i in nodes] for lane, nodes in lane_ops.items()},
        busy={lane: BusyTime([ts[i] for i in nodes], [ts[i] + dur[i] for i in nodes])
              for lane, nodes in lane_ops.items()},
        cpu_lanes=[lane for lane, key in enumerate(linked.lanes) if key[0] == "cpu"],
        own_ends={lane: sorted(ts[i] + dur[i] for i in nodes) for lane, nodes in lane_nodes.items()},
        launched=_EnqueueOrder.of(linked, lambda g: lane_of[linked.parent[g]] if linked.parent[g] >= 0 else -1),
        on_stream=_EnqueueOrder.of(linked, lambda g: lane_of[g]))


def link_launches(timeline: _Timeline) -> None:
    """GPU work after its launch; a collective on a worker thread after the op that enqueued it; a CPU op after a
    caller on another thread that had finished when it started. The observer names as parent whatever record
    function was last opened on any thread: one that is no cause stops being the node's ctrl dependency."""
    linked = timeline.linked
    ts, dur, lane_of, kind, parent = linked.ts, linked.dur, linked.lane, linked.kind, linked.parent
    enqueuers = _collective_enqueuers(timeline)
    for i in range(len(kind)):
        p = parent[i]
        if i in linked.comm and kind[i] != GPU_OP:
            p = enqueuers.get(i, p if p >= 0 and lane_of[p] != lane_of[i] and not timeline.step_node[p] else -1)
            parent[i] = p if p >= 0 and timeline.add(p, i, "enqueue") else -1
            continue
        if p < 0 or lane_of[p] == lane_of[i]:
            continue
        if kind[i] == GPU_OP:
            timeline.add(p, i, "launch")
        elif ts[p] + dur[p] <= ts[i] and p not in linked.comm:
            timeline.add(p, i, "caller")
        else:
            parent[i] = -1  # a ctrl dep must also be a data ancestor; this one is not


def _collective_enqueuers(timeline: _Timeline) -> dict[int, int]:
    """CPU-thread collective -> the c10d op on another thread that enqueued it: the last one that started before it
    and holds the same tensors."""
    linked = timeline.linked
    host, ts = linked.host, linked.ts
    c10d_by_storage: dict[int, list[int]] = defaultdict(list)
    for i, h in enumerate(linked.host_index):
        if h >= 0 and host.names[h].startswith("c10d::") and i not in linked.comm:
            for s in host.storages[h]:
                c10d_by_storage[s].append(i)
    for nodes in c10d_by_storage.values():
        nodes.sort(key=lambda i: ts[i])
    starts = {s: [ts[x] for x in nodes] for s, nodes in c10d_by_storage.items()}
    enqueuers = {}
    for i in linked.comm:
        h = linked.host_index[i]
        if h < 0 or linked.kind[i] == GPU_OP:
            continue
        best = -1
        for s in host.storages[h]:
            nodes = c10d_by_storage.get(s, ())
            q = bisect.bisect_right(starts.get(s, ()), ts[i]) - 1
            while q >= 0 and linked.lane[nodes[q]] == linked.lane[i]:
                q -= 1
            if q >= 0 and (best < 0 or ts[nodes[q]] > ts[best]):
                best = nodes[q]
        if best >= 0:
            enqueuers[i] = best
    return enqueuers


def order_collectives(timeline: _Timeline) -> None:
    """The collectives of one process group run in the order they were issued (one communicator, one link). A
    collective on a CPU worker thread is issued when the c10d op that enqueued it started (link_launches made that
    op its parent): gloo runs its queue on two threads, so two collectives enqueued back to back (DDP's broadcast of
    a model's float and integer buffers) can start there in either order, which differed between the ranks of one
    run and gave their .et files the two broadcasts in opposite orders."""
    linked = timeline.linked
    ts, parent, lane = linked.ts, linked.parent, linked.lane

    def issued(i: int) -> float:
        enqueuer = parent[i]
        on_worker = linked.kind[i] != GPU_OP and enqueuer >= 0 and lane[enqueuer] != lane[i]
        return ts[enqueuer] if on_worker else ts[i]

    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, info in linked.comm.items():
        key = linked.lanes[lane[i]]
        place = ("gpu", key[1]) if key[0] == "gpu" else ("cpu",)
        groups[(info.get("pg_name", ""),) + place].append(i)
    for nodes in groups.values():
        nodes.sort(key=lambda i: (issued(i), ts[i], timeline.position[i]))
        for a, b in zip(nodes, nodes[1:]):
            if linked.lane[a] != linked.lane[b]:
                timeline.add(a, b, "collective order")


def _enqueue_call(linked: LinkedTrace, i: int) -> int:
    """The outermost communication call on the issuing thread around collective i's enqueue (c10d::allreduce_
    around record_param_comms around nccl:all_reduce); -1 when unknown."""
    x = linked.parent[i]
    outer = -1
    depth = 0
    while x >= 0 and depth < 8 and linked.kind[x] != GPU_OP:
        name = linked.name(x)
        if not name.startswith(COMM_CALL_PREFIXES):
            break
        outer = x
        x = linked.parent[x]
        depth += 1
    return outer


def _collective_seq(linked: LinkedTrace, call: int) -> int:
    """The sequence number record_param_comms gives a collective (what a `wait` record names); -1 when none."""
    host = linked.host
    x, depth = call, 0
    while x >= 0 and depth < 8:
        h = linked.host_index[x]
        if h >= 0 and host.names[h].startswith("record_param_comms"):
            values, types = host.comm_inputs.get(h, ([], []))
            ints = _int_inputs(values, types)
            if ints and "wait" not in _string_inputs(values, types):
                return ints[0]
        x = linked.parent[x] if linked.parent[x] != x else -1
        depth += 1
    return -1


def link_collective_consumers(timeline: _Timeline) -> set[int]:
    """A collective's consumer is the first op of the issuing thread, after the enqueue call returned, that reads or
    writes one of its tensors, or that waits on its work (`record_param_comms` 'wait' with its sequence number).
    On the CPU that op waits for the collective; on a GPU the first kernel enqueued from that op on does. Returns
    the collectives given a consumer."""
    linked = timeline.linked
    host, ts, dur, lane_of = linked.host, linked.ts, linked.dur, linked.lane
    waits_by_seq: dict[int, list[int]] = defaultdict(list)
    touching: dict[int, list[int]] = defaultdict(list)  # storage -> non-communication CPU ops touching it, by start
    for i, h in enumerate(linked.host_index):
        if h < 0 or timeline.step_node[i]:
            continue
        name = host.names[h]
        if name.startswith("record_param_comms"):
            values, types = host.comm_inputs.get(h, ([], []))
            ints = _int_inputs(values, types)
            if ints and "wait" in _string_inputs(values, types):
                waits_by_seq[ints[0]].append(i)
        elif not name.startswith(COMM_CALL_PREFIXES) and i not in linked.comm:
            for s in host.storages[h]:
                touching[s].append(i)
    for nodes in touching.values():
        nodes.sort(key=lambda i: ts[i])
    touch_times = {s: [ts[i] for i in nodes] for s, nodes in touching.items()}
    consumed: set[int] = set()
    for i in sorted(linked.comm, key=lambda x: ts[x]):
        call = _enqueue_call(linked, i) if linked.kind[i] == GPU_OP else linked.parent[i]
        if call < 0:
            continue
        issuing_lane, returned = lane_of[call], ts[call] + dur[call]
        storages: set[int] = set()
        x = i if linked.kind[i] != GPU_OP else linked.parent[i]
        while x >= 0:  # the collective's own record up to the enqueue call: all hold its buffer
            if linked.host_index[x] >= 0:
                storages.update(host.storages[linked.host_index[x]])
            x = linked.parent[x] if x != call and linked.parent[x] != x else -1
        if linked.kind[i] != GPU_OP:
            storages.update(host.storages[linked.host_index[call]] if linked.host_index[call] >= 0 else ())
        candidates = []
        for s in storages:
            nodes = touching.get(s, ())
            q = bisect.bisect_left(touch_times[s], returned) if nodes else 0
            while q < len(nodes) and lane_of[nodes[q]] != issuing_lane:
                q += 1
            if q < len(nodes):
                candidates.append(nodes[q])
        seq = _collective_seq(linked, call)
        for w in waits_by_seq.get(seq, ()) if seq >= 0 else ():
            if ts[w] >= ts[call]:
                candidates.append(w)
        if not candidates:
            continue
        consumer = min(candidates, key=lambda y: ts[y])
        if linked.kind[i] != GPU_OP:
            if timeline.add(i, consumer, "consumer"):
                consumed.add(i)
                timeline.note_wait(consumer, lane_of[i])
            continue
        lane = lane_of[consumer]
        q = timeline.launched.last_before(lane, ts[consumer], inclusive=False) + 1
        nodes = timeline.launched.nodes.get(lane, [])
        while q < len(nodes) and lane_of[nodes[q]] == lane_of[i]:
            q += 1
        if q < len(nodes) and ts[nodes[q]] >= ts[i] + dur[i] - 1.0 and timeline.add(i, nodes[q], "consumer"):
            consumed.add(i)
    return consumed


def link_blocked_callers(timeline: _Timeline) -> set[int]:
    """A call that stayed open through most of the collective it enqueued on another thread (a synchronous gloo
    broadcast or all_reduce) blocked on it: the overlap is waiting, and its thread's next op follows the collective."""
    linked = timeline.linked
    ts, dur, lane_of, kind = linked.ts, linked.dur, linked.lane, linked.kind
    lane_children: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(linked.lane_parent):
        if p >= 0:
            lane_children[p].append(i)
    blocked: set[int] = set()
    for i in linked.comm:
        p = linked.parent[i]
        if p < 0 or kind[i] == GPU_OP or lane_of[p] == lane_of[i]:
            continue
        lo, hi = max(ts[p], ts[i]), min(ts[p] + dur[p], ts[i] + dur[i])
        if hi - lo > 0.5 * dur[i] > 0:
            children = lane_children.get(p, ())
            inner = BusyTime([ts[c] for c in children], [ts[c] + dur[c] for c in children]).overlap(lo, hi)
            linked.wait[p] += max(0.0, hi - lo - inner)
            after = timeline.first_op_from(lane_of[p], ts[p] + dur[p])
            if after >= 0 and timeline.add(i, after, "blocked caller"):
                blocked.add(i)
    return blocked


def link_thread_handoffs(timeline: _Timeline) -> None:
    """On the CPU: an op waits for what the other threads' non-communication ops finished before it started (the
    autograd thread starts after the forward, the optimizer after the backward); a thread that resumed after an
    idle gap also waits for the other thread's op that ran through the gap and closed just after (the engine wakes
    its waiter before the op's record closes)."""
    linked = timeline.linked
    ts, dur = linked.ts, linked.dur
    lanes = timeline.cpu_lanes
    if len(lanes) < 2:
        return
    position, step_node, comm = timeline.position, timeline.step_node, linked.comm
    inter_thread = linked.inter_thread_dep
    by_end = {}
    for lane in lanes:
        nodes = [i for i in timeline.lane_nodes[lane] if dur[i] > 0 and i not in comm and not step_node[i]]
        nodes.sort(key=lambda i: (ts[i] + dur[i], ts[i]))
        by_end[lane] = nodes
    for target in lanes:
        targets = [i for i in timeline.lane_nodes[target] if i not in comm]
        own_ends = timeline.own_ends[target]
        waited: dict[int, tuple[float, int]] = {}
        for source in lanes:
            finished = by_end[source]
            if source == target or not finished:
                continue
            j = 0
            best = -1
            last_added = -1
            for i in targets:
                start = ts[i]
                while j < len(finished) and ts[finished[j]] + dur[finished[j]] <= start and ts[finished[j]] < start:
                    best = max(best, position[finished[j]])
                    j += 1
                if j < len(finished) and not step_node[i]:
                    idle_from = own_ends_before(own_ends, start)
                    gap = start - idle_from
                    while j < len(finished) and gap > 0:
                        other = finished[j]
                        other_end = ts[other] + dur[other]
                        cover = min(other_end, start) - max(ts[other], idle_from)
                        if not (ts[other] < start and other_end - start <= COMPLETION_SLACK_SHARE * gap
                                and cover >= BLOCKED_COVER * gap):
                            break
                        best = max(best, position[other])
                        j += 1
                if best > last_added:
                    src = timeline.lane_nodes[source][best]
                    last_added = best
                    if timeline.add(src, i, "thread handoff"):
                        prev = inter_thread.get(i)
                        if prev is None or ts[src] + dur[src] > ts[prev] + dur[prev]:
                            inter_thread[i] = src
                        overlap = timeline.busy[source].overlap(own_ends_before(own_ends, start), start)
                        if overlap > waited.get(i, (0.0, -1))[0]:
                            waited[i] = (overlap, source)
        for i, (_, source) in waited.items():
            timeline.note_wait(i, source)


def link_unexplained_waits(timeline: _Timeline, collectives: list[int]) -> None:
    """For a CPU-thread collective with no consumer in the trace: the op another thread resumed with, after idling
    through most of the collective's tail, when the collective closed at most a little after the resume (its
    worker wakes the waiters before it closes the record)."""
    linked = timeline.linked
    ts, dur, lane_of = linked.ts, linked.dur, linked.lane
    for i in collectives:
        if linked.kind[i] == GPU_OP:
            continue
        end = ts[i] + dur[i]
        for lane in timeline.cpu_lanes:
            if lane == lane_of[i]:
                continue
            ops, starts = timeline.lane_ops[lane], timeline.lane_starts[lane]
            q = bisect.bisect_left(starts, ts[i])
            own_ends = timeline.own_ends[lane]
            while q < len(ops):
                resumed = ops[q]
                start = ts[resumed]
                idle_from = own_ends_before(own_ends, start)
                gap = start - idle_from
                if start > end + gap:
                    break
                cover = min(end, start) - max(ts[i], idle_from)
                if gap > 0 and end - start <= COMPLETION_SLACK_SHARE * gap and cover >= COLLECTIVE_COVER * gap \
                        and end >= idle_from:
                    if timeline.add(i, resumed, "idle until it closed"):
                        timeline.note_wait(resumed, lane_of[i])
                    break
                q += 1


def link_stream_waits(timeline: _Timeline) -> None:
    """Cross-stream waits: from the recorded CUDA sync events when the trace has them, else the NCCL rule."""
    if linked_stream_wait_events(timeline):
        return
    link_collective_stream_waits(timeline)


def linked_stream_wait_events(timeline: _Timeline) -> bool:
    """Each 'Stream Wait Event' (cudaStreamWaitEvent): the first kernel enqueued on the waiting stream after the
    call depends on the last kernel enqueued on the recorded stream before its cudaEventRecord. False when the
    trace recorded no such events."""
    linked = timeline.linked
    dev = linked.device
    if not dev.stream_waits:
        return False
    rt_start = {corr: t for corr, t in zip(dev.rt_corr, dev.rt_ts) if corr >= 0}
    lane_of_stream = {key: lane for lane, key in enumerate(linked.lanes)}
    on_stream = timeline.on_stream
    for device, stream, waited_stream, wait_corr, record_corr in dev.stream_waits:
        waited_at, recorded_at = rt_start.get(wait_corr), rt_start.get(record_corr)
        waiting, waited = lane_of_stream.get(("gpu", device, stream)), lane_of_stream.get(("gpu", device, waited_stream))
        if waited_at is None or recorded_at is None or waiting is None or waited is None:
            continue
        p = on_stream.last_before(waited, recorded_at)
        q = on_stream.last_before(waiting, waited_at, inclusive=False) + 1
        if p >= 0 and q < len(on_stream.nodes[waiting]):
            timeline.add(on_stream.nodes[waited][p], on_stream.nodes[waiting][q], "cuda stream wait event")
    return True


def link_collective_stream_waits(timeline: _Timeline) -> None:
    """A collective kernel starts after the last kernel its thread enqueued on another stream of the GPU before
    it: ProcessGroupNCCL makes its stream wait on the current stream's work so far."""
    linked = timeline.linked
    lane_of = linked.lane
    for i in linked.comm:
        if linked.kind[i] != GPU_OP or linked.parent[i] < 0:
            continue
        lane = lane_of[linked.parent[i]]
        device = linked.lanes[lane_of[i]][1]
        q = timeline.launched.last_before(lane, linked.launch_ts[i], inclusive=False)
        nodes = timeline.launched.nodes[lane]
        while q >= 0 and (lane_of[nodes[q]] == lane_of[i] or linked.lanes[lane_of[nodes[q]]][1] != device):
            q -= 1
        if q >= 0:
            timeline.add(nodes[q], i, "stream wait")


def link_synchronizing_calls(timeline: _Timeline, syncs: list[tuple[int, int, float]]) -> None:
    """The first CPU op after a synchronising call waits for the last GPU work enqueued before the call: on every
    stream of the device for a device or context synchronisation, else on the stream the thread last enqueued to.
    The time the call spent while the GPU was busy is waiting."""
    linked = timeline.linked
    dev, lane_of, ts = linked.device, linked.lane, linked.ts
    gpu_lanes_of_device: dict[Any, list[int]] = defaultdict(list)
    for lane, key in enumerate(linked.lanes):
        if key[0] == "gpu":
            gpu_lanes_of_device[key[1]].append(lane)
    if not gpu_lanes_of_device:
        return
    device_busy = {device: BusyTime([ts[i] for lane in lanes for i in timeline.lane_nodes[lane]],
                                     [ts[i] + linked.dur[i] for lane in lanes for i in timeline.lane_nodes[lane]])
                   for device, lanes in gpu_lanes_of_device.items()}
    launched, on_stream = timeline.launched, timeline.on_stream
    whole_device = ("DeviceSynchronize", "CtxSynchronize")
    for lane, r, end in syncs:
        holder = linked.launcher_of_rt.get(r, -1)
        if holder >= 0:
            linked.wait[holder] += max(b.overlap(dev.rt_ts[r], end) for b in device_busy.values())
        waiter = timeline.first_op_from(lane, end)
        if waiter < 0:
            continue
        called = dev.rt_ts[r]
        q = launched.last_before(lane, called)
        if q < 0:
            continue
        mine = launched.nodes[lane]
        if dev.rt_names[r].endswith(whole_device):
            streams = gpu_lanes_of_device[linked.lanes[lane_of[mine[q]]][1]]
        else:
            streams = [lane_of[mine[q]]]
        for stream in streams:
            p = on_stream.last_before(stream, called)
            if p >= 0 and timeline.add(on_stream.nodes[stream][p], waiter, "synchronising call"):
                linked.sync_deps.setdefault(waiter, []).append(on_stream.nodes[stream][p])


def own_ends_before(own_ends: list[float], t: float) -> float:
    q = bisect.bisect_right(own_ends, t) - 1
    return own_ends[q] if q >= 0 else t


def _innermost_around(linked: LinkedTrace, node: int, t: float) -> int:
    """The innermost node on `node`'s thread that is `node` or encloses it and whose span contains time t."""
    ts, dur = linked.ts, linked.dur
    depth = 0
    while node >= 0 and depth < 10000:
        if ts[node] <= t <= ts[node] + dur[node]:
            return node
        node = linked.lane_parent[node]
        depth += 1
    return -1


def _tiebreak_keys(linked: LinkedTrace) -> list:
    """Order among nodes with equal start and duration: callers first (the host's rf_id grows at op start)."""
    dev, host = linked.device, linked.host
    keys = []
    for i, kind in enumerate(linked.kind):
        if kind == GPU_OP:
            keys.append((dev.gpu_corr[linked.src[i]], i))
        elif kind == HOST_OP:
            keys.append((host.rf_ids[linked.host_index[i]], i))
        else:
            keys.append((dev.cpu_ext[linked.src[i]], i))
    return keys


def _assign_ids(linked: LinkedTrace) -> None:
    """Ids as chakra_trace_link numbers them: host nodes in id order, each followed by the GPU ops it launched."""
    host = linked.host
    node_of_host: dict[int, int] = {}
    for i, h in enumerate(linked.host_index):
        if h >= 0:
            node_of_host[h] = i
    gpu_children: dict[int, list[int]] = defaultdict(list)
    for i, kind in enumerate(linked.kind):
        if kind == GPU_OP:
            gpu_children[linked.parent[i]].append(i)
    ids = [-1] * len(linked.kind)
    next_id = 0
    for h in sorted(range(len(host)), key=lambda x: host.ids[x]):
        i = node_of_host.get(h)
        if i is not None:
            ids[i] = next_id
        next_id += 1
        if i is not None:
            for g in sorted(gpu_children.get(i, ()), key=lambda x: linked.ts[x]):
                ids[g] = next_id
                next_id += 1
    for i, kind in enumerate(linked.kind):
        if kind == KINETO_OP:
            ids[i] = next_id
            next_id += 1
            for g in sorted(gpu_children.get(i, ()), key=lambda x: linked.ts[x]):
                ids[g] = next_id
                next_id += 1
    linked.node_id = ids
