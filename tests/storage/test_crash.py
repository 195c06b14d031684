"""Acceptance: a writer killed with SIGKILL at random points, ten times over, never costs a completed batch and
never leaves a shard that fails to open or verify."""
from __future__ import annotations

import random
import select
import signal
import subprocess
import sys
import time

import pytest

from rlfactory_megatron.envs.storage import RolloutStore, ToolArtifactCache
from rlfactory_megatron.envs.storage.topology import single_process
from rlfactory_megatron.envs.storage.verify import verify_directory

pytestmark = pytest.mark.slow
KILLS = 10


def _run_until_killed(cmd, env, delay_s: float) -> list[str]:
    """Start the writer, kill -9 it `delay_s` after it is ready, return the batches it reported done."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    lines: list[str] = []
    try:
        deadline = None
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], 0.01)
            if ready:
                line = proc.stdout.readline()
                assert line, f"writer exited early: {proc.stderr.read()[-2000:]}"
                lines.append(line.strip())
                if line.strip() == "ready":
                    deadline = time.monotonic() + delay_s
            if deadline is not None and time.monotonic() >= deadline:
                break
            assert proc.poll() is None, f"writer died: {proc.stderr.read()[-2000:]}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        lines += [line.strip() for line in proc.stdout]  # reported before the signal landed
    finally:
        if proc.poll() is None:
            proc.kill()
    return lines


def test_kill_nine_mid_append_keeps_completed_batches(tmp_path, worker_cmd, subprocess_env, workers):
    rng = random.Random(1234)
    completed_rollouts, synced_artifacts = -1, set()
    for kill in range(KILLS):
        lines = _run_until_killed([*worker_cmd, "killed-writer", str(tmp_path)], subprocess_env, rng.uniform(0.05, 0.8))
        completed_rollouts = max([completed_rollouts] + [int(l.split()[1]) for l in lines if l.startswith("rollouts")])
        synced_artifacts |= {int(l.split()[1]) for l in lines if l.startswith("artifacts")}

        problems = {path: found for path, found in verify_directory(tmp_path / "rollouts").items() if found}
        problems.update({path: found for path, found in verify_directory(tmp_path / "artifacts").items() if found})
        assert not problems, f"after kill {kill}: {problems}"
        with RolloutStore(tmp_path / "rollouts", readonly=True) as store:
            steps = store.steps()
            assert steps == list(range(len(steps))), f"after kill {kill}: a step is missing or torn: {steps}"
            assert len(steps) > completed_rollouts  # every reported batch survived (one more may have, unreported)
            for step in (steps[-1], rng.choice(steps)):
                assert store.read_step(step) == [workers.make_record(step, 0, i) for i in range(workers.KILL_BATCH)]
    assert completed_rollouts >= KILLS // 2, "the writer barely ran: the kills did not land mid-append"

    # Reopening for writing recovers the crashed shards. The newest reported step's artifacts are all there
    # (the cache holds about three steps; at most one more, unreported, step was synced after it), and no
    # lookup of an older one returns wrong bytes.
    with ToolArtifactCache(tmp_path / "artifacts", single_process(), max_bytes=workers.KILL_CACHE_BYTES) as cache:
        for step in sorted(synced_artifacts):
            for i in range(8):
                hit = cache.get("search", workers.artifact_args(step, i))
                assert (hit is None and step < max(synced_artifacts)) or hit.value == workers.artifact_value(step, i)
        assert cache.stats()["owned_bytes"] <= cache.shard_cap
    verify = subprocess.run([sys.executable, "-m", "rlfactory_megatron.cli.cache", "verify", str(tmp_path / "rollouts"),
                             str(tmp_path / "artifacts")], capture_output=True, text=True, env=subprocess_env)
    assert verify.returncode == 0, verify.stdout + verify.stderr
