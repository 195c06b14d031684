"""`python`: run model-written code in a limited child process: a filesystem sandbox (bubblewrap:
the interpreter and standard library read-only, a size-capped scratch cwd and a private /tmp, nothing
else of the host), CPU, memory, processes, output, wall time, scrubbed env, no network."""
from __future__ import annotations

import asyncio
import functools
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from rlfactory_megatron.envs.tools.base import BaseTool, ToolResult
from rlfactory_megatron.envs.tools.registry import register_tool

_SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
_SCRATCH = "/scratch"  # the program's cwd inside the filesystem sandbox
_OUTPUT_MARKER = "\n...[output truncated at {limit} bytes]"


@dataclass(frozen=True)
class SandboxSupport:
    """What this host lets us enforce. `namespaces`: `unshare` can give the child its own network
    (none) and PID namespace (whose death takes every descendant with it). `drop_privileges`: we
    are root and can run the child as an unused uid, the only way RLIMIT_NPROC binds (the kernel
    exempts root from it)."""

    namespaces: bool
    drop_privileges: bool
    filesystem: str | None  # why bubblewrap cannot hide the host's files here, or None when it can

    @property
    def bwrap(self) -> str | None:
        return shutil.which("bwrap") if self.filesystem is None else None


@functools.lru_cache(maxsize=1)
def sandbox_support() -> SandboxSupport:
    unshare = shutil.which("unshare")
    namespaces = False
    if unshare:
        probe = subprocess.run([unshare, "--net", "--pid", "--fork", "--kill-child", "true"], capture_output=True)
        namespaces = probe.returncode == 0
    drop = os.geteuid() == 0 and shutil.which("setpriv") is not None
    return SandboxSupport(namespaces=namespaces, drop_privileges=drop, filesystem=_probe_bwrap(drop))


def _probe_bwrap(drop_privileges: bool) -> str | None:
    """None when bubblewrap runs a program here as the sandbox will (as an unused uid when we are
    root), else what is missing."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap (`bwrap`) is not installed: apt-get install bubblewrap (./install.sh does)"
    cmd = [bwrap, *_BWRAP_BASE, *_SYSTEM_MOUNTS, "/usr/bin/true"]
    if drop_privileges:
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--no-new-privs", "--", *cmd]
    probe = subprocess.run(cmd, capture_output=True, text=True)
    if probe.returncode != 0:
        return f"bubblewrap cannot create its namespaces here ({probe.stderr.strip()[:200]})"
    return None


# Every namespace bubblewrap can make (network, PIDs, IPC, UTS, users, cgroups), killed with its
# parent, its own terminal session (no keystrokes injected into ours).
_BWRAP_BASE = ("--unshare-all", "--die-with-parent", "--new-session")
# The host's /usr read-only (interpreter, standard library, shared libraries), with the merged-/usr links.
_SYSTEM_MOUNTS = ("--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
                  "--symlink", "usr/lib64", "/lib64")


class SandboxUnavailableError(ValueError):
    """The python tool cannot hide the host's files here and was not allowed to run without."""


def _usable_by_others(path: str) -> bool:
    """True when a non-root uid can execute `path` (every parent directory searchable)."""
    real = os.path.realpath(path)
    if not os.stat(real).st_mode & stat.S_IXOTH:
        return False
    parent = os.path.dirname(real)
    while parent != "/":
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(parent)
    return True


