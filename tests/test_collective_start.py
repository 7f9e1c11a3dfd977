"""utils/collective_start.py: the start-up wait of an all-reduce issued after compute, as the tracer measures it."""
from __future__ import annotations

import statistics

import pytest
import torch
import torch.distributed as dist

from utils import collective_start


@pytest.fixture
def one_rank_gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_all_reduces_are_timed_after_compute_for_a_drawn_time_or_after_a_barrier(one_rank_gloo, monkeypatch):
    computed = []
    real_compute = collective_start.compute_for
    monkeypatch.setattr(collective_start, "compute_for",
                        lambda seconds, matrix: computed.append(seconds) or real_compute(seconds, matrix))
    state = torch.random.get_rng_state()
    tensor = torch.ones(16)
    after_compute = collective_start.time_all_reduces(tensor, repeats=4, warmup=1, compute_ms=(2.0, 3.0), seed=7)
    after_barrier = collective_start.time_all_reduces(tensor, repeats=3)
    assert len(after_compute) == 4 and len(after_barrier) == 3
    assert all(0 < t < 1 for t in after_compute + after_barrier)
    # every repeat (and the warm-up) computed for a time drawn in the range, the same draws for the same seed
    assert len(computed) == 5 and all(0.002 <= s <= 0.003 for s in computed)
    assert len(set(computed)) == 5
    computed.clear()
    collective_start.time_all_reduces(tensor, repeats=4, warmup=1, compute_ms=(2.0, 3.0), seed=7)
    assert len(computed) == 5 and len(set(computed)) == 5
    # the run's own random numbers are untouched: the probe runs inside a training run
    assert torch.equal(torch.random.get_rng_state(), state)


def test_the_wait_is_the_mean_time_beyond_the_fastest(monkeypatch):
    """Bimodal times, as on a 2-core VM at CONFIG_HZ=250: 30 at 0.4 ms and 10 that waited for the tick (4.4 ms).
    The wait is their mean beyond the fast ones (10th percentile): 1.0 ms; none when every one is fast."""
    times = [0.0004] * 30 + [0.0044] * 10
    monkeypatch.setattr(collective_start, "time_all_reduces", lambda tensor, repeats, **kw: times[:repeats])
    assert collective_start.measure_collective_start_wait_s(repeats=40) == pytest.approx(
        statistics.fmean(times) - 0.0004)
    assert collective_start.measure_collective_start_wait_s(repeats=40) == pytest.approx(0.001)
    times[:] = [0.0004] * 40
    assert collective_start.measure_collective_start_wait_s(repeats=40) == 0.0
