"""`python -m utils.torchrun ...`: torchrun with the same arguments, ending in one `error:` line instead of a traceback
when it is stopped by a signal or a rank fails (see utils.distributed.run_torchrun)."""
import sys

from utils.distributed import run_torchrun

if __name__ == "__main__":
    sys.exit(run_torchrun(sys.argv[1:]))
