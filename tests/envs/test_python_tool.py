"""The python tool's sandbox: a filesystem that hides the host (bubblewrap), scratch dir, CPU/wall/
memory/process/output limits, scrubbed env, no network; one test per escape attempt."""
import asyncio
import os
import socket
import time

import pytest

from rlfactory_megatron.envs.tools.python_sandbox import PythonTool, sandbox_support

# Bounds on wall time: run alone, after the parallel part of the suite (scripts/test.sh).
pytestmark = pytest.mark.serial


def run(code, **limits):
    return asyncio.run(PythonTool(**limits).run({"code": code}))


def test_runs_code_in_a_fresh_scratch_dir_removed_afterwards():
    code = "import os\nopen('out.txt', 'w').write('x')\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))"
    first, second = run(code), run(code)
    assert not first.is_error and first.text.splitlines()[0] == "/scratch"
    assert first.text.splitlines()[1] == second.text.splitlines()[1] == "['main.py', 'out.txt']"  # nothing left from other runs
    assert first.metadata["scratch_dir"] != second.metadata["scratch_dir"]
    assert not os.path.exists(first.metadata["scratch_dir"]) and not os.path.exists(second.metadata["scratch_dir"])
    assert first.metadata["isolation"] == {"filesystem": True, "network": True, "pid_namespace": True,
                                           "process_limit": sandbox_support().drop_privileges}


def test_cannot_read_a_world_readable_file_outside_its_scratch(tmp_path):
    # As a training set is written: default umask, 0644, ground truth included.
    secret = tmp_path / "data" / "train.jsonl"
    secret.parent.mkdir()
    secret.write_text('{"prompt": "2+2", "ground_truth": "4"}\n')
    secret.chmod(0o644)
    for folder in [p for p in secret.parents if str(p) != "/"]:
        folder.chmod(folder.stat().st_mode | 0o005)  # searchable by anyone: only the sandbox stands in the way
    result = run(f"print(open({str(secret)!r}).read())")
    assert result.is_error and "FileNotFoundError" in result.text and "ground_truth" not in result.text


def test_cannot_read_the_package_source_or_the_hosts_config():
    import rlfactory_megatron

    source = rlfactory_megatron.__file__
    code = ("import os\n"
            f"for path in [{source!r}, '/etc/passwd', '/root', '/work', '/home']:\n"
            "    print(path, os.path.exists(path))\n")
    result = run(code)
    assert not result.is_error, result.text
    assert all(line.endswith(" False") for line in result.text.splitlines()), result.text


def test_cannot_write_outside_its_scratch(tmp_path):
    target = tmp_path / "planted.txt"
    code = ("import os\n"
            f"for path in [{str(target)!r}, '/usr/planted.txt', '/planted.txt']:\n"
            "    try:\n"
            "        open(path, 'w').write('x')\n"
            "        print(path, 'written')\n"
            "    except OSError as exc:\n"
            "        print(path, 'refused', type(exc).__name__)\n"
            "open('/tmp/own.txt', 'w').write('x')\n"  # its private /tmp works, and is not the host's
            "print('tmp', os.listdir('/tmp'))\n")
    result = run(code)
    lines = result.text.splitlines()
    assert all(" refused " in line for line in lines[:3]), result.text
    assert lines[3] == "tmp ['own.txt']"
    assert not target.exists() and not os.path.exists("/usr/planted.txt") and not os.path.exists("/tmp/own.txt")


def test_scratch_is_size_capped():
    code = ("try:\n"
            "    with open('big.bin', 'wb') as f:\n"
            "        for _ in range(64):\n"
            "            f.write(b'x' * (1 << 20))\n"
            "    print('wrote all')\n"
            "except OSError as exc:\n"
            "    print('stopped', exc.errno)\n")
    result = run(code, scratch_mb=8, max_file_mb=1024)
    assert result.text.startswith("stopped 28"), result.text  # ENOSPC


def test_refuses_to_run_unsandboxed_unless_allowed(monkeypatch):
    # The host lacking bubblewrap is simulated (it is installed here): the tool must not fall back silently.
    from rlfactory_megatron.envs.tools import python_sandbox

    real = python_sandbox.sandbox_support()
    missing = python_sandbox.SandboxSupport(real.namespaces, real.drop_privileges, "bubblewrap (`bwrap`) is not installed")
    monkeypatch.setattr(python_sandbox, "sandbox_support", lambda: missing)
    with pytest.raises(python_sandbox.SandboxUnavailableError, match="bwrap.*allow_unsandboxed: true"):
        PythonTool()
    result = asyncio.run(PythonTool(allow_unsandboxed=True).run({"code": "import os\nprint(os.path.exists('/etc'))"}))
    assert result.text.strip() == "True" and result.metadata["isolation"]["filesystem"] is False


