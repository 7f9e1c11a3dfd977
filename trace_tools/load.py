"""Read host (ExecutionTraceObserver) and device (Kineto) traces into compact columns of primitives."""
from __future__ import annotations

import gzip
import math
import re
import zlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

import orjson

from .layout import PG_INIT_NODE

# Files above this size are parsed in slices of the big array so the parsed objects of the whole file never
# exist at once (a 55 MB host trace is ~350 MB of Python objects when parsed whole).
CHUNKED_PARSE_MIN_BYTES = 16 << 20
CHUNK_BYTES = 4 << 20

KNOWN_SCHEMA_FAMILIES = ("1.0", "1.1")
STRUCTURAL_NODE_PREFIXES = ("[pytorch|profiler|execution_trace|", "[pytorch|profiler|execution_graph|")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
CPU_CATEGORIES = ("cpu_op", "user_annotation")
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver", "hip_runtime", "hip_driver")
# Kineto's CUDA synchronisation events (torch.profiler._ExperimentalConfig(enable_cuda_sync_events=True)).
SYNC_CATEGORY = "cuda_sync"
USED_CATEGORIES = frozenset((*GPU_CATEGORIES, *CPU_CATEGORIES, *RUNTIME_CATEGORIES, SYNC_CATEGORY))
# Host operators whose tensors describe a collective (sizes, process group); kept whole for the converter.
COMM_NAME_PREFIXES = ("nccl:", "gloo:", "c10d::", "record_param_comms", "mpi:", "ucc:", "xccl:")


class TraceError(Exception):
    """A problem with an input, said in one line that names the file."""

    def __init__(self, path: str | Path | None, problem: str):
        self.path = str(path) if path is not None else None
        self.problem = problem
        super().__init__(f"{path}: {problem}" if path is not None else problem)


# ---------------------------------------------------------------------------------------------------------------
# Raw bytes and JSON
# ---------------------------------------------------------------------------------------------------------------
def read_trace_bytes(path: str | Path) -> bytes:
    """The file's bytes, gunzipped when it is gzip (by its magic number, whatever its name)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(2)
            f.seek(0)
            if head == b"\x1f\x8b":
                try:
                    data = gzip.decompress(f.read())
                except (OSError, EOFError, zlib.error) as e:
                    raise TraceError(path, f"gzip data is damaged or truncated ({e})") from None
            else:
                data = f.read()
    except FileNotFoundError:
        raise TraceError(path, "file not found") from None
    except IsADirectoryError:
        raise TraceError(path, "is a directory, expected a trace file") from None
    except PermissionError:
        raise TraceError(path, "not readable (permission denied)") from None
    if not data.strip():
        raise TraceError(path, "empty file")
    return data


def describe_json_problem(data: bytes, error: Exception) -> str:
    """One line saying why `data` is not one JSON document (truncated, several documents, stray bytes)."""
    message = str(error)
    position = getattr(error, "pos", None)
    where = ""
    match = re.search(r"line (\d+) column (\d+)", message)
    if match:
        where = f" at line {match.group(1)}, column {match.group(2)}"
    if "input length is 0" in message:
        return "empty file"
    if "unexpected content after document" in message:
        count = _count_concatenated_documents(data)
        if count > 1:
            return f"{count} JSON documents concatenated (the writer wrote more than once); run fix_host_traces.py"
        return f"unexpected data after the JSON document{where}"
    if "unexpected end of data" in message or (position is not None and position >= len(data.rstrip())):
        return f"truncated JSON: the file ends inside the document{where} (the writer was interrupted)"
    if "control character" in message or "unexpected character" in message:
        return f"not valid JSON{where}: {message.split(':')[0]}"
    return f"not valid JSON{where}: {message}"


def json_kind(value: object) -> str:
    """What a parsed JSON value is, in JSON's words: 'JSON null', 'a JSON array'."""
    if value is None:
        return "JSON null"
    if isinstance(value, bool):
        return f"JSON {str(value).lower()}"
    kind = "number" if isinstance(value, (int, float)) else "string" if isinstance(value, str) else "array"
    return f"a JSON {kind}"


