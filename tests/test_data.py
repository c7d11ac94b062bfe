"""weightstream.utils.data: step counts, restartable DataLoader, DistributedSampler, helpers.

The restart tests pin invariant 3 of design.md ("a resumed run continues
exactly as if it had never stopped") for the input pipeline: stop after batch
k, save, build a new DataLoader, load, and the batches that follow are those
the uninterrupted run produced.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset, TensorDataset

import weightstream as cstorch
import weightstream.utils.data
from weightstream.context import start_run
from weightstream.data import streaming
from weightstream.utils.data import (
    DataLoader,
    DistributedSampler,
    SyntheticDataset,
    aggregate_state_dict,
    compute_num_steps,
    deaggregate_state_dict,
    get_streaming_batch_size,
    get_streaming_rank,
    is_streamer,
    num_streamers,
)

N = 10  # samples in the toy dataset: batches of 3 give passes of 4 batches (the last short)


@pytest.fixture(autouse=True)
def _default_config():
    start_run()
    yield
    start_run()


def shuffled_fn(batch_size=3, num_workers=0, generator_seed=None):
    generator = None if generator_seed is None else torch.Generator().manual_seed(generator_seed)
    return TorchDataLoader(
        TensorDataset(torch.arange(N)),
        batch_size=batch_size,
        shuffle=True,
        num_workers=num_workers,
        generator=generator,
    )


def run(input_fn, *args, stop_after=None, state=None, user_rng_draws=1, **kwargs):
    """Iterate a fresh DataLoader; return the batches (as lists) and the final state.

    The loop body draws from the global torch RNG, as a model with dropout
    would, a different amount per run (user_rng_draws), which must not change
    the data.
    """
    torch.manual_seed(1234)
    dl = DataLoader(input_fn, *args, **kwargs)
    if state is not None:
        dl.load_state_dict(state)
    batches = []
    for batch in dl:
        torch.rand(user_rng_draws * (len(batches) + 1))
        batches.append(_as_list(batch))
        if stop_after is not None and len(batches) == stop_after:
            break
    return batches, dl.state_dict()


def flatten(batches):
    return [i for batch in batches for i in batch]


def _as_list(batch):
    if isinstance(batch, (list, tuple)):
        batch = batch[0]
    return batch.tolist()


def check_resume(input_fn, stops, max_steps=11, **kwargs):
    full, _ = run(input_fn, max_steps=max_steps, **kwargs)
    assert len(full) == max_steps
    for k in stops:
        head, state = run(input_fn, stop_after=k, max_steps=max_steps, **kwargs)
        assert state["appliance_step"] == k and state["worker_step"] == k
        # max_steps counts from the saved appliance_step: the tail is the rest of the run.
        tail, _ = run(input_fn, state=state, max_steps=max_steps, user_rng_draws=7, **kwargs)
        assert head + tail == full, f"resume after batch {k} diverged"
    return full


# -- restart -------------------------------------------------------------------------


def test_resume_shuffled_torch_loader_across_epoch_wrap():
    full = check_resume(shuffled_fn, stops=[1, 3, 4, 5, 9])
    # The loader was iterated again after 4 batches, with a new shuffle.
    assert sorted(flatten(full[:4])) == list(range(N))
    assert sorted(flatten(full[4:8])) == list(range(N))
    assert full[:4] != full[4:8]


def test_resume_with_user_generator():
    check_resume(lambda: shuffled_fn(generator_seed=7), stops=[2, 4, 6])


def test_resume_with_worker_processes():
    # Two worker processes per pass are slow to start: two stop points only, one
    # mid-pass and one exactly at the end of a pass.
    full = check_resume(lambda: shuffled_fn(num_workers=2), stops=[4, 6], max_steps=9)
    assert full[:8] == run(shuffled_fn, max_steps=8)[0], "workers do not change the order"


class CountingDataset(Dataset):
    """Counts __getitem__ calls, to show a restore loads no skipped sample."""

    def __init__(self, n):
        self.n = n
        self.loads = 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.loads += 1
        return torch.tensor(i)


def test_resume_with_distributed_sampler_skips_without_loading():
    datasets = []

    def input_fn():
        ds = CountingDataset(N)
        datasets.append(ds)
        return TorchDataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, seed=3))

    full = check_resume(input_fn, stops=[3, 5, 7], max_steps=12)
    assert sorted(flatten(full[:5])) == list(range(N))
    _, state = run(input_fn, stop_after=3, max_steps=12)
    tail, _ = run(input_fn, state=state, max_steps=12)
    assert datasets[-1].loads == 2 * len(tail), "the restored loader loaded skipped samples"


def test_resume_with_distributed_batch_sampler_and_steps_per_epoch():
    def input_fn():
        ds = TensorDataset(torch.arange(N))
        return TorchDataLoader(ds, batch_sampler=DistributedSampler(ds, batch_size=2))

    # steps_per_epoch=3 truncates each pass to 3 of its 5 batches.
    full = check_resume(input_fn, stops=[2, 3, 4], steps_per_epoch=3, num_epochs=4, max_steps=12)
    assert len(full) == 12
    for e in range(4):
        epoch = full[3 * e : 3 * e + 3]
        assert len({i for b in epoch for i in b}) == 6


class StatefulLoader:
    """A loader that keeps its own position (its state is trusted over replay)."""

    def __init__(self):
        self.pos = 0
        self.epoch = 0

    def __iter__(self):
        while self.pos < 5:
            self.pos += 1
            yield torch.tensor([100 * self.epoch + self.pos])
        self.pos = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, sd):
        self.pos = sd["pos"]


def test_resume_stateful_loader_uses_its_state():
    full = check_resume(StatefulLoader, stops=[2, 5, 7])
    assert full[:6] == [[1], [2], [3], [4], [5], [101]]
    _, state = run(StatefulLoader, stop_after=2, max_steps=11)
    assert state["user_state"] == {"loader": {"pos": 2}}


class AugmentedDataset(Dataset):
    """Draws torch randomness per sample and keeps a state of its own (a visit count)."""

    def __init__(self):
        self.visits = 0

    def __len__(self):
        return N

    def __getitem__(self, i):
        self.visits += 1
        return torch.tensor(i * 1000 + self.visits % 7) + torch.randint(0, 100, ())

    def state_dict(self):
        return {"visits": self.visits}

    def load_state_dict(self, sd):
        self.visits = sd["visits"]


def test_resume_dataset_state_and_in_process_randomness():
    def input_fn():
        return TorchDataLoader(AugmentedDataset(), batch_size=3, shuffle=True)

    check_resume(input_fn, stops=[2, 4, 6])
    _, state = run(input_fn, stop_after=2, max_steps=11)
    assert state["user_state"] == {"dataset": {"visits": 0}}, "state as of the pass start"


# -- iteration -----------------------------------------------------------------------


class EpochRecordingSampler(torch.utils.data.Sampler):
    def __init__(self):
        super().__init__()
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(range(4))

    def __len__(self):
        return 4


def test_iteration_yields_num_steps_and_calls_set_epoch():
    sampler = EpochRecordingSampler()
    ds = TensorDataset(torch.arange(4))
    dl = DataLoader(lambda bs: TorchDataLoader(ds, batch_size=bs, sampler=sampler), 2, num_steps=5)
    assert len(dl) == 5 and dl.num_steps == 5
    assert [b[0].tolist() for b in dl] == [[0, 1], [2, 3]] * 2 + [[0, 1]]
    assert sampler.epochs == [0, 1, 2]
    # A second iteration continues the data stream for another num_steps.
    assert [b[0].tolist() for b in dl] == [[2, 3], [0, 1], [2, 3], [0, 1], [2, 3]]


def test_kwargs_go_to_input_fn_and_grad_accum_counts_batches():
    seen = {}

    def input_fn(a, *, b):
        seen.update(a=a, b=b)
        return [torch.ones(2)] * 6

    dl = DataLoader(input_fn, 1, b=2, num_epochs=2, grad_accum_steps=2)
    assert seen == {"a": 1, "b": 2}
    assert dl.num_steps == 6 and len(dl) == 12
    assert len(list(dl)) == 12
    assert dl.state_dict()["appliance_step"] == 6
    assert dl.state_dict()["samples_streamed"] == 24
    # A pass of 5 batches gives 2 whole steps; the fifth batch is dropped so
    # that no step spans two epochs.
    odd = DataLoader(
        lambda: [torch.tensor([i]) for i in range(5)], num_epochs=2, grad_accum_steps=2
    )
    assert [int(b) for b in odd] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_dataloader_argument_errors():
    with pytest.raises(TypeError, match="wrap it: DataLoader\\(lambda: loader"):
        DataLoader([1, 2, 3], num_steps=1)
    with pytest.raises(TypeError, match="must return a torch DataLoader or another iterable"):
        DataLoader(lambda: 3, num_steps=1)
    dl = DataLoader(lambda: iter([torch.ones(1)]), num_steps=3)
    with pytest.raises(ValueError, match="one-shot iterator"):
        list(dl)


def test_load_state_dict_errors():
    dl = DataLoader(shuffled_fn, num_steps=3)
    state = dl.state_dict()
    next(iter(dl))
    with pytest.raises(RuntimeError, match="must be called before iteration starts"):
        dl.load_state_dict(state)

    bad = {**state, "extra": 1}
    del bad["samples_streamed"]
    with pytest.raises(
        ValueError, match=r"missing key\(s\) \['samples_streamed'\].*unexpected key"
    ):
        DataLoader(shuffled_fn, num_steps=3).load_state_dict(bad)
    with pytest.warns(UserWarning, match="loading what matches"):
        DataLoader(shuffled_fn, num_steps=3).load_state_dict(bad, strict=False)

    with pytest.raises(ValueError, match="saved by streamer 3 but this process is streamer 0"):
        DataLoader(shuffled_fn, num_steps=3).load_state_dict({**state, "wse_id": 3})
    with pytest.raises(ValueError, match="draws from generators"):
        DataLoader(lambda: shuffled_fn(generator_seed=1), num_steps=3).load_state_dict(state)
    with pytest.raises(ValueError, match="loaded DataLoader state is at step 5: max_steps \\(5\\)"):
        DataLoader(shuffled_fn, max_steps=5).load_state_dict({**state, "appliance_step": 5})


def test_state_dict_after_load_is_the_loaded_state():
    _, state = run(shuffled_fn, stop_after=3, max_steps=8)
    dl = DataLoader(shuffled_fn, max_steps=8)
    dl.load_state_dict(state)
    assert _equal(dl.state_dict(), state)
    assert len(dl) == 5


def test_load_state_dict_replay_mismatch_is_reported():
    _, state = run(shuffled_fn, stop_after=3, max_steps=8)
    dl = DataLoader(lambda: shuffled_fn(batch_size=5), max_steps=8)
    dl.load_state_dict(state)
    with pytest.raises(ValueError, match=r"has only 2 there\. Build the DataLoader with the same"):
        next(iter(dl))


def test_aggregated_state_round_trip_and_load():
    _, state = run(shuffled_fn, stop_after=3, max_steps=8)
    other = {**state, "wse_id": 1, "samples_streamed": 5}
    agg = aggregate_state_dict([other, state])
    assert agg["samples_streamed"] == state["samples_streamed"] + 5
    assert agg["appliance_step"] == 3 and agg["num_csx"] == 1
    back = deaggregate_state_dict(agg)
    assert [w["wse_id"] for w in back] == [0, 1]
    assert _equal(back, [state, other])
    assert DataLoader.aggregate_state_dict is aggregate_state_dict

    with pytest.raises(ValueError, match=r"appear more than once"):
        aggregate_state_dict([state, state])
    with pytest.raises(ValueError, match="disagree on appliance_step"):
        aggregate_state_dict([state, {**other, "appliance_step": 4}])
    with pytest.raises(ValueError, match="missing key"):
        deaggregate_state_dict({"worker_states": [state]})
    # One streamer here: without a DistributedSampler a two-worker state cannot be
    # mapped (test_state_moves_between_rank_counts has one that can), a one-worker one loads.
    with pytest.raises(ValueError, match=r"position of 2 streamer\(s\) .* but this run has 1"):
        DataLoader(shuffled_fn, max_steps=8).load_state_dict(agg)
    full, _ = run(shuffled_fn, max_steps=8)
    tail, _ = run(shuffled_fn, state=aggregate_state_dict([state]), max_steps=8)
    assert tail == full[3:]


def _equal(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def test_state_records_worker_identity_from_config():
    with pytest.warns(UserWarning, match="configure starts no processes|one of 1 rank"):
        cstorch.configure(num_csx=2, num_workers_per_csx=3)
    _, state = run(shuffled_fn, stop_after=2, max_steps=8)
    assert {
        k: state[k] for k in ("local_worker_id", "num_csx", "num_workers_per_csx", "wse_id")
    } == {
        "local_worker_id": 0,
        "num_csx": 2,
        "num_workers_per_csx": 3,
        "wse_id": 0,
    }
    assert state["samples_streamed"] == 6


# -- compute_num_steps -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"num_steps": 7}, 7),
        ({"num_steps": 25}, 25),  # more than one pass: the loader is iterated again
        ({"num_steps": 7, "max_steps": 5}, 5),
        ({"num_steps": 7, "max_steps": 20, "initial_step": 16}, 4),
        ({"max_steps": 20, "initial_step": 16}, 4),
        ({"num_epochs": 3}, 30),  # steps_per_epoch defaults to len(dl) == 10
        ({"num_epochs": 3, "steps_per_epoch": 4}, 12),
        ({"num_epochs": 3, "max_steps": 25}, 25),
        ({"num_epochs": 3, "steps_per_epoch": 4, "max_steps": 100, "initial_step": 95}, 5),
        ({"num_epochs": 2, "grad_accum_steps": 3}, 6),  # 10 batches // 3 = 3 steps per epoch
    ],
)
def test_compute_num_steps(kwargs, expected):
    assert compute_num_steps(list(range(10)), **kwargs) == expected


class Unsized:
    def __iter__(self):
        return iter(range(3))


@pytest.mark.parametrize(
    ("dl", "kwargs", "error", "message"),
    [
        (range(10), {"num_steps": 5, "num_epochs": 1}, ValueError, "mutually exclusive"),
        (range(10), {}, ValueError, "No step count given: pass num_steps, max_steps or num_epochs"),
        (range(10), {"steps_per_epoch": 3}, ValueError, "No step count given"),
        (
            range(10),
            {"num_epochs": 1, "steps_per_epoch": 11},
            ValueError,
            r"steps_per_epoch \(11\) exceeds the length of the dataloader \(10 batches\).*<= 10",
        ),
        (
            Unsized(),
            {"num_epochs": 2},
            ValueError,
            r"num_epochs \(2\) needs the length of an epoch.*Unsized does not define __len__.*Pass steps_per_epoch",
        ),
        (
            range(10),
            {"max_steps": 5, "initial_step": 5},
            ValueError,
            r"max_steps \(5\) must be greater than initial_step \(5\).*Raise max_steps above 5",
        ),
        (range(10), {"max_steps": 5, "initial_step": 9}, ValueError, "no steps left"),
        (
            range(2),
            {"num_epochs": 1, "grad_accum_steps": 3},
            ValueError,
            r"shorter than one step of grad_accum_steps=3",
        ),
        (range(10), {"num_steps": 0}, ValueError, "num_steps must be >= 1, got 0"),
        (range(10), {"num_steps": 2.0}, TypeError, "num_steps must be an int, got float"),
        (range(10), {"num_epochs": True}, TypeError, "num_epochs must be an int, got bool"),
        (range(10), {"num_steps": 1, "initial_step": -1}, ValueError, "initial_step must be >= 0"),
        (
            range(10),
            {"num_steps": 1, "grad_accum_steps": 0},
            ValueError,
            "grad_accum_steps must be >= 1",
        ),
    ],
)
def test_compute_num_steps_errors(dl, kwargs, error, message):
    with pytest.raises(error, match=message):
        compute_num_steps(dl, **kwargs)


def test_compute_num_steps_unsized_loader():
    assert compute_num_steps(Unsized(), num_steps=8) == 8
    assert compute_num_steps(Unsized(), num_epochs=2, steps_per_epoch=3) == 6
    # The DataLoader iterates it again when it runs out.
    assert [int(x) for x in DataLoader(Unsized, num_steps=8)] == [0, 1, 2, 0, 1, 2, 0, 1]


def test_an_epoch_of_a_cstorch_dataloader_is_a_pass_over_its_data():
    """As ModelZoo code calls it: 12 batches of data in a loader asked for 3 steps."""
    batches = lambda: TorchDataLoader(TensorDataset(torch.arange(48)), batch_size=4)  # noqa: E731
    dl = DataLoader(batches, num_steps=3)
    assert compute_num_steps(dl, num_epochs=2) == 2 * len(batches())


# -- DistributedSampler -----------------------------------------------------------------


def interleave(shares):
    out = []
    for i in range(max(len(s) for s in shares)):
        out.extend(s[i] for s in shares if i < len(s))
    return out


@pytest.mark.parametrize("batch_size", [None, 3])
@pytest.mark.parametrize("shuffle", [True, False])
def test_distributed_sampler_order_independent_of_shards(batch_size, shuffle):
    ds = range(48)  # divides into 4 shards of batches of 3
    orders = {}
    for shards in (1, 2, 4):
        samplers = [
            DistributedSampler(
                ds, shuffle=shuffle, seed=5, batch_size=batch_size, num_shards=shards, shard_index=r
            )
            for r in range(shards)
        ]
        for epoch in (0, 1):
            for s in samplers:
                s.set_epoch(epoch)
            shares = [list(s) for s in samplers]
            assert all(len(share) == len(s) for share, s in zip(shares, samplers))
            orders[shards, epoch] = interleave(shares)
    for epoch in (0, 1):
        assert orders[1, epoch] == orders[2, epoch] == orders[4, epoch]
        flat = [i for item in orders[1, epoch] for i in (item if batch_size else [item])]
        assert sorted(flat) == list(range(48))
    assert (orders[1, 0] != orders[1, 1]) == shuffle, "reshuffled per epoch only when shuffling"
    again = DistributedSampler(ds, shuffle=shuffle, seed=5, batch_size=batch_size, shard=False)
    assert list(again) == orders[1, 0], "deterministic from seed and epoch"


def test_distributed_sampler_start_index_resumes_on_other_shard_count():
    ds = range(24)
    reference = []
    for epoch in range(3):
        s = DistributedSampler(ds, seed=1, batch_size=2, shard=False)
        s.set_epoch(epoch)
        reference += list(s)
    # 2 shards stream 5 global steps (2 batches of 2 each), then 3 shards take over.
    streamed = 5 * 2 * 2
    samplers = [
        DistributedSampler(
            ds, seed=1, batch_size=2, start_index=streamed, num_shards=3, shard_index=r
        )
        for r in range(3)
    ]
    resumed = []
    for epoch in range(2):
        for s in samplers:
            s.set_epoch(epoch)
        resumed += interleave([list(s) for s in samplers])
    assert resumed[: len(reference) - 10] == reference[10:][: len(resumed)]


def test_distributed_sampler_tail_rules_and_state():
    ds = range(10)
    dropped = [
        list(DistributedSampler(ds, shuffle=False, num_shards=4, shard_index=r)) for r in range(4)
    ]
    assert dropped == [[0, 4], [1, 5], [2, 6], [3, 7]]
    padded = [
        list(
            DistributedSampler(
                ds, shuffle=False, drop_last=False, pad_last=True, num_shards=4, shard_index=r
            )
        )
        for r in range(4)
    ]
    assert padded == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    kept = [
        list(DistributedSampler(ds, shuffle=False, drop_last=False, num_shards=4, shard_index=r))
        for r in range(4)
    ]
    assert kept == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]
    assert list(DistributedSampler(range(3), shuffle=False, num_samples=7, batch_size=2)) == [
        [0, 1],
        [2, 0],
        [1, 2],
    ]

    s = DistributedSampler(ds, seed=2, num_shards=2, shard_index=1)
    s.set_epoch(3)
    it = iter(s)
    head = [next(it) for _ in range(2)]
    state = s.state_dict()
    rest = list(it)
    fresh = DistributedSampler(ds, seed=2, num_shards=2, shard_index=1)
    fresh.load_state_dict(state)
    assert len(fresh) == len(rest) and list(fresh) == rest and len(head) == 2
    with pytest.raises(ValueError, match="different order \\(seed: saved 2, here 9\\)"):
        DistributedSampler(ds, seed=9, num_shards=2, shard_index=1).load_state_dict(state)


def test_distributed_sampler_state_moves_to_another_layout():
    ds = range(50)  # rounds of 6 samples: epochs of 48
    reference = flatten(DistributedSampler(ds, seed=4, batch_size=6, shard=False))
    # Two shards with batches of 3 yield 3 batches each (3 rounds, 18 samples) and save.
    saver = DistributedSampler(ds, seed=4, batch_size=3, num_shards=2, shard_index=1)
    it = iter(saver)
    assert [next(it) for _ in range(3)] == [reference[i : i + 3] for i in (3, 9, 15)]
    state = saver.state_dict()
    for batch_size, shards in ((6, 1), (2, 3), (1, 6)):
        samplers = [
            DistributedSampler(ds, seed=4, batch_size=batch_size, num_shards=shards, shard_index=r)
            for r in range(shards)
        ]
        for s in samplers:
            s.load_state_dict(state)
        assert flatten(interleave([list(s) for s in samplers])) == reference[18:], shards
    # 18 samples are not whole rounds of 12: no shard would start on the next sample.
    with pytest.raises(ValueError, match=r"18 samples into a pass .* rounds of 12 samples"):
        DistributedSampler(ds, seed=4, batch_size=3, num_shards=4).load_state_dict(state)
    # Rounds of 5 make epochs of 50 samples, another sequence than the saved 48.
    with pytest.raises(ValueError, match="epochs hold 48 samples, but this sampler's hold 50"):
        DistributedSampler(ds, seed=4, batch_size=1, num_shards=5).load_state_dict(state)
    with pytest.raises(ValueError, match="different order \\(dataset_len: saved 50, here 60"):
        DistributedSampler(range(60), seed=4, batch_size=6, num_samples=50).load_state_dict(state)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"pad_last": True}, ValueError, "Pass drop_last=False together with pad_last=True"),
        ({"shard": False, "num_shards": 2}, ValueError, "shard=False"),
        (
            {"num_shards": 2, "shard_index": 2},
            ValueError,
            r"shard_index \(2\) must be < num_shards \(2\)",
        ),
        ({"batch_size": 4, "start_index": 6}, ValueError, "must be a multiple of batch_size"),
        ({"batch_size": 20}, ValueError, "gives no full share"),
        ({"seed": -1}, ValueError, "seed must be >= 0"),
    ],
)
def test_distributed_sampler_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        DistributedSampler(range(10), **kwargs)


def test_distributed_sampler_needs_sized_dataset():
    with pytest.raises(TypeError, match="needs a dataset with a length"):
        DistributedSampler(Unsized())


# -- SyntheticDataset ----------------------------------------------------------------------


def test_synthetic_dataset():
    spec = {
        "x": torch.empty(2, 3, dtype=torch.float16, device="meta"),
        "y": (torch.tensor([1, 2]), 5),
    }
    ds = SyntheticDataset(spec, num_samples=4)
    assert len(ds) == 4
    sample = ds[3]
    assert sample["x"].dtype == torch.float16 and torch.equal(
        sample["x"], torch.zeros(2, 3, dtype=torch.float16)
    )
    assert torch.equal(sample["y"][0], torch.tensor([1, 2])) and sample["y"][1] == 5
    sample["y"][0].add_(10)
    assert torch.equal(ds[0]["y"][0], torch.tensor([1, 2])), "samples are independent copies"
    with pytest.raises(IndexError):
        ds[4]
    batches = list(TorchDataLoader(ds, batch_size=2))
    assert len(batches) == 2 and batches[0]["x"].shape == (2, 2, 3)

    infinite = SyntheticDataset(torch.ones(3))
    with pytest.raises(TypeError, match="infinite"):
        len(infinite)
    dl = DataLoader(lambda: TorchDataLoader(infinite, batch_size=4), num_steps=3)
    assert [b.shape for b in dl] == [(4, 3)] * 3
    with pytest.raises(TypeError, match="sample_spec\\['a'\\] is a str"):
        SyntheticDataset({"a": "text"})


# -- streaming helpers -----------------------------------------------------------------------


class FakeDist:
    def __init__(self, world, rank):
        self.world, self.rank = world, rank

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def get_world_size(self):
        return self.world

    def get_rank(self):
        return self.rank

    def all_gather(self, out, tensor):
        # Ranks are simulated one after another: every other rank is taken to agree
        # (the comparison itself runs on real ranks: test_data_parallel_api.py).
        for t in out:
            t.copy_(tensor)


def test_streaming_helpers(monkeypatch):
    assert (num_streamers(), get_streaming_rank(), is_streamer()) == (1, 0, True)
    assert get_streaming_batch_size(6) == 6
    monkeypatch.setattr(streaming, "dist", FakeDist(4, 2))
    assert (num_streamers(), get_streaming_rank(), is_streamer()) == (4, 2, True)
    assert get_streaming_batch_size(8) == 2
    with pytest.raises(
        ValueError, match=r"global batch size 6 does not divide by the number of streamers \(4"
    ):
        get_streaming_batch_size(6)
    with pytest.raises(TypeError, match="global_batch must be an int"):
        get_streaming_batch_size(4.0)
    # The sampler shards by the streaming rank by default.
    s = DistributedSampler(range(8), shuffle=False)
    assert (s.num_shards, s.shard_index, list(s)) == (4, 2, [2, 6])


def test_reference_import_path():
    assert cstorch.utils.data.DataLoader is DataLoader
    assert set(weightstream.utils.data.__all__) >= {
        "DataLoader",
        "compute_num_steps",
        "DistributedSampler",
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DataLoader(shuffled_fn, num_steps=1).state_dict()


# -- another number of ranks -----------------------------------------------------------------
#
# Ranks are simulated one after another in this process (FakeDist): each builds
# its loader, streams its share and saves its state, as the processes of a run
# would. What is compared: the sample ids each rank's loader yields after a
# resume on another number of ranks, against an uninterrupted run on that
# number of ranks.

G = 12  # global batch: divides by 1, 2, 3 and 4 ranks


class Indices(Dataset):
    """Sample i is the tensor i: a batch shows which samples it holds."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor(i)


