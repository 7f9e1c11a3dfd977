"""Diagnose and repair PyTorch ExecutionTraceObserver host traces (JSON, plain or gzipped)."""
from __future__ import annotations

import contextlib
import filecmp
import gc
import gzip
import json
import os
import re
import shutil
import stat
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import orjson

from .atomic import atomic_output, process_is_alive
from .discover import find_runs
from .layout import PG_INIT_NODE
from .load import json_kind

# Host trace schemas PyTorch has written so far: "1.0.1" (torch 2.0-2.2, the GPU fixtures), then
# "1.0.2-chakra.0.0.4" ... "1.1.1-chakra.0.0.4" and "1.1.1-chakra.1.0.0". A 2.x would change the node layout.
SUPPORTED_SCHEMA_RE = re.compile(r"1\.[01]\.\d+(?:-chakra\.\d+\.\d+\.\d+)?")
SUPPORTED_SCHEMAS_TEXT = "1.0.x and 1.1.x, e.g. 1.0.1 or 1.1.1-chakra.0.0.4"

# A truncated trace with fewer complete nodes than this is not worth keeping.
DEFAULT_MIN_NODES = 10

# Names a tracer gives host traces: host.<rank>.json[.gz] (chakra's recipe) and <name>_host.json[.gz] (the seed).
HOST_NAME_RE = re.compile(r"(?:^|[._-])host(?:[._-]\d+)?\.json(?:\.gz)?$")
SKIP_DIRS = {".git", "__pycache__", "node_modules", ".venv", "chakra-venv", ".pytest_cache"}

# Kinds of diagnosis.
VALID = "valid"
CONCATENATED = "concatenated"
TRUNCATED = "truncated"
DUPLICATE_IDS = "duplicate_ids"
TWO_WRITERS = "two_writers"
PADDED = "padded"
EMPTY = "empty"
NOT_JSON = "not_json"
INVALID_JSON = "invalid_json"
DEVICE_TRACE = "device_trace"
NOT_HOST_TRACE = "not_host_trace"
UNKNOWN_SCHEMA = "unknown_schema"
UNREADABLE = "unreadable"
BOM = "byte_order_mark"
NO_OPERATORS = "no_operators"

UTF8_BOM = b"\xef\xbb\xbf"
BOM_PROBLEM = "starts with a UTF-8 byte-order mark (an editor or a Windows tool saved it; PyTorch writes none)"
# What to do about a host trace that needs a repair but cannot be written in place.
READ_ONLY_HINT = "copy the run to a writable folder, or chmod u+w"
# Where buffered writers flush: two processes writing one path each from offset 0 leave each other's text in blocks
# that start at multiples of this.
WRITE_BLOCK = 4096
# The observer's own structure and the process-group record: a trace of only these holds no operator.
STRUCTURAL_PREFIXES = ("[pytorch|profiler|execution_trace|", "[pytorch|profiler|execution_graph|")
NO_OPERATORS_PROBLEM = ("holds {nodes} node(s) and no operator: the ExecutionTraceObserver was re-registered during "
                        "the run and truncated its own file; the data was lost at capture: trace again, registering "
                        "the observer once per process")
# NaN and Infinity where a JSON value goes (Python's json.dump writes them; PyTorch writes "nan"/"inf" strings).
_NON_FINITE_RE = re.compile(r"[:\[,]\s*(?:-?Infinity|NaN)(?=\s*[,\]}])")

_WS_RE = re.compile(r"[ \t\n\r]*")
_HEADER_RE = re.compile(r'\{\s*"schema"\s*:')
_PID_AFTER_HEADER_RE = re.compile(r'"pid"\s*:\s*(\d+)')
# Characters that never occur in a JSON text outside strings and never unescaped inside them; lone surrogates
# stand for bytes that were not UTF-8. Either one means the bytes are not what one JSON writer produced.
_BAD_CHARS_RE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\udc80-\udcff]")
_NUMBER_TAIL_RE = re.compile(r"[-+.eE0-9]*")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_DECODER = json.JSONDecoder()


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic garbage collector while building many containers: parsing a 55 MB host trace creates
    ~10^6 lists and dicts, which trigger repeated collections of the growing heap (2.3 s instead of 0.6 s)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def parse_json_fast(data: bytes) -> object:
    """orjson.loads with the garbage collector paused; raises orjson.JSONDecodeError (a ValueError)."""
    with gc_paused():
        return orjson.loads(data)


@dataclass
class Diagnosis:
    """What is wrong with a host trace, if anything, and whether fix_host_traces.py can repair it."""

    path: Path
    kind: str
    problem: Optional[str] = None  # one line, without the path; None when the trace is valid
    repairable: bool = False
    schema: Optional[str] = None
    nodes: int = 0  # nodes in the trace as it is (valid) or as it will be after the repair
    action: Optional[str] = None  # what the repair does, when repairable
    document: Optional[dict] = field(default=None, repr=False)  # the parsed trace, when asked for and valid
    note: str = ""  # what a reader should know about a valid trace (NaN values)

    @property
    def ok(self) -> bool:
        return self.kind == VALID

    def message(self) -> str:
        """The one-line error a user reads, e.g. 'error: host.1.json: 2 JSON objects concatenated (...); run fix_host_traces.py'."""
        if self.ok:
            return f"ok: {self.path}: valid host trace ({self.nodes} nodes)"
        hint = "; run fix_host_traces.py" if self.repairable else ""
        return f"error: {self.path}: {self.problem}{hint}"


