"""Compute after a pause: the tracer's measurement (utils/wake_cost.py), the .et metadata the converter writes from
it, and the cost simulate.py gives the simulated network's pauses instead of the traced one's
(trace_tools.wake_cost)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from chakra.schema.protobuf.et_def_pb2 import COMP_NODE

from conversion_helpers import CPU_FIXTURES, read_et_with_protolib
from trace_tools import simulate
from trace_tools.discover import read_run_info
from trace_tools.simulate import simulate_run
from trace_tools.wake_cost import WAKE_COST_ATTR, WakeCost, training_thread
from utils import wake_cost

REPO = Path(__file__).resolve().parent.parent

# As the tracer wrote it on the 2-core VM (seconds): 4 pauses, the cost over the first 1-4 steps of ~10 ms after each
MEASURED = {"pauses_s": [0.005, 0.02, 0.06, 0.15], "compute_s": [0.0095, 0.019, 0.0285, 0.038],
            "extra_cpu_s": [[0.0, 0.0002, 0.0004, 0.0016], [0.0006, 0.0015, 0.002, 0.0025],
                            [0.0026, 0.0033, 0.0035, 0.0043], [0.0036, 0.004, 0.0049, 0.0057]]}


# --- the measurement ------------------------------------------------------------------------------------------

def test_the_cost_is_the_cpu_time_beyond_the_back_to_back_step_summed_over_the_steps_after_each_pause():
    """A step of 10 ms that takes 3 ms more right after a pause of 0.1 s or more, 1 ms more in the step after that,
    and 1 ms more after a shorter pause: the cost is summed step by step, against the back-to-back step."""
    clock = {"since_pause": None, "pause": 0.0}

    def sleep(seconds):
        clock["since_pause"], clock["pause"] = 0, seconds

    def step():
        k = clock["since_pause"]
        if k is None:
            return 0.010
        clock["since_pause"] = k + 1
        if clock["pause"] >= 0.1:
            return 0.010 + (0.003, 0.001)[k] if k < 2 else 0.010
        return 0.011 if k == 0 else 0.010

    measured = wake_cost.wake_cost_of(step, (0.1, 0.01), steps_after=3, cycles=2, sleep=sleep)
    assert measured["pauses_s"] == [0.01, 0.1]
    assert measured["compute_s"] == pytest.approx([0.010, 0.020, 0.030])
    assert measured["extra_cpu_s"] == [pytest.approx([0.001, 0.001, 0.001]), pytest.approx([0.003, 0.004, 0.004])]


def measured_after(times_after: dict[float, list[float]]) -> dict:
    """wake_cost_of on a 10 ms step whose first steps after a pause of p take times_after[p] (one cycle)."""
    clock = {"pause": None, "k": 0}

    def sleep(seconds):
        clock["pause"], clock["k"] = seconds, 0

    def step():
        if clock["pause"] is None or clock["k"] >= len(times_after[clock["pause"]]):
            return 0.010
        clock["k"] += 1
        return times_after[clock["pause"]][clock["k"] - 1]

    return wake_cost.wake_cost_of(step, tuple(times_after), steps_after=2, cycles=1, sleep=sleep)


def test_a_longer_pause_or_more_compute_never_costs_less_than_the_measurement_before_it():
    """Noise makes a later step faster than the back-to-back one, or a longer pause cheaper: what is kept is the
    nearest table that never decreases along either (the runs that break the order pooled into their mean, not the
    larger of them kept, which would turn the noise into a cost)."""
    measured = measured_after({0.01: [0.012, 0.009], 0.1: [0.011, 0.010]})
    # as measured, cumulative: [2, 1] ms after 10 ms, [1, 1] ms after 100 ms; each pause's pooled to [1.5, 1.5] and
    # [1, 1], then each amount of compute's across the pauses to 1.25
    assert measured["extra_cpu_s"] == [pytest.approx([0.00125, 0.00125]), pytest.approx([0.00125, 0.00125])]
    assert measured["cycles"] == 1


def test_a_step_faster_after_a_pause_than_back_to_back_costs_nothing_rather_than_less_than_nothing():
    measured = measured_after({0.01: [0.009, 0.009], 0.1: [0.0105, 0.0105]})
    assert measured["extra_cpu_s"] == [pytest.approx([0.0, 0.0]), pytest.approx([0.0005, 0.001])]


def test_the_nearest_nondecreasing_sequence_pools_each_run_that_breaks_the_order():
    assert wake_cost.nondecreasing_nearest([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert wake_cost.nondecreasing_nearest([5.0, 1.0, 0.0, 6.0]) == [2.0, 2.0, 2.0, 6.0]
    assert wake_cost.nondecreasing_nearest([0.0, 1.0, 1.0]) == [0.0, 1.0, 1.0]


def test_the_probe_times_a_real_training_step_and_leaves_the_runs_random_numbers_alone():
    state = torch.random.get_rng_state()
    measured = wake_cost.measure_wake_cost_s(pauses_s=(0.001, 0.01), steps_after=2, cycles=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert measured["pauses_s"] == [0.001, 0.01]
    assert 0 < measured["compute_s"][0] < measured["compute_s"][1] < 1  # a step's CPU time, and two of them
    assert all(0 <= extra < 1 for row in measured["extra_cpu_s"] for extra in row)
    assert WakeCost.from_run_info(measured) is not None  # what the converter reads


# --- reading it -----------------------------------------------------------------------------------------------

def test_the_cost_is_linear_between_the_measured_points_none_without_a_pause_and_level_beyond():
    cost = WakeCost.from_run_info(MEASURED)
    assert cost.extra(0.0, 20_000) == 0.0
    assert cost.extra(150_000, 38_000) == pytest.approx(5_700)
    assert cost.extra(1_000_000, 1_000_000) == pytest.approx(5_700)  # beyond the longest pause and the most compute
    assert cost.extra(60_000, 9_500) == pytest.approx(2_600)
    assert cost.extra(105_000, 9_500) == pytest.approx((2_600 + 3_600) / 2)  # half way between 60 and 150 ms
    assert cost.extra(150_000, 4_750) == pytest.approx(3_600 / 2)  # half the first step's compute
    assert cost.extra(2_500, 38_000) == pytest.approx(1_600 / 2)  # half the shortest pause
    assert WakeCost.from_json(cost.to_json()) == cost
    assert cost.describe() == "150 ms pause: +5.7 ms of CPU over the first 38 ms of compute"


@pytest.mark.parametrize("damage", [
    lambda m: m.pop("compute_s"),
    lambda m: m.update(pauses_s=[0.15, 0.005, 0.02, 0.06]),          # not ascending
    lambda m: m["extra_cpu_s"].pop(),                                # a pause without its row
    lambda m: m["extra_cpu_s"][0].append(0.1),                       # a row longer than the compute
    lambda m: m["extra_cpu_s"][1].__setitem__(0, -0.001),            # a negative cost
    lambda m: m.update(pauses_s="0.1"),
])
def test_a_damaged_measurement_is_named_in_run_json_and_not_used(damage, tmp_path):
    measured = json.loads(json.dumps(MEASURED))
    damage(measured)
    assert WakeCost.from_run_info(measured) is None
    (tmp_path / "run.json").write_text(json.dumps({"ranks": [{"rank": 0, "wake_cost": measured}]}))
    _, problem = read_run_info(tmp_path / "run.json")
    assert "ranks[0].wake_cost is" in problem and "utils/wake_cost.py" in problem


# --- the converter and the simulation ---------------------------------------------------------------------------

def traced_run(folder: Path, measured: dict | None, untraced_step_s: float = 0.4) -> Path:
    """The bundled two-rank GPT-2 run with each rank's run.json entry timed as a CPU tracer times it: untraced steps
    of untraced_step_s (the training thread waiting for the network well over 150 ms of it), its wait for a
    core, gloo's CPU time and, when given, the wake cost; converted by convert_to_et.py."""
    shutil.copytree(CPU_FIXTURES / "gpt2_tiny_2r", folder)
    info = json.loads((folder / "run.json").read_text())
    for entry in info["ranks"]:
        traced = entry["step_wall_time_s"]
        entry.update(step_thread_cpu_time_s=[0.04] * len(traced), step_run_queue_wait_s=[0.001] * len(traced),
                     untraced_step_wall_time_s=[1.0] + [untraced_step_s] * 4,
                     untraced_step_thread_cpu_time_s=[0.5] + [0.025] * 4,
                     untraced_step_run_queue_wait_s=[0.0] + [0.0005] * 4,
                     untraced_step_communication_cpu_time_s=[0.0] + [0.002] * 4,
                     collective_start_wait_s=0.0015)
        if measured is not None:
            entry["wake_cost"] = measured
    info["untraced_steps"] = [0, 1, 2, 3, 4]
    (folder / "run.json").write_text(json.dumps(info))
    proc = subprocess.run([sys.executable, "convert_to_et.py", str(folder), "--jobs", "1", "--no-progress"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("wake")
    return {"measured": traced_run(base / "gpt2_tiny_2r", MEASURED),
            "unmeasured": traced_run(base / "older" / "gpt2_tiny_2r", None)}


def test_the_converter_writes_the_measured_cost_into_every_ets_metadata_and_says_so(runs):
    for rank in (0, 1):
        metadata, _ = read_et_with_protolib(runs["measured"] / f"gpt2_tiny_2r.{rank}.et")
        [attr] = [a for a in metadata.attr if a.name == WAKE_COST_ATTR]
        assert WakeCost.from_json(attr.string_val) == WakeCost.from_run_info(MEASURED)
        older, _ = read_et_with_protolib(runs["unmeasured"] / f"gpt2_tiny_2r.{rank}.et")
        assert not [a for a in older.attr if a.name == WAKE_COST_ATTR]
    summary = (runs["measured"] / "CONVERSION_SUMMARY.md").read_text()
    assert ("compute after a pause took more CPU on this machine (150 ms pause: +5.7 ms of CPU over the first 38 ms "
            "of compute; run.json, utils/wake_cost.py)") in summary
    assert "compute after a pause" not in (runs["unmeasured"] / "CONVERSION_SUMMARY.md").read_text()


def finishing_after(folder: Path, pause_ns: int) -> Path:
    """A stand-in for ASTRA-sim that finishes each rank pause_ns after the durations of its .et's COMP nodes, summed
    (a step whose compute is all on the path, followed by a wait for the network), and keeps the workload it got."""
    fake = folder / "astra"
    fake.write_text(f"""#!{sys.executable}
import sys
from chakra.schema.protobuf.et_def_pb2 import COMP_NODE, GlobalMetadata, Node
from chakra.src.third_party.utils.protolib import decodeMessage, openFileRd
workload = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--workload-configuration="))
open("workloads.txt", "a").write(workload + "\\n")
for rank in (0, 1):
    f = openFileRd(f"{{workload}}.{{rank}}.et")
    decodeMessage(f, GlobalMetadata())
    compute_ns, node = 0, Node()
    while decodeMessage(f, node):
        compute_ns += node.duration_micros * 1000 if node.type == COMP_NODE else 0
    print(f"sys[{{rank}}] finished, {{compute_ns + {pause_ns}}} cycles, exposed communication 0 cycles.")
""")
    fake.chmod(0o755)
    return fake


def test_a_simulated_network_that_waits_less_than_the_traced_one_gives_the_compute_less_cpu(runs, tmp_path):
    """Traced with the training thread waiting for the network over 150 ms a step, simulated on a network it waits
    3 ms for (and for the communication threads' CPU nodes): its compute is given the cost of a 3 ms pause instead of the traced one's, and the simulation
    is run again on the changed copies; the pause is the same then (the compute moved the finish by as much), so
    two simulations settle it."""
    run = runs["measured"]
    fake = finishing_after(tmp_path, 3_000_000)
    plain = simulate_run(run, bandwidth_gbs=1.0, binary=fake, work_dir=tmp_path / "plain", wake_cost=False,
                         communication_cpu_bound=False)
    result = simulate_run(run, bandwidth_gbs=1.0, binary=fake, work_dir=tmp_path / "w", invocation="simulate.py run",
                          communication_cpu_bound=False)
    cost = WakeCost.from_run_info(MEASURED)
    assert result.wake is not None and result.wake.simulations == 2
    for rank in (0, 1):
        metadata, nodes = read_et_with_protolib(run / f"gpt2_tiny_2r.{rank}.et")
        meta = {a.name: getattr(a, a.WhichOneof("value")) for a in metadata.attr}
        thread = training_thread([n.SerializeToString() for n in nodes], meta)
        wake = result.wake.ranks[rank]
        assert wake.traced_pause_us == pytest.approx(400_000 - thread.compute_us) and wake.traced_pause_us > 150_000
        others = sum(n.duration_micros for n in nodes if n.type == COMP_NODE) - thread.compute_us
        pause = 3_000 + others  # what the stand-in finishes the rank after, beyond the training thread's compute
        assert wake.simulated_pause_us == pytest.approx(pause, abs=2)
        expected = cost.extra(pause, thread.compute_us) - cost.extra(wake.traced_pause_us, thread.compute_us)
        assert expected < -3_000
        assert wake.change_us == pytest.approx(expected)
        # the changed copies' training thread lasts that much less (each node rounded to the µs), nothing else
        _, copied = read_et_with_protolib(tmp_path / "w" / simulate.WAKE_COST_DIR / f"gpt2_tiny_2r.{rank}.et")
        changed = training_thread([n.SerializeToString() for n in copied], meta)
        assert changed.compute_us == pytest.approx(thread.compute_us + expected, abs=1)
        assert (result.per_rank_ns[rank] - plain.per_rank_ns[rank]) / 1e3 == pytest.approx(expected, abs=1)
    assert result.step_ms < plain.step_ms - 3
    text = (run / "SIMULATION.md").read_text()
    assert (f"compute after a pause: the training thread paused {result.wake.ranks[0].simulated_pause_us / 1000:.1f}"
            " ms a step in this simulation against") in text
    assert "(2 simulations; trace_tools.wake_cost; --no-wake-cost simulates the .et as written)" in text
    assert plain.wake is None


def test_a_simulated_network_that_waits_as_long_as_the_traced_one_simulates_the_et_as_written(runs, tmp_path):
    run = runs["measured"]
    metadata, nodes = read_et_with_protolib(run / "gpt2_tiny_2r.0.et")
    meta = {a.name: getattr(a, a.WhichOneof("value")) for a in metadata.attr}
    thread = training_thread([n.SerializeToString() for n in nodes], meta)
    others = sum(n.duration_micros for n in nodes if n.type == COMP_NODE) - thread.compute_us
    fake = finishing_after(tmp_path, round((thread.traced_pause_us - others) * 1000))
    result = simulate_run(run, bandwidth_gbs=1.0, binary=fake, work_dir=tmp_path / "w", communication_cpu_bound=False)
    assert result.wake.simulations == 1 and abs(result.wake.ranks[0].change_us) < 1
    assert (tmp_path / "w" / "workloads.txt").read_text().count("\n") == 1  # ASTRA-sim ran once


def test_a_run_traced_without_the_measurement_is_simulated_as_written(runs, tmp_path):
    fake = finishing_after(tmp_path, 3_000_000)
    result = simulate_run(runs["unmeasured"], bandwidth_gbs=1.0, binary=fake, work_dir=tmp_path / "w",
                          invocation="simulate.py run", communication_cpu_bound=False)
    assert result.wake is None
    assert "compute after a pause" not in (runs["unmeasured"] / "SIMULATION.md").read_text()


@pytest.mark.usefixtures("astra_sim")
def test_astra_sim_predicts_a_fast_network_faster_with_the_cost_of_its_short_pauses(runs, tmp_path):
    """The real simulator: on a network far faster than the traced one the thread hardly waits, so its compute loses
    the cost of the traced pauses and the step is shorter than the .et as written predicts; the command line says
    what it did."""
    folder = tmp_path / "run"
    shutil.copytree(runs["measured"], folder)
    proc = subprocess.run([sys.executable, "simulate.py", str(folder), "--bandwidth", "100Gbit/s"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "compute after a pause: the training thread paused" in proc.stdout
    predicted = float(proc.stdout.split("predicted step: ", 1)[1].split(" ms", 1)[0].replace(",", ""))
    plain = subprocess.run([sys.executable, "simulate.py", str(folder), "--bandwidth", "100Gbit/s", "--no-wake-cost"],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    assert "compute after a pause" not in plain.stdout
    as_written = float(plain.stdout.split("predicted step: ", 1)[1].split(" ms", 1)[0].replace(",", ""))
    assert predicted < as_written - 3


def test_the_converter_takes_the_mean_of_what_the_ranks_on_one_machine_measured():
    """Each rank measures the machine at the same time; their mean is the machine's. A rank on another host keeps its
    own, and so does a rank whose measurement is of other pauses."""
    from trace_tools.step_timing import machine_wake_cost

    doubled = json.loads(json.dumps(MEASURED))
    doubled["extra_cpu_s"] = [[2 * e for e in row] for row in doubled["extra_cpu_s"]]
    other_pauses = dict(MEASURED, pauses_s=[0.01, 0.02, 0.06, 0.15])
    info = {"ranks": [{"rank": 0, "hostname": "a", "wake_cost": MEASURED},
                      {"rank": 1, "hostname": "a", "wake_cost": doubled},
                      {"rank": 2, "hostname": "b", "wake_cost": doubled},
                      {"rank": 3, "hostname": "a", "wake_cost": other_pauses}]}
    cost = WakeCost.from_run_info(MEASURED)
    mean = machine_wake_cost(info, info["ranks"][0])
    assert mean == machine_wake_cost(info, info["ranks"][1])
    assert mean.extra(150_000, 38_000) == pytest.approx(1.5 * 5_700)
    assert mean.extra(60_000, 9_500) == pytest.approx(1.5 * cost.extra(60_000, 9_500))
    assert machine_wake_cost(info, info["ranks"][2]).extra(150_000, 38_000) == pytest.approx(2 * 5_700)
    assert machine_wake_cost(info, info["ranks"][3]) == WakeCost.from_run_info(other_pauses)
    assert machine_wake_cost(info, {"rank": 4, "hostname": "a"}) is None
