"""How often lo's tbf stalls when its rate changes: changed in place against a new qdisc at every change.

bench/whatif_bench.py changes the loopback's rate every few steps while two ranks train. Its runs recorded 15 stalls
(2026-11-27 and -28): the tbf held packets and sent none until it was replaced, each time in the first block after
tc had lowered its rate in place (`tc qdisc replace` on the tbf already there). This bench runs that traffic without
a model: two ranks under torchrun in a private network namespace (root), each step computing for --compute-ms and
then all-reducing a message of --mb MB with gloo, while whatif_bench's own RateCycler moves through the rates in
blocks of --block steps, alternating their order, and clears a stall the way the benchmark does. It counts the stalls
with each way of changing the rate:

- in-place: tc changes the rate of the tbf already on lo (what bench/netem.py did before 2026-11-28);
- new: the old tbf is deleted and a new one added at each change (bench/netem.py's Namespace.set_rate).

    sudo python bench/tbf_stalls.py [--modes in-place,new] [--cycles 25] [--block 10]
"""
from __future__ import annotations

import argparse
import datetime
from collections import Counter
import sys
import time
from pathlib import Path

from bench.common import (BenchError, WorkFolder, child_env, exit_on_sigterm, fail, format_table, machine_description,
                          run_child)
from bench.netem import Namespace, NetemUnavailable, missing_requirement, parse_rate
from trace_tools.command_line import ArgumentParser

MODES = ("in-place", "new")
DEFAULT_RATES = "unthrottled,1gbit,400mbit,100mbit"
FIRST_STEPS = 10  # steps before the first change: gloo's connections and the first all-reduces settle
CHILD_TIMEOUT_S = 1800


class InPlaceNamespace(Namespace):
    """A namespace whose tbf has its rate changed in place, as bench/netem.py did before it added a new qdisc at every
    change; clearing a stall still puts a new qdisc on lo, as it always did."""

    def set_rate(self, rate) -> str:
        if not rate.throttled:
            return super().set_rate(rate)
        argv = self.tbf_command(rate)
        self._check(self.command(argv), f"limit lo to {rate.label}")
        self.rate = rate
        return " ".join(argv)

    def reset_rate(self) -> str:
        return Namespace.set_rate(self, self.rate)


def worker(args) -> None:
    """One rank (under torchrun): compute, all-reduce, and on rank 0 a step line in the trainer's log format."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    message = torch.ones(max(1, round(args.mb * 1e6 / 4)))
    log = open(args.step_log, "a", encoding="utf-8") if dist.get_rank() == 0 else None
    for step in range(1, args.steps + 1):
        began = time.perf_counter()
        while time.perf_counter() < began + args.compute_ms / 1000:  # the step's compute, on its core
            pass
        dist.all_reduce(message)
        if log:
            now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
            log.write(f"{now} rank 0/2 INFO tbf_stalls: step {step}/{args.steps} | all-reduce | "
                      f"{1000 * (time.perf_counter() - began):.1f} ms/step\n")
            log.flush()
    dist.barrier()  # the ranks tear gloo down together: one alone aborts at exit at times
    dist.destroy_process_group()


def run_mode(mode: str, rates: list, args, work: Path) -> dict:
    """The traffic through every block of rates with one way of changing them: blocks, steps, seconds, stalls."""
    from bench.whatif_bench import RateCycler, cycle_schedule

    schedule = cycle_schedule(rates, args.cycles)
    steps = FIRST_STEPS + len(schedule) * args.block + 1
    log = work / f"{mode}.log"
    log.unlink(missing_ok=True)
    with (InPlaceNamespace() if mode == "in-place" else Namespace()) as ns:
        cycler = RateCycler(ns, schedule, FIRST_STEPS + args.block, args.block, log)
        cycler.start_first()
        command = ns.command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              Path(__file__).resolve(), "--worker", "--steps", steps, "--step-log", log,
                              "--mb", args.mb, "--compute-ms", args.compute_ms])
        try:
            done = run_child(command, env=child_env(threads=1), timeout_s=CHILD_TIMEOUT_S)
        finally:
            cycler.finished.set()
            cycler.join()
    if not done.ok:
        raise BenchError(f"the {mode} run failed: {done.reason()}")
    if cycler.error:
        raise BenchError(f"the {mode} run's rate changes failed: {cycler.error}")
    return {"mode": mode, "blocks": len(schedule), "steps": steps, "seconds": done.wall_s,
            "stalls": len(cycler.stalls), "at": Counter(rate.label for _, rate, _ in cycler.stalls)}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="bench/tbf_stalls.py",
                            description="Stalls of lo's tbf when its rate changes in place or as a new qdisc (root).")
    parser.add_argument("--modes", default=",".join(MODES), help="ways of changing the rate (default: %(default)s)")
    parser.add_argument("--rates", default=DEFAULT_RATES, help="rates cycled through (default: %(default)s)")
    parser.add_argument("--cycles", type=int, default=25, help="passes over all rates per mode (default: %(default)s)")
    parser.add_argument("--block", type=int, default=10, help="steps at each rate (default: %(default)s)")
    parser.add_argument("--mb", type=float, default=0.9,
                        help="all-reduced message per step, MB (default: %(default)s, GPT-2 tiny's gradients)")
    parser.add_argument("--compute-ms", type=float, default=30.0,
                        help="compute before each all-reduce (default: %(default)s)")
    parser.add_argument("--keep", metavar="DIR", default=None, help="keep each mode's step log in DIR")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--step-log", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    if not modes or any(mode not in MODES for mode in modes):
        parser.error(f"--modes: {args.modes!r}: choose from {', '.join(MODES)}")
    if args.cycles < 1 or args.block < 2:
        parser.error("--cycles must be at least 1 and --block at least 2")
    if args.mb <= 0 or args.compute_ms < 0:
        parser.error("--mb must be above 0 and --compute-ms not below 0")
    try:
        rates = [parse_rate(text) for text in args.rates.split(",") if text.strip()]
    except ValueError as exc:
        parser.error(f"--rates: {exc}")
    if not any(rate.throttled for rate in rates):
        parser.error("--rates: name at least one throttled rate")
    exit_on_sigterm()
    problem = missing_requirement()
    if problem:
        return fail(f"bench/tbf_stalls.py: {problem}")
    print(machine_description(("torch",)))
    work = WorkFolder(args.keep, "tbf_stalls-")
    results = []
    with work:
        try:
            for mode in modes:
                print(f"... {mode}: {args.cycles} cycle(s) over {', '.join(r.label for r in rates)}, "
                      f"{args.block} steps a block", flush=True)
                results.append(run_mode(mode, rates, args, work.path))
        except (BenchError, NetemUnavailable) as exc:
            return work.fail(f"bench/tbf_stalls.py: {exc}")
    print()
    print(format_table(["rate changes", "blocks", "steps", "seconds", "stalls", "stalled at"],
                       [[r["mode"], r["blocks"], r["steps"], f"{r['seconds']:.0f}", r["stalls"],
                         ", ".join(f"{label} x{n}" for label, n in r["at"].items()) or "-"] for r in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
