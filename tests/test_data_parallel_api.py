"""Data parallel through the API: a seed-style script on 1, 2 and 4 ranks.

``tests/scripts/dp_seed_style.py`` is written as for one device: it never calls
``init_process_group`` and its input_fn makes global batches. Started by
``torchrun`` or ``weightstream launch --num_csx N`` it must join the ranks by
itself, give each rank its share of every batch, reduce the gradients in the
backward and clip by the whole model's norm, for the replicated and the
sharded store, SGD and AdamW, with and without dynamic loss scaling, and
with gradient accumulation (micro-batches under ``no_sync()``, or two reduced
backwards before one step); the
checkpoint it writes with ``cstorch.save(model.state_dict())`` must equal the
one-rank run's.

Tolerance: the N-rank run differs from the one-rank run only in the order of
the sums. One rank sums the per-token losses of the whole batch in one
reduction; N ranks sum their shares and average the N gradients. That moves
the last bits of the fp32 gradients (relative 1e-7 per step); clipping and
AdamW's normalisation carry them into the weights at the scale of an update
(lr 0.01): measured up to 2.4e-7 after 4 steps. WEIGHT_ATOL allows 8x that.
A wrong step is far outside it: clipping by each shard's own norm (the defect
this replaces) moves these weights by 1.1e-3 (SGD) and 4.2e-3 (AdamW).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from weightstream import checkpoint as ckpt

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "dp_seed_style.py"
WEIGHT_ATOL = 2e-6
CONFIGS = [
    "replicated-SGD",
    "replicated-AdamW",
    "sharded-SGD",
    "sharded-AdamW",
    "sharded-AdamW-no_sync",
    "sharded-SGD-twice",
    "replicated-AdamW-twice",
    "replicated-AdamW-buckets",
    "sharded-SGD-no_sync-buckets",
]


def _run(out: Path, ranks: int, launcher: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", WEIGHTSTREAM_DIST_TIMEOUT="60")
    if ranks == 1:
        cmd = [sys.executable, str(SCRIPT), str(out)]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={ranks}", str(SCRIPT), str(out)]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "weightstream", "launch", "--num_csx", str(ranks),
               str(SCRIPT), str(out)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache: dict = {}

    def get(ranks: int, launcher: str = "launch") -> tuple[Path, dict]:
        key = (ranks, launcher if ranks > 1 else "none")
        if key not in cache:
            out = tmp_path_factory.mktemp(f"dp{ranks}{key[1]}")
            cache[key] = (out, _run(out, ranks, launcher))
        return cache[key]

    return get


def _assert_states_close(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for key, w in want.items():
        g = got[key]
        if isinstance(w, torch.Tensor):
            assert (g.shape, g.dtype) == (w.shape, w.dtype), f"{what}: {key}"
            torch.testing.assert_close(g, w, rtol=0, atol=WEIGHT_ATOL, msg=f"{what}: {key}")
        elif isinstance(w, dict):
            _assert_states_close(g, w, f"{what}: {key}")
        else:
            assert g == w, f"{what}: {key}"


# 15-22 s each on 2 cores: the default suite keeps two ranks under weightstream launch,
# which is torchrun's machinery; -m slow the rest.
@pytest.mark.parametrize(
    ("ranks", "launcher"),
    [
        (2, "launch"),
        pytest.param(2, "torchrun", marks=pytest.mark.slow),
        pytest.param(4, "launch", marks=pytest.mark.slow),
        pytest.param(4, "torchrun", marks=pytest.mark.slow),
    ],
)
def test_seed_style_script_on_n_ranks_ends_with_the_one_rank_weights(runs, ranks, launcher):
    one_dir, _ = runs(1)
    out, records = runs(ranks, launcher)
    for rank, record in records.items():
        # The API joined the ranks by itself, and fed each rank its share.
        assert record["initialized"] and record["world"] == ranks, rank
        for name in CONFIGS:
            assert record["runs"][name]["shapes"] == [[16 // ranks, 6]] * 4, (rank, name)
    for name in CONFIGS:
        want = dict(ckpt.load(one_dir / f"{name}.mdl", map_location="cpu"))
        got = dict(ckpt.load(out / f"{name}.mdl", map_location="cpu"))
        # Whole tensors: a sharded model's state_dict() is never placeholders.
        for key, t in got["model"].items():
            assert t.untyped_storage().nbytes() >= t.numel() * t.element_size(), key
        _assert_states_close(got["model"], want["model"], f"{name} model")
        _assert_states_close(
            got["optimizer"]["state"], want["optimizer"]["state"], f"{name} optimizer"
        )


@pytest.mark.parametrize("name", CONFIGS[:4])
def test_a_units_reduction_starts_before_the_backward_of_the_units_before_it_ends(runs, name):
    """Event order of the last step on 2 ranks: SwarmX reduces each unit's gradients
    as its backward ends, while the backward goes on through the units before it."""
    _, records = runs(2)
    result = records[0]["runs"][name]
    units, events = result["units"], [tuple(e) for e in result["events"]]
    position = {event: i for i, event in enumerate(events)}
    checked = 0
    # Every block's reduction (units[1:-2]: the embedding shares its bucket with the
    # tied head, which completes last) starts before every earlier unit's backward ends.
    for k, unit in enumerate(units[1:-2], start=1):
        start = position[("reduce_start", unit)]
        assert position[("unit_backward_end", unit)] < start, (unit, events)
        for earlier in units[:k]:
            assert start < position[("unit_backward_end", earlier)], (unit, earlier, events)
            checked += 1
    assert checked >= 6


def test_coalesce_merges_neighbours_of_one_owner_up_to_the_cap():
    """Backward order (last unit first): units close a bucket once it holds the cap;
    an owner change closes it too; the result is in forward order."""
    from weightstream.runtime.swarm import coalesce

    sizes = [4, 1, 1, 3, 1, 1]  # numel of each unit's one fp32 parameter (x4 bytes)
    units = [[torch.nn.Parameter(torch.zeros(n))] for n in sizes]
    buckets, owners, taken = coalesce(units, None, cap=8)
    # From the back: [5, 4] holds 8 bytes, [3] 12 bytes, [2, 1] 8 bytes, [0] 16.
    assert taken == [[0], [1, 2], [3], [4, 5]]
    assert owners is None and [len(b) for b in buckets] == [1, 2, 1, 2]
    buckets, owners, taken = coalesce(units, [0, 0, 1, 1, 1, 1], cap=100)
    assert taken == [[0, 1], [2, 3, 4, 5]] and owners == [0, 1]
    assert coalesce(units, None, cap=0)[2] == [[i] for i in range(6)]


def _join_and_exit(rank: int, port: int, out: str) -> None:
    """A rank started as torchrun starts it: the engine's join, then the exit handlers."""
    import atexit

    import torch.distributed as dist

    from weightstream.runtime import swarm

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2"
    )
    joined = swarm.init_from_env(torch.device("cpu"))
    swarm.barrier()
    atexit._run_exitfuncs()  # what the interpreter runs first at exit
    Path(out, f"{rank}.json").write_text(json.dumps([joined, dist.is_initialized()]))


