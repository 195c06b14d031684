"""`rlf-bench rollout` runs end to end on a small model: both engine counts generate the same
samples through the router, and every figure is reported (the real figures come from the
default run)."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_rollout_reports_scaling_and_sync_times(tmp_path):
    out = tmp_path / "figures.json"
    subprocess.run([sys.executable, "-m", "rlfactory_megatron.cli.bench", "rollout", "--prompts", "8", "--max-tokens",
                    "16", "--prompt-tokens", "16", "--hidden", "128", "--layers", "2", "--rounds", "2", "--json", str(out)],
                   check=True, timeout=600, capture_output=True)
    figures = json.loads(out.read_text())
    assert figures["same_samples"]  # where a seeded request runs never changes what it generates
    assert figures["one_engine"]["tokens"] == figures["two_engines"]["tokens"] > 0
    assert len(figures["two_engines"]["engine_busy_s"]) == 2 and all(b > 0 for b in figures["two_engines"]["engine_busy_s"])
    assert figures["scaling_efficiency"] > 0 and figures["two_engines"]["imbalance"] >= 1.0
    assert figures["sync_one_engine_s"] > 0 and figures["sync_two_over_one"] > 0
    # Two rounds, each count first once: every round's figures beside the medians.
    assert len(figures["one_engine"]["tokens_per_s_per_round"]) == len(figures["scaling_efficiency_per_round"]) == 2
