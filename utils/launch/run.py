"""Running the plan: foreground runs with signal forwarding, the background child, trace checks, the conversion to
.et, the summary and the next steps."""
from __future__ import annotations

import fcntl
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from trace_tools import layout
from trace_tools.atomic import process_is_alive, write_text_atomic
from utils.errors import STOP_SIGNALS, UsageError
from utils.launch.options import CONSOLE_LOG, LAUNCHERS, PID_FILE, Launcher, ShowHelp, parse_options, usage
from utils.launch.plan import (ROOT, LaunchError, Plan, Run, check_folders, check_master_address, check_train_flags,
                               dataset_arguments, make_plan, print_settings, probe_machine, report_machine, size_text)

PEEK_SECONDS = 5  # how long a background start shows the run's first lines
FLAGS_CHECKED = "LC_FLAGS_CHECKED"  # set for the background child: its parent checked train.py's flags


class Foreground:
    """Runs one command at a time; SIGINT, SIGTERM or SIGHUP (a `kill` of a background launcher, Ctrl-C, a closed
    terminal) is passed to it as SIGTERM (torchrun hands it to every rank, which saves a checkpoint) and stops the
    plan."""

    def __init__(self):
        self.child: Optional[subprocess.Popen] = None
        self.stopped = False

    def _on_signal(self, signum, frame) -> None:
        # Passed on once: `timeout` and `kill -- -PGID` signal the launcher and its whole process group, so the ranks
        # have it already; a second Ctrl-C reaches them from the terminal without the launcher.
        already_stopping, self.stopped = self.stopped, True
        if not already_stopping and self.child is not None and self.child.poll() is None:
            print(f"🛑 Stopping: SIGTERM to torchrun (PID {self.child.pid}); the trainer saves a checkpoint and exits")
            self.child.send_signal(signal.SIGTERM)

    def run(self, argv: list) -> int:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        self.child = subprocess.Popen(argv, cwd=ROOT)
        try:
            return self.child.wait()  # a signal handler runs during the wait, which then goes on (PEP 475)
        finally:
            self.child = None


def written_since(folder: Path, started: float) -> list:
    """The checkpoint folders (checkpoint-N, final_model, ...) in a run's --save-dir written since `started`: what a
    run stopped by a signal left, which is nothing when it stopped before its first checkpoint."""
    try:
        entries = [e for e in os.scandir(folder) if e.is_dir() and not e.name.startswith(".")]
        return sorted(e.name for e in entries if e.stat().st_mtime >= started - 1)  # coarse file-system clocks
    except OSError:
        return []


def check_traces(plan: Plan, run: Run, started: float) -> bool:
    """Every rank of this node wrote its host and device trace during this run (and rank 0 run.json)."""
    folder_text = f"{plan.opts.output_dir}/{run.name}"
    folder = ROOT / folder_text
    first = plan.opts.node_rank * run.nproc
    missing = []
    for rank in range(first, first + run.nproc):
        for name in (layout.host_trace_name(rank), layout.device_trace_name(rank)):
            path = folder / name
            if not _non_empty(path):
                missing.append(name)
            elif path.stat().st_mtime < started - 1:  # a second of slack for coarse file-system clocks
                missing.append(f"{name}(stale)")
    rank0 = plan.opts.node_rank == 0
    if rank0 and not _non_empty(folder / layout.RUN_INFO):
        missing.append(layout.RUN_INFO)
    if missing:
        print(f"❌ Trace folder {folder_text} is incomplete: missing {' '.join(missing)}")
        return False
    print(f"✅ Traces: {folder_text} (ranks {first}-{first + run.nproc - 1}: host, device, stacks"
          f"{', ' + layout.RUN_INFO if rank0 else ''}; {size_text(folder)})")
    return True


def make_logs_folder(logs: str) -> None:
    """--logs-dir, made where missing; one line naming it when it cannot be (check_folders finds most such cases
    before anything starts; a path in /proc, say, passes it)."""
    try:
        (ROOT / logs).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LaunchError(f"❌ --logs-dir {logs} cannot be made: {exc.strerror or exc}") from None


