#!/usr/bin/env python3
"""Write report.md, report.json and PNG figures beside the .et files of converted runs."""
import argparse
import logging
import sys
import time
from pathlib import Path

from trace_tools.atomic import InterruptedAfterWriting
from trace_tools.command_line import ArgumentParser, StopSignal, path_argument
from utils.environment import require

require("report")  # one line naming the environment to use, not a ModuleNotFoundError

from trace_tools.report import ReportError, find_report_folders, write_report  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(
        description="For each run folder (the <name>.<rank>.et files of one run), write report.md with the step "
                    "time breakdown per rank, a timeline of the traced step, the top operators and kernels, the "
                    "communication, and the critical path beside the traced step time; report.json holds every "
                    "number. On GPU runs HolisticTraceAnalysis also reads the device traces, where it is installed.",
        epilog="Exit status: 0 when every report was written, 1 when a folder could not be reported on "
               "(the others are still written).")
    parser.add_argument("dirs", nargs="+", metavar="DIR", type=path_argument,
                        help="a folder of .et files, or a folder of such folders (searched two levels deep)")
    parser.add_argument("--traces", action="append", default=[], metavar="DIR", type=path_argument,
                        help="where the device traces (device.<rank>.json[.gz]) are when they are not beside the "
                             ".et files: a run folder, or a folder of run folders named like the .et files "
                             "(repeatable)")
    parser.add_argument("--no-hta", action="store_true", help="do not run HolisticTraceAnalysis")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    for raw in args.traces:
        if not Path(raw).is_dir():
            print(f"error: --traces {raw}: no such folder", file=sys.stderr)
            return 2
    with StopSignal() as stop:
        try:
            return _report_all(args)
        except InterruptedAfterWriting as e:  # it had said "not moved in" of the report just moved in
            print(f"interrupted: trace_report.py stopped by {stop.name} once {e.written} was written; the reports "
                  "printed above are complete too", file=sys.stderr)
            return stop.exit_code
        except KeyboardInterrupt:
            print(f"interrupted: trace_report.py stopped by {stop.name}; the report being written was not moved in "
                  "(its folder keeps the earlier one, if any); the reports printed above are complete", file=sys.stderr)
            return stop.exit_code


def _report_all(args: argparse.Namespace) -> int:
    failed = 0
    for raw in args.dirs:
        try:
            folders = find_report_folders(Path(raw))
        except (ReportError, OSError) as e:
            print(f"error: {_one_line(e, raw)}", file=sys.stderr)
            failed += 1
            continue
        for folder in folders:
            started = time.perf_counter()
            try:
                path = write_report(folder, args.traces, use_hta=not args.no_hta)
            except (ReportError, OSError) as e:
                print(f"error: {_one_line(e, folder)}", file=sys.stderr)
                failed += 1
                continue
            print(f"{path} ({time.perf_counter() - started:.1f} s)", flush=True)
    return 1 if failed else 0


def _one_line(error: Exception, where: str | Path) -> str:
    """A ReportError as it is; an OSError the report did not expect (a sub-folder that cannot be read) naming its
    file, not a traceback."""
    if isinstance(error, OSError):
        return f"{error.filename or where}: {error.strerror or error}"
    return str(error)


if __name__ == "__main__":
    sys.exit(main())
