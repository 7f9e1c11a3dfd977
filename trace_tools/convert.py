"""Write a linked trace as a Chakra .et (protobuf, length-delimited) and, optionally, as chakra_trace_link's JSON."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from chakra.schema.protobuf.et_def_pb2 import AttributeProto, GlobalMetadata, Node
from chakra.src.third_party.utils.protolib import encodeMessage

from .link import (COMM_COLL_NODE, COMM_RECV_NODE, COMM_SEND_NODE, COMMUNICATION_CPU_ATTR, COMMUNICATION_CPU_OP,
                   COMMUNICATION_WAIT_ATTR, COMMUNICATION_WAIT_OP, GPU_OP, HOST_OP, KINETO_OP, LinkedTrace)
from .atomic import atomic_output
from .graph import topological_order
from .load import CHUNK_BYTES, iter_document, read_trace_bytes
from .validate import SerializedMessage
from .wake_cost import WAKE_COST_ATTR

ET_VERSION = "0.0.4"
CONVERTER = "mosim-llms trace_tools"
# Host schemas chakra_converter parses; older ones are rewritten into this layout for the merged JSON.
CHAKRA_CONVERTER_SCHEMAS = ("1.0.2-chakra.0.0.4", "1.0.3-chakra.0.0.4", "1.1.0-chakra.0.0.4", "1.1.1-chakra.0.0.4")
MERGED_SCHEMA_FOR_LEGACY = "1.0.3-chakra.0.0.4"


def _attr_int(name: str, value: int) -> AttributeProto:
    return AttributeProto(name=name, int64_val=value)


def _as_int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def global_metadata(linked: LinkedTrace) -> GlobalMetadata:
    """What chakra's converter writes (schema, pid, time, start_ts, finish_ts) plus rank, step and process groups."""
    host, dev = linked.host, linked.device
    attrs = [
        AttributeProto(name="schema", string_val=host.schema),
        AttributeProto(name="pid", uint64_val=max(0, _as_int(host.pid))),
        AttributeProto(name="time", string_val=host.time),
        AttributeProto(name="start_ts", uint64_val=max(0, host.start_ts)),
        AttributeProto(name="finish_ts", uint64_val=max(0, host.finish_ts)),
        AttributeProto(name="rank", int64_val=linked.rank),
        AttributeProto(name="converter", string_val=CONVERTER),
        AttributeProto(name="traced_step", string_val=linked.step_name),
        AttributeProto(name="traced_step_start_micros", int64_val=round(linked.step_start)),
        AttributeProto(name="traced_step_micros", int64_val=round(linked.step_dur)),
    ]
    if linked.stats.get("step_durations_us"):
        attrs.append(AttributeProto(name="traced_steps_micros",
                                    string_val=orjson.dumps(linked.stats["step_durations_us"]).decode()))
    if linked.untraced_step_us:
        # Durations estimate the run without the profiler: its measured cost was taken out of every CPU op.
        attrs.append(AttributeProto(name="untraced_step_micros", int64_val=round(linked.untraced_step_us)))
        attrs.append(AttributeProto(name="recording_overhead_micros",
                                    int64_val=round(linked.stats.get("recording_overhead_us", 0))))
    distributed = dev.distributed if isinstance(dev.distributed, dict) else {}
    if isinstance(distributed.get("world_size"), int):
        attrs.append(AttributeProto(name="world_size", int64_val=distributed["world_size"]))
    if isinstance(distributed.get("backend"), str):
        attrs.append(AttributeProto(name="backend", string_val=distributed["backend"]))
    groups = host.process_groups or distributed.get("pg_config") or []
    if groups:
        # The observer's `## process_group:init ##` node as metadata: ASTRA-sim rejects METADATA_NODE nodes.
        attrs.append(AttributeProto(name="process_groups", string_val=orjson.dumps(groups).decode()))
    if dev.base_time_ns is not None:
        attrs.append(AttributeProto(name="kineto_base_time_ns", int64_val=dev.base_time_ns))
    if linked.stats.get("wake_cost_json"):  # the machine's cost of compute after a pause (trace_tools.wake_cost)
        attrs.append(AttributeProto(name=WAKE_COST_ATTR, string_val=linked.stats["wake_cost_json"]))
    if linked.stats.get("host_repair"):  # fix_host_traces.py changed the host trace (nodes dropped, inputs lost)
        attrs.append(AttributeProto(name="host_trace_repaired", string_val=linked.stats["host_repair"]))
    return GlobalMetadata(version=ET_VERSION, attr=attrs)