def test_errors_are_reported_with_output():
    result = run("print('before')\nraise ValueError('bad input')")
    assert result.is_error and result.metadata["exit_code"] == 1
    assert "before" in result.text and "ValueError: bad input" in result.text


def test_killed_at_cpu_time_limit():
    start = time.monotonic()
    result = run("while True:\n    pass", cpu_time_s=1, wall_timeout_s=20)
    assert time.monotonic() - start < 10
    assert result.is_error and not result.metadata["timed_out"] and "CPU time limit" in result.text


def test_killed_at_wall_clock_timeout():
    start = time.monotonic()
    result = run("import time\nprint('sleeping', flush=True)\ntime.sleep(60)", wall_timeout_s=1.0)
    assert time.monotonic() - start < 5
    assert result.is_error and result.metadata["timed_out"] and "wall-clock" in result.text and "sleeping" in result.text


def test_cannot_grow_past_memory_limit():
    grow = "chunks = []\nfor _ in range({n}):\n    chunks.append(bytearray(16 << 20))\nprint('grew', len(chunks) * 16, 'MB')"
    assert run(grow.format(n=4), memory_mb=256).text.strip() == "grew 64 MB"
    result = run(grow.format(n=40), memory_mb=256)  # 640 MB
    assert result.is_error and "MemoryError" in result.text and "grew" not in result.text


@pytest.mark.skipif(not sandbox_support().drop_privileges, reason="process limit needs root (to run the child as an unused uid)")
def test_cannot_fork_bomb():
    # A bounded fork loop: at most 60 children that exit on their own after 2 s.
    code = (
        "import os, time\n"
        "made = 0\n"
        "for _ in range(60):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(2)\n"
        "        os._exit(0)\n"
        "    made += 1\n"
        "print('children', made)\n"
    )
    limited = run(code, max_processes=8)
    assert int(limited.text.split()[-1]) < 8
    assert int(run(code, max_processes=100).text.split()[-1]) == 60  # the limit, not the loop, stopped it


def test_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("RLF_TEST_SECRET", "hunter2")
    result = run("import os\nprint(sorted(os.environ))\nprint(os.environ.get('RLF_TEST_SECRET'))")
    assert "hunter2" not in result.text and "RAY_ADDRESS" not in result.text
    assert result.text.splitlines()[-1] == "None"


@pytest.mark.parametrize("pipe_kb", [None, 1024])
def test_output_is_capped(pipe_kb):
    # A 1 MB pipe lets one read take 256 KB, past the reader's buffer limit, which pauses the pipe
    # (on slow machines this happens by chance): the run must still end.
    code = "import sys\n"
    if pipe_kb:
        code += f"import fcntl\nfcntl.fcntl(1, 1031, {pipe_kb} << 10)  # F_SETPIPE_SZ\n"
    code += "sys.stdout.write('y' * (1 << 20))\nsys.stdout.flush()"
    start = time.monotonic()
    result = run(code, max_output_bytes=1000, memory_mb=1024, wall_timeout_s=20)
    assert time.monotonic() - start < 15
    assert result.metadata["truncated"] and not result.metadata["timed_out"]
    assert "output truncated at 1000 bytes" in result.text and len(result.text) < 1200


@pytest.mark.skipif(not sandbox_support().namespaces, reason="`unshare --net` is not permitted on this host")
def test_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    code = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "    print('connected')\n"
        "except OSError as exc:\n"
        "    print('blocked', exc)\n"
    )
    try:
        isolated = run(code)
        assert isolated.text.startswith("blocked") and isolated.metadata["isolation"]["network"]
        open_net = run(code, isolate_network=False)  # control: the same code does reach the host
        assert open_net.text.strip() == "connected"
    finally:
        server.close()


def test_the_isolation_in_force_is_reported_at_start_up(capsys):
    from rlfactory_megatron.envs.tools.registry import ToolSpec
    from rlfactory_megatron.rollout.generator import _report_sandboxes

    _report_sandboxes([ToolSpec("calculator"), ToolSpec("python", {"isolate_network": False})])
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["rlf-train: tool 'python' runs programs isolated by: filesystem, pid_namespace, process_limit "
                     "(not: network)"] or not sandbox_support().drop_privileges
