"""Scale-out: time and new disk of scale_et.py at N ranks; with ASTRA-sim, the scaled sets simulated at each N, the
ring all-reduce's 2(N-1)/N growth, and a 4-rank self-consistency check (ranks {0,1} scaled to 4 against all 4)."""
import argparse
import os
import re
import shutil
import sys
from pathlib import Path

from bench.common import (REPO_ROOT, BenchError, WorkFolder, child_env, exit_on_sigterm, fail, format_table,
                          machine_description, median, quick_settings, run_child)
from trace_tools.command_line import ArgumentParser
from trace_tools.layout import CONVERSION_SUMMARY, RUN_INFO, et_name

BUNDLED_RUN = REPO_ROOT / "tests" / "data" / "cpu" / "gpt2_tiny_2r"
RANKS = (8, 64, 512, 1024)
# Issue 12's targets for the tiny GPT-2 at 1024 ranks.
TARGET_RANKS, TARGET_SECONDS, TARGET_NEW_MB = 1024, 10.0, 50.0
SCALE_TIMEOUT_S = 600
SIMULATE_TIMEOUT_S = 1800
# A minimal ASTRA-sim setup (analytical backend, congestion unaware): the system and memory files of
# docs/CHAKRA_SETUP.md, and a one-dimensional ring of N NPUs.
SYSTEM_JSON = """{
    "scheduling-policy": "LIFO", "endpoint-delay": 10, "active-chunks-per-dimension": 1,
    "preferred-dataset-splits": 4, "all-reduce-implementation": ["ring"], "all-gather-implementation": ["ring"],
    "reduce-scatter-implementation": ["ring"], "all-to-all-implementation": ["ring"],
    "collective-optimization": "localBWAware", "local-mem-bw": 1600, "boost-mode": 0, "roofline-enabled": 0
}
"""
MEMORY_JSON = '{ "memory-type": "NO_MEMORY_EXPANSION" }\n'
NETWORK_YML = "topology: [ Ring ]\nnpus_count: [ {npus} ]\nbandwidth: [ {bandwidth} ]  # GB/s\nlatency: [ {latency} ]  # ns\n"
FINISHED = re.compile(r"sys\[(\d+)\] finished, (\d+) cycles")
SCALED_LINE = re.compile(r"wrote (\d+) ranks from (\d+) traced: (\d+) files, (\d+) hard links.*?, ([0-9.]+) s$", re.M)
# Communication-dominated growth check: the gradient all-reduce (0.86 MiB) at 1 MB/s takes seconds, the traced
# compute a quarter of a second; the same sets at 1000 GB/s give the compute-only step to subtract. Up to 64 NPUs:
# ASTRA-sim's time grows faster than N (2 s at 8 NPUs, 25 s at 64, 9 min at 512, 26 min and 4.5 GB at 1024 on a
# busy 2-core machine).
GROWTH_RANKS = (2, 4, 8, 16, 32, 64)
GROWTH_SLOW_GBS, GROWTH_FAST_GBS = 0.001, 1000.0
CONSISTENCY_GBS = (0.01, 0.1, 1.0)
CONSISTENCY_TOLERANCE = 0.05


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--run", type=Path, default=None,
                        help="a converted run folder (default: tests/data/cpu/gpt2_tiny_2r, converted here)")
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS), metavar="N")
    parser.add_argument("--repeats", type=int, default=3, help="timings of scale_et.py per N (median shown)")
    parser.add_argument("--astra-sim", default=os.environ.get("ASTRA_SIM"), metavar="PATH",
                        help="ASTRA-sim's analytical binary (default: $ASTRA_SIM); without it nothing is simulated")
    parser.add_argument("--simulate-ranks", type=int, nargs="+", default=None, metavar="N",
                        help="the N to simulate (default: every --ranks)")
    parser.add_argument("--simulate-timeout", type=float, default=SIMULATE_TIMEOUT_S, metavar="S",
                        help=f"seconds per ASTRA-sim run (default: {SIMULATE_TIMEOUT_S})")
    parser.add_argument("--bandwidth", type=float, default=50.0, help="GB/s per ring link for the simulated sets")
    parser.add_argument("--latency", type=float, default=500.0, help="ns per ring link")
    parser.add_argument("--growth", action="store_true",
                        help=f"also simulate N = {', '.join(map(str, GROWTH_RANKS))} at {GROWTH_SLOW_GBS} and "
                        f"{GROWTH_FAST_GBS} GB/s and compare the communication time with 2(N-1)/N")
    parser.add_argument("--growth-ranks", type=int, nargs="+", default=list(GROWTH_RANKS), metavar="N")
    parser.add_argument("--consistency", type=Path, default=None, metavar="RUN4",
                        help="a converted 4-rank run: simulate it, and its ranks {0,1} scaled to 4, at "
                        f"{', '.join(map(str, CONSISTENCY_GBS))} GB/s")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR", help="keep the scaled sets and logs in DIR")
    parser.add_argument("--quick", action="store_true", help="N = 8 and 64, one timing, no simulation (a smoke test)")
    return parser