def build_node(linked: LinkedTrace, i: int) -> bytes:
    """The serialized protobuf Node of linked node i: the linked fields, then the host node's tensors and
    attributes (serialized once when the host trace was read; concatenated protobuf messages merge)."""
    host, dev = linked.host, linked.device
    ids = linked.node_id
    kind = linked.kind[i]
    node = Node(id=ids[i], name=linked.name(i), type=linked.node_type[i],
                start_time_micros=max(0, round(linked.ts[i])), duration_micros=max(0, round(linked.work(i))))
    parent = linked.parent[i]
    if parent >= 0:
        node.ctrl_deps.append(ids[parent])
    if linked.deps[i]:
        node.data_deps.extend([ids[d] for d in linked.deps[i]])
    node_type = linked.node_type[i]
    # A wait for a core holds none: ASTRA-sim runs it beside the rank's CPU ops (its slot for non-CPU compute, which
    # a CPU run does not otherwise use)
    on_cpu = kind not in (GPU_OP, COMMUNICATION_WAIT_OP) and node_type not in (COMM_COLL_NODE, COMM_SEND_NODE,
                                                                                COMM_RECV_NODE)
    attrs = node.attr
    h = linked.host_index[i]
    if kind == COMMUNICATION_CPU_OP:
        # Not a traced op: the CPU time gloo's threads spent on this collective (trace_tools.core_sharing)
        attrs.append(_attr_int(COMMUNICATION_CPU_ATTR, ids[linked.src[i]]))
    elif kind == COMMUNICATION_WAIT_OP:
        attrs.append(_attr_int(COMMUNICATION_WAIT_ATTR, ids[linked.src[i]]))
    elif kind != GPU_OP:
        # The thread the op really ran on (a gloo collective: the backend's worker thread) in Kineto's numbering;
        # `tid` keeps the host trace's own numbering, as chakra writes it.
        tid = dev.cpu_tid[linked.src[i]]
        if h < 0:
            attrs.append(_attr_int("tid", tid if isinstance(tid, int) else 0))
        if isinstance(tid, int):
            attrs.append(_attr_int("kineto_tid", tid))
        attrs.append(_attr_int("inclusive_micros", max(0, round(linked.dur[i]))))
    attrs.append(AttributeProto(name="is_cpu_op", bool_val=on_cpu))
    if kind == GPU_OP:
        g = linked.src[i]
        attrs.append(_attr_int("stream", dev.gpu_stream[g]))
        attrs.append(_attr_int("device", dev.gpu_device[g]))
        if dev.gpu_bytes[g]:
            attrs.append(_attr_int("bytes", dev.gpu_bytes[g]))
    else:
        attrs.append(_attr_int("stream", 0))
        if kind == KINETO_OP:
            attrs.append(AttributeProto(name="kineto_only", bool_val=True))
    comm = linked.comm.get(i)
    if comm is not None:
        if node_type == COMM_COLL_NODE:
            attrs.append(_attr_int("comm_type", comm["comm_type"]))
        attrs.append(_attr_int("comm_size", comm["comm_size"]))
        if comm.get("pg_name"):
            attrs.append(AttributeProto(name="pg_name", string_val=str(comm["pg_name"])))
        for key in ("comm_src", "comm_dst", "comm_tag"):
            if key in comm:  # ASTRA-sim's feeder reads these as int32
                attrs.append(AttributeProto(name=key, int32_val=comm[key]))
    if linked.wait[i] >= 0.5:
        attrs.append(_attr_int("wait_micros", round(linked.wait[i])))
    traced = round(linked.traced_work(i))
    if traced != node.duration_micros:  # median over the steps and/or the profiler's cost taken out
        attrs.append(_attr_int("traced_micros", traced))
    blob = node.SerializeToString()
    if h >= 0:  # the host op's attributes (rf_id ... op_schema) first, as chakra writes them, then its tensors
        return host.attr_fragments[h] + blob + host.io_fragments[h]
    if kind == GPU_OP and parent >= 0 and linked.host_index[parent] >= 0:
        return blob + host.io_fragments[linked.host_index[parent]]  # its launcher's tensors, as chakra_trace_link does
    return blob


def write_et(linked: LinkedTrace, out_path: str | Path) -> Path:
    """Write the .et atomically (temp file in the same folder, then rename): never a partial .et."""
    out_path = Path(out_path)
    order = file_order(linked)
    with atomic_output(out_path) as f:
        encodeMessage(f, global_metadata(linked))
        for i in order:
            encodeMessage(f, SerializedMessage(build_node(linked, i)))
    return out_path


