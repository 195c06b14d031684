"""Compare two directories of scripts/refactor_baselines.sh runs: every run's stored trajectories
and metrics.jsonl must be equal bit for bit, timings apart (tests/trainer/rlf_train_cli.py's rules)."""
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "tests" / folder) for folder in ("common", "trainer")]
from rlf_train_cli import assert_same_metrics, records, stored_trajectories  # noqa: E402

RUNS = ("default", "colocated_dp2", "disaggregated")


def stored_records(run_dir: Path) -> dict:
    """(step, sample id) -> every field of the stored record (advantages, log-probs, tool traces,
    metadata) but the tool calls' latencies, which are timings."""
    from rlfactory_megatron.envs.storage import RolloutStore

    with RolloutStore(run_dir / "cache" / "rollouts", readonly=True) as store:
        return {(step, r.sample_id): repr((r.prompt_ids.tolist(), r.response_ids.tolist(), r.loss_mask.tolist(),
                                           r.logprobs.tolist(), r.advantages.tolist(), r.reward, r.metadata,
                                           [{k: v for k, v in t.items() if k != "latency_s"} for t in r.tool_traces]))
                for step in store.steps() for r in store.read_step(step)}


def main(new: Path, baseline: Path) -> None:
    for run in RUNS:
        trajectories = stored_trajectories(new / run)
        assert trajectories and trajectories == stored_trajectories(baseline / run), f"{run}: stored trajectories differ"
        ours, theirs = stored_records(new / run), stored_records(baseline / run)
        differ = sorted(key for key in ours.keys() | theirs.keys() if ours.get(key) != theirs.get(key))
        assert not differ, f"{run}: stored records differ at (step, sample) {differ[:5]}"
        assert_same_metrics(records(new / run), records(baseline / run))
        print(f"{run}: {len(trajectories)} stored trajectories and {len(records(new / run))} metric records identical")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
