"""Check a written .et the way a simulator will use it: decode, resolve, walk, time, and compare ranks."""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from chakra.schema.protobuf.et_def_pb2 import (
    ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BROADCAST, COMM_COLL_NODE, COMM_RECV_NODE, COMM_SEND_NODE, COMP_NODE,
    REDUCE_SCATTER, GlobalMetadata, Node,
)

from .graph import longest_path, topological_order
from .link import COMM_TYPE_NAMES, NODE_TYPE_NAMES

# ASTRA-sim counts simulated time in nanoseconds as a double (timespec_t) and a 64-bit integer (Tick): a message whose
# time does not fit wraps to 0 (the collective is simulated as free), and past 2^53 ns (104 days) the double no longer
# counts every nanosecond and ranks stop unfinished. Measured on the 2-rank GPT-2 tiny: a step of 8.4e15 ns simulates,
# one of 8.4e16 ns does not.
CLOCK_LIMIT_NS = 2 ** 53
# Files ASTRA-sim holds open besides one .et per NPU (its feeders keep them open from the start): stdin, stdout,
# stderr and its two log files. Measured: 16 NPUs need 21 open files, 128 need 133; one fewer and it exits 1 saying
# nothing about why.
ASTRA_SIM_OTHER_FILES = 5
# Node types ASTRA-sim's workload layer issues (it aborts on METADATA_NODE and skips INVALID_NODE).
ACCEPTED_NODE_TYPES = {COMP_NODE, COMM_COLL_NODE, COMM_SEND_NODE, COMM_RECV_NODE}
# Collectives ASTRA-sim implements (BROADCAST replays its traced duration).
ACCEPTED_COMM_TYPES = {ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, BROADCAST}


class EtFormatError(Exception):
    """The file is not a sequence of length-delimited Chakra messages."""


# The .et framing, read and written in this one place. Written with chakra's protolib.encodeMessage. Read by hand:
# protolib.decodeMessage takes a truncated .et for a shorter one (a cut between two fields of the last node parses
# as a smaller node: 67 of the last 2,000 cut points of the bert_tiny_2r fixture read without an error) and a bad
# length prefix for the end of the file; validation must report both. Measured on a 300,000-node .et (126 MB, the
# fixture's nodes repeated; /tmp script, 2-core machine): writing 0.22 s by hand, 0.48 s with protolib (with
# SerializedMessage; 1.27 s from Node objects); reading and parsing every node 1.38 s here, 0.87 s with protolib.
class SerializedMessage:
    """A message already serialized (a node from cached fragments, a source node copied unchanged), in the shape
    protolib.encodeMessage takes."""

    __slots__ = ("blob",)

    def __init__(self, blob: bytes):
        self.blob = blob

    def SerializeToString(self) -> bytes:
        return self.blob


def iter_et_messages(path: str | Path) -> Iterator[bytes]:
    """Raw messages of a length-delimited .et (GlobalMetadata first), decoded from memory in one pass."""
    data = Path(path).read_bytes()
    pos, end = 0, len(data)
    while pos < end:
        size = shift = 0
        while True:
            if pos >= end:
                raise EtFormatError(f"{path}: truncated length prefix at byte {pos}")
            byte = data[pos]
            pos += 1
            size |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
            shift += 7
            if shift > 63:
                raise EtFormatError(f"{path}: bad length prefix at byte {pos}")
        if pos + size > end:
            raise EtFormatError(f"{path}: truncated message at byte {pos} ({size} bytes announced)")
        yield data[pos:pos + size]
        pos += size


def read_et(path: str | Path) -> tuple[GlobalMetadata, list[Node]]:
    messages = iter_et_messages(path)
    metadata = GlobalMetadata()
    try:
        metadata.ParseFromString(next(messages))
    except StopIteration:
        raise EtFormatError(f"{path}: empty .et") from None
    nodes = []
    for blob in messages:
        node = Node()
        node.ParseFromString(blob)
        nodes.append(node)
    return metadata, nodes


@dataclass
class EtReport:
    """What validate_et found in one .et."""

    path: str
    nodes: int = 0
    nodes_by_type: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    visited: int = 0
    critical_path_us: float = 0.0
    traced_critical_path_us: float = 0.0  # with the durations as traced (traced_micros where the .et has it)
    traced_step_us: float = 0.0
    rank: int | None = None
    # (process group, comm type name, bytes) of every collective in start order
    collectives: list[tuple[str, str, int]] = field(default_factory=list)
    comm_bytes: int = 0
    p2p: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def read_et_metadata(messages, path: str | Path) -> GlobalMetadata:
    """The global metadata, the first message of a .et (EtFormatError for an empty file)."""
    metadata = GlobalMetadata()
    try:
        metadata.ParseFromString(next(messages))
    except StopIteration:
        raise EtFormatError(f"{path}: empty .et") from None
    return metadata