@dataclass
class RepairResult:
    """What repair_host_trace() did to one file."""

    path: Path
    status: str  # "unchanged", "repaired", "needs_repair" (check only) or "failed"
    diagnosis: Diagnosis
    detail: str
    backup: Optional[Path] = None
    nodes_kept: int = 0
    nodes_dropped: int = 0

    @property
    def ok(self) -> bool:
        return self.status in ("unchanged", "repaired")

    def line(self) -> str:
        label = {"unchanged": "ok", "repaired": "repaired", "needs_repair": "needs repair", "failed": "error"}[self.status]
        return f"{label}: {self.path}: {self.detail}"


# ----------------------------------------------------------------------------------------------------------
# Reading


@dataclass
class _Raw:
    data: bytes
    gzipped: bool
    gzip_truncated: bool = False


def _read_raw(path: Path) -> _Raw:
    """Bytes of the JSON text; a gzip stream cut short yields what it holds (the JSON is then truncated too)."""
    raw = path.read_bytes()
    if raw[:2] != b"\x1f\x8b":
        return _Raw(raw, gzipped=False)
    out = []
    rest = raw
    truncated = False
    while rest:
        inflater = zlib.decompressobj(wbits=31)
        try:
            out.append(inflater.decompress(rest))
        except zlib.error as exc:
            raise _Unusable(UNREADABLE, f"corrupt gzip data ({exc})") from None
        if not inflater.eof:
            truncated = True
            break
        rest = inflater.unused_data.lstrip(b"\x00")  # gzip allows zero padding after a member
    return _Raw(b"".join(out), gzipped=True, gzip_truncated=truncated)


class _Unusable(Exception):
    def __init__(self, kind: str, problem: str):
        super().__init__(problem)
        self.kind = kind
        self.problem = problem


# ----------------------------------------------------------------------------------------------------------
# Checks shared by the fast path (whole file parsed by orjson) and the scanning path


def _schema_problem(fields: dict, nodes_is_list: bool) -> Optional[tuple]:
    """(kind, problem) when the top-level object is not a host trace we can read, else None."""
    if "traceEvents" in fields:
        return (DEVICE_TRACE, "this is a device (Kineto) trace, not a host trace (it has 'traceEvents'); "
                "pass it as the device trace (device.<rank>.json)")
    if "schema" not in fields or not nodes_is_list:
        keys = ", ".join(list(fields)[:5]) or "no keys"
        return (NOT_HOST_TRACE, f"not an ExecutionTraceObserver host trace (no 'schema' and 'nodes' list; keys: {keys})")
    schema = fields["schema"]
    if not isinstance(schema, str) or not SUPPORTED_SCHEMA_RE.fullmatch(schema):
        return (UNKNOWN_SCHEMA, f"unknown host trace schema version {schema!r} (supported: {SUPPORTED_SCHEMAS_TEXT})")
    return None


def _node_id(node: object) -> object:
    return node.get("id") if isinstance(node, dict) else None


def _parent_id(node: object) -> object:
    # 1.1.x writes the enclosing operator as "ctrl_deps", 1.0.x as "parent".
    if not isinstance(node, dict):
        return None
    return node.get("ctrl_deps", node.get("parent"))


def _duplicate_indices(ids: list) -> list:
    seen = set()
    dups = []
    for index, node_id in enumerate(ids):
        if node_id in seen:
            dups.append(index)
        else:
            seen.add(node_id)
    return dups


def _bad_id_problem(ids: list) -> Optional[str]:
    for index, node_id in enumerate(ids):
        if not isinstance(node_id, int) or isinstance(node_id, bool):
            return f"node {index} has no integer 'id' ({node_id!r}); not an ExecutionTraceObserver host trace"
    return None


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


# ----------------------------------------------------------------------------------------------------------
# Scanning decoder: walks concatenated, truncated or damaged text one top-level value and one node at a time,
# with the C scanner of the standard json module. Iterative, linear in the text, and it keeps only node ids.


@dataclass
class _Doc:
    start: int
    end: Optional[int] = None  # index after the closing brace, when complete
    fields: dict = field(default_factory=dict)  # top-level members other than "nodes"
    nodes_is_list: bool = False
    nodes_open: Optional[int] = None  # index after '['
    nodes_close: Optional[int] = None  # index of ']'
    node_spans: list = field(default_factory=list)
    node_ids: list = field(default_factory=list)
    node_parents: list = field(default_factory=list)
    has_operator: bool = False  # a node other than the observer's structure (see NO_OPERATORS_PROBLEM)
    last_member_end: Optional[int] = None  # end of the last complete top-level member
    error: Optional[json.JSONDecodeError] = None
    at_eof: bool = False  # the error is the text ending, not a syntax error

    @property
    def complete(self) -> bool:
        return self.end is not None

    @property
    def truncated(self) -> bool:
        return self.error is not None and self.at_eof

    @property
    def broken(self) -> bool:
        return self.error is not None and not self.at_eof

    @property
    def is_host(self) -> bool:
        return "schema" in self.fields and self.nodes_is_list

    @property
    def pid(self) -> object:
        return self.fields.get("pid")


def _skip_ws(text: str, index: int) -> int:
    return _WS_RE.match(text, index).end()


def _ends_at_eof(text: str, exc: json.JSONDecodeError, end: int) -> bool:
    """Whether a decode error is the text running out (truncation) rather than a syntax error."""
    if exc.pos >= end or exc.msg.startswith("Unterminated string"):
        return True
    tail = text[exc.pos:end]
    if _NUMBER_TAIL_RE.fullmatch(tail):
        return True
    if any(literal.startswith(tail) for literal in _LITERALS):
        return True
    return tail.startswith("\\") and len(tail) <= 6 and '"' not in tail


