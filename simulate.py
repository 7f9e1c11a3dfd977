#!/usr/bin/env python3
"""Simulate a converted run in ASTRA-sim on a chosen network: predicted step per rank beside the measured one."""
import sys

from trace_tools.simulate import main

if __name__ == "__main__":
    sys.exit(main())