def validate_et(path: str | Path) -> EtReport:
    """Decode the .et and check it: dependencies resolve, node types are accepted, collectives are complete, and a
    walk that issues every node whose dependencies are done (as ASTRA-sim's feeder does) reaches all nodes.
    Also computes the critical path (longest dependency chain of durations). Nodes are decoded one at a time into
    columns, so checking a large .et needs little memory."""
    report = EtReport(path=str(path))
    ids: list[int] = []
    deps: list[tuple] = []
    durations: list[int] = []
    traced_durations: list[int] = []
    type_counts: Counter = Counter()
    collectives = []
    try:
        messages = iter_et_messages(path)
        metadata = read_et_metadata(messages, path)
        node = Node()
        for blob in messages:
            node.Clear()
            node.ParseFromString(blob)
            ids.append(node.id)
            deps.append(tuple(set(node.data_deps) | set(node.ctrl_deps)))
            durations.append(node.duration_micros)
            traced_durations.append(next((a.int64_val for a in node.attr if a.name == "traced_micros"),
                                         node.duration_micros))
            type_counts[NODE_TYPE_NAMES.get(node.type, str(node.type))] += 1
            _check_node(node, report, collectives, len(ids) - 1)
    except (EtFormatError, OSError) as e:
        report.problems.append(str(e))
        return report
    except Exception as e:  # protobuf decode errors
        report.problems.append(f"{path}: not a Chakra .et ({e})")
        return report
    meta = {a.name: getattr(a, a.WhichOneof("value")) for a in metadata.attr if a.WhichOneof("value")}
    report.rank = meta.get("rank")
    report.traced_step_us = float(meta.get("traced_step_micros", 0))
    report.nodes = len(ids)
    report.nodes_by_type = dict(type_counts)
    index_of: dict[int, int] = {}
    for index, node_id in enumerate(ids):
        if node_id in index_of:
            report.problems.append(f"duplicate node id {node_id}")
        index_of[node_id] = index
    dangling = [(ids[i], d) for i, ds in enumerate(deps) for d in ds if d not in index_of]
    if dangling:
        report.problems.append(f"{len(dangling)} dependencies on missing nodes (node {dangling[0][0]} depends on "
                               f"missing node {dangling[0][1]})")
        return report
    # Issue order: a node runs when all its data and ctrl dependencies are done (ASTRA-sim's feeder needs both).
    parents = [[index_of[dep] for dep in ds] for ds in deps]
    order = topological_order(parents)
    report.visited = len(order)
    if len(order) != len(ids):
        report.problems.append(f"only {len(order)} of {len(ids)} nodes can be issued: a dependency cycle")
    collectives.sort()
    # The order a simulator issues them in: each once its dependencies are done (before serve_in_turn changes the
    # durations). Not the traced start order: gloo runs its queue on two threads, so two collectives enqueued back
    # to back (DDP's broadcast of a model's float and integer buffers) start there in either order, which differed
    # between the ranks of one run
    finish = longest_path(parents, durations, order)[0]
    issued = sorted(collectives, key=lambda c: (finish[c[-1]] - durations[c[-1]], c))
    in_turn = [(start, pg, index) for start, _, pg, _, _, index in collectives]
    report.critical_path_us = float(timed_critical_path(parents, durations, in_turn, order))
    report.traced_critical_path_us = float(timed_critical_path(parents, traced_durations, in_turn, order))
    report.collectives = [(pg, comm_type, size) for _, _, pg, comm_type, size, _ in issued]
    return report


def timed_critical_path(parents: list[list[int]], durations: list[int], collectives: list[tuple[int, str, int]],
                        order: list[int] | None = None) -> int:
    """The longest dependency chain of durations (µs), the collectives served in turn in their process groups
    (serve_in_turn, which changes `durations`): how validate_et times an .et. `order`: topological_order(parents),
    when already known."""
    serve_in_turn(collectives, durations)
    return max(longest_path(parents, durations, order if order is not None else topological_order(parents))[0],
               default=0)


def serve_in_turn(collectives: list[tuple[int, str, int]], durations: list[int]) -> None:
    """Each collective's duration as the .et runs them: one after another in its process group. gloo works on two
    buckets at once on two threads, each slower for sharing the link; chained, the later one counts only from the
    earlier one's end, so the pair takes the time it took (a simulator times each at the full link, one after the
    other: the same total). `collectives`: (start, process group, node index), in start order."""
    last_end: dict[str, int] = {}
    for start, pg, index in collectives:
        end = start + durations[index]
        durations[index] = max(0, end - max(start, last_end.get(pg, start)))
        last_end[pg] = max(end, last_end.get(pg, end))