def _fail(text: str, message: str, pos: int):
    raise json.JSONDecodeError(message, text, pos)


def _walk_nodes(text: str, index: int, end: int, doc: _Doc) -> int:
    index = _skip_ws(text, index)
    if index < end and text[index] == "]":
        doc.nodes_close = index
        return index + 1
    while True:
        if index >= end:
            _fail(text, "Expecting value", index)
        node, after = _DECODER.raw_decode(text, index)
        doc.node_spans.append((index, after))
        doc.node_ids.append(_node_id(node))
        doc.node_parents.append(_parent_id(node))
        doc.has_operator = doc.has_operator or _is_operator(node)
        index = _skip_ws(text, after)
        if index >= end:
            _fail(text, "Expecting ',' delimiter", index)
        if text[index] == ",":
            index = _skip_ws(text, index + 1)
            continue
        if text[index] == "]":
            doc.nodes_close = index
            return index + 1
        _fail(text, "Expecting ',' delimiter", index)


def _walk_document(text: str, start: int, end: int) -> _Doc:
    """Walk one JSON object starting at text[start] == '{' (a host trace's top level)."""
    doc = _Doc(start)
    try:
        index = _skip_ws(text, start + 1)
        if index < end and text[index] == "}":
            doc.end = index + 1
            return doc
        while True:
            if index >= end:
                _fail(text, "Expecting property name enclosed in double quotes", index)
            if text[index] != '"':
                _fail(text, "Expecting property name enclosed in double quotes", index)
            key, index = json.decoder.scanstring(text, index + 1)
            index = _skip_ws(text, index)
            if index >= end or text[index] != ":":
                _fail(text, "Expecting ':' delimiter", index)
            index = _skip_ws(text, index + 1)
            if index >= end:
                _fail(text, "Expecting value", index)
            if key == "nodes" and text[index] == "[":
                doc.nodes_is_list = True
                doc.nodes_open = index + 1
                index = _walk_nodes(text, index + 1, end, doc)
            else:
                doc.fields[key], index = _DECODER.raw_decode(text, index)
                if index >= end and not isinstance(doc.fields[key], (str, list, dict)):
                    # A number running to the end of the text may be cut inside it ("finish_ts": 20707 of 20707199):
                    # not known whole, it is not kept
                    del doc.fields[key]
                    _fail(text, "Expecting ',' delimiter", index)
            doc.last_member_end = index
            index = _skip_ws(text, index)
            if index >= end:
                _fail(text, "Expecting ',' delimiter", index)
            if text[index] == ",":
                index = _skip_ws(text, index + 1)
                continue
            if text[index] == "}":
                doc.end = index + 1
                return doc
            _fail(text, "Expecting ',' delimiter", index)
    except json.JSONDecodeError as exc:
        doc.error = exc
        doc.at_eof = _ends_at_eof(text, exc, end)
    except RecursionError:  # a pathologically nested value; not a trace
        doc.error = json.JSONDecodeError("nesting too deep", text, start)
    return doc


@dataclass
class _Scan:
    text: str
    end: int  # end of the content: trailing whitespace and NUL padding cut off
    docs: list
    garbage: list  # (start, end) spans that belong to no complete or truncated document
    trailing_nuls: int
    bad_char_pos: Optional[int]
    header_pids: list


def _scan(text: str) -> _Scan:
    stripped = text.rstrip(" \t\n\r\x00")
    end = len(stripped)
    trailing_nuls = text.count("\x00", end)
    docs: list = []
    garbage: list = []
    index = _skip_ws(text, 0)
    while index < end:
        if text[index] == "{":
            doc = _walk_document(text, index, end)
            docs.append(doc)
            if doc.complete:
                index = _skip_ws(text, doc.end)
                continue
            if doc.truncated:
                break
            nxt = _next_header(text, index + 1, end)
            garbage.append((index, nxt if nxt is not None else end))
        else:
            nxt = _next_header(text, index, end)
            garbage.append((index, nxt if nxt is not None else end))
        if nxt is None:
            break
        index = nxt
    bad = _BAD_CHARS_RE.search(text, 0, end)
    pids = []
    for match in _HEADER_RE.finditer(text, 0, end):
        pid = _PID_AFTER_HEADER_RE.search(text, match.end(), min(end, match.end() + 400))
        pids.append(int(pid.group(1)) if pid else None)
    return _Scan(text, end, docs, garbage, trailing_nuls, bad.start() if bad else None, pids)


def _next_header(text: str, start: int, end: int) -> Optional[int]:
    match = _HEADER_RE.search(text, start, end)
    return match.start() if match else None


def _line_col(text: str, pos: int) -> str:
    line = text.count("\n", 0, pos) + 1
    col = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return f"line {line}, column {col}"


# ----------------------------------------------------------------------------------------------------------
# Analysis


@dataclass
class _Plan:
    """How to write the repaired document: which document, which nodes, how to close it."""

    doc: _Doc
    drop: frozenset  # node indices (duplicates) to leave out
    close_truncated: bool = False
    marker: Optional[dict] = None
    partial_node: bool = False  # a node cut in the middle is left out


@dataclass
class _Analysis:
    diagnosis: Diagnosis
    raw: Optional[_Raw] = None
    text: Optional[str] = None
    plan: Optional[_Plan] = None


