"""`python utils/launch run_gpt2.sh [options]`: what ./run_gpt2.sh runs (the script's name picks its defaults)."""
import sys
from pathlib import Path

# Run as a folder: import from the repository root, not from utils/launch/, whose plan.py and run.py would otherwise
# shadow same-named modules.
sys.path[0] = str(Path(__file__).resolve().parent.parent.parent)

from utils.launch.run import main  # noqa: E402

sys.exit(main())
