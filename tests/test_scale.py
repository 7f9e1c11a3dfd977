"""Scale-out: a data-parallel run traced on k ranks becomes N ranks for ASTRA-sim; other parallelism is refused."""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from chakra.schema.protobuf.et_def_pb2 import COMM_COLL_NODE, COMM_SEND_NODE, COMP_NODE, GlobalMetadata, Node
from chakra.src.third_party.utils.protolib import encodeMessage

import scale_et
from conversion_helpers import CPU_FIXTURES, read_et_with_protolib
from trace_tools import scale
from trace_tools.discover import find_runs
from trace_tools.pipeline import convert_runs
from trace_tools.scale import NotDataParallelError, ScaleError, scale_run, scale_set
from trace_tools.validate import SerializedMessage, collectives_agree, iter_et_messages, validate_et

REPO = Path(__file__).resolve().parent.parent
GPT2_2R = "gpt2_tiny_2r"


def metadata_of(path: Path) -> dict:
    metadata, _ = read_et_with_protolib(path)
    return {a.name: getattr(a, a.WhichOneof("value")) for a in metadata.attr}


def attr_value(node: Node, name: str):
    return next((getattr(a, a.WhichOneof("value")) for a in node.attr if a.name == name), None)


def collective_nodes(path: Path) -> list[Node]:
    return [n for n in read_et_with_protolib(path)[1] if n.type == COMM_COLL_NODE]


def write_et(path: Path, metadata: GlobalMetadata, nodes: list[Node]) -> Path:
    with open(path, "wb") as f:
        encodeMessage(f, metadata)
        for node in nodes:
            encodeMessage(f, node)
    return path


@pytest.fixture(scope="session")
def gpu_runs(shared_fixtures, tmp_path_factory) -> Path:
    """The Megatron tensor-parallel and DLRM all-to-all 8-rank fixtures, converted (no run.json: foreign traces)."""
    out = tmp_path_factory.mktemp("scale_gpu")
    runs = find_runs([shared_fixtures / "gpu" / "astra-sim_megatron_tp8_a100_8r",
                      shared_fixtures / "gpu" / "param_dlrm_v100_8r"])
    results = convert_runs(runs, output_dir=out, jobs=2, progress=False)
    assert all(r.ok for r in results)
    return out


@pytest.fixture
def bare_gpt2(gpt2_run, tmp_path) -> Path:
    """The converted .et files alone, as a foreign user would have them: no run.json, no CONVERSION_SUMMARY.md."""
    folder = tmp_path / GPT2_2R
    folder.mkdir()
    for r in (0, 1):
        shutil.copy(gpt2_run / f"{GPT2_2R}.{r}.et", folder)
    return folder


# ---- ranks, groups, metadata --------------------------------------------------------------------------------------
def test_rank_r_replays_traced_rank_r_mod_k_with_world_size_n(gpt2_run, tmp_path):
    prefix = scale_run(gpt2_run, 5, output_dir=tmp_path / "out")
    assert prefix == tmp_path / "out" / f"{GPT2_2R}_5npus"
    files = sorted(prefix.parent.glob("*.et"))
    assert [f.name for f in files] == [f"{GPT2_2R}_5npus.{r}.et" for r in range(5)]
    for r in range(5):
        meta = metadata_of(Path(f"{prefix}.{r}.et"))
        assert (meta["source_rank"], meta["world_size"], meta["traced_world_size"], meta["scaled"]) == (r % 2, 5, 2, True)
        assert "rank" not in meta  # the rank is the file name: ranks replaying one traced rank share the file
        _, nodes = read_et_with_protolib(Path(f"{prefix}.{r}.et"))
        _, traced = read_et_with_protolib(gpt2_run / f"{GPT2_2R}.{r % 2}.et")
        assert [(n.id, n.duration_micros) for n in nodes] == [(n.id, n.duration_micros) for n in traced]


def test_collectives_keep_their_sizes_and_run_over_the_n_rank_world_group(gpt2_run, tmp_path):
    prefix = scale_run(gpt2_run, 64, output_dir=tmp_path)
    traced = collective_nodes(gpt2_run / f"{GPT2_2R}.0.et")
    scaled = collective_nodes(Path(f"{prefix}.62.et"))
    assert [attr_value(n, "comm_size") for n in scaled] == [attr_value(n, "comm_size") for n in traced] == [900352, 8]
    assert [attr_value(n, "comm_type") for n in scaled] == [attr_value(n, "comm_type") for n in traced]
    # ASTRA-sim runs pg_name "0" (or none) over every NPU, with no --comm-group-configuration
    assert {attr_value(n, "pg_name") for n in scaled} == {"0"}
    groups = scale._process_groups(metadata_of(Path(f"{prefix}.62.et")))
    assert [(g["pg_name"], g["group_size"], g["ranks"]) for g in groups] == [("0", 64, [])]


def test_a_count_that_is_not_a_multiple_of_the_traced_one_is_fine(gpt2_run, tmp_path):
    three = scale_run(gpt2_run, 3, output_dir=tmp_path / "three")
    assert [metadata_of(Path(f"{three}.{r}.et"))["source_rank"] for r in range(3)] == [0, 1, 0]


def test_fewer_ranks_than_traced_are_refused_as_a_flag_error_and_nothing_is_written(gpt2_run, tmp_path, capsys):
    """--ranks 1 of a 2-rank run wrote one rank that replays traced rank 0 alone, with collectives over 1 NPU."""
    code = scale_et.main([str(gpt2_run), "--ranks", "1", "--output-dir", str(tmp_path / "one")])
    assert code == 2
    assert capsys.readouterr().err == ("error: --ranks: must be at least the 2 traced ranks (got 1): scaling makes "
                                       "more ranks from the traced ones; simulate the traced set as it is\n")
    assert not (tmp_path / "one").exists()
    # A scaled set stands for the ranks it was traced on: 8 scaled from 2 scale to 4, not to 1.
    eight = scale_run(gpt2_run, 8, output_dir=tmp_path / "eight")
    four = scale_run(eight.parent, 4, output_dir=tmp_path / "four")
    assert [metadata_of(Path(f"{four}.{r}.et"))["source_rank"] for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ScaleError, match="--ranks: must be at least the 2 traced ranks"):
        scale_run(eight.parent, 1, output_dir=tmp_path / "one")


