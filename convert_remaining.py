#!/usr/bin/env python3
"""Convert only the ranks whose .et is missing or failed in the last CONVERSION_SUMMARY.md."""
import sys

from trace_tools.cli import main

if __name__ == "__main__":
    sys.exit(main(remaining=True))
