"""The compact-state kernels' chunks on several threads (Note [compact kernels on many
cores] in optim/compact.py): every chunk once, failures raised, and the same bits as
one thread, which the CPU engine's helper threads use."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import weightstream as cstorch
from weightstream.common.threads import run_on_threads, single_threaded_operators
from weightstream.optim.compact import CHUNK

needs_two = pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs 2 threads")


def _on_helper(fn):
    """``fn()`` on a thread whose operators run single-threaded (the CPU engine's
    prefetch and update threads: Note [helper threads and OpenMP] in runtime/device.py)."""
    out = {}

    def target():
        single_threaded_operators()
        out["value"] = fn()

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    return out["value"]


@needs_two
def test_every_item_runs_once_on_the_workers():
    seen, lock = [], threading.Lock()

    def record(i):
        with lock:
            seen.append((i, threading.get_ident()))

    run_on_threads(record, range(100))
    assert sorted(i for i, _ in seen) == list(range(100))
    assert threading.get_ident() not in {t for _, t in seen}


def test_a_single_threaded_caller_runs_every_item_itself():
    seen = _on_helper(lambda: _idents(10))
    assert len(seen) == 10 and len(set(seen)) == 1 and seen[0] not in _pool_idents()


def _idents(n):
    out = []
    run_on_threads(lambda _: out.append(threading.get_ident()), range(n))
    return out


def _pool_idents():
    return {t.ident for t in threading.enumerate() if t.name.startswith("weightstream-kernel")}


@needs_two
def test_a_failure_is_raised_once_every_worker_stopped():
    """Nothing runs on after the caller has the error (a half-applied update would go on
    writing the state it is handed back): the other slices finished, the failing one
    stopped at its item."""
    done = []

    def work(i):
        time.sleep(0.001)
        if i == 0:
            raise ValueError("item 0")
        done.append(i)

    with pytest.raises(ValueError, match="item 0"):
        run_on_threads(work, range(40))
    finished = sorted(done)
    time.sleep(0.05)
    assert sorted(done) == finished  # no worker still running
    assert set(range(10, 40)) <= set(finished)  # the other slices (of 5 items or more)


@needs_two
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_chunks_on_several_threads_give_the_bits_of_one(state_dtype):
    """A bf16 master with Kahan compensation over several chunks (and a part of one),
    stepped from the main thread (the workers) and from a single-threaded one."""
    numel = 3 * CHUNK + 1000

    def train():
        g = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(numel, generator=g).to(torch.bfloat16))
        opt = cstorch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, state_dtype=state_dtype)
        for _ in range(3):
            p.grad = torch.randn(numel, generator=g).to(torch.bfloat16)
            opt.step()
        return p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}

    p_many, state_many = train()
    p_one, state_one = _on_helper(train)
    assert torch.equal(p_many.view(torch.int16), p_one.view(torch.int16))
    assert state_many.keys() == state_one.keys()
    for key in state_many:
        a, b = state_many[key], state_one[key]
        assert (
            torch.equal(a, b)
            if a.dtype != torch.bfloat16
            else torch.equal(a.view(torch.int16), b.view(torch.int16))
        ), key


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@needs_two
def test_a_forked_child_makes_its_own_workers():
    run_on_threads(lambda _: None, range(4))  # the parent's pool exists
    pid = os.fork()
    if pid == 0:  # the child: a pool of the parent's would never run this
        out = []
        run_on_threads(out.append, range(8))
        os._exit(0 if sorted(out) == list(range(8)) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