# ---- disk ---------------------------------------------------------------------------------------------------------
def test_ranks_replaying_one_traced_rank_are_hard_links_to_one_file(gpt2_run, tmp_path):
    result = scale_set(gpt2_run, 1024, output_dir=tmp_path)
    stats = [os.stat(f"{result.prefix}.{r}.et") for r in range(1024)]
    assert {s.st_ino for s in stats[0::2]} == {stats[0].st_ino} and {s.st_ino for s in stats[1::2]} == {stats[1].st_ino}
    assert stats[0].st_ino != stats[1].st_ino and stats[0].st_nlink == stats[1].st_nlink == 512
    assert (len(result.written), result.links, result.copies) == (2, 1022, 0)
    source_bytes = sum((gpt2_run / f"{GPT2_2R}.{r}.et").stat().st_size for r in (0, 1))
    assert result.new_bytes < 1.1 * source_bytes + 65536  # 1024 ranks cost two files


def test_without_hard_links_every_rank_gets_a_copy(gpt2_run, tmp_path, monkeypatch):
    def refuse(src, dst):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(scale.os, "link", refuse)
    result = scale_set(gpt2_run, 4, output_dir=tmp_path)
    assert (result.links, result.copies) == (0, 2)
    assert len({os.stat(f"{result.prefix}.{r}.et").st_ino for r in range(4)}) == 4
    assert Path(f"{result.prefix}.2.et").read_bytes() == Path(f"{result.prefix}.0.et").read_bytes()


# ---- the simulator's view -----------------------------------------------------------------------------------------
def test_scaled_set_passes_the_validator_and_the_cross_rank_collective_check(gpt2_run, tmp_path):
    prefix = scale_run(gpt2_run, 8, output_dir=tmp_path, slow={5: 1.5})
    reports = {r: validate_et(f"{prefix}.{r}.et") for r in range(8)}
    assert all(report.ok for report in reports.values()), {r: rep.problems for r, rep in reports.items()}
    assert collectives_agree({r: report.collectives for r, report in reports.items()}) == []
    assert {len(report.collectives) for report in reports.values()} == {2}


def test_a_slow_rank_has_its_compute_scaled_in_a_file_of_its_own(gpt2_run, tmp_path):
    result = scale_set(gpt2_run, 8, output_dir=tmp_path, slow={3: 2.0})
    slow_path, peer_path = Path(f"{result.prefix}.3.et"), Path(f"{result.prefix}.1.et")  # both replay traced rank 1
    assert os.stat(slow_path).st_ino != os.stat(peer_path).st_ino
    assert os.stat(peer_path).st_ino == os.stat(f"{result.prefix}.7.et").st_ino
    _, slow_nodes = read_et_with_protolib(slow_path)
    _, peer_nodes = read_et_with_protolib(peer_path)
    for slow_node, node in zip(slow_nodes, peer_nodes, strict=True):
        expected = node.duration_micros * 2 if node.type == COMP_NODE else node.duration_micros
        assert (slow_node.id, slow_node.duration_micros) == (node.id, expected)
    assert metadata_of(slow_path)["compute_scale"] == 2.0 and "compute_scale" not in metadata_of(peer_path)
    slow_path_us = validate_et(slow_path).critical_path_us
    assert slow_path_us > 1.8 * validate_et(peer_path).critical_path_us
    assert "| 3 | 1 | x2 (--slow 3:2) | its own |" in (tmp_path / scale.SUMMARY_NAME).read_text()


def test_a_scaled_set_scales_again_keeping_the_traced_rank(gpt2_run, tmp_path):
    first = scale_run(gpt2_run, 4, output_dir=tmp_path / "four")
    result = scale_set(first.parent, 12, output_dir=tmp_path / "twelve")
    assert [metadata_of(Path(f"{result.prefix}.{r}.et"))["source_rank"] for r in range(12)] == [0, 1] * 6
    assert len(result.written) == 2  # the 4-rank set's hard links are read as the 2 files they are
    assert result.parallelism.startswith("a scaled set")


def test_a_scaled_set_that_the_traced_ranks_do_not_divide_scales_again_by_traced_rank(gpt2_run, tmp_path):
    three = scale_run(gpt2_run, 3, output_dir=tmp_path / "three")  # replays traced ranks 0, 1, 0
    result = scale_set(three.parent, 8, output_dir=tmp_path / "eight")
    # As if the traced run were scaled to 8 directly, not 0, 1, 0, 0, 1, 0, 0, 1 (rank r mod 3 of the 3-rank set).
    assert [metadata_of(Path(f"{result.prefix}.{r}.et"))["source_rank"] for r in range(8)] == [0, 1] * 4


def compute_scales(prefix: Path, ranks: int) -> dict[int, float]:
    return {r: meta["compute_scale"] for r in range(ranks)
            if "compute_scale" in (meta := metadata_of(Path(f"{prefix}.{r}.et")))}


def test_a_scaled_set_scaled_again_keeps_its_straggler_on_one_rank_and_says_so(gpt2_run, tmp_path, capsys):
    """6 ranks with --slow 3:1.5 scaled to 12 slowed ranks 3 and 9 (output rank r replayed rank r mod 6 of the
    6-rank set), said "from 6 traced" and listed traced ranks 2-5, rank 3 "as traced"."""
    assert scale_et.main([str(gpt2_run), "--ranks", "6", "--slow", "3:1.5", "--output-dir", str(tmp_path / "six")]) == 0
    capsys.readouterr()
    assert scale_et.main([str(tmp_path / "six"), "--ranks", "12", "--output-dir", str(tmp_path / "twelve")]) == 0
    out = capsys.readouterr().out
    prefix = tmp_path / "twelve" / f"{GPT2_2R}_6npus_12npus"
    assert compute_scales(prefix, 12) == {3: 1.5}
    assert [metadata_of(Path(f"{prefix}.{r}.et"))["source_rank"] for r in range(12)] == [0, 1] * 6
    assert {metadata_of(Path(f"{prefix}.{r}.et"))["traced_world_size"] for r in range(12)} == {2}
    assert os.stat(f"{prefix}.9.et").st_ino == os.stat(f"{prefix}.1.et").st_ino  # rank 9 replays rank 1 as traced
    assert out.startswith("wrote 12 ranks from 2 traced (through the 6-rank scaled set): 3 files, 9 hard links")
    assert "note: the scaled source's --slow 3:1.5 is kept: rank 3 is slowed again, and no other rank" in out
    summary = (tmp_path / "twelve" / scale.SUMMARY_NAME).read_text()
    assert "(a scaled set of 6 ranks, traced on 2) to 12 ranks" in summary
    rows = [line for line in summary.splitlines() if line.startswith("| ") and "replay" not in line]
    assert rows == ["| 0, 2, 4, ... (6 ranks: r mod 2 = 0) | 0 | as traced | shared (hard links) |",
                    "| 1, 3, 5, ... (6 ranks: r mod 2 = 1) | 1 | as traced | shared (hard links) |",
                    "| 3 | 1 | x1.5 (--slow 3:1.5) | its own |"]
    assert "`traced_world_size` 2" in summary and "- the scaled source's --slow 3:1.5 is kept" in summary