def _analyse(path: Path, *, min_nodes: int, keep_document: bool = False, need_plan: bool = False) -> _Analysis:
    path = Path(path)
    try:
        raw = _read_raw(path)
    except _Unusable as exc:
        return _Analysis(Diagnosis(path, exc.kind, exc.problem))
    except OSError as exc:
        return _Analysis(Diagnosis(path, UNREADABLE, f"cannot read: {exc.strerror or exc}"))
    bom = raw.data.startswith(UTF8_BOM)
    if bom:
        raw.data = raw.data[len(UTF8_BOM):]
    if not raw.data.strip(b" \t\r\n"):
        what = "empty file" if not raw.gzipped else "empty file (the gzip stream holds no data)"
        if raw.data:
            what += " (only whitespace)"
        return _Analysis(Diagnosis(path, EMPTY, what))
    # A document that does not end in '}' cannot be valid: skip the full parse of a truncated file. Text that does
    # not start with '{' is parsed all the same: JSON that is not an object (null, a list) is named as what it is.
    if not bom and not raw.gzip_truncated and (raw.data.rstrip(b" \t\r\n")[-1:] == b"}"
                                               or raw.data.lstrip(b" \t\r\n")[:1] != b"{"):
        try:
            obj = parse_json_fast(raw.data)
        except orjson.JSONDecodeError:
            obj = None
        else:
            analysis = _analyse_parsed(path, obj, keep_document)
            if analysis.diagnosis.kind != DUPLICATE_IDS or not need_plan:
                return analysis
    # Slow path: the text is damaged (or has duplicates to cut out); walk it piece by piece.
    text = raw.data.decode("utf-8", errors="surrogateescape")
    raw.data = raw.data[:64]  # only the head is quoted in messages; the text is what gets walked
    with gc_paused():
        scan = _scan(text)
    analysis = _analyse_scan(path, scan, raw, min_nodes)
    analysis.raw = raw
    analysis.text = text
    if bom:
        _with_bom(analysis, scan)
    if analysis.diagnosis.ok:
        non_finite = len(_NON_FINITE_RE.findall(text))
        if non_finite:
            analysis.diagnosis.note = (f"; {_plural(non_finite, 'NaN/Infinity value')}, which are not JSON (the "
                                       "converter reads them as null)")
        if keep_document:
            # Valid JSON that orjson refuses (NaN, Infinity): the standard parser reads it.
            with gc_paused():
                analysis.diagnosis.document = json.loads(text)
    return analysis


def _with_bom(analysis: _Analysis, scan: _Scan) -> None:
    """A trace behind a byte-order mark: repairable by dropping it, on top of whatever else the rest needs."""
    diagnosis = analysis.diagnosis
    if diagnosis.ok:
        complete = [doc for doc in scan.docs if doc.complete]
        analysis.diagnosis = Diagnosis(diagnosis.path, BOM, BOM_PROBLEM, repairable=True, schema=diagnosis.schema,
                                       nodes=diagnosis.nodes, action="removed the byte-order mark")
        analysis.plan = _Plan(complete[0], frozenset())
    elif diagnosis.repairable:
        diagnosis.problem = f"{BOM_PROBLEM}; {diagnosis.problem}"
        diagnosis.action = f"removed the byte-order mark; {diagnosis.action}"
    else:
        diagnosis.problem = f"{BOM_PROBLEM}; and {diagnosis.problem}"


def _analyse_parsed(path: Path, obj: object, keep_document: bool) -> _Analysis:
    if not isinstance(obj, dict):
        return _Analysis(Diagnosis(path, NOT_HOST_TRACE, f"{json_kind(obj)}, not an ExecutionTraceObserver host trace "
                                                         "(a JSON object with 'schema' and 'nodes')"))
    nodes = obj.get("nodes")
    problem = _schema_problem(obj, isinstance(nodes, list))
    if problem:
        return _Analysis(Diagnosis(path, *problem, schema=_schema_of(obj)))
    ids = [_node_id(node) for node in nodes]
    bad = _bad_id_problem(ids)
    if bad:
        return _Analysis(Diagnosis(path, NOT_HOST_TRACE, bad, schema=obj["schema"]))
    dups = _duplicate_indices(ids)
    if dups:
        return _Analysis(Diagnosis(path, DUPLICATE_IDS, _dup_problem(ids, dups), repairable=True, schema=obj["schema"],
                                   nodes=len(ids) - len(dups), action="kept the first node of each id"))
    if not any(_is_operator(node) for node in nodes):
        return _Analysis(Diagnosis(path, NO_OPERATORS, NO_OPERATORS_PROBLEM.format(nodes=len(nodes)),
                                   schema=obj["schema"], nodes=len(nodes)))
    return _Analysis(Diagnosis(path, VALID, schema=obj["schema"], nodes=len(nodes), document=obj if keep_document else None))


def _is_operator(node: object) -> bool:
    name = node.get("name") if isinstance(node, dict) else None
    return isinstance(name, str) and not name.startswith(STRUCTURAL_PREFIXES) and name != PG_INIT_NODE


def _schema_of(fields: dict) -> Optional[str]:
    schema = fields.get("schema")
    return schema if isinstance(schema, str) else None


def _dup_problem(ids: list, dups: list) -> str:
    return f"{_plural(len(dups), 'duplicate node id')} (first: {ids[dups[0]]})"


