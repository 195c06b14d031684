"""Prompts as the engines get them: rollout.truncation on token ids (the rollout and the SFT
warm-start cut alike), and the load-time check that names a prompt over rollout.max_prompt_tokens."""
import json
import os
import re
from pathlib import Path

import pytest

from rlfactory_megatron.config import load_config
from rlfactory_megatron.rollout.prompts import fit_prompt
from rlfactory_megatron.trainer.data import run_records
from rlfactory_megatron.trainer.data_checks import check_run_data


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    """The embedded default's model and tokenizer (chat template, tool-call format), built in the
    session's model cache, as rlf-train's runs in the suite build it."""
    from rlfactory_megatron.trainer.model_path import resolve_model_path

    os.environ.setdefault("RLF_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "rlf-cache"))
    return str(resolve_model_path("tiny://qwen3"))


def _rendered(hf_dir: str):
    """The embedded default's first training prompt, rendered with its tool schemas."""
    from transformers import AutoTokenizer

    from rlfactory_megatron.envs.tool_manager import get_tool_manager
    from rlfactory_megatron.envs.tools.toolbox import tool_schemas
    from rlfactory_megatron.trainer.tasks import run_tool_specs

    cfg = load_config()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    manager = get_tool_manager(cfg.tools.format, tokenizer)
    schemas = tool_schemas(run_tool_specs(cfg))
    record = run_records(cfg)[0][0]
    return tokenizer, manager, schemas, record, manager.render_prompt(record.messages, schemas)


def test_left_keeps_a_prompts_last_tokens_and_right_its_first(qwen3):
    from rlfactory_megatron.trainer.sft import demonstration_rows

    tokenizer, manager, schemas, record, full = _rendered(qwen3)
    limit = len(full) - 10
    left, right = fit_prompt(full, limit, "left"), fit_prompt(full, limit, "right")
    assert left == full[10:] and right == full[:limit]
    # left cuts the system prompt and tool schemas at the start, right the question and the
    # generation prompt at the end
    assert tokenizer.decode(left).endswith("<|im_start|>assistant\n") and not tokenizer.decode(right).endswith("\n")
    assert tokenizer.decode(right).startswith("<|im_start|>system")
    assert fit_prompt(full, len(full), "error") == full and fit_prompt(full, len(full), "left") == full
    with pytest.raises(ValueError, match=f"training prompt 0: a prompt of {len(full)} tokens exceeds "
                                         f"rollout.max_prompt_tokens={limit}"):
        fit_prompt(full, limit, "error", record.origin)
    # The warm-start trains on the prompt the rollout would generate from.
    for truncation, kept in (("left", left), ("right", right)):
        [(ids, mask)] = demonstration_rows([record], manager, schemas, limit, truncation)
        assert ids[:limit] == kept and mask[:limit] == [0] * limit and ids[limit:] and all(mask[limit:limit + 1])


def test_a_prompt_over_the_limit_is_named_at_load_or_cut_as_asked(qwen3, tmp_path):
    from rlfactory_megatron.envs.tools.registry import load_tool_specs
    from rlfactory_megatron.envs.tools.toolbox import tool_schemas

    _, manager, _, _, _ = _rendered(qwen3)
    tools = Path(__file__).resolve().parents[2] / "examples" / "tools" / "calculator.yaml"  # a user's data: tools declared
    limit = 2 + len(manager.render_prompt([{"role": "user", "content": "What is 2 + 3?"}],
                                          tool_schemas(load_tool_specs(tools))))
    rows = [{"prompt": "What is 2 + 3?", "ground_truth": "5"},
            {"prompt": "What is " + " + ".join(["12"] * 40) + "?", "ground_truth": "480"},
            {"prompt": "What is 7 * 6?", "ground_truth": "42"}]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [f"model.path={qwen3}", f"trainer.data_path={data}", f"tools.config_path={tools}", "trainer.sft_steps=0",
                 "trainer.sft_cache=null", "trainer.val_prompts=1", f"rollout.max_prompt_tokens={limit}"]
    named = re.escape(f'{data} row 1 ("What is 12 + 12 + ') + r'.*\.\.\."\): its prompt is \d+ tokens '
    with pytest.raises(ValueError, match=named + r"\(chat template and tool schemas\), over rollout.max_prompt_tokens"):
        check_run_data(load_config(None, overrides), qwen3)
    line = check_run_data(load_config(None, [*overrides, "rollout.truncation=left"]), qwen3)
    assert line.startswith("2 training and 1 validation prompts") and "1 longer ones keep their last" in line
