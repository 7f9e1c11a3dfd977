"""The benchmarks: each prints its table and exits 0 on small sizes, and exits non-zero when it cannot measure."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import BenchError, WorkFolder, format_table, our_step_times, quick_settings, run_child
from bench.convert_bench import build_parser, generate_traces, growth_exponent

ROOT = Path(__file__).resolve().parent.parent
CPU_TRACES = ROOT / "tests" / "data" / "cpu"


def run_bench(script: str, *args: str, env_extra: dict = None, timeout: int = 600,
              env_remove: tuple = ()) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **(env_extra or {}))
    for name in env_remove:
        env.pop(name, None)
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def table_rows(stdout: str, first_cell: str) -> list:
    """Cells of the Markdown table rows whose first cell starts with first_cell."""
    rows = []
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].startswith(first_cell):
            rows.append(cells)
    return rows


def ratio_value(cell: str) -> float:
    match = re.fullmatch(r"([0-9.]+)x", cell)
    assert match, f"not a ratio: {cell!r}"
    return float(match.group(1))


# ---------------------------------------------------------------------------------------------- shared helpers
def test_child_peak_memory_is_that_of_the_child(tmp_path):
    grow = "b = bytearray(200 * 1024 * 1024); b[::4096] = b'x' * len(b[::4096])"
    big = run_child([sys.executable, "-c", grow])
    small = run_child([sys.executable, "-c", "pass"])
    assert big.ok and small.ok
    assert big.peak_rss_mb > 200 > small.peak_rss_mb
    assert big.wall_s > 0


def test_child_peak_memory_leaves_out_the_parents_memory():
    # Linux carries the high-water RSS across fork and execve: a child forked straight from a large benchmark
    # process would report the parent's memory as its own.
    ballast = bytearray(300 * 1024 * 1024)
    ballast[::4096] = b"x" * len(ballast[::4096])
    small = run_child([sys.executable, "-c", "pass"])
    del ballast
    assert small.ok and small.peak_rss_mb < 100


def test_child_failure_reports_its_last_error_line():
    run = run_child([sys.executable, "-c", "import sys; print('error: disk full', file=sys.stderr); sys.exit(3)"])
    assert not run.ok and run.returncode == 3
    assert run.reason() == "exit status 3: error: disk full"


def test_child_past_its_timeout_is_stopped():
    run = run_child([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=0.5)
    assert run.timed_out and not run.ok and run.wall_s < 10


def test_step_times_are_read_from_our_trainer_log(tmp_path):
    (tmp_path / "training_rank_0.log").write_text(
        "2026-01-01 00:00:00,000 rank 0/1 INFO utils.trainer: step 1/2 | epoch 0.01 | loss 7.2 | lr 5e-05 | "
        "grad norm 2.0 | 144 tok/s | 1,772.1 ms/step\n"
        "2026-01-01 00:00:01,000 rank 0/1 INFO utils.trainer: step 2/2 | epoch 0.01 | loss 7.1 | lr 4e-05 | "
        "96 tok/s | 15.5 ms/step\n", encoding="utf-8")
    assert our_step_times(tmp_path) == {1: 1.7721, 2: 0.0155}


def test_a_log_without_step_lines_is_an_error(tmp_path):
    (tmp_path / "training_rank_0.log").write_text("no steps here\n", encoding="utf-8")
    with pytest.raises(BenchError, match="no 'step N/M"):
        our_step_times(tmp_path)


def test_table_aligns_numbers_right():
    table = format_table(["name", "s"], [["a", "1.50"], ["bb", "10.25"]]).splitlines()
    assert table[1] == "|------|------:|"
    assert table[2] == "| a    |  1.50 |"


def test_growth_exponent_is_one_for_linear_growth():
    assert growth_exponent([10.0, 20.0, 40.0], [1.0, 2.0, 4.0]) == pytest.approx(1.0)
    assert growth_exponent([10.0, 40.0], [1.0, 16.0]) == pytest.approx(2.0)


# -------------------------------------------------------------------------------------------- convert_bench
def test_convert_bench_compares_ours_with_chakra_converter_on_real_traces():
    result = run_bench("convert_bench.py", "--traces", str(CPU_TRACES / "gpt2_tiny_1r"),
                       str(CPU_TRACES / "bert_tiny_2r"))
    assert result.returncode == 0, result.stderr
    rows = table_rows(result.stdout, "bert_tiny_2r")
    per_rank = [r for r in rows if r[1] in ("0", "1")]
    assert [r[1] for r in per_rank] == ["0", "1"]
    for row in per_rank:
        parse_s, ours_s, ours_mb, chakra_s, chakra_mb = (float(row[i]) for i in (4, 5, 7, 8, 9))
        assert parse_s > 0 and ours_s > 0 and chakra_s > 0 and 20 < ours_mb < 2000 and 20 < chakra_mb < 2000
        assert ratio_value(row[10]) == pytest.approx(chakra_s / ours_s, rel=0.05, abs=0.01)
    assert "Growth" in result.stdout and "NOT in its column" in result.stdout


def test_convert_bench_fails_when_chakra_converter_is_missing(tmp_path):
    result = run_bench("convert_bench.py", "--traces", str(CPU_TRACES / "gpt2_tiny_1r"),
                       "--chakra-converter", str(tmp_path / "chakra_converter"))
    assert result.returncode == 1
    assert "reference cannot be measured" in result.stderr
    assert "| ours s" not in result.stdout


def test_convert_bench_keeps_the_input_its_failed_reference_run_was_given(tmp_path):
    """The error line names the merged JSON chakra_converter failed on; the temporary folder holding it had been
    removed before the line was printed."""
    failing = tmp_path / "chakra_converter"
    failing.write_text("#!/bin/sh\necho 'error: cannot read the input' >&2\nexit 1\n")
    failing.chmod(0o755)
    result = run_bench("convert_bench.py", "--traces", str(CPU_TRACES / "gpt2_tiny_1r"), "--repeats", "1",
                       "--chakra-converter", str(failing), env_extra={"TMPDIR": str(tmp_path)})
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    merged, kept = re.fullmatch(r"error: (\S+): chakra_converter failed: exit status 1: error: cannot read the input "
                                r"\(the runs' files are kept in (\S+)\)", line).groups()
    assert Path(merged).is_file() and Path(merged).is_relative_to(kept) and Path(kept).parent == tmp_path


@pytest.mark.slow
def test_convert_bench_traces_with_our_tracer_and_caches_the_traces(tmp_path):
    cache = tmp_path / "cache"
    result = run_bench("convert_bench.py", "--quick", "--steps", "1", "--cache-dir", str(cache))
    assert result.returncode == 0, result.stderr
    [folder] = cache.glob("gpt2-tiny_v*_1r_b2_s64_1steps")
    assert sorted(p.name for p in folder.glob("*.json")) == ["device.0.json", "host.0.json", "run.json"]
    assert (folder / "chakra_input" / "merged.0.json").is_file()
    assert len(table_rows(result.stdout, "1")) == 2  # the per-rank row and the growth row
    # A second run takes the cached traces instead of training again.
    args = build_parser().parse_args(["--model-name", "tiny", "--ranks", "1", "--batch-size", "2",
                                      "--max-seq-length", "64"])
    before = sorted((p.name, p.stat().st_mtime_ns) for p in folder.iterdir())
    vocab = int(folder.name.split("_v")[1].split("_")[0])
    cached = generate_traces(args, 1, cache, tokenizer=Path("unused"), vocab=vocab)
    assert cached.folder == folder and cached.cached
    assert sorted((p.name, p.stat().st_mtime_ns) for p in folder.iterdir()) == before


# ---------------------------------------------------------------------------------------------- train_bench
@pytest.mark.slow
def test_train_bench_prints_tokens_per_second_of_both_trainers_and_their_ratio():
    result = run_bench("train_bench.py", "--quick", "--models", "gpt2", "--threads", "1")
    assert result.returncode == 0, result.stderr
    [row] = table_rows(result.stdout, "gpt2 tiny")
    ours, trainer = (float(cell.replace(",", "")) for cell in row[6:8])
    assert ours > 0 and trainer > 0
    assert ratio_value(row[8]) == pytest.approx(ours / trainer, rel=0.05, abs=0.01)


def test_train_bench_fails_when_transformers_trainer_cannot_run(tmp_path):
    fake = tmp_path / "accelerate"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('No module named accelerate')\n")
    result = run_bench("train_bench.py", "--quick", "--models", "gpt2",
                       env_extra={"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])})
    assert result.returncode == 1
    assert "needs the accelerate package" in result.stderr


# ------------------------------------------------------------------------------------- collective_start_cost
def test_collective_start_cost_times_each_size_after_compute_and_after_a_barrier(tmp_path):
    # torchrun's folders nowhere (bench/common.child_env): each torchrun had left a /tmp/torchelastic_* folder
    result = run_bench("collective_start_cost.py", "--quick", "--compute-ms", "3,6", timeout=300,
                       env_extra={"TMPDIR": str(tmp_path)}, env_remove=("PET_LOG_DIR",))
    assert result.returncode == 0, result.stderr
    assert not list(tmp_path.glob("torchelastic_*"))
    (row,) = table_rows(result.stdout, "0.065536")
    assert row[1] == "5"  # repeats pooled per condition
    after_compute, after_barrier = float(row[2]), float(row[3])
    assert after_compute > 0 and after_barrier > 0
    assert float(row[4]) == pytest.approx(after_compute - after_barrier, abs=0.011)
    # both times and the ratio are printed to two decimals: a small ratio is off by up to 0.005 from its rounding
    # alone (0.09x printed for 0.34 / 3.99 ms = 0.085)
    assert ratio_value(row[5]) == pytest.approx(after_compute / after_barrier, rel=0.05, abs=0.01)
    # the tracer's measure: the mean after compute beyond its fastest, no more than the mean itself
    assert 0 <= float(row[9]) <= float(row[6])


# ---------------------------------------------------------------------------------------- communication_cpu
@pytest.mark.alone  # its CPUs' time is every thread's time plus the idle time: another test's threads would end in it
def test_communication_cpu_measures_the_threads_and_the_kernels_time_per_byte_at_each_rate():
    from bench.netem import missing_requirement
    problem = missing_requirement()
    if problem:
        pytest.skip(f"communication_cpu needs a rate-limited network namespace: {problem}")
    result = run_bench("communication_cpu.py", "--quick", timeout=300)
    assert result.returncode == 0, result.stderr
    fast, slow = table_rows(result.stdout, "unthrottled")[0], table_rows(result.stdout, "100 Mbit/s")[0]
    for row in (fast, slow):
        reduces, each_ms, threads_each, threads_per_mb = int(row[2]), float(row[3]), float(row[4]), float(row[6])
        assert reduces >= 3 and each_ms > 0 and threads_each > 0
        # 1 MB messages: the CPU time per MB is the time per all-reduce
        assert threads_per_mb == pytest.approx(threads_each, rel=0.02, abs=0.002)
        assert float(row[8]) == pytest.approx(float(row[6]) + float(row[7]), abs=0.002)
    # a 1 MB ring all-reduce moves 2 MB through the loopback: at 100 Mbit/s that is at least 160 ms
    assert float(slow[3]) >= 150 > float(fast[3])
    # every thread's CPU time and the idle time make up about the CPUs' whole time; the interrupts only add to it
    for row in (fast, slow):
        alone, added = float(row[10]), float(row[11])
        assert 0.7 < alone <= added < 1.4
    # the threads are given a CPU at least once an all-reduce, and more often when the network paces the bytes
    scheduled, per_time = {}, {}
    for name, row in (("fast", fast), ("slow", slow)):
        scheduled[name], per_time[name] = float(row[12].replace(",", "")), float(row[13])
        assert scheduled[name] >= 1 and per_time[name] > 0
        assert per_time[name] * scheduled[name] / 1000 == pytest.approx(float(row[4]), rel=0.05)
    assert scheduled["slow"] > scheduled["fast"]
    verdicts = [line for line in result.stdout.splitlines() if line.startswith("- ")]
    assert [line.split(":")[0] for line in verdicts] == ["- unthrottled", "- 100 Mbit/s"]
    assert all("of the CPUs' time was in no thread and not idle" in line for line in verdicts)


# ------------------------------------------------------------------------------------------------- rate_cpu
def test_rate_cpu_times_one_processs_threads_at_each_rate_after_the_window(tmp_path):
    from bench.netem import missing_requirement
    problem = missing_requirement()
    if problem:
        pytest.skip(f"rate_cpu needs a rate-limited network namespace: {problem}")
    result = run_bench("rate_cpu.py", "--quick", "--keep", str(tmp_path), timeout=600)
    assert result.returncode == 0, result.stderr
    rows = {(row[0], row[1]): row for row in table_rows(result.stdout, "") if row[1].isdigit()}
    assert set(rows) == {(rate, rank) for rate in ("unthrottled", "100 Mbit/s") for rank in ("0", "1")}
    info = json.loads((tmp_path / "run" / "traces" / "rate_cpu" / "run.json").read_text())
    assert {r["rank"] for r in info["ranks"]} == {0, 1}
    for (rate, _), row in rows.items():
        steps, wall, thread, communication, process = int(row[2]), *(float(c.replace(",", "")) for c in row[3:7])
        assert steps >= 2 and 0 < thread < process and communication > 0
        assert process <= wall * 1.1  # one process's CPU on one core a rank (the communication threads too)
        if rate == "unthrottled":
            assert row[7:10] == ["1.00x"] * 3
    # 2 x 0.9 MB of gradients through a 100 Mbit/s loopback: at least 140 ms a step, against tens unthrottled
    assert all(float(rows["100 Mbit/s", r][3].replace(",", "")) > 140 > float(rows["unthrottled", r][3]) for r in "01")


def test_rate_cpu_assigns_steps_to_rates_leaving_out_settling_and_stalled_steps():
    from bench.netem import parse_rate
    from bench.rate_cpu import steps_at_each_rate
    fast, slow = parse_rate("unthrottled"), parse_rate("100mbit")
    # rates from t = 0, 10, 20 (the order turns round: slow again) and 30; steps of 1 s each, step n in [n-1, n]
    switches = [(0.0, fast, 0.5, 0), (10.0, slow, 0.5, 0), (20.0, slow, 0.5, 0), (30.0, fast, 0.5, 0)]
    steps = [(n, n - 1.0, float(n)) for n in range(1, 40)]
    stalls = [(25.5, slow, "held 3 packets")]
    at_rate = steps_at_each_rate(switches, steps, first_step=3, settle=2, stalls=stalls)
    assert at_rate[fast.label] == [5, 6, 7, 8, 9, 10, 33, 34, 35, 36, 37, 38, 39]
    # after the change at 10 s: two settle; the block from 20 s repeats the rate, so none settle there; step 26
    # (25-26 s) is left out for the stall
    assert at_rate[slow.label] == [13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 27, 28, 29, 30]


@pytest.mark.parametrize("args, says", [
    (["--rates", "unthrottled"], "--rates unthrottled: give at least two different rates"),
    (["--rates", "unthrottled,fast"], "--rates unthrottled,fast: 'fast' is not a rate"),
    (["--block", "3", "--settle", "3"], "--settle 3: must be less than --block 3"),
    (["--cycles", "0"], "--cycles 0: must be at least 1"),
])
def test_rate_cpu_refuses_bad_flags_before_it_needs_root(args, says):
    result = run_bench("rate_cpu.py", *args, timeout=60)
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and says in line


# ------------------------------------------------------------------------------------------------- scale_whatif
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_an_n_npu_ring_at_p_over_n_a_link_takes_what_n_ranks_take_through_one_shared_loopback(ranks, tmp_path,
                                                                                             astra_sim):
    """N ranks' ring all-reduce of S bytes moves 2(N-1)S through lo's one qdisc: 2(N-1)S/P at payload rate P. An N-NPU
    ring at P/N a link must give the same, as bench/scale_whatif.py simulates it."""
    from bench.whatif_bench import link_gbs, write_allreduce_et
    from trace_tools.simulate import simulate_workload
    size, payload = 10_000_000, 100e6
    prefix = write_allreduce_et(tmp_path / "allreduce", size, ranks)
    result = simulate_workload(prefix, ranks, bandwidth_gbs=link_gbs(payload, ranks), latency_ns=500,
                               binary=astra_sim, work_dir=tmp_path / "sim")
    assert result.step_ms == pytest.approx(1000 * 2 * (ranks - 1) * size * 8 / payload, rel=0.01)


def test_scale_whatif_sets_n_real_ranks_against_the_trace_made_into_n(tmp_path, astra_sim):
    from bench.netem import missing_requirement
    problem = missing_requirement()
    if problem:
        pytest.skip(f"scale_whatif needs a rate-limited network namespace: {problem}")
    # --quick chooses 2 ranks a core where the machine has fewer than 4 (it had refused on 2 cores)
    result = run_bench("scale_whatif.py", "--quick", "--keep", str(tmp_path), timeout=900)
    assert result.returncode == 0, result.stderr
    (row,) = table_rows(result.stdout, "1")
    assert row[1] == "100 Mbit/s"
    real = {2: float(row[2].replace(",", "")), 4: float(row[5].replace(",", ""))}
    predicted = {2: float(row[3].replace(",", "")), 4: float(row[6].replace(",", ""))}
    # 0.9 MB of gradients: 2 x 0.9 MB through 100 Mbit/s at 2 ranks (144 ms), 6 x at 4 (432 ms), plus the compute
    assert real[4] > 2 * real[2] and real[2] > 140
    assert 2.2 < predicted[4] / predicted[2] < 3.0
    assert float(row[8].replace(",", "")) == pytest.approx(real[4] - real[2], abs=0.11)
    assert float(row[9].replace(",", "")) == pytest.approx(predicted[4] - predicted[2], abs=0.11)
    assert list((tmp_path / "traced-0" / "traces").glob("*/astra-sim-4-ranks-100Mbits"))
    assert "At 4 ranks: predicted / real" in result.stdout


@pytest.mark.parametrize("args, says", [
    (["--ranks", "2"], "--ranks 2: must be more than the 2 traced"),
    (["--ranks-per-core", "3"], "--ranks-per-core 3: must divide 2 and --ranks 4"),
    (["--ranks", "4096"], "--ranks 4096 at 1 a core needs 4096 cores"),
    (["--ranks", "2,4"], "--ranks 2: must be more than the 2 traced"),
    (["--ranks", "4,4096"], "--ranks 4096 at 1 a core needs 4096 cores"),
    (["--ranks-per-core", "2", "--rates", "unthrottled,100mbit"], "give throttled rates only"),
    (["--ranks-per-core", "2", "--cycles", "3"], "--cycles 3: use an even number"),
])
def test_scale_whatif_refuses_bad_flags_before_it_needs_root(args, says):
    result = run_bench("scale_whatif.py", *args, timeout=60)
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and says in line


# ------------------------------------------------------------------------------------- every bench's flags
@pytest.mark.parametrize("script, args, named", [
    ("collective_start_cost.py", ["--compute-ms", "5,2"], "--compute-ms"),
    ("collective_start_cost.py", ["--sizes", "65536,big"], "--sizes"),
    ("collective_start_cost.py", ["--repeats", "0"], "--repeats"),
    ("communication_cpu.py", ["--rates", "fast"], "--rates"),
    ("communication_cpu.py", ["--mb", "0"], "--mb"),
    ("communication_cpu.py", ["--rounds", "0"], "--rounds"),
    ("pause_cost.py", ["--rounds", "0"], "--rounds 0: must be at least 1"),
    ("whatif_bench.py", ["--gradient-accumulation-steps", "0"], "--gradient-accumulation-steps 0: at least 1"),
    ("pause_cost.py", ["--steps", "0"], "--steps 0: must be at least 1"),
    ("pause_cost.py", ["--pause-s", "0"], "--pause-s 0: must be more than 0"),
])
def test_a_bench_rejects_a_bad_flag_in_one_line_naming_it(script, args, named):
    result = run_bench(script, *args, timeout=60)
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and named in line


@pytest.mark.parametrize("script, args, says", [
    ("pause_cost.py", ["--model", "huge"], "argument --model: invalid choice: 'huge'"),
    ("whatif_bench.py", ["--traces", "two"], "argument --traces: invalid int value: 'two'"),
    ("communication_cpu.py", ["--bogus"], "unrecognized arguments: --bogus"),
    ("tbf_stalls.py", ["--modes", "in-place,bogus"], "--modes: 'in-place,bogus': choose from in-place, new"),
    ("tbf_stalls.py", ["--cycles", "0"], "--cycles must be at least 1"),
    ("tbf_stalls.py", ["--rates", "unthrottled"], "--rates: name at least one throttled rate"),
    ("tbf_stalls.py", ["--rates", "fast"], "--rates: 'fast' is not a rate"),
    ("scale_whatif.py", ["--ranks", "8,4"], "--ranks: '8,4': give each count once, smallest first"),
    ("scale_whatif.py", ["--ranks", "4,4"], "--ranks: '4,4': give each count once, smallest first"),
    ("scale_whatif.py", ["--ranks", "4,eight"], "--ranks: '4,eight': give whole numbers of ranks"),
])
def test_a_bench_refuses_a_flag_argparse_rejects_in_one_line_too(script, args, says):
    result = run_bench(script, *args, timeout=60)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and says in line and line.endswith("--help)")


# -------------------------------------------------------------------------------------------- process_pace
def test_process_pace_times_the_same_work_in_separate_processes():
    result = run_bench("process_pace.py", "--quick", timeout=300)
    assert result.returncode == 0, result.stderr
    rows = [row for row in table_rows(result.stdout, "") if row[0].isdigit()]
    assert [row[0] for row in rows] == ["1", "2"] and all(row[1] == "4" for row in rows)
    assert re.search(r"process 2 of 2: median \d+\.\d ms", result.stdout)  # said as each child ends
    medians = [float(row[2]) for row in rows]
    assert all(float(row[3]) <= float(row[2]) <= float(row[4]) for row in rows)
    (summary,) = [line for line in result.stdout.splitlines() if line.startswith("slowest / fastest")]
    # the medians are printed to 0.1 ms, the ratio from the unrounded ones: allow each median's rounding
    rounding = 0.05 * (max(medians) + min(medians)) / min(medians) ** 2 + 0.005
    assert ratio_value(summary.split(" = ")[1].split(";")[0]) == pytest.approx(max(medians) / min(medians),
                                                                              abs=rounding)


@pytest.mark.parametrize("flag", ["--processes", "--steps", "--parameters"])
def test_process_pace_rejects_a_count_too_small_in_one_line(flag):
    result = run_bench("process_pace.py", flag, "0", timeout=60)
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {flag} 0: must be at least")


def test_machine_description_names_the_transparent_huge_page_mode(tmp_path):
    from bench.common import transparent_huge_pages

    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert transparent_huge_pages(setting) == "madvise"
    setting.write_text("[always] madvise never\n")
    assert transparent_huge_pages(setting) == "always"
    setting.write_text("garbled\n")
    assert transparent_huge_pages(setting) is None
    assert transparent_huge_pages(tmp_path / "missing") is None


# ---------------------------------------------------------------------------------------------- pause_cost
def test_pause_cost_sets_the_step_after_a_pause_beside_the_back_to_back_step():
    result = run_bench("pause_cost.py", "--quick", timeout=300)
    assert result.returncode == 0, result.stderr
    rows = [row for row in table_rows(result.stdout, "") if row[0].isdigit()]
    assert [row[1] for row in rows] == ["back to back", "after a sleep", "after a spin"]
    assert all(row[2] == "2" and float(row[4]) <= float(row[3]) <= float(row[5]) for row in rows)
    base = float(rows[0][3])
    assert rows[0][6] == "1.000x"
    for row in rows[1:]:  # each kind over the round's back-to-back median; both medians are printed to 0.1 ms
        expected = float(row[3]) / base
        assert ratio_value(row[6]) == pytest.approx(expected, abs=(1 + expected) * 0.05 / base + 0.001)
    summaries = [line for line in result.stdout.splitlines() if " of 0.2 s: the step's CPU time is " in line]
    assert [line.split(" of ")[0] for line in summaries] == ["after a sleep", "after a spin"]
    assert "GPT-2 tiny" in result.stdout


def test_pause_cost_times_the_what_if_benchmarks_tiny_model_at_its_own_batch():
    result = run_bench("pause_cost.py", "--model", "tiny", "--rounds", "1", "--steps", "1", "--pause-s", "0.05",
                       timeout=300)
    assert result.returncode == 0, result.stderr
    # the what-if benchmark's GPT-2 tiny (bench/whatif_bench.py MODELS): the offline vocabulary, 4 x 128 tokens
    assert "model: GPT-2 tiny, 225,088 parameters, batch 4 x 128, fp32, one thread" in result.stdout
    assert len([row for row in table_rows(result.stdout, "") if row[0].isdigit()]) == 3


# --------------------------------------------------------------------------------------------- tracing_cost
@pytest.mark.slow
def test_tracing_cost_prints_step_time_ratios_of_each_condition():
    result = run_bench("tracing_cost.py", "--quick", "--threads", "1")
    assert result.returncode == 0, result.stderr
    rows = {row[1]: row for row in table_rows(result.stdout, "gpt2 tiny")}
    assert rows["tracing off"][4] == "1.00x"
    for condition in ("tracer set up, before the window (wait)", "inside the window (active)", "after the window"):
        assert ratio_value(rows[condition][4]) > 0
        assert int(rows[condition][2]) >= 1


def test_tracing_cost_fails_when_a_run_cannot_be_measured(tmp_path):
    result = run_bench("tracing_cost.py", "--model-names", "tiny", "--max-seq-length", "8", "--skip-steps", "0",
                       "--wait-steps", "1", "--active-steps", "2", "--after-steps", "0",
                       env_extra={"TMPDIR": str(tmp_path)})
    assert result.returncode == 1
    assert "(tiny, tracing off) failed" in result.stderr and "--max-seq-length" in result.stderr
    assert "| tracing off" not in result.stdout
    # the run's folder is kept and named in the error line (it had been removed before the line was printed)
    [kept] = re.findall(r"\(the runs' files are kept in (\S+)\)$", result.stderr.strip())
    assert Path(kept).parent == tmp_path and Path(kept).is_dir()


@pytest.mark.parametrize("script", ["whatif_bench", "scale_whatif", "rate_cpu", "tracing_cost", "convert_bench"])
def test_quick_settings_leave_alone_the_flags_given_on_the_command_line(script):
    """--quick puts in its smaller settings where the command line gave none; a flag given, in any of argparse's
    spellings, wins (`--quick` had overridden them: `scale_bench.py --quick --ranks 4` ran 8 and 64 ranks)."""
    import importlib
    parser = importlib.import_module(f"bench.{script}").build_parser()
    given = {"whatif_bench": ["--rates=unthrottled,1gbit", "--cycles", "3"], "scale_whatif": ["--rates", "1gbit"],
             "rate_cpu": ["--rates", "1gbit,100mbit"], "tracing_cost": ["--batch-size", "3"],
             "convert_bench": ["--steps", "3"]}[script]
    argv = ["--quick", *given]
    args = parser.parse_args(argv)
    before = vars(args).copy()
    settings = {"whatif_bench": dict(rates="unthrottled,100mbit", cycles=1, block=5),
                "scale_whatif": dict(rates="100mbit", traces=1), "rate_cpu": dict(rates="unthrottled,100mbit", block=6),
                "tracing_cost": dict(batch_size=2, max_seq_length=64), "convert_bench": dict(steps="1,2", ranks=1)}[script]
    quick_settings(parser, argv, args, settings)
    flags_given = {flag.split("=")[0].lstrip("-").replace("-", "_") for flag in given if flag.startswith("--")}
    for name, value in settings.items():
        assert getattr(args, name) == (before[name] if name in flags_given else value), name


def test_a_benchmarks_temporary_folder_is_removed_after_success_and_kept_after_a_failure(tmp_path, monkeypatch,
                                                                                           capsys):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with WorkFolder(None, "ok-") as work:
        (work.path / "log").write_text("fine")
    assert not work.path.exists()
    with pytest.raises(KeyboardInterrupt):
        with WorkFolder(None, "interrupted-") as work:
            raise KeyboardInterrupt
    assert not work.path.exists()
    with WorkFolder(None, "failed-") as work:
        assert work.fail("the run failed: see its log") == 1
    assert work.path.is_dir()
    assert capsys.readouterr().err == f"error: the run failed: see its log (the runs' files are kept in {work.path})\n"
    with pytest.raises(ValueError):
        with WorkFolder(None, "crashed-") as crashed:
            raise ValueError("a bug")
    assert crashed.path.is_dir() and capsys.readouterr().err == f"note: the runs' files are kept in {crashed.path}\n"
    with WorkFolder(tmp_path / "kept", "unused-") as kept:
        pass
    assert kept.path == tmp_path / "kept" and kept.path.is_dir()
    with WorkFolder(tmp_path / "kept", "unused-") as kept:
        kept.fail("no note about a folder the user named")
    assert capsys.readouterr().err == "error: no note about a folder the user named\n"


# --------------------------------------------------------------------------------------------- whatif_bench
def markdown_table_after(stdout: str, caption: str) -> dict:
    """{first cell: cells} of the first Markdown table after the line starting with caption."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(caption))
    rows = {}
    for line in lines[start + 1:]:
        if rows and not line.startswith("|"):
            break
        if line.startswith("|") and not line.startswith("|-"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells
    return rows


@pytest.mark.slow
def test_whatif_bench_measures_real_steps_at_every_rate_on_a_rate_limited_loopback(tmp_path):
    from bench.netem import missing_requirement

    problem = missing_requirement()
    if problem:
        pytest.skip(f"whatif_bench needs a rate-limited network namespace: {problem}")
    kept = tmp_path / "kept"
    result = run_bench("whatif_bench.py", "--quick", "--keep", str(kept), timeout=900)
    assert result.returncode == 0, result.stderr
    real = markdown_table_after(result.stdout, "Untraced real runs")
    assert set(real) == {"network", "unthrottled", "100 Mbit/s"}
    steps = {rate: float(real[rate][2].replace(",", "")) for rate in ("unthrottled", "100 Mbit/s")}
    assert all(int(real[rate][1]) >= 1 and steps[rate] > 0 for rate in steps)
    # 2 x 0.9 MB of gradients a step through 100 Mbit/s take 140 ms: the throttled step cannot hide them.
    assert steps["100 Mbit/s"] > steps["unthrottled"] + 50
    # The process's CPU time per step is the work without the wait: far below the throttled step.
    cpu = {rate: float(real[rate][3].replace(",", "")) for rate in steps}
    assert 0 < cpu["100 Mbit/s"] < steps["100 Mbit/s"] - 50 and cpu["unthrottled"] > 0
    # tbf really limits lo: a 10 MB all-reduce takes at least the ring's 2S/R (a larger burst would beat it).
    [micro] = [row for rate, row in markdown_table_after(result.stdout, "All-reduce micro-benchmark").items()
               if rate == "100 Mbit/s"]
    assert 0.95 < ratio_value(micro[5]) < 2.0
    assert "traced step" in result.stdout and ("Predictions:" in result.stdout or "Predictions skipped" in result.stdout)
    if "Predictions:" in result.stdout:  # the replay is also set against the traced process's own untraced steps
        assert re.search(r"Replay against the untraced steps the tracer timed in each traced process .*: predicted / "
                         r"real \d+\.\d+x", result.stdout)
    # The traced run went on untraced through both rates once its window had closed.
    after = markdown_table_after(result.stdout, "The traced runs' own untraced steps after their window")
    cells = dict(zip(after["trace"], after["1"]))
    assert float(cells["100 Mbit/s"].split()[0].replace(",", "")) > float(cells["unthrottled"].split()[0]) + 50
    assert all(" / cpu " in cell and "n/a" not in cell for cell in cells.values() if cell != "1")
    # The kept folder records what its traces are judged by; whatif_repredict converts them again and judges them.
    results = json.loads((kept / "whatif_results.json").read_text())
    assert [r["label"] for r in results["rates"]] == ["unthrottled", "100 Mbit/s"] and len(results["traces"]) == 1
    assert all(r["real_ms"] > 0 and r["bits_per_s"] > 0 for r in results["rates"])
    again = run_bench("whatif_repredict.py", str(kept), timeout=600)
    if not os.access(os.environ.get("ASTRA_SIM", ""), os.X_OK):
        assert again.returncode == 1 and "ASTRA_SIM" in again.stderr
        return
    assert again.returncode == 0, again.stderr
    # The same traces, converted again by the same checkout and simulated the same way: the bench's own predictions.
    bench_predicted = {row[2]: row[4] for row in table_rows(result.stdout, "GPT-2 tiny")}
    judged = table_rows(again.stdout, "kept")
    assert {row[2]: row[4] for row in judged} == {"unthrottled (replay)": bench_predicted["unthrottled"],
                                                 "100 Mbit/s": bench_predicted["100 Mbit/s"]}
    assert re.search(r"Against the untraced runs: \d of 2 within the bands", again.stdout)
    assert re.search(r"Against the same processes after their windows: \d of 2 within the bands", again.stdout)


def test_whatif_repredict_sets_the_predictions_spread_beside_the_real_processes_own():
    """The report counts the points within the bands and sets the spread of predicted / real beside how far the real
    processes differed from one another: a trace's .et carries its own process's pace."""
    from bench.whatif_repredict import Point, report

    points = [Point("k1", 1, "unthrottled", True, 100.0, 104.0, 110.0, 105.0),   # its process ran 10% slow
              Point("k1", 1, "1 Gbit/s", False, 200.0, 190.0, 200.0),
              Point("k1", 2, "unthrottled", True, 100.0, 94.0, 96.0, 88.0),
              Point("k1", 2, "1 Gbit/s", False, 200.0, 230.0, None)]     # no same-process step at this rate
    text = report(points)
    assert "Against the untraced runs: 2 of 4 within the bands" in text  # 0.94 and 1.15 are out
    assert "Against the same processes after their windows: 2 of 3 within the bands" in text
    # pooled with the other trace's process: trace 1's replay against (100 + 96) / 2 (1.06, out where the untraced
    # run alone gave 1.04), trace 2's against (100 + 110) / 2 (0.90) and at 1 Gbit/s against (200 + 200) / 2 (1.15);
    # trace 1 at 1 Gbit/s has no other process there and is not judged
    assert "one weight each): 0 of 3 within the bands" in text
    assert "replays mean 0.990, sd 7.1%, mean abs. error 5.0%, 0.94x-1.04x (2)" in text
    # each replay against its own process's untraced steps as the tracer timed them: 104 / 105 and 94 / 88 (1.07, out)
    assert ("Replays against the untraced steps the tracer timed in the traced process itself (run.json, before and "
            "after the window): 1 of 2 within 5%; mean 1.029, sd 5.5%, mean abs. error 3.9%, 0.99x-1.07x (2)") in text
    assert "other rates mean 1.050, sd 14.1%, mean abs. error 10.0%, 0.95x-1.15x (2)" in text
    assert ("at the traces' own rates mean 1.030, sd 9.9%, mean abs. error 7.0%, 0.96x-1.10x (2), 1 of 2 beyond 5%; "
            "at the other rates mean 1.000, sd 0.0%, mean abs. error 0.0%, 1.00x-1.00x (1), 0 of 1 beyond 10%") in text


def test_whatif_bound_is_judged_only_on_networks_faster_than_the_traced_one():
    """A throttled trace's communication CPU bounds the step from above on faster networks; the report says how
    often the real step lies between the step without it and the prediction."""
    from bench.netem import parse_rate
    from bench.whatif_bench import bound_verdict, faster_than
    from bench.whatif_repredict import Point, report

    slow, fast, full = parse_rate("400mbit"), parse_rate("1gbit"), parse_rate("unthrottled")
    assert faster_than(full, slow) and faster_than(fast, slow) and not faster_than(slow, fast)
    assert not faster_than(full, full) and not faster_than(slow, full) and not faster_than(slow, slow)
    assert bound_verdict([]) is None
    # real 100: inside [90, 120]; real 100 above a prediction of 80 (beyond 10%): outside
    text = bound_verdict([(90.0, 120.0, 100.0), (70.0, 80.0, 100.0)])
    assert "simulated without it, 0.70x to 0.90x of the real step" in text and "in 1 of 2." in text
    points = [Point("k1", 1, "400 Mbit/s", True, 300.0, 300.0, None, faster=False, without_communication_cpu_ms=290.0),
              Point("k1", 1, "unthrottled", False, 100.0, 120.0, None, faster=True, without_communication_cpu_ms=95.0)]
    assert "0.95x of the real step. The real step lies between the two (within 10%) in 1 of 1." in \
        report(points)


@pytest.mark.parametrize("content", [None, "{\"rates\": []}", "not json",
                                     '{"trace_rate": "unthrottled", "latency_ns": 500, "rates": [{"label": "x"}], '
                                     '"traces": [{"index": 1, "folder": "t"}]}',
                                     '{"trace_rate": "unthrottled", "latency_ns": 500, "rates": [{"label": "x", '
                                     '"bits_per_s": 1e10, "real_ms": 30}], "traces": [{"index": 1, "folder": "t"}], '
                                     '"partial": {"traced": 0, "traced_planned": 2, "untraced": 1, '
                                     '"untraced_planned": 2}}'])
def test_whatif_repredict_names_a_kept_folder_without_results(tmp_path, content):
    kept = tmp_path / "kept"
    kept.mkdir()
    if content is not None:
        (kept / "whatif_results.json").write_text(content)
    result = run_bench("whatif_repredict.py", str(kept), timeout=120)
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert str(kept / "whatif_results.json") in line
    assert ("--keep" in line) if content is None else ("not a what-if results file" in line)


def test_whatif_bench_says_what_is_missing_where_it_cannot_limit_the_network(tmp_path):
    # No ip or tc on PATH (or no root): one line naming what is missing, before anything runs.
    result = run_bench("whatif_bench.py", "--quick", env_extra={"PATH": str(tmp_path)}, timeout=60)
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: bench/whatif_bench.py: ")
    assert "'ip' not found on PATH" in line or "needs root" in line
    assert "|" not in result.stdout


def test_whatif_bench_without_astra_sim_does_not_rewrite_the_docs_without_predictions(tmp_path):
    """Without ASTRA-sim it measured for minutes, replaced the model's part of the docs by one of no predictions and
    exited 0; now it refuses before anything runs unless --no-docs (or --quick) says the docs are not written."""
    docs = tmp_path / "BENCHMARKS.md"
    docs.write_text("# Benchmarks\n")
    result = run_bench("whatif_bench.py", "--astra-sim", str(tmp_path / "no-astra-sim"), "--docs", str(docs),
                       timeout=60)
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: ASTRA-sim is needed for the predictions the docs' part holds (") and "--no-docs" in line
    assert docs.read_text() == "# Benchmarks\n" and "|" not in result.stdout


def test_whatif_runs_a_failed_training_run_once_more_and_fails_on_the_second_failure(capsys):
    from bench.whatif_bench import once_more_on_failure

    outcomes = [BenchError("untraced run 1 failed: RendezvousConnectionError"), "steps"]

    def attempt():
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert once_more_on_failure(attempt) == "steps" and not outcomes
    assert "untraced run 1 failed: RendezvousConnectionError; running it once more" in capsys.readouterr().out
    outcomes[:] = [BenchError("first"), BenchError("second"), "never"]
    with pytest.raises(BenchError, match="second"):
        once_more_on_failure(attempt)
    assert outcomes == ["never"]


def test_whatif_rates_read_as_tc_reads_them_and_map_to_half_a_ring_link():
    from bench.netem import parse_rate
    from bench.whatif_bench import GIB, link_gbs, ring_allreduce_s

    assert parse_rate("100mbit").bits_per_s == 100_000_000 == parse_rate("100 Mbit/s").bits_per_s
    assert parse_rate("2Gbit").label == "2 Gbit/s" and not parse_rate("unthrottled").throttled
    with pytest.raises(ValueError, match="not a rate"):
        parse_rate("100MB")
    # lo's one qdisc carries both directions: a 2-rank ring all-reduce of S bytes takes 2S/R there, and S/B on a
    # 2-NPU ring of per-link bandwidth B; so B = R/2 (in ASTRA-sim's GB/s of 2^30 bytes).
    rate = 1e9
    assert ring_allreduce_s(10_000_000, rate) == pytest.approx(10_000_000 / (link_gbs(rate) * GIB))


def test_whatif_simulates_a_throttled_rate_at_the_payload_rate_measured_through_it():
    from bench.netem import parse_rate
    from bench.whatif_bench import simulated_rates

    # tbf at R passes R less headers and acknowledgements: a gloo all-reduce takes 2S over the payload rate the TCP
    # check measured, so that is what the simulator's payload-only links get; unthrottled is the all-reduce's own.
    rates = [parse_rate("unthrottled"), parse_rate("1gbit"), parse_rate("100mbit")]
    payload = {"unthrottled": 13.2e9, "1 Gbit/s": 988.8e6, "100 Mbit/s": 99.0e6}
    assert simulated_rates(rates, payload, unthrottled_bits=14.5e9) == {
        "unthrottled": 14.5e9, "1 Gbit/s": 988.8e6, "100 Mbit/s": 99.0e6}


def test_whatif_models_run_their_own_family_trainer_at_a_size_it_knows():
    from bench.common import REPO_ROOT, train_script
    from bench.whatif_bench import MODELS
    from utils.families import load_family

    trained_by_a_family = [setup for setup in MODELS.values() if not setup.script]
    assert {m.family for m in trained_by_a_family} == {"gpt2", "bert"}
    for setup in trained_by_a_family:
        assert train_script(setup.family).is_file(), setup.key
        family = load_family(setup.family)
        if setup.model_name not in family.size_names:  # a folder of the repository (the trainer runs from its root)
            assert family.resolve_config(str(REPO_ROOT / setup.model_name)).model_type == setup.family, setup.key


def test_whatif_accumulation_is_a_configuration_of_its_own_that_every_run_trains_with(tmp_path):
    from bench.whatif_bench import build_parser, resolve, train_args
    from utils.run_config import build_parser as trainer_parser

    one_batch, *_ = resolve(build_parser().parse_args(["--model", "bert-tiny"]))
    setup, *_ = resolve(build_parser().parse_args(["--model", "bert-tiny", "--gradient-accumulation-steps", "3"]))
    # its own trace names and docs part, beside the model's one-batch runs, which it must not replace
    assert (one_batch.key, setup.key) == ("bert-tiny", "bert-tiny-accumulate3")
    assert setup.label == "BERT tiny, 3 micro-batches a step" and setup.family == "bert"
    assert "--gradient-accumulation-steps" not in [str(a) for a in train_args(one_batch, tmp_path, 5)]
    trained = trainer_parser("bert").parse_args([str(a) for a in train_args(setup, tmp_path, 5)])
    assert trained.gradient_accumulation_steps == 3 and trained.max_steps == 5


def test_whatif_compile_is_a_configuration_of_its_own_that_every_run_trains_with(tmp_path):
    from bench.whatif_bench import build_parser, resolve, train_args
    from utils.run_config import build_parser as trainer_parser

    eager, *_ = resolve(build_parser().parse_args(["--model", "tiny"]))
    setup, *_ = resolve(build_parser().parse_args(["--model", "tiny", "--compile", "--gradient-accumulation-steps", "2"]))
    assert (eager.key, setup.key) == ("tiny", "tiny-accumulate2-compiled")
    assert setup.label == "GPT-2 tiny, 2 micro-batches a step, compiled"
    assert trainer_parser("gpt2").parse_args([str(a) for a in train_args(eager, tmp_path, 5)]).compile is False
    trained = trainer_parser("gpt2").parse_args([str(a) for a in train_args(setup, tmp_path, 5)])
    assert trained.compile is True and trained.gradient_accumulation_steps == 2


def test_whatif_runs_a_loop_of_its_own_with_flags_it_takes_and_refuses_the_trainers_own(tmp_path):
    import importlib.util

    from bench.common import REPO_ROOT
    from bench.whatif_bench import build_parser, resolve, train_args

    setup, *_ = resolve(build_parser().parse_args(["--model", "mlp"]))
    spec = importlib.util.spec_from_file_location("own_training_loop", REPO_ROOT / setup.script)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    # what traced_run adds to train_args, as it adds it
    tracing = ["--enable-tracing", "--trace-output-dir", tmp_path / "traces", "--trace-name", "whatif_mlp_unthrottled_1",
               "--trace-wait-steps", 7, "--trace-after-steps", 7]
    parsed = example.parse_args([str(a) for a in train_args(setup, tmp_path, 40) + tracing])
    assert (parsed.width, parsed.layers, parsed.batch_size, parsed.max_steps) == (1024, 6, 64, 40)
    assert parsed.log_dir == str(tmp_path / "logs") and parsed.trace_after_steps == 7 and parsed.enable_tracing
    assert setup.program == "examples/own_training_loop.py --width 1024 --layers 6" and setup.batch == "batch 64"
    for flag in (["--compile"], ["--gradient-accumulation-steps", "2"]):
        with pytest.raises(ValueError, match="examples/own_training_loop.py, which has no"):
            resolve(build_parser().parse_args(["--model", "mlp", *flag]))


def test_whatif_runs_alternate_traced_and_untraced_so_drift_weighs_on_both():
    from bench.whatif_bench import run_order

    assert run_order(3, 3) == [("traced", 0), ("untraced", 0), ("traced", 1), ("untraced", 1), ("traced", 2),
                               ("untraced", 2)]
    assert run_order(3, 1) == [("traced", 0), ("traced", 1), ("untraced", 0), ("traced", 2)]
    assert run_order(1, 2) == [("untraced", 0), ("traced", 0), ("untraced", 1)]
    assert sorted(run_order(2, 5)) == [("traced", 0), ("traced", 1)] + [("untraced", j) for j in range(5)]


def test_whatif_untraced_step_of_a_trace_leaves_out_the_first_step_as_the_converter_does(tmp_path):
    from bench.whatif_bench import read_run_json

    # Step 0 holds the allocator's and DDP's one-time costs (3.4 s here); the converter corrects towards the
    # later untraced steps, and the bench's column must name the same steps: the slower rank's median of them.
    ranks = [{"rank": 0, "step_wall_time_s": [2.6, 2.8], "untraced_step_wall_time_s": [3.4, 2.0, 2.2, 2.1]},
             {"rank": 1, "step_wall_time_s": [2.7, 2.7], "untraced_step_wall_time_s": [3.3, 2.1, 2.3, 2.4]}]
    (tmp_path / "run.json").write_text(json.dumps({"ranks": ranks, "step_wall_time_s_max": [2.7, 2.8]}))
    traced_ms, untraced_ms = read_run_json(tmp_path)
    assert traced_ms == pytest.approx(2750) and untraced_ms == pytest.approx(2300)


def test_whatif_untraced_step_of_a_trace_is_not_a_step_by_step_maximum_of_ranks_whose_boundaries_jitter(tmp_path):
    from bench.whatif_bench import read_run_json

    # Both ranks take 2.2 s a step on average; a late boundary makes one rank's step long and its next one short,
    # in turn. Each step's slower rank is always the long half (2.4 s); the ranks' own medians are the step.
    ranks = [{"rank": 0, "step_wall_time_s": [2.5], "untraced_step_wall_time_s": [3.4, 2.0, 2.4, 2.0, 2.4, 2.2]},
             {"rank": 1, "step_wall_time_s": [2.5], "untraced_step_wall_time_s": [3.3, 2.4, 2.0, 2.4, 2.0, 2.2]}]
    (tmp_path / "run.json").write_text(json.dumps({"ranks": ranks, "step_wall_time_s_max": [2.5]}))
    assert read_run_json(tmp_path)[1] == pytest.approx(2200)


class RecordedRates:
    """A stand-in for bench.netem.Namespace that only records the rates it is set to."""

    def __init__(self):
        self.rates = []
        self.rate = None

    def set_rate(self, rate):
        self.rates.append(rate.label)
        self.rate = rate

    def drops(self):
        return 0


def test_the_rate_cycler_of_a_traced_run_starts_after_the_window_and_its_blocks_leave_the_window_out(tmp_path):
    import time

    from bench.netem import parse_rate
    from bench.whatif_bench import RateCycler, RealRuns, add_blocks, cycle_schedule, step_cpu, timed_steps

    fast, slow = parse_rate("unthrottled"), parse_rate("100mbit")
    schedule = [fast] + cycle_schedule([fast, slow], 2)  # the trace's rate, then fast slow | slow fast
    assert [r.label for r in schedule] == ["unthrottled", "unthrottled", "100 Mbit/s", "100 Mbit/s", "unthrottled"]
    log = tmp_path / "training_rank_0.log"
    ns = RecordedRates()
    cycler = RateCycler(ns, schedule, first_block=2, block=4, log_path=log, window_end=9)
    cycler.start_first()

    def step(n: int, ms: float, in_window: bool = False) -> None:
        """A step of `ms` that ends now, as the trainer logs it; then the cycler reads the line."""
        time.sleep(ms / 1000)
        now = time.time()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{int(now % 1 * 1000):03d}"
        tail = f"{ms:.1f} ms/step | loss read after the trace window" if in_window else \
            f"100 tok/s | {ms:.1f} ms/step | cpu {0.8 * ms:.1f} ms/step"
        with open(log, "a", encoding="utf-8") as out:
            out.write(f"{stamp} rank 0/2 INFO utils.trainer: step {n}/30 | epoch 0.10 | lr 1e-05 | {tail}\n")
        deadline = time.monotonic() + 10
        while cycler.is_alive() and cycler.seen < n and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.03)  # a change of rate comes right after the line that completes a block

    try:
        for n in range(1, 5):
            step(n, 30)                   # before the window: no change of rate, however many steps
        assert ns.rates == ["unthrottled"]
        for n in range(5, 9):
            step(n, 90, in_window=True)   # the window
        assert ns.rates == ["unthrottled"]
        step(9, 600)                      # the last traced step, with the trace written, then one more
        step(10, 60)
        assert ns.rates == ["unthrottled", "unthrottled"]  # first_block=2 steps after the window: the first pass
        for n in range(11, 25):
            step(n, 30 if ns.rates[-1] == "unthrottled" else 180)
    finally:
        cycler.finished.set()
        cycler.join()
    assert cycler.error is None and [r.label for _, r, _, _ in cycler.switches] == [r.label for r in schedule]
    blocks = {r.label: RealRuns(r) for r in (fast, slow)}
    add_blocks(blocks, cycler.switches, timed_steps(log), 0, first_measured=1, skip=8, settle=1, cpu=step_cpu(log))
    # Nothing of the window (90 ms) or of the step that wrote the trace (600 ms) counts as a real step.
    assert blocks["unthrottled"].steps and blocks["100 Mbit/s"].steps
    assert {round(s * 1000) for s in blocks["unthrottled"].steps} == {30}
    assert {round(s * 1000) for s in blocks["100 Mbit/s"].steps} == {180}
    # The same blocks' CPU time per step, from the lines' cpu part (the window's lines have none).
    assert blocks["unthrottled"].cpu_ms == pytest.approx(24) and blocks["100 Mbit/s"].cpu_ms == pytest.approx(144)
    assert len(blocks["100 Mbit/s"].cpu_segment_ms) == len(blocks["100 Mbit/s"].segment_ms)
    assert not set(step_cpu(log)) & set(range(5, 9))


