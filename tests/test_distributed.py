"""Data parallel over torch.distributed (gloo, local processes started by the run command).

Two ranks with half the global batch each must equal one rank with the whole
batch. The arithmetic differs only in the order of the sums: one rank sums the
per-token losses of the whole batch in one reduction, two ranks sum each half
and average the two gradients. That changes the last bits of the gradients
(relative 1e-7 per step), which AdamW's normalisation can carry into the
weights at the scale of its update size for near-zero gradients: hence the
stated tolerances below.

A checkpoint saved by N ranks resumes on M ranks: the weights, optimizer,
schedule and scaler are those of the replicated store, the same on every rank,
and the data continues from the run's place in its global sample order
(Note [global position] in weightstream.data.state). The resumed steps differ
from the uninterrupted run's only in the same order of sums, so the same
tolerances hold.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import params_files as pf
import pytest
import torch
import yaml

from weightstream import checkpoint as ckpt
from weightstream.cli.main import main
from weightstream.train.trainer import LOSS_LOG, LossLog

ROOT = Path(__file__).resolve().parent.parent
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 2e-5


def _params(
    tmp_path: Path, model: str, max_steps: int = 6, input_overrides: dict | None = None
) -> Path:
    if model == "gpt2":
        data = pf.text_input(8, 32, shuffle_seed=3)
        model_section = pf.gpt2(2, 32, 32)
    else:
        data = {
            "data_processor": "DigitsProcessor",
            "batch_size": 32,
            "image_size": 28,
            "shuffle_seed": 3,
        }
        model_section = {"name": "fc_mnist"}
    data.update(input_overrides or {})
    return pf.write(
        tmp_path / f"{model}.yaml",
        pf.params(
            train_input=data,
            model=model_section,
            optimizer=pf.adamw(2e-3, weight_decay=0.01),
            runconfig={
                "max_steps": max_steps,
                "checkpoint_steps": 3,
                "log_steps": 1,
                "seed": 5,
                "unit_size_target": 20_000,
            },
        ),
    )


def _losses(model_dir: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(model_dir / "train"))
    acc.Reload()
    return [e.value for e in acc.Scalars("loss")]


def _final_weights(model_dir: Path, step: int) -> dict:
    return dict(ckpt.load(model_dir / f"checkpoint_{step}.mdl", map_location="cpu")["model"])


# The default suite keeps weight streaming on the GPT (its 15 minutes); -m slow the rest.
@pytest.mark.parametrize(
    ("mode", "model"),
    [
        ("weight_streaming", "gpt2"),
        pytest.param("weight_streaming", "fc_mnist", marks=pytest.mark.slow),
        pytest.param("layer_pipelined", "gpt2", marks=pytest.mark.slow),
        pytest.param("layer_pipelined", "fc_mnist", marks=pytest.mark.slow),
    ],
)
def test_two_ranks_equal_one_rank_with_the_whole_batch(tmp_path, model, mode):
    params = _params(tmp_path, model)
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["run", "CPU", "-p", str(params), "--execution_mode", mode]
    assert main([*common, "-o", str(one)]) == 0
    assert main([*common, "-o", str(two), "--num_csx", "2"]) == 0
    l1, l2 = _losses(one), _losses(two)
    assert len(l1) == len(l2) == 6
    torch.testing.assert_close(torch.tensor(l2), torch.tensor(l1), rtol=LOSS_RTOL, atol=0)
    w1, w2 = _final_weights(one, 6), _final_weights(two, 6)
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=WEIGHT_ATOL, msg=k)
    # written once, by rank 0, in the same single-file format
    assert [s for s, _ in ckpt.list_checkpoints(two)] == [3, 6]
    # the estimate beside the run's global rate is of both ranks: twice one rank's plan
    # (rank 0 alone writes the compile directory: its own estimate)
    (plan,) = two.glob("ws_*/plan.json")
    per_rank = json.loads(plan.read_text())["est_samples_per_sec"]
    reported = json.loads((two / "performance" / "performance.json").read_text())
    assert reported["est_samples_per_sec"] == pytest.approx(2 * per_rank, rel=1e-9)
    # ... which the report says; the ranks' collectives, measured on their group when they
    # compiled, are priced in it: each unit's gradients reduced, and on the (CPU default)
    # sharded store its weights broadcast twice by their owner, so every unit pays some
    (report,) = two.glob("ws_*/compile_report.txt")
    assert "note: one rank's step x 2 ranks, its collectives as measured" in report.read_text()
    data = json.loads(plan.read_text())
    assert data["estimate_settings"]["ranks"] == 2
    costs = data["estimate_settings"]["collectives"]
    assert sorted(costs) == ["all_reduce", "broadcast", "reduce"]
    assert all(call > 0 and per_byte >= 0 for call, per_byte in costs.values())
    if mode == "weight_streaming":
        assert data["estimate_settings"]["sharded"] is True
        assert all(u["est_collective_s"] > 0 for u in data["units"])
    else:
        assert data["estimate"]["collective_s"] > 0


@pytest.mark.parametrize(
    ("mode", "saved_ranks", "ranks"),
    [
        # The default suite keeps one direction (its 15 minutes); -m slow the rest.
        pytest.param("weight_streaming", 2, 1, marks=pytest.mark.slow),
        ("weight_streaming", 1, 2),
        pytest.param("layer_pipelined", 2, 1, marks=pytest.mark.slow),
        pytest.param("layer_pipelined", 1, 2, marks=pytest.mark.slow),
    ],
)
def test_checkpoint_resumes_on_another_number_of_ranks(tmp_path, mode, saved_ranks, ranks):
    # FC-MNIST, the cheaper model. 180 training images make epochs of 5 global
    # batches of 32, so the resumed steps 4-6 also cross into epoch 1 (reshuffled).
    params = _params(tmp_path, "fc_mnist", input_overrides={"eval_fraction": 0.9})
    common = ["run", "CPU", "-p", str(params), "--execution_mode", mode]
    full, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    assert main([*common, "-o", str(full), "--num_csx", str(saved_ranks)]) == 0
    resumed.mkdir()
    shutil.copy(full / "checkpoint_3.mdl", resumed)  # resumed from as the newest checkpoint
    assert main([*common, "-o", str(resumed), "--num_csx", str(ranks)]) == 0

    want, got = LossLog.read(full / LOSS_LOG), LossLog.read(resumed / LOSS_LOG)
    assert [s for s, _ in want] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in got] == [4, 5, 6], "continued from the checkpoint's step"
    torch.testing.assert_close(
        torch.tensor([v for _, v in got]),
        torch.tensor([v for _, v in want[3:]]),
        rtol=LOSS_RTOL,
        atol=0,
    )
    w_full, w_resumed = _final_weights(full, 6), _final_weights(resumed, 6)
    assert w_full.keys() == w_resumed.keys()
    for k in w_full:
        torch.testing.assert_close(w_resumed[k], w_full[k], rtol=0, atol=WEIGHT_ATOL, msg=k)
    # The data went on from the global position: every global batch once, and
    # the count of samples streamed is the run's, not one rank's.
    data = ckpt.load(resumed / "checkpoint_6.mdl", map_location="cpu")["dataloader"]
    assert data["samples_streamed"] == 6 * 32
    position = data["global_position"]
    assert (position["epoch"], position["batches_in_epoch"]) == (1, 1)


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


@pytest.mark.slow  # waits 8 s for training and asserts the stop came within 60 s: timing, with the slow tests
def test_killing_one_rank_stops_the_run_naming_it(tmp_path):
    params = _params(tmp_path, "gpt2", max_steps=100_000)
    cmd = [
        sys.executable,
        "-m",
        "weightstream",
        "run",
        "CPU",
        "-p",
        str(params),
        "-o",
        str(tmp_path / "m"),
        "--num_csx",
        "2",
    ]
    env = dict(os.environ, WEIGHTSTREAM_DIST_TIMEOUT="30")
    launcher = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        deadline = time.monotonic() + 120
        while len(_children(launcher.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = _children(launcher.pid)
        assert len(ranks) == 2
        time.sleep(8)  # let training start
        os.kill(ranks[1], signal.SIGKILL)
        killed_at = time.monotonic()
        out, _ = launcher.communicate(timeout=90)
        elapsed = time.monotonic() - killed_at
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    assert elapsed < 60, elapsed
    assert "rank 1 of 2 was killed by signal 9" in out


@pytest.mark.slow  # 10 s on 2 cores, waits 5 s for training: with the slow tests
def test_sigterm_to_the_launcher_stops_the_ranks_and_says_how_to_resume(tmp_path):
    """A scheduler's SIGTERM to ``run --num_csx 2``: exit 143 and one line saying what
    happened and that the same command resumes (torch's agent printed a traceback of
    its SignalException, and the exit code was 1)."""
    params = _params(tmp_path, "gpt2", max_steps=100_000)
    cmd = [sys.executable, "-m", "weightstream", "run", "CPU", "-p", str(params),
           "-o", str(tmp_path / "m"), "--num_csx", "2"]  # fmt: skip
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(_children(launcher.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_children(launcher.pid)) == 2
        time.sleep(5)
        launcher.send_signal(signal.SIGTERM)
        out, _ = launcher.communicate(timeout=90)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "stopped by SIGTERM: the 2 ranks were stopped with it" in out
    assert "Traceback" not in out


@pytest.mark.slow
def test_two_ranks_measure_the_machine_profile_with_a_cold_cache(tmp_path):
    """The compile phase measures this rank's speed with streamed models of its own
    (StreamingConfig(data_parallel=False)): under data parallel they must not join
    the ranks, whose collectives would then differ (measured: a gloo timeout)."""
    params = _params(tmp_path, "gpt2", max_steps=2)
    env = dict(os.environ, WEIGHTSTREAM_CACHE_DIR=str(tmp_path / "cold"))
    env.pop("WEIGHTSTREAM_QUICK_MACHINE_PROFILE", None)
    cmd = [sys.executable, "-m", "weightstream", "run", "CPU", "-p", str(params),
           "-o", str(tmp_path / "m"), "--num_csx", "2"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (tmp_path / "m" / "checkpoint_2.mdl").exists()


@pytest.mark.parametrize(
    "backend, host",
    [
        ("gloo", True),
        ("cpu:gloo,cuda:nccl", True),
        ("nccl", False),
        ("cuda:nccl", False),
    ],
)
def test_a_device_only_backend_is_refused_for_host_collectives(backend, host):
    """Weight streaming reduces host tensors: NCCL alone cannot (swarm.check_host_collectives
    then names the fix)."""
    from weightstream.runtime import swarm

    assert swarm.host_capable(backend) is host


CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(
    "device, local_ranks, devices, backend, indices",
    [
        (CPU, 2, 0, "gloo", None),  # the CPU: gloo, no GPU to choose
        (CUDA, 1, 1, "cpu:gloo,cuda:nccl", [0]),
        (CUDA, 2, 2, "cpu:gloo,cuda:nccl", [0, 1]),  # a GPU each: NCCL for device tensors
        (CUDA, 2, 4, "cpu:gloo,cuda:nccl", [0, 1]),
        (CUDA, 2, 1, "gloo", [0, 0]),  # two ranks on one GPU: NCCL would refuse them
        (CUDA, 4, 2, "gloo", [0, 1, 0, 1]),  # more ranks than GPUs: round robin
    ],
)
def test_ranks_that_share_a_gpu_join_with_gloo_alone(
    device, local_ranks, devices, backend, indices
):
    """Note [ranks sharing a device]: the backend and each local rank's GPU, chosen from
    LOCAL_WORLD_SIZE and the visible GPUs only (the same choice on every rank)."""
    from weightstream.runtime import swarm

    assert swarm.backend_for(device, local_ranks, devices) == backend
    assert swarm.host_capable(backend)  # weight streaming's collectives are host tensors
    if indices is not None:
        assert [swarm.device_index(r, local_ranks, devices) for r in range(local_ranks)] == indices


@pytest.mark.parametrize(
    "device, local_ranks, devices, sharing",
    [(CPU, 2, 0, 1), (CUDA, 2, 2, 1), (CUDA, 2, 4, 1), (CUDA, 2, 1, 2), (CUDA, 3, 2, 2)],
)
def test_ranks_sharing_a_gpu_count_each_other(monkeypatch, device, local_ranks, devices, sharing):
    """The ranks that take a GPU round robin (above) split what it has: the 'auto' device
    tier's room (Note [device tier])."""
    from weightstream.runtime import swarm

    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(swarm.dist, "is_initialized", lambda: True)
    assert swarm.ranks_per_device(device) == sharing
    on = [swarm.device_index(r, local_ranks, devices) for r in range(local_ranks)]
    assert device == CPU or max(on.count(i) for i in set(on)) == sharing


