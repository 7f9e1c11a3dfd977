"""Helpers for the conversion tests: fixture paths and traces scaled up from a real one."""
from __future__ import annotations

import gzip
from pathlib import Path

import orjson
from chakra.schema.protobuf.et_def_pb2 import GlobalMetadata, Node
from chakra.src.third_party.utils.protolib import decodeMessage, openFileRd

DATA = Path(__file__).resolve().parent / "data"
CPU_FIXTURES = DATA / "cpu"


def read_json(path: Path):
    raw = path.read_bytes()
    return orjson.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)


def write_json(path: Path, document, compress: bool = False) -> Path:
    data = orjson.dumps(document)
    path.write_bytes(gzip.compress(data, compresslevel=1) if compress else data)
    return path


def scaled_trace(host_doc: dict, device_doc: dict, copies: int, host_copies: list[int] | None = None) -> tuple[dict, dict]:
    """A host + device pair of `copies` consecutive traced steps made by repeating one real step: node ids,
    rf_ids, External ids and timestamps shifted per copy, the observer's process/thread nodes kept once.
    `host_copies` keeps only those steps in the host trace (a device trace covering more steps than the host)."""
    nodes = host_doc["nodes"]
    structural = {n["id"] for n in nodes if n["name"].startswith("[pytorch|profiler|") or "process_group" in n["name"]}
    id_span = max(n["id"] for n in nodes) + 1
    attrs_rf = [next((a["value"] for a in n["attrs"] if a["name"] == "rf_id"), 0) for n in nodes]
    rf_span = max(attrs_rf) + 1
    events = device_doc["traceEvents"]
    timed = [e for e in events if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float))
             and e.get("cat") in ("cpu_op", "user_annotation")]
    t_span = max(e["ts"] + e.get("dur", 0) for e in timed) - min(e["ts"] for e in timed) + 100.0
    ext_span = max(e.get("args", {}).get("External id", 0) for e in timed) + 1
    keep = set(range(copies) if host_copies is None else host_copies)
    out_nodes = [n for n in nodes if n["id"] in structural or 0 in keep]
    out_events = list(events)
    for c in range(1, copies):
        for n in nodes:
            if n["id"] in structural or c not in keep:
                continue
            m = dict(n)
            m["id"] = n["id"] + c * id_span
            parent = n["ctrl_deps"]
            m["ctrl_deps"] = parent if parent in structural else parent + c * id_span
            m["attrs"] = [dict(a, value=a["value"] + c * rf_span) if a["name"] == "rf_id" else a for a in n["attrs"]]
            if m["name"].startswith("ProfilerStep#"):
                m["name"] = f"ProfilerStep#{int(m['name'].split('#')[1]) + c}"
            out_nodes.append(m)
        for e in events:
            if e.get("ph") != "X" or e.get("cat") not in ("cpu_op", "user_annotation"):
                continue
            f = dict(e)
            f["ts"] = e["ts"] + c * t_span
            args = dict(e.get("args", {}))
            if "Record function id" in args:
                args["Record function id"] += c * rf_span
            if "External id" in args:
                args["External id"] += c * ext_span
            f["args"] = args
            if f["name"].startswith("ProfilerStep#"):
                f["name"] = f"ProfilerStep#{int(f['name'].split('#')[1]) + c}"
            out_events.append(f)
    host = dict(host_doc, nodes=out_nodes)
    device = dict(device_doc, traceEvents=out_events)
    close_window(device)
    return host, device


def close_window(device_doc: dict) -> None:
    """Move the device trace's "Record Window End" to the end of its last event, as Kineto writes it: a trace made
    or stretched here ends later than the one it came from, and the loader leaves out events past that mark."""
    ends = [e["ts"] + e.get("dur", 0) for e in device_doc["traceEvents"]
            if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float))]
    for i, event in enumerate(device_doc["traceEvents"]):
        if event.get("ph") == "i" and event.get("name") == "Record Window End":
            device_doc["traceEvents"][i] = dict(event, ts=max(ends))


def write_scaled_run(folder: Path, source: Path, ranks: list[int], copies: int, compress: bool = False) -> Path:
    """Write host.<rank>.json / device.<rank>.json made of `copies` steps of the traces in `source`."""
    folder.mkdir(parents=True, exist_ok=True)
    suffix = ".json.gz" if compress else ".json"
    for rank in ranks:
        host, device = scaled_trace(read_json(source / f"host.{rank}.json.gz"),
                                    read_json(source / f"device.{rank}.json.gz"), copies)
        write_json(folder / f"host.{rank}{suffix}", host, compress)
        write_json(folder / f"device.{rank}{suffix}", device, compress)
    return folder


def read_et_with_protolib(path: Path) -> tuple[GlobalMetadata, list[Node]]:
    """Read a .et the way chakra's own tools do (protolib.decodeMessage), independent of trace_tools."""
    f = openFileRd(str(path))
    metadata = GlobalMetadata()
    assert decodeMessage(f, metadata)
    nodes = []
    while True:
        node = Node()
        if not decodeMessage(f, node):
            break
        nodes.append(node)
    f.close()
    return metadata, nodes