class HeldQueue(RecordedRates):
    """lo's qdisc at 400 Mbit/s holding 52 packets: stalled (its sent count stands still) until it is replaced, or
    busy (its sent count grows at every look)."""

    def __init__(self, stalled: bool):
        from bench.netem import parse_rate

        super().__init__()
        self.rate, self.stalled, self.sent, self.resets = parse_rate("400mbit"), stalled, 17646467, 0

    def queue_stats(self):
        self.sent += 0 if self.stalled else 9014
        held = "backlog 384119b 52p requeues 0" if self.stalled or not self.resets else "backlog 0b 0p requeues 0"
        return (f"qdisc tbf 8022: root refcnt 2 rate 400Mbit burst 21Kb lat 1s \n Sent {self.sent} bytes 3118 pkt "
                f"(dropped 0, overlimits 2446677 requeues 0) \n {held}\n")

    def reset_rate(self):
        self.resets += 1
        self.stalled = False


@pytest.mark.parametrize("stalled", [True, False])
def test_the_rate_cycler_replaces_a_tbf_that_holds_packets_and_sends_none(stalled, tmp_path):
    import time

    from bench.whatif_bench import RateCycler

    ns = HeldQueue(stalled)
    # No step line for 0.2 s: the cycler looks at the qdisc, and again 0.05 s later.
    cycler = RateCycler(ns, [ns.rate], first_block=5, block=5, log_path=tmp_path / "training_rank_0.log",
                        stall_after_s=0.2, stall_check_s=0.05)
    cycler.start_first()
    time.sleep(1.0)
    cycler.finished.set()
    cycler.join()
    assert cycler.error is None
    if stalled:
        assert ns.resets == 1 and len(cycler.stalls) == 1  # replaced once; the new qdisc sends
        assert cycler.stalls[0][1] == ns.rate and "holding 384,119 bytes in 52 packets" in cycler.stalls[0][2]
    else:
        assert ns.resets == 0 and cycler.stalls == []      # a busy link is left alone, however long the step


