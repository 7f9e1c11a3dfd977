"""What a collective costs to start when the cores are busy: a CPU run's start-up that the simulated network lacks.

On a CPU run the ranks' compute and the communication backend's threads (gloo's) share the machine's cores. When a
rank issues its all-reduce at the end of its compute, the thread that must carry it has to be woken on a core that
another rank's compute may hold; a kernel without wakeup preemption (CONFIG_PREEMPT_NONE, common on servers and
VMs) lets it wait up to the next timer tick (4 ms at CONFIG_HZ=250). That wait comes before the collective's CPU
work, whatever the network's rate: hidden behind a long transfer, on the path of a short one.

measure_collective_start_wait_s times a small all-reduce after compute, as a training step issues its gradients',
and returns its mean time beyond its fastest; the tracer records it in run.json and trace_tools.core_sharing puts
that wait before every collective's CPU work in the .et (bench/collective_start_cost.py compares the same all-reduce
after compute and after a barrier at several sizes).
"""
from __future__ import annotations

import random
import statistics
import time

import torch
import torch.distributed as dist

# A message whose transfer is short at any rate the run may be traced at (2 KB through a 100 Mbit/s link: 0.16 ms,
# inside a token bucket's burst): the time is the start-up's. A 64 KB one takes 10 ms at 100 Mbit/s, longer than the
# tick, and hid most of the wait (0.8-1.6 ms measured there against 1.4-3.4 ms unthrottled)
PROBE_BYTES = 1024
# Compute before each all-reduce for a time drawn in this range: a fixed time would start every all-reduce at the
# same phase of the timer tick, and the wait would depend on that phase
COMPUTE_MS = (10.0, 30.0)


def compute_for(seconds: float, matrix: torch.Tensor) -> torch.Tensor:
    """Matrix products on this rank's cores until `seconds` have passed."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        matrix = torch.tanh(matrix @ matrix)
    return matrix


def time_all_reduces(tensor: torch.Tensor, repeats: int, warmup: int = 1,
                     compute_ms: tuple[float, float] | None = None, seed: int = 0,
                     group: dist.ProcessGroup | None = None) -> list[float]:
    """Seconds of `repeats` all-reduces of `tensor` (after `warmup` untimed ones), each from the later rank's call to
    the later rank's finish: after compute for a time drawn in `compute_ms` (the same draw on every rank), or, when
    None, after a barrier (every rank's cores idle, the backend's threads just woken). Every rank must call it with
    the same arguments; every rank gets the same times."""
    matrix = torch.linspace(-1.0, 1.0, 256 * 256).reshape(256, 256) / 16  # no draw from torch's RNG: the run's own
    compute_times = random.Random(seed)
    started, finished = [], []
    for _ in range(warmup + repeats):
        if compute_ms:
            matrix = compute_for(compute_times.uniform(*compute_ms) / 1000, matrix)
        else:
            dist.barrier(group=group)
        started.append(time.perf_counter())
        dist.all_reduce(tensor, group=group)
        finished.append(time.perf_counter())
    # perf_counter is the machine's monotonic clock, shared by the ranks of a single-node run: from the later rank's
    # call (the collective cannot start before) to the later rank's finish (when it had finished)
    mine = torch.tensor([started, finished], dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    later_call = torch.stack([t[0] for t in everyone]).max(dim=0).values
    later_finish = torch.stack([t[1] for t in everyone]).max(dim=0).values
    return (later_finish - later_call)[warmup:].tolist()


def measure_collective_start_wait_s(repeats: int = 100, group: dist.ProcessGroup | None = None) -> float:
    """Mean time a small all-reduce issued after compute takes beyond its fastest (its 10th percentile: the
    transfer and the backend's work with a core at hand), in seconds. On this kind of machine the times are bimodal
    (2-core VM, CONFIG_HZ=250: 0.3-0.5 ms, or 2-10 ms when a thread waited for the tick); the excess over the fast
    ones is the wait. The mean, not the median: every wait adds to the run's time. 100 repeats (2.5 s on that
    machine): 40 gave 0.5-2.0 ms in four probes of one process, 100 gave 1.6-2.4 ms. Not against the same all-reduce
    after a barrier: there a third of them waited for the tick as well. Collective: every rank of `group` calls it,
    and every rank gets the same value."""
    tensor = torch.zeros(PROBE_BYTES // 4, dtype=torch.float32)
    return wait_beyond_fastest(time_all_reduces(tensor, repeats, compute_ms=COMPUTE_MS, group=group))


def wait_beyond_fastest(times: list[float]) -> float:
    """The mean of `times` beyond their 10th percentile (0 for fewer than two)."""
    if len(times) < 2:
        return 0.0
    fastest = statistics.quantiles(times, n=10, method="inclusive")[0]
    return max(0.0, statistics.fmean(times) - fastest)
