"""What one training process spends in CPU per step at each network rate, by thread: the training thread's and the
communication threads'.

A `.et` holds the CPU times of the rate it was traced at, and ASTRA-sim runs them unchanged at every rate it
simulates. So wherever the same program spends more CPU per step on a slower network (gloo's threads handle the
bytes in more, smaller pieces; the training thread resumes after waiting), a trace from one rate predicts another
too slow or too fast by that much, and no rule in a converter that reads one trace can see it. This measures it on
the machine, in one process so that the speed of separate processes (docs/BENCHMARKS.md §4b) stays out: two ranks
of `--model` under torchrun in a network namespace whose loopback tc tbf rate-limits (as bench/whatif_bench.py;
root), the tracer's window at the first rate, then the rates in blocks of `--block` steps, the order alternating
over `--cycles` passes. The tracer times every step after its window (run.json: wall time, the training thread's
and the communication threads' CPU time from schedstat, the process's); each rate's row is the median over its
steps, less `--settle` after each change, and its ratio to the first rate's.

    sudo python bench/rate_cpu.py [--model tiny] [--rates unthrottled,1gbit,400mbit,100mbit] [--cycles 2]
"""
from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path

from bench.common import (OUR_LOG_FILE, BenchError, WorkFolder, below_minimum, child_env, exit_on_sigterm, fail,
                          format_table, machine_description, quick_settings)
from bench.netem import Namespace, NetemUnavailable, missing_requirement, parse_rate
from bench.whatif_bench import (MODELS, ModelSetup, RateCycler, cycle_schedule, cycled_run, once_more_on_failure,
                                timed_steps)
from trace_tools.command_line import ArgumentParser
from trace_tools.layout import RUN_INFO
from utils.run_config import DEFAULT_WARMUP_STEPS

WAIT_STEPS = 4      # untraced steps before the window: gloo's connections and the allocator settle
ACTIVE_STEPS = 1    # the window (after the tracer's warm-up steps) is not measured here
FIRST_BLOCK = 2     # steps after the window before the first change (the tracer writes its files then)
TRACE_NAME = "rate_cpu"
RUN_FOLDER = "run"  # the run's logs and traces, under --keep DIR or a temporary folder
# run.json's per-step lists (seconds), by column
COLUMNS = (("wall ms", "untraced_step_wall_time_s"), ("training thread CPU ms", "untraced_step_thread_cpu_time_s"),
           ("communication threads CPU ms", "untraced_step_communication_cpu_time_s"),
           ("process CPU ms", "untraced_step_cpu_time_s"))


def steps_at_each_rate(switches: list, steps: list, first_step: int, settle: int, stalls: list = ()) -> dict:
    """{rate label: [trainer step numbers]}: the steps from `first_step` on that began after a change to the rate and
    ended before the next change, less the first `settle` after each change (none where the alternating order turns
    round and a block repeats its predecessor's rate), and less any step during which a stalled qdisc was replaced.
    `switches` and `stalls` are RateCycler's, `steps` timed_steps'."""
    at_rate: dict = {}
    ends = [when for when, *_ in switches[1:]] + [float("inf")]
    since, previous = 0.0, None
    for (began, rate, *_), ended in zip(switches, ends):
        changed = rate.label != previous
        since, previous = (began if changed else since), rate.label
        inside = [step for step, start, end in steps if step >= first_step and start >= since and began < end <= ended
                  and not any(start <= when <= end for when, *_ in stalls)]
        at_rate.setdefault(rate.label, []).extend(inside[settle:] if changed else inside)
    return at_rate


def per_rate_medians(info: dict, at_rate: dict) -> dict:
    """{(rate label, rank): {column: median ms}} from run.json's untraced steps (the tracer's step k is the trainer's
    step k + 1)."""
    index = {step: i for i, step in enumerate(info.get("untraced_steps") or [])}
    medians = {}
    for label, steps in at_rate.items():
        for rank in info.get("ranks", []):
            rows = [index[step - 1] for step in steps if step - 1 in index]
            if not rows:
                continue
            medians[label, rank["rank"]] = {column: 1000 * statistics.median(rank[key][i] for i in rows)
                                             for column, key in COLUMNS}
            medians[label, rank["rank"]]["steps"] = len(rows)
    return medians


def report(medians: dict, first: str) -> str:
    """A row per rate and rank: the medians, and each CPU time over the first rate's."""
    headers = ["rate", "rank", "steps", *(c for c, _ in COLUMNS), "training thread / first rate",
               "communication / first rate", "process / first rate"]
    rows = []
    for (label, rank), values in medians.items():
        base = medians.get((first, rank))
        ratios = [f"{values[c] / base[c]:.2f}x" if base and base[c] > 0 else "n/a" for c, _ in COLUMNS[1:]]
        rows.append([label, rank, values["steps"], *(f"{values[c]:,.1f}" for c, _ in COLUMNS), *ratios])
    return format_table(headers, rows)


