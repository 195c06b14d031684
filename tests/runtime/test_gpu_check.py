"""`scripts/gpu_check.sh --cpu`: every GPU check's CPU counterpart runs and passes, the GPU-only
ones are listed, so that the script a GPU machine runs cannot rot between the rare GPU runs."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_cpu_mode_runs_each_counterpart_and_lists_the_gpu_only_checks():
    source = (ROOT / "scripts" / "gpu_check.py").read_text()
    declared = re.findall(r"^@check(\(cpu=True\))?\ndef (\w+)\(ctx\)", source, flags=re.MULTILINE)
    on_cpu = {name for cpu, name in declared if cpu}
    gpu_only = [name for cpu, name in declared if not cpu]
    assert {"layer_spec_log_probs_match_hf", "triton_logprob_matches_torch",
            "engine_in_its_own_process_fed_by_handles_matches_actor"} <= on_cpu
    out = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--cpu"], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    verdicts = {name: verdict for verdict, name in re.findall(r"^(PASS|FAIL|SKIP) (\w+) ", out.stdout, flags=re.MULTILINE)}
    assert verdicts == {name: "PASS" for name in on_cpu}, (out.stdout[-4000:], out.stderr[-4000:])
    summary = out.stdout.strip().splitlines()[-1]
    assert summary == f"{len(on_cpu)} passed, 0 failed, 0 skipped on CPU; GPU-only: {', '.join(gpu_only)}", summary
    assert out.returncode == 0
    # The engine in a process of its own took every bucket by handle: messages under 1% of the model.
    handles = next(line for line in out.stdout.splitlines() if line.startswith("PASS engine_in_its_own_process"))
    assert float(re.search(r"\((\d+\.\d+)%\)", handles).group(1)) < 1.0, handles