def _count_concatenated_documents(data: bytes) -> int:
    """How many complete top-level JSON values follow each other in `data` (only called on the error path)."""
    import json

    text = data.decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    count, pos, end = 0, 0, len(text)
    while pos < end:
        while pos < end and text[pos] in " \t\r\n":
            pos += 1
        if pos >= end:
            break
        try:
            _, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break
        count += 1
    return count


def _loads(path: Path, data: bytes | bytearray) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise TraceError(path, describe_json_problem(bytes(data), e)) from None


def sniff_kind(data: bytes) -> str:
    """'host', 'device' or 'unknown' from the first bytes of a trace."""
    head = data[:1 << 16]
    if re.search(rb'"traceEvents"\s*:', head):
        return "device"
    if re.search(rb'"schema"\s*:', head) or re.search(rb'"nodes"\s*:\s*\[', head):
        return "host"
    return "unknown"


def iter_document(path: Path, data: bytes, array_key: str, chunk_bytes: int = CHUNK_BYTES,
                  chunked_min_bytes: int = CHUNKED_PARSE_MIN_BYTES) -> tuple[dict, Iterator[list]]:
    """Parse a JSON object whose bulk is one array (`array_key`) and hand that array out in lists of elements.

    Small files are parsed whole. Large ones are cut at element boundaries and parsed slice by slice, so the
    peak memory is the raw bytes plus one slice of objects. Any doubt about the layout falls back to a whole parse,
    which also gives the exact error message for a broken file.
    """
    if len(data) >= chunked_min_bytes:
        located = _locate_array(data, array_key)
        if located is not None:
            header, start, end = located
            return header, _iter_array_slices(path, data, array_key, start, end, chunk_bytes)
    document = _loads(path, data)
    if not isinstance(document, dict):
        raise TraceError(path, f"expected a JSON object at the top level, found {json_kind(document)}")
    elements = document.pop(array_key, None)
    if elements is not None and not isinstance(elements, list):
        raise TraceError(path, f'"{array_key}" is not a list')

    def whole() -> Iterator[list]:
        if elements:
            yield elements

    if elements is None:
        document["__missing__"] = True
    return document, whole()


def _locate_array(data: bytes, array_key: str) -> tuple[dict, int, int] | None:
    match = re.search(rb'"' + array_key.encode() + rb'"\s*:\s*\[', data)
    if match is None:
        return None
    open_bracket = match.end() - 1
    end = len(data)
    for _ in range(16):
        end = data.rfind(b"]", open_bracket + 1, end)
        if end < 0:
            return None
        try:
            header = orjson.loads(data[:open_bracket] + b"[]" + data[end + 1:])
        except orjson.JSONDecodeError:
            continue
        if isinstance(header, dict) and header.get(array_key) == []:
            del header[array_key]
            return header, open_bracket + 1, end
        return None
    return None


_BOUNDARY = re.compile(rb"\}\s*,\s*\{")
_FIRST_KEY = re.compile(rb'\{\s*"([^"\\]{1,64})"\s*:')


def _iter_array_slices(path: Path, data: bytes, array_key: str, start: int, end: int,
                       chunk_bytes: int) -> Iterator[list]:
    first_keys: set[bytes] = set()
    pos = start
    target = min(chunk_bytes, 1 << 18)  # a small first slice teaches the keys that open an element
    while pos < end:
        cut = _next_cut(data, pos + target, end, first_keys, pos + 4 * chunk_bytes)
        elements = None
        for _ in range(64):
            stop = end if cut is None else cut[0]
            try:
                elements = orjson.loads(b"[" + data[pos:stop] + b"]")
                break
            except orjson.JSONDecodeError:
                if cut is None:
                    break
                cut = _next_cut(data, cut[1] + 1, end, first_keys, cut[1] + 4 * chunk_bytes)
        if elements is None:
            # Not cuttable where we thought: let the whole parse say what is wrong (or just succeed).
            document = _loads(path, data)
            remaining = document.get(array_key, []) if isinstance(document, dict) else []
            raise _RestartWholeParse(remaining if isinstance(remaining, list) else [])
        for element in elements[:64]:
            if isinstance(element, dict) and element:
                first_keys.add(next(iter(element)).encode())
        yield elements
        if cut is None:
            return
        pos = cut[1]
        target = chunk_bytes


