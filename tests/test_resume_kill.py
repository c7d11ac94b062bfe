"""Crash-exact resume (design invariant 3): SIGKILL a training run again and again, resume it,
and get the uninterrupted run's losses and checkpoints bit for bit.

The harness runs the run command in a subprocess, ``python -m weightstream run CPU -p
params.yaml -m train -o model_dir`` (a tiny GPT in weight-streaming mode, with dropout,
gradient accumulation, dynamic loss scaling, gradient clipping, an LR schedule and an epoch
boundary, so every piece of state a resume needs matters), kills it with SIGKILL, starts the
same command again (it resumes from the newest complete checkpoint in model_dir) and so on;
the last start runs to the end. Next to it, the same command runs once without interruption.

Kill moments, drawn from ``random.Random(seed)`` (reproducible; the plan of every kill is in
the failure message):

* ``timed``: wait until the run has logged a step chosen among the next few, then sleep a
  random 0-50 ms and SIGKILL: anywhere in the following step (forward, backward, the host
  update, the loss log, a checkpoint write). Where exactly depends on the scheduler.
* ``startup``: SIGKILL 0.2-3 s after the start, or when training starts if that is sooner:
  in the imports, the compile phase or the checkpoint load.
* aimed, exactly reproducible: the run command started through tests/crash_points.py,
  which patches weightstream's functions in that process, stops itself (SIGSTOP) at an exact
  point, and the harness sends SIGKILL to the stopped process: ``save.leaf`` (after the j-th
  leaf written into a checkpoint's temporary file: a half-written checkpoint), ``save.renamed``
  (the new checkpoint renamed into place, the directory not yet fsynced), ``update`` (after
  the j-th torch operation of an optimizer update: some parameters updated, others not).

What is compared: ``train/losses.jsonl``, the loss of every step, which the run appends per
step and a resumed run cuts back to its checkpoint's step (train/trainer.py, LossLog), read
back as exact floats; every checkpoint either run left, leaf by leaf (model, optimizer,
schedulers, grad scaler, data loader position, RNG states, step counter); and the TensorBoard
loss scalars. After every kill: every ``checkpoint_*.mdl`` is complete, the newest loads,
progress never goes back, and an aimed kill left what it should (a temporary file, or the
renamed checkpoint). The default suite runs 5 kills; ``-m slow`` runs 20.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import crash_points
import h5py
import params_files as pf
import pytest
from trees import assert_same_tree

from weightstream import checkpoint as ckpt
from weightstream.train.trainer import LOSS_LOG, LossLog

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="SIGSTOP/SIGKILL and /proc: Linux only"
)

CHECKPOINT_STEPS = 3
LAUNCH_TIMEOUT = 180.0  # seconds one start of the run command may take, at most
RUN = (sys.executable, "-m", "weightstream", "run", "CPU")
# The same command with a crash point armed: python tests/crash_points.py <point> run CPU.
CRASH_RUN = (sys.executable, crash_points.__file__)


def _params(path: Path, max_steps: int) -> Path:
    return pf.write(
        path,
        pf.params(
            # 1900 bytes of training text: 111 windows, 27 batches, an epoch of 13
            # steps (with grad_accum_steps 2), so runs cross epoch boundaries.
            train_input=pf.text_input(4, 16, shuffle_seed=3, max_bytes=2000),
            model=pf.gpt2(2, 16, 16, dropout=0.1),  # dropout draws from torch's RNG every step
            optimizer=pf.adamw(
                pf.warmup_cosine(3e-3, 4, 200),
                weight_decay=0.01,
                max_gradient_norm=1.0,
                loss_scaling_factor="dynamic",
                grad_accum_steps=2,
            ),
            runconfig={
                "max_steps": max_steps,
                "checkpoint_steps": CHECKPOINT_STEPS,
                "log_steps": 1,  # a line per step on stdout: timed kills watch it
                "seed": 11,
                "execution_mode": "weight_streaming",
                "unit_size_target": 2000,
            },
        ),
    )


# ---------------------------------------------------------------------------
# Launching and killing
# ---------------------------------------------------------------------------


@dataclass
class Kill:
    """How one start of the run is killed."""

    kind: str  # "timed", "startup", "save.leaf", "save.renamed", "update"
    crash_point: str | None = None  # tests/crash_points.py's <point>:<n>, for the aimed kinds
    after_step: int | None = None  # timed: kill once this step is logged ...
    delay: float = 0.0  # ... this many seconds later (startup: after the start)
    save_step: int | None = None  # save.*: the checkpoint step the kill aims at


class Launch:
    """One start of the run command, its output in a log file."""

    def __init__(self, params: Path, model_dir: Path, log: Path, crash_point: str | None = None):
        env = dict(os.environ)
        run = RUN if crash_point is None else (*CRASH_RUN, crash_point, *RUN[3:])
        # One thread per process: the killed chain and the reference run share two cores,
        # and both use the same setting, so their arithmetic is the same.
        env["OMP_NUM_THREADS"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        self.log = log
        self._out = open(log, "wb")  # closed in wait()
        self.proc = subprocess.Popen(
            [*run, "-p", str(params), "-m", "train", "-o", str(model_dir)],
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.started = time.monotonic()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stopped(self) -> bool:
        """True when the process stopped itself at its crash point (state T)."""
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except OSError:
            return False
        return stat[stat.rindex(")") + 2] in "Tt"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)

    def wait(self, timeout: float = LAUNCH_TIMEOUT) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._out.close()

    def overdue(self) -> bool:
        return time.monotonic() - self.started > LAUNCH_TIMEOUT


def _run_until_killed(launch: Launch, kill: Kill) -> int:
    """Deliver ``kill`` to ``launch``; its return code (-SIGKILL unless it finished first)."""
    while launch.proc.poll() is None:
        if launch.overdue():
            launch.kill()
            pytest.fail(f"the run did not reach its kill point {kill} in time:\n{launch.output()}")
        if kill.crash_point is not None:
            if launch.stopped():
                launch.kill()
                break
        elif kill.kind == "startup":
            # At the latest when training starts (on a fast machine it may be soon).
            if time.monotonic() - launch.started >= kill.delay or "Training " in launch.output():
                launch.kill()
                break
        elif f"global_step = {kill.after_step}," in launch.output():
            # (This start's own log, one line per step: the loss log may still hold
            # lines of the killed start until this one cuts it back.)
            time.sleep(kill.delay)
            launch.kill()
            break
        time.sleep(0.005)
    return launch.wait()


# ---------------------------------------------------------------------------
# Planning kills
# ---------------------------------------------------------------------------


def _latest_step(model_dir: Path) -> int:
    latest = ckpt.find_latest_checkpoint(model_dir)
    return 0 if latest is None else int(latest.stem.split("_")[1])


def _leaves_per_checkpoint(model_dir: Path) -> int | None:
    latest = ckpt.find_latest_checkpoint(model_dir)
    if latest is None:
        return None
    with h5py.File(latest, "r", locking=False) as f:
        return len(f.keys())  # one name per leaf (tied tensors are hard links)


def _plan(rng: random.Random, kind: str, model_dir: Path, max_steps: int) -> Kill:
    """A kill of ``kind`` aimed at the next two checkpoints of a start resuming from here."""
    resumed = _latest_step(model_dir)
    window = range(resumed + 1, min(resumed + 2 * CHECKPOINT_STEPS, max_steps - 2) + 1)
    # Saves this start makes inside the window (never the final one: the run must go on).
    saves = [s for s in window if s % CHECKPOINT_STEPS == 0 and s < max_steps]
    assert window and saves, f"no room left to kill a run resumed at step {resumed}"
    if kind == "timed":
        # Well before the end: the kill must come before the run finishes.
        steps = range(window.start, max(window.start, min(window.stop, max_steps - 8)))
        return Kill(kind, after_step=rng.choice(steps or window), delay=rng.uniform(0.0, 0.05))
    if kind == "startup":
        return Kill(kind, delay=rng.uniform(0.2, 3.0))
    if kind == "update":
        n = rng.choice(window) - resumed  # the n-th update of this start
        return Kill(kind, crash_point=f"update:{n}@{rng.randint(1, 200)}")
    k = rng.randrange(len(saves))
    if kind == "save.renamed":
        return Kill(kind, crash_point=f"save.renamed:{k + 1}", save_step=saves[k])
    assert kind == "save.leaf"
    leaves = _leaves_per_checkpoint(model_dir)
    if leaves is None:  # no checkpoint yet to count them: aim inside the first save
        k, j = 0, rng.randint(1, 50)
    else:
        j = rng.randint(1, leaves)
    return Kill(kind, crash_point=f"save.leaf:{k * (leaves or 0) + j}", save_step=saves[k])


KINDS = ("save.leaf", "update", "timed", "save.renamed", "startup")


def _kinds(rng: random.Random, kills: int) -> list[str]:
    """Every kind equally often (so 5 kills cover each once), in a seeded order."""
    kinds = [KINDS[i % len(KINDS)] for i in range(kills)]
    rng.shuffle(kinds)
    return kinds


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------


def _check_after_kill(model_dir: Path, kill: Kill, previous: int, note: str) -> int:
    """The invariants a kill must leave; returns the newest complete checkpoint's step."""
    listed = ckpt.list_checkpoints(model_dir)
    for _, path in listed:
        # A checkpoint_*.mdl is only ever a complete file: saves rename into place.
        assert ckpt.is_complete_checkpoint(path), f"{note}: {path} is not complete"
    latest = ckpt.find_latest_checkpoint(model_dir)
    step = 0
    if latest is not None:
        state = ckpt.load(latest, map_location="cpu")  # the newest complete one loads
        step = state["global_step"]
        assert latest == ckpt.checkpoint_path(model_dir, step), note
    assert step >= previous, f"{note}: the newest checkpoint went back from {previous} to {step}"
    if kill.kind == "save.leaf":
        partial = list(model_dir.glob(f".checkpoint_{kill.save_step}.mdl.*.tmp"))
        assert partial, f"{note}: no temporary file of the interrupted save"
        assert all(not ckpt.is_complete_checkpoint(p) for p in partial), note
        assert step < kill.save_step, note
    if kill.kind == "save.renamed":
        assert step == kill.save_step, f"{note}: the renamed checkpoint is not the newest"
    return step


