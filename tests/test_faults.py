"""Faults a run must survive (design invariant 3): non-finite losses, a checkpoint write that
fails (file size limit, read-only model_dir), and checkpoints that would unpickle code.

Each ends either in the documented recovery (a skipped step) or in a clear error that names
the step or the file, with the newest checkpoint left intact and loadable. Runs that must
fail at the operating system's level (RLIMIT_FSIZE, no write permission) run the command in
a subprocess, ``python -m weightstream run ...``, with the limit set in that process only.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import resource
import subprocess
import sys
from pathlib import Path

import h5py
import params_files as pf
import pytest
import torch
import yaml

from weightstream import checkpoint as ckpt
from weightstream.checkpoint.cli import main as checkpoint_cli
from weightstream.checkpoint.format import ATTR_TYPE, TYPE_PICKLE
from weightstream.cli.main import main
from weightstream.train.trainer import LOSS_LOG, LossLog

pytest.importorskip("tensorboard")


def _params(tmp_path: Path, optimizer: dict | None = None, **runconfig) -> Path:
    section = pf.text_input(4, 16, max_bytes=2000)
    return pf.write(
        tmp_path / "params.yaml",
        pf.params(
            train_input=dict(section),
            eval_input=dict(section),
            model=pf.gpt2(1, 16, 16),
            optimizer=optimizer or pf.adamw(1e-3),
            runconfig={
                "max_steps": 3,
                "checkpoint_steps": 1,
                "seed": 5,
                "unit_size_target": 2000,
                **runconfig,
            },
        ),
    )


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(autouse=True)
def error_log():
    """The errors the run command logs (its logger has this one handler, so it adds none)."""
    logger = logging.getLogger("weightstream")
    handler = _Records()
    logger.handlers[:] = [handler]
    yield handler
    logger.handlers.clear()


RUN = (sys.executable, "-m", "weightstream", "run", "CPU")


def _run(params: Path, model_dir: Path, *extra: str) -> int:
    return main(["run", "CPU", "-p", str(params), "-o", str(model_dir), *extra])


def _errors(log: _Records) -> str:
    text = "\n".join(log.messages)
    log.messages.clear()
    return text


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _same_bits(a, b) -> bool:
    """Equal, tensors bit for bit (so NaN equals the same NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_bits(x, y) for x, y in zip(a, b))
    return a == b


def _state(model_dir: Path, step: int) -> dict:
    return ckpt.load(ckpt.checkpoint_path(model_dir, step), map_location="cpu")


# ---------------------------------------------------------------------------
# Numerical faults
# ---------------------------------------------------------------------------

# SGD at this learning rate sends the weights past float32's range in step 1, so from
# step 2 on every loss (and every gradient) is NaN.
EXPLODING = {"optimizer_type": "SGD", "learning_rate": 1e30}


def test_nan_loss_with_dynamic_loss_scaling_skips_the_step(tmp_path):
    optimizer = {**EXPLODING, "loss_scaling_factor": "dynamic", "initial_loss_scale": 1024.0}
    params = _params(tmp_path, optimizer, max_steps=4, save_initial_checkpoint=True)
    model_dir = tmp_path / "m"
    assert _run(params, model_dir) == 0  # the run goes on: the scaler skips the steps
    losses = [loss for _, loss in LossLog.read(model_dir / LOSS_LOG)]
    assert math.isfinite(losses[0]) and all(math.isnan(x) for x in losses[1:]), losses
    after_1 = _state(model_dir, 1)
    assert not _same_bits(_state(model_dir, 0)["model"], after_1["model"])  # step 1 applied
    for step in (2, 3, 4):  # skipped: weights and optimizer state exactly as after step 1
        state = _state(model_dir, step)
        assert _same_bits(state["model"], after_1["model"]), step
        assert _same_bits(state["optimizer"], after_1["optimizer"]), step
        # the dynamic loss scale halves at each skipped step
        assert state["grad_scaler"]["loss_scale"] == 1024.0 / 2 ** (step - 1)
        assert state["grad_scaler"]["num_skipped_steps"] == step - 1


