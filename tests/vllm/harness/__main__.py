"""``python tests/vllm/harness SCENARIO_ID``: see :func:`harness.compare.main`."""

import sys
from pathlib import Path

# Run as a directory, the package's parent is not on the path yet.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.compare import main

sys.exit(main(sys.argv[1:]))