def claim_runs(plan: Plan) -> list:
    """A lock per run in the logs folder, held until this launcher exits: a second launcher about to write the same
    run folders (same run names, same --logs-dir) stops before it starts instead of mixing its traces and checkpoints
    with this one's."""
    logs = plan.opts.logs_dir
    make_logs_folder(logs)
    held = []
    for run in plan.runs():
        lock = f"{logs}/.{run.name}.node{plan.opts.node_rank}.lock"
        handle = open(ROOT / lock, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise LaunchError(f"❌ {run.name} is already being run by another launcher (PID {holder}, {lock}); wait for "
                              "it to end, or give this one other --output-dir, --save-dir and --logs-dir") from None
        handle.truncate(0)
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        held.append(handle)
    return held


def _non_empty(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def exit_text(rc: int) -> str:
    """A child's end as a shell says it: `exit 143` for a status, `killed by SIGTERM` where Popen gives -15 (the
    launcher had printed `exit -15`)."""
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit {rc}"


def is_background_launcher(pid: int) -> bool:
    """Whether the live process pid runs this checkout's launcher (python <repo>/utils/launch ..., as
    start_background starts it); True where its command line cannot be read."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return False  # ended since
    except OSError:  # no /proc (macOS): ps
        try:
            command = subprocess.run(["ps", "-p", str(pid), "-o", "command="], capture_output=True, text=True,
                                     timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return True
    return str(ROOT / "utils" / "launch") in command


def start_background(launcher: Launcher, plan: Plan) -> int:
    """This launcher again, detached, in the foreground with the probe's results; prints how to follow it."""
    logs = plan.opts.logs_dir
    pid_file, console = ROOT / logs / PID_FILE, f"{logs}/{CONSOLE_LOG}"
    old = pid_file.read_text().strip() if pid_file.is_file() else ""
    if old.isdigit() and process_is_alive(int(old)):
        if is_background_launcher(int(old)):
            print(f"error: a background run is still going (PID {old}, {logs}/{PID_FILE}); stop it (kill {old}) or "
                  "use another --logs-dir", file=sys.stderr)
            return 1
        # the file outlived its run (it is not removed when the run ends): after a reboot or when the numbers wrap,
        # another process has that PID, and the error had told the user to kill it
        print(f"note: {logs}/{PID_FILE} names PID {old}, which is not a launcher of this checkout now (the file was "
              "left by a run that ended); starting")
    make_logs_folder(logs)
    print(f"\n🎯 Starting in the background\n📋 Console log: {console}")
    extra = ["--", *plan.opts.extra] if plan.opts.extra else []
    # Appended to, not replaced: an earlier run's console log is often all that is left of it.
    with open(ROOT / console, "ab") as log:
        log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} ./{shlex.join([launcher.script, *plan.opts.own_args])}"
                  f" =====\n".encode())
        log.flush()  # before the child writes to the same file
        start = log.tell()
        # nohup and a session of its own: neither closing the terminal nor Ctrl-C there reaches it, only a kill
        child = subprocess.Popen(["nohup", sys.executable, str(ROOT / "utils" / "launch"), launcher.script,
                                  *plan.opts.own_args, "--foreground", *extra], stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, **plan.machine.variables(), FLAGS_CHECKED: "1"})
    write_text_atomic(pid_file, f"{child.pid}\n")
    print(f"""✅ Background run started
🔢 Process ID: {child.pid}
📄 PID file: {logs}/{PID_FILE}

🔍 Follow it with:
  tail -f {shlex.quote(console)}     # live log
  ps -p {child.pid}                             # still running?
  kill {child.pid}                              # stop it (a checkpoint is saved)

📋 First log lines (up to {PEEK_SECONDS}s):
----------------------------------------""")
    deadline = time.time() + PEEK_SECONDS
    try:
        while time.time() < deadline and child.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:  # the run has a session of its own: Ctrl-C here stops only the watching
        print(f"\n----------------------------------------\nStill running in the background (PID {child.pid}).")
        return 0
    with open(ROOT / console, "rb") as log:
        log.seek(start)
        print("\n".join(log.read().decode(errors="replace").splitlines()[-20:]))
    print("----------------------------------------")
    if child.poll() is None:
        print("Still running in the background...")
        return 0
    if child.returncode == 0:
        print(f"✅ The background run already finished (exit 0); full output in {console}")
    else:
        print(f"❌ The background run already ended ({exit_text(child.returncode)}); see {console}")
    return child.returncode