def converted_bundled_run(work: Path) -> Path:
    folder = work / BUNDLED_RUN.name
    shutil.rmtree(folder, ignore_errors=True)  # an earlier run's, under the same --keep folder
    shutil.copytree(BUNDLED_RUN, folder)
    run = run_child([sys.executable, REPO_ROOT / "convert_to_et.py", folder, "--no-progress", "--jobs", "1"],
                    env=child_env(), timeout_s=SCALE_TIMEOUT_S)
    if not run.ok:
        raise BenchError(f"could not convert {BUNDLED_RUN}: {run.reason()}")
    return folder


def new_disk_bytes(folder: Path) -> int:
    """Bytes the folder takes: every distinct inode once (hard links share one), plus the folder itself."""
    seen, total = set(), folder.stat().st_blocks * 512
    for entry in os.scandir(folder):
        stat = entry.stat(follow_symlinks=False)
        if stat.st_ino not in seen:
            seen.add(stat.st_ino)
            total += stat.st_blocks * 512
    return total


def scale(run: Path, ranks: int, out: Path) -> dict:
    """scale_et.py in a child: wall time, peak memory, the time it reports for scaling itself, and new disk."""
    shutil.rmtree(out, ignore_errors=True)
    child = run_child([sys.executable, REPO_ROOT / "scale_et.py", run, "--ranks", ranks, "--output-dir", out],
                      env=child_env(), timeout_s=SCALE_TIMEOUT_S)
    if not child.ok:
        raise BenchError(f"scale_et.py {run} --ranks {ranks}: {child.reason()}")
    match = SCALED_LINE.search(child.stdout)
    if not match:
        raise BenchError(f"scale_et.py printed no 'wrote N ranks ...' line: {child.stdout[-300:]}")
    return {"wall_s": child.wall_s, "peak_mb": child.peak_rss_mb, "files": int(match[3]), "links": int(match[4]),
            "scaling_s": float(match[5]), "new_bytes": new_disk_bytes(out),
            "prefix": out / f"{run.name}_{ranks}npus"}


