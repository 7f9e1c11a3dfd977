#!/usr/bin/env python3
"""Check and repair PyTorch host traces (ExecutionTraceObserver JSON) in place, keeping <file>.orig."""
import argparse
import sys
import time

from trace_tools.command_line import ArgumentParser, StopSignal, path_argument
from utils.environment import require

require("conversion")  # one line naming the environment to use, not a ModuleNotFoundError

from trace_tools.repair import DEFAULT_MIN_NODES, find_host_traces, repair_host_trace  # noqa: E402


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(
        description="Repair host traces where it is safe: several JSON documents concatenated (keeps the last "
                    "complete one), a truncated tail (closes the node list after the last complete node), duplicate "
                    "node ids (keeps the first), one complete document amid another writer's text. Refuses, with a "
                    "one-line reason, what cannot be repaired safely. The original is kept as <file>.orig; running "
                    "it again changes nothing.",
        epilog="Exit status: 0 when every file is valid or was repaired, 1 when a file could not be repaired "
               "(or, with --check, needs a repair), or a path holds no host trace or a folder where one belongs.")
    parser.add_argument("paths", nargs="*", default=["outputs"], metavar="PATH", type=path_argument,
                        help="host trace files, or folders searched for host.<rank>.json[.gz] and "
                             "<name>_host.json[.gz] (default: ./outputs)")
    parser.add_argument("--check", action="store_true", help="only report what is wrong; change nothing")
    parser.add_argument("--min-nodes", type=positive_int, default=DEFAULT_MIN_NODES, metavar="N",
                        help="refuse a truncated trace with fewer complete nodes than this (default: %(default)s)")
    parser.add_argument("--no-backup", action="store_true", help="do not keep the original as <file>.orig")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    with StopSignal() as stop:
        return _repair_all(args, stop)


def _repair_all(args: argparse.Namespace, stop: StopSignal) -> int:
    files, problems = find_host_traces(args.paths)
    for problem in problems:
        print(problem, file=sys.stderr)
    counts = {"unchanged": 0, "repaired": 0, "needs_repair": 0, "failed": 0}
    started = time.perf_counter()
    for done, path in enumerate(files):
        try:
            result = repair_host_trace(path, keep_original=not args.no_backup, check_only=args.check,
                                       min_nodes=args.min_nodes)
        except KeyboardInterrupt:
            print(f"interrupted: stopped by {stop.name} at {path}, which is left as it was (a repair is written to a "
                  f"temporary file first); {done} of {len(files)} host traces done", file=sys.stderr)
            return stop.exit_code
        counts[result.status] += 1
        print(result.line(), file=sys.stdout if result.ok else sys.stderr, flush=True)
    if len(files) > 1:
        needs = f"{counts['needs_repair']} need repair, " if args.check else ""
        print(f"{len(files)} host traces: {counts['unchanged']} valid, {counts['repaired']} repaired, {needs}"
              f"{counts['failed']} not repairable ({time.perf_counter() - started:.1f} s)")
    return 1 if counts["failed"] or counts["needs_repair"] or problems else 0


if __name__ == "__main__":
    sys.exit(main())
