"""Validation of written .et files, bad inputs, run discovery, convert_remaining, and scale."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from chakra.schema.protobuf.et_def_pb2 import (ALL_REDUCE, BROADCAST, COMM_COLL_NODE, COMP_NODE, METADATA_NODE,
                                               AttributeProto, GlobalMetadata, Node)
from chakra.src.third_party.utils.protolib import encodeMessage

from conversion_helpers import CPU_FIXTURES, read_json, write_json, write_scaled_run
from trace_tools import cli
from trace_tools.discover import find_runs
from trace_tools.load import load_device_trace, load_host_trace
from trace_tools.summary import converted_from
from trace_tools.validate import collectives_agree, validate_et

REPO = Path(__file__).resolve().parent.parent
GPT2 = CPU_FIXTURES / "gpt2_tiny_1r"
BERT = CPU_FIXTURES / "bert_tiny_2r"


def write_et_file(path: Path, nodes: list[Node]) -> Path:
    with open(path, "wb") as f:
        encodeMessage(f, GlobalMetadata(version="0.0.4", attr=[AttributeProto(name="rank", int64_val=0)]))
        for node in nodes:
            encodeMessage(f, node)
    return path


def comp(node_id: int, deps=(), duration=10) -> Node:
    return Node(id=node_id, name=f"op{node_id}", type=COMP_NODE, data_deps=list(deps), duration_micros=duration,
                attr=[AttributeProto(name="is_cpu_op", bool_val=True)])


# ---- the validator ----------------------------------------------------------------------------------------------
def test_valid_graph_reports_its_critical_path(tmp_path):
    report = validate_et(write_et_file(tmp_path / "a.0.et", [comp(1), comp(2, [1], 5), comp(3, [1], 20),
                                                             comp(4, [2, 3], 1)]))
    assert report.ok and report.visited == 4
    assert report.critical_path_us == 10 + 20 + 1


def test_traced_path_counts_concurrent_collectives_of_one_group_once(tmp_path):
    # gloo reduced two buckets at once, 0-10 ms and 1-11 ms, each slower for sharing the link; the .et chains them
    # (one process group), so the pair must count 11 ms on the traced path, not 10 + 10.
    def collective(node_id: int, start: int, deps=()) -> Node:
        return Node(id=node_id, name=f"allreduce{node_id}", type=COMM_COLL_NODE, data_deps=list(deps),
                    start_time_micros=start, duration_micros=4_000,
                    attr=[AttributeProto(name="is_cpu_op", bool_val=False),
                          AttributeProto(name="comm_type", int64_val=ALL_REDUCE),
                          AttributeProto(name="comm_size", int64_val=1 << 20),
                          AttributeProto(name="traced_micros", int64_val=10_000)])

    report = validate_et(write_et_file(tmp_path / "a.0.et", [collective(1, 0), collective(2, 1_000, [1]),
                                                             comp(3, [2], 500)]))
    assert report.ok
    assert report.traced_critical_path_us == 11_000 + 500
    assert report.critical_path_us == 5_000 + 500  # the durations as written: 0-4 ms and 1-5 ms


def test_collectives_are_listed_in_the_order_a_simulator_issues_them_not_the_order_gloos_threads_began(tmp_path):
    # DDP broadcast a model's float buffers (256 bytes) and then its integer ones (16 bytes), each enqueued by a
    # c10d call of the training thread; gloo's two threads began the second one first. A simulator issues each once
    # its call is done, the 256 bytes first on every rank, and the ranks agree on that order.
    def broadcast(node_id: int, start: int, size: int, enqueued_by: int) -> Node:
        return Node(id=node_id, name=f"broadcast{node_id}", type=COMM_COLL_NODE, data_deps=[enqueued_by],
                    start_time_micros=start, duration_micros=100,
                    attr=[AttributeProto(name="is_cpu_op", bool_val=False),
                          AttributeProto(name="comm_type", int64_val=BROADCAST),
                          AttributeProto(name="comm_size", int64_val=size)])

    calls = [comp(1, duration=100), comp(2, [1], 100)]
    started_in_turn = validate_et(write_et_file(tmp_path / "a.0.et", [
        *calls, broadcast(3, 150, 256, enqueued_by=1), broadcast(4, 250, 16, enqueued_by=2)]))
    started_out_of_turn = validate_et(write_et_file(tmp_path / "a.1.et", [
        *calls, broadcast(3, 330, 256, enqueued_by=1), broadcast(4, 250, 16, enqueued_by=2)]))
    assert started_in_turn.collectives == started_out_of_turn.collectives == [("", "BROADCAST", 256),
                                                                             ("", "BROADCAST", 16)]
    assert collectives_agree({0: started_in_turn.collectives, 1: started_out_of_turn.collectives}) == []


def test_validator_finds_a_dangling_dependency(tmp_path):
    report = validate_et(write_et_file(tmp_path / "a.0.et", [comp(1), comp(2, [7])]))
    assert not report.ok and "missing node 7" in report.problems[0]


def test_validator_finds_a_dangling_ctrl_dependency_like_chakras_thread_node(tmp_path):
    node = comp(1)
    node.ctrl_deps.append(0)
    report = validate_et(write_et_file(tmp_path / "a.0.et", [node]))
    assert not report.ok and "missing node 0" in report.problems[0]


def test_validator_finds_a_cycle(tmp_path):
    report = validate_et(write_et_file(tmp_path / "a.0.et", [comp(1, [3]), comp(2, [1]), comp(3, [2]), comp(4)]))
    assert not report.ok and "cycle" in report.problems[-1] and report.visited == 1


def test_validator_rejects_metadata_nodes_and_incomplete_collectives(tmp_path):
    metadata = Node(id=1, name="## process_group:init ##", type=METADATA_NODE,
                    attr=[AttributeProto(name="is_cpu_op", bool_val=True)])
    collective = Node(id=2, name="all_reduce", type=COMM_COLL_NODE, data_deps=[1],
                      attr=[AttributeProto(name="is_cpu_op", bool_val=True),
                            AttributeProto(name="comm_type", int64_val=ALL_REDUCE)])
    problems = " | ".join(validate_et(write_et_file(tmp_path / "a.0.et", [metadata, collective])).problems)
    assert "ASTRA-sim rejects" in problems
    assert "is_cpu_op" in problems and "no comm_size" in problems


def test_validator_reports_a_truncated_et(tmp_path):
    path = write_et_file(tmp_path / "a.0.et", [comp(1), comp(2, [1])])
    path.write_bytes(path.read_bytes()[:-3])
    assert "truncated" in validate_et(path).problems[0]


def test_collectives_that_differ_between_ranks_are_reported():
    same = [("0", "ALL_REDUCE", 100), ("0", "ALL_TO_ALL", 8)]
    assert collectives_agree({0: same, 1: [("0", "ALL_REDUCE", 100), ("0", "ALL_TO_ALL", 16)]}) == []
    assert "rank 1 has 1 collectives" in collectives_agree({0: same, 1: same[:1]})[0]
    assert "ALL_REDUCE of 100 bytes on rank 0 but ALL_REDUCE of 50 bytes on rank 1" in \
        collectives_agree({0: same, 1: [("0", "ALL_REDUCE", 50), ("0", "ALL_TO_ALL", 8)]})[0]


# ---- bad inputs: one line, non-zero exit, no .et -------------------------------------------------------------------
def gpt2_run(folder: Path, host_bytes: bytes | None = None, device: Path = GPT2 / "device.0.json.gz") -> Path:
    folder.mkdir(parents=True)
    (folder / "host.0.json").write_bytes(gzip.decompress((GPT2 / "host.0.json.gz").read_bytes())
                                         if host_bytes is None else host_bytes)
    (folder / "device.0.json.gz").write_bytes(device.read_bytes())
    return folder


def convert_expecting_failure(folder: Path, capsys) -> str:
    assert cli.main([str(folder), "--no-progress"]) == 1
    out = capsys.readouterr().out
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out
    assert not list(folder.glob("*.et")) and not list(folder.glob(".*.et*")), "no .et, not even a partial one"
    return errors[0]


def host_text() -> bytes:
    return gzip.decompress((GPT2 / "host.0.json.gz").read_bytes())


@pytest.mark.parametrize("case,content,message", [
    ("empty", b"", "empty file"),
    ("truncated", host_text()[:200000], "truncated"),
    ("concatenated", host_text() + host_text(), "2 JSON objects concatenated"),
    ("unknown_schema", host_text().replace(b'"1.1.1-chakra.0.0.4"', b'"3.0.0"'), "schema"),
])
def test_broken_host_trace_gives_one_line_and_no_et(tmp_path, capsys, case, content, message):
    error = convert_expecting_failure(gpt2_run(tmp_path / case, content), capsys)
    assert "host.0.json" in error and message in error


def test_unknown_schema_is_named_in_the_error(tmp_path, capsys):
    content = host_text().replace(b'"1.1.1-chakra.0.0.4"', b'"2.3.0-chakra.9.9.9"')
    error = convert_expecting_failure(gpt2_run(tmp_path / "schema", content), capsys)
    assert "2.3.0-chakra.9.9.9" in error and "1.0.x and 1.1.x" in error


def test_device_trace_passed_as_host_gives_one_line(tmp_path, capsys):
    content = gzip.decompress((GPT2 / "device.0.json.gz").read_bytes())
    error = convert_expecting_failure(gpt2_run(tmp_path / "swapped", content), capsys)
    assert "device (Kineto) trace, not a host trace" in error


def test_host_trace_passed_as_device_gives_one_line(tmp_path, capsys):
    error = convert_expecting_failure(gpt2_run(tmp_path / "swapped", None, device=GPT2 / "host.0.json.gz"), capsys)
    assert "device.0.json.gz" in error and "not a Kineto device trace" in error


def test_truncated_device_trace_gives_one_line(tmp_path, capsys):
    folder = gpt2_run(tmp_path / "cut")
    (folder / "device.0.json.gz").unlink()
    (folder / "device.0.json").write_bytes(gzip.decompress((GPT2 / "device.0.json.gz").read_bytes())[:50000])
    error = convert_expecting_failure(folder, capsys)
    assert "device.0.json" in error and "truncated JSON" in error


def test_host_and_device_from_different_runs_give_one_line(tmp_path, capsys):
    folder = gpt2_run(tmp_path / "mixed", gzip.decompress((BERT / "host.0.json.gz").read_bytes()))
    error = convert_expecting_failure(folder, capsys)
    assert "not the same run" in error


def test_missing_rank_fails_alone_and_the_other_rank_is_converted(tmp_path, capsys):
    folder = tmp_path / "bert"
    folder.mkdir()
    for name in ("host.0.json.gz", "device.0.json.gz", "device.1.json.gz"):
        (folder / name).write_bytes((BERT / name).read_bytes())
    assert cli.main([str(folder), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "error: " + str(folder / "host.1.json") + ": missing" in out
    assert (folder / "bert.0.et").is_file() and not (folder / "bert.1.et").exists()
    summary = (folder / "CONVERSION_SUMMARY.md").read_text()
    assert "| 1 | ❌ failed |" in summary and "host.1.json: missing" in summary


def test_a_folder_in_a_trace_files_place_is_named_a_directory_not_missing(tmp_path, capsys):
    folder = tmp_path / "bert"
    folder.mkdir()
    for name in ("host.0.json.gz", "device.0.json.gz", "device.1.json.gz"):
        (folder / name).write_bytes((BERT / name).read_bytes())
    (folder / "host.1.json").mkdir()  # a copy gone wrong: said "host.1.json: missing"
    assert cli.main([str(folder), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert f"error: {folder / 'host.1.json'}: is a directory, expected a host trace file" in out.splitlines()
    assert (folder / "bert.0.et").is_file() and not (folder / "bert.1.et").exists()


def test_a_host_trace_that_is_json_null_is_named_as_such(tmp_path, capsys):
    error = convert_expecting_failure(gpt2_run(tmp_path / "null", b"null\n"), capsys)
    assert error == (f"error: {tmp_path / 'null' / 'host.0.json'}: JSON null, not an ExecutionTraceObserver host "
                     "trace (a JSON object with 'schema' and 'nodes')")


def test_a_device_trace_that_is_json_null_is_named_as_such(tmp_path, capsys):
    folder = gpt2_run(tmp_path / "null")
    (folder / "device.0.json.gz").unlink()
    (folder / "device.0.json").write_text("null\n")
    error = convert_expecting_failure(folder, capsys)
    assert error == f"error: {folder / 'device.0.json'}: expected a JSON object at the top level, found JSON null"


def test_rank_announced_by_run_json_but_absent_fails(tmp_path, capsys):
    folder = tmp_path / "gpt2"
    gpt2_run(folder)
    (folder / "run.json").write_text(json.dumps({"world_size": 2}))
    assert cli.main([str(folder), "--no-progress"]) == 1
    assert "host.1.json: missing, and" in capsys.readouterr().out


def test_no_traces_at_all_is_a_usage_error(tmp_path, capsys):
    """The folder first, as setup_and_convert.sh and the docs' table word it."""
    assert cli.main([str(tmp_path), "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path}: no traces found (expected host.<rank>.json[.gz] + "
                                       "device.<rank>.json[.gz], or <name>_host.json + <name>_device.json)\n")


# ---- discovery -----------------------------------------------------------------------------------------------------
def test_runs_are_found_in_tracer_folders_flat_files_and_their_parents(tmp_path):
    outputs = tmp_path / "outputs"
    tracer = outputs / "bert_2cpu"
    tracer.mkdir(parents=True)
    for name in ("host.0.json.gz", "device.0.json.gz", "host.1.json.gz", "device.1.json.gz"):
        (tracer / name).write_bytes(b"{}")
    (outputs / "gpt2_1gpu_quick_trace_host.json").write_bytes(b"{}")
    (outputs / "gpt2_1gpu_quick_trace_device.json").write_bytes(b"{}")
    (tracer / ".host.0.json.partial").write_bytes(b"")
    runs = {run.name: run for run in find_runs([outputs])}
    assert set(runs) == {"gpt2_1gpu_quick_trace"}  # a folder with traces of its own is that run
    runs = {run.name: run for run in find_runs([tracer, outputs / "gpt2_1gpu_quick_trace_host.json"])}
    assert runs["bert_2cpu"].ranks == [0, 1]
    assert runs["gpt2_1gpu_quick_trace"].ranks == [0]
    only_dirs = tmp_path / "runs"
    (only_dirs / "a").mkdir(parents=True)
    (only_dirs / "a" / "host.0.json").write_bytes(b"{}")
    (only_dirs / "a" / "device.0.json").write_bytes(b"{}")
    assert [r.name for r in find_runs([only_dirs])] == ["a"]


def test_flat_seed_layout_converts_to_name_dot_rank_et(tmp_path, capsys):
    (tmp_path / "gpt2_1gpu_quick_trace_host.json").write_bytes(host_text())
    (tmp_path / "gpt2_1gpu_quick_trace_device.json.gz").write_bytes((GPT2 / "device.0.json.gz").read_bytes())
    assert cli.main([str(tmp_path), "--no-progress"]) == 0
    assert (tmp_path / "gpt2_1gpu_quick_trace.0.et").is_file()


def test_read_only_run_folder_is_converted_into_converted_name(tmp_path, capsys, monkeypatch):
    """The summary there names the workload by an absolute path: the fallback folder had been recorded as
    converted/<name>, which holds only in the folder the conversion ran in."""
    folder = gpt2_run(tmp_path / "traces" / "gpt2_ro")
    folder.chmod(0o555)
    monkeypatch.chdir(tmp_path)
    try:
        assert cli.main([str(folder), "--no-progress"]) == 0
    finally:
        folder.chmod(0o755)
    assert f"is not writable: writing to {tmp_path / 'converted' / 'gpt2_ro'}" in capsys.readouterr().out
    assert sorted(p.name for p in folder.iterdir()) == ["device.0.json.gz", "host.0.json"]
    out_dir = tmp_path / "converted" / "gpt2_ro"
    et = out_dir / "gpt2_ro.0.et"
    assert et.is_file() and et.stat().st_mode & 0o044, "an ordinary readable file, not mkstemp's 0600"
    summary = (out_dir / "CONVERSION_SUMMARY.md").read_text()
    assert f"by trace_tools from `{folder}`" in summary
    assert f"--workload-configuration={out_dir / 'gpt2_ro'}`" in summary
    assert json.dumps(str(et)) in summary  # the rank's et_path in the status block


def test_the_summary_names_a_trace_folder_given_relative_by_its_absolute_path(tmp_path, monkeypatch):
    """simulate.py and scale_et.py find run.json in the trace folder the summary names; recorded as typed
    (`gpt2_rel`), it was found only from the folder the conversion ran in."""
    folder = gpt2_run(tmp_path / "traces" / "gpt2_rel")
    monkeypatch.chdir(tmp_path / "traces")
    assert cli.main(["gpt2_rel", "--output-dir", "../converted", "--no-progress"]) == 0
    monkeypatch.chdir(tmp_path)
    out_dir = tmp_path / "converted"
    assert f"by trace_tools from `{folder}`" in (out_dir / "CONVERSION_SUMMARY.md").read_text()
    assert converted_from(out_dir) == converted_from(Path("converted")) == folder


def test_an_older_summary_naming_the_trace_folder_as_typed_is_still_read(tmp_path, monkeypatch):
    """Summaries before the absolute path recorded the folder as typed, relative to where the conversion ran: it is
    taken from the working directory when it is a folder there, else from the summary's own folder."""
    folder = gpt2_run(tmp_path / "traces" / "gpt2_old")
    out_dir = tmp_path / "converted"
    assert cli.main([str(folder), "--output-dir", str(out_dir), "--no-progress"]) == 0
    summary = out_dir / "CONVERSION_SUMMARY.md"
    text = summary.read_text()
    summary.write_text(text.replace(f"from `{folder}`", "from `traces/gpt2_old`"))
    monkeypatch.chdir(tmp_path)
    assert converted_from(out_dir).resolve() == folder
    summary.write_text(text.replace(f"from `{folder}`", "from `../traces/gpt2_old`"))
    (tmp_path / "a" / "b").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a" / "b")  # where ../traces/gpt2_old is no folder
    assert converted_from(out_dir).resolve() == folder


# ---- convert_remaining ---------------------------------------------------------------------------------------------
def test_convert_remaining_redoes_only_missing_or_failed_ranks(tmp_path, capsys):
    folder = tmp_path / "bert"
    folder.mkdir()
    for name in ("host.0.json.gz", "device.0.json.gz", "device.1.json.gz"):
        (folder / name).write_bytes((BERT / name).read_bytes())
    assert cli.main([str(folder), "--no-progress"]) == 1
    first = (folder / "bert.0.et").stat().st_mtime_ns
    (folder / "host.1.json.gz").write_bytes((BERT / "host.1.json.gz").read_bytes())
    capsys.readouterr()
    assert cli.main([str(folder), "--no-progress"], remaining=True) == 0
    out = capsys.readouterr().out
    assert "converting 1 remaining rank(s)" in out
    assert (folder / "bert.0.et").stat().st_mtime_ns == first, "rank 0 was already converted: left alone"
    assert (folder / "bert.1.et").is_file()
    summary = (folder / "CONVERSION_SUMMARY.md").read_text()
    assert summary.count("✅ ok") == 2 and "collectives agree across the 2 ranks" in summary
    assert cli.main([str(folder), "--no-progress"], remaining=True) == 0
    assert "nothing to do" in capsys.readouterr().out


# ---- large traces --------------------------------------------------------------------------------------------------
def test_sliced_parsing_reads_the_same_trace_as_a_whole_parse(tmp_path):
    host_doc = read_json(BERT / "host.0.json.gz")
    path = write_json(tmp_path / "host.0.json", host_doc)
    whole = load_host_trace(path)
    sliced = load_host_trace(path, chunk_bytes=64 << 10, chunked_min_bytes=0)
    assert sliced.ids == whole.ids and sliced.names == whole.names and sliced.parents == whole.parents
    assert sliced.io_fragments == whole.io_fragments and sliced.attr_fragments == whole.attr_fragments
    device_path = write_json(tmp_path / "device.0.json", read_json(BERT / "device.0.json.gz"))
    whole_device = load_device_trace(device_path)
    sliced_device = load_device_trace(device_path, chunk_bytes=32 << 10, chunked_min_bytes=0)
    assert sliced_device.cpu_ts == whole_device.cpu_ts and sliced_device.cpu_names == whole_device.cpu_names


def _convert_in_fresh_process(folder: Path) -> dict:
    # CPU time, not wall time: the test machine is shared, and the claim is about the work done.
    code = ("import json, sys, time; from trace_tools.pipeline import convert_rank; t = time.process_time(); "
            "r = convert_rank(sys.argv[1] + '/host.0.json', sys.argv[1] + '/device.0.json', sys.argv[1] + '/x.0.et'); "
            "print(json.dumps({'s': time.process_time() - t, 'mb': r.peak_rss_mb, 'nodes': r.nodes, "
            "'ratio': r.critical_path_us / r.traced_step_us}))")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_conversion_grows_linearly_with_the_number_of_traced_steps(tmp_path):
    small = _convert_in_fresh_process(write_scaled_run(tmp_path / "steps2", BERT, [0], 2))
    large = _convert_in_fresh_process(write_scaled_run(tmp_path / "steps16", BERT, [0], 16))
    assert large["nodes"] == small["nodes"]  # the .et holds the median step, with medians over all traced steps
    assert large["s"] < 12 * small["s"], (small, large)  # 8x the trace: no worse than linear, with slack
    assert large["mb"] < 400
    assert 0.9 < large["ratio"] < 1.1


def test_peak_memory_reported_is_the_converting_process_own_not_its_parents():
    # ru_maxrss survives execve: a converter started by a large parent must not report the parent's peak.
    grow = ("import subprocess, sys; b = bytearray(400 * 1024 * 1024); b[::4096] = b'x' * len(b[::4096]); "
            "print(subprocess.run([sys.executable, '-c', 'from trace_tools.pipeline import peak_rss_mb; "
            "print(peak_rss_mb())'], capture_output=True, text=True, check=True).stdout)")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-c", grow], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert float(run.stdout.split()[-1]) < 200
