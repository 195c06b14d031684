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
