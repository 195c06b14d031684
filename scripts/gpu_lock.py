"""The GPU stack's lock, requirements/gpu.lock: every package requirements/gpu.txt needs, at the
version pip resolves for Linux x86_64 and CPython 3.12 (the Dockerfile's) from PyPI's wheels.

    .venv/bin/python scripts/gpu_lock.py write   # resolve afresh and write the lock
    .venv/bin/python scripts/gpu_lock.py check   # resolve with the lock as constraints: exit 1 unless
                                                 # pip arrives at exactly the lock

pip's own resolver does the work (`pip install --dry-run --report` for the target platform, which
reads wheel metadata from the index without downloading the wheels). Transformer-Engine's PyTorch
extension is not in the lock: it is a source distribution that install.sh builds against the
installed torch, at the version of `transformer-engine` in the lock.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "requirements" / "gpu.txt"
LOCK = ROOT / "requirements" / "gpu.lock"
PYTHON_VERSION = "3.12"
# Every manylinux tag a current x86_64 distribution accepts (pip matches tags exactly).
PLATFORMS = ["manylinux2014_x86_64", "linux_x86_64", *(f"manylinux_2_{n}_x86_64" for n in range(17, 40))]
HEADER = f"""# The GPU stack, exact: what pip resolves for requirements/gpu.txt on Linux x86_64, CPython {PYTHON_VERSION}.
# Written by `.venv/bin/python scripts/gpu_lock.py write`; ./install.sh --gpu installs exactly these
# (--no-deps), then builds transformer-engine-torch at transformer-engine's version.
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve(constraints: Path | None = None) -> dict[str, str]:
    """{package: version} of pip's resolution of requirements/gpu.txt for the target platform."""
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", "-", "--python-version", PYTHON_VERSION, "--implementation", "cp",
               "--only-binary=:all:", *(f"--platform={p}" for p in PLATFORMS), "-r", str(REQUIREMENTS)]
    if constraints is not None:
        command += ["-c", str(constraints)]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        problems = [line for line in run.stderr.splitlines() if line.startswith("ERROR")]
        raise SystemExit(f"gpu_lock: pip could not resolve {REQUIREMENTS.name}: {' '.join(problems) or run.stderr[-2000:]}")
    report = json.loads(run.stdout)
    return {canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in report["install"]}


def read_lock(path: Path = LOCK) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonical(name)] = version
    return pins


def write(path: Path = LOCK) -> None:
    pins = resolve()
    path.write_text(HEADER + "".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
    print(f"gpu_lock: {len(pins)} packages -> {path}")


def differences(resolved: dict[str, str], locked: dict[str, str]) -> list[str]:
    return ([f"{n}: lock {locked[n]}, resolved {resolved[n]}" for n in sorted(set(locked) & set(resolved))
             if locked[n] != resolved[n]]
            + [f"{n}=={resolved[n]} resolved, not in the lock" for n in sorted(set(resolved) - set(locked))]
            + [f"{n}=={locked[n]} in the lock, not needed" for n in sorted(set(locked) - set(resolved))])


def check(path: Path = LOCK) -> None:
    problems = differences(resolve(path), read_lock(path))
    if problems:
        raise SystemExit("gpu_lock: requirements/gpu.lock is not what pip resolves; rerun `scripts/gpu_lock.py "
                         "write`: " + "; ".join(problems))
    print(f"gpu_lock: {path.name} is exactly pip's resolution of {REQUIREMENTS.name} ({len(read_lock(path))} packages)")


if __name__ == "__main__":
    if sys.argv[1:] not in (["write"], ["check"]):
        raise SystemExit("usage: scripts/gpu_lock.py write|check")
    {"write": write, "check": check}[sys.argv[1]]()
