"""The checkpoints of a run's model_dir: which one a run starts from or evaluates, and
the runs refused because their checkpoints would replace an earlier run's (invariant
3: nothing lost, nothing mixed).
"""

from __future__ import annotations

import logging
from pathlib import Path

from weightstream import checkpoint as ckpt
from weightstream.cli.params import RunConfigParams

log = logging.getLogger("weightstream")


def own_checkpoint(model_dir: Path, rc: RunConfigParams) -> Path | None:
    """model_dir's newest complete checkpoint, which a run resumes from (None: the run
    has none, or does not resume: ``autoload_last_checkpoint: false``).

    A training run that would write checkpoints over others stops here, before it
    builds anything; a run that only validates or compiles writes none.
    """
    own = ckpt.find_latest_checkpoint(model_dir) if rc.autoload_last_checkpoint else None
    if rc.validate_only or rc.compile_only:
        return own
    if not rc.autoload_last_checkpoint:
        _refuse_earlier(model_dir)
    if rc.checkpoint_path and not rc.warm_start_states:
        _refuse_newer(model_dir, Path(rc.checkpoint_path))
    elif own is None and rc.autoload_last_checkpoint:
        _refuse_unreadable(model_dir)
    return own


def _refuse_earlier(model_dir: Path) -> None:
    """A run that does not resume starts at step 0: its checkpoints would take the
    names of an earlier run's in model_dir, some overwritten, some not."""
    earlier = ckpt.list_checkpoints(model_dir)
    if earlier:
        raise ValueError(
            f"{model_dir} holds checkpoints of an earlier run "
            f"({_names(p for _, p in earlier)}), and "
            "runconfig.autoload_last_checkpoint is false: this run would start at step 0 "
            "and write checkpoints under the same names, replacing some of them. Fix: a "
            "new model_dir (-o), move those checkpoints away, or "
            "autoload_last_checkpoint: true to resume from the newest."
        )


def _refuse_unreadable(model_dir: Path) -> None:
    """model_dir's checkpoints are all incomplete or unreadable: starting over at step
    0 would replace them one by one, the evidence of what went wrong with them."""
    bad = ckpt.list_checkpoints(model_dir)
    if bad:
        raise ValueError(
            f"{model_dir} holds checkpoints ({_names(p for _, p in bad)}), but none is "
            "complete and "
            "readable, so there is nothing to resume from; training from step 0 would "
            "replace them. Fix: move them away (or delete them) to train from the start, "
            "or resume from a good copy with --checkpoint_path."
        )


def _refuse_newer(model_dir: Path, start: Path) -> None:
    """A run resuming from checkpoint_path at step N writes checkpoints after N under
    their names: model_dir's own checkpoints after N would be replaced, as when the
    command that trained them is run again."""
    step = saved_step(start)
    if step is None:
        return  # resuming reports what is wrong with it
    newer = [path for s, path in ckpt.list_checkpoints(model_dir) if s > step]
    if newer:
        raise ValueError(
            f"{model_dir} holds checkpoints after global step {step}, where "
            f"checkpoint_path {start} starts ({_names(newer)}): training from there would replace "
            "them. Fix: to continue this model_dir's run, leave checkpoint_path out (it "
            f"resumes from its newest, {newer[-1].name}); to train again from step {step}, "
            "use a new model_dir (-o)."
        )


def latest_or_given(model_dir: Path, rc: RunConfigParams) -> Path:
    """The checkpoint an evaluation reads: checkpoint_path, else model_dir's newest."""
    # With load_checkpoint_states, checkpoint_path is where training started
    # from: evaluate the run's own newest checkpoint, else that start.
    if rc.checkpoint_path and not rc.warm_start_states:
        return Path(rc.checkpoint_path)
    latest = ckpt.find_latest_checkpoint(model_dir)
    if latest is None and rc.checkpoint_path:
        return Path(rc.checkpoint_path)
    if latest is None:
        raise ValueError(
            f"no checkpoint to evaluate: {model_dir} has no complete checkpoint_*.mdl. "
            "Train first, or pass --checkpoint_path."
        )
    return latest


def finished(path: Path, max_steps: int | None) -> bool:
    """True when the checkpoint to resume from already reached ``max_steps``.

    The run was complete (perhaps killed after its last checkpoint): running
    it again has nothing to train, and changes nothing.
    """
    if max_steps is None:
        return False
    step = saved_step(path)  # None: resuming reports what is wrong with it
    if step is None or step < max_steps:
        return False
    log.info(
        "%s is at global step %d and max_steps is %d: training is complete, nothing to do.",
        path,
        step,
        max_steps,
    )
    return True


def resume_from(trainer, path: Path, dataloader, model_dir: Path, named: bool) -> None:
    """``trainer`` loads the checkpoint ``path``; ``named``: the user named it
    (checkpoint_path), else it is model_dir's newest, and an unreadable one's error
    says how to resume from an earlier one."""
    try:
        trainer.load_checkpoint(path, dataloader)
    except ckpt.CheckpointError as e:
        if named:
            raise
        earlier = [
            c
            for _, c in ckpt.list_checkpoints(model_dir)
            if c != path and ckpt.is_complete_checkpoint(c)
        ]
        hint = f"pass --checkpoint_path {earlier[-1]}, or " if earlier else ""
        raise type(e)(
            f"{e} (The run resumes from the newest checkpoint in {model_dir}: to resume "
            f"from an earlier one, {hint}move {path.name} out of {model_dir}.)"
        ) from e


def saved_step(path: Path) -> int | None:
    """The global step a trainer checkpoint recorded (read lazily: the one value), or
    None where it cannot be read."""
    try:
        with ckpt.load(path) as state:
            step = state.get("global_step")
    except (ckpt.CheckpointError, OSError, AttributeError, TypeError):
        return None
    return step if isinstance(step, int) else None


def _names(paths, most: int = 4) -> str:
    """The first few file names of ``paths``, for a message."""
    paths = list(paths)
    return ", ".join(p.name for p in paths[:most]) + (", ..." if len(paths) > most else "")
