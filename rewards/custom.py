"""Reward functions from config: a file path + function name + kwargs, checked before training starts."""
import functools
import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfactory_megatron.rewards.scorers import SCORERS, default_compute_score, get_scorer

SAMPLE_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCH_ARGS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


class RewardConfigError(ValueError):
    """A reward setting that cannot work; the message names the config key and the fix."""


@dataclass
class RewardFnSpec:
    """Which reward function to run: a Python file + function name, or (path None) a built-in scorer.

    `kwargs` go to either. With no path and no `scorer`, each sample's `data_source` picks
    the scorer. A spec, not the function, travels to Ray actors and worker processes;
    each loads it locally. `config_prefix` is where these settings live, for error messages.
    """

    path: str | None = None
    name: str = "compute_score"
    kwargs: dict[str, Any] = field(default_factory=dict)
    scorer: str | None = None
    config_prefix: str = "reward"

    @classmethod
    def from_config(cls, reward: Any, config_prefix: str = "reward") -> "RewardFnSpec":
        """From a config node with `custom_function_path/_name/_kwargs` and `scorer` (the `reward` section)."""
        return cls(
            path=reward.custom_function_path,
            name=reward.custom_function_name or "compute_score",
            kwargs=dict(reward.custom_function_kwargs or {}),
            scorer=reward.scorer,
            config_prefix=config_prefix,
        )


def load_reward_fn(spec: RewardFnSpec, batched: bool = False) -> Callable[..., Any]:
    """The configured function with its kwargs bound.

    Per-sample functions are called as `fn(data_source, solution_str, ground_truth,
    extra_info, **kwargs) -> float | dict`; batched ones as `fn(data_sources,
    solution_strs, ground_truths, extra_infos, **kwargs) -> list`. Raises
    RewardConfigError when the file, the function or its signature does not fit.
    """
    if spec.path is None:
        fn = _builtin(spec)
        return functools.partial(_map_over_batch(fn) if batched else fn, **spec.kwargs)
    return load_function(spec, BATCH_ARGS if batched else SAMPLE_ARGS)


def load_function(spec: RewardFnSpec, args: tuple[str, ...], path_key: str | None = None,
                  name_key: str | None = None) -> Callable[..., Any]:
    """The function `spec.name` of the file `spec.path`, checked to take `args` (plus `spec.kwargs`,
    bound); errors name `path_key` / `name_key` (default: the custom_function_* keys under
    `spec.config_prefix`)."""
    path_key = path_key or f"{spec.config_prefix}.custom_function_path"
    name_key = name_key or f"{spec.config_prefix}.custom_function_name"
    fn = _function_from_file(spec, path_key, name_key)
    try:
        inspect.signature(fn).bind(**dict.fromkeys(args), **spec.kwargs)
    except TypeError as exc:
        kwargs = f" plus {spec.config_prefix}.custom_function_kwargs {sorted(spec.kwargs)}" if spec.kwargs else ""
        raise RewardConfigError(
            f"{name_key}: {spec.name}{inspect.signature(fn)} in {spec.path} "
            f"cannot be called with ({', '.join(args)}){kwargs}: {exc}. Give it these parameters (or **kwargs)."
        ) from None
    return functools.partial(fn, **spec.kwargs)


def _function_from_file(spec: RewardFnSpec, path_key: str, name_key: str) -> Callable[..., Any]:
    path = Path(spec.path).expanduser().resolve()
    if not path.is_file():
        raise RewardConfigError(f"{path_key}: no file at {path} (from {spec.path!r}); point it at a .py file")
    # A name unique per file, so two custom files with the same stem do not replace each other.
    module_name = f"rlf_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up here
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise RewardConfigError(f"{path_key}: importing {path} failed: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, spec.name, None)
    if not callable(fn):
        available = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise RewardConfigError(f"{name_key}: {path} has no function {spec.name!r}; functions defined there: {available}")
    return fn


def _builtin(spec: RewardFnSpec) -> Callable[..., Any]:
    if spec.scorer is None:
        return default_compute_score
    try:
        scorer = get_scorer(spec.scorer)
    except KeyError:
        raise RewardConfigError(
            f"{spec.config_prefix}.scorer: unknown {spec.scorer!r}; choose one of {', '.join(SCORERS)} "
            f"or set {spec.config_prefix}.custom_function_path"
        ) from None

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        return scorer(solution_str, ground_truth, **kwargs)

    return compute_score


def _map_over_batch(fn: Callable[..., Any]) -> Callable[..., list]:
    def batch_fn(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
        rows = zip(data_sources, solution_strs, ground_truths, extra_infos, strict=True)
        return [fn(*row, **kwargs) for row in rows]

    return batch_fn