@pytest.mark.parametrize(
    "backend, device_type, native",
    [
        ("cpu:gloo,cuda:nccl", "cuda", True),
        ("cpu:gloo,cuda:gloo", "cuda", False),  # what get_backend_config gives for "gloo"
        ("gloo", "cuda", False),
        ("nccl", "cuda", True),
        ("cuda:nccl", "cuda", True),
        ("cpu:gloo", "cuda", False),  # no backend for the device at all
        ("CPU:GLOO, CUDA:NCCL", "cuda", True),
    ],
)
def test_device_tensors_go_through_host_copies_where_gloo_serves_the_device(
    backend, device_type, native
):
    """swarm's collectives on device tensors (buffers at build, loss and metric sums) use
    the device's own backend where the group has one, else a host copy."""
    from weightstream.runtime import swarm

    assert swarm.device_native(backend, device_type) is native


def test_a_batch_the_ranks_cannot_share_is_refused_once_before_any_rank_starts(tmp_path, caplog):
    """--num_csx 3 with a global batch of 8: one error from the parent, exit code 2 as
    for any bad setting, no rank started (each rank said it before, then the launcher
    blamed a rank and suggested a rerun)."""
    params = _params(tmp_path, "gpt2")
    logger = logging.getLogger("weightstream")
    logger.addHandler(caplog.handler)
    try:
        argv = ["run", "CPU", "-p", str(params), "-o", str(tmp_path / "m"), "--num_csx", "3"]
        assert main(argv) == 2
    finally:
        logger.removeHandler(caplog.handler)
    errors = {r.getMessage() for r in caplog.records if r.levelname == "ERROR"}
    assert len(errors) == 1
    (error,) = errors
    assert "train_input.batch_size = 8 (the global batch) does not divide by the 3" in error
    assert not (tmp_path / "m").exists()


