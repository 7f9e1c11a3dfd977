"""What a gloo all-reduce costs in CPU time per byte at several network rates: its communication threads' and the
kernel's.

Each row also counts how many times the communication threads were given a CPU per all-reduce (schedstat): a
thread that sleeps on its sockets is woken for every piece the network delivers, so on a paced network the count
rises with the pieces, and the CPU time per all-reduce rises with it.

The converter gives each collective of a CPU run a CPU node with the communication threads' CPU time per untraced
step (trace_tools.core_sharing), measured at the traced network's rate, and the .et carries it to every rate it is
simulated at. The machine's interrupt time it only reports: this bench also says whether the kernel counts that
time in the threads it interrupted (every thread's CPU time plus the idle time then make up the CPUs' whole time;
with the interrupt time added, more than that), so that adding it would count it twice, as on a kernel without
CONFIG_IRQ_TIME_ACCOUNTING. It measures how each changes with the rate: two ranks under torchrun in a private network
namespace whose loopback is rate-limited with tc tbf (as bench/whatif_bench.py does; root), reducing one message
back to back for about --seconds at each rate, the rates in alternating order over --rounds so a machine that gets
busier or quieter favours none. /proc/stat counts interrupt time in clock ticks (10 ms), so each run lasts long
enough to hold many.

    sudo python bench/communication_cpu.py [--rates unthrottled,1gbit,500mbit,100mbit] [--mb 8] [--seconds 4]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

from bench.common import (REPO_ROOT, BenchError, child_env, exit_on_sigterm, fail, format_table, machine_description,
                          quick_settings, run_child)
from bench.netem import Namespace, NetemUnavailable, Rate, missing_requirement, parse_rate
from trace_tools.command_line import ArgumentParser

CHILD = REPO_ROOT / "bench" / "allreduce_child.py"
RANKS = 2
DEFAULT_RATES = "unthrottled,1gbit,500mbit,100mbit"
UNTHROTTLED_GUESS_BITS = 8e9  # to size the unthrottled runs (a 2-core VM's loopback moves 9-14 Gbit/s)
CHILD_TIMEOUT_S = 900
# Below this share of the CPUs' time, the interrupt time (in 10 ms ticks) is too small against the other times'
# error (a thread that ended in the run, the ms the reading takes) to say where it was counted
TELLING_INTERRUPT_SHARE = 0.02


def repeats_for(rate: Rate, message_bytes: int, seconds: float) -> int:
    """All-reduces that take about `seconds` at the rate: a 2-rank ring moves 2 x the message through the loopback."""
    bits_per_s = rate.bits_per_s or UNTHROTTLED_GUESS_BITS
    return max(3, math.ceil(seconds * bits_per_s / (2 * message_bytes * 8)))


def measure(namespace: Namespace, rate: Rate, message_bytes: int, seconds: float) -> dict:
    """One child run at the rate: the child's JSON line (wall time, threads' and interrupts' CPU seconds)."""
    namespace.set_rate(rate)
    repeats = repeats_for(rate, message_bytes, seconds)
    command = namespace.command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 f"--nproc_per_node={RANKS}", CHILD, "--sizes", message_bytes, "--repeats", repeats,
                                 "--warmup", 2, "--cpu-times"])
    run = run_child(command, env=child_env(threads=1), timeout_s=CHILD_TIMEOUT_S)
    if not run.ok:
        raise BenchError(f"the all-reduces at {rate.label} failed: {run.reason()}")
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise BenchError(f"the all-reduces at {rate.label} printed no CPU times")
    return json.loads(lines[-1])


def interrupt_ms_per_mb(run: dict) -> float:
    """The machine's interrupt time in one child run, in ms per MB of the messages it reduced."""
    return 1000 * run["interrupt_cpu_s"] / (run["repeats"] * run["bytes"] / 1e6)


def accounted_share(run: dict, with_interrupts: bool) -> float:
    """Every thread's CPU time plus the idle time (plus the interrupt time) over the CPUs' whole time in a run."""
    extra = run["interrupt_cpu_s"] if with_interrupts else 0.0
    return (run["all_threads_cpu_s"] + run["idle_cpu_s"] + extra) / run["cpus_time_s"]


def interrupts_inside_threads(results: dict[str, list[dict]]) -> str:
    """Per rate, pooled over its runs: the share of the CPUs' time that no thread's CPU time and no idle time holds,
    against the interrupt time's share, and which accounting that shows. Where the threads' time holds the
    interrupts, little is outside both; where it does not, the interrupt time is outside."""
    lines = []
    for label, runs in results.items():
        whole = sum(run["cpus_time_s"] for run in runs)
        outside = 1 - sum(run["all_threads_cpu_s"] + run["idle_cpu_s"] for run in runs) / whole
        interrupts = sum(run["interrupt_cpu_s"] for run in runs) / whole
        if interrupts < TELLING_INTERRUPT_SHARE:
            verdict = "too little interrupt time to tell where it was counted"
        elif abs(outside) < abs(outside - interrupts):
            verdict = "the interrupt time is in the threads' time (added to it, it would count twice)"
        else:
            verdict = "the interrupt time is outside the threads' time"
        lines.append(f"- {label}: {outside:.1%} of the CPUs' time was in no thread and not idle; the interrupt time "
                     f"was {interrupts:.1%}: {verdict}")
    return "\n".join(lines)


