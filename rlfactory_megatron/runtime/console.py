"""The console is ours: while a rank runs, library start-up chatter (megatron's, vLLM's, Ray's,
transformers', their child processes' and C libraries') goes to a log file under the run's
output folder, and the terminal shows our own lines: what runs where, progress, where outputs
went. `--verbose` or RLF_VERBOSE=1 leaves the libraries' output on the console."""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

VERBOSE_ENV = "RLF_VERBOSE"


def verbose_requested() -> bool:
    return os.environ.get(VERBOSE_ENV, "").lower() not in ("", "0", "false", "no")


@contextlib.contextmanager
def library_output_to(log_path: Path, enabled: bool = True):
    """Within the block, file descriptors 1 and 2 (and so every library, child process and C
    extension writing to them) go to `log_path`; `sys.stdout` stays the terminal for our own
    lines. Python logging goes to the file too, at INFO and above. Restored on exit."""
    if not enabled:
        yield
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = os.dup(1), os.dup(2)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    console = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    previous_stdout, previous_stderr = sys.stdout, sys.stderr
    # vLLM would attach its own handler to whatever sys.stdout is when it is imported (ours):
    # left unconfigured, its records reach the root logger and so the file.
    previous_vllm = os.environ.get("VLLM_CONFIGURE_LOGGING")
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
    root = logging.getLogger()
    handler = logging.StreamHandler(os.fdopen(os.dup(log_fd), "w", buffering=1))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    previous_level = root.level
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    sys.stdout = console
    sys.stderr = sys.__stderr__  # fd 2, the log: not a copy of our own lines (console_copied_to)
    root.addHandler(handler)
    root.setLevel(min(previous_level or logging.INFO, logging.INFO))
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        root.removeHandler(handler)
        root.setLevel(previous_level)
        handler.close()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        sys.stdout, sys.stderr = previous_stdout, previous_stderr
        console.close()
        for fd in (*saved, log_fd):
            os.close(fd)
        if previous_vllm is None:
            os.environ.pop("VLLM_CONFIGURE_LOGGING", None)
        else:
            os.environ["VLLM_CONFIGURE_LOGGING"] = previous_vllm


class _Copied:
    """A text stream whose writes also go to a file (the run's console.log)."""

    def __init__(self, stream, file, path: Path) -> None:
        self.stream, self.file, self.path = stream, file, path

    def write(self, text: str) -> int:
        self.file.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.file.flush()
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def console_copied_to(path: Path, enabled: bool = True):
    """Within the block our own console lines (sys.stdout and sys.stderr) are also appended to
    `path`, so a run's own account of itself outlives the terminal. A rank running in the
    process that already copies to `path` copies once."""
    copied = [getattr(stream, "path", None) == path for stream in (sys.stdout, sys.stderr)]
    if not enabled or all(copied):
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    saved = sys.stdout, sys.stderr
    with open(path, "a", buffering=1) as file:
        sys.stdout, sys.stderr = (stream if done else _Copied(stream, file, path) for stream, done in zip(saved, copied))
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = saved
