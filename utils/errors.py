"""Errors a user can act on: the entry points print them as one `error: ...` line and exit non-zero."""
import os
import signal


class UsageError(Exception):
    """A bad flag, file or environment; the message names the flag or file and the problem."""


class DataError(UsageError):
    """A missing or malformed data file; the message starts with the file name (and line, where there is one)."""


class NonFiniteLossError(UsageError):
    """The loss became NaN or infinite; the run stops before the optimizer step so weights stay finite."""


class CheckpointError(UsageError):
    """A checkpoint that cannot be resumed from, or one that could not be written; the message names the file."""


class StopRequested(BaseException):
    """SIGTERM (or SIGINT) where no checkpoint can be saved: unwinds like KeyboardInterrupt, which
    `except Exception` blocks do not catch."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_quietly_while_starting_up() -> None:
    """Ctrl-C or SIGTERM while torch and transformers import: one line and exit 128 + signal, not a traceback
    through the import machinery. The trainer's own handlers replace these once it runs; an ignored signal (a
    background job's SIGINT) stays ignored."""

    def stop(signum, frame):
        os.write(2, f"error: interrupted by {signal.Signals(signum).name} while starting up; nothing was written\n"
                 .encode())
        os._exit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, stop)
