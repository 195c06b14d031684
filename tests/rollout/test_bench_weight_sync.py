"""`rlf-bench weight-sync` runs end to end on a small model and reports every figure, the sync into an
engine in a process of its own (fed by handle) among them (the real figures come from the default
152M-parameter run)."""
import json
import subprocess
import sys


def test_bench_weight_sync_reports_sync_in_and_out_of_process_memcpy_and_disk(tmp_path):
    out = tmp_path / "figures.json"
    subprocess.run([sys.executable, "-m", "rlfactory_megatron.cli.bench", "weight-sync", "--hidden", "128", "--layers", "2",
                    "--vocab", "1000", "--bucket-mb", "0.1", "1", "--repeats", "1", "--json", str(out)],
                   check=True, timeout=600, capture_output=True)
    figures = json.loads(out.read_text())
    small, large = figures["sync_0.1MB"], figures["sync_1MB"]
    assert small["bytes"] == large["bytes"] > 0 and small["buckets"] > large["buckets"] >= 1
    assert small["message_bytes"] == large["message_bytes"] == 0  # the engine in this process: no messages
    for bucket_mb in ("0.1", "1"):  # the engine in a process of its own, measured in the same run
        other = figures[f"other_process_sync_{bucket_mb}MB"]
        assert other["bytes"] == small["bytes"] and 0 < other["message_bytes"] < 0.01 * other["bytes"], other
    assert figures["memcpy"]["GB_per_s"] > 0 and figures["disk_save_and_reload"]["seconds"] > 0
    assert figures["sync_vs_memcpy_throughput"] > 0 and figures["speedup_vs_disk"] > 0
    assert figures["other_process_vs_in_process"] > 0
