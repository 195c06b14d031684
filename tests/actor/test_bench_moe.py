"""`rlf-bench moe` at small sizes: the MoE model and its dense twin of the same active size, each
at 1 rank and at 2 (the MoE one at EP 2), in one run; every sync moves every weight whole."""
import json

import pytest

from rlfactory_megatron.bench import moe

SMALL = ["--hidden", "128", "--heads", "2", "--kv-heads", "1", "--layers", "2", "--vocab", "512", "--tokens", "64",
         "--rows", "2", "--warmup", "0", "--steps", "1", "--sync-repeats", "1"]


@pytest.mark.slow
def test_moe_and_its_dense_twin_at_ep_1_and_2_in_one_run(tmp_path, capsys):
    out = tmp_path / "moe.json"
    assert moe.main([*SMALL, "--json", str(out)]) == 0, capsys.readouterr().out
    report = json.loads(out.read_text())
    results = report["results"]
    assert [(r["model"], r["ranks"], r["ep"]) for r in results] == [("dense", 1, 1), ("moe", 1, 1), ("dense", 2, 1),
                                                                     ("moe", 2, 2)]
    dense, sparse = results[0], results[1]
    # Same active size: a token's top-2 experts of width 128 are the dense MLP of width 256; the
    # MoE model adds its routers (layers x hidden x experts) and 6 idle experts per layer.
    assert dense["active_params"] == dense["params"]
    assert sparse["active_params"] == dense["params"] + 2 * 128 * 8
    assert sparse["params"] == sparse["active_params"] + 2 * 6 * 3 * 128 * 128
    for r in results:
        # Every weight once, whole (fp32): at EP 2 the experts were gathered from both ranks.
        assert r["sync_bytes"] == 4 * r["params"], r
        assert r["update_s"] > 0 and r["sync_s"] > 0 and r["tokens_per_s"] > 0
        assert len(r["per_rank"]) == r["ranks"]
    ratios = report["ratios"]
    assert ratios["moe_over_dense_at_2_ranks"]["update_s"] == results[3]["update_s"] / results[2]["update_s"]
    assert ratios["ep2_over_ep1"]["sync_s"] == results[3]["sync_s"] / results[1]["sync_s"]
    printed = capsys.readouterr().out
    assert "MoE / dense at 2 rank(s) (ep 2): update" in printed and "MoE at EP 2 / EP 1: update" in printed
    # A layout the experts cannot split into: refused before any model is built.
    assert moe.main([*SMALL, "--ep", "3"]) == 2
    assert "--ep 3: must be >= 1 and divide --experts 8 and --rows 2" in capsys.readouterr().out
    assert moe.main([*SMALL, "--ep", "one"]) == 2 and moe.main([*SMALL, "--steps", "0"]) == 2
    printed = capsys.readouterr().out
    assert "--ep one: give expert-parallel sizes" in printed and "--steps and --sync-repeats: at least 1" in printed
