"""Streamed, bucketed Megatron -> rollout-engine weight sync, over a pluggable transport.

Megatron shards -> per-tensor TP all-gather / PP broadcast -> HF names (the export generator)
-> buckets of `bucket_mb` that never split a fused group -> the transport -> the engine's loader.
Never a full-model copy, never disk. The whole manifest (names, shapes) is checked against
what the engine expects before the first byte moves, so a bad sync leaves the engine serving
its previous weights.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from rlfactory_megatron.registry import Registry

# Tensors vLLM fuses into one parameter must arrive in the same load call. A MoE layer's experts
# are one vLLM module (its fused w13 / w2 over all experts), processed once all have arrived: they
# travel together, so no layer waits across buckets holding the ones that came first.
_FUSED = (
    (re.compile(r"^(.*\.mlp\.experts)\.\d+\.(gate|up|down)_proj\.weight$"), r"\1"),
    (re.compile(r"^(.*\.self_attn)\.[qkv]_proj\.(weight|bias)$"), r"\1.qkv"),
    (re.compile(r"^(.*\.mlp)\.(gate|up)_proj\.weight$"), r"\1.gate_up"),
)


class WeightSyncError(RuntimeError):
    """A sync refused before any bucket moved, on every training rank: the weights offered do not
    match what the engine serves, or a sending rank could not take part (nothing was loaded)."""


class EngineLostError(RuntimeError):
    """Engines died (or stopped answering) during a sync. The transport has ended the update of
    the others, which serve again on layers of two versions; the sync must run again, to new
    engines in place of the `lost` ones (their indices; empty on ranks that did not send)."""

    def __init__(self, lost: list[int], why: str) -> None:
        super().__init__(why)
        self.lost = lost


def fused_group(name: str) -> str:
    for pattern, group in _FUSED:
        if pattern.match(name):
            return pattern.sub(group, name)
    return name


def iter_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group consecutive tensors into buckets of at most `bucket_bytes` (a larger fused group goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    bucket_size = 0
    group: list[tuple[str, torch.Tensor]] = []
    group_key = None

    def close_group():
        nonlocal bucket, bucket_size
        size = sum(t.numel() * t.element_size() for _, t in group)
        if bucket and bucket_size + size > bucket_bytes:
            yield bucket
            bucket, bucket_size = [], 0
        bucket.extend(group)
        bucket_size += size

    for name, tensor in named:
        key = fused_group(name)
        if group and key != group_key:
            yield from close_group()
            group = []
        group.append((name, tensor))
        group_key = key
    if group:
        yield from close_group()
    if bucket:
        yield bucket


def check_manifest(offered: dict[str, tuple], expected: dict[str, tuple]) -> None:
    """Names and shapes of the export vs the engine's; raise naming every difference."""
    missing = sorted(set(expected) - set(offered))
    unexpected = sorted(set(offered) - set(expected))
    mismatched = sorted(n for n in set(offered) & set(expected) if tuple(offered[n]) != tuple(expected[n]))
    problems = []
    if missing:
        problems.append(f"missing from the trainer's export: {', '.join(missing)}")
    if unexpected:
        problems.append(f"not known to the engine: {', '.join(unexpected)}")
    if mismatched:
        problems.append("shape differs: " + ", ".join(
            f"{n} (trainer {list(offered[n])}, engine {list(expected[n])})" for n in mismatched))
    if problems:
        raise WeightSyncError("weight sync refused, the engine keeps its current weights; " + "; ".join(problems)
                              + ". Does the engine serve the same architecture/config as the actor?")


class Transport:
    """Moves buckets from the sending training rank into an engine."""

    # The weight version the engine serves: set after each complete sync (a sync cut short leaves
    # layers of two versions, and the number of the last complete one).
    served_version: int = 0
    # The serialized size of the engine calls' arguments so far: what crossed a pipe or socket as
    # messages (the weights themselves go by handle or by broadcast).
    message_bytes: int = 0

    def expected_weights(self) -> dict[str, tuple]: ...

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None: ...

    def finish(self) -> None: ...

    def close(self) -> None:
        """Frees what the transport holds (a process group); it is not used after."""


