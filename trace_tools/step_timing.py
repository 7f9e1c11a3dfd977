"""Step wall times a traced run measured (run.json): what the .et durations are corrected towards."""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .layout import RUN_INFO, STEP_ANNOTATION
from .wake_cost import WakeCost

# Traced steps that differ by more than this share of their median make any one of them a poor sample of the run:
# the same bound as the fidelity the .et is held to (a prediction within ±10% of a real run).
STEP_SPREAD_BOUND = 0.10


@dataclass
class StepTimes:
    """One rank's measured step times in µs: traced (inside the profiler's window) and untraced (before it and, in
    runs of tracers that time them, after it)."""

    traced_us: list[float]
    untraced_us: list[float]
    traced_cpu_us: list[float] | None = None    # CPU time of the rank's process in the same steps, when measured
    untraced_cpu_us: list[float] | None = None
    traced_thread_cpu_us: list[float] | None = None  # CPU time of the training thread alone, when measured
    untraced_thread_cpu_us: list[float] | None = None
    recording_cost_per_op_us: float | None = None  # the tracer's measurement of one recorded operator's cost
    # Time the training thread waited for a core in each step (Linux's run-queue wait), when measured
    traced_run_queue_us: list[float] | None = None
    untraced_run_queue_us: list[float] | None = None
    # CPU time of the communication backend's threads (gloo) in each step, when measured
    traced_communication_cpu_us: list[float] | None = None
    untraced_communication_cpu_us: list[float] | None = None
    # Time those threads waited for a core in each step (summed over the threads), when measured
    traced_communication_run_queue_us: list[float] | None = None
    untraced_communication_run_queue_us: list[float] | None = None
    # How long an all-reduce issued after compute waited to start (its mean time beyond its fastest), when measured
    # (multi-rank CPU runs; utils/collective_start.py)
    collective_start_wait_us: float | None = None
    # How much more CPU compute took after a pause, by the pause (multi-rank CPU runs; utils/wake_cost.py)
    wake_cost: WakeCost | None = None
    # Minor page faults of the training thread in each step, when measured
    traced_page_faults: list[int] | None = None
    untraced_page_faults: list[int] | None = None
    intra_op_threads: int | None = None  # torch's intra-op threads in the rank's process, when recorded
    # The machine's time in interrupt and softirq context in each step (all its CPUs), when measured, and how many
    # ranks ran on the machine, sharing it
    traced_interrupt_cpu_us: list[float] | None = None
    untraced_interrupt_cpu_us: list[float] | None = None
    ranks_on_machine: int = 1
    # The share of the machine's CPUs other processes used during the traced window, and whether the tracer judged
    # the machine busy for it (run.json's machine_load), when measured
    other_processes_cpu_share: float | None = None
    machine_busy: bool | None = None
    usable_cpus: int | None = None  # the CPUs the rank's process could run on (run.json's machine_load), when recorded
    # How much longer a step's slowest rank computes than the slowest rank's median (_slowest_rank_scale)
    slowest_rank_scale: float = 1.0
    # Untraced steps after the run's first left out because they took other micro-batches than the traced step
    untraced_left_out: int = 0

    @property
    def untraced_op_time_us(self) -> float | None:
        """What the training thread's ops take in an untraced step, from its CPU time: None unless the run measured
        that time and ran every op on the training thread alone (one intra-op thread), on the CPU.

        Such a thread, untraced, is at any moment running an op, waiting for a core (its run-queue wait) or blocked
        in a collective: a CPU run's data loading is its own work (no loader workers), and nothing else puts it to
        sleep. So its ops' untraced time is its CPU time, however the traced steps spent theirs; the traced steps'
        time off the CPU outside the collectives (the profiler's writes and locks) is the trace's, not the run's.
        With more intra-op threads an op also waits for its helpers, time the training thread's CPU time misses."""
        if self.intra_op_threads != 1 or not self.untraced_thread_cpu_us:
            return None
        return statistics.median(self.untraced_thread_cpu_us) * self.slowest_rank_scale

    @property
    def compute_threads_beyond_cpus(self) -> int:
        """How many more compute threads the ranks on this machine ran (intra-op threads x ranks) than the rank's
        process had CPUs; 0 when they fit, or when run.json did not record the three."""
        if self.intra_op_threads is None or self.usable_cpus is None:
            return 0
        return max(0, self.intra_op_threads * self.ranks_on_machine - self.usable_cpus)

    @property
    def recording_cpu_us(self) -> float | None:
        """CPU time a traced step spent more than an untraced one: the recording's cost, measured apart from any
        wait on the network or on another rank (None when the run did not measure CPU time). The training thread's
        own CPU time where the run measured it: the recording runs on the thread that runs the ops, while the
        process's time also holds the communication threads', whose bursts (on a 2-core machine gloo's event loop
        ran 3-7 ms without sleeping in some steps and 0.5 ms in others) differ between the traced and the untraced
        steps for reasons of their own."""
        traced, untraced = self.traced_thread_cpu_us, self.untraced_thread_cpu_us
        if not traced or not untraced:
            traced, untraced = self.traced_cpu_us, self.untraced_cpu_us
        if not traced or not untraced:
            return None
        return statistics.median(traced) - statistics.median(untraced)

    @property
    def run_queue_median_us(self) -> tuple[float, float] | None:
        """Median run-queue wait of the training thread in a traced and in an untraced step (None if unmeasured)."""
        if not self.traced_run_queue_us or not self.untraced_run_queue_us:
            return None
        return statistics.median(self.traced_run_queue_us), statistics.median(self.untraced_run_queue_us)

    @property
    def communication_cpu_per_step_us(self) -> float | None:
        """Mean CPU time the communication threads used in an untraced step (in a traced one when no untraced step
        measured it; None if unmeasured): the collectives' own CPU work, the same with or without the profiler. The
        mean, not the median: that work comes in bursts (on a 2-core machine most steps 0.5 ms, some 3-7 ms in which
        gloo's event loop ran without sleeping, epoll_wait returning at once), and every burst adds to the run's
        time; a median drops them all."""
        return _mean_per_step(self.untraced_communication_cpu_us, self.traced_communication_cpu_us)

    @property
    def interrupt_cpu_per_step_us(self) -> float | None:
        """This rank's share of the machine's interrupt and softirq time in an untraced step (in a traced one when no
        untraced step measured it; None if unmeasured): the mean, divided among the ranks on the machine. On a CPU
        run that is mostly the kernel's work on the collectives' packets. Reported only: on a kernel that does not
        account interrupt time apart from the tasks' (no CONFIG_IRQ_TIME_ACCOUNTING, as on the 2-core VM), it is
        already inside the CPU time of the threads it interrupted, the training thread's and gloo's, and added to
        them it would count twice (docs/BENCHMARKS.md §4b, twenty-seventh session). The mean over all the steps, as
        /proc/stat counts it in 10 ms ticks: a sum over consecutive steps is off by a tick at most, however many."""
        mean = _mean_per_step(self.untraced_interrupt_cpu_us, self.traced_interrupt_cpu_us)
        return mean / max(1, self.ranks_on_machine) if mean is not None else None

    @property
    def communication_run_queue_per_step_us(self) -> float | None:
        """Mean time the communication threads waited for a core in an untraced step, summed over the threads (in
        a traced one when no untraced step measured it; None if unmeasured). Woken while the training threads
        hold the cores, they wait, on a kernel without wakeup preemption up to its next timer tick. Reported only:
        the threads' waits overlap in time, so the .et takes a collective's start-up from collective_start_wait_us
        instead (utils/collective_start.py)."""
        return _mean_per_step(self.untraced_communication_run_queue_us, self.traced_communication_run_queue_us)

    @property
    def traced_median_us(self) -> float:
        return statistics.median(self.traced_us)

    @property
    def untraced_median_us(self) -> float:
        return statistics.median(self.untraced_us)

    @property
    def untraced_deviation(self) -> float:
        """How far a typical untraced step lies from their median, as a share of it (the median absolute deviation;
        0 for one step). The median is what the .et durations are corrected towards and what simulate.py compares
        a prediction with: one unusual step among three (the first after the window, 1.0-1.3x and once 2.9x the
        others) does not move it or this, but two steps that differ by 2d give a median d from each of them."""
        middle = self.untraced_median_us
        if len(self.untraced_us) < 2 or middle <= 0:
            return 0.0
        return statistics.median(abs(t - middle) for t in self.untraced_us) / middle


