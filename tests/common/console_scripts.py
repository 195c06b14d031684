"""Where the tests find the commands users run: this environment's console scripts."""
import sys
from pathlib import Path

# rlf-train, rlf-convert, rlf-bench, rlf-cache, torchrun, ...: the folder of the running interpreter
BIN = Path(sys.executable).parent
