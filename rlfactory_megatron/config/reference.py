"""The configuration reference (docs/configuration.md), generated from schema.py: every key with
its type, default and the comments written beside it in the schema, so the reference cannot
drift from what `rlf-train` accepts (a test compares the file with this output).

    .venv/bin/python -m rlfactory_megatron.config.reference > docs/configuration.md
"""
from __future__ import annotations

import dataclasses
import inspect
import io
import tokenize
import typing

from omegaconf import MISSING

from rlfactory_megatron.config import schema

HEADER = """# Configuration reference

Generated from `rlfactory_megatron/config/schema.py` by
`.venv/bin/python -m rlfactory_megatron.config.reference > docs/configuration.md`; do not edit by
hand (`tests/docs/test_docs.py` fails when this file and the schema differ). Defaults here are
the schema's: a run with `--config FILE` starts from them. The embedded default run (`rlf-train`
without `--config`: `rlfactory_megatron/config/default.yaml`) sets a few others, for a tiny model
on CPU. Set a key in a YAML file (`--config`) or on the command line (`section.key=value`).
"""


# What every step logs (metrics.jsonl, TensorBoard, wandb): name, what it is, verl's name for it.
METRICS = (
    ("reward/score/mean, /min, /max", "the step's sample rewards", "critic/score/mean, /min, /max"),
    ("reward/errors", "samples whose reward failed (scored 0), by kind under reward/errors/<kind>", ""),
    ("train/advantages/mean, /min, /max", "advantages on the trained tokens, every DP rank's rows",
     "critic/advantages/mean, /min, /max"),
    ("train/returns/mean, /min, /max", "the critic's targets (runs with a critic)", "critic/returns/mean, /min, /max"),
    ("actor/pg_loss, actor/kl_loss, actor/entropy", "the policy loss, the KL loss (with actor.kl_loss_coef), "
     "the policy's entropy on the trained tokens", "actor/pg_loss, actor/kl_loss, actor/entropy"),
    ("actor/clip_frac, actor/approx_kl", "share of tokens the ratio clip acted on; KL of the update's policy "
     "from the sampling one", "actor/pg_clipfrac, actor/ppo_kl"),
    ("actor/grad_norm, actor/lr", "gradient norm before clipping (mean over the step's optimizer steps); "
     "the learning rate after the step", "actor/grad_norm, actor/lr"),
    ("critic/vf_loss, critic/grad_norm", "the value loss and its gradient norm", "critic/vf_loss, critic/grad_norm"),
    ("rollout/response_tokens_mean, _max", "generated tokens per trajectory (all turns and observations)",
     "response_length/mean, /max"),
    ("rollout/clip_ratio", "share of trajectories cut at rollout.max_response_tokens",
     "response_length/clip_ratio"),
    ("rollout/turns_mean, rollout/tool_calls_per_sample, tools/errors", "the agent loop: policy turns, tool calls, "
     "failed calls (by kind under tools/errors/<kind>)", ""),
    ("rollout/logprob_gap_mean, _max", "|trainer - engine| log-prob of the sampled tokens on the same weights",
     "training/rollout_probs_diff_mean, _max"),
    ("val/score_mean, val/<data_source>/score_mean", "greedy held-out score (every trainer.val_every steps and "
     "before RL, at step 0), over all held-out prompts and per data source", "val-core/<data_source>/reward/mean@1"),
    ("sft/loss", "the SFT warm-start's last loss (step 0)", ""),
    ("time/generate_s, time/logprob_s, time/reward_wait_s, time/update_s, time/sync_s", "the phases of a step",
     "timing_s/gen, timing_s/old_log_prob, timing_s/reward, timing_s/update_actor, timing_s/update_weights"),
    ("perf/step_s, perf/tokens_per_s", "a step's time; its tokens (prompts and responses) per second",
     "timing_s/step, perf/throughput"),
    ("rollout/num_engines, rollout/engine_imbalance", "engines generating; busiest engine's time over the mean", ""),
)

METRICS_HEADER = """
## Metrics

What each step logs (`<trainer.output_dir>/metrics.jsonl`, TensorBoard, wandb when asked); the
console's own lines are kept in `<trainer.output_dir>/logs/console.log`. Other families are
described where they arise: asynchronous RL (`rollout/staleness_*`), the rollout correction
(`rollout_correction/*`), MoE (`moe/*`, `rollout/routing_agreement`, docs/moe.md), model rewards
(`reward/model/*`, docs/rewards.md), the tool pool (`tools/*`).
"""


def _field_comments(cls: type) -> dict[str, str]:
    """Comment lines above a field and the comment after it, joined, per field name."""
    source = inspect.getsource(cls)
    comments: dict[str, str] = {}
    pending: list[str] = []
    line_of_field: dict[int, str] = {}
    for i, line in enumerate(source.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        name = stripped.split(":", 1)[0]
        if stripped and name.isidentifier() and ":" in stripped and not stripped.startswith(("class", "def", "@")):
            line_of_field[i] = name
            if pending:
                comments[name] = " ".join(pending)
        pending = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and token.start[0] in line_of_field and token.line.strip()[:1] != "#":
            name = line_of_field[token.start[0]]
            trailing = token.string.lstrip("#").strip()
            comments[name] = f"{comments[name]} {trailing}" if name in comments else trailing
    return comments


def _type_name(tp: typing.Any) -> str:
    if isinstance(tp, str):
        return tp.replace("Optional[", "").rstrip("]") + " or null" if tp.startswith("Optional[") else tp
    return getattr(tp, "__name__", str(tp))


def _default(value: typing.Any) -> str:
    if value is None:
        return "null"
    if value == MISSING:
        return "required"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


def _rows(defaults: typing.Any, prefix: str) -> list[tuple[str, str, str, str]]:
    """One row per key of the dataclass instance `defaults` (nested sections by their own
    defaults: critic.optim's learning rate is the critic's, not OptimConfig's)."""
    comments = _field_comments(type(defaults))
    rows = []
    for f in dataclasses.fields(defaults):
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(value):
            rows.extend(_rows(value, f"{prefix}{f.name}."))
            continue
        rows.append((f"{prefix}{f.name}", _type_name(f.type), _default(value), comments.get(f.name, "")))
    return rows


def render() -> str:
    out = [HEADER]
    root = schema.RLFConfig()
    for section in dataclasses.fields(root):
        cls = getattr(schema, str(section.type))
        doc = inspect.getdoc(cls) or ""
        out.append(f"\n## `{section.name}`\n")
        if doc and not doc.startswith(cls.__name__ + "("):  # a dataclass's generated signature is no doc
            out.append(doc + "\n")
        out.append("| key | type | default | what it does |\n| --- | --- | --- | --- |")
        for key, type_name, default, comment in _rows(getattr(root, section.name), f"{section.name}."):
            out.append(f"| `{key}` | {type_name} | `{default}` | {comment.replace('|', chr(92) + '|')} |")
    out.append(METRICS_HEADER)
    out.append("| metric | what it is | verl's name |\n| --- | --- | --- |")
    out.extend(f"| `{name}` | {what} | {f'`{verl}`' if verl else '—'} |" for name, what, verl in METRICS)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
