"""Rollout store: a step reads back as the same records, from any number of shards, after a restart too."""
from __future__ import annotations

import pytest

from rlfactory_megatron.envs.storage import RolloutStore, Topology


def _rank(rank: int, world: int) -> Topology:
    return Topology(rank=rank, world=world, backend="single", allgather=lambda obj: [obj])


def test_step_round_trip_across_shards_and_restart(tmp_path, workers):
    steps = {step: [workers.make_record(step, rank, i) for rank in range(2) for i in range(7)] for step in range(3)}
    for rank in range(2):  # two ranks' shards, written one after the other
        with RolloutStore(tmp_path, _rank(rank, 2)) as store:
            for step, records in steps.items():
                mine = [r for r in records if r.metadata["rank"] == rank]
                store.write(mine[:3])
                store.write(mine[3:])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-00000-of-00002.h5", "shard-00001-of-00002.h5"]
    with RolloutStore(tmp_path, readonly=True) as store:
        assert store.steps() == [0, 1, 2]
        assert store.read_step(1) == steps[1]
        assert store.read(2, "r1-s4-é") == steps[2][7 + 4]
        assert store.read_step(7) == []
        with pytest.raises(KeyError, match="step 2, sample 'nope'"):
            store.read(2, "nope")
        with pytest.raises(PermissionError):
            store.write(steps[0])


def test_records_compare_by_content(workers):
    record = workers.make_record(0, 0, 3)
    assert record == workers.make_record(0, 0, 3)
    assert record != workers.make_record(0, 0, 4)
    record.logprobs[0] += 1e-3
    assert record != workers.make_record(0, 0, 3)


def test_writer_sees_its_own_new_batches(tmp_path, workers):
    with RolloutStore(tmp_path, _rank(0, 1)) as store:
        store.write([workers.make_record(0, 0, 0)])
        assert len(store.read_step(0)) == 1
        store.write([workers.make_record(0, 0, 1), workers.make_record(1, 0, 0)])
        assert [len(store.read_step(s)) for s in (0, 1)] == [2, 1]


def test_a_rewritten_sample_reads_as_its_last_write(tmp_path, workers):
    # A run killed during step 1 resumes from step 0's checkpoint and writes step 1 again.
    first = [workers.make_record(1, 0, i) for i in range(3)]
    again = [workers.make_record(1, 0, i) for i in range(3)]
    for record in again:
        record.reward += 10.0
    with RolloutStore(tmp_path, _rank(0, 1)) as store:
        store.write(first)
    with RolloutStore(tmp_path, _rank(0, 1)) as store:
        store.write(again[:2])
    with RolloutStore(tmp_path, readonly=True) as store:
        assert store.read_step(1) == [first[2], *again[:2]]
        assert store.read(1, again[0].sample_id) == again[0]


def test_json_columns_encode_exactly_as_json_dumps():
    """The cached C encoder writes the very text json.dumps does, and fails the same way."""
    import json
    import math

    from rlfactory_megatron.envs.storage.rollouts import _to_json

    samples = [{}, [], {"name": "search", "arguments": {"q": "naïve 東京 \u2028", "k": [1, 2.5, None, True]}},
               [{"n": math.nan, "i": math.inf, "-i": -math.inf}], {"1": {"2": {"3": [[], {}]}}}, "text", 3, None]
    for obj in samples:
        assert _to_json(obj) == json.dumps(obj, separators=(",", ":"))
    circular: list = []
    circular.append(circular)
    with pytest.raises(ValueError, match="Circular"):
        _to_json({"a": [circular]})
    with pytest.raises(TypeError, match="set is not JSON serializable"):
        _to_json({"a": {1, 2}})
    assert _to_json({"a": [1]}) == '{"a":[1]}'  # a failed call leaves nothing behind


def test_routes_are_stored_with_the_trajectory_and_a_cache_from_before_them_still_reads(tmp_path, workers):
    # Routing replay R3 keeps the engine's routes in two columns added to the rollouts table; a
    # shard written without them reads as records with no routes, and takes new records (with
    # routes) once its writer has rewritten it with the columns.
    import dataclasses

    import numpy as np

    from rlfactory_megatron.envs.storage.rollouts import _to_columns
    from rlfactory_megatron.envs.storage.schemas import ROLLOUTS
    from rlfactory_megatron.envs.storage.shard import Table, create_shard, shard_name
    from rlfactory_megatron.envs.storage.verify import verify_shard

    table = ROLLOUTS.tables[0]
    before = dataclasses.replace(ROLLOUTS, tables=(Table(table.name, tuple(c for c in table.columns
                                                                          if not c.added_later)),))
    old = workers.make_record(0, 0, 1)
    shard = create_shard(tmp_path / shard_name(0, 1), before)
    shard.append(table.name, {k: v for k, v in _to_columns([old]).items() if not k.startswith("routes")})
    shard.close()
    assert verify_shard(tmp_path / shard_name(0, 1)) == []
    with RolloutStore(tmp_path, readonly=True) as store:
        assert store.read_step(0) == [old] and store.read_step(0)[0].routes is None

    new = dataclasses.replace(workers.make_record(1, 0, 2))
    new.routes = np.random.default_rng(0).integers(-1, 8, (len(new.prompt_ids) + len(new.response_ids) - 1, 4, 2))
    with RolloutStore(tmp_path, _rank(0, 1)) as store:
        store.write([new])
    with RolloutStore(tmp_path, readonly=True) as store:
        assert store.read_step(0) == [old] and store.read_step(1) == [new]
        assert store.read_step(1)[0].routes.dtype == np.int16 and store.read_step(1)[0].routes.shape[1:] == (4, 2)
    assert verify_shard(tmp_path / shard_name(0, 1)) == []
