"""Command lines convert_to_et.py and convert_remaining.py (argument parsing and exit codes only)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .discover import find_runs
from .pipeline import ET_NAME, convert_runs, output_dir_for
from .summary import read_previous_results, render_table

DEFAULT_PATH = "outputs"


def build_parser(remaining: bool) -> argparse.ArgumentParser:
    what = ("Convert only the ranks whose .et is missing or failed in the last CONVERSION_SUMMARY.md."
            if remaining else "Link and convert PyTorch host + device traces into Chakra .et files, one per rank.")
    parser = argparse.ArgumentParser(
        prog="convert_remaining.py" if remaining else "convert_to_et.py",
        description=what + " Each run (a folder with host.<rank>.json[.gz] + device.<rank>.json[.gz], or the flat "
        "<name>_host.json + <name>_device.json) gets <name>.<rank>.et for every rank, validated after writing, and "
        "a CONVERSION_SUMMARY.md. Exits 1 when a rank failed (the other ranks are still converted).")
    parser.add_argument("paths", nargs="*", default=[DEFAULT_PATH], metavar="PATH",
                        help=f"run folders, folders of runs, or trace files (default: ./{DEFAULT_PATH})")
    parser.add_argument("--output-dir", default=None, metavar="DIR",
                        help="where the .et files go (default: the run's own folder when writable, else "
                        "./converted/<name>/; with several runs, DIR/<name>/)")
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="ranks converted in parallel processes (default: min(ranks, CPU count))")
    parser.add_argument("--emit-merged", action="store_true",
                        help="also write <name>.<rank>.merged.json, the host+device JSON of chakra_trace_link "
                        "that `chakra_converter PyTorch` reads")
    parser.add_argument("--report", action="store_true",
                        help="then write report.md, report.json and figures (step breakdown, timelines, top "
                        "operators, communication, critical path) beside each run's .et files, as trace_report.py "
                        "does")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def main(argv: list[str] | None = None, remaining: bool = False) -> int:
    args = build_parser(remaining).parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    if args.jobs is not None and args.jobs < 1:
        print("error: --jobs must be at least 1", file=sys.stderr)
        return 2
    missing = [p for p in args.paths if not Path(p).exists()]
    for path in missing:
        print(f"error: {path}: no such file or folder", file=sys.stderr)
    runs = find_runs([p for p in args.paths if Path(p).exists()])
    if not runs:
        if not missing:
            print(f"error: no traces found in {', '.join(args.paths)} (expected host.<rank>.json + "
                  "device.<rank>.json, or <name>_host.json + <name>_device.json, gzipped or not)", file=sys.stderr)
        return 2
    only = previous = None
    if remaining:
        several = len(runs) > 1
        previous = {}
        for run in runs:
            out_dir, _ = output_dir_for(run, args.output_dir, several)
            previous[str(out_dir)] = read_previous_results(out_dir) or {}
        only = _still_to_convert(previous, args.output_dir, several)
        todo = sum(1 for run in runs for rank in run.ranks if only(run, rank))
        if todo == 0:
            print(f"nothing to do: every rank of {len(runs)} run(s) already has a converted .et")
            return 0
        print(f"converting {todo} remaining rank(s)")
        # Kept ranks still take part in the cross-rank check: re-read their collectives from their .et files.
        _reload_collectives(previous)
    results = convert_runs(runs, output_dir=args.output_dir, jobs=args.jobs, emit_merged=args.emit_merged,
                           progress=not args.no_progress and sys.stderr.isatty(), only=only, previous=previous)
    print(render_table(results))
    for result in results:
        if result.note:
            print(f"note: {result.note}")
        print(f"summary: {result.output_dir / 'CONVERSION_SUMMARY.md'}")
    failed = missing or any(not result.ok for result in results)
    if args.report and not write_reports(results):
        failed = True
    return 1 if failed else 0


def write_reports(results) -> bool:
    """The trace report of every run with at least one converted rank; False when one could not be written."""
    from .report import ReportError, write_report  # matplotlib: imported only when a report is asked for

    written_all = True
    for result in results:
        if not any(rank.ok for rank in result.ranks):
            continue
        try:
            path = write_report(result.output_dir, trace_dirs=[result.run.folder])
        except ReportError as e:
            print(f"error: {e}", file=sys.stderr)
            written_all = False
            continue
        print(f"report: {path}")
    return written_all


def _still_to_convert(previous: dict, output_dir: str | None, several: bool):
    """Predicate (run, rank) -> True when the rank has no .et or failed in the last summary."""
    def needed(run, rank) -> bool:
        out_dir, _ = output_dir_for(run, output_dir, several)
        old = previous[str(out_dir)].get(rank)
        et = out_dir / ET_NAME.format(name=run.name, rank=rank)
        return not (old is not None and old.ok and et.is_file())
    return needed


def _reload_collectives(previous: dict) -> None:
    from .validate import validate_et
    for results in previous.values():
        for result in results.values():
            if result.ok and result.et_path and os.path.isfile(result.et_path):
                result.collectives = [list(c) for c in validate_et(result.et_path).collectives]
