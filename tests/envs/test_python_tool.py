"""The python tool's sandbox: scratch dir, CPU/wall/memory/process/output limits, scrubbed env, no network."""
import asyncio
import os
import socket
import time

import pytest

from rlfactory_megatron.envs.tools.python_sandbox import PythonTool, sandbox_support


def run(code, **limits):
    return asyncio.run(PythonTool(**limits).run({"code": code}))


def test_runs_code_in_a_fresh_scratch_dir_removed_afterwards():
    code = "import os\nopen('out.txt', 'w').write('x')\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))"
    first, second = run(code), run(code)
    cwd = first.text.splitlines()[0]
    assert not first.is_error and first.metadata["scratch_dir"] == cwd
    assert first.text.splitlines()[1] == "['main.py', 'out.txt']"  # nothing left from other runs
    assert second.text.splitlines()[0] != cwd
    assert not os.path.exists(cwd) and not os.path.exists(second.metadata["scratch_dir"])


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