class _RestartWholeParse(Exception):
    """The slicing went wrong after some slices were handed out: the reader starts over with the whole array."""

    def __init__(self, remaining: list):
        super().__init__("restart")
        self.remaining = remaining


def _next_cut(data: bytes, pos: int, end: int, first_keys: set[bytes],
              give_up_filter_at: int) -> tuple[int, int] | None:
    """(end of an element, start of the next) for the first element boundary at or after `pos`; None: to the end.

    A boundary is '}' ',' '{' whose '{' opens with a key that opens elements; whether it really ends an element
    is settled by parsing the slice (a cut inside an element leaves it unbalanced, which never parses)."""
    while pos < end:
        match = _BOUNDARY.search(data, pos, end)
        if match is None:
            return None
        brace = match.end() - 1
        key = _FIRST_KEY.match(data, brace)
        if not first_keys or (key is not None and key.group(1) in first_keys) or brace > give_up_filter_at:
            return match.start() + 1, brace
        pos = match.end()
    return None


# ---------------------------------------------------------------------------------------------------------------
# Host trace
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class HostTrace:
    """Host execution trace as parallel columns (one entry per node, in file order).

    What only the .et needs (tensors, operator schema, the observer's attributes) is kept already serialized as
    two chakra Node fragments per node: protobuf messages concatenate into one, so the writer appends the linked
    fields to them instead of rebuilding every node, and a parsed trace stays a few bytes objects per node.
    """

    path: str
    schema: str
    layout: str  # "chakra" (ctrl_deps/attrs, 1.0.2+ chakra and 1.1.x) or "legacy" (parent/top-level rf_id, 1.0.1)
    pid: int | None
    time: str
    start_ts: int
    finish_ts: int
    ids: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    rf_ids: list[int] = field(default_factory=list)
    tids: list[int] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    # serialized Node(inputs=..., outputs=...): values, shapes and types as JSON text
    io_fragments: list[bytes] = field(default_factory=list)
    # serialized Node(attr=[rf_id, fw_parent, seq_id, scope, tid, fw_tid, op_schema]) as chakra's converter writes
    attr_fragments: list[bytes] = field(default_factory=list)
    # Storage ids of the tensors each node reads or writes (inputs and outputs): what ties a collective to the ops
    # that produce and consume its buffer
    storages: list[tuple[int, ...]] = field(default_factory=list)
    # Whole inputs of the few nodes that describe collectives: index -> (values, types)
    comm_inputs: dict[int, tuple[list, list]] = field(default_factory=dict)
    process_groups: list[dict] = field(default_factory=list)
    duplicate_ids: int = 0

    def __len__(self) -> int:
        return len(self.ids)


def schema_family(schema: Any) -> str | None:
    """'1.0' or '1.1' for a supported host ET schema string, else None."""
    if not isinstance(schema, str):
        return None
    match = re.match(r"^(\d+)\.(\d+)\.\d+(?:-chakra\.\d+\.\d+\.\d+)?$", schema.strip())
    if not match:
        return None
    family = f"{match.group(1)}.{match.group(2)}"
    return family if family in KNOWN_SCHEMA_FAMILIES else None