def convert(plan: Plan, folders: list, runner: Foreground) -> tuple:
    """convert_to_et.py on the trace folders, when this checkout and environment have it: (status, failed)."""
    print("\n🔄 Conversion to Chakra .et")
    python = plan.machine.python
    if not folders:
        print("⏭️  Nothing to convert: no trace folder was written")
        return "skipped", False
    if not (ROOT / "convert_to_et.py").is_file():
        print("⏭️  Conversion skipped: convert_to_et.py is not in this checkout")
        return "skipped", False
    if subprocess.run([python, "-c", "import chakra.schema.protobuf.et_def_pb2, orjson"], capture_output=True,
                      cwd=ROOT).returncode != 0:
        print(f"⏭️  Conversion skipped: {python} cannot import chakra and orjson; convert later with "
              f"./setup_and_convert.sh {plan.opts.output_dir}")
        return "skipped", False
    argv = [python, "convert_to_et.py", *folders]
    print(f"$ {shlex.join(argv)}")
    if plan.opts.dry_run:
        return "dry run", False
    rc = runner.run(argv)
    if rc == 0:
        print("✅ Converted: <run name>.<rank>.et and CONVERSION_SUMMARY.md in each trace folder")
        return "ok", False
    print(f"❌ Conversion failed (exit {rc}); the traces are kept, retry with: {python} convert_remaining.py "
          f"{' '.join(folders)}")
    return f"failed (exit {rc})", True


def run_plan(plan: Plan) -> int:
    """Each run in turn, then the conversion and the summary; the exit status (0, 1, or 130 when stopped)."""
    opts, runner = plan.opts, Foreground()
    results, traced, failed = [], [], False
    for run in plan.runs():
        if runner.stopped:
            break
        unit = "GPU(s)" if plan.device == "gpu" else "CPU rank(s)"
        nodes = f" per node × {opts.nnodes} nodes" if opts.nnodes > 1 else ""
        print(f"\n▶ {run.family.label} on {run.nproc} {unit}{nodes}: {run.name}\n$ {shlex.join(run.argv)}")
        where = f"{opts.output_dir if opts.trace else opts.save_dir}/{run.name}/"
        if opts.dry_run:
            results.append((run.name, "dry run", "-", where))
            continue
        started = time.time()
        rc = runner.run(run.argv)
        if rc == 0 and opts.trace and not check_traces(plan, run, started):
            rc = 1
        took = f"{round(time.time() - started)}s"
        if runner.stopped:
            saved = written_since(ROOT / opts.save_dir / run.name, started)
            kept = f"checkpoints in {opts.save_dir}/{run.name}/ (this run wrote {', '.join(saved)})" if saved else \
                f"this run wrote no checkpoint in {opts.save_dir}/{run.name}/"
            print(f"🛑 {run.name} stopped by a signal after {took} ({exit_text(rc)}); {kept}")
            results.append((run.name, "stopped", took, f"{opts.save_dir}/{run.name}/"))
        elif rc == 0:
            print(f"✅ {run.name} finished in {took}")
            results.append((run.name, "ok", took, where))
            traced += [f"{opts.output_dir}/{run.name}"] if opts.trace else []
        else:
            logs = f"{opts.logs_dir}/{run.name}/"
            # a flag train.py refused stops it before it logs: the folder the line had named did not exist
            wrote_logs = any(log.stat().st_mtime >= started - 1 for log in (ROOT / logs).glob("training_rank_*.log"))
            print(f"❌ {run.name} failed ({exit_text(rc)}) after {took}; "
                  + (f"per-rank logs in {logs}" if wrote_logs else "it wrote no log (its messages are above)"))
            results.append((run.name, f"failed ({exit_text(rc)})", took, logs if wrote_logs else "-"))
            failed = True
    conversion, next_run = None, None
    if opts.convert and opts.trace and not runner.stopped:
        if opts.dry_run:  # nothing was written yet: the command on the folders the runs would write
            traced = [f"{opts.output_dir}/{run.name}" for run in plan.runs()]
        conversion, convert_failed = convert(plan, traced, runner)
        failed = failed or convert_failed
        next_run = traced[-1] if conversion == "ok" else None  # the largest run: ASTRA-sim needs two NPUs or more
    print_summary(plan, results, conversion, next_run)
    if runner.stopped:
        print("🛑 Stopped by a signal")
        return 130
    return int(failed)