def test_nan_loss_without_loss_scaling_stops_at_the_step(tmp_path, error_log):
    params = _params(tmp_path, EXPLODING, max_steps=4)
    model_dir = tmp_path / "m"
    assert _run(params, model_dir) == 2
    message = _errors(error_log)
    good = ckpt.checkpoint_path(model_dir, 1)
    assert "the loss is nan at global step 2" in message
    assert f"the newest checkpoint, {good}, is the last good state" in message
    assert "loss_scaling_factor: dynamic" in message and "check_loss_values: false" in message
    # Nothing of the bad step reached a checkpoint: the newest is the last good one.
    assert ckpt.list_checkpoints(model_dir) == [(1, good)]
    assert ckpt.find_latest_checkpoint(model_dir) == good
    weights = _state(model_dir, 1)["model"]
    assert all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())
    assert [s for s, _ in LossLog.read(model_dir / LOSS_LOG)] == [1]


def test_check_loss_values_false_trains_through_non_finite_losses(tmp_path):
    params = _params(tmp_path, EXPLODING, max_steps=3, check_loss_values=False)
    model_dir = tmp_path / "m"
    assert _run(params, model_dir) == 0
    losses = [loss for _, loss in LossLog.read(model_dir / LOSS_LOG)]
    assert len(losses) == 3 and all(math.isnan(x) for x in losses[1:])
    assert [s for s, _ in ckpt.list_checkpoints(model_dir)] == [1, 2, 3]


# ---------------------------------------------------------------------------
# Writes that fail: file size limit, read-only model_dir
# ---------------------------------------------------------------------------


def _drop_write_privileges() -> None:
    """preexec_fn: as root, give up the capabilities that ignore file permissions."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER out of the bounding set
    # (PR_CAPBSET_DROP = 24): the exec'd process is root bound by permission bits.
    for cap in (1, 2, 3):
        if libc.prctl(24, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _run_subprocess(params: Path, model_dir: Path, preexec, *extra: str):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*RUN, "-p", str(params), "-o", str(model_dir), *extra],
        preexec_fn=preexec,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _first_three_steps(tmp_path: Path) -> tuple[Path, Path, str]:
    params = _params(tmp_path, max_steps=3, checkpoint_steps=3)
    model_dir = tmp_path / "m"
    assert _run(params, model_dir) == 0
    good = ckpt.checkpoint_path(model_dir, 3)
    return params, model_dir, _digest(good)


def _assert_checkpoint_3_intact(model_dir: Path, digest: str) -> None:
    good = ckpt.checkpoint_path(model_dir, 3)
    assert ckpt.list_checkpoints(model_dir) == [(3, good)]
    assert _digest(good) == digest
    assert ckpt.find_latest_checkpoint(model_dir) == good
    ckpt.load(good, map_location="cpu")
    assert not [p for p in model_dir.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow  # 11 s on 2 cores; a read-only model_dir is checked by default
def test_checkpoint_write_over_the_file_size_limit(tmp_path):
    params, model_dir, digest = _first_three_steps(tmp_path)
    size = ckpt.checkpoint_path(model_dir, 3).stat().st_size
    limit = size // 2  # the next checkpoint cannot be written; the small files can

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    result = _run_subprocess(params, model_dir, limit_file_size, "--max_steps", "6")
    assert result.returncode == 2, result.stdout + result.stderr
    out = result.stdout
    target = ckpt.checkpoint_path(model_dir, 6)
    assert f"could not write {target}" in out and "File too large" in out
    assert "ulimit -f" in out and "Training stopped at global step 6" in out
    assert f"The newest complete checkpoint, {ckpt.checkpoint_path(model_dir, 3)}, is intact" in out
    assert "Traceback" not in out + result.stderr
    _assert_checkpoint_3_intact(model_dir, digest)
    # Without the limit, the run resumes from step 3 and gets what one run gets.
    assert _run(params, model_dir, "--max_steps", "6") == 0
    straight = tmp_path / "straight"
    assert _run(params, straight, "--max_steps", "6") == 0
    assert _same_bits(_state(model_dir, 6)["model"], _state(straight, 6)["model"])
    got, want = LossLog.read(model_dir / LOSS_LOG), LossLog.read(straight / LOSS_LOG)
    assert [s for s, _ in got] == list(range(1, 7)) and got == want


def _snapshot(directory: Path) -> dict[str, tuple[int, str]]:
    return {
        str(p.relative_to(directory)): (p.stat().st_mtime_ns, _digest(p))
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


SAVE_ONE = "import sys, weightstream as w; w.save({'a': 1}, sys.argv[1])"


def test_read_only_model_dir(tmp_path):
    """Reported before anything is written; and a save into it fails cleanly."""
    params, model_dir, digest = _first_three_steps(tmp_path)
    before = _snapshot(model_dir)
    model_dir.chmod(0o555)
    try:
        result = _run_subprocess(params, model_dir, _drop_write_privileges, "--max_steps", "6")
        save = subprocess.run(
            [sys.executable, "-c", SAVE_ONE, str(ckpt.checkpoint_path(model_dir, 9))],
            preexec_fn=_drop_write_privileges,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        model_dir.chmod(0o755)
    assert result.returncode == 2, result.stdout + result.stderr
    out = result.stdout
    assert f"cannot write in {model_dir} (Permission denied)" in out
    assert "make it writable, or give another model directory with -o" in out
    assert "Traceback" not in out + result.stderr
    assert _snapshot(model_dir) == before  # nothing changed, not even the params yaml
    _assert_checkpoint_3_intact(model_dir, digest)
    # The library's save: the same kind of error, naming the file.
    assert save.returncode == 1
    assert "CheckpointWriteError: save(): could not write" in save.stderr
    assert "Permission denied" in save.stderr and f"make {model_dir} writable" in save.stderr
    _assert_checkpoint_3_intact(model_dir, digest)


def test_checkpoint_of_another_model_is_refused(tmp_path, error_log):
    params, model_dir, _ = _first_three_steps(tmp_path)
    raw = yaml.safe_load(params.read_text())
    raw["model"]["d_model"] = 32  # another model, same model_dir
    params.write_text(yaml.safe_dump(raw))
    before = _snapshot(model_dir)
    assert _run(params, model_dir, "--max_steps", "6") == 2
    message = _errors(error_log)
    assert f"cannot resume from {ckpt.checkpoint_path(model_dir, 3)}" in message
    assert "size mismatch" in message and "other model settings (model.d_model: " in message
    assert _snapshot(model_dir) == before


# ---------------------------------------------------------------------------
# Loading never unpickles without an explicit opt-in
# ---------------------------------------------------------------------------


class _Payload:
    """Unpickling this creates the file ``marker``: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_trainer_checkpoints_hold_nothing_pickled(tmp_path):
    params = _params(tmp_path, max_steps=2, checkpoint_steps=2)
    model_dir = tmp_path / "m"
    assert _run(params, model_dir) == 0
    with h5py.File(ckpt.checkpoint_path(model_dir, 2), "r") as f:
        tags = {f[name].attrs[ATTR_TYPE].decode() for name in f}
    assert TYPE_PICKLE not in tags, tags  # so resuming never needs allow_pickle


