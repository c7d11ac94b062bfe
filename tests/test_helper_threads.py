"""The engine's helper threads leave the CPUs' OpenMP team to the compute thread
(Note [helper threads and OpenMP] in runtime/device.py): their operators run on
one thread each, and the compute thread keeps its thread count."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import weightstream as cstorch
from weightstream.common.threads import openmp_runtime, single_threaded_operators
from weightstream.models import GPT, GPTConfig

pytestmark = pytest.mark.skipif(
    torch.get_num_threads() < 2 or openmp_runtime() is None,
    reason="needs PyTorch on an OpenMP runtime with at least 2 threads",
)

CFG = GPTConfig(vocab_size=128, seq_len=16, n_layer=3, d_model=32, n_head=4)


def _batch():
    x = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    return x, torch.roll(x, -1, 1)


@pytest.fixture(params=["default", "set by the user"])
def threads(request):
    """The compute thread's count: PyTorch's default, or torch.set_num_threads'
    (which every new thread then takes at its first call)."""
    threads = torch.get_num_threads()
    if request.param != "default":
        torch.set_num_threads(threads)
    return threads


def test_single_threaded_operators_changes_only_the_calling_thread(threads):
    seen = {}

    def helper():
        single_threaded_operators()
        seen["helper"] = torch.get_num_threads()
        seen["sum"] = torch.ones(1_000_000).sum().item()  # operators still run

    def later():
        seen["later"] = torch.get_num_threads()

    for target in (helper, later):
        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
    # torch.set_num_threads(1) in the helper would give every later thread one.
    assert seen == {"helper": 1, "sum": 1_000_000.0, "later": threads}
    assert torch.get_num_threads() == threads


def test_prefetch_and_update_threads_run_operators_on_one_thread(threads):
    seen = []

    class RecordingAdamW(cstorch.optim.AdamW):
        def _update(self, groups):  # runs on the update worker (overlap_updates)
            seen.append((threading.current_thread().name, torch.get_num_threads()))
            super()._update(groups)

    torch.manual_seed(0)
    model = GPT(CFG)
    runner = cstorch.compile(
        model, backend="ws", granularity="module", prefetch_depth=1, overlap_updates=True
    )
    opt = RecordingAdamW(model.parameters(), lr=1e-3)
    x, y = _batch()
    for _ in range(2):
        F.cross_entropy(runner(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
    runner.engine.synchronize()
    assert seen and all(name.startswith("weightstream-update") for name, _ in seen)
    assert {n for _, n in seen} == {1}
    prefetch = runner.engine.ops.submit(torch.get_num_threads, background=True)
    assert prefetch.wait() == 1
    assert torch.get_num_threads() == threads
