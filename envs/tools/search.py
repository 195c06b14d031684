"""`search`: BM25 retrieval over a local corpus file (JSONL with `text` and optional `title`/`id`, or plain lines)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlfactory_megatron.envs.tools.base import BaseTool, ToolResult
from rlfactory_megatron.envs.tools.bm25 import BM25Index
from rlfactory_megatron.envs.tools.registry import register_tool


def load_corpus(path: str | Path) -> list[dict[str, str]]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"search corpus file not found: {path} (set params.corpus to a .jsonl or .txt file)")
    docs = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if path.suffix == ".jsonl":
                record = json.loads(line)
                if "text" not in record:
                    raise ValueError(f"{path}:{line_no}: a corpus record needs a 'text' field")
                docs.append({"id": str(record.get("id", len(docs))), "title": record.get("title", ""), "text": record["text"]})
            else:
                docs.append({"id": str(len(docs)), "title": "", "text": line})
    return docs


@register_tool("search")
class SearchTool(BaseTool):
    name = "search"
    description = "Search the knowledge corpus and return the most relevant passages."
    parameters = {
        "type": "object",
        "properties": {
            "query": {"type": "string", "minLength": 1},
            "top_k": {"type": "integer", "minimum": 1, "maximum": 20},
        },
        "required": ["query"],
    }

    def __init__(self, corpus: str, top_k: int = 3, max_chars_per_doc: int = 1000):
        self.docs = load_corpus(corpus)
        self.index = BM25Index([f"{d['title']} {d['text']}" for d in self.docs])
        self.top_k, self.max_chars = top_k, max_chars_per_doc

    async def execute(self, args: dict[str, Any]) -> ToolResult:
        hits = self.index.search(args["query"], args.get("top_k", self.top_k))
        if not hits:
            return ToolResult("no results", {"doc_ids": []})
        lines = []
        for rank, (doc_id, _) in enumerate(hits, 1):
            doc = self.docs[doc_id]
            title = f"{doc['title']}: " if doc["title"] else ""
            lines.append(f"[{rank}] {title}{doc['text'][: self.max_chars]}")
        return ToolResult("\n".join(lines), {"doc_ids": [self.docs[i]["id"] for i, _ in hits], "scores": [s for _, s in hits]})