def _mean_per_step(untraced: list[float] | None, traced: list[float] | None) -> float | None:
    """The mean over the untraced steps, or over the traced ones when no untraced step measured it; None if neither
    did."""
    samples = untraced or traced
    return statistics.fmean(samples) if samples else None


def read_run_json(run_dir: str | Path):
    """run.json beside a run's traces, parsed (any JSON value); None when it is missing or not JSON."""
    try:
        return json.loads((Path(run_dir) / RUN_INFO).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_step_times(run_dir: str | Path, rank: int, micro_batches: int | None = None) -> StepTimes | None:
    """The rank's step times from run.json beside its traces, or None when the run did not measure them (foreign
    traces, runs of older versions, a window without timed untraced steps). Only steps of one micro-batch count
    are kept, traced and untraced alike (`micro_batches`, else the run's full step: MicroBatches), and the run's
    first step is left out (_comparable_untraced_steps); the untraced steps after the window (run.json's
    untraced_steps numbers them all) sample the run once its first steps are past."""
    return step_times_of(read_run_json(run_dir), rank, micro_batches)


@dataclass(frozen=True)
class MicroBatches:
    """How many micro-batches a rank's traced steps took (run.json), and how many the run's full step takes.

    A step takes --gradient-accumulation-steps micro-batches, and an epoch's last step the batches left over (the
    trainer's _micro_batches_due), which may be fewer: 239 GPT-2 sequences over 2 ranks at batch 4 are 30 batches a
    rank, 7 steps of 4 and one of 2. The trainer refuses an accumulation above an epoch's batches, so every epoch has
    full steps: the full step is the largest count the run recorded (or its gradient_accumulation_steps), the count
    most of the run's steps took (half of them where an epoch is one full step and one short one, which the most
    common count of a window or of a few steps could miss). A short step runs other work (fewer forward and backward
    passes), so it is no sample of a full step's ops or time."""

    full: int
    traced: dict[str, int]  # step annotation (ProfilerStep#N) -> micro-batches that traced step took

    def of(self, step_name: str) -> int | None:
        return self.traced.get(step_name)


def micro_batches_of(info, rank: int) -> MicroBatches | None:
    """The rank's micro-batch counts from run.json's parsed content; None when run.json records none for it (runs
    of older tracers, foreign traces)."""
    entry = _rank_entry(info, rank)
    if entry is None:
        return None
    traced, untraced = _counts(entry.get("step_micro_batches")), _counts(entry.get("untraced_step_micro_batches"))
    if traced is None and untraced is None:
        return None
    recorded = [n for n in (traced or []) + (untraced or []) if n is not None]
    accumulation = info.get("gradient_accumulation_steps")
    if isinstance(accumulation, int) and not isinstance(accumulation, bool) and accumulation > 0:
        recorded.append(accumulation)
    if not recorded:
        return None
    numbers = info.get("traced_steps")
    names = {}
    if isinstance(numbers, list) and traced is not None and len(numbers) == len(traced):
        names = {STEP_ANNOTATION.format(step=step): n for step, n in zip(numbers, traced) if n is not None}
    return MicroBatches(full=max(recorded), traced=names)


def _counts(values) -> list[int | None] | None:
    """A run.json list of micro-batch counts, a None where an entry is not one; None when the list is absent."""
    if not isinstance(values, list):
        return None
    return [n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None for n in values]


def _rank_entry(info, rank: int) -> dict | None:
    entries = [r for r in info.get("ranks", []) if isinstance(r, dict) and r.get("rank") == rank] \
        if isinstance(info, dict) else []
    return entries[0] if entries else None


def machine_wake_cost(info, entry: dict) -> WakeCost | None:
    """The wake cost of the rank's machine (trace_tools.wake_cost): the mean of what every rank on it (its hostname)
    measured, each at the same time as the others (a measurement is a few cycles of a few steps: one rank's was up
    to 1.5 ms off another's); the rank's own where the others' are not of the same pauses, or None without it."""
    own = WakeCost.from_run_info(entry.get("wake_cost"))
    if own is None:
        return None
    host = entry.get("hostname")
    measured = [cost for cost in (WakeCost.from_run_info(other.get("wake_cost")) for other in info.get("ranks", [])
                                  if isinstance(other, dict) and other.get("hostname") == host)
                if cost is not None and cost.pauses_us == own.pauses_us and len(cost.compute_us) == len(own.compute_us)]
    if len(measured) < 2:
        return own
    count = len(measured)
    return WakeCost(own.pauses_us, tuple(sum(c.compute_us[k] for c in measured) / count
                                         for k in range(len(own.compute_us))),
                    tuple(tuple(sum(c.extra_us[i][k] for c in measured) / count for k in range(len(own.compute_us)))
                          for i in range(len(own.pauses_us))))


def untraced_steps_after_the_first(info, rank: int) -> int:
    """How many untraced steps run.json times for the rank, the run's first (its start-up) left out, whatever
    micro-batches they took."""
    entry = _rank_entry(info, rank)
    if entry is None:
        return 0
    times = entry.get("untraced_step_wall_time_s")
    kept = _comparable_untraced_steps(info, entry, None)
    return sum(1 for i, t in enumerate(times if isinstance(times, list) else [])
               if isinstance(t, (int, float)) and kept(i))


def step_times_of(info, rank: int, micro_batches: int | None = None) -> StepTimes | None:
    """read_step_times on run.json's parsed content (any JSON value; None where it holds no times of the rank, or
    no traced and untraced step of the micro-batch count)."""
    entry = _rank_entry(info, rank)
    if entry is None:
        return None
    if micro_batches is None:
        counts = micro_batches_of(info, rank)
        micro_batches = counts.full if counts is not None else None

    def micros(key: str) -> list[float]:
        return [float(t) * 1e6 for t in entry.get(key) or [] if isinstance(t, (int, float))]

    kept = _comparable_untraced_steps(info, entry, micro_batches)
    taking = _steps_taking(entry.get("step_micro_batches"), micro_batches)

    def traced_micros(key: str) -> list[float]:
        return [value for i, value in enumerate(micros(key)) if taking(i)]

    def untraced_micros(key: str) -> list[float]:
        return [value for i, value in enumerate(micros(key)) if kept(i)]

    traced, untraced = traced_micros("step_wall_time_s"), untraced_micros("untraced_step_wall_time_s")
    if not traced or not untraced:
        return None
    any_count = _comparable_untraced_steps(info, entry, None)
    left_out = sum(1 for i in range(len(micros("untraced_step_wall_time_s"))) if any_count(i) and not kept(i))

    def counts(key: str, keep: Callable[[int], bool]) -> list[int]:
        return [int(n) for i, n in enumerate(entry.get(key) or []) if isinstance(n, int) and keep(i)]

    per_op = entry.get("recording_cost_per_op_us")
    threads = entry.get("intra_op_threads")
    start_wait = entry.get("collective_start_wait_s")
    wake_cost = machine_wake_cost(info, entry)
    ranks_on_machine = entry.get("ranks_on_machine")
    load = entry.get("machine_load")
    others, busy, cpus = ((load.get("other_processes_cpu_share"), load.get("busy"), load.get("cpus"))
                          if isinstance(load, dict) else (None, None, None))
    return StepTimes(traced_us=traced, untraced_us=untraced, traced_cpu_us=traced_micros("step_cpu_time_s"),
                     untraced_cpu_us=untraced_micros("untraced_step_cpu_time_s"),
                     traced_thread_cpu_us=traced_micros("step_thread_cpu_time_s"),
                     untraced_thread_cpu_us=untraced_micros("untraced_step_thread_cpu_time_s"),
                     recording_cost_per_op_us=float(per_op) if isinstance(per_op, (int, float)) else None,
                     traced_run_queue_us=traced_micros("step_run_queue_wait_s"),
                     untraced_run_queue_us=untraced_micros("untraced_step_run_queue_wait_s"),
                     traced_communication_cpu_us=traced_micros("step_communication_cpu_time_s"),
                     untraced_communication_cpu_us=untraced_micros("untraced_step_communication_cpu_time_s"),
                     traced_communication_run_queue_us=traced_micros("step_communication_run_queue_wait_s"),
                     untraced_communication_run_queue_us=untraced_micros(
                         "untraced_step_communication_run_queue_wait_s"),
                     collective_start_wait_us=(float(start_wait) * 1e6 if isinstance(start_wait, (int, float))
                                               and start_wait >= 0 else None),
                     wake_cost=wake_cost, untraced_left_out=left_out, traced_page_faults=counts("step_page_faults", taking),
                     untraced_page_faults=counts("untraced_step_page_faults", kept),
                     intra_op_threads=threads if isinstance(threads, int) and threads > 0 else None,
                     traced_interrupt_cpu_us=traced_micros("step_interrupt_cpu_time_s"),
                     untraced_interrupt_cpu_us=untraced_micros("untraced_step_interrupt_cpu_time_s"),
                     ranks_on_machine=ranks_on_machine if isinstance(ranks_on_machine, int) and ranks_on_machine > 0
                     else 1,
                     other_processes_cpu_share=(float(others) if isinstance(others, (int, float))
                                                and not isinstance(others, bool) and others >= 0 else None),
                     machine_busy=busy if isinstance(busy, bool) else None,
                     usable_cpus=cpus if isinstance(cpus, int) and not isinstance(cpus, bool) and cpus > 0 else None,
                     slowest_rank_scale=_slowest_rank_scale(info, micro_batches))


def _steps_taking(counts, micro_batches: int | None) -> Callable[[int], bool]:
    """Which steps of a run.json list (by index) took `micro_batches` micro-batches, by the list of their counts:
    every step when the count or the list is not known."""
    if micro_batches is None or not isinstance(counts, list):
        return lambda i: True
    return lambda i: i < len(counts) and counts[i] == micro_batches


def _comparable_untraced_steps(info: dict, entry: dict, micro_batches: int | None) -> Callable[[int], bool]:
    """Which of a rank's untraced steps (by their index in run.json's lists) are samples of a traced step that took
    `micro_batches` micro-batches (None: of any). The run's first step (step 0) holds one-time start-up costs
    (allocation, DDP's bucket rebuild) and is left out. So is a step that took another number of micro-batches
    (run.json's untraced_step_micro_batches; MicroBatches): it did other work (an epoch's last step of 3
    micro-batches took 353 ms where those of 4 took 465-477), and a traced step calibrated to it would take its
    time. When that leaves no sample, there is none: the profiler's cost is then kept, not measured against
    another step's work."""
    numbers = info.get("untraced_steps")
    first = 0 if not isinstance(numbers, list) or 0 in numbers else None  # older run.json: its first is step 0
    taking = _steps_taking(entry.get("untraced_step_micro_batches"), micro_batches)
    return lambda i: i != first and taking(i)


def _slowest_rank_scale(info: dict, micro_batches: int | None = None) -> float:
    """How much longer a step's slowest rank computes than the slowest rank's median: the median over the untraced
    steps of the ranks' largest training-thread CPU time, over the largest of the ranks' medians. Every rank's ops
    are scaled by it; 1.0 unless run.json holds the same number of such steps for every rank of a multi-rank run.

    The ranks meet at every collective, so a real step lasts as long as that step's slowest rank, and which rank
    that is changes from step to step: its compute is the median over the steps of the largest CPU time among the
    ranks, more than any one rank's median (on the 2-core VM 0.4-5.9% more for the tiny models, 0.0-3.0% for the big
    shapes; 21 traces, docs/BENCHMARKS.md §4b). An .et of per-rank medians gives the simulator the larger of the
    medians; scaling each rank's ops alike by this ratio gives it the slowest rank's median step and keeps the
    ranks' own differences. Only steps of `micro_batches` micro-batches count (None: every step)."""
    world = info.get("world_size")
    ranks = {r.get("rank"): r for r in info.get("ranks", []) if isinstance(r, dict)}
    if not isinstance(world, int) or world < 2 or set(ranks) != set(range(world)):
        return 1.0
    series = []
    for entry in ranks.values():
        times = entry.get("untraced_step_thread_cpu_time_s")
        if not isinstance(times, list) or not all(isinstance(t, (int, float)) and t >= 0 for t in times):
            return 1.0
        kept = _comparable_untraced_steps(info, entry, micro_batches)
        series.append([t for i, t in enumerate(times) if kept(i)])
    slowest_median = max((statistics.median(times) for times in series if times), default=0.0)
    if slowest_median <= 0 or any(len(times) != len(series[0]) for times in series):
        return 1.0
    return statistics.median(max(step) for step in zip(*series)) / slowest_median
