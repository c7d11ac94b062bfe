"""Explicit I/O for the disk store (Note [explicit disk I/O] in runtime/diskio.py).

The step's disk traffic goes through reader and writer threads, exactly the
bytes the placement plans, not through page faults, and leaves nothing in the
page cache; the buffers it uses are bounded; results stay bit for bit those of
the RAM store (tests/test_disk_store.py and tests/test_hybrid_store.py compare
every placement with clipping, micro-batches and overlapped updates).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from test_disk_store import CFG, _assert_same_training, _batch, _train
from test_hybrid_store import _working_set

import weightstream as cstorch
from weightstream.models import GPT
from weightstream.runtime.diskio import (
    ALIGN,
    BufferPool,
    DiskIO,
    StoreFile,
    open_for_io,
)
from weightstream.runtime.store import DiskStore

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def _cached_pages(store: DiskStore) -> tuple[int, int]:
    """(pages of the store's files in the page cache, pages in all): mincore on the
    files' shared mappings reports the page cache, mapped by us or not."""
    cached = total = 0
    for start, flat in store._maps.items():
        pages = -(-flat.numel() // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        assert _libc.mincore(start, flat.numel(), vec) == 0, ctypes.get_errno()
        cached += sum(b & 1 for b in vec)
        total += pages
    return cached, total


def _all_in_files(tmp_path) -> int:
    """The host_memory_budget that leaves the RAM tier empty: the working set alone."""
    torch.manual_seed(0)
    probe = cstorch.compile(GPT(CFG), backend="ws", store="disk", store_dir=str(tmp_path))
    budget = _working_set(probe)
    probe.engine.close()
    return budget


def _step(runner, opt, step):
    x, y = _batch(step)
    loss = F.cross_entropy(runner(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("direct", [None, False], ids=["o_direct", "buffered"])
def test_a_step_moves_exactly_the_planned_bytes_and_leaves_no_page_cache(
    tmp_path, monkeypatch, direct
):
    monkeypatch.setattr(DiskStore, "direct_io", direct)
    budget = _all_in_files(tmp_path / "probe")
    torch.manual_seed(0)
    model = GPT(CFG)
    runner = cstorch.compile(
        model, backend="ws", store="disk", store_dir=str(tmp_path), host_memory_budget=budget
    )
    opt = cstorch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(runner, opt, 0)  # the gradients' files appear at the first backward
    store = runner.engine.store.tier
    placed = store.placement()
    assert placed.ram_bytes == 0 and placed.disk_reads_per_step > 0
    if direct is None and not store._direct:
        pytest.skip("this file system refuses O_DIRECT")
    meter = runner.engine.streamer.meter
    read, written = store.io.bytes_read, store.io.bytes_written
    fetched = meter.total_fetched_bytes
    for step in (1, 2):
        _step(runner, opt, step)
        # Every fetch (forward, and backward where a unit saved its weights) reads
        # its masters; the update reads each master, moment and gradient and
        # writes masters and moments; the backward writes the gradients. Nothing
        # else touches the files.
        update_reads = sum(placed.disk.values())
        fetch_reads = meter.total_fetched_bytes - fetched
        assert fetch_reads > placed.disk["master"]
        assert store.io.bytes_read - read == fetch_reads + update_reads
        assert store.io.bytes_written - written == placed.disk_writes_per_step
        read, written = store.io.bytes_read, store.io.bytes_written
        fetched = meter.total_fetched_bytes
    cached, total = _cached_pages(store)
    assert total * mmap.PAGESIZE >= placed.disk_bytes
    assert cached <= total // 50, (cached, total)


def test_buffered_descriptors_train_bit_for_bit_as_the_ram_store(tmp_path, monkeypatch):
    """Where a file system refuses O_DIRECT the store uses buffered descriptors."""
    monkeypatch.setattr(DiskStore, "direct_io", False)
    budget = _all_in_files(tmp_path / "probe")
    ram = _train("ws", steps=3, micro_batches=2)
    disk = _train(
        "ws",
        steps=3,
        micro_batches=2,
        store="disk",
        store_dir=str(tmp_path),
        host_memory_budget=budget,
    )
    assert not disk[1].engine.store.tier._direct
    _assert_same_training(ram, disk)


def test_gradients_read_after_backward_are_the_written_ones(tmp_path):
    """p.grad of a file-placed gradient, read through its mapping right after
    backward() returns, is autograd's gradient (the backward waits for its writes)."""
    budget = _all_in_files(tmp_path / "probe")
    torch.manual_seed(0)
    ref = GPT(CFG)
    torch.manual_seed(0)
    model = GPT(CFG)
    runner = cstorch.compile(
        model, backend="ws", store="disk", store_dir=str(tmp_path), host_memory_budget=budget
    )
    x, y = _batch(0)
    F.cross_entropy(runner(x).flatten(0, 1), y.flatten()).backward()
    F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
    store = runner.engine.store.tier
    in_files = 0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        in_files += store.file_of(p.grad) is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert in_files == len(list(model.parameters()))


def test_pool_waits_for_room_and_never_exceeds_its_capacity():
    pool = BufferPool(capacity=4 * ALIGN)
    a, b = pool.take_many([ALIGN, 2 * ALIGN])
    assert a.data_ptr() % ALIGN == 0 and b.data_ptr() % ALIGN == 0
    assert pool.take_many([2 * ALIGN], wait=False) is None  # 3 of 4 pages taken
    got = []
    t = threading.Thread(target=lambda: got.append(pool.take(2 * ALIGN)))
    t.start()
    time.sleep(0.05)
    assert not got  # waiting for room
    pool.give(b)
    t.join(timeout=5)
    assert got and got[0].numel() == 2 * ALIGN
    assert pool.peak <= pool.capacity
    # A set larger than the pool is served outside it, and not kept.
    big = pool.take_many([3 * ALIGN, 3 * ALIGN])
    assert [x.numel() for x in big] == [3 * ALIGN, 3 * ALIGN]
    for x in big:
        pool.give(x)
    assert pool.peak <= pool.capacity


def test_a_failed_transfer_says_what_failed(tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(bytes(ALIGN))
    fd, direct = open_for_io(path, None)
    f = StoreFile(fd, ALIGN, direct, "state")
    io = DiskIO(BufferPool(4 * ALIGN))
    try:
        buf = io.pool.take(ALIGN)
        f.close()  # the descriptor is gone: the read fails
        f.fd = os.open(tmp_path, os.O_RDONLY)  # a directory: EISDIR on read
        with pytest.raises(OSError, match="disk store failed to read a state tensor"):
            io.read(f, buf).wait()
    finally:
        os.close(f.fd)
        io.close()