def load_host_trace(path: str | Path, data: bytes | None = None, chunk_bytes: int = CHUNK_BYTES,
                    chunked_min_bytes: int = CHUNKED_PARSE_MIN_BYTES) -> HostTrace:
    """Parse a host ExecutionTraceObserver JSON into columns; one-line TraceError on anything unusable."""
    path = Path(path)
    if data is None:
        data = read_trace_bytes(path)
    kind = sniff_kind(data)
    if kind == "device":
        raise TraceError(path, "this is a Kineto device trace (traceEvents), not a host execution trace")
    try:
        header, slices = iter_document(path, data, "nodes", chunk_bytes, chunked_min_bytes)
    except TraceError:
        raise
    if "traceEvents" in header:
        raise TraceError(path, "this is a Kineto device trace (traceEvents), not a host execution trace")
    if header.pop("__missing__", False) or "schema" not in header:
        raise TraceError(path, 'not a host execution trace: no "schema" and "nodes" at the top level')
    schema = header.get("schema")
    family = schema_family(schema)
    if family is None:
        raise TraceError(path, f"unsupported host trace schema {schema!r} (supported: 1.0.x and 1.1.x)")
    trace = HostTrace(path=str(path), schema=str(schema), layout="", pid=_pid(header.get("pid")),
                      time=str(header.get("time", "")), start_ts=_as_int(header.get("start_ts")),
                      finish_ts=_as_int(header.get("finish_ts")))
    try:
        for elements in slices:
            _append_host_nodes(trace, elements)
            del elements
    except _RestartWholeParse as restart:
        _reset_columns(trace)
        _append_host_nodes(trace, restart.remaining)
    if not trace.ids:
        raise TraceError(path, "host execution trace has no nodes")
    seen: set[int] = set()
    for nid in trace.ids:
        if nid in seen:
            trace.duplicate_ids += 1
        seen.add(nid)
    if trace.duplicate_ids:
        raise TraceError(path, f"{trace.duplicate_ids} duplicate node ids (two writers?); run fix_host_traces.py")
    return trace


def _reset_columns(trace: HostTrace) -> None:
    for name in ("ids", "names", "parents", "rf_ids", "tids", "seq_ids", "io_fragments", "attr_fragments",
                 "storages"):
        getattr(trace, name).clear()
    trace.comm_inputs.clear()
    trace.process_groups.clear()


def _as_int(value: Any, default: int = 0) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    if isinstance(value, list) and value:
        return _as_int(value[0], default)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return default
    return default


def _as_dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


_EMPTY_LIST = b"[]"


def _dump(value: Any) -> bytes:
    if value is None or value == []:
        return _EMPTY_LIST
    return orjson.dumps(value)