def _analyse_scan(path: Path, scan: _Scan, raw: _Raw, min_nodes: int) -> _Analysis:
    text, end = scan.text, scan.end
    complete = [doc for doc in scan.docs if doc.complete]
    truncated = [doc for doc in scan.docs if doc.truncated]
    hosts = [doc for doc in complete if doc.is_host]
    headers = len(scan.header_pids)
    distinct_pids = sorted({pid for pid in scan.header_pids if pid is not None} | {d.pid for d in hosts if isinstance(d.pid, int)})

    def refuse(kind: str, problem: str) -> _Analysis:
        return _Analysis(Diagnosis(path, kind, problem))

    if end == 0:
        return refuse(EMPTY, "empty file (only whitespace and NUL bytes)")

    # Writers' text mixed up: characters no JSON writer emits, or text that no document accounts for.
    damaged = bool(scan.garbage) or (scan.bad_char_pos is not None)
    if damaged:
        evidence = _damage_evidence(scan, headers, distinct_pids)
        if headers >= 2:
            mixed = f"two writers mixed their text in this file ({evidence})"
        else:
            mixed = f"damaged text ({evidence}): another process wrote into this file, or it was corrupted"
        if hosts and len({d.pid for d in hosts}) == 1:
            keep = hosts[-1]
            dropped = end - (keep.end - keep.start)
            what = "the one complete document" if len(hosts) == 1 else f"the last of {len(hosts)} complete documents"
            action = f"kept {what} (pid {keep.pid}, {{nodes}} nodes), dropped {dropped} bytes of other text"
            return _plan_for(path, keep, mixed, TWO_WRITERS, action, min_nodes)
        if complete and not hosts and headers == 0:
            first = complete[0]
            kind, why = _schema_problem(first.fields, first.nodes_is_list) or (NOT_HOST_TRACE, "not a host trace")
            return refuse(kind, f"{why}; and the file holds other text ({evidence})")
        if hosts:
            pids = ", ".join(str(d.pid) for d in hosts)
            return refuse(TWO_WRITERS, f"{mixed}; {len(hosts)} complete "
                                       f"documents from different processes (pids {pids}), cannot tell which is right: "
                                       "trace again with one output file per process")
        if headers <= 1 and scan.bad_char_pos is None and not complete:
            start = _skip_ws(text, 0)
            if headers == 0 and text[start] not in "{[":
                return refuse(NOT_JSON, f"not JSON (starts with {raw.data.lstrip()[:16]!r})")
            where, msg = _first_error(scan)
            if headers == 0 and "traceEvents" in text[:4096]:
                return refuse(DEVICE_TRACE, "this is a device (Kineto) trace, not a host trace, and it is not valid "
                                            f"JSON ({msg} at {_line_col(text, where)})")
            boundary = where - where % WRITE_BLOCK
            if boundary and where - boundary < 512:
                return refuse(TWO_WRITERS, f"invalid JSON at byte {where}, {where - boundary} bytes after byte "
                                           f"{boundary} (a multiple of {WRITE_BLOCK}, where buffered writes start): two "
                                           "processes wrote this file at the same time, each over the other's text "
                                           "(every rank needs its own path, host.<rank>.json); not repairable: trace "
                                           "again")
            return refuse(INVALID_JSON, f"invalid JSON at {_line_col(text, where)} (byte {where}): {msg}")
        if headers == 0 and scan.bad_char_pos is not None and text[_skip_ws(text, 0)] not in "{[":
            return refuse(NOT_JSON, f"not JSON (starts with {raw.data.lstrip()[:16]!r})")
        return refuse(TWO_WRITERS, f"{mixed}; no complete document can be isolated safely: "
                                   "trace again with one output file per process")

    # Clean text: one or more documents back to back, the last maybe cut short.
    if len(complete) >= 2 or (complete and truncated):
        writes = len(complete) + len(truncated)
        times = "twice" if writes == 2 else f"{writes} times"
        problem = f"{writes} JSON objects concatenated"
        if truncated:
            problem += ", the last one truncated"
        others = [doc for doc in complete if not doc.is_host]
        if not others:
            problem += f" (ExecutionTraceObserver wrote {times})"
        elif any("traceEvents" in doc.fields for doc in others):
            problem += " (a Kineto device trace among them: the device trace was written to the host trace's path)"
        else:
            problem += f" ({len(others)} of them not a host trace: another program wrote to this path too)"
        if not hosts:
            last = complete[-1]
            kind, why = _schema_problem(last.fields, last.nodes_is_list) or (NOT_HOST_TRACE, "not a host trace")
            return refuse(kind, f"{problem}; none is a host trace: {why}")
        keep = hosts[-1]
        pids = sorted({d.pid for d in hosts if d.pid is not None}, key=str)
        if len(pids) > 1:  # other ranks or runs writing one path: the last one need not be this file's trace
            return refuse(TWO_WRITERS, f"{len(hosts)} host traces of {len(pids)} processes concatenated (pids "
                                       f"{', '.join(map(str, pids))}): cannot tell which is this file's trace; "
                                       "trace again with one output file per process (host.<rank>.json)")
        which = "the last complete one" if keep is complete[-1] else f"complete object {complete.index(keep) + 1}, the last host trace"
        return _plan_for(path, keep, problem, CONCATENATED, f"kept {which} ({{nodes}} nodes)", min_nodes)
    if truncated:
        return _plan_truncated(path, scan, truncated[0], raw, min_nodes)
    # One complete document that orjson refused (NaN/Infinity, integers over 64 bits) or that has duplicates.
    doc = complete[0]
    trailing = f" followed by {scan.trailing_nuls} NUL bytes" if scan.trailing_nuls else ""
    if trailing:
        return _plan_for(path, doc, f"complete document{trailing} (the file was padded after writing)", PADDED,
                         "dropped the padding ({nodes} nodes)", min_nodes)
    return _plan_for(path, doc, None, VALID, None, min_nodes)