def test_a_process_group_the_api_joined_is_left_before_the_interpreter_shuts_down(tmp_path):
    # gloo's threads outliving the group at interpreter shutdown abort a rank now and
    # then ("terminate called without an active exception", pytorch#190489).
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_join_and_exit, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        assert json.loads((tmp_path / f"{rank}.json").read_text()) == [True, False], rank


def _first_batches(rank: int, port: int, out: str) -> None:
    """Each kind of input_fn on 2 ranks: what the DataLoader yields, or the error."""
    import warnings

    import torch.distributed as dist

    import weightstream as cstorch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    data = torch.arange(32).view(16, 2)
    plain = torch.utils.data.TensorDataset(data)
    input_fns = {
        # one device's script: global batches of 4, shared out (2 rows a rank)
        "global": lambda: torch.utils.data.DataLoader(plain, batch_size=4),
        # its own half of the data, by torch's rank: not one of weightstream's helpers
        "own-slice": lambda: torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(data[dist.get_rank() :: 2]), batch_size=2
        ),
        # a rank's own batches, of different sizes
        "uneven": lambda: torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(data[: 8 + cstorch.utils.data.get_streaming_rank()]),
            batch_size=3 - cstorch.utils.data.get_streaming_rank(),
        ),
    }
    record = {}
    try:
        for name, fn in input_fns.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    batches = [
                        b[0].tolist() for b in cstorch.utils.data.DataLoader(fn, num_steps=2)
                    ]
                    record[name] = {"batches": batches}
                except ValueError as e:
                    record[name] = {"error": str(e)}
            record[name]["warnings"] = [
                str(w.message) for w in caught if "ranks'" in str(w.message)
            ]
    finally:
        dist.destroy_process_group()
    Path(out, f"{rank}.json").write_text(json.dumps(record))


def test_the_first_batch_is_compared_over_the_ranks(tmp_path):
    """Note [rank share]: global batches are shared out; an input_fn that takes its own
    slice by torch's rank (so the DataLoader cannot tell) is stopped on every rank, not
    cut to half its data; ranks' own batches of different sizes are warned of."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_first_batches, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    records = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for rank, record in enumerate(records):
        rows = [
            [[2 * i, 2 * i + 1] for i in range(4 * s + 2 * rank, 4 * s + 2 * rank + 2)]
            for s in range(2)
        ]
        assert record["global"] == {"batches": rows, "warnings": []}, rank
        assert "first batch differs between the data-parallel ranks" in record["own-slice"]["error"]
        assert "get_streaming_rank() inside" in record["own-slice"]["error"]
        assert "batches" in record["uneven"]
        (warning,) = record["uneven"]["warnings"]
        assert "first batches have [3, 2] samples" in warning
