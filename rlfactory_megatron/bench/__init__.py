"""Benchmarks behind `rlf-bench NAME`: one module per benchmark, each with `main(argv) -> int`.

Every benchmark reports ratios against a baseline measured in the same process.
"""

from rlfactory_megatron.registry import Registry

# name -> what it measures; the module rlfactory_megatron.bench.<name with _ for -> runs it.
BENCHMARKS: Registry[str] = Registry("benchmark")
for _name, _what in (
    ("actor", "Megatron actor forward+backward vs plain transformers"),
    ("weight-sync", "Megatron -> vLLM bucketed weight sync vs memcpy and disk reload"),
    ("rollout", "generation tokens/s and weight sync on 2 disaggregated engines vs 1, through the router"),
    ("tools", "Ray tool pool throughput vs ideal concurrency / latency"),
    ("rewards", "Ray reward pool vs in-process scoring, and overlap with compute"),
    ("cache", "HDF5 rollout cache write/read MB/s and lookup latency vs raw disk"),
    ("logprob", "fused vocab-parallel log-prob/entropy vs naive log_softmax"),
    ("long-trajectory", "peak memory per rank and step time of actor updates on long trajectories at CP 1 and 2"),
    ("moe", "actor update and weight sync of a MoE model at EP 1 and 2 vs the dense model of its active size"),
    ("e2e", "end-to-end GRPO step phases and tokens/s vs TRL"),
    ("sweep", "a grid of benchmark runs, one JSON per point with its environment, a table and plots"),
    ("learn", "the embedded default's learning over seeds and thread settings (table + curves)"),
):
    BENCHMARKS.register(_name, _what)
