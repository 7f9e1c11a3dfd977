"""Compute after a pause costs more CPU: give a simulated network's pauses their cost, not the traced network's.

On a CPU run the training thread blocks while it waits for the network, and on a VM the core it ran on halts in that
pause; when the thread wakes, its caches, branch predictors and TLB have lost what they held, and the compute that
follows takes more CPU time than the same compute run back to back. The tracer measures that cost on the machine
(utils/wake_cost.py: run.json's wake_cost, by the length of the pause and the compute done since) and the converter
writes it into every .et's metadata (WAKE_COST_ATTR). The .et's compute durations are those of the traced network, so
they hold the cost of its pauses: GPT-2 tiny's training thread used 22 ms of CPU a step unthrottled and 26 ms at
100 Mbit/s, where it waited 145 ms a step, and an .et traced there predicted the unthrottled step 13-18% too slow
(docs/BENCHMARKS.md §4, session 44).

So a simulation (trace_tools.simulate) takes the training thread's pause in each rank's simulated step (the step less
the thread's compute) and gives that compute the cost of that pause instead of the traced one's (the traced step less
the same compute): faster than traced where the simulated network waits less, slower where it waits more, as traced
where it waits as long. The pause depends on the compute it changes, so the simulation is repeated until the two
agree (WakeAdjustment). GPU runs record no such cost (the host thread's waits do not slow the device's kernels), and
neither do runs traced before it was measured: their .et files are simulated as written.
"""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field

from .layout import STEP_PREFIX

WAKE_COST_ATTR = "wake_cost_micros"  # the .et metadata attribute: WakeCost.to_json()


@dataclass(frozen=True)
class WakeCost:
    """extra_us[i][k]: the CPU time the first compute_us[k] µs of compute after a pause of pauses_us[i] µs took beyond
    the same compute run back to back. Ascending pauses and compute; each row ascending, and no row below the one
    before it."""

    pauses_us: tuple[float, ...]
    compute_us: tuple[float, ...]
    extra_us: tuple[tuple[float, ...], ...]

    @classmethod
    def from_run_info(cls, value) -> WakeCost | None:
        """run.json's wake_cost (seconds; utils/wake_cost.py), or None when absent or not of that shape."""
        if not isinstance(value, dict):
            return None
        return cls._checked(value.get("pauses_s"), value.get("compute_s"), value.get("extra_cpu_s"), 1e6)

    @classmethod
    def from_json(cls, text: str) -> WakeCost | None:
        """WAKE_COST_ATTR's value, or None when it is not one this module writes."""
        try:
            value = json.loads(text)
        except (TypeError, ValueError):
            return None
        if not isinstance(value, dict):
            return None
        return cls._checked(value.get("pauses_us"), value.get("compute_us"), value.get("extra_us"), 1.0)

    @classmethod
    def _checked(cls, pauses, compute, extra, unit: float) -> WakeCost | None:
        def numbers(values) -> list[float] | None:
            if not isinstance(values, list) or not values:
                return None
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                       for v in values):
                return None
            return [float(v) * unit for v in values]

        pauses, compute = numbers(pauses), numbers(compute)
        rows = [numbers(row) for row in extra] if isinstance(extra, list) else None
        if pauses is None or compute is None or rows is None or len(rows) != len(pauses):
            return None
        if any(row is None or len(row) != len(compute) for row in rows):
            return None
        if pauses != sorted(pauses) or compute != sorted(compute):
            return None
        return cls(tuple(pauses), tuple(compute), tuple(tuple(row) for row in rows))

    def to_json(self) -> str:
        return json.dumps({"pauses_us": [round(p, 1) for p in self.pauses_us],
                           "compute_us": [round(c, 1) for c in self.compute_us],
                           "extra_us": [[round(e, 1) for e in row] for row in self.extra_us]},
                          separators=(",", ":"))

    def extra(self, pause_us: float, compute_us: float) -> float:
        """The CPU time that compute_us of compute costs beyond its own after a pause of pause_us: linear between the
        measured pauses and amounts of compute (from none after no pause, or over no compute), as measured at the
        longest beyond it."""
        def along(points: tuple[float, ...], values: list[float], x: float) -> float:
            xs, ys = (0.0, *points), (0.0, *values)
            if x >= xs[-1]:
                return ys[-1]
            i = max(1, bisect.bisect_right(xs, max(0.0, x)))
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return y0 + (y1 - y0) * ((x - x0) / (x1 - x0) if x1 > x0 else 1.0)

        by_pause = [along(self.compute_us, list(row), compute_us) for row in self.extra_us]
        return along(self.pauses_us, by_pause, pause_us)

    def describe(self) -> str:
        """The longest pause's cost over the most compute measured, e.g. '150 ms pause: +4.7 ms of CPU over the
        first 38 ms of compute'."""
        return (f"{self.pauses_us[-1] / 1000:.0f} ms pause: +{self.extra_us[-1][-1] / 1000:.1f} ms of CPU over the "
                f"first {self.compute_us[-1] / 1000:.0f} ms of compute")