def _first_error(scan: _Scan) -> tuple:
    """(position, message) of the first syntax error, for a text that holds no complete document."""
    for doc in scan.docs:
        if doc.error is not None:
            return doc.error.pos, doc.error.msg
    start = _skip_ws(scan.text, 0)
    try:
        _DECODER.raw_decode(scan.text[:scan.end], start)
    except json.JSONDecodeError as exc:
        return exc.pos, exc.msg
    except RecursionError:
        return start, "nesting too deep"
    return scan.garbage[0][0] if scan.garbage else start, "unexpected text"


def _damage_evidence(scan: _Scan, headers: int, pids: list) -> str:
    parts = []
    if scan.bad_char_pos is not None:
        char = scan.text[scan.bad_char_pos]
        name = "NUL bytes" if char == "\x00" else ("bytes that are not UTF-8" if "\udc80" <= char <= "\udcff"
                                                   else f"control character {ord(char):#04x}")
        parts.append(f"{name} at byte {scan.bad_char_pos}")
    if headers > 1:
        pid_text = f", pids {', '.join(map(str, pids))}" if len(pids) > 1 else ""
        parts.append(f"{headers} ExecutionTraceObserver headers{pid_text}")
    broken = [doc for doc in scan.docs if doc.broken]
    if broken:
        parts.append(f"invalid JSON at byte {broken[0].error.pos}")
    elif scan.garbage and scan.bad_char_pos is None:
        parts.append(f"stray text at byte {scan.garbage[0][0]}")
    return "; ".join(parts) or "mixed text"


def _plan_for(path: Path, doc: _Doc, problem: Optional[str], kind: str, action: Optional[str], min_nodes: int) -> _Analysis:
    """Check the document to keep (schema, ids) and describe the repair."""
    shape = _schema_problem(doc.fields, doc.nodes_is_list)
    if shape:
        prefix = f"{problem}; the document to keep is not usable: " if problem else ""
        return _Analysis(Diagnosis(path, shape[0], prefix + shape[1], schema=_schema_of(doc.fields)))
    bad = _bad_id_problem(doc.node_ids)
    if bad:
        return _Analysis(Diagnosis(path, NOT_HOST_TRACE, bad, schema=doc.fields["schema"]))
    if not doc.has_operator:  # keeping it would "repair" the trace into one that holds no data
        prefix = f"{problem}; the document to keep " if problem else ""
        return _Analysis(Diagnosis(path, NO_OPERATORS, prefix + NO_OPERATORS_PROBLEM.format(nodes=len(doc.node_ids)),
                                   schema=doc.fields["schema"], nodes=len(doc.node_ids)))
    dups = _duplicate_indices(doc.node_ids)
    nodes = len(doc.node_ids) - len(dups)
    if dups:
        dup_text = _dup_problem(doc.node_ids, dups)
        problem = f"{problem}; {dup_text}" if problem else dup_text
        action = f"{action}; kept the first node of each id" if action else "kept the first node of each id"
        if kind == VALID:
            kind = DUPLICATE_IDS
    if problem is None:
        return _Analysis(Diagnosis(path, VALID, schema=doc.fields["schema"], nodes=nodes))
    diagnosis = Diagnosis(path, kind, problem, repairable=True, schema=doc.fields["schema"], nodes=nodes,
                          action=action.replace("{nodes}", str(nodes)))
    return _Analysis(diagnosis, plan=_Plan(doc, frozenset(dups)))


def _plan_truncated(path: Path, scan: _Scan, doc: _Doc, raw: _Raw, min_nodes: int) -> _Analysis:
    text = scan.text
    cut = doc.error.pos
    where = "the gzip stream and the JSON end" if raw.gzip_truncated else "the JSON ends"
    if doc.nodes_open is None:
        if "traceEvents" in doc.fields or "traceEvents" in text[doc.start:doc.start + 4096]:
            return _Analysis(Diagnosis(path, DEVICE_TRACE, "this is a device (Kineto) trace, not a host trace, and it is truncated"))
        return _Analysis(Diagnosis(path, TRUNCATED, f"truncated inside the header ({where} at byte {cut}); nothing to recover",
                                   schema=_schema_of(doc.fields)))
    if "schema" not in doc.fields:
        return _Analysis(Diagnosis(path, TRUNCATED, "truncated, and the header before the node list has no 'schema': "
                                                    "not a host trace this tool can recover"))
    shape = _schema_problem(doc.fields, True)
    if shape:
        return _Analysis(Diagnosis(path, shape[0], shape[1], schema=_schema_of(doc.fields)))
    bad = _bad_id_problem(doc.node_ids)
    if bad:
        return _Analysis(Diagnosis(path, NOT_HOST_TRACE, bad, schema=doc.fields["schema"]))
    in_nodes = doc.nodes_close is None
    dups = _duplicate_indices(doc.node_ids)
    kept = len(doc.node_ids) - len(dups)
    last_end = (doc.node_spans[-1][1] if doc.node_spans else doc.nodes_open) if in_nodes else None
    partial_node = in_nodes and bool(text[last_end:scan.end].strip(" \t\r\n,"))
    if partial_node:
        problem = f"truncated JSON: {where} inside node {len(doc.node_ids) + 1} at byte {cut}"
    elif in_nodes:  # cut between two nodes: none is cut, the node list is not closed
        problem = f"truncated JSON: {where} after node {len(doc.node_ids)}, inside the node list, at byte {cut}"
    else:
        problem = f"truncated JSON: {where} after the node list at byte {cut}"
    if scan.trailing_nuls:
        problem += f", followed by {scan.trailing_nuls} NUL bytes (the file was never completely written)"
    if kept < min_nodes:
        return _Analysis(Diagnosis(path, TRUNCATED, f"{problem}; only {_plural(kept, 'complete node')} left "
                                                    f"(fewer than {min_nodes}): too little to recover",
                                   schema=doc.fields["schema"], nodes=kept))
    kept_ids = set(doc.node_ids)
    lost_parents = {parent for parent in doc.node_parents if isinstance(parent, int) and parent not in kept_ids}
    orphans = sum(1 for parent in doc.node_parents if parent in lost_parents)
    if in_nodes:
        dropped_bytes = scan.end - last_end
        cut_note = f"dropped 1 partial node ({dropped_bytes} bytes)" if partial_node else "no node was cut"
        action = f"closed the node list after {_plural(kept, 'complete node')}; {cut_note}"
    else:
        dropped_bytes = scan.end - doc.last_member_end
        action = f"kept all {kept} nodes; dropped the cut-off end of the document ({dropped_bytes} bytes)"
    if lost_parents:
        action += (f"; {_plural(len(lost_parents), 'enclosing operator')} of {_plural(orphans, 'kept node')} "
                   "had not been written yet")
    if "finish_ts" not in doc.fields:
        action += "; finish_ts unknown, set to start_ts"
    if dups:
        problem += f"; {_dup_problem(doc.node_ids, dups)}"
        action += "; kept the first node of each id"
    marker = {"tool": "fix_host_traces.py", "truncated": True, "kept_nodes": kept, "dropped_bytes": dropped_bytes,
              "lost_parent_ids": len(lost_parents), "finish_ts_unknown": "finish_ts" not in doc.fields}
    diagnosis = Diagnosis(path, TRUNCATED, problem, repairable=True, schema=doc.fields["schema"], nodes=kept, action=action)
    return _Analysis(diagnosis, plan=_Plan(doc, frozenset(dups), close_truncated=True, marker=marker,
                                           partial_node=partial_node))