def test_the_rate_cycler_looks_at_the_qdisc_after_a_few_typical_steps_not_after_the_slowest(tmp_path):
    """A run's second stall came after steps of 40 ms and the first stall's own step of 14 s: the cycler looks once
    no step line has come for stall_after_s plus three typical steps (0.2 + 3 x 40 ms here), not three of the
    slowest (42 s), so the stall is cleared within a second."""
    import time

    from bench.whatif_bench import RateCycler

    log = tmp_path / "training_rank_0.log"
    log.write_text("".join(f"2026-11-28 16:39:{n:02d},000 rank 0/2 INFO utils.trainer: step {n}/100 | loss 7.0 | "
                           f"{ms} ms/step | cpu 30.0 ms/step\n"
                           for n, ms in enumerate(["41.8", "40.2", "14,077.6", "39.5", "40.8"], start=1)))
    ns = HeldQueue(stalled=True)
    cycler = RateCycler(ns, [ns.rate], first_block=50, block=50, log_path=log, stall_after_s=0.2, stall_check_s=0.05)
    cycler.start_first()
    time.sleep(1.0)
    cycler.finished.set()
    cycler.join()
    assert cycler.error is None and cycler.seen == 5
    assert ns.resets == 1 and len(cycler.stalls) == 1


def test_resetting_the_rate_puts_a_new_qdisc_of_the_same_rate_on_lo():
    from bench.netem import Namespace, missing_requirement, parse_rate, queue_counters

    problem = missing_requirement()
    if problem:
        pytest.skip(f"needs a rate-limited network namespace: {problem}")
    with Namespace() as ns:
        ns.set_rate(parse_rate("100mbit"))
        send = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                "[s.sendto(b'x' * 1000, ('127.0.0.1', 9)) for _ in range(10)]")
        subprocess.run(ns.command([sys.executable, "-c", send]), check=True, capture_output=True, timeout=30)
        assert queue_counters(ns.queue_stats())[0] > 0  # the old qdisc sent the datagrams
        ns.reset_rate()
        shown = ns.queue_stats()
        assert "tbf" in shown and "rate 100Mbit" in shown and queue_counters(shown) == (0, 0)
        assert ns.rate == parse_rate("100mbit")