def ordered_fn(global_batch=G, seed=7, n=100, num_workers=0):
    """This rank's share of one global order, per-rank batch = global batch / ranks.

    100 samples in batches of 12: passes of 8 global batches (the tail of 4 is dropped).
    """
    ds = Indices(n)
    per_rank = get_streaming_batch_size(global_batch)
    sampler = DistributedSampler(ds, seed=seed, batch_size=per_rank)
    return TorchDataLoader(ds, batch_sampler=sampler, num_workers=num_workers)


def run_ranks(monkeypatch, ranks, input_fn, stop_after=None, state=None, max_steps=20):
    """Each of `ranks` streamers runs `run`; their batches, and the state a checkpoint keeps."""
    per_rank, states = [], []
    real = streaming.dist
    for r in range(ranks):
        monkeypatch.setattr(streaming, "dist", FakeDist(ranks, r))
        batches, worker_state = run(
            input_fn, stop_after=stop_after, state=state, max_steps=max_steps
        )
        per_rank.append(batches)
        states.append(worker_state)
    monkeypatch.setattr(streaming, "dist", real)
    # As the trainer stores it: one worker's state, or all of them aggregated.
    return per_rank, states[0] if ranks == 1 else aggregate_state_dict(states)


def global_batches(per_rank):
    """The global batches: rank r holds the r-th slice of each (Note [global order])."""
    return [flatten(parts) for parts in zip(*per_rank)]


