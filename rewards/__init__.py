"""Rewards: scorers, reward managers, custom reward functions, model rewards (a judge on our engines,
a remote endpoint) and their combination with the rule, Ray reward pool."""
from rlfactory_megatron.rewards.combine import CombineSpec
from rlfactory_megatron.rewards.custom import RewardConfigError, RewardFnSpec, load_reward_fn
from rlfactory_megatron.rewards.managers import REWARD_MANAGERS, build_reward_manager
from rlfactory_megatron.rewards.records import RewardResult, RewardSample, SampleScore
from rlfactory_megatron.rewards.remote import PROTOCOLS, RemoteRewardSpec
from rlfactory_megatron.rewards.scorers import SCORERS, get_scorer
from rlfactory_megatron.rewards.served_judge import JUDGE_KINDS, JudgeSpec

__all__ = [
    "JUDGE_KINDS",
    "PROTOCOLS",
    "CombineSpec",
    "JudgeSpec",
    "RemoteRewardSpec",
    "REWARD_MANAGERS",
    "SCORERS",
    "RewardConfigError",
    "RewardFnSpec",
    "RewardResult",
    "RewardSample",
    "SampleScore",
    "build_reward_manager",
    "get_scorer",
    "load_reward_fn",
]