def test_every_change_of_rate_puts_a_new_tbf_on_lo():
    """A tbf whose rate tc changed in place stalled in 23 of 400 blocks of gloo all-reduces (bench/tbf_stalls.py): the
    namespace deletes it and adds a new one, whose counters start at zero, at every change between two rates."""
    from bench.netem import Namespace, missing_requirement, parse_rate, queue_counters

    problem = missing_requirement()
    if problem:
        pytest.skip(f"needs a rate-limited network namespace: {problem}")
    send = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
            "[s.sendto(b'x' * 1000, ('127.0.0.1', 9)) for _ in range(10)]")
    with Namespace() as ns:
        for rate, shown_as in (("1gbit", "rate 1Gbit"), ("400mbit", "rate 400Mbit"), ("100mbit", "rate 100Mbit")):
            ns.set_rate(parse_rate(rate))
            shown = ns.queue_stats()
            assert shown_as in shown and queue_counters(shown)[0] == 0, shown
            subprocess.run(ns.command([sys.executable, "-c", send]), check=True, capture_output=True, timeout=30)
            assert queue_counters(ns.queue_stats())[0] > 0  # this qdisc sent the datagrams


@pytest.mark.slow
def test_tbf_stalls_runs_gloo_traffic_through_both_ways_of_changing_the_rate():
    from bench.netem import missing_requirement

    problem = missing_requirement()
    if problem:
        pytest.skip(f"tbf_stalls needs a rate-limited network namespace: {problem}")
    result = run_bench("tbf_stalls.py", "--cycles", "1", "--block", "3", timeout=600)
    assert result.returncode == 0, result.stderr
    rows = {row[0]: row for row in table_rows(result.stdout, "") if row[0] in ("in-place", "new")}
    assert set(rows) == {"in-place", "new"}
    for row in rows.values():
        # 4 rates, 1 cycle: 4 blocks of 3 steps after the first 10, one more to end the last block cleanly
        assert row[1:3] == ["4", "23"] and int(row[4]) >= 0 and float(row[3]) > 0


