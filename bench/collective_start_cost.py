"""A gloo all-reduce issued from cores that were computing, as a training step issues its gradients', against the same
all-reduce on idle cores (the all-reduce micro-benchmark of `whatif_bench.py`), side by side in one run.

Two ranks under torchrun on this machine's loopback (no namespace, no root). Each size is timed in both ways, in
alternating runs so a machine that gets busier or quieter favours neither: after a barrier (idle cores, gloo's threads
just woken), and after each rank computed for a time drawn between --compute-ms LOW and HIGH (the draw samples the
phase of the kernel's timer tick; see bench/allreduce_child.py). What the second costs more is start-up that a
network model fitted on the first does not have: on a kernel where a woken thread can wait for the next timer tick,
about half a tick per collective. The last column is what the tracer records before its window
(utils/collective_start.py): the mean after compute beyond its 10th percentile, which does not lean on the barrier
(after a barrier a third of the all-reduces waited for the tick as well).

    python bench/collective_start_cost.py [--sizes 65536,921600,8388608] [--repeats 100] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from bench.allreduce_child import compute_range_ms
from bench.common import (REPO_ROOT, BenchError, child_env, exit_on_sigterm, fail, format_table, machine_description,
                          quick_settings, run_child)
from trace_tools.command_line import ArgumentParser
from utils.collective_start import wait_beyond_fastest

CHILD = REPO_ROOT / "bench" / "allreduce_child.py"
RANKS = 2
DEFAULT_SIZES = "65536,921600,8388608"
CHILD_TIMEOUT_S = 1800


def measure(sizes: str, repeats: int, compute_ms: str | None, seed: int) -> dict[int, list[float]]:
    """Seconds per all-reduce, by size, from one 2-rank child run."""
    args = ["--sizes", sizes, "--repeats", repeats, "--warmup", 3, "--seed", seed]
    if compute_ms:
        args += ["--after-compute-ms", compute_ms]
    run = run_child([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}",
                     CHILD, *args], env=child_env(threads=1), timeout_s=CHILD_TIMEOUT_S)
    what = f"after {compute_ms} ms of compute" if compute_ms else "after a barrier"
    if not run.ok:
        raise BenchError(f"the all-reduce {what} failed: {run.reason()}")
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    if not results:
        raise BenchError(f"the all-reduce {what} printed no times")
    return {result["bytes"]: result["seconds"] for result in results}


def report(idle: dict[int, list[float]], busy: dict[int, list[float]], compute_ms: str) -> str:
    rows = []
    for size in sorted(idle):
        idle_ms = [1000 * s for s in idle[size]]
        busy_ms = [1000 * s for s in busy[size]]
        idle_median, busy_median = statistics.median(idle_ms), statistics.median(busy_ms)
        idle_mean, busy_mean = statistics.mean(idle_ms), statistics.mean(busy_ms)
        rows.append([f"{size / 1e6:g}", len(busy_ms), f"{busy_median:.2f}", f"{idle_median:.2f}",
                     f"{busy_median - idle_median:+.2f}", f"{busy_median / idle_median:.2f}x",
                     f"{busy_mean:.2f}", f"{idle_mean:.2f}", f"{busy_mean - idle_mean:+.2f}",
                     f"{wait_beyond_fastest(busy_ms):.2f}"])
    headers = ["MB", "repeats", f"after {compute_ms} ms compute: median ms", "after a barrier: median ms",
               "difference ms", "ratio", "after compute: mean ms", "after a barrier: mean ms", "difference (means) ms",
               "after compute: mean beyond its fastest ms"]
    return format_table(headers, rows)


def main(argv: list | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="message sizes in bytes (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=100, help="timed all-reduces per size and run (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="pairs of runs, in alternating order, pooled (default: %(default)s)")
    parser.add_argument("--compute-ms", default="10,30", metavar="LOW,HIGH",
                        help="range of the compute time before each all-reduce (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="a smoke test: one small size, a few repeats, one round")
    args = parser.parse_args(argv)
    if args.quick:
        quick_settings(parser, argv, args, dict(sizes="65536", repeats=5, rounds=1))
    if min(args.repeats, args.rounds) < 1:
        return fail("--repeats and --rounds must be at least 1")
    try:
        compute_range_ms(args.compute_ms)
        if not all(int(size) >= 4 for size in args.sizes.split(",")):
            raise ValueError
    except argparse.ArgumentTypeError as error:
        return fail(f"--compute-ms {error}")
    except ValueError:
        return fail(f"--sizes {args.sizes!r}: expected comma-separated sizes in bytes, each at least 4")
    exit_on_sigterm()
    print(machine_description(("torch",)), flush=True)
    idle: dict[int, list[float]] = {}
    busy: dict[int, list[float]] = {}
    try:
        for round_index in range(args.rounds):
            order = ("idle", "busy") if round_index % 2 == 0 else ("busy", "idle")
            for condition in order:
                times = measure(args.sizes, args.repeats, args.compute_ms if condition == "busy" else None,
                                seed=round_index)
                for size, seconds in times.items():
                    (busy if condition == "busy" else idle).setdefault(size, []).extend(seconds)
    except BenchError as error:
        return fail(str(error))
    print(f"2-rank gloo all-reduce on the loopback, {args.rounds} round(s) of {args.repeats} repeats per size and "
          f"condition; time from the later rank's call to the later rank's finish.\n")
    print(report(idle, busy, args.compute_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
