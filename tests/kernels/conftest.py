"""Make logprob_cases importable: pytest runs with --import-mode=importlib, which adds no test dirs to sys.path."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
