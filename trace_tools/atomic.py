"""Outputs that appear whole under their final name or not at all: a temporary file in the same folder, flushed to
disk, then renamed; removed when anything fails."""
from __future__ import annotations

import os
import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Callable, Iterator


class InterruptedAfterWriting(KeyboardInterrupt):
    """Ctrl-C or SIGTERM that came while outputs were being renamed into place, held back until they were:
    `written` (the file or folder that says what was written) is whole."""

    def __init__(self, written: Path):
        super().__init__(str(written))
        self.written = written


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block ends, where signals can be blocked (the thread that would take them
    blocks them here: a command line's only thread)."""
    held = {signal.SIGINT, signal.SIGTERM}
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    # The mask as it is, read before anything is blocked: pthread_sigmask runs any signal handler that is due as it
    # returns, and a Ctrl-C raised there by the call that blocks would skip the `finally` and leave the signals
    # blocked for the rest of the process.
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, held)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextmanager
def publication(written: Callable[[], Path]) -> Iterator[None]:
    """Renames that belong together, never interrupted halfway: Ctrl-C or SIGTERM waits until the block has ended
    (signals_deferred), then raises InterruptedAfterWriting(written()) when the block did all it had to, so the
    command says its outputs are in place instead of "nothing was written". A signal that was not held back (no
    pthread_sigmask, or another thread took it) interrupts the block as any other."""
    done = False
    try:
        with signals_deferred():
            yield
            done = True
    except KeyboardInterrupt:
        if not done:
            raise
        raise InterruptedAfterWriting(written()) from None


def process_is_alive(pid: int) -> bool:
    """Whether a process runs with this pid (another user's counts): a temporary file or folder named after a dead
    writer's pid is a leftover that the next run may remove."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def new_file_mode() -> int:
    """The mode open() would give a new file under the current umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextmanager
def atomic_path(path: str | Path, stage: str = "", mode: int | None = None) -> Iterator[Path]:
    """A temporary path beside `path` for a writer that wants a path; renamed to `path` when the block ends without
    an error (after fsync, with `mode` or an ordinary file's mode), removed otherwise. `stage` names what the
    temporary file waits for (".<name>.<stage>.<random>.tmp"), so a clean-up after a kill can find it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.{stage + '.' if stage else ''}", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, new_file_mode() if mode is None else mode)  # mkstemp makes 0600 files
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_output(path: str | Path, mode: int | None = None, stage: str = "") -> Iterator[BinaryIO]:
    """A binary file that appears under `path` only when fully written (see atomic_path)."""
    with atomic_path(path, stage=stage, mode=mode) as tmp, open(tmp, "wb", buffering=1 << 20) as f:
        yield f


def write_text_atomic(path: str | Path, text: str) -> Path:
    """A UTF-8 text file (summary, configuration) written whole under its name or not at all."""
    with atomic_output(path) as f:
        f.write(text.encode("utf-8"))
    return Path(path)


@contextmanager
def folder_held(folder: str | Path, busy: Callable[[], Exception], *, shared: bool = False) -> Iterator[None]:
    """Hold a folder against the other tools that write into it (one writer; with shared=True, readers side by side
    but no writer): raises busy() when another process holds it. An advisory lock on the folder itself, so no lock
    file is left and the kernel drops it when the holder dies; unguarded where there are no advisory locks (Windows,
    a file system without them)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy() from None
        except OSError:
            pass
        yield
    finally:
        os.close(fd)
