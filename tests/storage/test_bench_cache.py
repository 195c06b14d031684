"""`rlf-bench cache` runs end to end on a small payload (the figures come from the full run)."""
import re

from rlfactory_megatron.bench.cache import main


def test_bench_cache_prints_the_figures(tmp_path, capsys):
    assert main(["--dir", str(tmp_path), "--records", "64", "--batch", "16", "--prompt-len", "32",
                 "--response-len", "64", "--artifacts", "50", "--lookups", "200", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "in 4 batches of 16 records" in out
    for line in ("raw sequential write + fsync", "the same, with write-behind", "rollout write + fsync",
                 "rollout read (all steps)", "artifact lookup (hit), wall"):
        assert re.search(re.escape(line) + r" *: +[\d.]+ (MB/s|ms)|" + re.escape(line) + r" *: p50", out), line
    assert re.search(r"= \d+% of raw, \d+% of raw with write-behind", out)
    assert list(tmp_path.iterdir()) == []  # its work directory is removed
