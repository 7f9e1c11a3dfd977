#!/usr/bin/env python3
"""Convert PyTorch host + device traces into validated Chakra .et files (one per rank) with a summary."""
import sys

from utils.environment import require

require("conversion")  # one line naming the environment to use, not a ModuleNotFoundError

from trace_tools.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