def file_order(linked: LinkedTrace) -> list[int]:
    """Nodes in a dependency order (each after everything it depends on), by id among the ready ones.

    ASTRA-sim's feeder reads a window of nodes and keeps reading while a node depends on one not read yet; with no
    forward reference it never has to hold more than its window."""
    n, ids = len(linked.kind), linked.node_id
    parents = [[*deps, p] if p >= 0 else deps for deps, p in zip(linked.deps, linked.parent)]
    order = topological_order(parents, priority=ids)
    if len(order) != n:  # a cycle would be a linker bug; the validator names it, the file keeps every node
        placed = set(order)
        order.extend(sorted((i for i in range(n) if i not in placed), key=lambda i: ids[i]))
    return order


# ---------------------------------------------------------------------------------------------------------------
# chakra_trace_link-compatible merged JSON
# ---------------------------------------------------------------------------------------------------------------
def write_merged_json(linked: LinkedTrace, out_path: str | Path, chunk_bytes: int = CHUNK_BYTES) -> Path:
    """Host nodes (renumbered like chakra_trace_link) with ts/inclusive_dur/exclusive_dur, followed in id order by
    the GPU ops they launched; legacy (1.0.1) nodes are rewritten into the layout chakra_converter parses.

    The host file is read a second time, slice by slice, so the merged output never holds every node in memory.
    """
    out_path = Path(out_path)
    host = linked.host
    legacy = host.layout == "legacy"
    schema = host.schema if host.schema in CHAKRA_CONVERTER_SCHEMAS else MERGED_SCHEMA_FOR_LEGACY
    ids = linked.node_id
    node_of_host = {h: i for i, h in enumerate(linked.host_index) if h >= 0}
    host_index_of_id = {nid: h for h, nid in enumerate(host.ids)}
    new_id = _merged_host_ids(linked)
    gpu_children: dict[int, list[int]] = {}
    for i, kind in enumerate(linked.kind):
        if kind == GPU_OP:
            gpu_children.setdefault(linked.parent[i], []).append(i)
    header = {"schema": schema, "pid": host.pid, "time": host.time, "start_ts": host.start_ts}
    if schema != host.schema:
        header["source_schema"] = host.schema
    data = read_trace_bytes(host.path)
    _, slices = iter_document(Path(host.path), data, "nodes", chunk_bytes)
    pending: dict[int, bytes] = {}  # merged id -> serialized node, written in id order
    next_to_write = 0
    with atomic_output(out_path) as f:
        head = orjson.dumps(header)
        f.write(head[:-1] + b', "nodes": [\n')
        first = True

        def emit(blob: bytes) -> None:
            nonlocal first
            f.write(blob if first else b",\n" + blob)
            first = False

        for elements in slices:
            for raw in elements:
                h = host_index_of_id.get(raw.get("id"))
                if h is None:
                    continue
                node = _merged_host_node(raw, legacy, new_id, host_index_of_id, h)
                i = node_of_host.get(h)
                if i is not None:
                    node["inclusive_dur"] = linked.dur[i]
                    node["exclusive_dur"] = linked.excl[i]
                    node["ts"] = linked.ts[i]
                    dep = linked.inter_thread_dep.get(i)
                    node["inter_thread_dep"] = ids[dep] if dep is not None else None
                    if i in linked.sync_deps:
                        node["sync_dep"] = [ids[g] for g in linked.sync_deps[i]]
                pending[node["id"]] = orjson.dumps(node)
                if i is not None:
                    for g in gpu_children.get(i, ()):
                        pending[ids[g]] = orjson.dumps(_merged_gpu_node(linked, g, node))
            while next_to_write in pending:
                emit(pending.pop(next_to_write))
                next_to_write += 1
        for i, kind in enumerate(linked.kind):
            if kind == KINETO_OP:
                node = _merged_kineto_node(linked, i)
                pending[node["id"]] = orjson.dumps(node)
                for g in gpu_children.get(i, ()):
                    pending[ids[g]] = orjson.dumps(_merged_gpu_node(linked, g, node))
        for key in sorted(pending):
            emit(pending[key])
        f.write(b'\n], "finish_ts": ' + orjson.dumps(host.finish_ts) + b"}\n")
    del data
    return out_path