def _check_node(node: Node, report: EtReport, collectives: list, index: int) -> None:
    if node.type not in ACCEPTED_NODE_TYPES:
        report.problems.append(f"node {node.id} ({node.name}) has type {node.type}, which ASTRA-sim rejects")
    if node.type not in (COMM_COLL_NODE, COMM_SEND_NODE, COMM_RECV_NODE):
        # names only: decoding every attribute value of every compute node is most of the validation time
        if not any(a.name == "is_cpu_op" for a in node.attr):
            report.problems.append(f"node {node.id} ({node.name}) has no is_cpu_op attribute")
        return
    attrs = {a.name: getattr(a, a.WhichOneof("value")) for a in node.attr if a.WhichOneof("value")}
    if "is_cpu_op" not in attrs:
        report.problems.append(f"node {node.id} ({node.name}) has no is_cpu_op attribute")
    if attrs.get("is_cpu_op"):
        report.problems.append(f"communication node {node.id} is marked is_cpu_op (ASTRA-sim would not send it)")
    size = attrs.get("comm_size")
    if size is None:
        report.problems.append(f"communication node {node.id} ({node.name}) has no comm_size")
        size = 0
    report.comm_bytes += size
    if node.type == COMM_COLL_NODE:
        comm_type = attrs.get("comm_type")
        if comm_type not in ACCEPTED_COMM_TYPES:
            report.problems.append(f"collective {node.id} ({node.name}) has comm_type {comm_type}, which ASTRA-sim "
                                   "does not implement")
        collectives.append((node.start_time_micros, node.id, str(attrs.get("pg_name", "")),
                            COMM_TYPE_NAMES.get(comm_type, str(comm_type)), size, index))
    else:
        report.p2p += 1


def misnamed_rank(path: str | Path, file_rank: int, recorded_rank) -> str | None:
    """Why an .et named as rank `file_rank` is another rank's file (its metadata's `rank`, as the converter writes
    it), or None. A rank's file copied over another's (`cp x.0.et x.1.et`) runs the same collectives and passes
    every other check, and a simulation would replay rank 0 twice. Scaled files record no rank (ranks replaying
    one traced rank share a file): nothing to compare."""
    if recorded_rank is None or int(recorded_rank) == file_rank:
        return None
    return (f"{path}: holds rank {int(recorded_rank)} of its run, not rank {file_rank} as its name says (a rank's "
            f"file copied or renamed over another's); convert the run again")


def open_file_limit_problem(npus: int) -> str | None:
    """Why ASTRA-sim could not open a file per NPU under this shell's hard limit of open files, or None."""
    try:
        import resource
    except ImportError:  # Windows: no such limit to read
        return None
    needed = npus + ASTRA_SIM_OTHER_FILES
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard >= needed:
        return None
    return (f"{npus} NPUs need {needed} open files (ASTRA-sim keeps each NPU's .et open), but this shell allows "
            f"{hard} (ulimit -Hn); raise the hard limit (/etc/security/limits.conf, or ulimit -n as root) or "
            "simulate fewer ranks")


def group_members(listed: str, ranks: int) -> dict[str, list[int]]:
    """The process groups an .et's `process_groups` metadata lists (JSON, as the converter writes it): name -> ranks
    (every rank when the group names none); empty when it lists none or the list does not parse."""
    try:
        groups = json.loads(listed) if listed else []
    except ValueError:
        return {}
    return {str(group.get("pg_name", "")): [int(r) for r in group.get("ranks") or range(ranks)]
            for group in (groups if isinstance(groups, list) else []) if isinstance(group, dict)}


def collectives_agree(collectives_by_rank: dict[int, list[tuple[str, str, int]]],
                      members: dict[str, list[int]] | None = None) -> list[str]:
    """Problems that would deadlock a simulator: ranks whose collectives differ in count, order, type or size
    within a process group (all-to-all sizes may differ per rank, with uneven splits). Every rank takes part in
    every group it could be in, a rank with no collective at all included; `members` (group name -> its ranks,
    when known) leaves out the ranks a group does not hold."""
    problems: list[str] = []
    if len(collectives_by_rank) < 2:
        return problems
    grouped: dict[int, dict[str, list[tuple[str, int]]]] = {}
    for rank, collectives in collectives_by_rank.items():
        groups: dict[str, list[tuple[str, int]]] = defaultdict(list)
        for pg, comm_type, size in collectives:
            groups[pg].append((comm_type, size))
        grouped[rank] = groups
    names = set().union(*(set(groups) for groups in grouped.values()))
    for pg in sorted(names):
        label = f"process group {pg!r}" if pg else "the default process group"
        held = (members or {}).get(pg)
        ranks = sorted(r for r in grouped if not held or r in held)
        if len(ranks) < 2:
            continue
        reference_rank = ranks[0]
        reference = grouped[reference_rank].get(pg, [])
        for rank in ranks[1:]:
            sequence = grouped[rank].get(pg, [])
            if len(sequence) != len(reference):
                problems.append(f"{label}: rank {rank} has {len(sequence)} collectives, rank {reference_rank} "
                                f"has {len(reference)}")
                continue
            for n, ((t1, s1), (t2, s2)) in enumerate(zip(reference, sequence)):
                if t1 != t2 or (s1 != s2 and t1 != "ALL_TO_ALL"):
                    problems.append(f"{label}: collective #{n + 1} is {t1} of {s1} bytes on rank {reference_rank} "
                                    f"but {t2} of {s2} bytes on rank {rank}")
                    break
    return problems