# ----------------------------------------------------------------------------------------------------------
# Public API


def diagnose_host_trace(path, *, keep_document: bool = False, min_nodes: int = DEFAULT_MIN_NODES) -> Diagnosis:
    """Check a host trace before linking. A valid file is parsed once with orjson (and returned as
    `.document` when keep_document is set); only a file that fails to parse is walked by the scanning decoder."""
    return _analyse(Path(path), min_nodes=min_nodes, keep_document=keep_document).diagnosis


def _render(text: str, plan: _Plan) -> str:
    doc = plan.doc
    if not plan.drop and not plan.close_truncated:
        return text[doc.start:doc.end] + "\n"
    parts = []
    if doc.nodes_open is not None and (plan.drop or doc.nodes_close is None):
        kept = [text[a:b] for index, (a, b) in enumerate(doc.node_spans) if index not in plan.drop]
        parts.append(text[doc.start:doc.nodes_open])
        parts.append("\n    " + ",\n    ".join(kept) + "\n  " if kept else "")
        if doc.nodes_close is not None:
            tail_end = doc.end if doc.complete else doc.last_member_end
            parts.append(text[doc.nodes_close:tail_end])
        else:
            parts.append("]")
    else:
        parts.append(text[doc.start:doc.end if doc.complete else doc.last_member_end])
    if plan.close_truncated:
        if "finish_ts" not in doc.fields:
            start_ts = doc.fields.get("start_ts", 0)
            parts.append(',\n  "finish_ts": ' + json.dumps(start_ts if isinstance(start_ts, int) else 0))
        parts.append(',\n  "repair": ' + json.dumps(plan.marker) + "\n}")
        return "".join(parts) + "\n"
    out = "".join(parts)
    if plan.marker:  # nodes dropped from a complete document: the trace says so (and so does the .et made of it)
        out = out[:-1].rstrip() + ',\n  "repair": ' + json.dumps(plan.marker) + "\n}"
    return out + "\n"


def _check_rendered(out: str, plan: _Plan) -> Optional[str]:
    """Walk what is about to be written (strict JSON, ids only, little memory): it must be exactly one complete
    host document holding exactly the nodes the plan keeps."""
    with gc_paused():
        scan = _scan(out)
    if len(scan.docs) != 1 or not scan.docs[0].complete or scan.garbage or scan.bad_char_pos is not None:
        return "the repaired text is not one valid JSON document"
    expected = [node_id for index, node_id in enumerate(plan.doc.node_ids) if index not in plan.drop]
    if scan.docs[0].node_ids != expected:
        return "the repaired text does not hold the expected nodes"
    return None


def read_only_reason(path: Path) -> Optional[str]:
    """Why path cannot be replaced in place, or None. Mode bits count even for root (os.access says yes to root):
    a user's chmod a-w, or a shared read-only copy of traces, means 'do not write here'."""
    path = Path(path)
    targets = [(path, "the folder")] if path.is_dir() else [(path, "the file"), (path.parent, "its folder")]
    for target, what in targets:
        mode = target.stat().st_mode
        if not os.access(target, os.W_OK) or not stat.S_IMODE(mode) & 0o222:
            return f"{what} is read-only"
    return None


def _backup_path(path: Path) -> Path:
    candidate = path.with_name(path.name + ".orig")
    number = 1
    while candidate.exists():
        candidate = path.with_name(f"{path.name}.orig.{number}")
        number += 1
    return candidate


def _remove_dead_writers_temp_files(path: Path) -> None:
    """Remove the temp files (a repaired copy, or a copy of the original) that a killed repair of `path` left."""
    pattern = re.compile(rf"^\.{re.escape(path.name)}(\.orig(\.\d+)?)?\.(?P<pid>\d+)\.\w+\.tmp$")
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return
    for entry in entries:
        match = pattern.match(entry.name)
        if match and not process_is_alive(int(match["pid"])):
            with contextlib.suppress(OSError):
                entry.unlink()