def _merged_host_ids(linked: LinkedTrace) -> dict[int, int]:
    """Original host id -> merged id (the .et ids of emitted nodes; the same numbering for the others)."""
    host = linked.host
    emitted = {linked.host_index[i]: linked.node_id[i] for i in range(len(linked.kind)) if linked.kind[i] == HOST_OP}
    gpu_count: dict[int, int] = {}
    for i, kind in enumerate(linked.kind):
        if kind == GPU_OP and linked.kind[linked.parent[i]] == HOST_OP:
            h = linked.host_index[linked.parent[i]]
            gpu_count[h] = gpu_count.get(h, 0) + 1
    result: dict[int, int] = {}
    next_id = 0
    for h in sorted(range(len(host)), key=lambda x: host.ids[x]):
        result[host.ids[h]] = emitted.get(h, next_id)
        next_id += 1 + gpu_count.get(h, 0)
    return result


def _merged_host_node(raw: dict, legacy: bool, new_id: dict[int, int], host_index_of_id: dict, h: int) -> dict:
    if not legacy:
        node = dict(raw)
        node["id"] = new_id[raw["id"]]
        parent = raw.get("ctrl_deps")
        if isinstance(parent, int):
            node["ctrl_deps"] = new_id.get(parent, parent)
        return node
    attrs = _legacy_attrs(raw)
    parent = raw.get("parent")
    return {
        "id": new_id[raw["id"]],
        "name": raw.get("name", ""),
        "ctrl_deps": new_id.get(parent, parent) if isinstance(parent, int) else parent,
        "inputs": {"values": raw.get("inputs", []), "shapes": raw.get("input_shapes", []),
                   "types": raw.get("input_types", []), "strides": []},
        "outputs": {"values": raw.get("outputs", []), "shapes": raw.get("output_shapes", []),
                    "types": raw.get("output_types", []), "strides": []},
        "attrs": attrs,
    }


_CHAKRA_ATTRS = (("rf_id", "uint64", 0), ("fw_parent", "uint64", 0), ("seq_id", "int64", -1), ("scope", "uint64", 0),
                 ("tid", "uint64", 0), ("fw_tid", "uint64", 0), ("op_schema", "string", ""))


def _legacy_attrs(fields: dict) -> list[dict]:
    """The attrs list of the 1.0.2+/1.1.x layout from top-level fields (1.0.1) or defaults."""
    return [{"name": key, "type": type_, "value": fields.get(key, default)} for key, type_, default in _CHAKRA_ATTRS]


def _merged_gpu_node(linked: LinkedTrace, g: int, launcher_node: dict) -> dict:
    dev = linked.device
    src = linked.src[g]
    node = dict(launcher_node)
    for key in ("inter_thread_dep", "sync_dep"):
        node.pop(key, None)
    node.update({
        "id": linked.node_id[g],
        "ctrl_deps": launcher_node["id"],
        "cat": dev.gpu_cat[src],
        "name": _chakra_kernel_name(dev.gpu_names[src]),
        "ph": "X",
        "inclusive_dur": linked.dur[g],
        "exclusive_dur": linked.excl[g],
        "ts": linked.ts[g],
        "stream": dev.gpu_stream[src],
    })
    if node["name"] != dev.gpu_names[src]:
        node["kernel_name"] = dev.gpu_names[src]
    comm = linked.comm.get(g)
    if comm and comm.get("pg_name"):
        node["pg_name"] = comm["pg_name"]
    return node


def _chakra_kernel_name(name: str) -> str:
    """NCCL < 2.19 names its kernels ncclKernel_*, later ones ncclDevKernel_*; chakra_converter only recognises a
    SendRecv (all-to-all) kernel under the newer name, so the merged JSON uses it (the .et keeps the traced name)."""
    return "ncclDevKernel_" + name[len("ncclKernel_"):] if name.startswith("ncclKernel_SendRecv") else name


def _merged_kineto_node(linked: LinkedTrace, i: int) -> dict:
    parent = linked.lane_parent[i]
    tid = linked.device.cpu_tid[linked.src[i]]
    return {
        "id": linked.node_id[i],
        "name": linked.name(i),
        "ctrl_deps": linked.node_id[parent] if parent >= 0 else None,
        "inputs": {"values": [], "shapes": [], "types": [], "strides": []},
        "outputs": {"values": [], "shapes": [], "types": [], "strides": []},
        "attrs": _legacy_attrs({"tid": tid if isinstance(tid, int) else 0}),
        "inclusive_dur": linked.dur[i],
        "exclusive_dur": linked.excl[i],
        "ts": linked.ts[i],
        "inter_thread_dep": None,
        "kineto_only": True,
    }
