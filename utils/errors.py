"""Errors a user can act on: the entry points print them as one `error: ...` line and exit non-zero."""
import os
import signal
import sys
import time

# The signals that stop a run the way SIGTERM does (a checkpoint after the current step, once training runs): Ctrl-C,
# a kill, and the hang-up of a closed terminal or a dropped SSH session, which otherwise ended every rank at once
# without the checkpoint that torchrun's message says each was asked for.
STOP_SIGNALS = tuple(sig for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if sig is not None)
# How long a rank other than 0 waits for rank 0 to report an error every rank hit (wait_for_rank_zero_to_report).
SHARED_ERROR_GRACE_S = 30.0


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

    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, stop)


def wait_for_rank_zero_to_report(message: str, rank: int) -> None:
    """A rank other than 0 under torchrun that hit an error every rank hits (a missing dataset, a bad flag), which
    rank 0 alone prints: wait for torchrun to stop this rank.

    torchrun stops every rank when the first one fails. Had this rank failed first, rank 0 would be stopped before it
    printed, and the console would never name the problem. Waiting lets rank 0 print and fail first; torchrun then
    sends this rank SIGTERM. If none comes within SHARED_ERROR_GRACE_S, rank 0 did not hit the error (a file missing
    on this node only), so this rank prints it, naming itself.
    """
    if rank == 0 or "TORCHELASTIC_RUN_ID" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)  # torchrun's stop (or the user's Ctrl-C) ends the wait quietly
    time.sleep(SHARED_ERROR_GRACE_S)
    print(f"error: [rank {rank}] {message}", file=sys.stderr)
