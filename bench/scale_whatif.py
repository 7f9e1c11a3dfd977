"""Scale-out against real runs: ASTRA-sim on a 2-rank trace made into N ranks, against real N-rank runs.

`simulate.py --ranks N` (trace_tools.scale) makes N ranks of a 2-rank data-parallel trace: every rank runs a traced
rank's compute, and the ring's all-reduce grows as 2(N-1)/N. This checks that prediction against real runs of the
same training on the same network, as root, in whatif_bench's network namespace: one loopback, rate-limited by tc
tbf, carries every rank's traffic, so a ring all-reduce of S bytes on N ranks moves 2(N-1)S through it (time
2(N-1)S/P at the payload rate P), which an N-NPU ring of P/N per link reproduces (2(N-1)/N x S / (P/N)); at 2 ranks
that is whatif_bench's P/2.

At scale every rank brings its own hardware, so every run here gives each rank the same share of the machine:
`--ranks-per-core` ranks on each core (default 1: the 2-rank runs on two cores, the N-rank runs on N). Without it an
N-rank run on the same cores would compute slower by the machine's oversubscription, which no trace or scaling rule
could know. With 2 a core, N ranks fit on N/2 cores, but then a rank's compute also waits for the other rank on its
core, which a trace shows only as that wait: the converter reads a training thread's wait for a core as the
communication threads' doing (trace_tools/core_sharing.py) and ASTRA-sim shares no core between ranks, so at 2 a
core the predictions at the traced scale already come out short by about one rank's compute. The trace is taken at
full speed (a trace through tbf carries that rate's communication CPU time:
docs/BENCHMARKS.md §4b) and the real runs cycle through the throttled rates, as whatif_bench's untraced runs do, at
2 ranks (the traced scale) and at N ranks.

    sudo python bench/scale_whatif.py [--model tiny] [--ranks 4[,8...]] [--rates 1gbit,400mbit,100mbit] [--traces 2]

Several scales (`--ranks 4,8`) share the traces and the 2-rank runs; each gets its own table.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from bench.common import (BenchError, WorkFolder, child_env, exit_on_sigterm, fail, foreign_checkout, format_table,
                          machine_description, quick_settings)
from bench.netem import DEFAULT_MTU, Namespace, NetemUnavailable, Rate, missing_requirement, parse_rate
from bench.whatif_bench import (MODELS, RANKS, RealRuns, find_simulator, fmt_ms, label_slug, link_gbs,
                                real_run, traced_run, verify_rates)
from trace_tools.command_line import ArgumentParser

BAND = 0.10  # issue 9's band for a prediction at a rate other than the trace's


def pinned(setup, ranks: int, per_core: int):
    """The model's setup at `ranks` ranks, pinned to the first ranks/per_core of the cores this process may use."""
    cores = sorted(os.sched_getaffinity(0))[:ranks // per_core]
    return replace(setup, ranks=ranks, cpus=tuple(cores))


def quick_setup(setup):
    """--quick: the model's setup with a few short blocks, no warm-up cycle."""
    return replace(setup, skip=3, block=5, settle=1, warmup_cycles=0)


def run_settings(args, setup) -> argparse.Namespace:
    """The flags whatif_bench's traced_run and real_run read, from the model's defaults: a traced run without
    untraced cycles after its window (only its own replay and trace are used here)."""
    return argparse.Namespace(skip=setup.skip, block=setup.block, settle=setup.settle, cycles=args.cycles,
                              warmup_cycles=setup.warmup_cycles, after_window_cycles=0,
                              trace_wait_steps=setup.skip + 2, trace_active_steps=None)


def predict(sim, folder: Path, ranks: int, bits_per_s: float, label: str, latency_ns: float) -> float:
    """ASTRA-sim's step (ms) for the converted 2-rank run at `folder` made into `ranks` ranks, at a payload rate."""
    result = sim.module.simulate_run(folder, ranks=ranks, bandwidth_gbs=link_gbs(bits_per_s, ranks),
                                     latency_ns=latency_ns, binary=sim.binary,
                                     work_dir=folder / f"astra-sim-{ranks}-ranks-{label_slug(label)}")
    return result.step_ms


def report(rows: list, ranks: int) -> str:
    headers = ["trace", "network rate", f"real ms, {RANKS} ranks", f"predicted ms, {RANKS} ranks",
               f"predicted / real, {RANKS} ranks", f"real ms, {ranks} ranks", f"predicted ms, {ranks} ranks",
               f"predicted / real, {ranks} ranks", f"real change ms, {RANKS}->{ranks}", "predicted change ms",
               f"CPU ms/step, {RANKS} / {ranks} ranks (rank 0's process)"]
    return format_table(headers, rows)


def rank_counts(text: str) -> tuple:
    """--ranks: one or more comma-separated rank counts, in increasing order, each once."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers of ranks, comma-separated") from None
    if list(counts) != sorted(set(counts)):
        raise argparse.ArgumentTypeError(f"{text!r}: give each count once, smallest first")
    return counts


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="bench/scale_whatif.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny", help="(default: %(default)s)")
    parser.add_argument("--ranks", type=rank_counts, default=(4,), metavar="N[,N...]",
                        help="ranks of the real and simulated scale-out, one or more (default: 4)")
    parser.add_argument("--ranks-per-core", type=int, default=None,
                        help="ranks sharing each core, in every run (default: 1; --quick: 2 where --ranks outnumber "
                        "the cores)")
    parser.add_argument("--rates", default="1gbit,400mbit,100mbit",
                        help="comma-separated throttled tc rates of the real runs (default: %(default)s)")
    parser.add_argument("--traces", type=int, default=2, help="traced 2-rank runs (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="untraced runs at each scale, pooled (default: %(default)s)")
    parser.add_argument("--cycles", type=int, default=2,
                        help="passes over the rates in an untraced run (default: %(default)s)")
    parser.add_argument("--sim-latency-ns", type=float, default=500.0, help="ASTRA-sim link latency (default: "
                        "%(default)s)")
    parser.add_argument("--astra-sim", default=None, metavar="PATH", help="ASTRA-sim's analytical binary (default: "
                        "$ASTRA_SIM)")
    parser.add_argument("--keep", metavar="DIR", default=None, help="keep the runs' logs, traces and .et files in DIR")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: GPT-2 tiny at 100 Mbit/s, one trace, one pass of 5-step blocks")
    return parser


def check(args) -> tuple:
    """(the model setup, the rates), or ValueError naming the flag."""
    cores = len(os.sched_getaffinity(0))
    for ranks in args.ranks:
        if ranks <= RANKS:
            raise ValueError(f"--ranks {ranks}: must be more than the {RANKS} traced")
        if args.ranks_per_core < 1 or RANKS % args.ranks_per_core or ranks % args.ranks_per_core:
            raise ValueError(f"--ranks-per-core {args.ranks_per_core}: must divide {RANKS} and --ranks {ranks}")
    largest = max(args.ranks)
    if largest // args.ranks_per_core > cores:
        raise ValueError(f"--ranks {largest} at {args.ranks_per_core} a core needs "
                         f"{largest // args.ranks_per_core} cores; this process may use {cores}")
    if min(args.traces, args.repeats, args.cycles) < 1:
        raise ValueError("--traces, --repeats and --cycles must be at least 1")
    if args.cycles > 1 and args.cycles % 2:
        raise ValueError(f"--cycles {args.cycles}: use an even number (or 1), so every rate sits as early as late")
    rates = [parse_rate(text) for text in args.rates.split(",") if text.strip()]
    if not rates or not all(rate.throttled for rate in rates):
        raise ValueError(f"--rates {args.rates}: give throttled rates only (the unthrottled loopback's speed is its "
                         "cores', which differ between the scales)")
    return (quick_setup(MODELS[args.model]) if args.quick else MODELS[args.model]), rates


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        quick_settings(parser, argv, args, dict(model="tiny", rates="100mbit", traces=1, repeats=1, cycles=1))
    if args.ranks_per_core is None:
        # 1 a core; a --quick smoke test on fewer cores than --ranks doubles up (it had refused on a 2-core machine)
        cores = len(os.sched_getaffinity(0))
        args.ranks_per_core = RANKS if args.quick and max(args.ranks) > cores and all(
            n % RANKS == 0 and n // RANKS <= cores for n in args.ranks) else 1
    foreign = foreign_checkout(__file__)
    if foreign:
        return fail(foreign)
    try:
        setup, rates = check(args)
    except ValueError as exc:
        return fail(f"bench/scale_whatif.py: {exc}")
    problem = missing_requirement()
    if problem:
        return fail(f"bench/scale_whatif.py: {problem}")
    sim = find_simulator(args.astra_sim)
    if not sim.ok:
        return fail(f"bench/scale_whatif.py: {sim.missing}")
    exit_on_sigterm()
    print(machine_description(("torch", "transformers")))
    scales = (RANKS, *args.ranks)
    setups = {n: pinned(setup, n, args.ranks_per_core) for n in scales}
    settings, env = run_settings(args, setup), child_env(threads=1)
    with WorkFolder(args.keep, "scale_whatif-") as work:
        root = work.path
        real = {n: {r.label: RealRuns(r) for r in rates} for n in scales}
        try:
            with Namespace(mtu=DEFAULT_MTU, burst_slack_s=setup.burst_slack_s) as ns:
                print("... tbf check", flush=True)
                _, payload = verify_rates(ns, rates, 1.0)
                traces = []
                for index in range(args.traces):
                    print(f"... traced run {index + 1} of {args.traces} ({RANKS} ranks on cores "
                          f"{setups[RANKS].cpus})", flush=True)
                    traces.append(traced_run(ns, setups[RANKS], Rate("unthrottled", None), index, settings, env,
                                             root, rates))
                for repeat in range(args.repeats):
                    for run_setup in setups.values():
                        print(f"... untraced run {repeat + 1} of {args.repeats}, {run_setup.ranks} ranks on cores "
                              f"{run_setup.cpus}", flush=True)
                        real_run(ns, run_setup, rates, repeat, settings, env, root / f"{run_setup.ranks}-ranks",
                                 real[run_setup.ranks])
            tables = {n: ([], []) for n in args.ranks}  # rows, ratios
            for trace in traces:
                for rate in rates:
                    measured = {n: real[n][rate.label] for n in scales}
                    empty = [n for n in scales if measured[n].step_ms is None]
                    if empty:
                        raise BenchError(f"no clean step of the {empty[0]}-rank run at {rate.label}")
                    predicted = {n: predict(sim, trace.folder, n, payload[rate.label], rate.label,
                                            args.sim_latency_ns) for n in scales}
                    ratio = {n: predicted[n] / measured[n].step_ms for n in scales}
                    for n, (rows, ratios) in tables.items():
                        ratios.append(ratio[n])
                        rows.append([trace.index + 1, rate.label,
                                     *(cell for m in (RANKS, n) for cell in (fmt_ms(measured[m].step_ms),
                                                                             fmt_ms(predicted[m]), f"{ratio[m]:.2f}x")),
                                     f"{measured[n].step_ms - measured[RANKS].step_ms:+,.1f}",
                                     f"{predicted[n] - predicted[RANKS]:+,.1f}",
                                     " / ".join(fmt_ms(measured[m].cpu_ms) for m in (RANKS, n))])
        except (BenchError, NetemUnavailable, sim.module.SimulationError) as exc:
            return work.fail(f"bench/scale_whatif.py: {exc}")
    for n, (rows, ratios) in tables.items():
        print(f"\n{setup.label}: a 2-rank trace at full speed, simulated at 2 and {n} ranks (ring, P/N per "
              f"link; P the payload rate through tbf), against real untraced runs at each scale, "
              f"{args.ranks_per_core} ranks a core:\n")
        print(report(rows, n))
        within = sum(abs(r - 1) <= BAND for r in ratios)
        print(f"\nAt {n} ranks: predicted / real {min(ratios):.2f}x to {max(ratios):.2f}x; {within} of "
              f"{len(ratios)} within {BAND:.0%}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