def _append_host_nodes(trace: HostTrace, nodes: list) -> None:
    from chakra.schema.protobuf.et_def_pb2 import AttributeProto, IOInfo, Node

    ids, names, parents, rf_ids = trace.ids, trace.names, trace.parents, trace.rf_ids
    tids, seq_ids, comm_inputs = trace.tids, trace.seq_ids, trace.comm_inputs
    io_fragments, attr_fragments, storages = trace.io_fragments, trace.attr_fragments, trace.storages
    interned = _INTERNED
    dump = _dump
    for node in nodes:
        if not isinstance(node, dict) or "id" not in node or "name" not in node:
            raise TraceError(trace.path, f"node without id/name: {str(node)[:80]}")
        index = len(ids)
        node_id = node["id"]
        if type(node_id) is not int:  # ids are what parents and tensors refer to: nothing to guess them from
            raise TraceError(trace.path, f"node {index} has no integer 'id' ({str(node_id)[:40]!r}); not an "
                                         "ExecutionTraceObserver host trace")
        if not trace.layout:
            trace.layout = "chakra" if "attrs" in node or "ctrl_deps" in node else "legacy"
        # Fields of another type than the observer writes are read as missing (a name as text)
        name = node["name"]
        if not isinstance(name, str):
            name = "" if name is None else str(name)
        name = interned.setdefault(name, name)
        ids.append(node_id)
        names.append(name)
        if trace.layout == "chakra":
            parents.append(_as_int(node.get("ctrl_deps"), -1))
            attr_list = node.get("attrs")
            attrs = {a.get("name"): a.get("value") for a in attr_list if isinstance(a, dict)} \
                if isinstance(attr_list, list) else {}
            inputs = _as_dict(node.get("inputs"))
            outputs = _as_dict(node.get("outputs"))
            values, types = inputs.get("values"), inputs.get("types")
            output_values = outputs.get("values")
            io = Node(inputs=IOInfo(values=dump(values), shapes=dump(inputs.get("shapes")), types=dump(types)),
                      outputs=IOInfo(values=dump(outputs.get("values")), shapes=dump(outputs.get("shapes")),
                                     types=dump(outputs.get("types"))))
        else:
            parents.append(_as_int(node.get("parent"), -1))
            attrs = node
            values, types = node.get("inputs"), node.get("input_types")
            output_values = node.get("outputs")
            io = Node(inputs=IOInfo(values=dump(values), shapes=dump(node.get("input_shapes")), types=dump(types)),
                      outputs=IOInfo(values=dump(node.get("outputs")), shapes=dump(node.get("output_shapes")),
                                     types=dump(node.get("output_types"))))
        io_fragments.append(io.SerializeToString())
        storages.append(tensor_storages(values, output_values))
        rf = attrs.get("rf_id")
        rf = rf if isinstance(rf, int) else -1
        rf_ids.append(rf)
        tid = _as_int(attrs.get("tid"), 0)
        tids.append(tid)
        seq = attrs.get("seq_id")
        seq = seq if isinstance(seq, int) else -1
        seq_ids.append(seq)
        schema = attrs.get("op_schema")
        attr_fragments.append(b"".join((
            Node(attr=[AttributeProto(name="rf_id", int64_val=rf)]).SerializeToString(),
            piece("fw_parent", _as_int(attrs.get("fw_parent"), 0)), piece("seq_id", seq),
            piece("scope", _as_int(attrs.get("scope"), 0)), piece("tid", tid),
            piece("fw_tid", _as_int(attrs.get("fw_tid"), 0)),
            piece("op_schema", schema if isinstance(schema, str) else ""))))
        if name.startswith(COMM_NAME_PREFIXES):
            comm_inputs[index] = (values if isinstance(values, list) else [], types if isinstance(types, list) else [])
        elif name == PG_INIT_NODE:
            trace.process_groups.extend(_parse_process_groups(values))


_NO_STORAGES: tuple[int, ...] = ()


def tensor_storages(*value_lists: Any) -> tuple[int, ...]:
    """Storage ids of the tensors among an op's input or output values: a tensor is written by the observer as
    [tensor_id, storage_id, offset, numel, itemsize, device], alone or inside a list (GenericList[Tensor])."""
    found: list[int] = []
    for values in value_lists:
        if not isinstance(values, list):
            continue
        pending = list(values)
        while pending:  # iterative: lists of lists of tensors at most a few levels deep
            value = pending.pop()
            if type(value) is not list:
                continue
            if len(value) == 6 and type(value[1]) is int and type(value[5]) is str:
                found.append(value[1])
            else:
                pending.extend(value)
    return tuple(sorted(set(found))) if found else _NO_STORAGES


# Operator names repeat thousands of times: one string object each.
_INTERNED: dict[str, str] = {}
# Serialized single-attribute Node fragments, by (name, value): most attribute values repeat across nodes.
_ATTR_PIECES: dict[tuple, bytes] = {}


def piece(name: str, value: int | str) -> bytes:
    key = (name, value)
    blob = _ATTR_PIECES.get(key)
    if blob is None:
        from chakra.schema.protobuf.et_def_pb2 import AttributeProto, Node

        attr = AttributeProto(name=name, string_val=value) if isinstance(value, str) else \
            AttributeProto(name=name, int64_val=value)
        blob = Node(attr=[attr]).SerializeToString()
        if len(_ATTR_PIECES) < 1 << 16:
            _ATTR_PIECES[key] = blob
    return blob


