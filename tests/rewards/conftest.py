"""Fixtures for the rewards tests: a custom reward-function file (Ray comes from tests/conftest.py)."""
import textwrap
from pathlib import Path

import pytest

BEHAVING_FN = textwrap.dedent(
    '''
    import os
    import time


    def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
        """Exact match plus `bonus`; special responses misbehave on purpose."""
        if solution_str == "raise":
            raise RuntimeError("reward code failed")
        if solution_str == "sleep":
            time.sleep(60)
        if solution_str == "exit":
            os._exit(3)
        if solution_str == "spin":
            while True:
                pass
        return {"score": float(solution_str == ground_truth) + bonus, "acc": float(solution_str == ground_truth)}


    def batch_score(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):
        return [scale * len(s) for s in solution_strs]
    '''
)


@pytest.fixture(scope="session")
def reward_fn_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reward-function file in a temp dir (not importable as a module: loaded by path)."""
    path = tmp_path_factory.mktemp("custom_reward") / "my_reward.py"
    path.write_text(BEHAVING_FN)
    return path