@pytest.mark.parametrize("flags, slowed, note", [
    ([], {3: 1.5}, "the scaled source's --slow 5:2 is dropped: there is no rank 5 among 4"),
    (["--slow", "3:1"], {}, "the scaled source's --slow 3:1.5 is replaced by this command's --slow 3:1"),
    (["--slow", "3:3"], {3: 3.0}, "the scaled source's --slow 3:1.5 is replaced by this command's --slow 3:3"),
])
def test_a_scaled_sets_stragglers_are_kept_dropped_or_replaced_explicitly(gpt2_run, tmp_path, capsys, flags, slowed,
                                                                         note):
    """4 ranks from the 6-rank set had kept its slowed rank 3 (and its rank 5's file, slowed, as no rank) and
    listed rank 3 as "as traced"."""
    six = scale_run(gpt2_run, 6, output_dir=tmp_path / "six", slow={3: 1.5, 5: 2.0})
    assert scale_et.main([str(six.parent), "--ranks", "4", "--output-dir", str(tmp_path / "four"), *flags]) == 0
    out = capsys.readouterr().out
    four = tmp_path / "four" / f"{GPT2_2R}_6npus_4npus"
    assert compute_scales(four, 4) == slowed
    assert [metadata_of(Path(f"{four}.{r}.et"))["source_rank"] for r in range(4)] == [0, 1, 0, 1]
    assert f"note: {note}" in out and f"- {note}" in (four.parent / scale.SUMMARY_NAME).read_text()
    assert "| 3 | 1 | as traced" not in (four.parent / scale.SUMMARY_NAME).read_text()
    # The command SCALE_SUMMARY.md gives to write the set again writes this set, not the source's stragglers.
    again = scale.scale_again_command(four.parent, scale.read_scale_status(four.parent))
    assert again.endswith("".join(f" --slow {r}:{f:g}" for r, f in (slowed or {3: 1}).items()))


def test_a_traced_rank_only_a_straggler_replays_is_scaled_back_to_its_traced_durations(gpt2_run, tmp_path):
    """2 ranks with --slow 1:3 scaled to 4 had slowed ranks 1 and 3: the set has no file of traced rank 1 as traced,
    so rank 3 copied the straggler's. It is the set scaled from the converted run with --slow 1:3, node for node."""
    two = scale_run(gpt2_run, 2, output_dir=tmp_path / "two", slow={1: 3.0})
    again = scale_set(two.parent, 4, output_dir=tmp_path / "again")
    direct = scale_run(gpt2_run, 4, output_dir=tmp_path / "direct", slow={1: 3.0})
    assert compute_scales(again.prefix, 4) == compute_scales(direct, 4) == {1: 3.0}
    for r in range(4):
        _, nodes = read_et_with_protolib(Path(f"{again.prefix}.{r}.et"))
        _, expected = read_et_with_protolib(Path(f"{direct}.{r}.et"))
        assert [(n.id, n.duration_micros) for n in nodes] == [(n.id, n.duration_micros) for n in expected], r


def test_summary_says_what_was_scaled_and_how_to_run_it(gpt2_run, tmp_path):
    result = scale_set(gpt2_run, 16, output_dir=tmp_path)
    summary = (tmp_path / "SCALE_SUMMARY.md").read_text()
    assert f"--workload-configuration={result.prefix}" in summary
    assert "0, 2, 4, ... (8 ranks: r mod 2 = 0)" in summary
    assert "our trainer's DDP run (world size 2, backend gloo)" in summary
    assert "2 distinct files written, 14 hard links" in summary


