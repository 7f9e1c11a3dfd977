"""Outputs that appear whole under their final name or not at all: a temporary file in the same folder, then rename."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO


def new_file_mode() -> int:
    """The mode open() would give a new file under the current umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


class _atomic_output:
    """Context manager: a binary file that appears under its final name only when fully written."""

    def __init__(self, path: Path):
        self.path = path
        self.tmp: str | None = None
        self.file: BinaryIO | None = None

    def __enter__(self) -> BinaryIO:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self.tmp = tempfile.mkstemp(prefix="." + self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        self.file = os.fdopen(fd, "wb", buffering=1 << 20)
        return self.file

    def __exit__(self, exc_type, exc, tb) -> None:
        assert self.file is not None and self.tmp is not None
        try:
            self.file.close()
            if exc_type is None:
                os.chmod(self.tmp, new_file_mode())  # mkstemp makes 0600 files; outputs are ordinary files
                os.replace(self.tmp, self.path)
        finally:
            if os.path.exists(self.tmp):
                os.unlink(self.tmp)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """A UTF-8 text file (summary, configuration) written whole under its name or not at all."""
    path = Path(path)
    with _atomic_output(path) as f:
        f.write(text.encode("utf-8"))
    return path