def test_no_checkpoint_path_unpickles_without_opt_in(tmp_path, error_log):
    params = _params(tmp_path, max_steps=2, checkpoint_steps=2)
    model_dir = tmp_path / "m"
    assert _run(params, model_dir) == 0
    marker = tmp_path / "code_ran"
    # A trainer checkpoint with a pickled value planted in it, as the newest in model_dir,
    state = _state(model_dir, 2)
    state["metadata"]["note"] = _Payload(marker)
    planted = ckpt.checkpoint_path(model_dir, 4)
    ckpt.save(state, planted)
    # and a torch.save file with the payload.
    pt = tmp_path / "state.pt"
    torch.save({"model": state["model"], "x": _Payload(marker)}, pt)
    assert not marker.exists()

    # Resuming (autoload), naming it, evaluating it: refused, nothing ran.
    assert _run(params, model_dir, "--max_steps", "6") == 2
    message = _errors(error_log)
    assert "holds a pickled" in message and str(planted) in message
    assert _run(params, model_dir, "--checkpoint_path", str(pt), "--max_steps", "6") == 2
    assert "is a torch.save (pickle) file" in _errors(error_log)
    assert _run(params, model_dir, "-m", "eval", "--checkpoint_path", str(planted)) == 2
    assert _run(params, model_dir, "-m", "eval_all") == 2
    # The library and the checkpoint command.
    for path in (planted, pt):
        with pytest.raises(ckpt.PickleNotAllowedError, match="allow_pickle=True"):
            ckpt.load(path, map_location="cpu")
    lazy = ckpt.load(planted)  # lazy: the model reads, the pickled value is never touched
    assert torch.equal(lazy["model"]["wte.weight"], state["model"]["wte.weight"])
    assert checkpoint_cli(["info", str(planted)]) == 0
    assert checkpoint_cli(["convert", str(planted), str(tmp_path / "out.safetensors")]) != 0
    checkpoint_cli(["diff", str(planted), str(ckpt.checkpoint_path(model_dir, 2))])
    assert not marker.exists(), "a checkpoint path unpickled without allow_pickle=True"
    # Only the explicit opt-in runs it.
    ckpt.load(planted, map_location="cpu", allow_pickle=True)
    assert marker.exists()