def test_a_step_during_which_a_stalled_qdisc_was_replaced_is_left_out_of_its_block():
    from bench.netem import parse_rate
    from bench.whatif_bench import RealRuns, add_blocks

    rate = parse_rate("400mbit")
    switches = [(100.0, rate, 1.0, 0)]
    steps = [(n, 100.0 + n - 1, 100.0 + n - 0.9) for n in range(1, 6)]  # 100 ms steps, one a second
    steps[3] = (4, 103.0, 110.0)  # the stalled one: 7 s, until the qdisc was replaced at 109.5 s
    blocks = {rate.label: RealRuns(rate)}
    add_blocks(blocks, switches, steps, 0, first_measured=0, skip=0, settle=0,
               stalls=[(109.5, rate, "lo's qdisc tbf: ... holding 384,119 bytes in 52 packets")])
    assert [round(s, 3) for s in blocks[rate.label].steps] == [0.1, 0.1, 0.1, 0.1]
    assert blocks[rate.label].stalls == ["lo's qdisc tbf: ... holding 384,119 bytes in 52 packets"]


def test_a_hung_run_names_what_los_queue_holds():
    from bench.netem import describe_queue

    # `tc -s qdisc show dev lo` where a run hung (2026-11-23): tbf held 52 packets and sent nothing more.
    shown = ("qdisc tbf 8022: root refcnt 2 rate 400Mbit burst 21Kb lat 1s \n"
             " Sent 17646467 bytes 3118 pkt (dropped 0, overlimits 2446677 requeues 0) \n"
             " backlog 384119b 52p requeues 0\n")
    assert describe_queue(shown) == ("lo's qdisc tbf: sent 17,646,467 bytes in 3,118 packets, dropped 0, "
                                     "overlimits 2,446,677, holding 384,119 bytes in 52 packets")
    assert describe_queue("") == ""


