"""Judge this checkout's converter on the traces earlier what-if benchmarks kept.

`bench/whatif_bench.py --keep DIR` leaves each traced run's host and device traces in DIR with whatif_results.json:
every rate's real step as that run measured it, and each trace's own steps after its window. This converts those
traces again with this checkout's convert_to_et.py (into --work, the kept folders stay as they are), simulates them
in ASTRA-sim at every rate as the benchmark does, and prints predicted / real with how many points are within the
issue's bands (a replay within 5%, another rate within 10%). A change to the converter's rules is judged on many
traces of several runs this way, without tracing again: a rule that only helps the trace it was tuned on shows.

    python bench/whatif_repredict.py /tmp/run1 /tmp/run2 [--astra-sim PATH] [--work DIR]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.common import BenchError, WorkFolder, child_env, fail, foreign_checkout, format_table
from bench.whatif_bench import (REPLAY_BAND, RESULTS_FILE, WHATIF_BAND, Progress, bands_count, bound_verdict, convert,
                                find_simulator, read_run_json, simulate_at, within_band)
from trace_tools.command_line import ArgumentParser
from trace_tools.layout import RUN_INFO, TRACE_FILE_RE


@dataclass
class Point:
    """One trace simulated at one rate, against the real step there and the same process's."""

    run: str
    trace: int
    rate: str
    replay: bool
    real_ms: float
    predicted_ms: float
    same_run_ms: float | None
    tracer_untraced_ms: float | None = None  # a replay's: the traced process's untraced steps as its tracer timed them
    faster: bool = False  # a network faster than the traced one
    without_communication_cpu_ms: float | None = None  # the step simulated without gloo's CPU nodes (CPU runs)