def _tensorboard_losses(event_dir: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(event_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("loss")]


def _exact(entries: list[tuple[int, float]]) -> list[tuple[int, str]]:
    return [(step, float(loss).hex()) for step, loss in entries]


def run_kill_chain(tmp_path: Path, kills: int, seed: int) -> dict:
    """Kill a run ``kills`` times, finish it, compare with an uninterrupted run."""
    max_steps = CHECKPOINT_STEPS * (2 * kills + 2)
    params = _params(tmp_path / "params.yaml", max_steps)
    reference_dir, chain_dir = tmp_path / "reference", tmp_path / "killed"
    logs = tmp_path / "logs"
    logs.mkdir()
    rng = random.Random(seed)
    reference = Launch(params, reference_dir, logs / "reference.log")
    history: list[str] = []
    newest = 0
    try:
        for i, kind in enumerate(_kinds(rng, kills)):
            kill = _plan(rng, kind, chain_dir, max_steps)
            note = f"kill {i + 1}/{kills} (seed {seed}) {kill}"
            history.append(f"resumed at {newest}: {kill}")
            launch = Launch(params, chain_dir, logs / f"start{i}.log", kill.crash_point)
            code = _run_until_killed(launch, kill)
            assert code == -signal.SIGKILL, (
                f"{note}: the run ended with {code} before it was killed\n"
                + "\n".join(history)
                + f"\n{launch.output()}"
            )
            if newest:
                assert (
                    f"Resumed from {ckpt.checkpoint_path(chain_dir, newest)}" in (launch.output())
                    or kill.kind == "startup"
                ), f"{note}: did not resume\n{launch.output()}"
            newest = _check_after_kill(chain_dir, kill, newest, note)
        final = Launch(params, chain_dir, logs / "final.log")
        assert final.wait() == 0, final.output()
        assert reference.wait() == 0, reference.output()
    finally:
        if reference.proc.poll() is None:
            reference.proc.kill()
        reference.wait()

    plan = "\n".join(history)
    # The losses of every step, bit for bit.
    got = LossLog.read(chain_dir / LOSS_LOG)
    want = LossLog.read(reference_dir / LOSS_LOG)
    assert [s for s, _ in want] == list(range(1, max_steps + 1))
    assert _exact(got) == _exact(want), plan
    # Every checkpoint, leaf by leaf.
    steps = [s for s, _ in ckpt.list_checkpoints(reference_dir)]
    assert steps == list(range(CHECKPOINT_STEPS, max_steps + 1, CHECKPOINT_STEPS))
    assert [s for s, _ in ckpt.list_checkpoints(chain_dir)] == steps, plan
    for step in steps:
        a = ckpt.load(ckpt.checkpoint_path(reference_dir, step), map_location="cpu")
        b = ckpt.load(ckpt.checkpoint_path(chain_dir, step), map_location="cpu")
        # The one difference the two runs are meant to have.
        assert a["metadata"]["params"]["runconfig"].pop("model_dir") == str(reference_dir)
        assert b["metadata"]["params"]["runconfig"].pop("model_dir") == str(chain_dir)
        assert_same_tree(a, b, f"checkpoint_{step}")
    # TensorBoard's reader, given the event files of every start, shows the same losses.
    pytest.importorskip("tensorboard")
    got_tb = _tensorboard_losses(chain_dir / "train")
    assert got_tb == _tensorboard_losses(reference_dir / "train"), plan
    leftovers = [p.name for p in chain_dir.iterdir() if p.name.endswith(".tmp")]
    return {"kills": kills, "steps": max_steps, "plan": history, "temporary_files": leftovers}


def test_a_kill_resumes_bit_for_bit(tmp_path):
    result = run_kill_chain(tmp_path, kills=1, seed=20261126)
    assert len(result["plan"]) == 1


@pytest.mark.slow  # 50 s on 2 cores; the default suite kills once (above)
def test_five_kills_resume_bit_for_bit(tmp_path):
    result = run_kill_chain(tmp_path, kills=5, seed=20261121)
    assert len(result["plan"]) == 5


@pytest.mark.slow
def test_twenty_kills_resume_bit_for_bit(tmp_path):
    result = run_kill_chain(tmp_path, kills=20, seed=8)
    assert len(result["plan"]) == 20
    print(f"\nsurvived {result['kills']}/20 kills over {result['steps']} steps:")
    print("\n".join(result["plan"]))


def _stopped_at(launch: Launch) -> None:
    while not launch.stopped():
        if launch.proc.poll() is not None or launch.overdue():
            launch.kill()
            pytest.fail(f"the run did not reach its crash point:\n{launch.output()}")
        time.sleep(0.005)


@pytest.mark.slow  # 25 s on 2 cores; the default suite kills once (above)
def test_sigterm_mid_save_removes_the_temporary_and_sigkill_leaves_one_for_the_next_run(
    tmp_path,
):
    """SIGTERM (a scheduler's stop) in the middle of writing a checkpoint ends the run as
    Ctrl-C does: the temporary file goes, the exit code is 143 and the log says how to
    resume. SIGKILL cannot clean up; the next run removes what it left (its process is
    gone) and trains on to the end."""
    params, model_dir = _params(tmp_path / "p.yaml", max_steps=6), tmp_path / "m"
    temporaries = lambda: sorted(p.name for p in model_dir.glob(".checkpoint_*.tmp"))  # noqa: E731

    term = Launch(params, model_dir, tmp_path / "term.log", crash_point="save.leaf:3")
    _stopped_at(term)
    assert len(temporaries()) == 1  # the first save, half written
    term.proc.send_signal(signal.SIGTERM)
    term.proc.send_signal(signal.SIGCONT)
    assert term.wait() == 128 + signal.SIGTERM
    assert temporaries() == [] and not list(model_dir.glob("checkpoint_*.mdl"))
    assert "the run stopped: SIGTERM" in term.output()
    assert f"{model_dir} holds no complete checkpoint yet" in term.output()

    kill = Launch(params, model_dir, tmp_path / "kill.log", crash_point="save.leaf:3")
    _stopped_at(kill)
    kill.kill()
    kill.wait()
    left = temporaries()
    assert len(left) == 1

    rerun = Launch(params, model_dir, tmp_path / "rerun.log")
    assert rerun.wait() == 0
    assert f"Removed {left[0]}" in rerun.output() and temporaries() == []
    assert _latest_step(model_dir) == 6


def test_loss_log_is_cut_back_to_the_step_a_run_starts_from(tmp_path):
    path = tmp_path / "train" / "losses.jsonl"
    path.parent.mkdir()
    lines = [f'{{"step": {s}, "loss": {s / 3!r}}}\n' for s in range(1, 6)]
    path.write_text("".join(lines) + '{"step": 6, "lo')  # a kill in the middle of a write
    log = LossLog(path, 3)  # resuming from checkpoint_3
    log.append(4, 0.25)
    log.close()
    assert LossLog.read(path) == [(1, 1 / 3), (2, 2 / 3), (3, 1.0), (4, 0.25)]
    LossLog(path, 0).close()  # a run from scratch starts an empty log
    assert path.read_bytes() == b""


def test_crash_point_setting_is_checked():
    with pytest.raises(ValueError, match=r"expected <point>:<n> or update:<n>@<j>"):
        crash_points.parse("save.leaf")
    with pytest.raises(ValueError, match=r"unknown point 'save.leave'"):
        crash_points.parse("save.leave:3")
    assert crash_points.parse("save.leaf:3") == ("save.leaf", 3, 1)
    assert crash_points.parse("update:2@17") == ("update", 2, 17)
