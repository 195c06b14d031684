"""`rlf-bench long-trajectory` at small sizes: CP 2 keeps at most 0.6x CP 1's peak memory per rank,
and makes the same update (grad norm)."""
import json

import pytest

from rlfactory_megatron.bench import long_trajectory


@pytest.mark.slow
def test_cp2_halves_the_peak_memory_per_rank_and_makes_the_same_update(tmp_path, capsys):
    out = tmp_path / "long_trajectory.json"
    argv = ["--tokens", "4096", "--trajectories", "1", "--turn", "256", "--hidden", "128", "--layers", "2",
            "--heads", "2", "--kv-heads", "1", "--vocab", "4096", "--warmup", "1", "--steps", "1", "--json", str(out)]
    assert long_trajectory.main(argv) == 0, capsys.readouterr().out
    summary = json.loads(out.read_text())
    assert [r["cp"] for r in summary["results"]] == [1, 2]
    assert summary["peak_ratio_cp2"] <= long_trajectory.TARGET, summary
    assert summary["grad_norm_rel_diff"] <= 1e-5, summary
    assert "CP 2 / CP 1: peak memory per rank" in capsys.readouterr().out