@pytest.mark.parametrize(("saved_ranks", "ranks"), [(2, 1), (1, 2), (4, 2), (2, 3)])
@pytest.mark.parametrize("stop", [5, 8, 11])  # mid pass, at the end of pass 0, mid pass 1
def test_state_moves_between_rank_counts(monkeypatch, saved_ranks, ranks, stop):
    uninterrupted, _ = run_ranks(monkeypatch, ranks, ordered_fn)
    saved_run, _ = run_ranks(monkeypatch, saved_ranks, ordered_fn)
    # One order whatever the number of ranks: the premise of moving a position.
    assert global_batches(saved_run) == global_batches(uninterrupted)
    assert len(set(flatten(global_batches(uninterrupted)[:8]))) == 96

    head, state = run_ranks(monkeypatch, saved_ranks, ordered_fn, stop_after=stop)
    epoch, batches = divmod(stop, 8)
    assert state["global_position"] == {
        "epoch": epoch,
        "batches_in_epoch": batches,
        "samples_in_epoch": batches * G,
        "global_batch_size": G,
        "shuffle": True,
        "shuffle_seed": 7,
        "dataset_len": 100,
        "num_samples": 100,
        "drop_last": True,
        "pad_last": False,
        "data_fingerprint": None,  # a plain TensorDataset has none
    }
    tail, after = run_ranks(monkeypatch, ranks, ordered_fn, state=state)
    for r in range(ranks):
        assert tail[r] == uninterrupted[r][stop:], f"rank {r} of {ranks} after the resume"
    assert global_batches(head) + global_batches(tail) == global_batches(saved_run)
    # Samples streamed stay the global count, shared out among the new ranks.
    assert after["samples_streamed"] == 20 * G


