"""`rlf-bench logprob` runs end to end on a small case and shows the fused path's memory advantage."""
import json

import pytest

from rlfactory_megatron.bench import logprob


@pytest.mark.slow
def test_bench_small_case(tmp_path, capsys):
    out = tmp_path / "logprob.json"
    argv = ["--tokens", "2048", "--vocab", "32768", "--hidden", "32", "--chunk-size", "128", "--device", "cpu", "--json", str(out)]
    assert logprob.main(argv) == 0
    (result,) = json.loads(out.read_text())
    assert result["T"] == 2048 and result["max_abs_diff"] < 1e-4
    # naive holds several [2048, 32768] fp32 tensors (256 MiB each); fused a few [128, 32768] (16 MiB).
    assert result["fused"]["peak_mib"] * 8 < result["naive"]["peak_mib"]
    assert "fused peak" in capsys.readouterr().out


def test_a_case_too_small_to_move_rss_reports_no_memory_ratio_instead_of_crashing(monkeypatch, capsys):
    # CI saw it: T=64 V=512 naive logits fit in heap the process already held, RSS read 0 MiB,
    # and the summary divided by it.
    case = {"T": 64, "V": 512, "H": 32, "max_abs_diff": 0.0,
            "fused": {"time_s": 0.002, "peak_mib": 0.0}, "naive": {"time_s": 0.001, "peak_mib": 0.0}}
    monkeypatch.setattr(logprob, "_spawn", lambda T, V, paths, argv: case)
    assert logprob.main(["--tokens", "64", "--vocab", "512", "--hidden", "32", "--device", "cpu"]) == 0
    summary = capsys.readouterr().out.splitlines()[-1]
    assert "not measurable" in summary and "TARGETS MISSED" in summary
