"""The argument parser of every command line on the conversion side and of the benchmarks: a bad flag is refused in
one `error:` line that says what is wrong and where the help is (exit status 2), as the trainers refuse theirs
(utils/run_config.RunArgumentParser), instead of argparse's usage block followed by the error; and how a command's
child processes end with it."""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import threading
from typing import NoReturn


def output_closed() -> None:
    """Whoever read this command's output stopped reading (`| head`): stdout goes to /dev/null, so that nothing more
    written, and Python's flush at exit, raises BrokenPipeError again (a traceback)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose refusals are one line: `error: <prog>: <what is wrong> (see <prog> --help)`."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def path_argument(text: str) -> str:
    """argparse type of a flag that names a file or folder: an empty value (`--output-dir ""`, an unset shell
    variable) is refused, where the current folder would have been used in its place."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path (for the current folder, give .)")
    return text


class StopSignal:
    """SIGTERM (kill, a job scheduler's time limit) raises KeyboardInterrupt inside `with StopSignal() as stop:`, so
    a command line cleans up as on Ctrl-C; afterwards stop.name and stop.exit_code say which of the two it was."""

    def __init__(self) -> None:
        self.by_sigterm = False
        self._previous = None

    def _stop(self, signum, frame) -> NoReturn:
        self.by_sigterm = True
        raise KeyboardInterrupt

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():  # signal handlers can be set only there
            self._previous = signal.signal(signal.SIGTERM, self._stop)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    @property
    def name(self) -> str:
        return "SIGTERM" if self.by_sigterm else "Ctrl-C"

    @property
    def exit_code(self) -> int:
        return 128 + signal.SIGTERM if self.by_sigterm else 130


def die_with_parent() -> bool:
    """Ask Linux to SIGKILL this process when its parent ends (prctl PR_SET_PDEATHSIG), for a child that must not
    outlive a command killed outright (kill -9, the OOM killer): the conversion's workers, ASTRA-sim under
    simulate.py. False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, signal.SIGKILL, 0, 0, 0) == 0  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False