@pytest.mark.slow  # 13 s on 2 cores; report_error's choice is checked in-process by default
def test_bad_input_met_by_every_rank_is_said_once(tmp_path):
    """A checkpoint_path that does not exist stops both ranks of the run command with the
    same message: it is printed once, by rank 0 (Note [one line per error] in
    cli/launch.py), and the launcher's summary follows it."""
    params = _params(tmp_path, "gpt2", max_steps=2)
    missing = tmp_path / "missing.h5"
    left = Path(tempfile.gettempdir()).glob("weightstream-rank-errors-*")
    before = set(left)
    cmd = [sys.executable, "-m", "weightstream", "run", "CPU", "-p", str(params), "-o",
           str(tmp_path / "m"), "--num_csx", "2", "--checkpoint_path", str(missing)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-2000:]
    assert out.count(f"checkpoint {missing} does not exist") == 1, out[-3000:]
    assert "rank 1 of 2:" not in out
    assert "of 2 exited with code 2" in out
    left = Path(tempfile.gettempdir()).glob("weightstream-rank-errors-*")
    assert set(left) <= before  # the launcher removed its directory


def test_the_launcher_says_each_ranks_own_error_once_with_the_ranks_that_met_it(
    tmp_path, monkeypatch, caplog
):
    """What the ranks left (report_error): rank 0's message was logged as it stopped; the
    others' are printed once each, naming every rank that met them."""
    from weightstream.cli import launch

    monkeypatch.setenv(launch.RANK_ERRORS, str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "4")
    with caplog.at_level(logging.ERROR, logger="weightstream"):
        for rank, message in enumerate(("bad data", "bad data", "no room", "no room")):
            monkeypatch.setenv("RANK", str(rank))
            launch.report_error(message)
        assert [r.getMessage() for r in caplog.records] == ["bad data"]  # rank 0's, at once
        launch._print_rank_errors(tmp_path, 4)
    assert [r.getMessage() for r in caplog.records] == ["bad data", "ranks 2, 3 of 4: no room"]
    # Without the launcher's directory every rank says its own.
    monkeypatch.delenv(launch.RANK_ERRORS)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="weightstream"):
        launch.report_error("no room")
    assert [r.getMessage() for r in caplog.records] == ["rank 3 of 4: no room"]