def _parse_process_groups(values: Any) -> list[dict]:
    """The process-group descriptions the observer stores as one JSON string input of `## process_group:init ##`."""
    groups: list[dict] = []
    for value in values if isinstance(values, list) else []:
        if not isinstance(value, str):
            continue
        try:
            parsed = orjson.loads(value)
        except orjson.JSONDecodeError:
            continue
        for group in parsed if isinstance(parsed, list) else [parsed]:
            if isinstance(group, dict):
                groups.append(group)
    return groups


def is_structural(name: str) -> bool:
    """The observer's process/thread root nodes: structure, not operators."""
    return name.startswith(STRUCTURAL_NODE_PREFIXES)


# ---------------------------------------------------------------------------------------------------------------
# Device (Kineto) trace
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class DeviceTrace:
    """Kineto trace reduced to three tables: CPU operators, runtime calls and GPU activity."""

    path: str
    pids: set = field(default_factory=set)
    distributed: dict = field(default_factory=dict)
    base_time_ns: int | None = None
    trace_name: str = ""
    # CPU operators and user annotations
    cpu_names: list[str] = field(default_factory=list)
    cpu_ts: list[float] = field(default_factory=list)
    cpu_dur: list[float] = field(default_factory=list)
    cpu_tid: list[Any] = field(default_factory=list)
    cpu_ext: list[int] = field(default_factory=list)
    cpu_rf: list[int] = field(default_factory=list)
    cpu_seq: list[int] = field(default_factory=list)
    cpu_is_annotation: list[bool] = field(default_factory=list)
    # CUDA/HIP runtime and driver calls
    rt_names: list[str] = field(default_factory=list)
    rt_ts: list[float] = field(default_factory=list)
    rt_dur: list[float] = field(default_factory=list)
    rt_tid: list[Any] = field(default_factory=list)
    rt_corr: list[int] = field(default_factory=list)
    # GPU kernels, memcpy, memset
    gpu_names: list[str] = field(default_factory=list)
    gpu_cat: list[str] = field(default_factory=list)
    gpu_ts: list[float] = field(default_factory=list)
    gpu_dur: list[float] = field(default_factory=list)
    gpu_device: list[int] = field(default_factory=list)
    gpu_stream: list[int] = field(default_factory=list)
    gpu_corr: list[int] = field(default_factory=list)
    gpu_bytes: list[int] = field(default_factory=list)
    gpu_pg_name: dict[int, str] = field(default_factory=dict)
    # "Stream Wait Event" synchronisation events: (device, waiting stream, stream waited on, correlation id of the
    # cudaStreamWaitEvent call, correlation id of the cudaEventRecord it waits for)
    stream_waits: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    thread_names: dict = field(default_factory=dict)
    # Complete events of the categories above left out for want of a usable "ts" or "dur" (missing, not a number,
    # or a negative duration), by category
    unusable_events: dict[str, int] = field(default_factory=dict)
    # Kineto's "Record Window End" (µs): the profiler keeps no activity that ends after it (its outOfRange filter),
    # so an event that does holds a time no profiler measured. Such events are left out and counted, by table.
    window_end_us: float | None = None
    past_window_end: dict[str, int] = field(default_factory=dict)

    @property
    def has_record_function_ids(self) -> bool:
        return any(rf >= 0 for rf in self.cpu_rf)


