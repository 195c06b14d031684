"""The commands of README.md and docs/*.md marked as running on CPU: fenced blocks whose info
string is `bash cpu` (run by tests/docs/test_docs.py) or `bash cpu=<tag>` (run by the test that
asks for that tag through `docs_block`)."""
from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from console_scripts import BIN

ROOT = Path(__file__).parents[2]
_FENCE = re.compile(r"^```bash cpu(?:=(?P<tag>[\w-]+))?\n(?P<body>.*?)^```$", re.S | re.M)


@dataclass(frozen=True)
class Block:
    file: str
    line: int
    tag: str | None
    body: str


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def cpu_blocks() -> list[Block]:
    blocks = []
    for path in documents():
        text = path.read_text()
        for match in _FENCE.finditer(text):
            blocks.append(Block(str(path.relative_to(ROOT)), text.count("\n", 0, match.start()) + 1,
                                match.group("tag"), match.group("body")))
    return blocks


def docs_block(tag: str) -> Block:
    found = [b for b in cpu_blocks() if b.tag == tag]
    assert len(found) == 1, f"expected one block marked bash cpu={tag}, found {len(found)}"
    return found[0]


def workdir(tmp_path: Path) -> Path:
    """A folder that looks like the checkout (its top-level entries linked), so documented
    commands run as typed from the repository root but write their outputs/ elsewhere."""
    work = tmp_path / "checkout"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in ("outputs", ".git"):
            (work / entry.name).symlink_to(entry)
    (work / "outputs").mkdir()
    return work


def run_block(block: Block, work: Path, env: dict[str, str], timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", block.body], cwd=work, env=env, capture_output=True,
                          text=True, timeout=timeout)


def block_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, RLF_CACHE_HOME=str(tmp_path.parent / "rlf-cache"), OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "RAY_ADDRESS", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env