def report(results: dict[str, list[dict]]) -> str:
    """One row a rate: per all-reduce, and per MB of the message, the threads' and the kernel's CPU time."""
    rows = []
    for label, runs in results.items():
        reduces = sum(r["repeats"] for r in runs)
        megabytes = sum(r["repeats"] * r["bytes"] for r in runs) / 1e6
        threads_ms = 1000 * sum(sum(r["communication_threads_cpu_s"]) for r in runs)
        interrupts_ms = 1000 * sum(r["interrupt_cpu_s"] for r in runs)
        per_run = [interrupt_ms_per_mb(r) for r in runs]
        scheduled = sum(sum(r["communication_threads_scheduled"]) for r in runs)
        rows.append([label, len(runs), reduces, f"{1000 * sum(r['wall_s'] for r in runs) / reduces:,.1f}",
                     f"{threads_ms / reduces:.2f}", f"{interrupts_ms / reduces:.2f}",
                     f"{threads_ms / megabytes:.3f}", f"{interrupts_ms / megabytes:.3f}",
                     f"{(threads_ms + interrupts_ms) / megabytes:.3f}",
                     ", ".join(f"{x:.3f}" for x in per_run),
                     ", ".join(f"{accounted_share(r, False):.3f}" for r in runs),
                     ", ".join(f"{accounted_share(r, True):.3f}" for r in runs),
                     f"{scheduled / reduces:,.1f}", f"{1000 * threads_ms / scheduled:.1f}" if scheduled else "n/a"])
    headers = ["rate", "runs", "all-reduces", "ms each", "threads' CPU ms each (both ranks)",
               "interrupt CPU ms each (machine)", "threads ms/MB", "interrupts ms/MB", "both ms/MB",
               "interrupts ms/MB in each run", "all threads + idle / CPUs' time", "+ interrupts / CPUs' time",
               "threads given a CPU, times each (both ranks)", "threads' CPU us a time"]
    return format_table(headers, rows)


def main(argv: list | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default=DEFAULT_RATES, help="comma-separated rates (default: %(default)s)")
    parser.add_argument("--mb", type=float, default=8.0, help="message size in MB (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=4.0,
                        help="about how long each run reduces at its rate (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="passes over the rates, in alternating order, pooled (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: 1 MB at unthrottled and 100mbit, one run of about a second each")
    args = parser.parse_args(argv)
    if args.quick:
        quick_settings(parser, argv, args, dict(rates="unthrottled,100mbit", mb=1.0, seconds=1.0, rounds=1))
    try:
        rates = [parse_rate(text) for text in args.rates.split(",")]
    except ValueError as error:
        return fail(f"--rates: {error}")
    if args.mb <= 0 or args.seconds <= 0 or args.rounds < 1:
        return fail("--mb and --seconds must be positive and --rounds at least 1")
    problem = missing_requirement()
    if problem:
        return fail(problem)
    exit_on_sigterm()
    message_bytes = int(args.mb * 1e6) // 4 * 4
    print(machine_description(("torch",)), flush=True)
    results: dict[str, list[dict]] = {rate.label: [] for rate in rates}
    try:
        with Namespace() as namespace:
            for round_index in range(args.rounds):
                for rate in rates if round_index % 2 == 0 else list(reversed(rates)):
                    result = measure(namespace, rate, message_bytes, args.seconds)
                    results[rate.label].append(result)
                    print(f"    {rate.label}: {result['repeats']} all-reduces in {result['wall_s']:.1f} s, threads "
                          f"{sum(result['communication_threads_cpu_s']):.3f} s, interrupts "
                          f"{result['interrupt_cpu_s']:.2f} s of CPU", flush=True)
    except (BenchError, NetemUnavailable) as error:
        return fail(str(error))
    print(f"\n2-rank gloo all-reduce of {message_bytes / 1e6:g} MB, back to back, {args.rounds} run(s) a rate of about "
          f"{args.seconds:g} s; CPU time per all-reduce and per MB of the message (the loopback carries 2 x it).\n")
    print(report(results))
    medians = {label: statistics.median(interrupt_ms_per_mb(r) for r in runs) for label, runs in results.items()}
    print("\nInterrupt ms/MB, median of the runs: " + ", ".join(f"{k} {v:.3f}" for k, v in medians.items()))
    print("Where the kernel's interrupt time was counted:\n" + interrupts_inside_threads(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
