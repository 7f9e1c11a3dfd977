"""Repair of host traces: real CPU traces broken in each way a tracer breaks them, repaired or refused."""
import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from trace_tools import repair
from trace_tools.repair import diagnose_host_trace, repair_host_trace

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data" / "cpu"
GPT2_HOST = DATA / "gpt2_tiny_1r" / "host.0.json.gz"
GPT2_DEVICE = DATA / "gpt2_tiny_1r" / "device.0.json.gz"
BERT_HOSTS = [DATA / "bert_tiny_2r" / f"host.{rank}.json.gz" for rank in (0, 1)]


def unzip(path: Path) -> bytes:
    return gzip.decompress(path.read_bytes())


@pytest.fixture(scope="module")
def gpt2_text() -> bytes:
    return unzip(GPT2_HOST)


@pytest.fixture(scope="module")
def gpt2(gpt2_text) -> dict:
    return orjson.loads(gpt2_text)


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def load(path: Path) -> dict:
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return json.loads(data)  # the strict standard parser: what we write must be plain valid JSON


def run_cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, str(REPO / "fix_host_traces.py"), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def node_ids(doc: dict) -> list:
    return [node["id"] for node in doc["nodes"]]


def assert_repaired_then_idempotent(path: Path, original: bytes) -> dict:
    """The .orig holds the input byte for byte, the file parses, and a second run leaves it as it is."""
    backup = path.with_name(path.name + ".orig")
    assert backup.read_bytes() == original
    repaired = load(path)
    after = path.read_bytes()
    again = repair_host_trace(path)
    assert again.status == "unchanged"
    assert again.line().endswith(f"already valid, nothing to do ({len(repaired['nodes'])} nodes)")
    assert path.read_bytes() == after
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, backup.name])
    return repaired


def assert_refused_untouched(result, path: Path, original: bytes, *fragments: str):
    assert result.status == "failed"
    line = result.line()
    assert line.startswith(f"error: {path}: ")
    assert "\n" not in line
    for fragment in fragments:
        assert fragment in line
    assert path.read_bytes() == original
    assert not path.with_name(path.name + ".orig").exists()
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".")] == []  # no temporary file left


# --- valid files ------------------------------------------------------------------------------------------