TRANSPORTS: Registry[Callable[..., Transport]] = Registry("weight-sync transport")


@TRANSPORTS.register("in_process")
class InProcessTransport(Transport):
    """The engine belongs to this process (colocated): buckets go straight to its loader, which
    hands them by handle to workers that live in processes of their own."""

    def __init__(self, engine) -> None:
        self.engine = engine

    @property
    def message_bytes(self) -> int:
        return self.engine.message_bytes

    def expected_weights(self) -> dict[str, tuple]:
        return self.engine.weight_names()

    def send(self, bucket):
        self.engine.load_weights(bucket)

    def finish(self):
        self.engine.finish_weight_update()


@dataclass
class SyncStats:
    seconds: float
    bytes: int
    buckets: int
    max_bucket_bytes: int
    transport_seconds: float  # inside transport.send/finish: the engine's loader (+ wire time)
    message_bytes: int  # the engine calls' serialized arguments (see Transport.message_bytes)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def sync_weights(actor_engine, transport: Transport | None, bucket_mb: float,
                 version: int | None = None, refusal: str | None = None) -> SyncStats | None:
    """Collective over all training ranks: every rank that holds a `transport` (one per engine:
    the export yields full tensors on every rank) sends every bucket into its engine, so all
    engines take the same sync at once; ranks without an engine pass None.

    `version` (the trainer's update count) is what each engine reports serving once its sync is
    complete. `refusal`: why this rank cannot take part (e.g. its engines could not be replaced);
    every rank then raises WeightSyncError with it, before any bucket, instead of the others
    waiting in the export's collectives. Returns the stats on ranks that sent, None elsewhere.
    """
    from rlfactory_megatron.models.conversion import hf_weight_manifest

    start = time.perf_counter()
    is_sender = transport is not None
    manifest = hf_weight_manifest(actor_engine.modules(), actor_engine.arch)
    verdict = refusal
    if is_sender and verdict is None:
        try:
            check_manifest({n: shape for n, (shape, _) in manifest.items()}, transport.expected_weights())
        except WeightSyncError as exc:
            verdict = str(exc)
    verdicts = [verdict]
    if dist.get_world_size() > 1:  # every rank must stop together, or the others hang in the stream
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, verdict)
    refused = next((v for v in verdicts if v is not None), None)
    if refused is not None:
        raise WeightSyncError(refused)
    total = buckets = biggest = 0
    in_transport = 0.0
    messages_before = transport.message_bytes if is_sender else 0
    lost: EngineLostError | None = None
    try:
        for bucket in iter_buckets(actor_engine.iter_hf_weights(), int(bucket_mb * 2**20)):
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            total += size
            buckets += 1
            biggest = max(biggest, size)
            if is_sender and lost is None:
                sent = time.perf_counter()
                try:
                    transport.send(bucket)
                except EngineLostError as exc:
                    lost = exc  # the export goes on to its end: the other ranks' gathers wait for this one
                in_transport += time.perf_counter() - sent
    except BaseException:
        if is_sender and buckets and lost is None:
            # Cut short: end the engine's update so that it serves again (layers it received hold the
            # new weights, the others their old ones); the error is what the caller sees.
            try:
                transport.finish()
            except Exception:
                pass
        raise
    sent = time.perf_counter()
    if is_sender and lost is None:
        try:
            transport.finish()
        except EngineLostError as exc:
            lost = exc
    in_transport += time.perf_counter() - sent
    _agree_on_lost_engines(lost)
    if is_sender:
        if version is not None:
            transport.served_version = version
        return SyncStats(time.perf_counter() - start, total, buckets, biggest, in_transport,
                         transport.message_bytes - messages_before)
    return None


def _agree_on_lost_engines(lost: EngineLostError | None) -> None:
    """Raises EngineLostError on every training rank when any sender lost an engine, so that all
    ranks run the sync again together (a rank that went on alone would wait in the next step's
    collectives for one that is still syncing)."""
    reports = [None if lost is None else str(lost)]
    if dist.get_world_size() > 1:
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, None if lost is None else str(lost))
    failed = [why for why in reports if why is not None]
    if failed:
        raise EngineLostError(lost.lost if lost is not None else [], "; ".join(failed))