def simulate(binary: str, prefix: Path, npus: int, bandwidth: float, latency: float, work: Path,
             timeout_s: float = SIMULATE_TIMEOUT_S) -> dict:
    """ASTRA-sim (analytical) on one set: which ranks finished, the slowest rank's simulated time, wall time."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "system.json").write_text(SYSTEM_JSON)
    (work / "memory.json").write_text(MEMORY_JSON)
    (work / "network.yml").write_text(NETWORK_YML.format(npus=npus, bandwidth=bandwidth, latency=latency))
    child = run_child([binary, f"--workload-configuration={prefix}", f"--system-configuration={work / 'system.json'}",
                       f"--network-configuration={work / 'network.yml'}",
                       f"--remote-memory-configuration={work / 'memory.json'}"],
                      cwd=work, env=child_env(), timeout_s=timeout_s)
    (work / "astra-sim.log").write_text(child.stdout + child.stderr)
    cycles = {int(r): int(c) for r, c in FINISHED.findall(child.stdout + child.stderr)}
    if not child.ok or len(cycles) != npus:
        raise BenchError(f"ASTRA-sim on {prefix} ({npus} NPUs): {len(cycles)} of {npus} ranks finished; "
                         f"{child.reason()} (log: {work / 'astra-sim.log'})")
    return {"finished": len(cycles), "step_ms": max(cycles.values()) / 1e6, "wall_s": child.wall_s,
            "peak_mb": child.peak_rss_mb}


def _mb(value: float) -> str:
    return f"{value / 1e6:.1f}"


def scale_table(runs: dict[int, list[dict]]) -> str:
    rows = []
    for ranks, timings in runs.items():
        last = timings[-1]
        wall = median(t["wall_s"] for t in timings)
        mark = ""
        if ranks == TARGET_RANKS:
            ok = wall < TARGET_SECONDS and last["new_bytes"] / 1e6 < TARGET_NEW_MB
            mark = f"{'met' if ok else 'MISSED'} (< {TARGET_SECONDS:g} s, < {TARGET_NEW_MB:g} MB)"
        rows.append((ranks, last["files"], last["links"], _mb(last["new_bytes"]), f"{wall:.2f}",
                     f"{median(t['scaling_s'] for t in timings):.2f}", f"{max(t['peak_mb'] for t in timings):.0f}",
                     mark))
    return format_table(("N", "files written", "hard links", "new disk (MB)", "scale_et.py wall (s)",
                         "of which scaling (s)", "peak RSS (MB)", "target"), rows)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    exit_on_sigterm()
    if args.quick:
        quick_settings(parser, argv, args, dict(ranks=[8, 64], repeats=1, astra_sim=None, growth=False,
                                                consistency=None))
    if min(args.ranks) < 1 or args.repeats < 1:
        return fail("--ranks and --repeats must be at least 1")
    if args.astra_sim and not os.access(args.astra_sim, os.X_OK):
        return fail(f"--astra-sim {args.astra_sim}: not an executable file")
    if (args.growth or args.consistency) and not args.astra_sim:
        return fail("--growth and --consistency simulate: give --astra-sim PATH (or set $ASTRA_SIM)")
    print(machine_description(("orjson", "protobuf", "mlc-chakra")))
    with WorkFolder(args.keep, "scale_bench-") as folder:
        try:
            work = folder.path
            run = args.run or converted_bundled_run(work)
            print(f"source: {run} ({len(list(run.glob('*.et')))} .et files, "
                  f"{_mb(sum(p.stat().st_size for p in run.glob('*.et')))} MB)")
            runs: dict[int, list[dict]] = {}
            for ranks in args.ranks:
                runs[ranks] = [scale(run, ranks, work / f"scaled_{ranks}") for _ in range(args.repeats)]
                print(f"... N = {ranks}: {runs[ranks][-1]['wall_s']:.2f} s", flush=True)
            print()
            print(scale_table(runs))
            if args.astra_sim:
                print()
                print(simulate_table(args, runs, work))
            if args.growth:
                print()
                print(growth_table(args, run, work))
            if args.consistency:
                print()
                print(consistency_table(args, args.consistency, work))
        except BenchError as exc:
            return folder.fail(str(exc))
    return 0


def simulate_table(args, runs: dict[int, list[dict]], work: Path) -> str:
    rows = []
    for ranks, timings in runs.items():
        if args.simulate_ranks is not None and ranks not in args.simulate_ranks:
            continue
        sim = simulate(args.astra_sim, timings[-1]["prefix"], ranks, args.bandwidth, args.latency,
                       work / f"sim_{ranks}", args.simulate_timeout)
        print(f"... simulated N = {ranks}: {sim['wall_s']:.1f} s", flush=True)
        rows.append((ranks, f"{sim['finished']}/{ranks}", f"{sim['step_ms']:.3f}", f"{sim['wall_s']:.2f}",
                     f"{sim['peak_mb']:.0f}"))
    header = (f"ASTRA-sim analytical (congestion unaware), Ring of N NPUs, {args.bandwidth:g} GB/s, "
              f"{args.latency:g} ns per link, ring collectives, roofline off:\n\n")
    return header + format_table(("N", "ranks finished", "simulated step (ms)", "ASTRA-sim wall (s)",
                                  "peak RSS (MB)"), rows)


def growth_table(args, run: Path, work: Path) -> str:
    """Communication time (step at low bandwidth minus step at high bandwidth) against 2(N-1)/N, relative to N=2."""
    rows, base = [], None
    for ranks in args.growth_ranks:
        prefix = scale(run, ranks, work / f"growth_{ranks}")["prefix"]
        slow = simulate(args.astra_sim, prefix, ranks, GROWTH_SLOW_GBS, args.latency, work / f"growth_{ranks}_slow")
        fast = simulate(args.astra_sim, prefix, ranks, GROWTH_FAST_GBS, args.latency, work / f"growth_{ranks}_fast")
        comm = slow["step_ms"] - fast["step_ms"]
        factor = 2 * (ranks - 1) / ranks
        base = base or (comm, factor)
        measured, predicted = comm / base[0], factor / base[1]
        rows.append((ranks, f"{slow['step_ms']:.1f}", f"{fast['step_ms']:.1f}", f"{comm:.1f}", f"{measured:.3f}",
                     f"{predicted:.3f}", f"{(measured / predicted - 1) * 100:+.1f}%"))
        print(f"... growth N = {ranks}: {comm:.1f} ms of communication", flush=True)
    header = (f"Growth with N (communication dominates): Ring, {GROWTH_SLOW_GBS:g} GB/s per link (and "
              f"{GROWTH_FAST_GBS:g} GB/s for the compute-only step), {args.latency:g} ns, ring all-reduce:\n\n")
    return header + format_table(("N", f"step at {GROWTH_SLOW_GBS:g} GB/s (ms)", f"step at {GROWTH_FAST_GBS:g} GB/s (ms)",
                                  "communication (ms)", "comm / comm(N=2)", "2(N-1)/N / 1", "deviation"), rows)


def consistency_table(args, run4: Path, work: Path) -> str:
    """The real 4-rank set against ranks {0,1} of it scaled to 4, simulated at each bandwidth."""
    sets = sorted(run4.glob("*.et"))
    if len(sets) != 4:
        raise BenchError(f"--consistency {run4}: expected 4 .et files, found {len(sets)}")
    name = sets[0].name.rsplit(".", 2)[0]
    pair = work / "consistency_pair" / name
    shutil.rmtree(pair, ignore_errors=True)
    pair.mkdir(parents=True)
    for r in (0, 1):
        os.link(run4 / et_name(name, r), pair / et_name(name, r))
    for info in (run4 / RUN_INFO, run4 / CONVERSION_SUMMARY):
        if info.is_file():
            shutil.copy(info, pair)
    scaled = scale(pair, 4, work / "consistency_scaled")["prefix"]
    rows, worst = [], 0.0
    for gbs in CONSISTENCY_GBS:
        real = simulate(args.astra_sim, run4 / name, 4, gbs, args.latency, work / f"consistency_real_{gbs:g}")
        fake = simulate(args.astra_sim, scaled, 4, gbs, args.latency, work / f"consistency_scaled_{gbs:g}")
        diff = fake["step_ms"] / real["step_ms"] - 1
        worst = max(worst, abs(diff))
        rows.append((f"{gbs:g}", f"{real['step_ms']:.2f}", f"{fake['step_ms']:.2f}", f"{diff * 100:+.1f}%"))
    verdict = "within" if worst <= CONSISTENCY_TOLERANCE else "NOT within"
    header = (f"Self-consistency: {run4} (4 traced ranks) against its ranks {{0,1}} scaled to 4; Ring of 4, "
              f"{args.latency:g} ns:\n\n")
    return header + format_table(("GB/s", "real 4 ranks: step (ms)", "{0,1} scaled to 4: step (ms)", "difference"),
                                 rows) + f"\n\n{verdict} {CONSISTENCY_TOLERANCE:.0%} at every bandwidth (worst {worst:.1%})"


if __name__ == "__main__":
    sys.exit(main())
