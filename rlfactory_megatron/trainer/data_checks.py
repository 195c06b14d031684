"""A run's data checked at load, before any model, engine or Ray starts (rlf-train): every prompt
rendered as the engines will get it (chat template and tool schemas) against
rollout.max_prompt_tokens, demonstrations for a warm-start, a scorer for every data_source."""
from __future__ import annotations

from rlfactory_megatron.rollout.prompts import PromptRecord
from rlfactory_megatron.trainer.data import run_records

# Characters of a prompt's last message quoted in a message naming its row.
QUOTED_CHARS = 60


def check_run_data(cfg, hf_dir: str) -> str:
    """Raises ValueError naming the first row (and the key) the run cannot use; returns one line
    on the prompts: how many, the longest, and what rollout.truncation does to those over."""
    train, val = run_records(cfg)
    if cfg.trainer.sft_steps > 0 and not any(r.demonstration for r in train):
        raise ValueError(f"trainer.sft_steps={cfg.trainer.sft_steps} needs demonstrations, and no training row has "
                         "one: give trainer.data_path rows a 'demonstration' column, or set trainer.sft_steps=0")
    _check_scorers(cfg.reward, train + val)
    return _check_prompt_lengths(cfg, hf_dir, train, val)


def row_name(record: PromptRecord) -> str:
    """Where a row is and how it starts: `<file> row 17 ("Tom has 1,200 apples...")`."""
    text = " ".join(str(record.messages[-1].get("content", "")).split())
    quoted = text[:QUOTED_CHARS] + ("..." if len(text) > QUOTED_CHARS else "")
    return f'{record.origin or "a prompt"} ("{quoted}")'


def _check_scorers(reward, records: list[PromptRecord]) -> None:
    """With reward.scorer null (and no custom function) each row's data_source picks its scorer:
    a source without one would score each of its samples 0 with an error."""
    if reward.scorer is not None or reward.custom_function_path:
        return
    from rlfactory_megatron.rewards.scorers import get_scorer

    first_of = {}
    for record in records:
        first_of.setdefault(record.data_source, record)
    for source, record in first_of.items():
        try:
            get_scorer(source)
        except KeyError as exc:
            raise ValueError(f"reward.scorer=null picks each row's scorer by its data_source, and {exc.args[0]} "
                             f"(first row with it: {record.origin})") from None


def _check_prompt_lengths(cfg, hf_dir: str, train: list[PromptRecord], val: list[PromptRecord]) -> str:
    from transformers import AutoTokenizer

    from rlfactory_megatron.envs.tool_manager import get_tool_manager

    manager = get_tool_manager(cfg.tools.format, AutoTokenizer.from_pretrained(hf_dir))
    schemas = _tool_schemas(cfg) if cfg.tools.enable else None
    records = train + val
    lengths = [len(manager.render_prompt(r.messages, schemas)) for r in records]
    limit, truncation = cfg.rollout.max_prompt_tokens, cfg.rollout.truncation
    over = [i for i, length in enumerate(lengths) if length > limit]
    rendered = "chat template and tool schemas" if schemas else "chat template"
    if over and truncation == "error":
        first = over[0]
        others = (f"; {len(over)} of the run's {len(records)} prompts are over, the longest {max(lengths)} tokens"
                  if len(over) > 1 else "")
        raise ValueError(f"{row_name(records[first])}: its prompt is {lengths[first]} tokens ({rendered}), over "
                         f"rollout.max_prompt_tokens={limit}{others}; raise rollout.max_prompt_tokens, leave such rows "
                         "out, or set rollout.truncation=left (cuts a prompt's first tokens) or right (its last)")
    line = (f"{len(train)} training and {len(val)} validation prompts, the longest {max(lengths, default=0)} tokens "
            f"({rendered}; rollout.max_prompt_tokens={limit})")
    if over:
        kept = "last" if truncation == "left" else "first"
        line += f"; {len(over)} longer ones keep their {kept} {limit} tokens (rollout.truncation={truncation})"
    return line


def _tool_schemas(cfg) -> list[dict]:
    """The schemas of the run's tools, built here as a tool actor builds them: a tool that cannot
    start (a python sandbox without bubblewrap, an MCP server that does not answer) is named now."""
    from rlfactory_megatron.envs.tools.toolbox import tool_schemas
    from rlfactory_megatron.trainer.tasks import run_tool_specs

    try:
        return tool_schemas(run_tool_specs(cfg))
    except Exception as exc:  # whatever a tool's constructor raises, as one line naming where it is declared
        where = (f"tools.config_path={cfg.tools.config_path}" if cfg.tools.config_path
                 else f"trainer.task={cfg.trainer.task}")
        raise ValueError(f"{where}: a tool does not start: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
