"""Command lines convert_to_et.py and convert_remaining.py (argument parsing and exit codes only)."""
from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from pathlib import Path

from .command_line import ArgumentParser, StopSignal, output_closed, path_argument
from .discover import find_runs
from .layout import CONVERSION_SUMMARY, et_name
from .load import TraceError
from .pipeline import (MERGED_NAME, convert_runs, et_fingerprint, input_fingerprints, output_dir_clash,
                       output_dir_for, output_dir_problem)
from .summary import RunResult, read_previous_results, render_table

DEFAULT_PATH = "outputs"


def build_parser(remaining: bool) -> argparse.ArgumentParser:
    what = ("Convert only the ranks that have no good .et: missing, failed or interrupted in the last "
            "CONVERSION_SUMMARY.md, an .et that no longer validates, or traces changed since it was made."
            if remaining else "Link and convert PyTorch host + device traces into Chakra .et files, one per rank.")
    parser = ArgumentParser(
        prog="convert_remaining.py" if remaining else "convert_to_et.py",
        description=what + " Each run (a folder with host.<rank>.json[.gz] + device.<rank>.json[.gz], or the flat "
        "<name>_host.json + <name>_device.json) gets <name>.<rank>.et for every rank, validated after writing, and "
        "a CONVERSION_SUMMARY.md. Exits 1 when a rank failed (the other ranks are still converted).")
    parser.add_argument("paths", nargs="*", default=[DEFAULT_PATH], metavar="PATH", type=path_argument,
                        help=f"run folders, folders of runs, or trace files (default: ./{DEFAULT_PATH})")
    parser.add_argument("--output-dir", default=None, metavar="DIR", type=path_argument,
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
    with StopSignal() as stop:
        try:
            return _main(args, remaining)
        except KeyboardInterrupt:
            what = "convert_remaining.py" if remaining else "convert_to_et.py"
            print(f"interrupted: {what} stopped by {stop.name}; ranks already converted are kept (see "
                  "CONVERSION_SUMMARY.md), convert_remaining.py converts the rest", file=sys.stderr)
            return stop.exit_code
        except TraceError as e:  # an output that cannot be written (the summary)
            print(f"error: {e}", file=sys.stderr)
            return 1
        except BrokenPipeError:  # whoever read the output stopped reading (`| head`): nothing more to say
            output_closed()
            return 1


def _main(args: argparse.Namespace, remaining: bool) -> int:
    if args.jobs is not None and args.jobs < 1:
        print("error: --jobs must be at least 1", file=sys.stderr)
        return 2
    missing = [p for p in args.paths if not Path(p).exists()]
    for path in missing:
        print(f"error: {path}: no such file or folder", file=sys.stderr)
    if args.report and importlib.util.find_spec("matplotlib") is None:
        # before any rank is converted (the report's figures need it; it had been a traceback after converting)
        print(f"error: --report: {sys.executable} has no matplotlib, which the report's figures need: convert with "
              "./setup_and_convert.sh DIR -- --report (it adds it to chakra-venv/), or install the [report] extra "
              "(pip install '.[report]'), or leave out --report", file=sys.stderr)
        return 2
    runs = find_runs([p for p in args.paths if Path(p).exists()])
    if not runs:
        if not missing:
            print(f"error: {', '.join(args.paths)}: no traces found (expected host.<rank>.json[.gz] + "
                  "device.<rank>.json[.gz], or <name>_host.json + <name>_device.json)", file=sys.stderr)
        return 2
    several = len(runs) > 1
    clash = output_dir_clash(runs, args.output_dir)  # before output_dir_problem makes the folder: none is left
    if clash:
        print(f"error: {clash}", file=sys.stderr)
        return 2
    if args.output_dir is not None:
        problem = output_dir_problem(args.output_dir)
        if problem:
            print(f"error: --output-dir {args.output_dir}: {problem}", file=sys.stderr)
            return 2
    for run in runs:
        out_dir, _ = output_dir_for(run, args.output_dir, several)
        problem = output_dir_problem(out_dir)
        if problem:
            print(f"error: {out_dir}: {problem} (choose another --output-dir)", file=sys.stderr)
            return 2
        if (out_dir / CONVERSION_SUMMARY).is_dir():  # before any earlier .et is removed, not after
            print(f"error: {out_dir / CONVERSION_SUMMARY}: a folder, where the conversion writes its summary; move it "
                  "away and convert again", file=sys.stderr)
            return 2
    only = previous = None
    if remaining:
        previous = {}
        for run in runs:
            out_dir, _ = output_dir_for(run, args.output_dir, several)
            previous[str(out_dir)] = read_previous_results(out_dir) or {}
        only, kept = _still_to_convert(runs, previous, args.output_dir, several, args.emit_merged)
        todo = sum(1 for run in runs for rank in run.ranks if only(run, rank))
        if todo == 0:
            print(f"nothing to do: every rank of {len(runs)} run(s) has a valid .et made from the traces there now")
            if not args.report:
                return 0
            converted = []  # --report: the report of the .et files there, whether or not it was written before
            for run in runs:
                out_dir, _ = output_dir_for(run, args.output_dir, several)
                converted.append(RunResult(run=run, output_dir=out_dir,
                                           ranks=[previous[str(out_dir)][rank] for rank in run.ranks]))
            return 0 if write_reports(converted) else 1
        print(f"converting {todo} remaining rank(s)" + (f" ({kept})" if kept else ""))
    results = convert_runs(runs, output_dir=args.output_dir, jobs=args.jobs, emit_merged=args.emit_merged,
                           progress=not args.no_progress and sys.stderr.isatty(), only=only, previous=previous)
    print(render_table(results))
    for result in results:
        if result.note:
            print(f"note: {result.note}")
        print(f"summary: {result.output_dir / CONVERSION_SUMMARY}")
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


def _still_to_convert(runs, previous: dict, output_dir: str | None, several: bool, emit_merged: bool = False):
    """(predicate (run, rank) -> True when the rank must be converted again, words on why some are redone).

    A rank is kept only when the last summary says ok, its .et is the file that summary recorded and still
    validates as that rank, and its host and device traces are the files it was made from. Kept ranks get their
    collectives back from their .et, for the cross-rank check."""
    from .validate import validate_et

    redo: set[tuple[str, int]] = set()
    reasons: dict[str, int] = {}
    for run in runs:
        out_dir, _ = output_dir_for(run, output_dir, several)
        for rank in run.ranks:
            old = previous[str(out_dir)].get(rank)
            reason = _why_redo(run, rank, old, out_dir / et_name(run.name, rank), validate_et)
            if not reason and emit_merged and not (out_dir / MERGED_NAME.format(name=run.name, rank=rank)).is_file():
                reason = "merged JSON asked for"
            if reason:
                redo.add((str(out_dir), rank))
                reasons[reason] = reasons.get(reason, 0) + 1
                previous[str(out_dir)].pop(rank, None)

    def needed(run, rank) -> bool:
        return (str(output_dir_for(run, output_dir, several)[0]), rank) in redo

    changed = {k: v for k, v in reasons.items() if k not in ("new", "not ok")}
    return needed, ", ".join(f"{count} {reason}" for reason, count in sorted(changed.items()))


def _why_redo(run, rank: int, old, et: Path, validate_et) -> str | None:
    """Why a rank's earlier result cannot be kept (None: keep it)."""
    if old is None:
        return "new"
    if not old.ok:
        return "not ok"
    if not et.is_file():
        return ".et gone"
    inputs = old.inputs or {}
    if not inputs:
        return "converted before summaries recorded their traces"
    try:
        now = {**input_fingerprints(run.hosts[rank], run.devices[rank]), "et": et_fingerprint(et)}
    except (KeyError, OSError):
        return "traces gone"
    if any(inputs.get(kind) != now[kind] for kind in ("host", "device")):
        return "traces changed"
    if inputs.get("run_info") != now.get("run_info"):
        return "run.json changed"
    if inputs.get("et") != now["et"]:
        return ".et changed"
    report = validate_et(et)
    if not report.ok or (report.rank is not None and report.rank != rank):
        return ".et invalid"
    old.collectives = [list(c) for c in report.collectives]
    return None