def test_a_stalled_queue_is_seen_whatever_unit_tc_gives_its_backlog_in():
    from bench.netem import describe_queue, queue_counters

    # Where a tiny run hung at 400 Mbit/s (2026-11-26): tc wrote the backlog in Kb (60,416 bytes is 59 x 1,024)
    # and the stall went unseen for 8 minutes, the packets held read as none.
    shown = ("qdisc tbf 829a: root refcnt 2 rate 400Mbit burst 21Kb lat 1s \n"
             " Sent 19094171 bytes 3176 pkt (dropped 0, overlimits 1359976 requeues 0) \n"
             " backlog 59Kb 27p requeues 0\n")
    assert queue_counters(shown) == (19094171, 27)
    assert describe_queue(shown).endswith("holding 60,416 bytes in 27 packets")
    assert queue_counters(shown.replace("59Kb 27p", "2Mb 1500p")) == (19094171, 1500)


def test_whatif_docs_block_rewrites_only_its_models_part(tmp_path):
    from bench.whatif_bench import DOCS_BEGIN, DOCS_END, write_docs

    docs = tmp_path / "BENCHMARKS.md"
    docs.write_text("# Benchmarks\n\n## 1. Throughput\n\nkept as it is\n", encoding="utf-8")
    write_docs(docs, "tiny", "### GPT-2 tiny\n\nfirst tiny table")
    write_docs(docs, "gpt2-124m-shape", "### GPT-2 124M shape\n\n124M table")
    write_docs(docs, "tiny", "### GPT-2 tiny\n\nsecond tiny table")
    text = docs.read_text(encoding="utf-8")
    assert text.startswith("# Benchmarks\n\n## 1. Throughput\n\nkept as it is\n")
    assert text.count(DOCS_BEGIN) == text.count(DOCS_END) == 1
    assert "second tiny table" in text and "first tiny table" not in text and "124M table" in text
    assert text.index("second tiny table") < text.index("124M table") < text.index(DOCS_END)