def test_state_moves_between_rank_and_worker_counts(monkeypatch):
    # A map-style loader is ordered by its sampler in this process: worker
    # processes change nothing, neither across rank counts nor on the same one.
    with_workers = lambda: ordered_fn(num_workers=2)  # noqa: E731
    uninterrupted, _ = run_ranks(monkeypatch, 1, ordered_fn, max_steps=8)
    _, state = run_ranks(monkeypatch, 2, ordered_fn, stop_after=3, max_steps=8)
    tail, after = run_ranks(monkeypatch, 1, with_workers, state=state, max_steps=8)
    assert tail == [uninterrupted[0][3:]]
    assert after["layout"] == {"num_streamers": 1, "input_workers": 2}


def test_state_of_another_global_batch_or_order_is_refused(monkeypatch):
    _, state = run_ranks(monkeypatch, 2, ordered_fn, stop_after=3)
    cases = [
        (
            1,
            {"global_batch": 8},
            r"global batch size: saved 12, here 8\).*keep the global batch "
            r"at 12 samples whatever the number of ranks",
        ),
        # The same number of ranks with a smaller per-rank batch is a smaller global batch too.
        (2, {"global_batch": 8}, r"global batch size: saved 12, here 8\)"),
        (1, {"seed": 8}, r"shuffle seed: saved 7, here 8\).*shuffle=True, seed=7"),
        (2, {"seed": 8}, r"shuffle seed: saved 7, here 8\)"),
        (
            1,
            {"n": 90},
            r"dataset length: saved 100, here 90; samples per epoch: saved 100, "
            r"here 90\).*read the same data",
        ),
    ]
    for ranks, settings, message in cases:
        monkeypatch.setattr(streaming, "dist", FakeDist(ranks, 0))
        for strict in (True, False):  # not a key mismatch: no strict=False loads it anyway
            dl = DataLoader(lambda: ordered_fn(**settings), max_steps=20)  # noqa: B023
            with pytest.raises(ValueError, match=message):
                dl.load_state_dict(state, strict=strict)


