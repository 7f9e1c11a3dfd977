"""The argument parser of every command line on the conversion side and of the benchmarks: a bad flag is refused in
one `error:` line that says what is wrong and where the help is (exit status 2), as the trainers refuse theirs
(utils/run_config.RunArgumentParser), instead of argparse's usage block followed by the error."""
from __future__ import annotations

import argparse
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose refusals are one line: `error: <prog>: <what is wrong> (see <prog> --help)`."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")