def test_whatif_docs_overview_counts_every_parts_points_from_the_reports_own_lines(tmp_path):
    from bench.whatif_bench import against_same_process_line, against_untraced_line, write_docs

    docs = tmp_path / "BENCHMARKS.md"
    # tiny: one replay out of its 5% band (1.07) and one other rate out of its 10% band (0.85)
    write_docs(docs, "tiny", "### GPT-2 tiny\n\nMeasured 2026-11-20 07:50 UTC, as root\n\n"
               "- code: 1a2b3c4 with uncommitted changes (the tracer, the converter and this benchmark)\n\n"
               + against_untraced_line([1.07, 1.01], [0.85, 0.98, 1.02]) + "\n\n"
               + against_same_process_line([1.00, 1.02], [0.99, 0.98, 1.12]))
    # a part without the same-process line (a run with --after-window-cycles 0)
    write_docs(docs, "gpt2-124m-shape", "### GPT-2 124M shape\n\nMeasured 2026-11-21 05:00 UTC\n\n"
               + against_untraced_line([0.97], [1.04, 0.91]))
    write_docs(docs, "bert-tiny", "### BERT tiny\n\nan older part without the report's lines")
    text = docs.read_text(encoding="utf-8")
    table = text[text.index("| run "):text.index("<!-- whatif:tiny:begin -->")]
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in table.splitlines()[2:] if line.startswith("|")}
    assert rows["GPT-2 tiny"] == ["2026-11-20", "1a2b3c4 with uncommitted changes", "1.01x to 1.07x", "0.85x to 1.02x",
                                  "3 of 5", "4 of 5"]
    assert rows["GPT-2 124M shape"] == ["2026-11-21", "-", "0.97x", "0.91x to 1.04x", "3 of 3", "-"]
    assert "BERT tiny" not in rows
    assert rows["all runs"][-2:] == ["6 of 8", "4 of 5"]
    # rewriting a part updates the overview
    write_docs(docs, "tiny", "### GPT-2 tiny\n\nMeasured 2026-11-22 07:50 UTC\n\n"
               + against_untraced_line([1.01, 1.02], [0.95, 0.98, 1.02]))
    text = docs.read_text(encoding="utf-8")
    assert "| all runs " in text and "8 of 8" in text and text.count("| GPT-2 tiny ") == 1
    assert "(target within 5%) and the other rates (within 10%)" in " ".join(text.split())


