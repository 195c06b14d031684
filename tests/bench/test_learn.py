"""`rlf-bench learn` runs rlf-train per seed and thread setting and reports each run and the
median: here one very short run (too short to learn: the verdict is its own figures', and so is
the exit status) with no thread variable set, as a newcomer runs it (rlf-train chooses, says so)."""
import json
import subprocess
import sys

from rlf_train_cli import SMALL, env_for


def test_learn_reports_every_run_and_the_median(tmp_path):
    out = tmp_path / "learn"
    short = [*SMALL, "trainer.total_steps=3", "trainer.val_every=3", "trainer.save_every=0"]
    env = {k: v for k, v in env_for(tmp_path).items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-m", "rlfactory_megatron.cli.bench", "learn", "--seeds", "5",
                           "--threads", "auto", "--out", str(out), *short],
                          capture_output=True, text=True, env=env, timeout=1200)
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-2000:]
    assert "run 1/1: seed 5, threads auto" in done.stdout
    assert "[seed 5 threads auto] rlf-train: OMP_NUM_THREADS=" in done.stdout  # rlf-train chose
    assert "[seed 5 threads auto] step 3/3 | reward" in done.stdout  # each run's progress passes through
    report = json.loads((out / "learn.json").read_text())
    runs = report["runs"]
    assert [(r["seed"], r["threads"]) for r in runs] == [(5, "auto")]
    for r in runs:
        assert not r["error"] and set(r["val_curve"]) == {"0", "3"} and set(r["reward_curve"]) == {"1", "2", "3"}
        assert r["learned"] == (r["gain"] >= 0.4 and r["reward_last"] > r["reward_first"])
    assert done.returncode == (0 if all(r["learned"] for r in runs) else 1)
    table = (out / "learn.md").read_text()
    assert "| 5 | auto |" in table and "| median (min-max) |" in table
    assert (out / "learn.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "seed5-threadsauto" / "metrics.jsonl").is_file()