@dataclass
class TrainingThread:
    """One .et's training thread: the COMP nodes of the lane that ran the traced step (its ProfilerStep's tid), their
    total duration (its compute a step), and the rank's untraced step (the .et's untraced_step_micros)."""

    indices: list[int]
    compute_us: float
    untraced_step_us: float
    wake_cost: WakeCost

    @property
    def traced_pause_us(self) -> float:
        """The time a step of the traced run the thread did not compute: its pauses."""
        return max(0.0, self.untraced_step_us - self.compute_us)


def training_thread(blobs: list[bytes], meta: dict) -> TrainingThread | None:
    """The training thread of an .et (its serialized nodes and metadata), or None when the .et records no wake cost,
    no untraced step or no ProfilerStep node."""
    from chakra.schema.protobuf.et_def_pb2 import COMP_NODE, Node

    cost = WakeCost.from_json(meta.get(WAKE_COST_ATTR, ""))
    untraced = meta.get("untraced_step_micros")
    if cost is None or not isinstance(untraced, int) or untraced <= 0:
        return None
    node = Node()
    step_tid = None
    compute_by_tid: dict[int, tuple[list[int], list[int]]] = {}  # tid: (its COMP nodes' indices, their durations)
    for index, blob in enumerate(blobs):
        node.Clear()
        node.ParseFromString(blob)
        tid = next((a.int64_val for a in node.attr if a.name == "tid"), None)
        if tid is None or tid < 0:
            continue
        if step_tid is None and node.name.startswith(STEP_PREFIX):
            step_tid = tid
        if node.type == COMP_NODE:
            indices, durations = compute_by_tid.setdefault(tid, ([], []))
            indices.append(index)
            durations.append(node.duration_micros)
    indices, durations = compute_by_tid.get(step_tid, ([], [])) if step_tid is not None else ([], [])
    if sum(durations) <= 0:
        return None
    return TrainingThread(indices, float(sum(durations)), float(untraced), cost)


@dataclass
class RankWake:
    """One rank's training thread in a simulation: its pause a step as traced and as simulated, and the CPU time its
    compute was given for the difference (negative: less than traced)."""

    traced_pause_us: float
    simulated_pause_us: float
    change_us: float
    compute_us: float


@dataclass
class WakeAdjustment:
    """The wake cost a simulation gave each rank's compute (trace_tools.simulate), and how many simulations found it."""

    ranks: dict[int, RankWake] = field(default_factory=dict)
    simulations: int = 1
    cost: WakeCost | None = None

    def line(self) -> str:
        """SIMULATION.md's and the printout's sentence on it."""
        if not self.ranks:
            return ""
        worst = max(self.ranks.items(), key=lambda item: abs(item[1].change_us))
        rank, wake = worst
        change = wake.change_us / 1000
        pauses = sorted(w.simulated_pause_us for w in self.ranks.values())
        return (f"compute after a pause: the training thread paused {pauses[0] / 1000:,.1f}"
                + (f"-{pauses[-1] / 1000:,.1f}" if pauses[-1] - pauses[0] >= 50 else "")
                + f" ms a step in this simulation against {wake.traced_pause_us / 1000:,.1f} ms in the traced run "
                f"(rank {rank}); on the traced machine compute costs more CPU after a pause ({self.cost.describe()}; "
                f"run.json, utils/wake_cost.py), so rank {rank}'s {wake.compute_us / 1000:,.1f} ms of compute was "
                f"given {change:+,.2f} ms ("
                + (f"{self.simulations} simulations" if self.simulations > 1 else "pauses as traced: simulated once")
                + "; trace_tools.wake_cost; --no-wake-cost simulates the .et as written)")
