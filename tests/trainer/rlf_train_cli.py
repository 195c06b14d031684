"""Run `rlf-train` as a user does (a subprocess, its own Ray and vLLM) with small settings."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from console_scripts import BIN

SMALL = ["trainer.prompts_per_step=2", "rollout.n=2", "rollout.max_response_tokens=48", "trainer.val_every=2",
         "trainer.val_prompts=2", "trainer.save_every=2", "trainer.sft_steps=2", "trainer.sft_batch_size=4",
         "tools.num_workers=1"]
# Wall-clock measurements (and the engines' busy-time ratio) differ between any two runs, and so
# does the size of the handles a sync sends (they name process ids); everything else must not.
TIMING_KEYS = ("time/", "perf/", "tokens_per_s", "_busy_s", "engine_imbalance", "weight_sync/message_bytes")


def env_for(tmp_path):
    # RLF_DEVICE_DISCIPLINE: every run fails where a GPU run would (runtime/device_discipline.py).
    env = dict(os.environ, OMP_NUM_THREADS="1", RLF_CACHE_HOME=str(tmp_path.parent / "rlf-cache"),
               RLF_DEVICE_DISCIPLINE="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "RAY_ADDRESS"):
        env.pop(var, None)
    return env


def rlf_train(tmp_path, run: str, *overrides, timeout=900, env=None):
    args = [*SMALL, f"trainer.output_dir={tmp_path / run}", *overrides]
    return subprocess.run([str(BIN / "rlf-train"), *args], capture_output=True, text=True,
                          env={**env_for(tmp_path), **(env or {})}, timeout=timeout)


def torchrun_train(tmp_path, run: str, nproc: int, *overrides, timeout=900):
    """`torchrun --standalone --nproc-per-node N -m rlfactory_megatron.cli.train` (data-parallel ranks;
    standalone, torchrun binds its store where the OS puts it: a port picked beforehand can be taken)."""
    args = [*SMALL, f"trainer.output_dir={tmp_path / run}", *overrides]
    command = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(nproc),
               "-m", "rlfactory_megatron.cli.train", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env_for(tmp_path), timeout=timeout)


def stored_trajectories(run_dir: Path) -> dict[tuple[int, str], tuple]:
    """(step, sample id) -> (prompt ids, response ids, loss mask, reward) over all of a run's rollout shards."""
    from rlfactory_megatron.envs.storage import RolloutStore

    out = {}
    with RolloutStore(run_dir / "cache" / "rollouts", readonly=True) as store:
        for step in store.steps():
            for r in store.read_step(step):
                assert (step, r.sample_id) not in out, f"step {step} sample {r.sample_id} stored twice"
                out[step, r.sample_id] = (r.prompt_ids.tolist(), r.response_ids.tolist(), r.loss_mask.tolist(), r.reward)
    return out


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_metrics(run: list[dict], reference: list[dict], ignore: tuple[str, ...] = (), rel: float = 0.0) -> None:
    """`run` logged the steps `reference` logged, each with every metric of it but timings (and
    keys containing one of `ignore`) equal: exactly, or within `rel` (DP's sums round otherwise)."""
    import pytest

    assert [r["step"] for r in run] == [r["step"] for r in reference]
    for mine, theirs in zip(run, reference):
        compared = {k for k in theirs if not any(t in k for t in TIMING_KEYS + ignore)}
        assert compared <= set(mine), compared - set(mine)
        for key in compared:
            expected = pytest.approx(theirs[key], rel=rel, abs=1e-6) if rel else theirs[key]
            assert mine[key] == expected, (mine["step"], key, mine[key], theirs[key])


def _start_and_wait(tmp_path, run: str, overrides, reached, what: str, timeout: float):
    """Start rlf-train in a session of its own (its log in <run>.log) and wait until `reached()`."""
    args = [*SMALL, f"trainer.output_dir={tmp_path / run}", *overrides]
    log_path = tmp_path / f"{run}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(BIN / "rlf-train"), *args], stdout=log, stderr=subprocess.STDOUT,
                                env=env_for(tmp_path), start_new_session=True)
    deadline = time.monotonic() + timeout
    while not reached():
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{what} not reached in time"
        time.sleep(0.2)
    return proc, log_path