def test_source_revision_names_the_commit_and_uncommitted_changes(tmp_path):
    from bench.common import source_revision

    assert source_revision(tmp_path) == "not a git checkout"
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "RESULTS.md").write_text("before\n")
    for argv in (["init", "-q"], ["add", "a.py", "RESULTS.md"], ["commit", "-q", "-m", "a"]):
        subprocess.run(["git", "-C", str(tmp_path), *argv], check=True, env=env)
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"], check=True, env=env,
                          capture_output=True, text=True).stdout.strip()
    assert source_revision(tmp_path) == head
    (tmp_path / "RESULTS.md").write_text("a result written in\n")
    assert source_revision(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert source_revision(tmp_path) == f"{head} with uncommitted changes"


def fake_whatif_runs(rates: list, runs: list):
    """An interleaved_runs stand-in that 'finishes' the given runs ("traced" or "untraced"), reporting each as the real
    one does, and then stops as a SIGTERM would; every other step of main is stubbed out in the caller."""
    from bench.whatif_bench import Progress, RealRuns, TracedRun

    def runs_then_sigterm(ns, setup, trace_rate, rates_, args, env, root_, on_run_done=None):
        traces, real = [], {rate.label: RealRuns(rate) for rate in rates}
        untraced = 0
        for kind in runs:
            if kind == "traced":
                folder = root_ / f"traced-{len(traces)}" / "traces" / "t"
                traces.append(TracedRun(len(traces), trace_rate, folder, before_window_ms=40.0,
                                        after_window={r.label: RealRuns(r, segment_ms=[38.0 * (i + 1)])
                                                      for i, r in enumerate(rates)}))
            else:
                untraced += 1
                for i, rate in enumerate(rates):
                    real[rate.label].segment_ms.append(36.0 * (i + 1) + untraced)
            on_run_done(traces, real, Progress(len(traces), args.traces, untraced, args.repeats))
        raise SystemExit(143)  # what exit_on_sigterm's handler raises on SIGTERM

    return runs_then_sigterm


@pytest.mark.parametrize("runs, partial", [
    (["traced"], None),                                   # no real step yet: nothing to judge, nothing written
    (["traced", "untraced"], {"traced": 1, "traced_planned": 2, "untraced": 1, "untraced_planned": 2}),
    (["traced", "untraced", "traced"], {"traced": 2, "traced_planned": 2, "untraced": 1, "untraced_planned": 2}),
])
def test_whatif_bench_stopped_by_sigterm_keeps_what_its_finished_runs_measured(tmp_path, monkeypatch, capsys, runs,
                                                                               partial):
    """A benchmark cut short (a `timeout`, a scheduler's SIGTERM) keeps, with --keep, the results of every run that
    finished, in the file whatif_repredict.py judges, and its one error line says where; an earlier run's results
    file in the folder does not stand for this one's."""
    import bench.whatif_bench as whatif
    from bench.whatif_repredict import read_results

    class FakeNamespace:
        name, mtu, offload_note = "fake", 9000, "no offload"

        def __init__(self, *args):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / whatif.RESULTS_FILE).write_text('{"from": "an earlier run"}')
    rates = [whatif.parse_rate("unthrottled"), whatif.parse_rate("100mbit")]
    monkeypatch.setattr(whatif, "exit_on_sigterm", lambda: None)
    monkeypatch.setattr(whatif, "missing_requirement", lambda: None)
    monkeypatch.setattr(whatif, "Namespace", FakeNamespace)
    monkeypatch.setattr(whatif, "verify_rates", lambda ns, rates_, seconds: ([], {"unthrottled": 20e9,
                                                                                "100 Mbit/s": 99e6}))
    monkeypatch.setattr(whatif, "micro_benchmark", lambda *args, **kwargs: ([], 24e9))
    monkeypatch.setattr(whatif, "interleaved_runs", fake_whatif_runs(rates, runs))
    with pytest.raises(SystemExit) as stopped:
        whatif.main(["--rates", "unthrottled,100mbit", "--micro-rate", "100mbit", "--traces", "2", "--repeats", "2", "--keep", str(kept),
                     "--no-docs"])
    assert stopped.value.code == 143
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert line.startswith("error: bench/whatif_bench.py: stopped by SIGTERM; the runs were stopped")
    results_path = kept / whatif.RESULTS_FILE
    if partial is None:
        assert not results_path.exists() and f"{results_path} was not written" in line
        return
    results = read_results(kept)
    assert results["partial"] == partial
    assert len(results["traces"]) == partial["traced"]
    assert [r["real_ms"] for r in results["rates"]] == [36.0 + 1, 72.0 + 1]  # the one untraced run's blocks
    assert [r["bits_per_s"] for r in results["rates"]] == [24e9, 99e6]
    assert results["traces"][0]["same_run_ms"] == {"unthrottled": 38.0, "100 Mbit/s": 76.0}
    assert line.endswith(f"what {partial['traced']} of 2 traced and 1 of 2 untraced runs measured is in "
                         f"{results_path}: judge it with `python bench/whatif_repredict.py {kept}`")


def test_whatif_results_of_every_run_carry_no_partial_mark(tmp_path):
    """The file written after the last planned run is the complete one the bench always wrote."""
    from bench.whatif_bench import MODELS, Progress, RealRuns, TracedRun, parse_rate, write_results

    rate = parse_rate("unthrottled")
    trace = TracedRun(0, rate, tmp_path / "traced-0" / "traces" / "t", after_window={"unthrottled": RealRuns(rate)})
    real = {"unthrottled": RealRuns(rate, segment_ms=[30.0, 32.0])}
    path = write_results(tmp_path, MODELS["tiny"], rate, [rate], [trace], real, {"unthrottled": 2e10}, 500.0,
                         Progress(1, 1, 1, 1))
    results = json.loads(path.read_text())
    assert "partial" not in results and results["rates"][0]["real_ms"] == 31.0
    assert results["traces"][0]["folder"] == "traced-0/traces/t" and results["traces"][0]["same_run_ms"] == {
        "unthrottled": None}


@pytest.mark.parametrize("script, arguments", [("whatif_repredict", ["kept"]), ("whatif_bench", ["--quick"])])
def test_a_bench_script_that_would_import_another_checkouts_bench_package_refuses(tmp_path, script, arguments):
    """Run by its path, a bench script imports `bench` from wherever the environment finds it: with a virtual
    environment shared by two checkouts (an editable install of one, or PYTHONPATH), the other checkout's script
    would run this checkout's trainer and converter and report them as its own. It stops with a line naming
    both, before it measures anything."""
    from bench.common import REPO_ROOT, foreign_checkout

    assert foreign_checkout(str(REPO_ROOT / "bench" / f"{script}.py")) is None
    other = tmp_path / "other"
    shutil.copytree(REPO_ROOT / "bench", other / "bench")
    done = subprocess.run([sys.executable, str(other / "bench" / f"{script}.py"), *arguments], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 1
    assert done.stderr.strip() == (f"error: bench/{script}.py of {other} imports the bench package of {REPO_ROOT} "
                                   f"(an editable install of that checkout), so it would run that checkout's code; "
                                   f"run it from {other} as `python -m bench.{script}`, or with PYTHONPATH={other}")
