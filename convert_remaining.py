#!/usr/bin/env python3
"""Convert only the ranks whose .et is missing or failed in the last CONVERSION_SUMMARY.md."""
import sys

from utils.environment import require

require("conversion")  # one line naming the environment to use, not a ModuleNotFoundError

from trace_tools.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(remaining=True))