@register_tool("python")
class PythonTool(BaseTool):
    name = "python"
    cacheable = False  # programs may read the clock, draw random numbers or time out by load
    description = "Run a Python 3 program and return what it prints (stdout and stderr). No network access."
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "a complete Python program; use print() for output"}},
        "required": ["code"],
    }

    def __init__(
        self,
        cpu_time_s: int = 5,
        wall_timeout_s: float = 10.0,
        memory_mb: int = 512,
        max_processes: int = 16,
        max_output_bytes: int = 64 * 1024,
        max_file_mb: int = 16,
        isolate_network: bool = True,
        interpreter: str | None = None,
        sandbox_uid_base: int = 200_000,
        sandbox_uid_count: int = 1 << 20,
        scratch_mb: int = 64,
        allow_unsandboxed: bool = False,
    ):
        self.cpu_time_s, self.wall_timeout_s = cpu_time_s, wall_timeout_s
        self.memory_bytes, self.max_processes = memory_mb << 20, max_processes
        self.max_output_bytes, self.max_file_bytes = max_output_bytes, max_file_mb << 20
        self.scratch_bytes = scratch_mb << 20
        self.support = sandbox_support()
        self.bwrap = self.support.bwrap
        if self.bwrap is None and not allow_unsandboxed:
            raise SandboxUnavailableError(
                f"python tool: programs would see the host's files (datasets, checkpoints, source): "
                f"{self.support.filesystem}; or set `allow_unsandboxed: true` in the tool's params")
        # bubblewrap makes its own network namespace; without it `unshare` does, where permitted.
        self.isolate = isolate_network and (self.bwrap is not None or self.support.namespaces)
        self.interpreter = interpreter or self._default_interpreter()
        if self.bwrap is not None and not os.path.realpath(self.interpreter).startswith("/usr/"):
            raise ValueError(f"python tool: interpreter {self.interpreter} is outside /usr, the only host folder "
                             "the sandbox shows; use the system python3")
        # Inside a user namespace only mapped uids work: shrink the range to fit the map there.
        self.sandbox_uid_base, self.sandbox_uid_count = sandbox_uid_base, sandbox_uid_count

    def _default_interpreter(self) -> str:
        inside_usr = os.path.realpath(sys.executable).startswith("/usr/")
        if (self.bwrap is None or inside_usr) and (not self.support.drop_privileges or _usable_by_others(sys.executable)):
            return sys.executable
        # Our interpreter may live under a private home (/root): fall back to the system one.
        system = shutil.which("python3", path=_SYSTEM_PATH)
        if system is None:
            raise ValueError("python tool: no python3 a sandbox uid can run; set params.interpreter")
        return system

    def isolation(self) -> dict[str, bool]:
        return {
            "filesystem": self.bwrap is not None,
            "network": self.isolate,
            "pid_namespace": self.isolate or self.bwrap is not None,
            "process_limit": self.support.drop_privileges,
        }

    def _command(self, uid: int, scratch: str) -> list[str]:
        # Soft CPU limit first, so the program dies of SIGXCPU (nameable) before the hard SIGKILL.
        limits = [f"--cpu={self.cpu_time_s}:{self.cpu_time_s + 1}", f"--as={self.memory_bytes}", f"--fsize={self.max_file_bytes}", "--core=0"]
        if self.support.drop_privileges:
            limits.append(f"--nproc={self.max_processes}")
        # Without bubblewrap, `unshare` makes the namespaces, as root, before privileges are dropped.
        cmd = ["unshare", "--net", "--pid", "--fork", "--kill-child"] if self.isolate and self.bwrap is None else []
        cmd += ["prlimit", *limits, "--"]
        if self.support.drop_privileges:
            cmd += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs", "--"]
        if self.bwrap is not None:  # as the unprivileged uid, in a user namespace of its own
            cmd += self._bwrap_args(scratch)
        # A shell in between reports a signal death as exit status 128+N: util-linux `unshare --fork`
        # turns it into a bare 1, and as PID 1 of the namespace the shell also reaps orphans.
        return cmd + ["/bin/sh", "-c", '"$@"; exit $?', "sh", self.interpreter, "-I", "-B", "main.py"]

    def _bwrap_args(self, scratch: str) -> list[str]:
        """The program's whole filesystem: /usr read-only (interpreter, standard library), its own
        size-capped scratch (cwd, holding main.py read-only) and /tmp, fresh /proc and /dev."""
        size = str(self.scratch_bytes)
        net = [] if self.isolate else ["--share-net"]
        return [self.bwrap, *_BWRAP_BASE, *net, *_SYSTEM_MOUNTS, "--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/tmp",
                "--size", size, "--tmpfs", _SCRATCH, "--ro-bind", os.path.join(scratch, "main.py"),
                f"{_SCRATCH}/main.py", "--remount-ro", "/", "--chdir", _SCRATCH, "--"]

    async def execute(self, args: dict[str, Any]) -> ToolResult:
        # A fresh uid per run gives each run its own process budget (RLIMIT_NPROC counts per uid).
        uid = self.sandbox_uid_base + secrets.randbelow(self.sandbox_uid_count)
        scratch = tempfile.mkdtemp(prefix="rlf-python-")
        try:
            with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as f:
                f.write(args["code"])
            if self.support.drop_privileges:
                os.chown(scratch, uid, uid)
                os.chown(os.path.join(scratch, "main.py"), uid, uid)
            output, exit_code, timed_out, truncated = await self._run(self._command(uid, scratch), scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        text = output.decode("utf-8", errors="replace")
        if truncated:
            text += _OUTPUT_MARKER.format(limit=self.max_output_bytes)
        if timed_out:
            text += f"\n[killed: wall-clock limit of {self.wall_timeout_s:g}s reached]"
        elif exit_code > 128 and not truncated:
            text += f"\n[killed by {_signal_name(exit_code - 128)}{_LIMIT_HINTS.get(exit_code - 128, '')}]"
        metadata = {"exit_code": exit_code, "timed_out": timed_out, "truncated": truncated, "scratch_dir": scratch,
                    "isolation": self.isolation()}
        return ToolResult(text, metadata, is_error=timed_out or (exit_code != 0 and not truncated))

    def _env(self, scratch: str) -> dict[str, str]:
        # Scrubbed: nothing of the trainer's environment (tokens, paths, RAY_*) reaches the code.
        threads = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
        home = _SCRATCH if self.bwrap is not None else scratch
        return {"PATH": _SYSTEM_PATH, "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", **threads}

    async def _run(self, cmd: list[str], scratch: str) -> tuple[bytes, int, bool, bool]:
        proc = await asyncio.create_subprocess_exec(
            *cmd, cwd=scratch, env=self._env(scratch), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )
        output = bytearray()  # outside the reader, so a timeout keeps what was printed so far
        timed_out = truncated = False
        try:
            truncated = await asyncio.wait_for(self._read_capped(proc, output), self.wall_timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
        finally:
            _kill_group(proc.pid)  # also reaps stragglers the program left behind
            await _discard_rest(proc)
            exit_code = await proc.wait()
        return bytes(output), exit_code, timed_out, truncated

    async def _read_capped(self, proc: asyncio.subprocess.Process, output: bytearray) -> bool:
        """Read the program's output into `output`; past the cap, kill it and return True."""
        while chunk := await proc.stdout.read(65536):
            room = self.max_output_bytes - len(output)
            output += chunk[:room]
            if len(chunk) > room:
                _kill_group(proc.pid)
                return True
        return False


_LIMIT_HINTS = {signal.SIGXCPU: ": CPU time limit reached", signal.SIGKILL: ": a resource limit was reached"}


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


async def _discard_rest(proc: asyncio.subprocess.Process, grace_s: float = 5.0) -> None:
    """Read the killed program's pipe to EOF. `proc.wait()` returns only once the pipe is closed,
    and after a truncation the reader stopped with a full buffer, which pauses the pipe: without
    this, `wait()` can hang forever (it did on a slower machine). A descendant that escaped the
    kill may hold the pipe open: after `grace_s` we close our end instead."""
    async def drain() -> None:
        while await proc.stdout.read(1 << 20):
            pass

    try:
        await asyncio.wait_for(drain(), grace_s)
    except asyncio.TimeoutError:
        proc._transport.close()  # no public API closes a Process's pipes; stable since Python 3.4


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
