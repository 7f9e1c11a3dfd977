#!/usr/bin/env python3
"""Convert PyTorch host + device traces into validated Chakra .et files (one per rank) with a summary."""
import sys

from trace_tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