def test_state_without_global_position_stays_on_its_rank_count(monkeypatch):
    _, state = run_ranks(monkeypatch, 2, ordered_fn, stop_after=3)
    # As saved before the global position was recorded: the per-rank states still
    # load on two ranks, but cannot be mapped onto one.
    old = {k: v for k, v in state.items() if k != "global_position"}
    old["worker_states"] = [
        {k: v for k, v in w.items() if k not in ("layout", "global_position")}
        for w in state["worker_states"]
    ]
    tail, _ = run_ranks(monkeypatch, 2, ordered_fn, state=old)
    uninterrupted, _ = run_ranks(monkeypatch, 2, ordered_fn)
    assert tail == [batches[3:] for batches in uninterrupted]
    with pytest.raises(ValueError, match=r"records no global position.*Resume on 2 rank"):
        DataLoader(ordered_fn, max_steps=20).load_state_dict(old)


def test_rank_0s_state_of_shared_global_batches_resumes_every_rank(monkeypatch):
    """An input_fn that does not shard by rank: every rank iterates the same global
    batches and takes its share, so rank 0's state (what a script saves with
    cstorch.save on rank 0, as examples/train_gpt_ws.py does) is every rank's position.
    Rank 1 loads it and continues with its own share, as uninterrupted."""
    fn = lambda: shuffled_fn(batch_size=4)  # noqa: E731
    uninterrupted, _ = run_ranks(monkeypatch, 2, fn, max_steps=8)
    real = streaming.dist
    monkeypatch.setattr(streaming, "dist", FakeDist(2, 0))
    _, rank0_state = run(fn, stop_after=3, max_steps=8)
    for rank in (0, 1):
        monkeypatch.setattr(streaming, "dist", FakeDist(2, rank))
        tail, _ = run(fn, state=rank0_state, max_steps=8)
        assert tail == uninterrupted[rank][3:], rank
    monkeypatch.setattr(streaming, "dist", real)