def load_device_trace(path: str | Path, data: bytes | None = None, chunk_bytes: int = CHUNK_BYTES,
                      chunked_min_bytes: int = CHUNKED_PARSE_MIN_BYTES) -> DeviceTrace:
    """Parse a Kineto chrome trace into the tables the linker needs; one-line TraceError otherwise."""
    path = Path(path)
    if data is None:
        data = read_trace_bytes(path)
    if sniff_kind(data) == "host":
        raise TraceError(path, "this is a host execution trace (schema/nodes), not a Kineto device trace")
    header, slices = iter_document(path, data, "traceEvents", chunk_bytes, chunked_min_bytes)
    if "nodes" in header and "schema" in header:
        raise TraceError(path, "this is a host execution trace (schema/nodes), not a Kineto device trace")
    if header.pop("__missing__", False):
        raise TraceError(path, 'not a Kineto device trace: no "traceEvents" at the top level')
    trace = DeviceTrace(path=str(path))
    trace.distributed = header.get("distributedInfo") or {}
    base = header.get("baseTimeNanoseconds")
    trace.base_time_ns = base if isinstance(base, int) else None
    trace.trace_name = str(header.get("traceName", ""))
    try:
        for events in slices:
            _append_events(trace, events)
            del events
    except _RestartWholeParse as restart:
        fresh = DeviceTrace(path=str(path), distributed=trace.distributed, base_time_ns=trace.base_time_ns,
                            trace_name=trace.trace_name)
        trace = fresh
        _append_events(trace, restart.remaining)
    _leave_out_events_past_window_end(trace)
    if not trace.cpu_names:
        unusable = sum(trace.unusable_events.get(cat, 0) for cat in CPU_CATEGORIES)
        if unusable:
            raise TraceError(path, f"none of its {unusable} CPU operator events (cpu_op/user_annotation) has a "
                                   f"usable time: {UNUSABLE_TIME}")
        raise TraceError(path, "Kineto trace has no CPU operators (cpu_op/user_annotation events)")
    return trace


UNUSABLE_TIME = '"ts" or "dur" missing, not a number, or a negative duration'
PAST_WINDOW_END = ("they end after the trace's own \"Record Window End\", where the profiler stopped and kept "
                   "nothing that ended later: times no profiler measured")
# Kineto writes times in µs with three decimals (whole ns); a start plus a duration can overshoot the window end
# by a rounding error, never by a microsecond.
WINDOW_END_ROUNDING_US = 1.0
# The device trace's tables, by the prefix of their columns, and what one row of each is called.
DEVICE_TABLES = {"cpu_": "CPU operator", "rt_": "runtime call", "gpu_": "GPU activity"}


def _leave_out_events_past_window_end(trace: DeviceTrace) -> None:
    """Drop the rows of every table whose event ends after the trace's Record Window End (see PAST_WINDOW_END)."""
    if trace.window_end_us is None:
        return
    last_end = trace.window_end_us + WINDOW_END_ROUNDING_US
    for prefix, row_name in DEVICE_TABLES.items():
        starts, durations = getattr(trace, prefix + "ts"), getattr(trace, prefix + "dur")
        keep = [start + duration <= last_end for start, duration in zip(starts, durations)]
        dropped = len(keep) - sum(keep)
        if not dropped:
            continue
        trace.past_window_end[row_name] = dropped
        for column in fields(trace):
            if column.name.startswith(prefix) and isinstance(getattr(trace, column.name), list):
                values = getattr(trace, column.name)
                setattr(trace, column.name, [value for value, kept in zip(values, keep) if kept])
        if prefix == "gpu_":  # the process-group names are keyed by row: renumber them
            new_index = {old: new for new, old in enumerate(i for i, kept in enumerate(keep) if kept)}
            trace.gpu_pg_name = {new_index[i]: name for i, name in trace.gpu_pg_name.items() if i in new_index}


def _time(value: Any) -> float | None:
    """A Kineto time field as a number: int, float, or a number written as a string (some tools quote them)."""
    if type(value) is int or type(value) is float:
        return value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return None
        return number if math.isfinite(number) else None
    return None


def _pid(value: Any) -> int | None:
    """A process id as an int (also when written as text), None when there is none."""
    number = _event_id(value)
    return number if number >= 0 else None


def _event_id(value: Any) -> int:
    """An id of Kineto's args (External id, Record function id, correlation) as an int, -1 when there is none."""
    if type(value) is int:
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return -1


