"""Shard files, on a toy schema from workers.py: round trip, commit point and torn-tail recovery, live SWMR
readers, and errors that name the file."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest

from rlfactory_megatron.envs.storage.shard import Ragged, ShardError, open_reader, open_writer, rewrite
from rlfactory_megatron.envs.storage.verify import verify_shard

HERE = Path(__file__).parent


@pytest.fixture
def toy(workers):
    return workers.TOY_SCHEMA, workers.toy_batch


def test_round_trip_and_reopen(tmp_path, toy):
    schema, batch = toy
    path = tmp_path / "s.h5"
    shard = open_writer(path, schema)
    assert shard.append("t", batch(0, 5)) == range(0, 5)
    assert shard.append("t", batch(5, 0)) == range(5, 5)
    shard.append("t", batch(5, 6))
    shard.close()
    shard = open_writer(path, schema)
    assert shard.rows("t") == 11
    tokens = shard.read("t", "tokens", 3, 9)
    assert [len(t) for t in tokens] == [i % 7 for i in range(3, 9)]
    assert np.array_equal(shard.cell("t", "tokens", 6), np.arange(6))
    assert np.array_equal(shard.read("t", "vec", 10, 11), [[10, 10.5, -10]])
    assert shard.read_rows("t", np.array([2, 9]))["n"] == [2, 9]
    shard.close()
    assert verify_shard(path, {"toy": schema}) == []


def test_flat_ragged_cells(tmp_path, toy):
    schema, batch = toy
    shard = open_writer(tmp_path / "s.h5", schema)
    flat = batch(0, 3)
    flat["tokens"] = Ragged(np.array([7, 8, 9, 10], dtype=np.int64), np.array([1, 0, 3]))
    shard.append("t", flat)
    assert [t.tolist() for t in shard.read("t", "tokens", 0, 3)] == [[7], [], [8, 9, 10]]
    broken = batch(3, 3)
    broken["tokens"] = Ragged(np.arange(5), np.array([1, 1, 1]))
    with pytest.raises(ValueError, match="do not add up"):
        shard.append("t", broken)
    broken = batch(5, 3)
    broken["doc"] = [np.array([0.5])] * 3  # refused after "tokens" was written
    with pytest.raises(TypeError):
        shard.append("t", broken)
    shard.append("t", batch(3, 2))  # the failed batches left nothing behind, in the file or in memory
    assert [t.tolist() for t in shard.read("t", "tokens", 2, 5)] == [[8, 9, 10], [0, 1, 2], [0, 1, 2, 3]]
    assert shard.read("t", "n", 0, 5).tolist() == [0, 1, 2, 3, 4]
    shard.close()


def test_uneven_batch_is_refused(tmp_path, toy):
    schema, batch = toy
    shard = open_writer(tmp_path / "s.h5", schema)
    uneven = batch(0, 3)
    uneven["n"] = [1]
    with pytest.raises(ValueError, match="different lengths"):
        shard.append("t", uneven)
    shard.close()


def test_killed_writer_leaves_committed_rows_and_cuts_the_torn_tail(tmp_path, toy):
    schema, batch = toy
    """The writer dies after writing a batch's data but before its commit point."""
    path = tmp_path / "s.h5"
    script = textwrap.dedent(f"""
        import os, signal, sys
        import numpy as np
        sys.path.insert(0, {str(HERE)!r})
        from rlfactory_megatron.envs.storage.shard import open_writer
        from workers import TOY_SCHEMA as schema, toy_batch as batch
        shard = open_writer({str(path)!r}, schema)
        shard.append("t", batch(0, 4))
        torn = shard.dataset("t", "tokens")
        torn.resize(torn.shape[0] + 1000, axis=0)
        shard.dataset("t", "n").resize(9, axis=0)
        shard._file.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    with pytest.raises(OSError, match="h5clear"):
        h5py.File(path, "r+")  # the crash left the file marked as still open for writing
    assert verify_shard(path, {"toy": schema}) == []
    shard = open_writer(path, schema)
    assert shard.rows("t") == 4 and shard.dataset("t", "n").shape[0] == 4
    assert shard.dataset("t", "tokens").shape[0] == sum(i % 7 for i in range(4))
    shard.append("t", batch(4, 2))
    assert shard.read("t", "n", 0, 6).tolist() == list(range(6))
    shard.close()


def test_live_reader_sees_each_committedbatch(tmp_path, toy):
    schema, batch = toy
    path = tmp_path / "s.h5"
    writer = open_writer(path, schema)
    writer.append("t", batch(0, 3))
    reader_script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(HERE)!r})
        from rlfactory_megatron.envs.storage.shard import open_reader
        from workers import TOY_SCHEMA as schema
        reader = open_reader({str(path)!r}, {{"toy": schema}})
        print(reader.rows("t"), flush=True)
        while reader.rows("t") < 8:
            time.sleep(0.01)
            reader.refresh()
        print(reader.read("t", "n", 0, 8).tolist(), flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", reader_script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "3"
    writer.append("t", batch(3, 5))
    out, _ = proc.communicate(timeout=60)
    writer.close()
    assert out.strip() == str(list(range(8)))


def test_rewrite_keeps_selected_rows(tmp_path, toy):
    schema, batch = toy
    path = tmp_path / "s.h5"
    shard = open_writer(path, schema)
    shard.append("t", batch(0, 10))
    shard.close()
    rewrite(path, schema, keep=lambda s, table: np.array([1, 4, 8]))
    shard = open_reader(path, {"toy": schema})
    assert shard.read("t", "n", 0, 10).tolist() == [1, 4, 8]
    assert [t.tolist() for t in shard.read("t", "tokens", 0, 3)] == [list(range(1)), list(range(4)), list(range(1))]
    shard.close()


def test_schema_version_mismatch_names_the_file(tmp_path, toy):
    schema, batch = toy
    path = tmp_path / "s.h5"
    open_writer(path, schema).close()
    with h5py.File(path, "r+") as file:
        file.attrs["schema_version"] = 99
    for opener in (lambda: open_writer(path, schema), lambda: open_reader(path, {"toy": schema})):
        with pytest.raises(ShardError, match=f"{path}.*schema version 99"):
            opener()
    assert "schema version 99" in verify_shard(path, {"toy": schema})[0]


def test_garbage_file_names_the_file(tmp_path, toy):
    schema, batch = toy
    path = tmp_path / "shard-00000-of-00001.h5"
    path.write_bytes(b"not hdf5 at all" * 100)
    with pytest.raises(ShardError, match=str(path)):
        open_writer(path, schema)
    assert str(path) in verify_shard(path, {"toy": schema})[0]


def test_verify_finds_broken_offsets_and_json(tmp_path, toy):
    schema, batch = toy
    path = tmp_path / "s.h5"
    shard = open_writer(path, schema)
    shard.append("t", batch(0, 6))
    shard.close()
    with h5py.File(path, "r+") as file:
        file["t/tokens.offsets"][2] = 10**6
        file["t/doc"][0] = ord("!")
    problems = "\n".join(verify_shard(path, {"toy": schema}))
    assert str(path) in problems and "tokens" in problems and "not JSON" in problems


def test_batch_failing_midway_leaves_no_rows(tmp_path, toy):
    schema, batch = toy
    path = tmp_path / "s.h5"
    shard = open_writer(path, schema)
    shard.append("t", batch(0, 3))
    broken = batch(3, 2)
    broken["doc"] = [np.array([0.5]), np.array([1.5])]  # floats into a uint8 column: refused after n, tokens, vec
    with pytest.raises(TypeError):
        shard.append("t", broken)
    shard.close()
    shard = open_writer(path, schema)  # the written-but-uncommitted columns are cut on open
    assert shard.rows("t") == 3 and shard.dataset("t", "n").shape[0] == 3
    assert shard.dataset("t", "tokens").shape[0] == sum(i % 7 for i in range(3))
    shard.append("t", batch(3, 2))
    assert shard.read("t", "n", 0, 5).tolist() == list(range(5))
    shard.close()
    assert verify_shard(path, {"toy": schema}) == []


def test_cells_in_any_form_store_the_same_values(tmp_path, toy):
    """Ragged cells as arrays of the column's type (joined as bytes), of a wider type, as lists, or as
    non-contiguous views all store the same values; a float cell in an int column is still refused."""
    schema, batch = toy
    shard = open_writer(tmp_path / "s.h5", schema)
    forms = [
        [np.array([1, 2, 3], np.int32), np.array([], np.int32), np.array([4], np.int32)],
        [np.array([1, 2, 3], np.int64), np.array([], np.int64), np.array([4], np.int64)],
        [[1, 2, 3], [], [4]],
        [np.array([1, 0, 2, 0, 3], np.int32)[::2], np.array([], np.int32), np.array([4, 9], np.int32)[:1]],
    ]
    for n, cells in enumerate(forms):
        rows = batch(3 * n, 3)
        rows["tokens"] = cells
        shard.append("t", rows)
    for n in range(len(forms)):
        assert [t.tolist() for t in shard.read("t", "tokens", 3 * n, 3 * n + 3)] == [[1, 2, 3], [], [4]]
    rows = batch(12, 3)
    rows["tokens"] = [np.array([1.5]), np.array([2.0]), np.array([3.0])]
    with pytest.raises(TypeError):
        shard.append("t", rows)
    shard.close()


def _dirty_and_writeback_pages(fd: int) -> tuple[int, int]:
    """(dirty, under writeback) pages of an open file in the page cache: Linux cachestat (6.5+)."""
    import ctypes

    class Range(ctypes.Structure):
        _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]

    class Stat(ctypes.Structure):
        _fields_ = [(name, ctypes.c_uint64) for name in ("cache", "dirty", "writeback", "evicted", "recent")]

    libc, stat = ctypes.CDLL(None, use_errno=True), Stat()
    if libc.syscall(451, fd, ctypes.byref(Range(0, 0)), ctypes.byref(stat), 0) != 0:  # 451: cachestat
        pytest.skip(f"cachestat unavailable on this kernel (errno {ctypes.get_errno()})")
    return stat.dirty, stat.writeback


def test_appends_start_writeback_without_an_fsync(tmp_path, toy):
    """Write-behind: 16 MB of appends leave at most the last MB dirty; the kernel alone waits ~30 s
    (dirty_expire_centisecs) before writing back."""
    import time

    schema, _ = toy
    shard = open_writer(tmp_path / "s.h5", schema)
    try:
        tokens = np.arange(1 << 18, dtype=np.int32)  # 1 MB per row
        for n in range(16):
            shard.append("t", {"n": [n], "tokens": [tokens], "vec": [[0, 0, 0]], "doc": [np.frombuffer(b"{}", np.uint8)]})
        fd = shard._file.id.get_vfd_handle()
        deadline = time.monotonic() + 10
        while _dirty_and_writeback_pages(fd)[0] > 300 and time.monotonic() < deadline:
            time.sleep(0.05)
        dirty, _ = _dirty_and_writeback_pages(fd)
        assert dirty <= 300, f"{dirty} pages still dirty: writeback was not started"  # 1 MB = 256 pages + metadata
    finally:
        shard.close()


def test_write_behind_calls_once_per_threshold_and_close_waits(tmp_path, monkeypatch):
    """The threshold, the helper thread and close(), with the syscall replaced by a recorder (the real call
    is covered above)."""
    import threading

    from rlfactory_megatron.envs.storage import shard as shard_module

    calls, release = [], threading.Event()

    def fake_sync_file_range(fd, offset, nbytes, flags):
        calls.append((fd, offset, nbytes, flags))
        release.wait(5)
        return 0

    monkeypatch.setattr(shard_module, "_sync_file_range", lambda: fake_sync_file_range)
    with open(tmp_path / "f", "wb") as handle:
        behind = shard_module.WriteBehind(handle.fileno(), every=1000)
        handle.write(b"x" * 999)
        handle.flush()
        behind.wrote()
        assert not calls and behind._thread is None  # below the threshold: nothing, not even a thread
        handle.write(b"x")
        handle.flush()
        behind.wrote()
        for _ in range(500):
            if calls:
                break
            threading.Event().wait(0.01)
        assert calls == [(handle.fileno(), 0, 0, 2)]  # the whole file, SYNC_FILE_RANGE_WRITE
        closer = threading.Thread(target=behind.close)
        closer.start()
        closer.join(0.2)
        assert closer.is_alive(), "close() returned while a writeback call was in flight"
        release.set()
        closer.join(5)
        assert not closer.is_alive()
        handle.write(b"x" * 5000)
        handle.flush()
        behind.wrote()  # after close: ignored
        assert len(calls) == 1