def print_summary(plan: Plan, results: list, conversion: Optional[str], next_run: Optional[str]) -> None:
    print("\n📊 Summary")
    rows = results + [(name, "skipped", "-", why) for name, why in plan.skipped]
    for name, status, took, where in rows:
        print(f"   {name:<28} {status:<16} {took:<7} {where}")
    if plan.opts.convert and plan.opts.trace:
        print(f"   {'conversion to .et':<28} {conversion or 'not run'}")
    if next_run:
        python = plan.machine.python
        print(f"""
👉 Next steps: the report: {python} trace_report.py {next_run}
   ASTRA-sim (built by ./install_astra_sim.sh): {python} simulate.py {next_run} --bandwidth 100Gbit/s
   or its workload path: --workload-configuration={next_run}/{Path(next_run).name} (docs/CHAKRA_SETUP.md)""")


def main(argv: Optional[list] = None) -> int:
    """argv: the launcher script's name (run_gpt2.sh), then the user's arguments."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        return launch(argv)
    except KeyboardInterrupt:  # Ctrl-C while checking the environment, before any run started
        print("\n🛑 Stopped (Ctrl-C) before any run started", file=sys.stderr)
        return 130
    except BrokenPipeError:  # whoever read the output stopped reading (`--help | head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0 if {"-h", "--help"} & set(argv) else 1


def launch(argv: list) -> int:
    script, *args = argv
    launcher = LAUNCHERS[script]
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # our lines and the children's stay in order in a log
    try:
        opts = parse_options(launcher, args)
    except ShowHelp:
        print(usage(launcher))
        return 0
    except UsageError as exc:
        print(f"error: {exc} (see ./{launcher.script} --help)", file=sys.stderr)  # the help would push it off screen
        return 2
    print(f"{'=' * 56}\n  MOSIM LLMs · {launcher.title}\n  torchrun + DDP · Chakra execution traces\n{'=' * 56}\n")
    print("🔍 Checking the environment")
    try:
        machine = probe_machine()
        device = report_machine(machine, opts)
        plan = make_plan(launcher, opts, machine, device, dataset_arguments(opts.dataset_path, device))
        check_folders(opts)
        check_master_address(opts)
    except LaunchError as exc:
        print(exc)
        return exc.status
    print_settings(plan)
    # A plain --dry-run only prints; with an explicit --background it rehearses the background start.
    try:
        if not opts.dry_run and os.environ.get(FLAGS_CHECKED) != "1":  # the background child's were, by its parent
            check_train_flags(plan)
        if opts.background and (not opts.dry_run or "--background" in opts.own_args):
            return start_background(launcher, plan)
        locks = [] if opts.dry_run else claim_runs(plan)
    except LaunchError as exc:
        print(exc)
        return exc.status
    try:
        return run_plan(plan)
    finally:
        for lock in locks:
            lock.close()