class WorkerShards(torch.utils.data.IterableDataset):
    """Deals samples out to the input workers itself: its order depends on their number."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(worker, 12, workers))


def test_iterable_dataset_state_needs_the_same_workers_and_ranks(monkeypatch):
    def input_fn(num_workers=0):
        return TorchDataLoader(WorkerShards(), batch_size=2, num_workers=num_workers)

    _, state = run(input_fn, stop_after=2, max_steps=4)
    assert state["global_position"] is None and state["layout"]["input_workers"] == 0
    with pytest.raises(ValueError, match=r"num_workers=0 .* num_workers=2; its dataset is an Iter"):
        DataLoader(lambda: input_fn(2), max_steps=4).load_state_dict(state)
    monkeypatch.setattr(streaming, "dist", FakeDist(2, 1))
    with pytest.raises(ValueError, match=r"position of 1 streamer.*this run has 2.*Resume on 1"):
        DataLoader(input_fn, max_steps=4).load_state_dict(state)


@pytest.mark.parametrize(
    ("n", "parts"), [(18, [[4, 4, 1], [4, 4, 1]]), (19, [[4, 4, 2], [4, 4, 1]])]
)
def test_an_evaluations_short_last_round_is_dealt_out_evenly(n, parts):
    """Note [an uneven last round]: 2 shards of batches of 4, 2 or 3 samples left: one
    part each (not one batch for shard 0 alone), and every sample once, in order."""
    ds = list(range(n))
    shards = [
        DistributedSampler(
            ds, shuffle=False, batch_size=4, drop_last=False, num_shards=2, shard_index=r,
            even_last_round=True,
        )
        for r in range(2)
    ]  # fmt: skip
    batches = [list(s) for s in shards]
    assert [[len(b) for b in bs] for bs in batches] == parts
    assert [len(s) for s in shards] == [len(bs) for bs in batches]
    assert [i for b in interleave(batches) for i in b] == ds
    training = DistributedSampler(ds, shuffle=False, batch_size=4, drop_last=False, num_shards=2,
                                  shard_index=1)  # fmt: skip
    assert [len(b) for b in training] == [4, 4]  # training's rounds stay whole batches


def test_an_evaluations_last_round_of_fewer_samples_than_shards_is_refused():
    with pytest.raises(ValueError, match=r"An epoch of 17 samples leaves 1 for its last global "
                       r"batch .*fewer than the shards: 1 of them would have no batch"):  # fmt: skip
        DistributedSampler(range(17), batch_size=4, drop_last=False, num_shards=2,
                           shard_index=0, even_last_round=True)  # fmt: skip