def read_results(folder: Path) -> dict:
    path = folder / RESULTS_FILE
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
        if not (isinstance(results, dict) and results["rates"] and results["traces"]):
            raise ValueError("no rates or no traces")
        if not isinstance(results["trace_rate"], str) or float(results["latency_ns"]) < 0:
            raise ValueError("no trace rate or simulated latency")
        if not all(float(r["bits_per_s"]) > 0 and float(r["real_ms"]) > 0 and r["label"] for r in results["rates"]):
            raise ValueError("a rate without its bandwidth or real step")
        if not all(int(t["index"]) and t["folder"] for t in results["traces"]):
            raise ValueError("a trace without its folder")
        partial = results.get("partial")
        done = Progress(**partial) if partial is not None else None
        if done and not (0 < int(done.traced) <= int(done.traced_planned)
                         and 0 < int(done.untraced) <= int(done.untraced_planned)):
            raise ValueError("a partial run's counts of finished runs are off")
    except FileNotFoundError:
        raise BenchError(f"{path}: not found; keep a run with `bench/whatif_bench.py --keep {folder}` "
                         "(runs kept before the file existed cannot be judged again)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"{path}: not a what-if results file ({exc})") from None
    return results


def reconvert(trace_folder: Path, work: Path, env: dict) -> Path:
    """A copy of the trace folder's inputs in `work`, converted by this checkout."""
    if not trace_folder.is_dir():
        raise BenchError(f"{trace_folder}: the kept trace folder is missing")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for path in trace_folder.iterdir():
        if path.is_file() and (TRACE_FILE_RE.match(path.name) or path.name == RUN_INFO):  # what a conversion reads
            shutil.copy2(path, work / path.name)
    convert(work, env)
    return work


def repredict(folder: Path, results: dict, work: Path, sim, env: dict) -> list:
    points = []
    partial = results.get("partial")
    if partial:
        print(f"    {folder.name}: cut short after {Progress(**partial).describe()}; judged on what those measured",
              flush=True)
    if any("tbf_bits_per_s" not in rate for rate in results["rates"]):
        print(f"    {folder.name}: kept before the bench simulated a throttled rate at its measured payload rate; its "
              "rates are simulated as recorded, at tbf's rate R", flush=True)
    traced_bits = next((r["bits_per_s"] for r in results["rates"] if r["label"] == results["trace_rate"]), None)
    for trace in results["traces"]:
        converted = reconvert(folder / trace["folder"], work / f"trace-{trace['index']}", env)
        tracer_untraced_ms = read_run_json(converted)[1]  # timed at the trace's rate only
        for rate in results["rates"]:
            label = rate["label"]
            replay = label == results["trace_rate"]
            simulated = simulate_at(sim, converted, label, rate["bits_per_s"], results["latency_ns"])
            points.append(Point(folder.name, trace["index"], label, replay, rate["real_ms"], simulated.step_ms,
                                (trace.get("same_run_ms") or {}).get(label), tracer_untraced_ms if replay else None,
                                bool(traced_bits) and rate["bits_per_s"] > traced_bits,
                                simulated.without_communication_cpu_ms))
        print(f"    {folder.name} trace {trace['index']}: converted and simulated at {len(results['rates'])} rates",
              flush=True)
    return points


def report(points: list) -> str:
    rows = [[p.run, p.trace, p.rate + (" (replay)" if p.replay else ""), f"{p.real_ms:,.1f}", f"{p.predicted_ms:,.1f}",
             f"{p.predicted_ms / p.real_ms:.2f}x",
             f"{p.same_run_ms:,.1f}" if p.same_run_ms else "n/a",
             f"{p.predicted_ms / p.same_run_ms:.2f}x" if p.same_run_ms else "n/a"] for p in points]

    def count(against) -> str:
        judged = [p for p in points if against(p)]
        return bands_count([p.predicted_ms / against(p) for p in judged if p.replay],
                           [p.predicted_ms / against(p) for p in judged if not p.replay])

    lines = [format_table(["run", "trace", "network rate", "real step ms", "predicted ms", "predicted / real",
                           "same run ms", "predicted / same run"], rows), "",
             f"Against the untraced runs: {count(lambda p: p.real_ms)} within the bands (replay {REPLAY_BAND:.0%}, "
             f"other rates {WHATIF_BAND:.0%})."]
    if any(p.same_run_ms for p in points):
        lines.append(f"Against the same processes after their windows: {count(lambda p: p.same_run_ms)} within the "
                     "bands.")
    def pooled(point: Point) -> float | None:
        return pooled_reference_ms(point, points)

    if any(map(pooled, points)):
        lines.append(f"Against more processes, the trace's own left out (the untraced runs' step and the other "
                     f"traces' own untraced steps after their windows at that rate, one weight each): "
                     f"{count(pooled)} within the bands.")
    own = [p.predicted_ms / p.tracer_untraced_ms for p in points if p.replay and p.tracer_untraced_ms]
    if own:
        # The steps whose CPU time the .et's ops take: this sets the graph and the network apart from the drift of a
        # process's pace between its window and the untraced runs.
        lines.append(f"Replays against the untraced steps the tracer timed in the traced process itself (run.json, "
                     f"before and after the window): {bands_count(own, [])} within {REPLAY_BAND:.0%}; {spread(own)}.")
    bounded = bound_verdict([(p.without_communication_cpu_ms, p.predicted_ms, p.real_ms) for p in points
                             if p.faster and p.without_communication_cpu_ms])
    if bounded:
        lines.append(bounded)
    replays = [p.predicted_ms / p.real_ms for p in points if p.replay]
    others = [p.predicted_ms / p.real_ms for p in points if not p.replay]
    lines += ["", f"Spread of predicted / real: replays {spread(replays)}; other rates {spread(others)}."]
    paired = [p for p in points if p.same_run_ms]
    if paired:
        # A trace's .et carries its own process's pace, so how far the real processes differ from one another is a
        # floor under the predictions' error that no conversion can go below.
        own = [p.same_run_ms / p.real_ms for p in paired if p.replay]
        other = [p.same_run_ms / p.real_ms for p in paired if not p.replay]
        lines.append("The real runs against one another (each traced process's own untraced steps after its window "
                     "over the untraced runs' step at the same rate): at the traces' own rates " + spread(own)
                     + f", {beyond(own, replay=True)} beyond {REPLAY_BAND:.0%}; at the other rates " + spread(other)
                     + f", {beyond(other, replay=False)} beyond {WHATIF_BAND:.0%}.")
    return "\n".join(lines)


def pooled_reference_ms(point: Point, points: list) -> float | None:
    """The real step at the point's rate over more processes than the untraced runs': their step and each other
    trace's process after its window (None when no other trace has one). It tells a miss that comes from the
    reference's process pace (which pooling would move) from one the trace carries (which it would not)."""
    others = [q.same_run_ms for q in points if q.run == point.run and q.rate == point.rate
              and q.trace != point.trace and q.same_run_ms]
    return statistics.fmean([point.real_ms] + others) if others else None


def spread(ratios: list) -> str:
    """Mean, standard deviation, mean absolute error and range of ratios whose ideal is 1."""
    if not ratios:
        return "none"
    deviation = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    return (f"mean {statistics.fmean(ratios):.3f}, sd {deviation:.1%}, mean abs. error "
            f"{statistics.fmean(abs(r - 1) for r in ratios):.1%}, {min(ratios):.2f}x-{max(ratios):.2f}x "
            f"({len(ratios)})")


def beyond(ratios: list, replay: bool) -> str:
    """'N of M': how many ratios are outside the replay's band or the other rates'."""
    return f"{sum(not within_band(r, replay) for r in ratios)} of {len(ratios)}"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kept", nargs="+", type=Path, help="folders kept by bench/whatif_bench.py --keep")
    parser.add_argument("--astra-sim", default=None, metavar="PATH",
                        help="the ASTRA-sim analytical binary (default: $ASTRA_SIM)")
    parser.add_argument("--work", type=Path, default=None,
                        help="where the traces are converted again (default: a temporary folder, removed after)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    foreign = foreign_checkout(__file__)
    if foreign:
        return fail(foreign)
    try:
        kept = {folder: read_results(folder) for folder in args.kept}
    except BenchError as exc:
        return fail(str(exc))
    sim = find_simulator(args.astra_sim)
    if not sim.ok:
        return fail(f"bench/whatif_repredict.py: {sim.missing}")
    scratch = WorkFolder(args.work, "whatif_repredict-")
    work = scratch.path
    with scratch:
        try:
            points = []
            for number, (folder, results) in enumerate(kept.items(), 1):
                points += repredict(folder, results, work / f"{number}-{folder.name}", sim, child_env(threads=1))
        except BenchError as exc:
            return scratch.fail(str(exc))
        except Exception as exc:  # the simulator's errors (SimulationError): one line, exit 1
            if type(exc).__name__ != "SimulationError":
                raise
            return scratch.fail(str(exc))
    print()
    print(report(points))
    return 0


if __name__ == "__main__":
    sys.exit(main())
