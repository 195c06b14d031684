"""`rlf-bench sweep`: a grid from YAML or the command line runs one process per point and
leaves one JSON per point with its environment, a table and the curves."""
import json
import subprocess
import sys

CLI = [sys.executable, "-m", "rlfactory_megatron.cli.bench"]
SMALL_LOGPROB = ["--vocab", "512", "--hidden", "32"]


def test_sweep_over_two_suites_records_each_point_its_environment_a_table_and_a_curve(tmp_path):
    plan = tmp_path / "sweep.yaml"
    # The tool pool at a tiny size, its throughput target off: a busy test machine must not fail it.
    tools = ["--rounds", "2", "--latency-ms", "5", "--actors", "1", "--target", "0"]
    plan.write_text(f"out: {tmp_path / 'out'}\npoints:\n"
                    f"  - suite: logprob\n    args: {json.dumps(SMALL_LOGPROB)}\n    grid: {{tokens: [64, 256]}}\n"
                    f"  - suite: tools\n    args: {json.dumps(tools)}\n    grid: {{calls: [8]}}\n")
    done = subprocess.run([*CLI, "sweep", "--config", str(plan)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "point 1/3: logprob --tokens=64" in done.stdout and "point 2/3: logprob --tokens=256, ETA" in done.stdout
    points = sorted((tmp_path / "out" / "points").glob("*.json"))
    assert [p.name for p in points] == ["000-logprob.json", "001-logprob.json", "002-tools.json"]
    pool = json.loads(points[2].read_text())
    assert pool["params"] == {"--calls": "8"} and pool["figures"]["pool"] > 0 and pool["figures"]["ideal"] > 0
    first = json.loads(points[0].read_text())
    assert first["params"] == {"--tokens": "64"} and first["returncode"] == 0
    assert first["command"] == "rlf-bench logprob --vocab 512 --hidden 32 --tokens 64"
    assert first["figures"][0]["T"] == 64 and first["figures"][0]["naive"]["time_s"] > 0
    env = first["environment"]
    assert env["packages"]["torch"] and env["devices"]["cpus"] >= 1 and len(env["git"]["commit"]) == 40
    table = (tmp_path / "out" / "sweep.md").read_text()
    assert "| 0 | logprob | --tokens=64 | ok |" in table and "| 1 | logprob | --tokens=256 | ok |" in table
    assert "| 2 | tools | --calls=8 | ok |" in table
    assert (tmp_path / "out" / "logprob.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_from_the_command_line_and_a_failing_point(tmp_path):
    done = subprocess.run([*CLI, "sweep", "logprob", "--grid", "tokens=64,0", "--out", str(tmp_path), "--",
                           *SMALL_LOGPROB], capture_output=True, text=True, timeout=600)
    assert done.returncode == 1  # one point failed: the sweep says so, and keeps the others
    table = (tmp_path / "sweep.md").read_text()
    assert "| 0 | logprob | --tokens=64 | ok |" in table and "| 1 | logprob | --tokens=0 | exit " in table
    failed = json.loads((tmp_path / "points" / "001-logprob.json").read_text())
    assert failed["returncode"] != 0 and failed["output_tail"]


def test_sweep_refuses_what_it_cannot_run(tmp_path):
    done = subprocess.run([*CLI, "sweep", "cache", "--grid", "records=8", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "cannot sweep cache; choose among actor, weight-sync" in done.stderr