def test_valid_trace_is_left_alone_and_reported_once_as_valid(tmp_path):
    path = write(tmp_path, "host.0.json.gz", GPT2_HOST.read_bytes())
    proc = run_cli(path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"ok: {path}: already valid, nothing to do (2298 nodes)"
    assert path.read_bytes() == GPT2_HOST.read_bytes()
    assert not path.with_name("host.0.json.gz.orig").exists()


def test_valid_trace_is_parsed_once_without_the_scanning_decoder(monkeypatch):
    def no_scan(text):
        raise AssertionError("the scanning decoder ran on a valid file")

    monkeypatch.setattr(repair, "_scan", no_scan)
    diagnosis = diagnose_host_trace(GPT2_HOST, keep_document=True)
    assert diagnosis.ok and diagnosis.nodes == 2298
    assert diagnosis.schema == "1.1.1-chakra.0.0.4"
    assert len(diagnosis.document["nodes"]) == 2298


def test_every_reference_host_trace_is_valid_including_schema_1_0_1(shared_fixtures):
    hosts = sorted(shared_fixtures.glob("*/*/host.*.json.gz"))
    assert len(hosts) >= 22
    for path in hosts:
        diagnosis = diagnose_host_trace(path)
        assert diagnosis.ok, diagnosis.message()
    assert {diagnose_host_trace(p).schema for p in hosts} == {"1.0.1", "1.1.1-chakra.0.0.4"}


def test_json_with_nan_that_orjson_refuses_is_still_valid(tmp_path, gpt2):
    doc = dict(gpt2, nodes=gpt2["nodes"][:20])
    doc["nodes"][3] = dict(doc["nodes"][3], extra=float("nan"))
    path = write(tmp_path, "host.0.json", json.dumps(doc).encode())
    diagnosis = diagnose_host_trace(path, keep_document=True)
    assert diagnosis.ok, diagnosis.message()
    assert node_ids(diagnosis.document) == node_ids(doc)


# --- concatenated documents --------------------------------------------------------------------------------


def test_two_concatenated_documents_keep_the_last_complete_one(tmp_path, gpt2, gpt2_text):
    first = orjson.dumps(dict(gpt2, nodes=gpt2["nodes"][:100]))  # an earlier, shorter write of the same process
    original = first + b"\n" + gpt2_text
    path = write(tmp_path, "host.1.json", original)
    proc = run_cli(path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        f"repaired: {path}: 2 JSON objects concatenated (ExecutionTraceObserver wrote twice); "
        "kept the last complete one (2298 nodes); original kept as host.1.json.orig")
    repaired = assert_repaired_then_idempotent(path, original)
    assert repaired == gpt2


@pytest.mark.parametrize("other, says", [
    ("device", "a Kineto device trace among them: the device trace was written to the host trace's path"),
    ("other", "1 of them not a host trace: another program wrote to this path too"),
])
def test_a_concatenated_document_that_is_no_host_trace_is_not_blamed_on_the_observer(tmp_path, gpt2_text, other, says):
    first = unzip(GPT2_DEVICE) if other == "device" else b'{"format": "something else"}'
    path = write(tmp_path, "host.0.json", first + b"\n" + gpt2_text)
    proc = run_cli(path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (f"repaired: {path}: 2 JSON objects concatenated ({says}); kept the last complete one "
                                   "(2298 nodes); original kept as host.0.json.orig")


def test_concatenated_with_a_truncated_last_write_keeps_the_last_complete_one(tmp_path, gpt2, gpt2_text):
    original = gpt2_text + gpt2_text[: len(gpt2_text) // 3]
    path = write(tmp_path, "host.0.json", original)
    result = repair_host_trace(path)
    assert result.status == "repaired"
    assert "2 JSON objects concatenated, the last one truncated" in result.line()
    assert assert_repaired_then_idempotent(path, original) == gpt2


def test_gzipped_concatenation_is_repaired_and_stays_gzipped(tmp_path, gpt2, gpt2_text):
    original = gzip.compress(gpt2_text + gpt2_text)
    path = write(tmp_path, "host.0.json.gz", original)
    result = repair_host_trace(path)
    assert result.status == "repaired", result.line()
    assert path.read_bytes()[:2] == b"\x1f\x8b"
    assert assert_repaired_then_idempotent(path, original) == gpt2


def test_an_existing_backup_is_never_overwritten(tmp_path, gpt2_text):
    path = write(tmp_path, "host.0.json", gpt2_text + gpt2_text)
    older = write(tmp_path, "host.0.json.orig", b"an older backup")
    result = repair_host_trace(path)
    assert result.status == "repaired"
    assert result.backup.name == "host.0.json.orig.1"
    assert older.read_bytes() == b"an older backup"
    assert result.backup.read_bytes() == gpt2_text + gpt2_text


# --- truncated tail ---------------------------------------------------------------------------------------


def test_truncated_tail_keeps_every_complete_node_and_says_what_was_dropped(tmp_path, gpt2, gpt2_text):
    original = gpt2_text[: len(gpt2_text) * 2 // 3]
    path = write(tmp_path, "host.0.json", original)
    result = repair_host_trace(path)
    assert result.status == "repaired", result.line()
    kept = result.nodes_kept
    assert 1000 < kept < 2298
    assert result.nodes_dropped == 1
    line = result.line()
    assert f"closed the node list after {kept} complete nodes; dropped 1 partial node" in line
    assert "finish_ts unknown, set to start_ts" in line
    repaired = assert_repaired_then_idempotent(path, original)
    assert repaired["nodes"] == gpt2["nodes"][:kept]  # the complete nodes, unchanged
    for key in ("schema", "pid", "time", "start_ts"):
        assert repaired[key] == gpt2[key]
    assert repaired["finish_ts"] == gpt2["start_ts"]
    assert repaired["repair"]["truncated"] is True and repaired["repair"]["kept_nodes"] == kept


@pytest.mark.parametrize("digits", [3, 6])  # cut inside finish_ts's 6 digits; after them, before the closing brace
def test_a_number_cut_at_the_end_of_the_document_is_not_kept(tmp_path, gpt2, gpt2_text, digits):
    """Cut inside the last member's number ("finish_ts": 516 of 516315), the repair had kept the cut number, less
    than start_ts, and said it dropped 0 bytes. A number running to the end of the text is not known whole."""
    member = b'"finish_ts": ' + str(gpt2["finish_ts"]).encode()
    assert len(str(gpt2["finish_ts"])) == 6 and gpt2_text.rstrip().endswith(member + b"\n}")
    original = gpt2_text[:gpt2_text.rindex(member) + len(member) - 6 + digits]
    path = write(tmp_path, "host.0.json", original)
    result = repair_host_trace(path)
    assert result.status == "repaired", result.line()
    line = result.line()
    assert "finish_ts unknown, set to start_ts" in line and "(0 bytes)" not in line
    repaired = assert_repaired_then_idempotent(path, original)
    assert repaired["finish_ts"] == gpt2["start_ts"] and repaired["nodes"] == gpt2["nodes"]


def test_a_cut_between_two_nodes_says_so_and_cuts_no_node(tmp_path, gpt2, gpt2_text):
    """Cut just before a node's opening brace, the message had said the JSON ends inside the next node, and then
    that no node was cut."""
    middle = gpt2_text.index(b'"id":', len(gpt2_text) // 2)
    original = gpt2_text[:gpt2_text.rindex(b"{", 0, middle)]
    path = write(tmp_path, "host.0.json", original)
    kept = len(orjson.loads(gpt2_text[:gpt2_text.rindex(b"}", 0, middle) + 1] + b"]}")["nodes"])
    line = repair_host_trace(path).line()
    assert f"the JSON ends after node {kept}, inside the node list" in line and "inside node" not in line
    assert f"closed the node list after {kept} complete nodes; no node was cut" in line
    assert assert_repaired_then_idempotent(path, original)["nodes"] == gpt2["nodes"][:kept]


def test_truncated_gzip_stream_is_recovered_as_a_truncated_trace(tmp_path, gpt2):
    original = GPT2_HOST.read_bytes()[:40000]  # the copy stopped part way: gzip and JSON both cut
    path = write(tmp_path, "host.0.json.gz", original)
    diagnosis = diagnose_host_trace(path)
    assert diagnosis.kind == repair.TRUNCATED and diagnosis.repairable
    assert "the gzip stream and the JSON end inside node" in diagnosis.problem
    result = repair_host_trace(path)
    assert result.status == "repaired"
    repaired = assert_repaired_then_idempotent(path, original)
    assert repaired["nodes"] == gpt2["nodes"][: result.nodes_kept]


def test_truncation_that_leaves_too_few_nodes_is_refused(tmp_path, gpt2_text):
    original = gpt2_text[:3000]
    path = write(tmp_path, "host.0.json", original)
    proc = run_cli(path)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"error: {path}: truncated JSON: the JSON ends inside node 3 at byte 2995; "
                                   "only 2 complete nodes left (fewer than 10): too little to recover")
    assert path.read_bytes() == original and not path.with_name("host.0.json.orig").exists()


def test_truncation_inside_the_header_is_refused(tmp_path, gpt2_text):
    original = gpt2_text[:60]
    path = write(tmp_path, "host.0.json", original)
    assert_refused_untouched(repair_host_trace(path), path, original, "truncated inside the header")


def assert_every_cut_is_repaired_to_a_prefix_or_refused(tmp_path, text: bytes, cuts: int):
    original = orjson.loads(text)
    outcomes = set()
    for k in range(1, cuts + 1):
        cut = len(text) * k // (cuts + 1)
        path = write(tmp_path, f"host.{k}.json", text[:cut])
        result = repair_host_trace(path)
        if result.status == "repaired":
            repaired = load(path)
            assert repaired["nodes"] == original["nodes"][: result.nodes_kept], f"cut at byte {cut}"
            assert repaired["schema"] == original["schema"]
            outcomes.add("repaired")
        else:
            assert result.status == "failed"
            assert "too little to recover" in result.line() or "truncated inside the header" in result.line()
            outcomes.add("refused")
    return outcomes


def test_truncation_anywhere_keeps_exactly_the_complete_nodes(tmp_path, gpt2_text):
    assert assert_every_cut_is_repaired_to_a_prefix_or_refused(tmp_path, gpt2_text, 25) == {"repaired"}


def test_truncation_of_schema_1_0_1_traces_keeps_exactly_the_complete_nodes(tmp_path, shared_fixtures):
    text = unzip(shared_fixtures / "gpu" / "hta_simple_add_a100_1r" / "host.0.json.gz")  # 38 nodes, schema 1.0.1
    assert orjson.loads(text)["schema"] == "1.0.1"
    assert assert_every_cut_is_repaired_to_a_prefix_or_refused(tmp_path, text, 12) == {"repaired", "refused"}


@pytest.mark.slow
def test_large_truncated_trace_is_repaired_in_linear_time(tmp_path, gpt2):
    # ~25 MB: the GPT-2 step repeated with fresh ids, the size of a real model's host trace.
    nodes = []
    for copy in range(11):
        offset = copy * 100000
        nodes.extend(dict(node, id=node["id"] + offset, ctrl_deps=node["ctrl_deps"] + offset) for node in gpt2["nodes"])
    text = json.dumps(dict(gpt2, nodes=nodes)).encode()
    assert len(text) > 20e6
    path = write(tmp_path, "host.0.json", text[: len(text) * 9 // 10])
    started = time.perf_counter()
    result = repair_host_trace(path)
    elapsed = time.perf_counter() - started
    assert result.status == "repaired"
    assert load(path)["nodes"] == nodes[: result.nodes_kept]
    assert elapsed < 30, f"{elapsed:.1f} s"  # about 1.5 s here; a quadratic walk would take minutes


# --- duplicate node ids -----------------------------------------------------------------------------------


def test_duplicate_node_ids_keep_the_first_node_of_each_id(tmp_path, gpt2):
    nodes = list(gpt2["nodes"])
    copies = [dict(node, name="stale copy") for node in nodes[10:13]]
    broken = dict(gpt2, nodes=nodes[:500] + copies + nodes[500:])
    original = json.dumps(broken, indent=2).encode()
    path = write(tmp_path, "host.0.json", original)
    assert diagnose_host_trace(path).problem == f"3 duplicate node ids (first: {nodes[10]['id']})"
    result = repair_host_trace(path)
    assert result.status == "repaired" and result.nodes_dropped == 3
    assert "kept the first node of each id" in result.line()
    repaired = assert_repaired_then_idempotent(path, original)
    assert repaired["nodes"] == gpt2["nodes"]
    assert repaired["finish_ts"] == gpt2["finish_ts"]


# --- two writers ------------------------------------------------------------------------------------------


def test_two_writers_interleaved_are_refused_naming_both_processes(tmp_path):
    rank0, rank1 = (unzip(p) for p in BERT_HOSTS)
    pids = orjson.loads(rank0)["pid"], orjson.loads(rank1)["pid"]
    chunk = 4096
    original = b"".join(rank0[i:i + chunk] + rank1[i:i + chunk] for i in range(0, max(len(rank0), len(rank1)), chunk))
    path = write(tmp_path, "host.0.json", original)
    proc = run_cli(path)
    assert proc.returncode == 1
    assert proc.stdout == ""
    line = proc.stderr.strip()
    assert line.startswith(f"error: {path}: two writers mixed their text in this file (2 ExecutionTraceObserver headers")
    assert f"pids {min(pids)}, {max(pids)}" in line
    assert "no complete document can be isolated safely" in line
    assert path.read_bytes() == original and not path.with_name("host.0.json.orig").exists()


def test_complete_document_before_another_writers_nul_hole_is_isolated(tmp_path, gpt2, gpt2_text):
    # Writer B truncated the file and wrote its whole trace; writer A, still at its old offset, wrote on past a hole.
    other = unzip(BERT_HOSTS[0])
    hole = 5000
    original = gpt2_text + b"\0" * hole + other[len(gpt2_text) + hole:]
    path = write(tmp_path, "host.0.json", original)
    result = repair_host_trace(path)
    assert result.status == "repaired", result.line()
    line = result.line()
    assert f"NUL bytes at byte {len(gpt2_text)}" in line
    assert f"kept the one complete document (pid {gpt2['pid']}, 2298 nodes)" in line
    assert assert_repaired_then_idempotent(path, original) == gpt2


def test_control_characters_inside_the_only_document_are_refused(tmp_path, gpt2_text):
    original = gpt2_text[:100000] + b"\0" * 4096 + gpt2_text[104096:]
    path = write(tmp_path, "host.0.json", original)
    assert_refused_untouched(repair_host_trace(path), path, original, "NUL bytes at byte 100000",
                             "no complete document can be isolated safely")


def test_complete_documents_of_different_processes_amid_garbage_are_refused(tmp_path):
    rank0, rank1 = (unzip(p) for p in BERT_HOSTS)
    original = rank0 + b"\x01\x02 stray" + rank1
    path = write(tmp_path, "host.0.json", original)
    assert_refused_untouched(repair_host_trace(path), path, original, "2 complete documents from different processes")


# --- not repairable: not a host trace ---------------------------------------------------------------------


@pytest.mark.parametrize("content, message", [
    (b"", "empty file"),
    (b" \n\t\n", "empty file (only whitespace)"),
    (b"\x08\x01\x12\x07chakra\x00", "not JSON (starts with b'\\x08\\x01\\x12\\x07chakra\\x00')"),
    (b'{"schema": "2.0.0", "pid": 1, "nodes": []}',
     "unknown host trace schema version '2.0.0' (supported: 1.0.x and 1.1.x, e.g. 1.0.1 or 1.1.1-chakra.0.0.4)"),
    (b'{"pid": 1, "nodes": []}', "not an ExecutionTraceObserver host trace (no 'schema' and 'nodes' list; keys: pid, nodes)"),
    # JSON, just not an object: was "not JSON (starts with b'null')" and "invalid JSON ... unexpected text"
    (b"null", "JSON null, not an ExecutionTraceObserver host trace (a JSON object with 'schema' and 'nodes')"),
    (b"[1, 2]\n", "a JSON array, not an ExecutionTraceObserver host trace (a JSON object with 'schema' and 'nodes')"),
])
def test_unusable_files_get_one_line_error_and_stay_untouched(tmp_path, content, message):
    path = write(tmp_path, "x_host.json", content)
    proc = run_cli(path)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"error: {path}: {message}"
    assert path.read_bytes() == content and not path.with_name("x_host.json.orig").exists()


def test_device_trace_passed_as_host_is_named_as_such(tmp_path):
    original = GPT2_DEVICE.read_bytes()
    path = write(tmp_path, "host.0.json.gz", original)
    assert_refused_untouched(repair_host_trace(path), path, original,
                             "this is a device (Kineto) trace, not a host trace (it has 'traceEvents')")


def test_truncated_device_trace_passed_as_host_is_named_as_such(tmp_path):
    original = unzip(GPT2_DEVICE)[:50000]
    path = write(tmp_path, "host.0.json", original)
    assert_refused_untouched(repair_host_trace(path), path, original, "device (Kineto) trace, not a host trace")


def test_corrupt_gzip_is_refused(tmp_path):
    data = bytearray(GPT2_HOST.read_bytes())
    data[5000:5200] = b"\xff" * 200
    path = write(tmp_path, "host.0.json.gz", bytes(data))
    assert_refused_untouched(repair_host_trace(path), path, bytes(data), "corrupt gzip data")


# --- how the command line behaves ---------------------------------------------------------------------------


def test_read_only_file_that_needs_repair_exits_1_and_says_so(tmp_path, gpt2_text):
    original = gpt2_text + gpt2_text
    path = write(tmp_path, "host.0.json", original)
    valid = write(tmp_path, "host.1.json", gpt2_text)
    path.chmod(0o444)
    valid.chmod(0o444)
    proc = run_cli(path, valid)
    assert proc.returncode == 1
    assert f"error: {path}: 2 JSON objects concatenated (ExecutionTraceObserver wrote twice); cannot repair: " \
           "the file is read-only" in proc.stderr
    assert f"ok: {valid}: already valid, nothing to do" in proc.stdout  # a valid read-only file is fine
    assert path.read_bytes() == original and not path.with_name("host.0.json.orig").exists()


def test_check_reports_without_changing_anything(tmp_path, gpt2_text):
    original = gpt2_text + gpt2_text
    path = write(tmp_path, "host.0.json", original)
    proc = run_cli("--check", path)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"needs repair: {path}: 2 JSON objects concatenated (ExecutionTraceObserver wrote "
                                   "twice); repairable: run fix_host_traces.py")
    assert path.read_bytes() == original and not path.with_name("host.0.json.orig").exists()


def test_check_of_a_read_only_trace_says_the_repair_cannot_be_written_there(tmp_path, gpt2_text):
    """--check said "repairable: run fix_host_traces.py", which then refused the read-only file."""
    original = gpt2_text + gpt2_text
    path = write(tmp_path, "host.0.json", original)
    path.chmod(0o444)
    proc = run_cli("--check", path)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"needs repair: {path}: 2 JSON objects concatenated (ExecutionTraceObserver wrote "
                                   "twice); repairable, but not in place: the file is read-only (copy the run to a "
                                   "writable folder, or chmod u+w, then run fix_host_traces.py)")
    assert path.read_bytes() == original and not path.with_name("host.0.json.orig").exists()


def test_folder_is_searched_for_host_traces_of_both_layouts(tmp_path, gpt2_text):
    run = tmp_path / "outputs" / "gpt2_1r"
    run.mkdir(parents=True)
    write(run, "host.0.json.gz", GPT2_HOST.read_bytes())
    write(run, "device.0.json.gz", GPT2_DEVICE.read_bytes())  # not a host trace: not looked at
    flat = write(tmp_path / "outputs", "gpt2_1gpu_quick_trace_host.json", gpt2_text + gpt2_text)
    proc = run_cli("outputs", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("repaired: outputs/gpt2_1gpu_quick_trace_host.json: 2 JSON objects concatenated")
    assert lines[1] == "ok: outputs/gpt2_1r/host.0.json.gz: already valid, nothing to do (2298 nodes)"
    assert lines[2].startswith("2 host traces: 1 valid, 1 repaired, 0 not repairable")
    assert load(flat)["nodes"] == orjson.loads(gpt2_text)["nodes"]


def test_missing_path_and_folder_without_host_traces_exit_1(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run_cli(tmp_path / "nope", tmp_path / "empty")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"error: {tmp_path / 'nope'}: no such file or folder",
        f"error: {tmp_path / 'empty'}: no host traces found (host.<rank>.json[.gz] or <name>_host.json[.gz])",
    ]


def test_a_folder_where_a_host_trace_belongs_is_named_as_a_directory(tmp_path):
    """A copy gone wrong left a folder named host.0.json beside the device trace: named as convert_to_et.py names
    it, not 'no host traces found'."""
    run = tmp_path / "gpt2_1r"
    run.mkdir()
    write(run, "device.0.json.gz", GPT2_DEVICE.read_bytes())
    (run / "host.0.json").mkdir()
    proc = run_cli("--check", run)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [f"error: {run / 'host.0.json'}: is a directory, expected a host trace file"]


def test_a_folder_in_one_ranks_host_trace_place_fails_the_check_of_the_others(tmp_path):
    """Rank 0's host trace is fine and rank 1's is a folder: --check does not pass the run, which would not convert."""
    run = tmp_path / "bert_2r"
    run.mkdir()
    for rank in (0, 1):
        write(run, f"device.{rank}.json.gz", (DATA / "bert_tiny_2r" / f"device.{rank}.json.gz").read_bytes())
    write(run, "host.0.json.gz", BERT_HOSTS[0].read_bytes())
    (run / "host.1.json.gz").mkdir()
    proc = run_cli("--check", run)
    assert proc.returncode == 1
    assert proc.stdout.startswith(f"ok: {run / 'host.0.json.gz'}: already valid")
    assert proc.stderr.splitlines() == [f"error: {run / 'host.1.json.gz'}: is a directory, expected a host trace file"]


# --- the API the converter uses ---------------------------------------------------------------------------


def test_diagnosis_message_is_the_one_line_the_converter_prints(tmp_path, monkeypatch, gpt2_text):
    run = tmp_path / "outputs" / "gpt2_2gpu"
    run.mkdir(parents=True)
    write(run, "host.1.json", gpt2_text + gpt2_text)
    monkeypatch.chdir(tmp_path)
    diagnosis = diagnose_host_trace(Path("outputs/gpt2_2gpu/host.1.json"))
    assert not diagnosis.ok and diagnosis.repairable and diagnosis.kind == repair.CONCATENATED
    assert diagnosis.message() == ("error: outputs/gpt2_2gpu/host.1.json: 2 JSON objects concatenated "
                                   "(ExecutionTraceObserver wrote twice); run fix_host_traces.py")


def test_keep_original_false_leaves_no_backup(tmp_path, gpt2_text):
    path = write(tmp_path, "host.0.json", gpt2_text + gpt2_text)
    result = repair_host_trace(path, keep_original=False)
    assert result.status == "repaired" and result.backup is None
    assert [p.name for p in tmp_path.iterdir()] == ["host.0.json"]
    assert load(path) == orjson.loads(gpt2_text)


# --- a repair never makes the trace into another one ------------------------------------------------------


def test_host_traces_of_two_processes_concatenated_are_refused(tmp_path):
    """Rank 0's and rank 1's traces in one file: keeping the last would give host.0.json rank 1's trace."""
    rank0, rank1 = (unzip(p) for p in BERT_HOSTS)
    pids = sorted((orjson.loads(rank0)["pid"], orjson.loads(rank1)["pid"]))
    original = rank0 + rank1
    path = write(tmp_path, "host.0.json", original)
    proc = run_cli(path)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip() == (f"error: {path}: 2 host traces of 2 processes concatenated (pids {pids[0]}, "
                                   f"{pids[1]}): cannot tell which is this file's trace; trace again with one output "
                                   "file per process (host.<rank>.json)")
    assert_refused_untouched(repair_host_trace(path), path, original)


def test_concatenation_whose_last_document_holds_no_operator_is_refused(tmp_path, gpt2, gpt2_text):
    """The observer registered again wrote a document of its structure only: keeping it would drop every operator."""
    structure = [n for n in gpt2["nodes"] if n["name"].startswith("[pytorch|profiler|execution_trace|")]
    original = gpt2_text + orjson.dumps(dict(gpt2, nodes=structure))
    path = write(tmp_path, "host.0.json", original)
    assert_refused_untouched(repair_host_trace(path), path, original,
                             "2 JSON objects concatenated (ExecutionTraceObserver wrote twice); the document to keep "
                             f"holds {len(structure)} node(s) and no operator")


def test_interrupted_repair_leaves_the_original_alone_and_no_backup(tmp_path, gpt2_text, monkeypatch):
    original = gpt2_text + gpt2_text
    path = write(tmp_path, "host.0.json", original)

    def interrupted(src, dst):
        raise KeyboardInterrupt  # Ctrl-C just before the repaired file is renamed into place

    monkeypatch.setattr(repair.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        repair_host_trace(path)
    assert [p.name for p in tmp_path.iterdir()] == ["host.0.json"] and path.read_bytes() == original


def test_interrupt_right_after_the_rename_keeps_the_backup(tmp_path, gpt2, gpt2_text, monkeypatch):
    original = gpt2_text + gpt2_text
    path = write(tmp_path, "host.0.json", original)
    rename = repair.os.replace

    def renamed_then_interrupted(src, dst):
        rename(src, dst)
        raise KeyboardInterrupt

    monkeypatch.setattr(repair.os, "replace", renamed_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        repair_host_trace(path)
    assert path.with_name("host.0.json.orig").read_bytes() == original and load(path) == gpt2


def test_sigterm_during_a_repair_says_so_in_one_line_and_keeps_the_original(tmp_path, gpt2_text):
    original = gpt2_text + gpt2_text
    path = write(tmp_path, "host.0.json", original)
    code = ("import os, signal, sys, fix_host_traces, trace_tools.repair as r\n"
            "r._backup_path = lambda p: os.kill(os.getpid(), signal.SIGTERM)\n"
            f"sys.exit(fix_host_traces.main([{str(path)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 143
    assert proc.stderr.strip() == (f"interrupted: stopped by SIGTERM at {path}, which is left as it was (a repair is "
                                   "written to a temporary file first); 0 of 1 host traces done")
    assert [p.name for p in tmp_path.iterdir()] == ["host.0.json"] and path.read_bytes() == original