@pytest.mark.slow  # 9 s on 2 cores; bad input every rank meets is checked by default
def test_ranks_started_with_different_params_are_stopped_before_training(tmp_path):
    """Ranks started by hand (torchrun) with another learning rate each: a sharded store
    would update each rank's units by its own rate and exit 0. Every rank stops first."""
    base = yaml.safe_load(_params(tmp_path, "gpt2", max_steps=2).read_text())
    for rank, lr in enumerate((2e-3, 1e-3)):
        base["optimizer"]["learning_rate"] = lr
        (tmp_path / f"p{rank}.yaml").write_text(yaml.safe_dump(base))
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys\n"
        "from weightstream.cli.main import main\n"
        f"params = {str(tmp_path)!r} + '/p' + os.environ['RANK'] + '.yaml'\n"
        f"sys.exit(main(['run', 'CPU', '-p', params, '-o', {str(tmp_path / 'm')!r}]))\n"
    )
    cmd = [sys.executable, "-m", "weightstream", "launch", "--num_csx", "2", str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-2000:]
    assert "the 2 data-parallel ranks were started with different params" in out, out[-3000:]
    # Each rank says it: rank 1's line says whose it is; torch's own failure line is not there.
    assert "rank 1 of 2: the 2 data-parallel ranks were started" in out
    assert "failed (exitcode:" not in out
    assert "Fix: start every rank with the same params file and arguments" in out
    # The launcher's summary: a script's checkpoints are not the run command's.
    assert "rank 0 of 2 exited with code" in out or "rank 1 of 2 exited with code" in out
    assert "the run command resumes" not in out
    assert not list((tmp_path / "m").glob("checkpoint_*.mdl"))


