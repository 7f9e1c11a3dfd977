#!/usr/bin/env python3
"""Simulate N ranks from a data-parallel run traced on k: write <name>.<r>.et for r = 0..N-1 for ASTRA-sim."""
import argparse
import logging
import sys

from utils.environment import require

require("conversion")  # one line naming the environment to use, not a ModuleNotFoundError

from trace_tools.atomic import InterruptedAfterWriting  # noqa: E402
from trace_tools.command_line import ArgumentParser, StopSignal, output_closed, path_argument  # noqa: E402
from trace_tools.scale import DEFAULT_NAME, SUMMARY_NAME, ScaleError, parse_slow, scale_set  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="scale_et.py",
        description="Scale a converted data-parallel run (the <name>.<rank>.et files convert_to_et.py wrote for k "
        "traced ranks) to N ranks: rank r replays traced rank r mod k, collectives keep their sizes and run over all "
        "N ranks. Ranks that replay the same traced rank share one file (hard links). Runs that are not "
        "data-parallel (tensor-parallel all-reduces in the forward, all-to-all, send/recv, several process groups) "
        "are refused.")
    parser.add_argument("run_dir", metavar="RUN_DIR", type=path_argument,
                        help="a converted run folder (or a workload prefix <dir>/<name>)")
    parser.add_argument("--ranks", type=int, required=True, metavar="N",
                        help="ranks (ASTRA-sim NPUs) to write: at least the traced ranks")
    parser.add_argument("--output-dir", default=None, metavar="DIR",
                        help="where the set goes (default: a folder named after the set beside RUN_DIR)")
    parser.add_argument("--name", default=None,
                        help=f"the set's name, <name>.<rank>.et (default: {DEFAULT_NAME.format(name='<run>', ranks='<N>')})")
    parser.add_argument("--slow", action="append", default=[], metavar="RANK:FACTOR",
                        help="multiply the compute durations of output rank RANK by FACTOR (a straggler); repeatable")
    parser.add_argument("--assume-data-parallel", action="store_true",
                        help="scale a run that has no run.json, or whose collectives do not look data-parallel, "
                        "anyway (with a warning)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("warning: %(message)s"))
    logging.getLogger("trace_tools").addHandler(handler)
    with StopSignal() as stop:
        try:
            result = scale_set(args.run_dir, args.ranks, output_dir=args.output_dir, name=args.name,
                               slow=parse_slow(args.slow), assume_data_parallel=args.assume_data_parallel)
        except ScaleError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2 if e.where.startswith("--") else 1
        except InterruptedAfterWriting as e:  # it had said "no partial set is left" of the whole new set
            print(f"interrupted: scale_et.py stopped by {stop.name} once the set was written: {e.written}",
                  file=sys.stderr)
            return stop.exit_code
        except KeyboardInterrupt:
            print(f"interrupted: scale_et.py stopped by {stop.name}; no partial set is left (the set in place is the "
                  f"one its {SUMMARY_NAME} describes)", file=sys.stderr)
            return stop.exit_code
    try:
        print_result(result)
    except BrokenPipeError:  # `| head`: the set is written whole all the same
        output_closed()
    return 0


def print_result(result) -> None:
    extra = f", {result.copies} copies" if result.copies else ""
    through = f" (through the {result.source.ranks}-rank scaled set)" if result.source_scaled else ""
    print(f"wrote {result.ranks} ranks from {result.traced_ranks} traced{through}: {len(result.written)} files, "
          f"{result.links} hard links{extra}, {result.new_bytes / 1e6:.1f} MB, {result.seconds:.2f} s")
    for note in result.slow_notes:
        print(f"note: {note}")
    if result.note:
        print(f"note: {result.note}")
    print(f"summary: {result.output_dir / SUMMARY_NAME}")
    print(f"ASTRA-sim: --workload-configuration={result.prefix}")


if __name__ == "__main__":
    sys.exit(main())