def _append_events(trace: DeviceTrace, events: list) -> None:
    cpu_names, cpu_ts, cpu_dur, cpu_tid = trace.cpu_names, trace.cpu_ts, trace.cpu_dur, trace.cpu_tid
    cpu_ext, cpu_rf, cpu_seq, cpu_ann = trace.cpu_ext, trace.cpu_rf, trace.cpu_seq, trace.cpu_is_annotation
    pids = trace.pids
    for event in events:
        if not isinstance(event, dict):
            continue
        ph = event.get("ph")
        if ph != "X":
            if ph == "M" and event.get("name") == "thread_name":
                args = event.get("args")
                trace.thread_names[event.get("tid")] = args.get("name", "") if type(args) is dict else ""
            elif ph == "i" and event.get("name") == "Record Window End":
                trace.window_end_us = _time(event.get("ts"))
            continue
        cat = event.get("cat")
        if cat not in USED_CATEGORIES:
            continue
        # A complete event without a start and a duration cannot be placed in time: it is left out and counted
        # (Kineto always writes both, as numbers; a duration of 0 is valid, a negative one is not a measurement).
        ts, dur = event.get("ts"), event.get("dur", 0 if cat == SYNC_CATEGORY else None)
        if type(ts) is not int and type(ts) is not float:  # the usual numbers skip the call: this loop is hot
            ts = _time(ts)
        if type(dur) is not int and type(dur) is not float:
            dur = _time(dur)
        if ts is None or dur is None or dur < 0:
            trace.unusable_events[cat] = trace.unusable_events.get(cat, 0) + 1
            continue
        args = event.get("args")
        if type(args) is not dict:  # missing, or not the object Kineto writes: no arguments to read
            args = {}
        name = event.get("name", "")
        if type(name) is not str:
            name = "" if name is None else str(name)
        if cat in CPU_CATEGORIES:
            cpu_names.append(name)
            cpu_ts.append(ts)
            cpu_dur.append(dur)
            cpu_tid.append(event.get("tid"))
            ext, rf, seq = args.get("External id"), args.get("Record function id"), args.get("Sequence number")
            cpu_ext.append(ext if type(ext) is int else _event_id(ext))
            cpu_rf.append(rf if type(rf) is int else _event_id(rf))
            cpu_seq.append(seq if type(seq) is int else _event_id(seq))
            cpu_ann.append(cat == "user_annotation")
            pid = event.get("pid")
            pid = pid if type(pid) is int and pid >= 0 else _pid(pid)
            if pid is not None:
                pids.add(pid)
        elif cat in GPU_CATEGORIES:
            index = len(trace.gpu_names)
            trace.gpu_names.append(name)
            trace.gpu_cat.append(cat)
            trace.gpu_ts.append(ts)
            trace.gpu_dur.append(dur)
            trace.gpu_device.append(_as_int(args.get("device", event.get("pid")), 0))
            trace.gpu_stream.append(_as_int(args.get("stream", event.get("tid")), 0))
            corr = args.get("correlation", args.get("External id"))
            trace.gpu_corr.append(corr if type(corr) is int else _event_id(corr))
            trace.gpu_bytes.append(_as_int(args.get("bytes"), 0))
            pg = args.get("Process Group Name")
            if isinstance(pg, str) and pg:
                trace.gpu_pg_name[index] = pg
        elif cat == SYNC_CATEGORY:
            if name == "Stream Wait Event":
                trace.stream_waits.append((
                    _as_int(args.get("device", event.get("pid")), 0), _as_int(args.get("stream", event.get("tid")), 0),
                    _as_int(args.get("wait_on_stream"), -1), _as_int(args.get("correlation"), -1),
                    _as_int(args.get("wait_on_cuda_event_record_corr_id"), -1)))
        elif cat in RUNTIME_CATEGORIES:
            trace.rt_names.append(name)
            trace.rt_ts.append(ts)
            trace.rt_dur.append(dur)
            trace.rt_tid.append(event.get("tid"))
            corr = args.get("correlation")
            trace.rt_corr.append(corr if type(corr) is int else _event_id(corr))