def kill_after_checkpoint(tmp_path, run: str, checkpoint: str, *overrides) -> None:
    """Start rlf-train and SIGKILL its whole process group as soon as `checkpoint` is complete."""
    marker = tmp_path / run / "checkpoints" / checkpoint / "trainer_state.json"
    proc, _ = _start_and_wait(tmp_path, run, overrides, marker.exists, f"checkpoint {checkpoint}", 900)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def stop_after_step(tmp_path, run: str, step: int, *overrides, signum=signal.SIGTERM, everyone=False, timeout=900):
    """Start rlf-train, send `signum` once it has logged `step`: to its process alone (as torchrun
    passes it on to its workers, or `kill <pid>`), or with `everyone` to it and every process it
    started (as Slurm signals a job step: Ray's, vLLM's, the tools'). Returns (exit status,
    output, its descendants at the signal, seconds from the signal to its exit)."""
    import psutil

    metrics = tmp_path / run / "metrics.jsonl"

    def logged():
        return metrics.exists() and any(json.loads(line)["step"] >= step for line in metrics.read_text().splitlines())

    proc, log_path = _start_and_wait(tmp_path, run, overrides, logged, f"step {step}", timeout)
    descendants = psutil.Process(proc.pid).children(recursive=True)
    signalled = time.monotonic()
    for process in descendants if everyone else []:
        try:
            process.send_signal(signum)
        except psutil.NoSuchProcess:
            pass
    proc.send_signal(signum)
    status = proc.wait(timeout=timeout)
    return status, log_path.read_text(), descendants, time.monotonic() - signalled


# tests/trainer/faults/sitecustomize.py records a run's device phases when this names a file.
FAULTS = Path(__file__).parent / "faults"


def recording_env(path: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(FAULTS), "RLF_TEST_RECORD_DEVICE_PHASES": str(path)}


def check_device_phases(path: Path, offload: bool = False) -> dict[int, int]:
    """The order a GPU's memory hand-over needs, on what a run recorded (recording_env): no
    megatron pass while an engine is awake; each level-2 sleep (before training) followed by the
    passes, then torch.cuda.empty_cache(), then the engine's weights waking, the weight load, and
    only then its KV cache; with `offload`, the state offloaded before the weights wake and the
    actor's parameters after the load, before the KV cache wakes; a level-1 sleep (a checkpoint
    with offloaded state) wakes everything once the state is offloaded again. Returns the count
    of sleeps by level."""
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert events, "nothing was recorded"
    phases: list[list[dict]] = []
    for pid in sorted({event["pid"] for event in events}):  # each rank's process: its engine, its passes
        asleep: set[str] = set()
        mine: list[list[dict]] = []
        for event in (event for event in events if event["pid"] == pid):
            kind = event["event"]
            if kind == "sleep":
                assert not asleep, f"a sleep while asleep: {event}"
                asleep = {"weights", "kv_cache"}
                mine.append([])
            elif kind == "wake_up":
                asleep -= set(event["tags"] or ("weights", "kv_cache"))
            elif kind == "run":
                assert asleep == {"weights", "kv_cache"}, f"a megatron pass with the engine awake (asleep: {sorted(asleep)})"
            if mine:
                mine[-1].append(event)
        phases += mine
    levels: dict[int, int] = {}
    for phase in phases:
        names = [e["event"] for e in phase]
        level = phase[0]["level"]
        levels[level] = levels.get(level, 0) + 1
        wakes = [i for i, e in enumerate(phase) if e["event"] == "wake_up"]
        offloads = [i for i, e in enumerate(phase) if e["event"] == "offload"]
        if level == 1:  # a checkpoint: the whole state back, saved, sent away again; no pass
            assert "run" not in names and [phase[i]["tags"] for i in wakes] == [["weights", "kv_cache"]], names
            assert offloads and "params" in phase[offloads[-1]]["kinds"] and "empty_cache" in names[offloads[-1]:wakes[0]]
            continue
        assert level == 2, phase[0]
        assert [phase[i]["tags"] for i in wakes] == [["weights"], ["kv_cache"]], names
        weights, kv_cache = wakes
        last_pass = max((i for i, name in enumerate(names) if name == "run"), default=0)  # a resume loads, no pass
        assert last_pass < weights and "empty_cache" in names[last_pass:weights], names
        assert names[weights + 1:kv_cache].count("load") == 1 and "loaded" in names[weights + 1:kv_cache], names
        assert "load" not in names[:weights] and "loaded" not in names[kv_cache:], names
        loaded = names.index("loaded")
        if offload:
            assert any(phase[i]["kinds"] == ["grads", "optimizer"] for i in offloads if last_pass < i < weights), names
            after_load = [i for i in offloads if loaded < i < kv_cache]
            assert after_load and "params" in phase[after_load[-1]]["kinds"], names
            assert "empty_cache" in names[after_load[-1]:kv_cache], names
    return levels
