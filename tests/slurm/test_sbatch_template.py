"""slurm/train.sbatch's steps as it assembles them, without a cluster: `srun` and `scontrol` are
stand-ins on PATH that record each call (pyxis, which takes --container-image, is not installed on
the test cluster). The real template runs on the real test cluster in test_sbatch.py."""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[2]

RECORDING_SRUN = """#!/usr/bin/env bash
printf '%s\\n' "$*" >> "$SRUN_CALLS"
"""
SCONTROL = """#!/usr/bin/env bash
printf 'n1\\nn2\\n'
"""


def run_template(tmp_path, **env) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", RECORDING_SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "srun_calls"
    base = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SRUN_CALLS": str(calls), "SLURM_JOB_ID": "7",
            "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "8",
            "SLURM_SUBMIT_DIR": str(ROOT)}
    run = subprocess.run(["bash", str(ROOT / "slurm" / "train.sbatch"), "--config", "run.yaml"], env={**base, **env},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return calls.read_text().splitlines()


def test_every_step_runs_in_the_container_image_when_one_is_given(tmp_path):
    calls = run_template(tmp_path, RLF_CONTAINER_IMAGE="/images/rlf.sqsh", RLF_CONTAINER_MOUNTS="/models:/models")
    # The steps that finish before the script does (Ray's head and workers are background steps,
    # which the script stops at its end, possibly before the stand-in recorded them).
    steps = [c for c in calls if "torchrun" in c or "ray status" in c]
    assert len(steps) >= 2, calls
    for step in steps:
        assert ("--container-image=/images/rlf.sqsh --container-workdir=/opt/rlfactory-megatron "
                "--container-mounts=/models:/models") in step, step
        assert "/opt/rlfactory-megatron/.venv/bin/" in step, step


def test_without_an_image_the_steps_use_the_venv_on_the_host(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "ray").write_text("#!/usr/bin/env bash\n")  # `ray status` answers: the head is up
    (venv / "bin" / "ray").chmod(0o755)
    calls = run_template(tmp_path, RLF_VENV=str(venv))
    assert calls and not any("--container" in c for c in calls)
    assert any(f"{venv}/bin/torchrun" in c for c in calls)


def test_every_srun_of_the_template_takes_the_container_arguments():
    template = (ROOT / "slurm" / "train.sbatch").read_text()
    commands = template.replace("\\\n", " ").splitlines()  # continued lines joined
    sruns = [line for line in commands if not line.lstrip().startswith("#") and
             (line.lstrip().startswith("srun ") or " srun " in line)]
    assert len(sruns) == 4, sruns  # Ray's head, its status check, the workers, torchrun
    assert all('"${container[@]}"' in line for line in sruns), sruns
