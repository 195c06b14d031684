"""`rlf-bench tools` runs end to end (small N here; the figure itself comes from the full run)."""
from rlfactory_megatron.bench.tools import main


def test_bench_tools_prints_the_figures(ray_session, capsys):
    assert main(["--calls", "32", "--rounds", "3", "--latency-ms", "20", "--actors", "1", "--max-concurrency", "32", "--target", "0"]) == 0
    out = capsys.readouterr().out
    assert "ideal (concurrency / L)" in out and "1600 calls/s" in out
    assert "Ray tool pool" in out and "% of ideal" in out and "target >= 0% of ideal: met" in out