def _write_replacement(path: Path, payload: bytes, gzipped: bool) -> Path:
    """Write the repaired trace beside the original, keep the original as <file>.orig, then rename into place."""
    backup = None
    try:
        with atomic_output(path, mode=stat.S_IMODE(path.stat().st_mode), stage=str(os.getpid())) as out:
            if gzipped:
                with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=6, mtime=0) as zipped:
                    zipped.write(payload)
            else:
                out.write(payload)
            backup = _backup_path(path)
            try:
                os.link(path, backup)  # the original bytes, instantly, and nothing is lost if the rename fails
            except OSError:
                with atomic_output(backup, stage=str(os.getpid())) as copy, open(path, "rb") as source:
                    shutil.copyfileobj(source, copy, 1 << 20)
    except BaseException:  # the original is still in place (Ctrl-C, a full disk): no second copy of it beside it
        if backup is not None and _same_file(backup, path):
            backup.unlink()
        raise
    return backup


def _same_file(a: Path, b: Path) -> bool:
    """Whether a holds b's bytes (a hard link to it, or a whole copy), compared without reading them whole."""
    try:
        return os.path.samefile(a, b) or filecmp.cmp(a, b, shallow=False)
    except OSError:
        return False


def repair_host_trace(path, *, keep_original: bool = True, check_only: bool = False,
                      min_nodes: int = DEFAULT_MIN_NODES) -> RepairResult:
    """Repair a host trace in place where that is safe (see the module's kinds); idempotent.

    Args:
        path: host trace, plain or gzipped (gzipped stays gzipped).
        keep_original: keep the original bytes as <file>.orig (or .orig.N when that exists).
        check_only: only diagnose: status "needs_repair" or "failed" when the file is not valid.
        min_nodes: a truncated trace keeping fewer complete nodes is refused.
    """
    path = Path(path)
    if not check_only:
        _remove_dead_writers_temp_files(path)
    analysis = _analyse(path, min_nodes=min_nodes, need_plan=not check_only)
    diagnosis = analysis.diagnosis
    if diagnosis.ok:
        return RepairResult(path, "unchanged", diagnosis,
                            f"already valid, nothing to do ({diagnosis.nodes} nodes){diagnosis.note}",
                            nodes_kept=diagnosis.nodes)
    if not diagnosis.repairable:
        return RepairResult(path, "failed", diagnosis, diagnosis.problem)
    read_only = read_only_reason(path)
    if check_only:  # what the repair would do: a read-only trace it would refuse
        advice = (f"repairable, but not in place: {read_only} ({READ_ONLY_HINT}, then run fix_host_traces.py)"
                  if read_only else "repairable: run fix_host_traces.py")
        return RepairResult(path, "needs_repair", diagnosis, f"{diagnosis.problem}; {advice}")
    if read_only:
        return RepairResult(path, "failed", diagnosis, f"{diagnosis.problem}; cannot repair: {read_only} "
                                                       f"({READ_ONLY_HINT})")
    plan = analysis.plan
    if plan.marker is not None or plan.drop:  # a repair that loses data marks the trace (the .et says so too)
        plan.marker = dict(plan.marker or {"tool": "fix_host_traces.py", "dropped_nodes": len(plan.drop)},
                           problem=diagnosis.problem, action=diagnosis.action)
    out = _render(analysis.text, plan)
    bad = _BAD_CHARS_RE.search(out)
    if bad:
        return RepairResult(path, "failed", diagnosis, f"{diagnosis.problem}; the document to keep holds bytes that are not "
                                                       f"UTF-8 text (byte {bad.start()}): not repairable")
    check = _check_rendered(out, plan)
    if check:
        return RepairResult(path, "failed", diagnosis, f"{diagnosis.problem}; not repaired: {check}")
    try:
        backup = _write_replacement(path, out.encode("utf-8"), analysis.raw.gzipped)
    except OSError as exc:
        return RepairResult(path, "failed", diagnosis, f"{diagnosis.problem}; cannot write the repair: {exc.strerror or exc}")
    if not keep_original:
        backup.unlink()
        backup = None
    dropped = len(plan.drop) + (1 if plan.partial_node else 0)
    kept_note = f"; original kept as {backup.name}" if backup else ""
    return RepairResult(path, "repaired", diagnosis, f"{diagnosis.problem}; {diagnosis.action}{kept_note}",
                        backup=backup, nodes_kept=diagnosis.nodes, nodes_dropped=dropped)


def find_host_traces(paths: Iterable) -> tuple:
    """Host trace files under the given files and folders: (files, problems) where problems are one-line errors
    for paths that do not exist, folders holding no host trace, and folders where a run's host trace belongs. A file
    named explicitly is taken whatever its name."""
    files: list = []
    problems: list = []
    for raw_path in paths:
        path = Path(raw_path)
        if path.is_file():
            files.append(path)
            continue
        if not path.is_dir():
            problems.append(f"error: {path}: no such file or folder")
            continue
        found = []
        for root, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
            found.extend(Path(root) / name for name in sorted(names) if HOST_NAME_RE.search(name))
        # A folder where a run's host trace belongs (a copy gone wrong) is named, as convert_to_et.py names it
        in_place = [problem for run in find_runs([path]) for rank in run.ranks
                    if (problem := run.folder_in_place(rank, "host"))]
        problems.extend(f"error: {problem}" for problem in in_place)
        if not found and not in_place:
            problems.append(f"error: {path}: no host traces found (host.<rank>.json[.gz] or <name>_host.json[.gz])")
        files.extend(found)
    unique = list(dict.fromkeys(files))
    return unique, problems