@pytest.mark.slow  # 15 s on 2 cores; the uneven last batch's samples are counted by default
def test_eval_on_two_ranks_without_drop_last_covers_a_short_last_batch(tmp_path):
    """eval_input.drop_last false, the eval set's last global batch smaller than one rank's
    share: it used to be one rank's batch alone, and the other rank ended its pass a step
    early (a gloo hang or size mismatch). Dealt out evenly (Note [an uneven last round]),
    both ranks evaluate it and the loss over every sample is the one rank's."""
    from test_run_command import _scalars

    from weightstream.data.processors import get_data_processor

    eval_section = {"data_processor": "DigitsProcessor", "batch_size": 8, "drop_last": False}
    n = len(get_data_processor("DigitsProcessor")(eval_section, False).dataset)
    batch = next(b for b in range(8, 200, 2) if 2 <= n % b <= b // 2)  # a short last batch
    params = _params(tmp_path, "fc_mnist", max_steps=2)
    sections = yaml.safe_load(params.read_text())
    sections["eval_input"] = {**eval_section, "batch_size": batch}
    params.write_text(yaml.safe_dump(sections))
    losses = {}
    for ranks in (1, 2):
        out = tmp_path / f"r{ranks}"
        argv = ["run", "CPU", "-p", str(params), "-o", str(out), "-m", "train_and_eval"]
        assert main([*argv, "--num_csx", str(ranks)]) == 0
        losses[ranks] = [v for _, v in _scalars(out / "eval", "loss")]
    assert len(losses[1]) == len(losses[2]) == 1
    assert losses[2][0] == pytest.approx(losses[1][0], rel=LOSS_RTOL)


@pytest.mark.slow  # 18 s on 2 cores: two runs of two ranks, with the slow tests
def test_performance_counts_the_samples_of_an_uneven_last_batch(tmp_path):
    """One epoch without drop_last, whose last global batch splits unevenly over 2 ranks
    (1438 samples: 4 + 2): performance.json counts each sample once (it took rank 0's
    4 twice: 1440)."""
    import json

    from weightstream.data.processors import get_data_processor

    section = {"data_processor": "DigitsProcessor", "batch_size": 8, "drop_last": False}
    n = len(get_data_processor("DigitsProcessor")(section, True).dataset)
    assert 4 < n % 8 < 8  # 4 for rank 0, fewer for rank 1
    params = _params(tmp_path, "fc_mnist", max_steps=-(-n // 8))
    sections = yaml.safe_load(params.read_text())
    sections["train_input"] = {**section, "shuffle_seed": 3}
    sections["runconfig"]["checkpoint_steps"] = 0
    params.write_text(yaml.safe_dump(sections))
    for ranks in (1, 2):
        out = tmp_path / f"r{ranks}"
        argv = ["run", "CPU", "-p", str(params), "-o", str(out), "--num_csx", str(ranks)]
        assert main(argv) == 0
        perf = json.loads((out / "performance" / "performance.json").read_text())
        assert perf["total_samples"] == n, ranks
