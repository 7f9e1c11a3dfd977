"""What compute costs after the thread was idle: a CPU run's cost that depends on how long its network makes it wait.

On a CPU run the training thread blocks while it waits for a collective; the slower the network, the longer. On a
VM (and on a machine whose idle cores drop to deep sleep states) the core it ran on halts in that pause, and when the
thread wakes its caches, branch predictors and TLB no longer hold what it had built up: the compute that follows takes
more CPU time than the same compute run back to back. On the 2-core VM, a GPT-2 tiny step (20 ms of CPU) cost 2 ms
more after a 15 ms pause, 3 ms after 35 ms and 6 ms after 70 ms or more, with no network involved; its training
thread used 22 ms a step unthrottled and 26 ms at 100 Mbit/s, where it waits 145 ms a step (docs/BENCHMARKS.md §4,
session 44). The traced durations hold the cost of the traced network's pauses, so an .et traced on a slow network
predicted a fast one 13-18% too slow.

measure_wake_cost_s times a small transformer's training step (forward, backward, AdamW: the dispatcher's and
autograd's code, as a training step runs it) back to back and after pauses of several lengths, and returns the CPU
time each pause added. The tracer records it in run.json; the converter writes it into the .et's metadata, and
trace_tools.simulate gives the training thread's compute the cost of the pauses of the simulated network instead of
the traced one's (trace_tools.wake_cost).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

# Pauses (seconds) after which the steps are timed: the cost grows with the pause and levels off after about 100 ms
# on the 2-core VM; a pause longer than the longest here costs what it costs
PAUSES_S = (0.005, 0.02, 0.06, 0.15)
STEPS_AFTER = 4  # steps timed after each pause: the cost is spread over the first 20-40 ms of compute after it
CYCLES = 6       # passes over the pauses whose medians are taken
BACK_TO_BACK = 3  # steps timed after each pause's, back to back
WARMUP_STEPS = 5
WIDTH, LAYERS, HEADS, TOKENS, BATCH, CLASSES = 64, 2, 2, 128, 4, 1024


def measure_wake_cost_s(pauses_s: tuple[float, ...] = PAUSES_S, steps_after: int = STEPS_AFTER,
                        cycles: int = CYCLES) -> dict:
    """How much more CPU time compute takes after the thread was idle, as run.json's wake_cost records it (wake_cost_of)
    for a small transformer's training step: built here, it draws nothing from torch's random generator, so the
    run's own stays as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0,
                                                                        batch_first=True) for _ in range(LAYERS)])
        head = torch.nn.Linear(WIDTH, CLASSES)
        inputs = torch.randn(BATCH, TOKENS, WIDTH)
        labels = torch.randint(0, CLASSES, (BATCH * TOKENS,))
    optimizer = torch.optim.AdamW([*layers.parameters(), *head.parameters()], lr=1e-4)

    def step() -> float:
        started = time.thread_time()
        loss = torch.nn.functional.cross_entropy(head(layers(inputs)).view(-1, CLASSES), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.thread_time() - started

    return wake_cost_of(step, pauses_s, steps_after, cycles)


def wake_cost_of(step: Callable[[], float], pauses_s: tuple[float, ...], steps_after: int, cycles: int,
                 sleep: Callable[[float], None] = time.sleep) -> dict:
    """{"pauses_s": [p...], "compute_s": [c...], "extra_cpu_s": [[e...] a pause]}: e is the CPU time that the first c
    seconds of compute after a pause of p took beyond the same compute run back to back. `step` runs the compute once
    and returns its CPU time; `steps_after` of them are timed after each pause, and the back-to-back step is the
    median of BACK_TO_BACK steps after those (medians over `cycles` passes). Nothing is warmer after a longer pause
    or cheaper over more compute, so the measured table is replaced by the nearest one that never decreases along
    either (nondecreasing_nearest), never below 0: on a machine whose steps jitter by 10% a single measurement often
    breaks that order, and keeping the larger of two would make the noise a cost."""
    for _ in range(WARMUP_STEPS):
        step()
    pauses = sorted(pauses_s)
    back_to_back: list[float] = []
    after = {pause: [[] for _ in range(steps_after)] for pause in pauses}
    for _ in range(cycles):
        for pause in pauses:
            sleep(pause)
            for k in range(steps_after):
                after[pause][k].append(step())
            # past the cost's reach of the pause: the steady step every other is set against (more of them than
            # of any step after a pause: a reference off by a little is off that much a step after every pause)
            back_to_back.extend(step() for _ in range(BACK_TO_BACK))
    reference = statistics.median(back_to_back)
    measured = []
    for pause in pauses:
        spent, row = 0.0, []
        for k in range(steps_after):
            spent += statistics.median(after[pause][k]) - reference
            row.append(spent)
        measured.append(nondecreasing_nearest(row))
    by_compute = [nondecreasing_nearest([row[k] for row in measured]) for k in range(steps_after)]
    extra = []
    for i in range(len(pauses)):  # pooling along the pauses can undo the order along the compute: the larger kept
        row = [by_compute[k][i] for k in range(steps_after)]
        extra.append([max(0.0, *row[:k + 1]) for k in range(steps_after)])
    return {"pauses_s": pauses, "compute_s": [reference * (k + 1) for k in range(steps_after)], "extra_cpu_s": extra,
            "cycles": cycles}


def nondecreasing_nearest(values: list[float]) -> list[float]:
    """The nondecreasing sequence nearest to `values` in least squares: each run that decreases is replaced by its
    mean, pooled again with the run before it while that is larger (pool adjacent violators)."""
    pooled: list[list[float]] = []  # [sum, count] of each run
    for value in values:
        pooled.append([value, 1])
        while len(pooled) > 1 and pooled[-2][0] / pooled[-2][1] > pooled[-1][0] / pooled[-1][1]:
            total, count = pooled.pop()
            pooled[-1][0] += total
            pooled[-1][1] += count
    return [total / count for total, count in pooled for _ in range(int(count))]