def run(args, setup: ModelSetup, rates: list, folder: Path) -> tuple:
    """The cycled traced run in folder/run (made afresh): (its run.json, {rate label: the trainer's steps at it})."""
    schedule = [rates[0]] + cycle_schedule(rates, args.cycles)
    after = FIRST_BLOCK + (len(schedule) - 1) * args.block + 1
    steps = WAIT_STEPS + DEFAULT_WARMUP_STEPS + ACTIVE_STEPS + after
    work = folder / RUN_FOLDER
    extra = ["--enable-tracing", "--trace-output-dir", work / "traces", "--trace-name", TRACE_NAME,
             "--trace-wait-steps", WAIT_STEPS, "--trace-active-steps", ACTIVE_STEPS, "--trace-after-steps", after]
    log = work / "logs" / OUR_LOG_FILE
    with Namespace(burst_slack_s=setup.burst_slack_s) as namespace:
        print(f"... {setup.label}: {steps} steps, rates {', '.join(r.label for r in schedule)} after the window, "
              f"{args.block} steps each", flush=True)

        def attempt() -> RateCycler:
            shutil.rmtree(work, ignore_errors=True)  # the cycler follows the log from its start
            work.mkdir(parents=True)
            cycler = RateCycler(namespace, schedule, FIRST_BLOCK, args.block, log,
                                window_end=WAIT_STEPS + DEFAULT_WARMUP_STEPS + ACTIVE_STEPS)
            cycled_run(namespace, setup, work, child_env(threads=1), extra, steps, cycler, "the cycled run")
            return cycler

        cycler = once_more_on_failure(attempt)
    path = work / "traces" / TRACE_NAME / RUN_INFO
    if not path.is_file():
        raise BenchError(f"{path}: the tracer wrote no run.json")
    first_step = WAIT_STEPS + DEFAULT_WARMUP_STEPS + ACTIVE_STEPS + 1  # the trainer's first step after the window
    at_rate = steps_at_each_rate(cycler.switches[1:], timed_steps(log), first_step, args.settle, cycler.stalls)
    return json.loads(path.read_text(encoding="utf-8")), at_rate


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="bench/rate_cpu.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny", help="(default: %(default)s)")
    parser.add_argument("--rates", default=None,
                        help="comma-separated tc rates, the first the reference (default: the model's what-if rates)")
    parser.add_argument("--cycles", type=int, default=2, help="passes over the rates (default: %(default)s)")
    parser.add_argument("--block", type=int, default=None, help="steps at one rate (default: the what-if bench's)")
    parser.add_argument("--settle", type=int, default=None,
                        help="steps left out after each change (default: the what-if bench's)")
    parser.add_argument("--keep", default=None, metavar="DIR", help="keep the run's logs and run.json in DIR/run")
    parser.add_argument("--quick", action="store_true",
                        help="GPT-2 tiny, unthrottled and 100 Mbit/s, one pass of 6-step blocks: a smoke test")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        quick_settings(parser, argv, args, dict(model="tiny", rates="unthrottled,100mbit", cycles=1, block=6, settle=1))
    setup = MODELS[args.model]
    args.rates = args.rates or ",".join(setup.rates)
    args.block = setup.block if args.block is None else args.block
    args.settle = setup.settle if args.settle is None else args.settle
    too_small = below_minimum(args, (("cycles", 1), ("block", 1), ("settle", 0)))
    if too_small:
        return fail(too_small)
    if args.settle >= args.block:
        return fail(f"--settle {args.settle}: must be less than --block {args.block}")
    try:
        rates = [parse_rate(text) for text in args.rates.split(",")]
    except ValueError as exc:
        return fail(f"--rates {args.rates}: {exc}")
    if len({rate.label for rate in rates}) < 2:
        return fail(f"--rates {args.rates}: give at least two different rates")
    problem = missing_requirement()
    if problem:
        return fail(f"bench/rate_cpu.py: {problem}")
    exit_on_sigterm()
    print(machine_description(("torch", "transformers")))
    with WorkFolder(args.keep, "rate_cpu-") as work:
        try:
            info, at_rate = run(args, setup, rates, work.path)
        except (BenchError, NetemUnavailable) as exc:
            return work.fail(str(exc))
    medians, first = per_rate_medians(info, at_rate), rates[0].label
    if not any(label == first for label, _ in medians):
        return fail(f"no step of the run was timed at {first}: nothing to compare with")
    print(f"{setup.label}, one process; medians over each rate's steps after its first {args.settle}:")
    print(report(medians, first))
    return 0


if __name__ == "__main__":
    sys.exit(main())
