"""Compare two directories of scripts/refactor_baselines.sh runs: every run's stored trajectories
and metrics.jsonl must be equal bit for bit, timings apart (tests/trainer/rlf_train_cli.py's rules)."""
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "tests" / folder) for folder in ("common", "trainer")]
from rlf_train_cli import assert_same_metrics, records, stored_trajectories  # noqa: E402

RUNS = ("default", "colocated_dp2", "disaggregated")


def main(new: Path, baseline: Path) -> None:
    for run in RUNS:
        trajectories = stored_trajectories(new / run)
        assert trajectories and trajectories == stored_trajectories(baseline / run), f"{run}: stored trajectories differ"
        assert_same_metrics(records(new / run), records(baseline / run))
        print(f"{run}: {len(trajectories)} stored trajectories and {len(records(new / run))} metric records identical")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
