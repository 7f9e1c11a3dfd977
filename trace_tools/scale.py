"""Scale a converted data-parallel run from the k ranks it was traced on to N simulated ranks (ASTRA-sim NPUs).

Data parallelism makes this principled: every rank runs the same program and the gradient all-reduce carries the
same bytes at any world size; only the collective's cost changes, and that is the simulator's job. Output rank r
replays traced rank r mod k, so the measured spread between ranks survives. Nothing in a scaled file depends on
its output rank (ASTRA-sim takes the rank from the file name and runs a collective without a process group, or in
group "0", over every NPU), so the N files are hard links to k written files.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import math
import os
import re
import shlex
import shutil
import struct
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import orjson
from chakra.schema.protobuf.et_def_pb2 import (
    ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, COMM_COLL_NODE, COMM_RECV_NODE, COMM_SEND_NODE, COMP_NODE, REDUCE_SCATTER,
    AttributeProto, GlobalMetadata, Node,
)
from chakra.src.third_party.utils.protolib import encodeMessage

from .atomic import folder_held, publication, write_text_atomic
from .layout import CONVERSION_SUMMARY, ET_FILE_RE, TRACE_FILE_RE, et_name, et_sets, ranks_sharing_a_file
from .link import COMM_TYPE_NAMES, COMMUNICATION_CPU_ATTR
from .load import json_kind
from .pipeline import _writable, fallback_output_dir
from .summary import (ConvertedRun, et_fingerprint, format_bytes, rank_ranges, read_status_comment, run_info_files,
                      script_command, status_comment, unrecorded_et_file)
from .validate import (CLOCK_LIMIT_NS, EtFormatError, SerializedMessage, collectives_agree, iter_et_messages,
                       misnamed_rank, open_file_limit_problem, read_et_metadata, timed_critical_path, validate_et)

logger = logging.getLogger(__name__)

DEFAULT_NAME = "{name}_{ranks}npus"
NAME_CHARACTERS = "A-Za-z0-9_.+-"  # what a scaled set's name may hold (a regular expression's character class)
SUMMARY_NAME = "SCALE_SUMMARY.md"
STATUS_MARKER = "trace_tools-scale-status"  # SCALE_SUMMARY.md's machine-readable block (summary.status_comment)
# ASTRA-sim runs a collective whose pg_name is "" or "0" over every NPU (Workload::extract_comm_group), with no
# --comm-group-configuration; "0" is also PyTorch's name for the default (world) process group.
WORLD_GROUP = "0"
# Metadata this module writes; replaced when a scaled set is scaled again.
SCALE_ATTRS = {"rank", "world_size", "process_groups", "scaled", "source_rank", "traced_world_size", "compute_scale"}
# What run.json's "parallelism" field says for a data-parallel run (our trainer writes it; older runs lack it).
DATA_PARALLEL_NAMES = {"ddp", "dp", "data_parallel", "data-parallel", "distributeddataparallel"}
OVERRIDE_HINT = "--assume-data-parallel scales it anyway"
# Memory a rank takes at the least: a slot (one pointer) in each of ScaleResult's three per-rank lists
# (traced_of_rank, source_of_rank, content_of_rank); a count whose lists alone pass the memory this process may use
# is refused before they are built (it had been the OOM killer, or a MemoryError after seconds of allocating).
RANK_BYTES = 3 * struct.calcsize("P")


class ScaleError(Exception):
    """A problem with the input or a flag, said in one line that names the file or flag."""

    def __init__(self, where: str | Path, problem: str):
        self.where = str(where)
        self.problem = problem
        super().__init__(f"{where}: {problem}")


class NotDataParallelError(ScaleError):
    """The traced run is not (or not known to be) data-parallel, so scaling it would misstate its communication."""


# ---------------------------------------------------------------------------------------------------------------
# Reading the source set
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class SourceSet:
    """A converted run: `<name>.<rank>.et` for rank 0..k-1 in one folder."""

    folder: Path
    name: str
    paths: list[Path]

    @property
    def prefix(self) -> Path:
        return self.folder / self.name

    @property
    def ranks(self) -> int:
        return len(self.paths)


def find_source_set(source: str | Path) -> SourceSet:
    """The .et set in a run folder (or at a workload prefix such as ASTRA-sim's `--workload-configuration`)."""
    source = Path(source)
    if not source.is_dir():
        if source.parent.is_dir() and (source.parent / et_name(source.name, 0)).is_file():
            return _complete_set(source.parent, source.name)
        if source.is_file():
            raise ScaleError(source, "is a file; give the run folder or the workload prefix <dir>/<name>")
        raise ScaleError(source, "no such folder (expected a converted run folder with <name>.<rank>.et files)")
    sets = et_sets(source)
    if not sets:
        raise ScaleError(source, "no <name>.<rank>.et files; convert the traces first (convert_to_et.py)")
    if len(sets) > 1:
        if source.name not in sets:
            raise ScaleError(source, f"several .et sets ({', '.join(sorted(sets))}); name one as the prefix "
                             f"{source}/<name>")
        return _complete_set(source, source.name)
    return _complete_set(source, next(iter(sets)))


def _complete_set(folder: Path, name: str) -> SourceSet:
    ranks = set(et_sets(folder).get(name, ()))
    missing = sorted(set(range(max(ranks) + 1)) - ranks) if ranks else [0]
    if missing:
        raise ScaleError(folder / et_name(name, missing[0]),
                         f"missing (the set has ranks {rank_ranges(sorted(ranks))}; every rank from 0 up is needed)")
    return SourceSet(folder=folder, name=name, paths=[folder / et_name(name, r) for r in range(len(ranks))])


def check_against_conversion(source: SourceSet) -> None:
    """Refuse .et files that are not those the folder's CONVERSION_SUMMARY.md (summary.unrecorded_et_file) or
    SCALE_SUMMARY.md (unscaled_et_file) recorded: one cut short at a node boundary still decodes and validates, and
    would be scaled to N ranks as it is."""
    problem = unrecorded_et_file(source.folder, source.name, range(source.ranks)) or \
        unscaled_et_file(source.folder, source.name, range(source.ranks))
    if problem:
        raise ScaleError(*problem)


def read_scale_status(folder: Path) -> dict | None:
    """The status SCALE_SUMMARY.md in folder records (name, ranks, source, files...), or None when there is none."""
    status = read_status_comment(Path(folder) / SUMMARY_NAME, STATUS_MARKER)
    return status if isinstance(status, dict) else None


def scale_again_command(folder: Path, status: dict) -> str:
    """The scale_et.py command that writes the set SCALE_SUMMARY.md describes again, into the same folder."""
    words = [str(status.get("source")), "--ranks", str(status.get("ranks")), "--output-dir", str(folder), "--name",
             str(status.get("name"))]
    slow = {int(rank): factor for rank, factor in (status.get("slow") or {}).items()}
    slow.update({rank: 1 for rank in status.get("unslowed") or []})  # a scaled source's straggler made as traced
    for rank, factor in sorted(slow.items()):
        words += ["--slow", f"{rank}:{factor:g}"]
    return f"{script_command('scale_et')} {shlex.join(words)}"  # runnable as printed, from any folder


def unscaled_et_file(folder: Path, name: str, ranks: Iterable[int], *,
                     every_recorded_rank: bool = True) -> tuple[Path, str] | None:
    """The first .et of the set `name` in folder, among those of `ranks`, that is not the file scale_et.py wrote
    there as SCALE_SUMMARY.md records it (size and SHA-256 per rank), and why: a rank re-written by hand or by
    another scale run, or cut short. every_recorded_rank: a recorded rank that `ranks` lacks, or a rank beyond
    those recorded, is a problem too. None when every file is as recorded, or when the summary records no
    fingerprints of this set (another set, a summary written before they were recorded).

    Ranks that share a file (hard links) are hashed once: 1024 ranks of two files cost two hashes."""
    status = read_scale_status(folder)
    if not status or status.get("name") != name or not isinstance(status.get("files"), list):
        return None
    expected: dict[int, dict] = {}
    for fingerprint in status["files"]:
        for rank in fingerprint.get("ranks") or []:
            expected[rank] = {"size": fingerprint.get("size"), "sha256": fingerprint.get("sha256")}
    summary, again = folder / SUMMARY_NAME, scale_again_command(folder, status)
    present = set(ranks)
    hashed: dict[tuple[int, int], dict] = {}
    for rank in sorted(present | set(expected) if every_recorded_rank else present):
        path = folder / et_name(name, rank)
        if rank not in expected:
            return path, (f"{summary} records ranks 0-{status.get('ranks', 0) - 1} of {name}, not this one: the file "
                          f"was added since scale_et.py wrote the set ({again} writes it again)")
        if rank not in present:
            return path, f"missing, though {summary} records it written ({again} writes the set again)"
        try:
            stat = path.stat()
            key = (stat.st_dev, stat.st_ino)
            if key not in hashed:
                hashed[key] = et_fingerprint(path) if stat.st_size == expected[rank]["size"] else {}
        except OSError as e:
            return path, f"cannot read it ({e.strerror or e})"
        found = hashed[key]
        if (found.get("size"), found.get("sha256")) != (expected[rank]["size"], expected[rank]["sha256"]):
            return path, (f"not the file {summary} recorded for rank {rank} (re-written by hand or by another scale "
                          f"run, or cut short, since scale_et.py wrote it); {again} writes the set again")
    return None


@dataclass
class SourceEt:
    """One source .et in memory: its metadata, its node messages as read, and what its communication looks like."""

    path: Path
    metadata: GlobalMetadata
    blobs: list[bytes]
    node_types: list[int]
    comm_indices: list[int]
    # (process group, comm type name, bytes) of every collective in start order, as validate.EtReport has them
    collectives: list[tuple[str, str, int]] = field(default_factory=list)
    all_reduce_starts: list[int] = field(default_factory=list)
    p2p: int = 0
    first_backward_us: int | None = None
    # CPU nodes of the communication threads' work (trace_tools.core_sharing): it grows with the bytes a rank moves
    communication_cpu_indices: list[int] = field(default_factory=list)

    @property
    def meta(self) -> dict:
        return {a.name: getattr(a, a.WhichOneof("value")) for a in self.metadata.attr if a.WhichOneof("value")}


def read_source_et(path: Path) -> SourceEt:
    """Decode the .et once: messages are kept as bytes (copied unchanged into the scaled files), and the collectives,
    point-to-point nodes and the start of the backward pass are noted for the data-parallel check."""
    try:
        messages = iter_et_messages(path)
        metadata = read_et_metadata(messages, path)
        source = SourceEt(path=path, metadata=metadata, blobs=[], node_types=[], comm_indices=[])
        collectives = []
        node = Node()
        for blob in messages:
            node.Clear()
            node.ParseFromString(blob)
            index = len(source.blobs)
            source.blobs.append(blob)
            source.node_types.append(node.type)
            if node.type in (COMM_COLL_NODE, COMM_SEND_NODE, COMM_RECV_NODE):
                source.comm_indices.append(index)
                if node.type != COMM_COLL_NODE:
                    source.p2p += 1
                    continue
                attrs = {a.name: getattr(a, a.WhichOneof("value")) for a in node.attr if a.WhichOneof("value")}
                comm_type = attrs.get("comm_type")
                collectives.append((node.start_time_micros, node.id, str(attrs.get("pg_name", "")),
                                    COMM_TYPE_NAMES.get(comm_type, str(comm_type)), attrs.get("comm_size", 0)))
                if comm_type == ALL_REDUCE:
                    source.all_reduce_starts.append(node.start_time_micros)
            elif any(a.name == COMMUNICATION_CPU_ATTR for a in node.attr):
                source.communication_cpu_indices.append(index)
            elif _is_backward(node.name):
                start = node.start_time_micros
                if source.first_backward_us is None or start < source.first_backward_us:
                    source.first_backward_us = start
    except (EtFormatError, OSError) as e:
        raise ScaleError(path, f"cannot read the .et ({e})") from None
    except Exception as e:  # protobuf decode errors
        raise ScaleError(path, f"not a Chakra .et ({e})") from None
    collectives.sort()
    source.collectives = [(pg, comm_type, size) for _, _, pg, comm_type, size in collectives]
    return source


def _is_backward(name: str) -> bool:
    """An op of the backward pass: autograd's per-function record (host) or a `...Backward0` node."""
    return name.startswith("autograd::engine::evaluate_function") or "Backward" in name


# ---------------------------------------------------------------------------------------------------------------
# Is the run data-parallel?
# ---------------------------------------------------------------------------------------------------------------
def communication_problem(sources: list[SourceEt]) -> str | None:
    """Why the traced collectives are not the gradient all-reduce (and broadcasts) of one world group, or None."""
    first = sources[0]
    meta = first.meta
    if any(s.p2p for s in sources):
        return (f"{max(s.p2p for s in sources)} send/recv nodes per rank (pipeline parallelism or point-to-point "
                "exchanges name peer ranks, which do not exist at another world size)")
    kinds = Counter(comm_type for s in sources for _, comm_type, _ in s.collectives)
    per_rank = {kind: count // len(sources) or 1 for kind, count in kinds.items()}
    if kinds.get(COMM_TYPE_NAMES[ALL_TO_ALL]):
        return (f"{per_rank[COMM_TYPE_NAMES[ALL_TO_ALL]]} all-to-all collectives per rank (embedding or expert "
                "model parallelism: each rank's share changes with the world size)")
    sharded = sum(kinds.get(COMM_TYPE_NAMES[k], 0) for k in (ALL_GATHER, REDUCE_SCATTER))
    if sharded:
        return (f"{sharded // len(sources) or 1} all-gather/reduce-scatter collectives per rank (sharded data "
                "parallelism such as FSDP or ZeRO: the shard sizes change with the world size)")
    groups = sorted({pg or WORLD_GROUP for s in sources for pg, _, _ in s.collectives})
    if len(groups) > 1:
        return f"collectives in {len(groups)} process groups ({', '.join(groups)}): model parallelism"
    world = meta.get("world_size")
    for group in _process_groups(meta):
        if str(group.get("pg_name")) in groups and isinstance(group.get("group_size"), int) and world \
                and group["group_size"] != world:
            return (f"the collectives run in process group {group['pg_name']} of {group['group_size']} ranks, "
                    f"not over all {world}")
    if not kinds.get(COMM_TYPE_NAMES[ALL_REDUCE]):
        return ("no all-reduce: nothing in the trace is a gradient all-reduce (a 1-rank run has none; trace at least "
                "2 ranks)")
    for s in sources:
        count = len(s.all_reduce_starts)
        if s.first_backward_us is None:
            return (f"{count} all-reduces per rank and no backward pass in {s.path.name}: not a training step of "
                    "data parallelism (tensor-parallel layers all-reduce inside the forward)")
        forward = sum(1 for start in s.all_reduce_starts if start < s.first_backward_us)
        if forward:
            return (f"{forward} of {count} all-reduces in {s.path.name} run inside the forward, before the first "
                    "backward op (tensor parallelism); data parallelism all-reduces gradients in the backward")
    disagreement = collectives_agree({r: s.collectives for r, s in enumerate(sources)})
    if disagreement:
        return f"the traced ranks' collectives differ ({disagreement[0]})"
    return None


def _process_groups(meta: dict) -> list[dict]:
    try:
        groups = orjson.loads(meta.get("process_groups", "[]"))
    except orjson.JSONDecodeError:
        return []
    return [g for g in groups if isinstance(g, dict)] if isinstance(groups, list) else []


def find_run_info(source: SourceSet) -> tuple[Path | None, list[str]]:
    """run.json of the run the .et files were made from (run_info_files), and why each other one found was passed
    over: a run traced again under the same name replaces its trace folder's run.json, which then describes
    another run."""
    run = ConvertedRun.recorded_in(source.folder)
    files, previous = run_info_files(source.folder)
    passed_over = []
    for path in files:
        try:
            info = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            info = None  # declared_parallelism names what is wrong with it
        if path == previous and not run.holds(path, info):
            continue  # an earlier run's, or not known to be this one's
        why = run.other_run(path, info)
        if why:
            passed_over.append(f"passed over {path}: {why}")
            continue
        return path, passed_over
    return None, passed_over


def declared_parallelism(run_info: Path) -> tuple[bool, str]:
    """(data-parallel?, what run.json says). Our trainer wraps every multi-rank run in DDP; run.json records the
    world size and backend of it (a `parallelism` field, when the tracer writes one, is read first)."""
    try:
        info = json.loads(run_info.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return False, f"{run_info}: unreadable ({e})"
    if not isinstance(info, dict):
        return False, f"{run_info}: not a run description ({json_kind(info)}, not an object)"
    parallelism = info.get("parallelism")
    if isinstance(parallelism, str):
        return parallelism.lower() in DATA_PARALLEL_NAMES, f"{run_info}: parallelism {parallelism!r}"
    if isinstance(parallelism, dict):
        others = {k: v for k, v in parallelism.items()
                  if k not in ("data_parallel", "wrapper") and isinstance(v, int) and v > 1}
        return not others, f"{run_info}: parallelism {json.dumps(parallelism, sort_keys=True)}"
    if isinstance(info.get("world_size"), int) and isinstance(info.get("backend"), str):
        return True, (f"{run_info}: our trainer's DDP run (world size {info['world_size']}, backend "
                      f"{info['backend']})")
    return False, f"{run_info}: says nothing about parallelism"


def check_data_parallel(source: SourceSet, sources: list[SourceEt], assume: bool) -> tuple[str, list[str]]:
    """How the run is known to be data-parallel, and warnings; raises NotDataParallelError when it is not."""
    warnings = []
    problem = communication_problem(sources)
    if problem:
        if not assume:
            raise NotDataParallelError(source.folder, f"not data-parallel: {problem}; {OVERRIDE_HINT}")
        warnings.append(f"scaling a set that does not look data-parallel (--assume-data-parallel): {problem}")
    if sources[0].meta.get("scaled"):
        return "a scaled set (checked when it was scaled)", warnings
    run_info, passed_over = find_run_info(source)
    if run_info is not None:
        ok, said = declared_parallelism(run_info)
        if ok:
            return said, warnings
        if not assume:
            raise NotDataParallelError(source.folder, f"not data-parallel: {said}; {OVERRIDE_HINT}")
        warnings.append(f"{said}; scaling anyway (--assume-data-parallel)")
        return said + ", overridden by --assume-data-parallel", warnings
    if not assume and passed_over:
        raise NotDataParallelError(source.folder, "no run.json of the run the .et files were made from says it is "
                                   f"data-parallel; {'; '.join(passed_over)}; if it is, {OVERRIDE_HINT}")
    if not assume:
        raise NotDataParallelError(source.folder, "no run.json beside the .et files or in the traced run's folder "
                                   "says the run is data-parallel (runs traced by this project have one); if it "
                                   f"is, {OVERRIDE_HINT}")
    if not problem:
        warnings.append("no run.json: assuming the run is data-parallel (--assume-data-parallel); its collectives "
                        "look like it")
    return "assumed (--assume-data-parallel)", warnings


# ---------------------------------------------------------------------------------------------------------------
# Writing scaled files
# ---------------------------------------------------------------------------------------------------------------
def scaled_metadata(metadata: GlobalMetadata, ranks: int, traced_ranks: int, source_rank: int,
                    compute_scale: float) -> GlobalMetadata:
    """The source's metadata with world size N, the traced rank it replays, `scaled`, one world group, and the
    rank's compute_scale against the traced run when it is not 1.
    No `rank`: the output rank is the file name, so every rank replaying one traced rank can share one file."""
    old = {a.name: getattr(a, a.WhichOneof("value")) for a in metadata.attr if a.WhichOneof("value")}
    attrs = [a for a in metadata.attr if a.name not in SCALE_ATTRS]
    world_group = {"pg_name": WORLD_GROUP, "pg_desc": "default_pg", "ranks": [], "group_size": ranks,
                   "group_count": 1}
    backend = next((g.get("backend_config") for g in _process_groups(old) if g.get("backend_config")), None)
    if backend:
        world_group["backend_config"] = backend
    attrs += [
        AttributeProto(name="world_size", int64_val=ranks),
        AttributeProto(name="scaled", bool_val=True),
        AttributeProto(name="source_rank", int64_val=old.get("source_rank", old.get("rank", source_rank))),
        AttributeProto(name="traced_world_size", int64_val=old.get("traced_world_size",
                                                                   old.get("world_size", traced_ranks))),
        AttributeProto(name="process_groups", string_val=orjson.dumps([world_group]).decode()),
    ]
    if compute_scale != 1.0:
        attrs.append(AttributeProto(name="compute_scale", double_val=compute_scale))
    return GlobalMetadata(version=metadata.version, attr=attrs)


def _in_world_group(blob: bytes) -> bytes:
    node = Node()
    node.ParseFromString(blob)
    if node.type == COMM_COLL_NODE:
        for attr in node.attr:
            if attr.name == "pg_name":
                attr.string_val = WORLD_GROUP
                break
        else:
            node.attr.append(AttributeProto(name="pg_name", string_val=WORLD_GROUP))
    return node.SerializeToString()


def scaled_micros(micros: int, factor: float) -> int:
    """A duration times factor, at most what the .et's 64-bit field holds (a product past 1.8e308 is infinite, and
    round() of it an OverflowError); scale_set refuses a step past ASTRA-sim's clock, far below that."""
    scaled = micros * factor
    return round(scaled) if scaled < 2 ** 64 - 1 else 2 ** 64 - 1


def with_duration_scaled(blob: bytes, factor: float) -> bytes:
    """A serialized node with its duration times factor (scaled_micros)."""
    node = Node()
    node.ParseFromString(blob)
    node.duration_micros = scaled_micros(node.duration_micros, factor)
    return node.SerializeToString()


def duration_factors(source: SourceEt, *, ranks: int, traced_ranks: int, compute_scale: float) -> tuple[float, float]:
    """(compute, communication CPU): what write_scaled_et multiplies the source's compute durations and its
    communication threads' CPU durations by (see there)."""
    factor = compute_scale / source.meta.get("compute_scale", 1.0)
    moved = ((ranks - 1) / ranks) / ((traced_ranks - 1) / traced_ranks) if traced_ranks > 1 else 1.0
    return factor, factor * moved


def scaled_step_us(source: SourceEt, *, ranks: int, traced_ranks: int, compute_scale: float) -> int:
    """The critical path of the file write_scaled_et writes from source, timed as validate_et times it (collectives
    one after another in the one world group), without writing it: a --slow factor is checked against ASTRA-sim's
    clock before any file is written."""
    factor, cpu_factor = duration_factors(source, ranks=ranks, traced_ranks=traced_ranks, compute_scale=compute_scale)
    communication_cpu = set(source.communication_cpu_indices)
    index_of: dict[int, int] = {}
    deps: list[set[int]] = []
    durations: list[int] = []
    collectives = []
    node = Node()
    for index, blob in enumerate(source.blobs):
        node.Clear()
        node.ParseFromString(blob)
        index_of[node.id] = index
        deps.append(set(node.data_deps) | set(node.ctrl_deps))
        micros = node.duration_micros
        if index in communication_cpu:
            micros = scaled_micros(micros, cpu_factor)
        elif factor != 1.0 and node.type == COMP_NODE:
            micros = scaled_micros(micros, factor)
        durations.append(micros)
        if node.type == COMM_COLL_NODE:
            collectives.append((node.start_time_micros, node.id, index))
    parents = [[index_of[d] for d in ds if d in index_of] for ds in deps]
    return timed_critical_path(parents, durations, [(start, WORLD_GROUP, index) for start, _, index in
                                                    sorted(collectives)])


def past_the_clock(rank: int, factor: float, step_us: float) -> ScaleError:
    """--slow RANK:FACTOR makes the rank's step longer than ASTRA-sim's clock counts."""
    return ScaleError(f"--slow {rank}:{factor:g}", f"makes rank {rank}'s step {step_us / 86_400e6:,.0f} days, past "
                      f"what ASTRA-sim's clock counts (2^53 ns, {CLOCK_LIMIT_NS / 86_400e9:.0f} days); give a smaller "
                      "factor")


def write_scaled_et(source: SourceEt, out_path: Path, *, ranks: int, traced_ranks: int, source_rank: int,
                    compute_scale: float = 1.0) -> Path:
    """Write one scaled .et: collectives in the N-rank world group, compute durations compute_scale times the traced
    ones, the communication threads' CPU nodes also times the bytes a rank moves in a ring of N against one of the
    source's ranks ((N-1)/N of the buffer each way in an all-reduce, all-gather or reduce-scatter), every other node
    byte for byte as in the source. traced_ranks: the source set's world size.

    A source that is a straggler's file of a scaled set (its own compute_scale) is scaled by the ratio: from a factor
    above 1 that gives back the traced durations exactly (each was rounded to the µs once, by less than half a µs
    times the factor)."""
    factor, cpu_factor = duration_factors(source, ranks=ranks, traced_ranks=traced_ranks, compute_scale=compute_scale)
    rewrite: dict[int, bytes] = {i: _in_world_group(source.blobs[i]) for i in source.comm_indices}
    rewrite.update({i: with_duration_scaled(source.blobs[i], cpu_factor) for i in source.communication_cpu_indices})
    metadata = scaled_metadata(source.metadata, ranks, traced_ranks, source_rank, compute_scale)
    with open(out_path, "xb", buffering=1 << 20) as f:
        encodeMessage(f, metadata)
        for i, blob in enumerate(source.blobs):
            if i in rewrite:
                blob = rewrite[i]
            elif factor != 1.0 and source.node_types[i] == COMP_NODE:
                blob = with_duration_scaled(blob, factor)
            encodeMessage(f, SerializedMessage(blob))
    return out_path


def link_or_copy(existing: Path, new: Path) -> bool:
    """Hard-link `new` to `existing` (True), or copy it where the file system refuses links (False)."""
    try:
        os.link(existing, new)
        return True
    except OSError:  # no hard links (FAT, some network shares), or too many links to one inode (EMLINK)
        shutil.copyfile(existing, new)
        return False


# ---------------------------------------------------------------------------------------------------------------
# Scaling a run
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class ScaleResult:
    """What scale_set wrote and why it was allowed to."""

    source: SourceSet
    output_dir: Path
    name: str
    ranks: int
    source_of_rank: list[int]  # output rank -> the rank of the source set whose file it replays
    slow: dict[int, float]  # every straggler of the new set: this command's --slow and those kept from a scaled source
    parallelism: str
    traced_ranks: int = 0  # the ranks the run was traced on (a scaled source's traced_world_size)
    source_scaled: bool = False  # the source is a set scale_et.py wrote
    traced_of_rank: list[int] = field(default_factory=list)  # output rank -> the traced rank it replays
    slow_notes: list[str] = field(default_factory=list)  # what became of a scaled source's own --slow
    unslowed: list[int] = field(default_factory=list)  # a scaled source's stragglers given --slow RANK:1 here
    written: list[str] = field(default_factory=list)  # file names of the distinct files written
    links: int = 0
    copies: int = 0
    new_bytes: int = 0
    collectives: list[tuple[str, str, int]] = field(default_factory=list)
    critical_path_us: dict[int, float] = field(default_factory=dict)  # per distinct file, by its first rank
    # size and SHA-256 of each distinct content (by the first rank that has it), and the content of every rank:
    # SCALE_SUMMARY.md records them, so a rank changed since is refused (unscaled_et_file)
    fingerprints: dict[int, dict] = field(default_factory=dict)
    content_of_rank: list[int] = field(default_factory=list)
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)
    note: str = ""
    # where the output folder will be once renamed into place by its caller (simulate.py scales into its staging
    # folder): the paths SCALE_SUMMARY.md gives are there; None: output_dir itself
    published_dir: Path | None = None

    @property
    def prefix(self) -> Path:
        return self.output_dir / self.name


def _holds_a_run(folder: Path) -> str:
    """What in folder says it is a traced or converted run's folder (its CONVERSION_SUMMARY.md, a trace), or ""."""
    if (folder / CONVERSION_SUMMARY).is_file():
        return CONVERSION_SUMMARY
    traces = sorted(entry.name for entry in os.scandir(folder) if TRACE_FILE_RE.match(entry.name))
    return traces[0] if traces else ""


def default_output(source: SourceSet, name: str) -> tuple[Path, str]:
    """A folder named after the scaled set beside the source run, or ./converted/<name> when that is read-only."""
    # `scale_et.py .` from inside the run: Path(".").parent is "." itself, and the set went inside the run folder
    parent = source.folder.parent if source.folder.name not in ("", "..") else source.folder.resolve().parent
    if _writable(parent):
        return parent / name, ""
    fallback = fallback_output_dir(name)
    return fallback, f"{parent} is not writable: writing to {fallback}"


def check_slow(slow: dict[int, float] | None, ranks: int) -> dict[int, float]:
    checked = {}
    for rank, factor in (slow or {}).items():
        if not isinstance(rank, int) or not 0 <= rank < ranks:
            raise ScaleError("--slow", f"rank {rank} is not one of the {ranks} output ranks (0-{ranks - 1})")
        if not isinstance(factor, (int, float)) or math.isnan(factor) or factor <= 0:
            raise ScaleError("--slow", f"factor {factor} of rank {rank} must be a positive number")
        if math.isinf(factor):  # `--slow 3:inf`, or 3:1e309 (read as inf)
            raise ScaleError(f"--slow {rank}:{factor:g}", f"makes rank {rank}'s step infinite, past what ASTRA-sim's "
                             f"clock counts (2^53 ns, {CLOCK_LIMIT_NS / 86_400e9:.0f} days); give a smaller factor")
        if factor != 1.0:
            checked[rank] = float(factor)
    return checked


def check_slow_steps(slow: dict[int, float], source_of: dict[int, SourceEt], *, ranks: int, traced_ranks: int) -> None:
    """Refuse, before any file is written, a --slow factor that makes its rank's step longer than ASTRA-sim's clock
    counts (past 2^53 ns the simulated ranks stop unfinished). The step only grows with the factor: each source file
    is timed once, at the largest factor of the ranks that replay it."""
    largest: dict[int, int] = {}  # id of a source file -> the slowed rank with the largest factor on it
    for rank, factor in slow.items():
        key = id(source_of[rank])
        if key not in largest or factor > slow[largest[key]]:
            largest[key] = rank
    for rank in sorted(largest.values()):
        step_us = scaled_step_us(source_of[rank], ranks=ranks, traced_ranks=traced_ranks, compute_scale=slow[rank])
        if step_us * 1000 >= CLOCK_LIMIT_NS:
            raise past_the_clock(rank, slow[rank], step_us)


def too_many_for_memory(ranks: int) -> ScaleError:
    return ScaleError("--ranks", f"{ranks:,} ranks need more memory than this process may use, for their list alone "
                      "(and a file name each); give fewer")


def memory_limit() -> int | None:
    """The bytes this process may use at most: its address-space and data limits (ulimit -v, -d), the machine's
    memory and its container's (cgroup), whichever is least; None where none can be read."""
    limits = []
    try:
        import resource
        for kind in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
            soft = resource.getrlimit(kind)[0]
            if soft != resource.RLIM_INFINITY:
                limits.append(soft)
    except (ImportError, AttributeError, OSError, ValueError):  # Windows: no resource module
        pass
    try:
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # a container's
        try:
            limits.append(int(Path(path).read_text().strip()))
        except (OSError, ValueError):  # no such file, or "max"
            pass
    return min(limits) if limits else None


def check_rank_count(ranks: int) -> None:
    """Refuse, before a per-rank list is built or a file written, a rank count that the lists alone would not fit
    in memory (RANK_BYTES a rank), or that ASTRA-sim could not run here: it keeps each NPU's .et open, and this
    shell's hard limit of open files allows fewer (simulate.py's check)."""
    limit = memory_limit()
    if limit is not None and ranks * RANK_BYTES > limit:
        raise too_many_for_memory(ranks)
    problem = open_file_limit_problem(ranks)
    if problem:
        raise ScaleError("--ranks", problem)


def check_room(out_dir: Path, name: str, ranks: int, files: int, file_bytes: int) -> None:
    """Refuse, before writing, a set the output folder's file system has no room for: `files` distinct files
    (file_bytes together, about the source files' size) take an inode each, and every rank a folder entry, a hard
    link or a copy (at least ext4's 8 bytes and the name, rounded up to 4). A set that fills the disk half-way had
    written millions of links into its staging folder before failing."""
    folder = next((f for f in (out_dir, *out_dir.parents) if f.is_dir()), None)  # the folder may be made later
    try:
        disk = os.statvfs(folder if folder is not None else ".")
    except (AttributeError, OSError):  # Windows: no statvfs
        return
    entry_bytes = (8 + len(et_name(name, ranks - 1)) + 3) // 4 * 4
    needed, free = file_bytes + ranks * entry_bytes, disk.f_bavail * disk.f_frsize
    if needed > free:
        raise ScaleError(out_dir, f"no room for {ranks:,} ranks: they need at least {format_bytes(needed)} ({files} "
                         f"file{'s' if files != 1 else ''} and a folder entry a rank), and the disk has "
                         f"{format_bytes(free)} free; free space or give fewer --ranks")
    if disk.f_files and files + 2 > disk.f_favail:  # the files, the staging folder and the summary
        raise ScaleError(out_dir, f"no room for {ranks:,} ranks: they need {files + 2} inodes ({files} files, the "
                         f"staging folder and {SUMMARY_NAME}), and the disk has {disk.f_favail:,} free; free some")


def parse_slow(items: list[str]) -> dict[int, float]:
    """`RANK:FACTOR` strings (the --slow flag) as {rank: factor}."""
    slow: dict[int, float] = {}
    for item in items:
        rank_text, sep, factor_text = item.partition(":")
        try:
            rank, factor = int(rank_text), float(factor_text)
        except ValueError:
            raise ScaleError(f"--slow {item}", "expected RANK:FACTOR, e.g. 3:1.5 (rank 3's compute 1.5x slower)") \
                from None
        if not sep:
            raise ScaleError(f"--slow {item}", "expected RANK:FACTOR, e.g. 3:1.5 (rank 3's compute 1.5x slower)")
        if rank in slow:
            raise ScaleError(f"--slow {item}", f"rank {rank} is given twice")
        slow[rank] = factor
    return slow


@dataclass
class TracedRanks:
    """The traced run behind a source set: the ranks it was traced on, the rank of the set whose file replays each
    of them (as traced where the set has such a file), and the set's own stragglers (a scaled set's --slow:
    {rank: compute_scale})."""

    count: int
    file_rank: list[int]
    earlier_slow: dict[int, float]
    scaled: bool = False


def traced_ranks_of(source_set: SourceSet, sources: list[SourceEt], file_of_rank: list[int]) -> TracedRanks:
    """A converted set replays itself; a scaled set replays the ranks it was traced on (its files' source_rank and
    traced_world_size), each through a file that is not a straggler's where it has one (else a straggler's, which
    write_scaled_et scales back), so scaling it again scales the traced run again instead of copying a slowed file
    to other ranks."""
    k = source_set.ranks
    metas = [sources[file_of_rank[s]].meta for s in range(k)]
    if not metas[0].get("scaled"):
        return TracedRanks(k, list(range(k)), {})
    count = metas[0].get("traced_world_size")
    if not isinstance(count, int) or count < 1:
        raise ScaleError(source_set.paths[0], f"a scaled .et with no traced_world_size ({count!r}); scale the "
                         "converted run it was scaled from instead")
    earlier = {s: float(meta["compute_scale"]) for s, meta in enumerate(metas)
               if meta.get("compute_scale", 1.0) != 1.0}
    file_rank: dict[int, int] = {}
    for s in sorted(range(k), key=lambda s: s in earlier):  # a file as traced first
        file_rank.setdefault(metas[s].get("source_rank"), s)
    missing = [t for t in range(count) if t not in file_rank]
    if missing:
        raise ScaleError(source_set.folder, f"no rank of this scaled set replays traced rank {missing[0]} of its "
                         f"traced_world_size {count}; scale the converted run instead")
    return TracedRanks(count, [file_rank[t] for t in range(count)], earlier, scaled=True)


def stragglers(earlier: dict[int, float], given: dict[int, float], slow: dict[int, float],
               ranks: int) -> tuple[dict[int, float], list[str]]:
    """The new set's stragglers, and what became of each of a scaled source's (earlier, by rank): this command's
    --slow (slow, as checked; given, as typed: `--slow 3:1` names rank 3 too), plus every earlier straggler whose
    rank the new set still has and this command does not name again."""
    kept, notes = dict(slow), []
    for rank, factor in sorted(earlier.items()):
        flag = f"--slow {rank}:{factor:g}"
        if rank in given:
            notes.append(f"the scaled source's {flag} is replaced by this command's --slow {rank}:{given[rank]:g}")
        elif rank < ranks:
            kept[rank] = factor
            notes.append(f"the scaled source's {flag} is kept: rank {rank} is slowed again, and no other rank "
                         f"(--slow {rank}:1 replays it as traced)")
        else:
            notes.append(f"the scaled source's {flag} is dropped: there is no rank {rank} among {ranks}")
    return dict(sorted(kept.items())), notes


def scale_run(source: Path, ranks: int, *, output_dir: Path | None = None, name: str | None = None,
              slow: dict[int, float] | None = None, assume_data_parallel: bool = False) -> Path:
    """Write `<name>.<r>.et` for r in 0..ranks-1 from the converted run at `source`; returns the workload prefix
    (ASTRA-sim's --workload-configuration). Raises ScaleError (one line) for bad input or a refused run."""
    return scale_set(source, ranks, output_dir=output_dir, name=name, slow=slow,
                     assume_data_parallel=assume_data_parallel).prefix


def scale_set(source: str | Path, ranks: int, *, output_dir: str | Path | None = None, name: str | None = None,
              slow: dict[int, float] | None = None, assume_data_parallel: bool = False,
              published_dir: Path | None = None) -> ScaleResult:
    """scale_run, returning everything it did (and writing SCALE_SUMMARY.md beside the set).

    All files are written, linked and validated in a hidden folder inside the output folder and renamed into
    place at the end: a failure leaves no partial set."""
    started = time.perf_counter()
    if not isinstance(ranks, int) or ranks < 1:
        raise ScaleError("--ranks", f"must be at least 1 (got {ranks})")
    check_rank_count(ranks)
    if isinstance(output_dir, str) and not output_dir.strip():  # `--output-dir "$UNSET"` had written into "."
        raise ScaleError(f"--output-dir {output_dir!r}", "an empty path; give the folder the set goes in (or leave "
                         "the flag out for one beside the run)")
    folder = Path(source) if Path(source).is_dir() else Path(source).parent
    # A conversion writing the set now: its summary calls the ranks still to come "interrupted"; say what it is
    held = folder_held(folder, lambda: ScaleError(folder, "a conversion is writing into this folder now; scale the "
                                                          "run once it has ended"), shared=True) \
        if folder.is_dir() else contextlib.nullcontext()
    with held:
        source_set = find_source_set(source)
    given_slow = dict(slow or {})
    slow = check_slow(given_slow, ranks)
    if name is None:  # the source's name with what --name refuses (spaces, other letters) made "_"
        name = DEFAULT_NAME.format(name=re.sub(f"[^{NAME_CHARACTERS}]", "_", source_set.name).lstrip(".") or "run",
                                   ranks=ranks)
    if not re.fullmatch(f"[{NAME_CHARACTERS}]+", name) or name.startswith("."):
        raise ScaleError("--name", f"{name!r}: use letters, digits and _ . + - (it becomes <name>.<rank>.et)")
    note = ""
    if output_dir is None:
        out_dir, note = default_output(source_set, name)
    else:
        out_dir = Path(output_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ScaleError(out_dir, "exists and is not a folder")
    if out_dir.is_dir() and out_dir.resolve() == source_set.folder.resolve():
        # A second set beside the converted one: simulate.py and the conversion tools would no longer know which
        # set the folder is (and a set of the source's name would overwrite it).
        if output_dir is not None:
            raise ScaleError("--output-dir", f"{out_dir} is the run folder itself; a scaled set goes in a folder of "
                             "its own (default: one beside the run)")
        raise ScaleError("--name", f"{name}: the folder it names beside the run, {out_dir}, is the run folder "
                         "itself; give another --name, or an --output-dir")
    flag = "--output-dir" if output_dir is not None else "--name"
    if out_dir.is_dir() and _holds_a_run(out_dir):
        # its .et set of that name would be replaced by the scaled one, and its summary left describing them
        raise ScaleError(flag, f"{out_dir} holds a traced or converted run ({_holds_a_run(out_dir)}); a scaled set "
                         f"goes in a folder of its own (give another {flag})")
    if out_dir.is_dir() and name in et_sets(out_dir) and (read_scale_status(out_dir) or {}).get("name") != name:
        raise ScaleError(flag, f"{out_dir} already holds the .et set {name}, which scale_et.py did not write there "
                         f"(no {SUMMARY_NAME} of it); a scaled set goes in a folder of its own (give another {flag}, "
                         "or remove those files first)")
    others = sorted(other for other in et_sets(out_dir) if other != name) if out_dir.is_dir() else []
    if others:
        # SCALE_SUMMARY.md describes one set: a second one beside it would leave the first without its summary (and
        # unchecked), and the folder without one set for simulate.py or a later scale to take.
        holds = f"the scaled set {others[0]}" if (read_scale_status(out_dir) or {}).get("name") == others[0] \
            and len(others) == 1 else f"the .et set{'s' if len(others) > 1 else ''} {', '.join(others)}"
        raise ScaleError("--output-dir" if output_dir is not None else out_dir,
                         f"{out_dir} already holds {holds}; a scaled set goes in a folder of its own (give "
                         "another --output-dir, or remove those files first)")
    check_against_conversion(source_set)

    sources, file_of_rank = _read_whole_set(source_set)
    traced = traced_ranks_of(source_set, sources, file_of_rank)
    if ranks < traced.count:
        # Fewer ranks would drop traced ranks and the spread measured between them, and one rank would keep
        # collectives that ASTRA-sim's analytical network (2 NPUs at least) cannot run: scaling only adds ranks.
        raise ScaleError("--ranks", f"must be at least the {traced.count} traced ranks (got {ranks}): scaling makes "
                         "more ranks from the traced ones; simulate the traced set as it is")
    distinct = [sources[i] for i in sorted(set(file_of_rank))]
    parallelism, warnings = check_data_parallel(source_set, distinct, assume_data_parallel)
    for warning in warnings:
        logger.warning(warning)

    # Output rank r replays traced rank r mod T through a file of the source that replays it as traced (a scaled
    # source's straggler is never copied to other ranks); the stragglers are this command's --slow and those of a
    # scaled source whose rank still exists, each on its own rank once.
    slow, slow_notes = stragglers(traced.earlier_slow, given_slow, slow, ranks)
    source_of = {r: sources[file_of_rank[traced.file_rank[r % traced.count]]] for r in slow}
    check_slow_steps(slow, source_of, ranks=ranks, traced_ranks=source_set.ranks)
    # a file as traced for every traced rank that some output rank replays unslowed, and one for each straggler
    slowed = Counter(r % traced.count for r in slow)
    as_traced = [traced.file_rank[t] for t in range(traced.count) if (ranks - 1 - t) // traced.count + 1 > slowed[t]]
    check_room(out_dir, name, ranks, len(as_traced) + len(slow),
               sum(os.path.getsize(source_set.paths[s]) for s in as_traced)
               + sum(os.path.getsize(source.path) for source in source_of.values()))
    try:
        traced_of_rank = [r % traced.count for r in range(ranks)]
        source_of_rank = [traced.file_rank[t] for t in traced_of_rank]
    except MemoryError:  # past check_rank_count's lower bound: it had been a MemoryError traceback
        raise too_many_for_memory(ranks) from None
    unslowed = sorted(r for r in traced.earlier_slow if r < ranks and r not in slow)  # given --slow RANK:1
    result = ScaleResult(source=source_set, output_dir=out_dir, name=name, ranks=ranks, source_of_rank=source_of_rank,
                         slow=slow, parallelism=parallelism, traced_ranks=traced.count, traced_of_rank=traced_of_rank,
                         source_scaled=traced.scaled, slow_notes=slow_notes, unslowed=unslowed, warnings=warnings,
                         note=note, published_dir=published_dir)
    _write_and_publish(result, sources, file_of_rank, started)
    return result


def _read_whole_set(source_set: SourceSet) -> tuple[list[SourceEt], list[int]]:
    """The set's distinct files read (_read_sources), refused when its ranks are not the whole traced run: ranks
    deleted from the top (scaled, the ranks left would stand for the whole run), or a rank's file copied over
    another's (`cp x.0.et x.1.et`: in a set no summary records, it would replay the same rank twice; in one a summary
    records, its fingerprint has already told)."""
    sources, file_of_rank = _read_sources(source_set)
    for read in sources:
        world = read.meta.get("world_size")
        if isinstance(world, int) and world > 0 and world != source_set.ranks:
            raise ScaleError(read.path, f"recorded in a world of {world} ranks, but the set has {source_set.ranks} "
                             f".et files ({source_set.paths[0].name} to {source_set.paths[-1].name}); scale a "
                             "complete set")
    for rank, path in enumerate(source_set.paths):
        problem = misnamed_rank(path, rank, sources[file_of_rank[rank]].meta.get("rank"))
        if problem:
            raise ScaleError(path, problem.removeprefix(f"{path}: "))
    return sources, file_of_rank


def _write_and_publish(result: ScaleResult, sources: list[SourceEt], file_of_rank: list[int], started: float) -> None:
    """Write the set in a staging folder inside the output folder, then rename it into place: a failure leaves no
    partial set, and no output folder this command made."""
    out_dir, name, ranks = result.output_dir, result.name, result.ranks
    made = [folder for folder in (out_dir, *out_dir.parents) if not folder.exists()]  # innermost first
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ScaleError(out_dir, f"cannot write there ({e.strerror or e})") from None
    try:
        # one scale_et.py at a time in an output folder: two publishing sets of one name at once would leave ranks
        # of each (and the summary of one)
        with folder_held(out_dir, lambda: ScaleError(out_dir, "another scale_et.py is writing into this folder now; "
                                                              "wait for it to end")):
            _remove_dead_staging(out_dir)
            try:
                staging = Path(tempfile.mkdtemp(prefix=f".{name}{STAGING_MARK}", dir=out_dir))
            except OSError as e:
                raise ScaleError(out_dir, f"cannot write there ({e.strerror or e})") from None
            try:
                _write_set(result, sources, file_of_rank, staging)
                result.seconds = time.perf_counter() - started
                write_text_atomic(staging / SUMMARY_NAME, render_scale_summary(result))
                _publish(result, staging)
            except OSError as e:  # the disk filled, the folder went read-only
                raise ScaleError(e.filename or out_dir, f"cannot write the scaled set ({e.strerror or e}"
                                 f"{_why_no_space(e, out_dir, ranks)}); nothing was changed") from None
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except BaseException:  # refused, failed or interrupted: the folders this command made are not left behind empty
        for folder in made:
            try:
                folder.rmdir()
            except OSError:
                break
        raise


def _why_no_space(error: OSError, out_dir: Path, ranks: int) -> str:
    """What 'No space left on device' means when the disk has space and inodes left: the file system's limit on
    one folder's entries (ext4's directory index), which a set of 100,000,000 ranks, one file each, reached with
    76 GB and 97% of the inodes free."""
    if error.errno != errno.ENOSPC:
        return ""
    try:
        disk = os.statvfs(out_dir)
    except OSError:
        return ""
    if disk.f_bavail * disk.f_frsize < 1 << 30 or (disk.f_files and disk.f_favail < disk.f_files // 100):
        return ""  # the disk or its inodes are indeed nearly full
    return (f", with {disk.f_bavail * disk.f_frsize / 2**30:,.0f} GiB and {disk.f_favail:,} inodes free: the file "
            f"system's limit on one folder's entries, which {ranks:,} files reach; give fewer --ranks")


STAGING_MARK = ".scaling-"  # .<name>.scaling-XXXXXXXX: a set being written, renamed into place when whole


def _remove_dead_staging(out_dir: Path) -> None:
    """The staging folders of scale_et.py runs killed (kill -9, a power cut) before they could remove them: with
    the folder held, no other scale_et.py is writing one (a set of 3,000,000 ranks killed after 4 s had left
    362,842 files)."""
    try:
        entries = list(os.scandir(out_dir))
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith(".") and STAGING_MARK in entry.name and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)


def _read_sources(source_set: SourceSet) -> tuple[list[SourceEt], list[int]]:
    """The distinct files of the set, and the index in them of each rank's file: ranks sharing one file (a scaled set
    as source) are read once."""
    sharing = ranks_sharing_a_file(dict(enumerate(source_set.paths)))
    sources = [read_source_et(source_set.paths[first]) for first in sorted(sharing)]
    index_of = {rank: i for i, first in enumerate(sorted(sharing)) for rank in sharing[first]}
    return sources, [index_of[rank] for rank in range(len(source_set.paths))]


def _write_set(result: ScaleResult, sources: list[SourceEt], file_of_rank: list[int], staging: Path) -> None:
    """Distinct files first (one per traced rank replayed as traced, one per slowed rank) and validated; then
    every other rank's name as a hard link to its traced rank's file."""
    ranks, k = result.ranks, result.source.ranks
    base: dict[int, Path] = {}  # source file index -> its scaled file in staging
    base_rank: dict[int, int] = {}  # source file index -> the output rank whose file it is
    distinct: dict[int, Path] = {}  # first output rank of each distinct file -> the file
    result.content_of_rank = []
    for r in range(ranks):
        source_rank = result.source_of_rank[r]
        index = file_of_rank[source_rank]
        if r not in result.slow and index in base:
            result.content_of_rank.append(base_rank[index])
            continue
        path = staging / et_name(result.name, r)
        write_scaled_et(sources[index], path, ranks=ranks, traced_ranks=k, source_rank=result.traced_of_rank[r],
                        compute_scale=result.slow.get(r, 1.0))
        distinct[r] = path
        result.content_of_rank.append(r)
        if r not in result.slow:
            base[index], base_rank[index] = path, r
    reports = {}
    for r, path in distinct.items():
        report = validate_et(path)
        if not report.ok:
            raise ScaleError(result.output_dir / path.name,
                             "the scaled .et failed validation: " + "; ".join(report.problems[:3]))
        if r in result.slow and report.critical_path_us * 1000 >= CLOCK_LIMIT_NS:  # check_slow_steps, as written
            raise past_the_clock(r, result.slow[r], report.critical_path_us)
        reports[r] = report
        result.fingerprints[r] = et_fingerprint(path)
        result.new_bytes += path.stat().st_blocks * 512
        result.written.append(path.name)
    problems = collectives_agree({r: report.collectives for r, report in reports.items()})
    if problems:
        raise ScaleError(result.output_dir, "the scaled ranks' collectives disagree: " + problems[0])
    result.collectives = reports[min(reports)].collectives
    result.critical_path_us = {r: report.critical_path_us for r, report in reports.items()}
    for r in range(ranks):
        if r in distinct:
            continue
        index = file_of_rank[result.source_of_rank[r]]
        target = staging / et_name(result.name, r)
        if link_or_copy(base[index], target):
            result.links += 1
        else:
            result.copies += 1
            result.new_bytes += target.stat().st_blocks * 512
            base[index] = target  # link the next ranks to the copy (after EMLINK: the first inode is full)


def _publish(result: ScaleResult, staging: Path) -> None:
    """Rename every rank's file and the summary into place, then drop ranks >= N left by an earlier, larger set of
    this name. Ctrl-C and SIGTERM wait until it is done: an interrupted publish would leave ranks of two sets."""
    with publication(lambda: result.prefix):  # a signal meanwhile: InterruptedAfterWriting, the set is whole
        for r in range(result.ranks):
            name = et_name(result.name, r)
            os.replace(staging / name, result.output_dir / name)
        for entry in os.scandir(result.output_dir):
            match = ET_FILE_RE.match(entry.name)
            if match and match["name"] == result.name and int(match["rank"]) >= result.ranks:
                os.unlink(entry.path)
        os.replace(staging / SUMMARY_NAME, result.output_dir / SUMMARY_NAME)


# ---------------------------------------------------------------------------------------------------------------
# SCALE_SUMMARY.md
# ---------------------------------------------------------------------------------------------------------------
def _outputs_of(result: ScaleResult, traced_rank: int) -> str:
    ranks = [r for r, t in enumerate(result.traced_of_rank) if t == traced_rank]
    k = result.traced_ranks
    if len(ranks) > 3 and k > 1 and ranks == list(range(traced_rank, result.ranks, k)):
        return f"{traced_rank}, {traced_rank + k}, {traced_rank + 2 * k}, ... ({len(ranks)} ranks: r mod {k} = {traced_rank})"
    return rank_ranges(ranks) + f" ({len(ranks)} rank{'s' if len(ranks) != 1 else ''})"


def render_scale_summary(result: ScaleResult) -> str:
    source, ranks, k = result.source, result.ranks, result.traced_ranks
    kinds = Counter(comm_type for _, comm_type, _ in result.collectives)
    comm = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items())) or "none"
    total = sum(size for _, _, size in result.collectives)
    lines = [
        f"# Scale summary: {result.name}",
        "",
        f"Scaled {datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')} by trace_tools from `{source.prefix}` "
        + (f"(a scaled set of {source.ranks} ranks, traced on {k})" if result.source_scaled
           else f"({k} traced rank{'s' if k != 1 else ''})")
        + f" to {ranks} ranks in {result.seconds:.2f} s.",
        "",
        f"ASTRA-sim: `--workload-configuration={(result.published_dir or result.output_dir) / result.name}` (reads "
        f"`{result.name}.<rank>.et` for rank 0 to "
        f"{ranks - 1}); the network must have {ranks} NPUs (the product of `npus_count`).",
        "",
        "| output ranks | replay traced rank | compute | file |",
        "|---|---:|---|---|",
    ]
    for t in sorted(set(result.traced_of_rank)):
        lines.append(f"| {_outputs_of(result, t)} | {t} | as traced | shared (hard links) |")
    for r, factor in sorted(result.slow.items()):
        lines.append(f"| {r} | {result.traced_of_rank[r]} | x{factor:g} (--slow {r}:{factor:g}) | its own |")
    if result.slow:
        lines.append("")
        lines.append("Slowed ranks are listed twice: the shared row counts them, but they have their own file.")
    if result.slow_notes:
        lines += ["", "The scaled source's stragglers (a scaled set scaled again replays the traced ranks, each "
                      "straggler on its own rank):", ""]
        lines += [f"- {note}" for note in result.slow_notes]
    files = (f"{len(result.written)} distinct file{'s' if len(result.written) != 1 else ''} written, "
             f"{result.links} hard links" + (f", {result.copies} copies (the file system refused hard links)"
                                             if result.copies else "") + f"; {format_bytes(result.new_bytes)} of new disk")
    lines += [
        "",
        "## What was done",
        "",
        f"- Data parallelism: {result.parallelism}.",
        f"- Collectives per rank: {comm} ({format_bytes(total)}), sizes as traced; every collective is now in process group "
        f"`{WORLD_GROUP}` (`pg_name`), which ASTRA-sim runs over all {ranks} NPUs without a "
        "`--comm-group-configuration`.",
        f"- Metadata of every file: `world_size` {ranks}, `source_rank` (the traced rank it replays), "
        f"`traced_world_size` {k}, `scaled` true, one world process group; no `rank` (the rank is the file name).",
        f"- Files: {files}.",
        "- Every distinct file was decoded after writing (dependencies resolve, no cycle, only node types ASTRA-sim "
        "accepts) and the collectives agree across them (same types and sizes in the same order).",
        "- The size and SHA-256 of every rank's file are recorded below: simulate.py and scale_et.py refuse a rank "
        "changed, replaced or removed since (scale again instead).",
        "",
        "## What the simulator needs",
        "",
        f"- One file per NPU named `{result.name}.<rank>.et`: ASTRA-sim opens `<prefix>.<sys id>.et` for each NPU and "
        "reads nothing rank-specific inside it, so ranks that replay the same traced rank share one file (hard links; "
        "the file system copies where it has none).",
        f"- {ranks} open files at once (each NPU's feeder keeps its file open): `ulimit -n` above {ranks} "
        "(simulate.py raises the soft limit up to the hard one itself).",
        "- Files it may open for writing: Chakra's feeder opens each .et in read+append mode (it writes nothing), so "
        "a read-only .et fails with `Failed to open file`; do not make the set read-only. A hard-linked file changed "
        "through one name changes every rank that shares it: regenerate with scale_et.py instead of editing.",
    ]
    if result.critical_path_us:
        paths = ", ".join(f"rank {r}: {us:,.0f}" for r, us in result.critical_path_us.items())
        lines += ["", f"Critical path with collectives at their traced durations (µs), per distinct file: {paths}."]
    if result.warnings or result.note:
        lines += ["", "## Warnings", ""]
        lines += [f"- {w}" for w in result.warnings]
        if result.note:
            lines.append(f"- {result.note}")
    status = {"name": result.name, "ranks": ranks, "source": str(source.prefix.absolute()), "traced_ranks": k,
              "source_of_rank": "r mod traced_ranks", "slow": {str(r): f for r, f in result.slow.items()},
              "unslowed": result.unslowed,
              "parallelism": result.parallelism, "files_written": len(result.written), "links": result.links,
              "copies": result.copies, "new_bytes": result.new_bytes, "seconds": round(result.seconds, 3),
              "files": [{"name": fingerprint["name"], "size": fingerprint["size"], "sha256": fingerprint["sha256"],
                         "ranks": [r for r, content in enumerate(result.content_of_rank) if content == first]}
                        for first, fingerprint in sorted(result.fingerprints.items())]}
    lines += status_comment(STATUS_MARKER, status)
    return "\n".join(lines)
