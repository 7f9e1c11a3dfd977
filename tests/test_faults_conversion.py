"""Faults on the conversion side: ranks of different runs, stale .et files, the tracer's replaced runs, outputs
that cannot be written, Ctrl-C, and traces broken in ways that used to give a traceback or the wrong message.

Each case of tests/faults/conversion_corpus.py is one test here; the tests below it check what a corpus case
cannot see from the outside (the summary written rank by rank, the run id of the tracer, the flags of a repair).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conversion_helpers import CPU_FIXTURES, read_json
from faults import conversion_corpus as corpus
from trace_tools import cli, pipeline
from trace_tools.identity import one_run_problems
from trace_tools.repair import diagnose_host_trace, repair_host_trace
from trace_tools.summary import read_previous_results
from trace_tools.validate import collectives_agree, read_et

REPO = Path(__file__).resolve().parent.parent
BERT = CPU_FIXTURES / "bert_tiny_2r"
GPT2 = CPU_FIXTURES / "gpt2_tiny_1r"
GPT2_2R = CPU_FIXTURES / "gpt2_tiny_2r"


def convert(folder: Path, capsys, *extra: str, remaining: bool = False) -> tuple[int, str]:
    code = cli.main([str(folder), "--no-progress", *extra], remaining=remaining)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error: ")]


def metadata(path: Path) -> dict:
    meta, _ = read_et(path)
    return {a.name: getattr(a, a.WhichOneof("value")) for a in meta.attr if a.WhichOneof("value")}


# ---- the corpus: every case ends in a clear message or a correct result -----------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("case", list(corpus.CASES))
def test_fault_case_gets_a_clear_message_or_a_correct_result(case):
    [result] = corpus.run_cases([case])
    assert result["outcome"] == "clear", result["message"]


# ---- ranks of different runs ------------------------------------------------------------------------------------
def test_a_rank_without_collectives_is_compared_with_the_others():
    one = [("0", "ALL_REDUCE", 1024)]
    assert collectives_agree({0: [], 1: one}) == ["process group '0': rank 1 has 1 collectives, rank 0 has 0"]
    assert collectives_agree({0: one, 1: []}) == ["process group '0': rank 1 has 0 collectives, rank 0 has 1"]


def test_a_refused_run_has_no_duration_estimate_printed(tmp_path, capsys):
    """Rank 0 of another 2-rank run among this run's files: both ranks are refused and no .et is kept, so no line
    says what their .et durations estimate (it had, from run.json's times of ranks that have no .et)."""
    folder = corpus.copy_run(corpus.GPT2_BUCKETS, tmp_path / "mixed")
    shutil.copyfile(corpus.GPT2_BUCKETS / "run.json", folder / "run.json")
    corpus.place_rank(GPT2_2R, 0, folder, 0)
    code, output = convert(folder, capsys)
    assert code == 1 and "no .et kept" in "\n".join(errors(output))
    assert not list(folder.glob("*.et"))
    assert "the .et durations estimate" not in output


def test_traces_without_run_json_are_converted_with_a_warning_that_the_profiler_cost_stays(tmp_path, capsys):
    """No run.json beside the traces: the .et keeps the profiler's cost (2.7x the step of the same traces with
    their run.json, measured) and simulate.py has nothing to compare with. That was said only deep in the
    summary; the terminal now says it, once for the run."""
    folder = corpus.copy_run(GPT2_2R, tmp_path / "norun")
    code, output = convert(folder, capsys)
    assert code == 0
    [line] = [line for line in output.splitlines() if "no run.json beside the traces" in line]
    assert line.startswith(f"warning: norun: no run.json beside the traces in {folder} ")
    assert "every .et keeps the profiler's cost" in line
    shutil.copyfile(GPT2_2R / "run.json", folder / "run.json")
    assert "no run.json beside" not in convert(folder, capsys)[1]


def test_report_without_matplotlib_is_refused_before_converting(tmp_path, capsys, monkeypatch):
    """pip install .[convert] and a plain chakra-venv have no matplotlib: --report converted every rank, then ended
    in a ModuleNotFoundError traceback. It is now one line, before anything is written."""
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    folder = corpus.copy_run(GPT2_2R, tmp_path / "run")
    code, output = convert(folder, capsys, "--report")
    assert code == 2
    assert errors(output) == [line for line in output.splitlines() if line]
    [line] = errors(output)
    assert line.startswith("error: --report: ") and "has no matplotlib" in line and "-- --report" in line
    assert not list(folder.glob("*.et")) and not (folder / "CONVERSION_SUMMARY.md").exists()


def test_an_empty_run_json_is_named_as_such_not_blamed_on_the_trace_window(tmp_path, capsys):
    folder = corpus.copy_run(GPT2_2R, tmp_path / "emptyrun")
    (folder / "run.json").write_text("{}")
    code, output = convert(folder, capsys)
    assert code == 0
    [line] = [line for line in output.splitlines() if "run.json records no rank's step times" in line]
    assert line.startswith(f"warning: emptyrun: {folder / 'run.json'} records no rank's step times (an empty object)")
    assert "--trace-wait-steps" not in output


def test_a_group_is_compared_only_between_its_members():
    tp = [("1", "ALL_REDUCE", 64)]
    assert collectives_agree({0: tp, 1: tp, 2: [], 3: []}, members={"1": [0, 1]}) == []
    assert collectives_agree({0: tp, 1: [], 2: [], 3: []}, members={"1": [0, 1]}) != []


def test_one_rank_run_beside_a_two_rank_run_is_refused_and_keeps_no_et(tmp_path, capsys):
    folder = tmp_path / "mix"
    corpus.place_rank(GPT2, 0, folder, 0)
    corpus.place_rank(GPT2_2R, 1, folder, 1)
    code, output = convert(folder, capsys)
    assert code == 1
    assert f"error: {folder}: rank 1 was traced in a world of 2 ranks but rank 0 in a world of 1: the files come " \
           "from different runs; no .et kept" in errors(output)
    assert not list(folder.glob("*.et")) and not list(folder.glob(".*"))
    summary = (folder / "CONVERSION_SUMMARY.md").read_text()
    assert summary.count("⛔ refused") == 2 and "no .et of this run is kept" in summary


def test_second_capture_of_the_same_config_names_the_rank_and_the_gap(tmp_path, capsys):
    folder = corpus.copy_run(BERT, tmp_path / "bert")
    corpus.shift_capture(folder, 1, hours=3, pid_offset=1000)
    code, output = convert(folder, capsys)
    assert code == 1
    assert "rank 1's traced step ran 3 h 0 min after rank 0's: two captures" in errors(output)[0]


def test_host_trace_of_another_capture_with_the_same_pid_is_refused_by_its_start_time(tmp_path, capsys):
    folder = corpus.copy_run(BERT, tmp_path / "bert")
    corpus.swap_in_host_of_second_capture(folder, rank=0)
    code, output = convert(folder, capsys)
    assert code == 1
    assert errors(output)[0] == (
        f"error: {folder / 'host.0.json'}: its capture started at 2026-11-22 12:27:44 (the tracing machine's clock), "
        "but the device trace's window at 2026-11-22 10:18:20 UTC, which no time zone explains: the host trace comes "
        "from another capture (same process id, other run); copy the host and device trace of one capture "
        f"({folder / 'device.0.json'})")
    assert et_names(folder) == ["bert.1.et"]


def test_start_time_check_allows_any_time_zone_and_a_late_profiler_window():
    from trace_tools.identity import host_device_time_problem
    utc_start = 1_795_342_700.4  # 2026-11-22 10:18:20.4 UTC
    for clock in ("2026-11-22 10:18:20", "2026-11-22 02:18:20", "2026-11-22 15:03:20",
                  "2026-11-22 10:17:46"):  # UTC, UTC-8, UTC+4:45, the observer started 34 s early
        assert host_device_time_problem(clock, utc_start) is None, clock
    assert host_device_time_problem("2026-11-22 12:27:44", utc_start).startswith("its capture started at")
    assert host_device_time_problem("2026-11-22 10:18:20", 4485.6) is None  # not a wall clock: no judgement


def test_start_times_of_ranks_of_one_run_pass():
    base = {"run_id": None, "host_name": "n1", "host_time": None, "dist_rank": None, "world_size": 2,
            "process_groups": {}, "step_us": 250_000.0}
    ranks = {0: dict(base, host_pid=1, dist_rank=0, step_start_unix_us=1e15),
             1: dict(base, host_pid=2, dist_rank=1, step_start_unix_us=1e15 + 400_000)}
    assert one_run_problems(ranks) == []
    ranks[1]["step_start_unix_us"] += 10e6
    assert one_run_problems(ranks) == ["rank 1's traced step ran 10.4 s after rank 0's: two captures, the files "
                                       "come from different runs"]


def test_run_ids_of_the_tracer_name_the_odd_rank():
    ranks = {r: {"run_id": "a", "world_size": 3, "dist_rank": r} for r in range(3)}
    ranks[2]["run_id"] = "b"
    assert one_run_problems(ranks) == ["rank 2 comes from traced run b but ranks 0, 1 from a: the files come from "
                                       "different runs"]
    ranks[2]["run_id"] = None
    assert one_run_problems(ranks)[0].startswith("rank 2 carries no run id while ranks 0, 1 come from traced run a")


# ---- stale .et files --------------------------------------------------------------------------------------------
def test_summary_records_the_files_each_et_was_made_from(tmp_path, capsys):
    folder = corpus.copy_run(BERT, tmp_path / "bert")
    assert convert(folder, capsys)[0] == 0
    previous = read_previous_results(folder)
    stat = (folder / "host.1.json").stat()
    assert previous[1].inputs["host"] == {"name": "host.1.json", "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    assert previous[1].inputs["et"]["size"] == (folder / "bert.1.et").stat().st_size
    os.utime(folder / "bert.1.et", (1_000_000_000, 1_000_000_000))  # a copy that did not keep the time
    assert "nothing to do" in convert(folder, capsys, remaining=True)[1]


def test_interrupted_conversion_keeps_the_ranks_it_finished(tmp_path, capsys, monkeypatch):
    folder = corpus.copy_run(BERT, tmp_path / "bert")
    real = pipeline.convert_rank

    def ctrl_c_on_rank_1(host, device, out, rank=0, *args, **kwargs):
        if rank == 1:
            raise KeyboardInterrupt
        return real(host, device, out, rank, *args, **kwargs)

    monkeypatch.setattr(pipeline, "convert_rank", ctrl_c_on_rank_1)
    code, output = convert(folder, capsys, "--jobs", "1")
    assert code == 130 and "Traceback" not in output
    assert output.strip().splitlines()[-1].startswith("interrupted: convert_to_et.py stopped by Ctrl-C")
    summary = (folder / "CONVERSION_SUMMARY.md").read_text()
    assert "| 0 | ✅ ok |" in summary and "| 1 | ⏸ interrupted |" in summary
    assert sorted(p.name for p in folder.iterdir() if p.name.endswith("et") or p.name.startswith(".")) == ["bert.0.et"]
    monkeypatch.setattr(pipeline, "convert_rank", real)
    rank0 = (folder / "bert.0.et").stat().st_mtime_ns
    code, output = convert(folder, capsys, remaining=True)
    assert code == 0 and "converting 1 remaining rank(s)" in output
    assert (folder / "bert.0.et").stat().st_mtime_ns == rank0


def test_convert_remaining_redoes_an_et_that_no_longer_validates(tmp_path, capsys):
    folder = corpus.copy_run(BERT, tmp_path / "bert")
    assert convert(folder, capsys)[0] == 0
    et = folder / "bert.1.et"
    et.write_bytes(et.read_bytes()[:1000])
    code, output = convert(folder, capsys, remaining=True)
    assert code == 0 and "converting 1 remaining rank(s) (1 .et changed)" in output
    assert et.stat().st_size > 1000


def test_convert_remaining_redoes_ranks_traced_again_since(tmp_path, capsys):
    folder = corpus.copy_run(BERT, tmp_path / "bert")
    assert convert(folder, capsys)[0] == 0
    corpus.copy_run(GPT2_2R, folder)
    code, output = convert(folder, capsys, remaining=True)
    assert code == 0 and "converting 2 remaining rank(s) (2 traces changed)" in output
    assert metadata(folder / "bert.0.et")["pid"] == read_json(GPT2_2R / "host.0.json.gz")["pid"]


def test_convert_remaining_of_one_run_finds_its_earlier_conversion_with_other_runs(tmp_path, capsys):
    """Two runs converted into --output-dir out went to out/<name>/; convert_remaining.py of one of them with the
    same --output-dir finds it there (it had converted both ranks anew into out/ itself, beside it)."""
    traces = tmp_path / "traces"
    bert, gpt2 = corpus.copy_run(BERT, traces / "bert"), corpus.copy_run(GPT2_2R, traces / "gpt2")
    out = tmp_path / "out"
    assert convert(traces, capsys, "--output-dir", str(out))[0] == 0
    assert convert(bert, capsys, "--output-dir", str(out), remaining=True)[1].startswith("nothing to do")
    (out / "bert" / "bert.1.et").unlink()
    code, output = convert(bert, capsys, "--output-dir", str(out), remaining=True)
    assert code == 0 and "converting 1 remaining rank(s)" in output
    assert (out / "bert" / "bert.1.et").is_file() and not list(out.glob("*.et"))
    assert not (out / "CONVERSION_SUMMARY.md").exists()
    # a run converted alone into a folder holding no earlier conversion of it goes to that folder itself
    assert convert(gpt2, capsys, "--output-dir", str(tmp_path / "alone"))[0] == 0
    assert (tmp_path / "alone" / "gpt2.0.et").is_file()


def test_a_report_and_simulation_of_the_earlier_et_files_go_when_a_rank_is_converted_again(tmp_path, capsys):
    folder = corpus.copy_run(BERT, tmp_path / "bert")
    assert convert(folder, capsys)[0] == 0
    described = ["report.md", "report.json", "report_timeline_rank1.png", "SIMULATION.md"]
    for name in described:
        (folder / name).write_text("of the first conversion")
    (folder / "astra-sim").mkdir()  # simulate.py's network files and output of that simulation
    (folder / "astra-sim" / "astra-sim.out").write_text("of the first conversion")
    described.append("astra-sim")
    (folder / "notes.md").write_text("the user's own")
    assert "nothing to do" in convert(folder, capsys, remaining=True)[1]
    assert all((folder / name).exists() for name in described)  # the .et files they describe are still there
    (folder / "bert.1.et").write_bytes(b"")
    assert "converting 1 remaining rank(s)" in convert(folder, capsys, remaining=True)[1]
    assert not any((folder / name).exists() for name in described)
    assert (folder / "notes.md").read_text() == "the user's own"


def test_convert_remaining_with_nothing_to_do_still_writes_what_its_flags_ask_for(tmp_path, capsys):
    folder = corpus.copy_run(BERT, tmp_path / "bert")
    assert convert(folder, capsys)[0] == 0
    code, output = convert(folder, capsys, "--emit-merged", remaining=True)
    assert code == 0 and "converting 2 remaining rank(s) (2 merged JSON asked for)" in output
    assert sorted(p.name for p in folder.glob("*.merged.json")) == ["bert.0.merged.json", "bert.1.merged.json"]
    pytest.importorskip("matplotlib")
    code, output = convert(folder, capsys, "--report", remaining=True)
    assert code == 0 and "nothing to do" in output and f"report: {folder / 'report.md'}" in output
    assert "| 1 |" in (folder / "report.md").read_text()


def test_a_rank_that_fails_keeps_no_earlier_et(tmp_path, capsys):
    folder = corpus.copy_run(BERT, tmp_path / "bert")
    assert convert(folder, capsys)[0] == 0
    (folder / "device.1.json").write_text("[")
    code, output = convert(folder, capsys)
    assert code == 1 and "| 1 | ❌ failed |" in (folder / "CONVERSION_SUMMARY.md").read_text()
    assert et_names(folder) == ["bert.0.et"]


def et_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.et"))


def test_et_of_a_rank_the_run_no_longer_has_is_removed(tmp_path, capsys):
    folder = corpus.copy_run(BERT, tmp_path / "run")
    (folder / "stale.merged.json").write_text("{}")  # not of this run: left alone
    assert convert(folder, capsys, "--emit-merged")[0] == 0
    assert et_names(folder) == ["run.0.et", "run.1.et"]
    for path in folder.glob("*.json"):
        if path.name.startswith(("host.", "device.")):
            path.unlink()
    corpus.copy_run(GPT2, folder)  # a one-rank run traced into the same folder
    code, output = convert(folder, capsys)
    assert code == 0, output
    assert et_names(folder) == ["run.0.et"]  # simulate.py and scale_et.py would have taken run.1.et as rank 1
    assert not (folder / "run.1.merged.json").exists() and not (folder / "run.0.merged.json").exists()
    assert (folder / "stale.merged.json").exists()


def test_two_runs_of_one_name_into_one_folder_are_refused_before_anything_is_written(tmp_path, capsys):
    first, second = corpus.copy_run(BERT, tmp_path / "a" / "run"), corpus.copy_run(GPT2, tmp_path / "b" / "run")
    code = cli.main([str(first), str(second), "--output-dir", str(tmp_path / "out"), "--no-progress"])
    output = capsys.readouterr().err
    assert code == 2
    assert errors(output) == [f"error: {first} and {second} would both be converted into {tmp_path / 'out' / 'run'} "
                              "as run.<rank>.et; convert them one at a time with an --output-dir each"]
    assert not (tmp_path / "out").exists()  # not even the --output-dir folder (it was made, and left empty)


def test_two_runs_of_flat_files_in_one_folder_go_to_folders_of_their_own(tmp_path, capsys):
    """One CONVERSION_SUMMARY.md describes one run: two runs named by their files (<name>_host.json) in one folder
    are refused there, and converted side by side with --output-dir."""
    folder = tmp_path / "flat"
    folder.mkdir()
    for name, source in (("a", GPT2), ("b", BERT)):
        for kind in ("host", "device"):
            (folder / f"{name}_{kind}.json").write_bytes(corpus.unzip(source / f"{kind}.0.json.gz"))
    code, output = convert(folder, capsys)
    assert code == 2 and errors(output) == [
        f"error: runs a and b would both be converted into {folder}, whose CONVERSION_SUMMARY.md can describe one "
        "run; pass --output-dir DIR (each run goes to DIR/<name>)"]
    assert not list(folder.glob("*.et"))
    code, output = convert(folder, capsys, "--output-dir", str(tmp_path / "out"))
    assert code == 1, output  # b is rank 0 of a 2-rank run alone
    assert et_names(tmp_path / "out" / "a") == ["a.0.et"]
    assert "| 0 | ✅ ok |" in (tmp_path / "out" / "a" / "CONVERSION_SUMMARY.md").read_text()
    assert "rank(s) 1 have no host and device trace here" in (tmp_path / "out" / "b" / "CONVERSION_SUMMARY.md").read_text()


def test_a_run_folder_renamed_since_its_conversion_keeps_one_set(tmp_path, capsys):
    """Converted, renamed, converted again: the set of the old name was left beside the new one, undescribed, and
    trace_report.py then refused the folder ("several runs")."""
    folder = corpus.copy_run(GPT2_2R, tmp_path / "run_a")
    assert convert(folder, capsys)[0] == 0
    renamed = folder.rename(tmp_path / "run_b")
    code, output = convert(renamed, capsys)
    assert code == 0, output
    assert et_names(renamed) == ["run_b.0.et", "run_b.1.et"]


def test_a_conversion_into_a_folder_that_holds_another_runs_conversion_is_refused(tmp_path, capsys):
    """Two runs converted into one --output-dir: the second replaced the summary and left the first run's set
    beside its own, described by nothing."""
    out = tmp_path / "out"
    assert convert(corpus.copy_run(GPT2_2R, tmp_path / "gpt2"), capsys, "--output-dir", str(out))[0] == 0
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    code, output = convert(corpus.copy_run(BERT, tmp_path / "bert"), capsys, "--output-dir", str(out))
    assert code == 1 and errors(output) == [
        f"error: {out}: holds gpt2.<rank>.et, the conversion of another run that its CONVERSION_SUMMARY.md "
        "describes; converting bert here would leave them beside it undescribed: give it another --output-dir, or "
        "remove them first"]
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before


def test_sigterm_stops_a_conversion_like_ctrl_c_and_leaves_no_et_of_the_earlier_conversion(tmp_path, capsys):
    folder = corpus.copy_run(BERT, tmp_path / "run")
    assert convert(folder, capsys)[0] == 0
    earlier = {rank: (folder / f"run.{rank}.et").read_bytes() for rank in (0, 1)}
    corpus.copy_run(GPT2_2R, folder)  # traced again: both ranks change
    summary = folder / "CONVERSION_SUMMARY.md"
    proc = corpus.interrupt_when("convert_to_et.py", [folder, "--no-progress", "--jobs", "1"],
                                 lambda: all(row in summary.read_text() for row in ("| 0 | ✅ ok |", "| 1 | ⏸")),
                                 signum=signal.SIGTERM)
    assert proc.rc == 143, proc.text
    assert proc.err.strip().splitlines()[-1].startswith("interrupted: convert_to_et.py stopped by SIGTERM")
    assert "Traceback" not in proc.text and not list(folder.glob(".*"))
    kept = {rank: (folder / f"run.{rank}.et").read_bytes() for rank in (0, 1) if (folder / f"run.{rank}.et").exists()}
    assert kept and all(blob != earlier[rank] for rank, blob in kept.items()), "a rank of the earlier conversion"
    done = {rank for rank, result in (read_previous_results(folder) or {}).items() if result.ok}
    assert sorted(kept) == sorted(done)


def test_a_conversion_into_a_folder_another_one_is_writing_into_stops_with_one_line(tmp_path, capsys):
    folder = corpus.copy_run(BERT, tmp_path / "run")
    with pipeline.only_conversion_in(folder):
        code, output = convert(folder, capsys)
    assert code == 1
    assert errors(output) == [f"error: {folder}: another conversion, a trace_report.py or a simulate.py is using this "
                              "folder now; wait for it to end"]
    assert et_names(folder) == [] and not (folder / "CONVERSION_SUMMARY.md").exists()
    assert convert(folder, capsys)[0] == 0  # the lock went with the first


@pytest.mark.parametrize("damage, says", [
    (lambda text: text[:len(text) // 2], "not valid JSON at byte"),
    (lambda text: "[]", "not a run description (a JSON array, not an object)"),
    (lambda text: "null", "not a run description (JSON null, not an object)"),
    (lambda text: "3", "not a run description (a JSON number, not an object)"),
])
def test_a_broken_run_json_fails_every_rank_naming_it(tmp_path, capsys, damage, says):
    folder = corpus.copy_run(GPT2_2R, tmp_path / "run")
    run_json = folder / "run.json"
    run_json.write_text(damage((GPT2_2R / "run.json").read_text()))
    code, output = convert(folder, capsys)
    assert code == 1 and et_names(folder) == []
    assert f"{run_json}: {says}" in output
    assert (folder / "CONVERSION_SUMMARY.md").read_text().count("❌ failed") == 2


GPT2_TIMED = CPU_FIXTURES / "gpt2_2x128_2r_buckets"  # a run.json with untraced step times


def _set_untraced(values):
    def damage(info):
        info["ranks"][0]["untraced_step_wall_time_s"] = values
    return damage


@pytest.mark.parametrize("damage, says", [
    (_set_untraced([-0.1, -0.1, -0.1]), "ranks[0].untraced_step_wall_time_s[0] is -0.1, not a time in seconds above 0"),
    (_set_untraced([float("nan")] * 3), "ranks[0].untraced_step_wall_time_s[0] is NaN, not a time in seconds above 0"),
    (_set_untraced([True] * 3), "ranks[0].untraced_step_wall_time_s[0] is true, not a time in seconds above 0"),
    (_set_untraced(["0.1"] * 3), 'ranks[0].untraced_step_wall_time_s[0] is "0.1", not a time in seconds above 0'),
    (_set_untraced(0.1), "ranks[0].untraced_step_wall_time_s is 0.1, not a list with a value a step"),
    (lambda info: info.update(ranks=None), "ranks is null, not a list of the ranks' measurements"),
    (lambda info: info["ranks"][1].pop("rank"), "ranks[1] is {"),
    (lambda info: info.update(untraced_steps=[0, -1, 2]), "untraced_steps is [0, -1, 2], not a list of step numbers"),
])
def test_run_json_with_a_measurement_no_tracer_writes_fails_every_rank_naming_it(tmp_path, capsys, damage, says):
    """A run.json that parses but holds a time no tracer writes (negative, NaN, a string, a boolean) is a damaged
    copy: its times scale the .et durations, so converting with it gave a wrong .et and exit 0 (a step of -100 ms)
    or a traceback (NaN, "ranks": null)."""
    folder = corpus.copy_run(GPT2_TIMED, tmp_path / "run")
    run_json = folder / "run.json"
    info = json.loads((GPT2_TIMED / "run.json").read_text())
    damage(info)
    run_json.write_text(json.dumps(info))
    code, output = convert(folder, capsys)
    assert code == 1 and et_names(folder) == [] and "Traceback" not in output
    assert f"{run_json}: {says}" in output and "a damaged copy of the tracer's file, which never holds" in output
    assert (folder / "CONVERSION_SUMMARY.md").read_text().count("❌ failed") == 2


def test_convert_remaining_redoes_the_ranks_when_run_json_changes(tmp_path, capsys):
    folder = corpus.copy_run(GPT2_2R, tmp_path / "run")
    (folder / "run.json").write_text((GPT2_2R / "run.json").read_text())
    assert convert(folder, capsys)[0] == 0
    assert "nothing to do" in convert(folder, capsys, remaining=True)[1]
    info = json.loads((folder / "run.json").read_text())
    info["ranks"][0]["step_wall_time_s"] = [2 * t for t in info["ranks"][0]["step_wall_time_s"]]
    (folder / "run.json").write_text(json.dumps(info))
    code, output = convert(folder, capsys, remaining=True)
    assert code == 0 and "converting 2 remaining rank(s) (2 run.json changed)" in output


@pytest.mark.parametrize("layout", ["rank 1 copied as rank 0", "rank 0 alone"])
def test_a_part_of_a_run_without_its_run_json_is_refused(tmp_path, capsys, layout):
    folder = tmp_path / "run"
    if layout == "rank 0 alone":
        corpus.copy_run(GPT2_2R, folder, ranks=[0])
        says = "the traces were recorded in a world of 2 ranks but rank(s) 1 have no host and device trace here"
    else:
        corpus.place_rank(GPT2_2R, 1, folder, 0)
        says = "rank 0's device trace was recorded by rank 1 (its distributedInfo)"
    code, output = convert(folder, capsys)
    assert code == 1 and says in output
    assert et_names(folder) == []


# ---- the tracer: a new run replaces the old one only once its window is written --------------------------------
def train_mlp(tracer, steps: int, fail_at: int | None = None) -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with tracer:
        for step in range(steps):
            if step == fail_at:
                raise RuntimeError("killed")
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            tracer.step()


def test_run_stopped_before_its_window_leaves_the_previous_run_in_place(tmp_path):
    from utils.chakra_tracer import ChakraTracer

    train_mlp(ChakraTracer(tmp_path, "mlp", run_info={"model": "mlp"}), steps=3)
    before = {p.name: p.read_bytes() for p in (tmp_path / "mlp").iterdir()}
    with pytest.raises(RuntimeError, match="killed"):
        train_mlp(ChakraTracer(tmp_path, "mlp", run_info={"model": "mlp"}), steps=3, fail_at=1)
    assert {p.name: p.read_bytes() for p in (tmp_path / "mlp").iterdir()} == before


def test_new_window_moves_the_previous_traces_et_summary_and_report_aside(tmp_path):
    from utils.chakra_tracer import ChakraTracer

    train_mlp(ChakraTracer(tmp_path, "mlp", run_info={"model": "mlp"}), steps=3)
    run = tmp_path / "mlp"
    old_host = (run / "host.0.json").read_bytes()
    derived = ["mlp.0.et", "CONVERSION_SUMMARY.md", "report.md", "report.json", "report_breakdown.png",
               "report_timeline_rank0.png", "host.0.json.orig", "SIMULATION.md"]
    for name in derived:
        (run / name).write_text("old")
    (run / "astra-sim").mkdir()  # simulate.py's folder of the old .et files: had stayed beside the new traces
    (run / "astra-sim" / "astra-sim.out").write_text("old")
    (run / "notes.txt").write_text("mine")
    train_mlp(ChakraTracer(tmp_path, "mlp", run_info={"model": "mlp"}), steps=3)
    assert sorted(p.name for p in run.iterdir()) == ["device.0.json", "host.0.json", "notes.txt", "run.json",
                                                     "stacks.0.txt"]
    previous = tmp_path / ".previous" / "mlp"
    assert (previous / "host.0.json").read_bytes() == old_host
    assert all((previous / name).read_text() == "old" for name in derived)
    assert (previous / "astra-sim" / "astra-sim.out").read_text() == "old"
    assert json.loads((previous / "run.json").read_text())["run_id"] != json.loads((run / "run.json").read_text())["run_id"]


def test_every_device_trace_and_run_json_carry_one_run_id(tmp_path):
    from utils.chakra_tracer import ChakraTracer

    train_mlp(ChakraTracer(tmp_path, "mlp", run_info={"model": "mlp"}), steps=3)
    run_id = json.loads((tmp_path / "mlp" / "run.json").read_text())["run_id"]
    device = json.loads((tmp_path / "mlp" / "device.0.json").read_text())
    assert device["mosim_run"] == {"id": run_id, "rank": 0, "world_size": 1}


# ---- broken traces: the message says what happened --------------------------------------------------------------
def cut_and_repaired(folder: Path, kept: float) -> Path:
    """Both ranks' host traces cut after `kept` of their bytes (a process killed while writing), then repaired."""
    for rank in (0, 1):
        text = (folder / f"host.{rank}.json").read_bytes()
        (folder / f"host.{rank}.json").write_bytes(text[:int(len(text) * kept)])
        assert repair_host_trace(folder / f"host.{rank}.json").status == "repaired"
    return folder


def test_repaired_host_trace_is_flagged_in_the_et_the_table_the_summary_and_the_report(tmp_path, capsys):
    """Cut inside the last of three traced steps, a repaired host trace gives an .et of the two whole ones."""
    from trace_tools.report import write_report

    folder = cut_and_repaired(corpus.copy_run(corpus.GPT2_BUCKETS, tmp_path / "gpt2"), 9 / 10)
    code, output = convert(folder, capsys)
    assert code == 0
    assert "ok (repaired host trace)" in output.splitlines()[2]
    assert any(line.startswith("warning: gpt2 rank 0: ") and "repaired by fix_host_traces.py: closed the node list"
               in line for line in output.splitlines())
    assert any(line.startswith("warning: gpt2 ranks 0-1: the host trace ends inside ProfilerStep#6: ")
               and line.endswith("so that step is left out and the .et is made of ProfilerStep#4, ProfilerStep#5")
               for line in output.splitlines())
    assert "✅ ok, host trace repaired" in (folder / "CONVERSION_SUMMARY.md").read_text()
    assert metadata(folder / "gpt2.0.et")["host_trace_repaired"].startswith("repaired by fix_host_traces.py: closed")
    report = write_report(folder, use_hta=False).read_text()
    assert "**Repaired host traces:**" in report and "- rank 0: repaired by fix_host_traces.py" in report


def test_host_trace_cut_inside_the_middle_step_gives_the_first_step_alone(tmp_path, capsys):
    """Cut inside the second of three traced steps, a repaired host trace keeps one whole step: the .et holds that
    step's nodes and no operator of the cut step (they had stayed in, a step and a half in an .et marked ok)."""
    whole = corpus.copy_run(corpus.GPT2_BUCKETS, tmp_path / "whole")
    folder = cut_and_repaired(corpus.copy_run(corpus.GPT2_BUCKETS, tmp_path / "gpt2"), 1 / 2)
    assert convert(whole, capsys)[0] == 0
    code, output = convert(folder, capsys)
    assert code == 0
    assert any(line.startswith("warning: gpt2 ranks 0-1: the host trace ends inside ProfilerStep#5: ")
               and line.endswith("so that step is left out and the .et is made of ProfilerStep#4")
               for line in output.splitlines())
    for rank in (0, 1):
        nodes = read_et(folder / f"gpt2.{rank}.et")[1]
        assert len(nodes) == len(read_et(whole / f"whole.{rank}.et")[1])
        assert sum(node.name == "aten::embedding" for node in nodes) == 2  # token and position embeddings, once


def test_host_traces_cut_inside_the_only_step_are_refused_naming_the_collectives_they_lost(tmp_path, capsys):
    """Both ranks' host traces cut inside the one traced step, before DDP's all-reduce: the repaired traces agree
    with each other (no collective on either rank), but an .et of them would simulate the step with no
    communication at any network speed. The device trace still holds the step's later operators: each rank is
    refused, naming the step and the collective it lost, and no .et is written."""
    folder = cut_and_repaired(corpus.copy_run(GPT2_2R, tmp_path / "cut"), 3 / 5)
    code, output = convert(folder, capsys)
    assert code == 1
    for rank in (0, 1):
        [line] = [e for e in errors(output) if e.startswith(f"error: {folder / f'host.{rank}.json'}: ")]
        assert "ends inside ProfilerStep#2: " in line and "start after its last node, among them c10d::allreduce_ " \
            "(the host trace was cut short" in line
    assert not list(folder.glob("*.et"))


def test_duplicate_ids_dropped_by_a_repair_are_recorded_in_the_trace(tmp_path):
    host = read_json(GPT2 / "host.0.json.gz")
    host["nodes"] += host["nodes"][10:12]
    path = tmp_path / "host.0.json"
    path.write_text(json.dumps(host))
    assert repair_host_trace(path).status == "repaired"
    marker = json.loads(path.read_text())["repair"]
    assert marker["dropped_nodes"] == 2 and marker["action"] == "kept the first node of each id"


def test_nan_is_read_as_null_and_both_tools_say_so(tmp_path, capsys):
    folder = corpus.copy_run(GPT2, tmp_path / "gpt2")
    host = folder / "host.0.json"
    host.write_bytes(host.read_bytes().replace(b'"value": ""}', b'"value": NaN}', 2))
    assert diagnose_host_trace(host).ok
    assert repair_host_trace(host, check_only=True).line().endswith(
        "; 2 NaN/Infinity values, which are not JSON (the converter reads them as null)")
    code, output = convert(folder, capsys)
    assert code == 0
    assert f"warning: gpt2 rank 0: {host}: 2 NaN/Infinity value(s), which are not JSON" in output


def test_byte_order_mark_is_named_and_removed(tmp_path, capsys):
    folder = corpus.copy_run(GPT2, tmp_path / "gpt2")
    host = folder / "host.0.json"
    original = host.read_bytes()
    host.write_bytes(b"\xef\xbb\xbf" + original)
    code, output = convert(folder, capsys)
    assert code == 0 and "starts with a UTF-8 byte-order mark" in output
    result = repair_host_trace(host)
    assert result.line() == (f"repaired: {host}: starts with a UTF-8 byte-order mark (an editor or a Windows tool "
                             "saved it; PyTorch writes none); removed the byte-order mark; original kept as "
                             "host.0.json.orig")
    assert host.read_bytes() == original.rstrip() + b"\n"


def test_single_node_host_trace_says_the_observer_truncated_its_own_file(tmp_path, capsys):
    folder = corpus.copy_run(GPT2, tmp_path / "gpt2")
    host = json.loads((folder / "host.0.json").read_text())
    host["nodes"] = host["nodes"][:1]
    (folder / "host.0.json").write_text(json.dumps(host))
    message = ("holds 1 node(s) and no operator: the ExecutionTraceObserver was re-registered during the run and "
               "truncated its own file; the data was lost at capture")
    code, output = convert(folder, capsys)
    assert code == 1 and message in errors(output)[0]
    assert message in diagnose_host_trace(folder / "host.0.json").problem


def test_a_write_that_fails_names_the_et_not_the_trace(tmp_path):
    folder = corpus.copy_run(GPT2, tmp_path / "gpt2")
    proc = subprocess.run([sys.executable, str(REPO / "convert_to_et.py"), str(folder), "--no-progress"],
                          capture_output=True, text=True, cwd=REPO, preexec_fn=corpus.limit_file_size(64 << 10))
    assert proc.returncode == 1
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("error: ")]
    assert line == (f"error: {folder / 'gpt2.0.et'}: cannot write the .et: File too large (a limit on file sizes, "
                    "`ulimit -f`, stops it); raise the limit, then convert_remaining.py")
    assert not list(folder.glob("*.et")) and not list(folder.glob(".*"))


def test_disk_full_says_how_much_space_is_left(tmp_path):
    import errno

    text = pipeline._os_problem(OSError(errno.ENOSPC, "No space left on device"), tmp_path)
    assert text.startswith("No space left on device (") and f"MiB free in {tmp_path}); free some space" in text


@pytest.mark.parametrize("make, problem", [
    (lambda p: p.write_text("a file"), "is a file, not a folder"),
    (lambda p: (p.mkdir(), p.chmod(0o555)), "is not writable (read-only folder or file system)"),
])
def test_output_dir_that_cannot_take_the_et_is_one_line(tmp_path, capsys, make, problem):
    folder = corpus.copy_run(GPT2, tmp_path / "gpt2")
    target = tmp_path / "out"
    make(target)
    try:
        code, output = convert(folder, capsys, "--output-dir", str(target))
    finally:
        if target.is_dir():
            target.chmod(0o755)
    assert code == 2 and output.strip() == f"error: --output-dir {target}: {problem}"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the workers in Linux's /proc")
def test_workers_end_with_a_conversion_killed_outright_and_leave_the_folder_free(tmp_path, capsys):
    """kill -9 of the converter (the OOM killer) used to leave its workers running: they held the folder's lock, so
    convert_remaining.py refused the folder ("another conversion ... is using this folder now") until they were found
    and killed by hand, and went on renaming .et files into it."""
    folder = corpus.copy_run(BERT, tmp_path / "bert")
    proc = subprocess.Popen([sys.executable, str(REPO / "convert_to_et.py"), str(folder), "--no-progress",
                             "--jobs", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    workers: list[int] = []
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline and not (workers and any(folder.glob(".*unvalidated*"))):
        workers = [int(pid) for pid in children.read_text().split()] if children.exists() else []
        time.sleep(0.01)
    assert proc.poll() is None and workers, "the conversion ended before its workers could be seen"
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()], "a worker outlived the killed conversion"
    code, output = convert(folder, capsys, remaining=True)
    assert code == 0, output
    assert et_names(folder) == ["bert.0.et", "bert.1.et"]


def test_ctrl_c_stops_parallel_workers_with_one_line_and_no_partial_file(tmp_path):
    folder = corpus.copy_run(BERT, tmp_path / "bert")
    proc = corpus.interrupt_when("convert_to_et.py", [folder, "--no-progress", "--jobs", "2"],
                                 lambda: any(folder.glob(".*unvalidated*")))
    assert proc.rc == 130, proc.text
    assert proc.err.strip().startswith("interrupted: convert_to_et.py stopped by Ctrl-C") and "Traceback" not in proc.text
    assert not list(folder.glob(".*")), "no partial file of a stopped worker"
    done = {rank for rank, result in (read_previous_results(folder) or {}).items() if result.ok}
    assert et_names(folder) == [f"bert.{rank}.et" for rank in sorted(done)]


def test_a_trace_beside_its_uncompressed_twin_is_named_as_passed_over(tmp_path, capsys):
    """host.0.json and host.0.json.gz both in the folder (`gunzip -k`, then one edited): the conversion reads the
    uncompressed one and says which one it passed over, once for the run."""
    folder = corpus.copy_run(GPT2_2R, tmp_path / "both", plain=False)
    (folder / "host.0.json").write_bytes(corpus.unzip(folder / "host.0.json.gz"))
    code, output = convert(folder, capsys)
    assert code == 0
    assert [line for line in output.splitlines() if "passed over" in line] == [
        f"warning: both: {folder / 'host.0.json.gz'}: passed over for host.0.json beside it, which is converted "
        "(both name the same trace); remove the one that is not this run's"]


def test_a_folder_of_runs_with_one_that_cannot_be_looked_into_converts_the_others(tmp_path, capsys, monkeypatch):
    """A folder of runs beside a folder this user may not read (another user's, /proc's): the scan passes over
    what it cannot look at, as it passes over any other folder without traces, instead of a PermissionError
    traceback."""
    corpus.copy_run(GPT2_2R, tmp_path / "runs" / "gpt2")
    locked = tmp_path / "runs" / "locked"
    (locked / "inner").mkdir(parents=True)
    real_is_dir, real_is_file = Path.is_dir, Path.is_file

    def refuse(real):
        def check(self):
            if locked in self.parents:
                raise PermissionError(13, "Permission denied", str(self))
            return real(self)
        return check
    monkeypatch.setattr(Path, "is_dir", refuse(real_is_dir))
    monkeypatch.setattr(Path, "is_file", refuse(real_is_file))
    code, output = convert(tmp_path / "runs", capsys)
    assert code == 0 and "Traceback" not in output
    assert sorted(p.name for p in (tmp_path / "runs" / "gpt2").glob("*.et")) == ["gpt2.0.et", "gpt2.1.et"]


# ---- what the conversion reads and writes beside the traces -------------------------------------------------------
def test_a_run_json_that_is_a_folder_is_named_not_taken_for_a_missing_one(tmp_path, capsys):
    """A folder named run.json was passed over as no run.json: the .et files kept the profiler's cost, with a
    warning and exit 0. It is an unreadable run.json, said once for the run."""
    folder = corpus.copy_run(GPT2_2R, tmp_path / "run")
    (folder / "run.json").mkdir()  # copy_run copies the traces only
    code, output = convert(folder, capsys)
    assert code == 1
    assert errors(output) == [f"error: {folder / 'run.json'}: cannot be read (Is a directory)"]
    assert not list(folder.glob("*.et"))


def test_a_summary_path_that_is_a_folder_is_refused_before_any_et_is_removed(tmp_path, capsys):
    """A folder named CONVERSION_SUMMARY.md: the earlier .et files were removed, then the summary could not be
    written."""
    folder = corpus.copy_run(GPT2_2R, tmp_path / "run")
    assert convert(folder, capsys)[0] == 0
    ets = {path.name: path.read_bytes() for path in folder.glob("*.et")}
    (folder / "CONVERSION_SUMMARY.md").unlink()
    (folder / "CONVERSION_SUMMARY.md").mkdir()
    for remaining in (False, True):
        code, output = convert(folder, capsys, remaining=remaining)
        assert code == 2
        assert output == (f"error: {folder / 'CONVERSION_SUMMARY.md'}: a folder, where the conversion writes its "
                          "summary; move it away and convert again\n")
        assert {path.name: path.read_bytes() for path in folder.glob("*.et")} == ets


@pytest.mark.parametrize("command", [
    ["convert_to_et.py", ""], ["convert_to_et.py", "run", "--output-dir", ""], ["convert_remaining.py", ""],
    ["fix_host_traces.py", ""], ["simulate.py", "", "--bandwidth", "1Gbit/s"], ["trace_report.py", ""],
    ["trace_report.py", "run", "--traces", ""], ["scale_et.py", "", "--ranks", "4"]])
def test_an_empty_path_is_refused_instead_of_taken_for_the_current_folder(tmp_path, command):
    """`--output-dir ""` (an unset shell variable) wrote the .et files into the current folder, and an empty run
    folder converted, repaired or simulated whatever lay there."""
    folder = corpus.copy_run(GPT2_2R, tmp_path / "run")
    before = sorted(path.name for path in folder.iterdir())
    proc = subprocess.run([sys.executable, str(REPO / command[0]), *command[1:]], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    flag = next((f for f in ("--output-dir", "--traces") if f in command), None) or \
        {"simulate.py": "RUN_DIR", "scale_et.py": "RUN_DIR", "trace_report.py": "DIR"}.get(command[0], "PATH")
    assert proc.returncode == 2
    assert proc.stderr == (f"error: {command[0]}: argument {flag}: an empty path (for the current folder, give .) "
                           f"(see {command[0]} --help)\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run"]
    assert sorted(path.name for path in folder.iterdir()) == before