# ---- what is refused ----------------------------------------------------------------------------------------------
def test_megatron_tensor_parallel_set_is_refused(gpu_runs, tmp_path):
    with pytest.raises(NotDataParallelError, match="tensor-parallel"):
        scale_run(gpu_runs / "astra-sim_megatron_tp8_a100_8r", 16, output_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_dlrm_all_to_all_set_is_refused_in_one_line(gpu_runs, tmp_path, capsys):
    code = scale_et.main([str(gpu_runs / "param_dlrm_v100_8r"), "--ranks", "16", "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert err.startswith(f"error: {gpu_runs / 'param_dlrm_v100_8r'}: not data-parallel: 5 all-to-all")
    assert "--assume-data-parallel" in err and not list(tmp_path.iterdir())


def test_the_override_scales_a_refused_set_with_a_warning(gpu_runs, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="trace_tools.scale"):
        result = scale_set(gpu_runs / "astra-sim_megatron_tp8_a100_8r", 16, output_dir=tmp_path,
                           assume_data_parallel=True)
    assert "does not look data-parallel" in caplog.text and "tensor-parallel" in caplog.text
    assert [metadata_of(Path(f"{result.prefix}.{r}.et"))["source_rank"] for r in (0, 7, 8, 15)] == [0, 7, 0, 7]


def test_a_foreign_set_without_run_json_needs_the_override(bare_gpt2, tmp_path, caplog):
    with pytest.raises(NotDataParallelError, match="no run.json"):
        scale_run(bare_gpt2, 4, output_dir=tmp_path / "refused")
    with caplog.at_level(logging.WARNING, logger="trace_tools.scale"):
        scale_run(bare_gpt2, 4, output_dir=tmp_path / "assumed", assume_data_parallel=True)
    assert "no run.json: assuming" in caplog.text


def test_a_run_json_that_is_not_an_object_is_refused_in_one_line(bare_gpt2, tmp_path):
    """run.json holding JSON null had ended scale_et.py in an AttributeError traceback."""
    (bare_gpt2 / "run.json").write_text("null\n")
    with pytest.raises(NotDataParallelError) as error:
        scale_run(bare_gpt2, 4, output_dir=tmp_path / "refused")
    assert f"{bare_gpt2 / 'run.json'}: not a run description (JSON null, not an object)" in str(error.value)
    assert not (tmp_path / "refused").exists()


def test_run_json_is_found_through_the_conversion_summary(gpt2_run, tmp_path):
    converted = tmp_path / "converted"
    convert_runs(find_runs([gpt2_run]), output_dir=converted, jobs=1, progress=False)
    assert not (converted / "run.json").exists()
    result = scale_set(converted, 4, output_dir=tmp_path / "out")
    assert result.parallelism.startswith(str(gpt2_run / "run.json"))


def test_run_json_is_found_through_the_summary_from_another_working_directory(tmp_path, monkeypatch):
    """A trace folder given relative, converted into a folder elsewhere: scale_et.py run from a third folder still
    finds run.json through the summary's record of the trace folder."""
    traces = tmp_path / "traces" / GPT2_2R
    shutil.copytree(CPU_FIXTURES / GPT2_2R, traces)
    monkeypatch.chdir(tmp_path / "traces")
    assert convert_runs(find_runs([GPT2_2R]), output_dir="../converted", jobs=1, progress=False)[0].ok
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    result = scale_set(Path("../converted"), 4, output_dir=tmp_path / "out")
    assert result.parallelism.startswith(str(traces / "run.json"))


TIMED = "gpt2_2x128_2r_buckets"  # its run.json and device traces carry the run id


def retraced(tmp_path: Path, converted_run: dict | None, new_run: dict) -> tuple[Path, Path, Path]:
    """TIMED (its run.json updated with converted_run) converted into a folder of its own, then traced again under
    the same name: the run's files move to .previous/<name>/, as the tracer moves them, and the new run's run.json
    (another run id) is its own updated with new_run. Returns the converted folder, the trace folder and
    .previous/<name>/."""
    traces = tmp_path / "traces" / TIMED
    shutil.copytree(CPU_FIXTURES / TIMED, traces)
    info = json.loads((traces / "run.json").read_text())
    if converted_run:
        (traces / "run.json").write_text(json.dumps({**info, **converted_run}))
    converted = tmp_path / "converted"
    assert convert_runs(find_runs([traces]), output_dir=converted, jobs=1, progress=False)[0].ok
    previous = tmp_path / "traces" / ".previous" / TIMED
    previous.parent.mkdir()
    traces.rename(previous)
    traces.mkdir()
    (traces / "run.json").write_text(json.dumps({**info, "run_id": "20261124T090000Z-0123456789ab", **new_run}))
    return converted, traces, previous


def test_after_a_retrace_the_parallelism_is_the_converted_runs_not_the_new_runs(tmp_path):
    """A tensor-parallel run converted, then a data-parallel one traced under its name: the .et files are still
    the tensor-parallel run's, which its run.json in .previous/ says."""
    converted, traces, previous = retraced(tmp_path, {"parallelism": {"data_parallel": 1, "tensor_parallel": 2}},
                                           {"parallelism": {"data_parallel": 2, "tensor_parallel": 1}})
    with pytest.raises(NotDataParallelError) as error:
        scale_set(converted, 4, output_dir=tmp_path / "out")
    assert f"not data-parallel: {previous / 'run.json'}: parallelism" in str(error.value)
    assert '"tensor_parallel": 2' in str(error.value)


def test_after_a_retrace_another_runs_run_json_is_passed_over_and_named(tmp_path):
    converted, traces, previous = retraced(tmp_path, None, {"parallelism": "tensor"})
    result = scale_set(converted, 4, output_dir=tmp_path / "out")
    assert result.parallelism.startswith(f"{previous / 'run.json'}: our trainer's DDP run")
    shutil.rmtree(previous)
    with pytest.raises(NotDataParallelError) as error:
        scale_set(converted, 4, output_dir=tmp_path / "refused")
    run_id = json.loads((CPU_FIXTURES / TIMED / "run.json").read_text())["run_id"]
    assert str(error.value) == (f"{converted}: no run.json of the run the .et files were made from says it is "
                                f"data-parallel; passed over {traces / 'run.json'}: another run's (run_id "
                                f"20261124T090000Z-0123456789ab; the .et files in {converted} were made from run "
                                f"{run_id}); if it is, --assume-data-parallel scales it anyway")


def _rewritten(source: Path, folder: Path, change) -> Path:
    """A copy of the 2-rank set with change(nodes) applied to each rank's nodes."""
    folder.mkdir()
    (folder / "run.json").write_bytes((source / "run.json").read_bytes())
    for r in (0, 1):
        metadata, nodes = read_et_with_protolib(source / f"{GPT2_2R}.{r}.et")
        change(nodes)
        write_et(folder / f"{GPT2_2R}.{r}.et", metadata, nodes)
    return folder


def test_collectives_in_two_process_groups_are_refused(gpt2_run, tmp_path):
    def second_group(nodes):
        for attr in collective_nodes_of(nodes)[1].attr:
            if attr.name == "pg_name":
                attr.string_val = "1"
    with pytest.raises(NotDataParallelError, match=r"2 process groups \(0, 1\)"):
        scale_run(_rewritten(gpt2_run, tmp_path / "groups", second_group), 4, output_dir=tmp_path / "out")


def test_send_and_recv_are_refused(gpt2_run, tmp_path):
    def as_send(nodes):
        collective_nodes_of(nodes)[1].type = COMM_SEND_NODE
    with pytest.raises(NotDataParallelError, match="1 send/recv nodes per rank"):
        scale_run(_rewritten(gpt2_run, tmp_path / "p2p", as_send), 4, output_dir=tmp_path / "out")


def test_an_all_reduce_inside_the_forward_is_refused_as_tensor_parallel(gpt2_run, tmp_path):
    def early(nodes):
        collective_nodes_of(nodes)[0].start_time_micros = min(n.start_time_micros for n in nodes)
    with pytest.raises(NotDataParallelError, match="1 of 2 all-reduces .* inside the forward"):
        scale_run(_rewritten(gpt2_run, tmp_path / "tp", early), 4, output_dir=tmp_path / "out")


def collective_nodes_of(nodes: list[Node]) -> list[Node]:
    return sorted((n for n in nodes if n.type == COMM_COLL_NODE), key=lambda n: n.start_time_micros)


# ---- bad input and failures ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["{tmp}/missing", "--ranks", "4"], "{tmp}/missing: no such folder"),
    (["{tmp}", "--ranks", "4"], "{tmp}: no <name>.<rank>.et files; convert the traces first"),
    (["{run}", "--ranks", "0"], "--ranks: must be at least 1 (got 0)"),
    (["{run}", "--ranks", "4", "--slow", "4:2"], "--slow: rank 4 is not one of the 4 output ranks (0-3)"),
    (["{run}", "--ranks", "4", "--slow", "1:fast"], "--slow 1:fast: expected RANK:FACTOR"),
    (["{run}", "--ranks", "4", "--slow", "1:0"], "--slow: factor 0.0 of rank 1 must be a positive number"),
    # A step past what ASTRA-sim's clock counts (2^53 ns): 1e300 was a traceback, 1e12 a set written with exit 0
    (["{run}", "--ranks", "4", "--slow", "1:1e300"], "--slow 1:1e+300: makes rank 1's step"),
    (["{run}", "--ranks", "4", "--slow", "1:1e12"], "--slow 1:1e+12: makes rank 1's step"),
    (["{run}", "--ranks", "4", "--output-dir", "{run}", "--name", GPT2_2R],
     "--output-dir: {run} is the run folder itself; a scaled set goes in a folder of its own"),
    # Another name would put a second set beside the converted one: simulate.py could no longer tell them apart.
    (["{run}", "--ranks", "4", "--output-dir", "{run}"],
     "--output-dir: {run} is the run folder itself; a scaled set goes in a folder of its own"),
])
def test_bad_input_is_one_error_line(gpt2_run, tmp_path, capsys, argv, message):
    code = scale_et.main([a.format(tmp=tmp_path, run=gpt2_run) for a in argv])
    err = capsys.readouterr().err
    assert code in (1, 2) and err.count("\n") == 1
    assert err.startswith("error: " + message.format(tmp=tmp_path, run=gpt2_run)), err


def test_a_set_missing_its_top_rank_is_refused_as_simulate_py_refuses_it(gpt2_run, tmp_path):
    """Rank 1 of 2 gone: the set was scaled from rank 0 alone, its prediction 184.8 ms against 246.5 ms from the
    whole run (the slower rank dropped), and its summary called it a 1-rank trace."""
    shutil.copy(gpt2_run / f"{GPT2_2R}.0.et", tmp_path)
    with pytest.raises(ScaleError, match=rf"{GPT2_2R}\.0\.et: recorded in a world of 2 ranks, but the set has 1 \.et "
                                         rf"files \({GPT2_2R}\.0\.et to {GPT2_2R}\.0\.et\); scale a complete set"):
        scale_set(tmp_path, 4, output_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_more_ranks_than_memory_holds_is_one_line(gpt2_run, tmp_path, capsys):
    """--ranks 1000000000 under an address-space limit (3 GB, 1 GB here) had been a MemoryError traceback."""
    done = subprocess.run([sys.executable, "-c", "import resource, sys, scale_et\n"
                           "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
                           "sys.exit(scale_et.main(sys.argv[1:]))", str(gpt2_run), "--ranks", "1000000000",
                           "--output-dir", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr == ("error: --ranks: 1,000,000,000 ranks need more memory than this process may use, for "
                           "their list alone (and a file name each); give fewer\n")


def test_a_folder_holding_another_run_is_not_written_into(gpt2_run, tmp_path, capsys):
    """--name bert_tiny_2r beside a converted bert_tiny_2r replaced its .et files with scaled GPT-2 ones, under its
    CONVERSION_SUMMARY.md; a folder of traces, or .et files scale_et.py did not write, are another run's too."""
    runs = tmp_path / "runs"
    shutil.copytree(gpt2_run, runs / GPT2_2R)
    other = runs / "bert_tiny_2r"
    shutil.copytree(gpt2_run, other)
    before = {path.name: path.read_bytes() for path in other.iterdir() if path.is_file()}
    assert scale_et.main([str(runs / GPT2_2R), "--ranks", "4", "--name", "bert_tiny_2r"]) == 2
    assert capsys.readouterr().err == (f"error: --name: {other} holds a traced or converted run "
                                       "(CONVERSION_SUMMARY.md); a scaled set goes in a folder of its own (give "
                                       "another --name)\n")
    assert scale_et.main([str(runs / GPT2_2R), "--ranks", "4", "--output-dir", str(other), "--name", GPT2_2R]) == 2
    assert f"error: --output-dir: {other} holds a traced or converted run" in capsys.readouterr().err
    assert {path.name: path.read_bytes() for path in other.iterdir() if path.is_file()} == before

    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "host.0.json").write_text("{}")
    assert scale_et.main([str(runs / GPT2_2R), "--ranks", "4", "--output-dir", str(traces)]) == 2
    assert f"error: --output-dir: {traces} holds a traced or converted run (host.0.json)" in capsys.readouterr().err

    mine = tmp_path / "mine"
    mine.mkdir()
    for rank in (0, 1):
        shutil.copy(gpt2_run / f"{GPT2_2R}.{rank}.et", mine / f"set.{rank}.et")
    assert scale_et.main([str(runs / GPT2_2R), "--ranks", "4", "--output-dir", str(mine), "--name", "set"]) == 2
    assert (f"error: --output-dir: {mine} already holds the .et set set, which scale_et.py did not write there"
            in capsys.readouterr().err)
    # a set scale_et.py wrote is written again in place
    assert scale_et.main([str(runs / GPT2_2R), "--ranks", "4", "--output-dir", str(tmp_path / "again")]) == 0
    assert scale_et.main([str(runs / GPT2_2R), "--ranks", "4", "--output-dir", str(tmp_path / "again")]) == 0


def test_a_name_that_makes_the_default_folder_the_run_folder_blames_the_name(gpt2_run, tmp_path, capsys):
    runs = tmp_path / "runs"
    shutil.copytree(gpt2_run, runs / GPT2_2R)
    assert scale_et.main([str(runs / GPT2_2R), "--ranks", "4", "--name", GPT2_2R]) == 2
    assert capsys.readouterr().err == (f"error: --name: {GPT2_2R}: the folder it names beside the run, "
                                       f"{runs / GPT2_2R}, is the run folder itself; give another --name, or an "
                                       "--output-dir\n")


def test_the_run_folder_given_as_dot_gets_its_set_beside_it(gpt2_run, tmp_path, monkeypatch, capsys):
    """`scale_et.py .` from inside the run wrote the set inside the run folder, where no tool looks for it."""
    runs = tmp_path / "runs"
    shutil.copytree(gpt2_run, runs / GPT2_2R)
    monkeypatch.chdir(runs / GPT2_2R)
    assert scale_et.main([".", "--ranks", "4"]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in (runs / f"{GPT2_2R}_4npus").glob("*.et")) == [f"{GPT2_2R}_4npus.{r}.et"
                                                                                 for r in range(4)]
    assert not (runs / GPT2_2R / f"{GPT2_2R}_4npus").exists()


def test_a_refused_scale_leaves_no_folder_it_made_and_a_killed_ones_staging_is_cleared(gpt2_run, tmp_path, capsys):
    """--slow 1:1e300 is refused only once the set is being written: the output folder it had made stayed behind,
    empty. And a scale_et.py killed outright left its staging folder (362,842 files of a 3,000,000-rank set killed
    after 4 s), which no later run removed."""
    out = tmp_path / "new" / "scaled"
    assert scale_et.main([str(gpt2_run), "--ranks", "4", "--slow", "1:1e300", "--output-dir", str(out)]) in (1, 2)
    assert "makes rank 1's step" in capsys.readouterr().err
    assert not out.parent.exists()
    out.mkdir(parents=True)
    dead = out / ".run.scaling-k1ll3d"  # what a killed run leaves
    (dead / "deep").mkdir(parents=True)
    (dead / "deep" / "run.5.et").write_bytes(b"partial")
    scale_run(gpt2_run, 4, output_dir=out, name="run")
    assert sorted(p.name for p in out.iterdir()) == ["SCALE_SUMMARY.md", *(f"run.{r}.et" for r in range(4))]


def test_no_space_on_a_disk_with_space_names_the_folders_entry_limit(gpt2_run, tmp_path, monkeypatch, capsys):
    """--ranks 100000000 ended in 'No space left on device' with 76 GB and 97% of the inodes free: the limit met was
    one folder's entries. The error says so when the disk has room."""
    disk = os.statvfs(tmp_path)
    if disk.f_bavail * disk.f_frsize < 2 << 30:
        pytest.skip("the disk under the test's folder is nearly full itself")

    def folder_full(existing, new):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(new))
    monkeypatch.setattr(scale, "link_or_copy", folder_full)
    assert scale_et.main([str(gpt2_run), "--ranks", "8", "--output-dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "(No space left on device, with " in err and "the file system's limit on one folder's entries, which " \
        "8 files reach; give fewer --ranks); nothing was changed" in err
    assert not (tmp_path / "out").exists()


def test_a_missing_rank_is_named(gpt2_run, tmp_path):
    shutil.copy(gpt2_run / f"{GPT2_2R}.1.et", tmp_path)
    with pytest.raises(ScaleError, match=rf"{GPT2_2R}\.0\.et: missing"):
        scale_run(tmp_path, 4)


def test_a_failure_leaves_no_partial_set_and_keeps_the_previous_one(gpt2_run, tmp_path, monkeypatch):
    previous = scale_run(gpt2_run, 4, output_dir=tmp_path, name="run")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def failing_link(existing, new):
        if new.name.endswith(".5.et"):
            raise RuntimeError("disk full")
        return os.link(existing, new) or True
    monkeypatch.setattr(scale, "link_or_copy", failing_link)
    with pytest.raises(RuntimeError):
        scale_run(gpt2_run, 8, output_dir=tmp_path, name="run")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no staging folder, no rank 4-7
    assert previous == tmp_path / "run"


def test_a_source_et_cut_short_since_its_conversion_is_refused(gpt2_run, tmp_path):
    source = tmp_path / GPT2_2R
    shutil.copytree(gpt2_run, source, ignore=shutil.ignore_patterns("*.json.gz"))
    rank0 = source / f"{GPT2_2R}.0.et"
    blobs = list(iter_et_messages(rank0))
    with open(rank0, "wb") as f:  # cut at a node boundary after the collectives: it still decodes and validates
        for blob in blobs[:-3]:
            encodeMessage(f, SerializedMessage(blob))
    assert validate_et(rank0).ok
    code = scale_et.main([str(source), "--ranks", "4", "--output-dir", str(tmp_path / "out")])
    assert code == 1 and not (tmp_path / "out").exists()
    with pytest.raises(ScaleError, match=rf"{GPT2_2R}\.0\.et: not the file .*CONVERSION_SUMMARY.md recorded"):
        scale_run(source, 4, output_dir=tmp_path / "out")


def test_a_second_scale_into_a_folder_being_written_is_refused(gpt2_run, tmp_path):
    fcntl = pytest.importorskip("fcntl")
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a scale_et.py still writing there holds it
        with pytest.raises(ScaleError, match="another scale_et.py is writing into this folder now"):
            scale_run(gpt2_run, 4, output_dir=tmp_path, name="run")
    finally:
        os.close(fd)
    assert list(tmp_path.iterdir()) == []
    assert scale_run(gpt2_run, 4, output_dir=tmp_path, name="run") == tmp_path / "run"


def test_a_write_that_fails_is_one_error_line_and_keeps_the_previous_set(gpt2_run, tmp_path, monkeypatch, capsys):
    scale_run(gpt2_run, 4, output_dir=tmp_path, name="run")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def disk_full(existing, new):
        raise OSError(28, "No space left on device", str(new))
    monkeypatch.setattr(scale, "link_or_copy", disk_full)
    code = scale_et.main([str(gpt2_run), "--ranks", "8", "--output-dir", str(tmp_path), "--name", "run"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "No space left on device" in err and "nothing was changed" in err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_sigterm_while_scaling_leaves_nothing_half_written(gpt2_run, tmp_path, monkeypatch, capsys):
    write = scale.write_scaled_et

    def killed_midway(source, out_path, **kwargs):
        write(source, out_path, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # a job scheduler's time limit, after the first file
    monkeypatch.setattr(scale, "write_scaled_et", killed_midway)

    def unhandled(signum, frame):
        raise AssertionError("SIGTERM reached the test: scale_et.py did not handle it")
    previous = signal.signal(signal.SIGTERM, unhandled)  # without this, a SIGTERM scale_et.py ignores ends pytest
    try:
        code = scale_et.main([str(gpt2_run), "--ranks", "4", "--output-dir", str(tmp_path / "out")])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 128 + signal.SIGTERM
    assert capsys.readouterr().err.startswith("interrupted: scale_et.py stopped by SIGTERM; no partial set is left")
    assert not (tmp_path / "out").exists()  # no staging folder, no rank, no summary, not the folder it made


def test_sigterm_while_the_set_is_renamed_into_place_says_the_set_was_written(gpt2_run, tmp_path, monkeypatch,
                                                                              capsys):
    """The renames wait for each other, and a SIGTERM among them is handled after the last: the line had said "no
    partial set is left" of a whole new set, and printed none of its lines."""
    replace = os.replace

    def killed_while_publishing(source, target):
        if str(target).endswith(".0.et") and Path(target).parent == tmp_path / "out":
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)  # held back until the set is in place
        replace(source, target)
    monkeypatch.setattr(scale.os, "replace", killed_while_publishing)

    def unhandled(signum, frame):
        raise AssertionError("SIGTERM reached the test: scale_et.py did not handle it")
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        code = scale_et.main([str(gpt2_run), "--ranks", "4", "--output-dir", str(tmp_path / "out")])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 128 + signal.SIGTERM
    assert capsys.readouterr().err == (f"interrupted: scale_et.py stopped by SIGTERM once the set was written: "
                                       f"{tmp_path / 'out' / GPT2_2R}_4npus\n")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == \
        sorted([f"{GPT2_2R}_4npus.{r}.et" for r in range(4)] + ["SCALE_SUMMARY.md"])
    assert scale.unscaled_et_file(tmp_path / "out", f"{GPT2_2R}_4npus", range(4)) is None


def test_a_smaller_set_replaces_a_larger_one_of_the_same_name(gpt2_run, tmp_path):
    scale_run(gpt2_run, 8, output_dir=tmp_path, name="run")
    scale_run(gpt2_run, 4, output_dir=tmp_path, name="run")
    assert sorted(p.name for p in tmp_path.glob("*.et")) == [f"run.{r}.et" for r in range(4)]


def test_a_set_of_another_name_is_refused_in_a_folder_holding_a_scaled_set(gpt2_run, tmp_path, capsys):
    scale_run(gpt2_run, 8, output_dir=tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    # --ranks 16 is another set (gpt2_tiny_2r_16npus): beside the 8-rank one it would take its SCALE_SUMMARY.md
    code = scale_et.main([str(gpt2_run), "--ranks", "16", "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: --output-dir: {tmp_path} already holds the scaled set {GPT2_2R}_8npus; a scaled "
                          "set goes in a folder of its own"), err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_the_summary_records_the_size_and_sha256_of_every_ranks_file(gpt2_run, tmp_path):
    result = scale_set(gpt2_run, 8, output_dir=tmp_path, slow={3: 2.0})
    status = scale.read_scale_status(tmp_path)
    files = {tuple(f["ranks"]): f for f in status["files"]}
    assert sorted(files) == [(0, 2, 4, 6), (1, 5, 7), (3,)]  # rank 3, the straggler, has a file of its own
    for ranks, fingerprint in files.items():
        data = Path(f"{result.prefix}.{ranks[0]}.et").read_bytes()
        assert (fingerprint["size"], fingerprint["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())


@pytest.mark.parametrize("change, says", [
    ("cut", "{prefix}.2.et: not the file {summary} recorded for rank 2 (re-written by hand or by another scale run, "
            "or cut short, since scale_et.py wrote it)"),
    ("top rank gone", "{prefix}.3.et: missing, though {summary} records it written"),
])
def test_a_scaled_set_changed_since_it_was_written_is_refused_as_a_source(gpt2_run, tmp_path, change, says):
    four = scale_run(gpt2_run, 4, output_dir=tmp_path / "four")
    rank = Path(f"{four}.{2 if change == 'cut' else 3}.et")
    if change == "cut":  # at a node boundary, in a file of its own (not through rank 0's hard link): still decodes
        blobs = list(iter_et_messages(rank))
        rank.unlink()
        with open(rank, "wb") as f:
            for blob in blobs[:-3]:
                encodeMessage(f, SerializedMessage(blob))
        assert validate_et(rank).ok
    else:
        rank.unlink()
    with pytest.raises(ScaleError) as error:
        scale_run(four.parent, 8, output_dir=tmp_path / "eight")
    assert says.format(prefix=four, summary=four.parent / scale.SUMMARY_NAME) in str(error.value), str(error.value)
    assert f"scale_et.py {gpt2_run / GPT2_2R} --ranks 4 --output-dir {four.parent}" in str(error.value)
    assert not (tmp_path / "eight").exists()


def test_the_command_that_writes_a_changed_set_again_runs_as_printed_from_any_folder(gpt2_run, tmp_path,
                                                                                     monkeypatch):
    """It had been `scale_et.py <source as typed> ...`: `command not found`, and a relative source named from
    where the set had been scaled."""
    runs = tmp_path / "runs"
    shutil.copytree(gpt2_run, runs / GPT2_2R)
    monkeypatch.chdir(runs)
    four = scale_run(Path(GPT2_2R), 4, output_dir=Path("four"))
    Path(f"{four}.3.et").unlink()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ScaleError) as error:
        scale_run(runs / "four", 8, output_dir=tmp_path / "eight")
    command = str(error.value).split(" records it written (", 1)[1].removesuffix(" writes the set again)")
    done = subprocess.run(command, shell=True, cwd="/", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (command, done.stderr)
    assert sorted(p.name for p in (runs / "four").glob("*.et")) == [f"{GPT2_2R}_4npus.{r}.et" for r in range(4)]


def test_the_default_output_is_a_folder_beside_the_run(gpt2_run, tmp_path):
    source = tmp_path / GPT2_2R
    shutil.copytree(gpt2_run, source, ignore=shutil.ignore_patterns("*.json.gz"))
    prefix = scale_run(source, 8)
    assert prefix == tmp_path / f"{GPT2_2R}_8npus" / f"{GPT2_2R}_8npus"


def test_a_run_beside_no_writable_folder_scales_into_converted_named_by_an_absolute_path(gpt2_run, tmp_path,
                                                                                         monkeypatch, capsys):
    """The fallback was recorded as converted/<name>, which holds only in the folder scale_et.py ran in."""
    source = tmp_path / "ro" / GPT2_2R
    shutil.copytree(gpt2_run, source, ignore=shutil.ignore_patterns("*.json.gz"))
    source.parent.chmod(0o555)
    monkeypatch.chdir(tmp_path)
    try:
        assert scale_et.main([str(source), "--ranks", "4"]) == 0
    finally:
        source.parent.chmod(0o755)
    prefix = tmp_path / "converted" / f"{GPT2_2R}_4npus" / f"{GPT2_2R}_4npus"
    assert f"ASTRA-sim: --workload-configuration={prefix}\n" in capsys.readouterr().out
    assert f"--workload-configuration={prefix}`" in (prefix.parent / scale.SUMMARY_NAME).read_text()


def test_a_run_named_with_spaces_and_other_letters_scales_under_a_default_name_astra_sim_takes(tmp_path):
    source = tmp_path / "my runs" / "rün 1"
    shutil.copytree(CPU_FIXTURES / GPT2_2R, source)
    assert convert_runs(find_runs([source]), jobs=1, progress=False)[0].ok
    prefix = scale_run(source, 4)
    assert prefix == tmp_path / "my runs" / "r_n_1_4npus" / "r_n_1_4npus"
    assert [validate_et(prefix.parent / f"r_n_1_4npus.{r}.et").ok for r in range(4)] == [True] * 4
    with pytest.raises(ScaleError, match="--name"):  # a name given is taken as it is, or refused
        scale_run(source, 4, name="rün 1")


def test_scale_et_runs_on_the_conversion_side_without_torch(gpt2_run, tmp_path):
    code = ("import sys, runpy; sys.argv = ['scale_et.py', *sys.argv[1:]]; "
            "sys.modules['torch'] = None; runpy.run_path('scale_et.py', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", code, str(gpt2_run), "--ranks", "32", "--output-dir", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "wrote 32 ranks from 2 traced: 2 files, 30 hard links" in result.stdout
    assert f"--workload-configuration={tmp_path / f'{GPT2_2R}_32npus'}" in result.stdout


@pytest.mark.parametrize("flags, ranks", [([], [8, 64]), (["--ranks", "4", "16"], [4, 16])])
def test_the_benchmark_measures_time_and_disk_per_rank_count(flags, ranks):
    """--quick's rank counts are 8 and 64 unless --ranks is given (--quick had overridden it)."""
    result = subprocess.run([sys.executable, "bench/scale_bench.py", "--quick", *flags], cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("|") and line.split("|")[1].strip().isdigit()]
    assert [int(row.split("|")[1]) for row in rows] == ranks
    assert all(float(row.split("|")[4]) < 10 for row in rows)  # new disk (MB): two files, whatever N


# ---- ASTRA-sim itself (where it is built: $ASTRA_SIM) ---------------------------------------------------------------
def simulated_steps_ns(binary: Path, prefix: Path, npus: int, work: Path) -> dict[int, int]:
    """{rank: simulated ns} of every rank that finished, from ASTRA-sim's `sys[r] finished, N cycles` lines."""
    from bench.scale_bench import FINISHED, MEMORY_JSON, NETWORK_YML, SYSTEM_JSON
    work.mkdir()
    (work / "system.json").write_text(SYSTEM_JSON)
    (work / "memory.json").write_text(MEMORY_JSON)
    (work / "network.yml").write_text(NETWORK_YML.format(npus=npus, bandwidth=50.0, latency=500.0))
    result = subprocess.run([str(binary), f"--workload-configuration={prefix}",
                             f"--system-configuration={work / 'system.json'}",
                             f"--network-configuration={work / 'network.yml'}",
                             f"--remote-memory-configuration={work / 'memory.json'}"],
                            cwd=work, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return {int(r): int(c) for r, c in FINISHED.findall(result.stdout + result.stderr)}


def test_astra_sim_runs_every_rank_of_a_scaled_set_and_feels_the_straggler(astra_sim, gpt2_run, tmp_path):
    even = simulated_steps_ns(astra_sim, scale_run(gpt2_run, 8, output_dir=tmp_path / "even"), 8, tmp_path / "a")
    slowed = simulated_steps_ns(astra_sim, scale_run(gpt2_run, 8, output_dir=tmp_path / "slow", slow={3: 2.0}), 8,
                                tmp_path / "b")
    assert sorted(even) == sorted(slowed) == list(range(8))
    # The gradient all-reduce waits for the slow rank: every rank's step grows by about its compute before it.
    assert min(slowed.values()) > max(even.values()) * 1.3


def test_communication_cpu_nodes_grow_with_the_bytes_a_rank_moves_in_the_larger_ring(gpt2_run, tmp_path):
    """A collective's CPU node (trace_tools.core_sharing) at 8 ranks: each rank moves 7/8 of the buffer each way
    against 1/2 at 2, so 1.75x the time; the other compute nodes keep theirs, and so does the wait for a core
    before the CPU node (a start-up, whatever the bytes)."""
    def with_communication_cpu(nodes: list[Node]) -> None:
        collective = next(n for n in nodes if n.type == COMM_COLL_NODE)
        wait = Node(id=max(n.id for n in nodes) + 2, name="gloo:all_reduce (communication threads' wait for a core)",
                    type=COMP_NODE, duration_micros=2500, data_deps=list(collective.data_deps))
        wait.attr.add(name="communication_wait_of", int64_val=collective.id)
        wait.attr.add(name="is_cpu_op", bool_val=False)
        node = Node(id=max(n.id for n in nodes) + 1, name="gloo:all_reduce (communication threads' CPU work)",
                    type=COMP_NODE, duration_micros=4000, data_deps=[wait.id])
        node.attr.add(name="communication_cpu_of", int64_val=collective.id)
        node.attr.add(name="is_cpu_op", bool_val=True)
        nodes.extend([node, wait])

    source = _rewritten(gpt2_run, tmp_path / "src", with_communication_cpu)
    prefix = scale_run(source, 8, output_dir=tmp_path / "out")
    for r in (0, 5):
        _, nodes = read_et_with_protolib(Path(f"{prefix}.{r}.et"))
        _, traced = read_et_with_protolib(source / f"{GPT2_2R}.{r % 2}.et")
        durations = {n.id: n.duration_micros for n in nodes}
        cpu_work = [n for n in traced if attr_value(n, "communication_cpu_of") is not None]
        assert len(cpu_work) == 1 and durations[cpu_work[0].id] == 7000
        assert all(durations[n.id] == n.duration_micros for n in traced if n is not cpu_work[0])
        assert [durations[n.id] for n in traced if attr_value(n, "communication_wait_of") is not None] == [2500]


def test_a_run_a_conversion_is_writing_into_is_named_as_such(gpt2_run, tmp_path):
    """scale_et.py said "summary says rank 2 was not converted (interrupted...)" of a conversion still running."""
    from trace_tools import pipeline
    with pipeline.only_conversion_in(gpt2_run):
        with pytest.raises(ScaleError, match=f"^{gpt2_run}: a conversion is writing into this folder now; scale the "
                                             "run once it has ended$"):
            scale_run(gpt2_run, 4, output_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()
