#!/usr/bin/env python3
"""Simulate a converted run in ASTRA-sim on a chosen network: predicted step per rank beside the measured one."""
import sys

from utils.environment import require

require("conversion")  # one line naming the environment to use, not a ModuleNotFoundError

from trace_tools.simulate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
