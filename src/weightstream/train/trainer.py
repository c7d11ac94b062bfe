"""The training and evaluation loops of the run command.

A step reads top to bottom: take the batches of one optimizer step, forward and
backward each (loss scaled, divided by the number of micro-batches), unscale,
clip, step the optimizer (skipped on non-finite gradients under dynamic loss
scaling), update the scaler, step the LR schedule, log, checkpoint.

Everything a resumed run needs to continue bit for bit is in the trainer
checkpoint: model, optimizer, schedulers, grad scaler, data loader position,
random number generator states and the step counter. The loss of every step
goes to ``train/losses.jsonl`` (:class:`LossLog`), which a resumed run cuts back
to its checkpoint's step, so the file reads as if the run had never stopped.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import shutil
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from weightstream import checkpoint as ckpt
from weightstream.amp import GradScaler
from weightstream.amp.step_helper import apply_gradients, backward_context
from weightstream.checkpoint.weights import load_weights
from weightstream.data.state import aggregate_state_dict
from weightstream.data.streaming import batch_size_of
from weightstream.models.tasks import attention_of, lm_weights, router_loss_coef, task_loss
from weightstream.runtime import swarm
from weightstream.runtime.performance import PerformanceTracker
from weightstream.runtime.rng import capture_rng_state, restore_rng_state

log = logging.getLogger("weightstream")

# The per-step loss log, relative to model_dir (see LossLog).
LOSS_LOG = Path("train") / "losses.jsonl"


@dataclass
class TrainerSettings:
    task: str
    model_dir: Path
    log_steps: int = 10
    checkpoint_steps: int = 0  # 0: only at the end
    max_checkpoints: int | None = None
    save_initial_checkpoint: bool = False
    grad_accum_steps: int = 1
    max_gradient_norm: float | None = None
    max_gradient_value: float | None = None
    check_loss_values: bool = True
    metadata: dict = field(default_factory=dict)
    # The keys of the model's state a checkpoint holds; None: all of it. A LoRA
    # run saves its trainable tensors only (Note [lora checkpoints] in cli/run_lora.py).
    model_keys: tuple[str, ...] | None = None


class Trainer:
    """Owns the training objects of one run and the loops over them."""

    def __init__(
        self,
        settings: TrainerSettings,
        model: torch.nn.Module,
        compiled: Callable,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler=None,
        grad_scaler: GradScaler | None = None,
        perf: PerformanceTracker | None = None,
    ):
        self.s = settings
        self.model = model
        self.compiled = compiled
        # The format of a packed batch's attention mask (Note [packed batches] in
        # models/tasks.py): the model's attention implementation, None for the zoo's.
        self.attention = attention_of(model)
        # A mixture of experts' load-balancing loss in the training loss (Note [router
        # loss] in models/tasks.py): its weight, 0.0 for every other model.
        self.router_coef = router_loss_coef(model)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.grad_scaler = grad_scaler or GradScaler()
        # TensorBoard writers of training and evaluation (common.scalars.ScalarWriter),
        # set by the run command.
        self.writer = None
        self.eval_writer = None
        # Evaluation during training (the run command's train_and_eval with
        # eval_frequency): every ``eval_every`` steps, ``eval_input()``'s batches,
        # ``eval_steps`` of them at most (Note [evaluation during training]).
        self.eval_every: int | None = None
        self.eval_input: Callable[[], object] | None = None
        self.eval_steps: int | None = None
        self.perf = perf or PerformanceTracker()
        self.global_step = 0
        self.losses: list[float] = []
        self._progress: ProgressBar | None = None
        self._loss_log: LossLog | None = None
        self._saved_step: int | None = None

    # ---- checkpoints ----------------------------------------------------------------

    def state_dict(self, dataloader) -> dict:
        # On a sharded store both reads are collective and every rank gets the
        # whole state (Note [sharded store]); rank 0 writes it.
        model_state = self.model.state_dict()
        if self.s.model_keys is not None:
            model_state = OrderedDict((k, model_state[k]) for k in self.s.model_keys)
        optim_state = None if self.optimizer is None else self.optimizer.state_dict()
        state = {
            "model": model_state,
            "global_step": self.global_step,
            "rng": capture_rng_state(),
            "metadata": self.s.metadata,
        }
        if optim_state is not None:
            state["optimizer"] = optim_state
        if self.lr_scheduler is not None:
            state["schedulers"] = [self.lr_scheduler.state_dict()]
        state["grad_scaler"] = self.grad_scaler.state_dict()
        if dataloader is not None:
            # Each rank streams its own shard: the checkpoint keeps every rank's position,
            # and their common place in the global sample order, from which a run on
            # another number of ranks resumes (Note [global position] in data/state.py).
            states = swarm.all_gather_objects(dataloader.state_dict())
            state["dataloader"] = states[0] if len(states) == 1 else aggregate_state_dict(states)
        return state

    def save_checkpoint(self, dataloader) -> Path:
        """Every rank calls this (the state gathers from all); rank 0 writes the file."""
        path = ckpt.checkpoint_path(self.s.model_dir, self.global_step)
        state = self.state_dict(dataloader)
        self._saved_step = self.global_step
        if not swarm.is_main():
            swarm.barrier()
            return path
        try:
            ckpt.save(state, path)
        except ckpt.CheckpointWriteError as e:
            latest = ckpt.find_latest_checkpoint(self.s.model_dir)
            where = (
                f"The newest complete checkpoint, {latest}, is intact: a new run with this "
                "model_dir resumes from it."
                if latest is not None
                else "There is no earlier checkpoint: a new run starts from step 0."
            )
            raise ckpt.CheckpointWriteError(
                f"{e} Training stopped at global step {self.global_step}. {where}"
            ) from e
        log.info("Saving checkpoint at global step %d: %s", self.global_step, path)
        if self.s.max_checkpoints:
            ckpt.prune_checkpoints(self.s.model_dir, self.s.max_checkpoints)
        swarm.barrier()
        return path

    def load_checkpoint(
        self, path, dataloader=None, weights_only: bool = False, name_map=None
    ) -> None:
        if weights_only and not ckpt.is_trainer_checkpoint(path):
            # Evaluation of weights from elsewhere (a Hugging Face folder, a
            # safetensors file): tensor by tensor, at global step 0, by the zoo
            # model's Hugging Face names where it has them (``name_map``).
            load_weights(self.model, path, name_map=name_map)
            self.global_step = 0
            return
        # Lazy: tensor by tensor into the model and the store (Note [bounded loads]).
        state = ckpt.load(path)
        try:
            self._load_trainer_state(path, state, dataloader, weights_only)
        finally:
            if isinstance(state, ckpt.LazyStateDict):
                state.close()

    def _load_trainer_state(self, path, state, dataloader, weights_only: bool) -> None:
        if not isinstance(state, dict) or "model" not in state:
            keys = sorted(map(str, state)) if isinstance(state, dict) else []
            raise ValueError(
                f"{path} is not a trainer checkpoint: it has no 'model' entry (keys: "
                f"{', '.join(keys[:8])}). Pass a checkpoint written by this command."
            )
        if isinstance(state, ckpt.LazyStateDict):
            state.read_small_values()  # a bad value fails before any tensor is copied
        new_constant = False if weights_only else self._check_schedule(path, state)
        # A sharded store fills the tensors this rank owns (Note [sharded store]).
        try:
            self._load_model_state(state["model"])
            if weights_only:  # evaluation: the weights and the step they reached
                self.global_step = int(state.get("global_step", 0))
                return
            if self.optimizer is not None and "optimizer" in state:
                configured = [dict(g) for g in self.optimizer.param_groups]
                self.optimizer.load_state_dict(state["optimizer"])
                self._keep_configured_settings(configured, new_constant)
            if self.lr_scheduler is not None and state.get("schedulers"):
                saved_schedule = state["schedulers"][0]
                if new_constant:  # this run's constant, at the step reached
                    self.lr_scheduler.last_epoch = _read(saved_schedule)["last_epoch"]
                else:
                    self.lr_scheduler.load_state_dict(saved_schedule)
            if "grad_scaler" in state:
                self.grad_scaler.load_state_dict(_read(state["grad_scaler"]))
            if dataloader is not None and "dataloader" in state:
                dataloader.load_state_dict(_read(state["dataloader"]))
            if "rng" in state:
                restore_rng_state(_read(state["rng"]))
            self.global_step = int(state.get("global_step", 0))
        except ckpt.CheckpointError:
            raise  # the file itself is bad: its message names it and what to do
        except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as e:
            # torch's load_state_dict raises RuntimeError on missing keys and shape
            # mismatches; the others come from a state of another structure.
            what = "load the weights of" if weights_only else "resume from"
            differ = _settings_differ(state, self.s.metadata)
            cause = (
                f"it was written with other model settings ({'; '.join(differ)})"
                if differ
                else "it was probably written with another params file (model, optimizer or "
                "data settings)"
            )
            raise ValueError(
                f"cannot {what} {path}: {cause}. {type(e).__name__}: {_first_lines(e)} "
                "Fix: resume with the params file it was written with (a run keeps it in "
                "model_dir/train/params_train.yaml), pass --checkpoint_path with another "
                "checkpoint, or train in a new model_dir."
            ) from e
        log.info("Resumed from %s at global step %d", path, self.global_step)

    # Note [settings on resume]
    # -------------------------
    # A checkpoint holds the optimizer's param groups, hyperparameters and all, and torch's
    # load_state_dict puts them back: a learning rate changed in the params file for the
    # resume would be ignored while the run's records (params_train.yaml, the next
    # checkpoint's metadata) said it was used. The params file is what a run runs with,
    # so after the load each group's hyperparameters are set back to this run's, with a
    # warning naming what changed; the state (moments, step counts) stays the
    # checkpoint's. Only a key a scheduler drives keeps the loaded value (the schedule's
    # value at the step reached); a schedule itself changed is refused before anything
    # loads, since the scheduler's state (its position and its arguments) is the old
    # schedule's: the weights alone start a new one. A constant rate changed for another
    # is no schedule: the run's scheduler keeps its constant and takes the step reached.

    def _check_schedule(self, path, state) -> bool:
        """Refuse a resume whose learning-rate schedule differs from the checkpoint's
        (Note [settings on resume]); True where a constant rate changed, which may."""
        try:
            saved_params = _read(_read(state.get("metadata") or {}).get("params") or {})
            saved = _read(saved_params.get("optimizer") or {}).get("learning_rate")
        except (ckpt.CheckpointError, AttributeError, KeyError, TypeError, ValueError):
            return False
        ours = (((self.s.metadata or {}).get("params") or {}).get("optimizer") or {}).get(
            "learning_rate"
        )
        if saved is None or ours is None:
            return False
        saved, ours = _plain(saved), _plain(ours)
        if saved == ours:
            return False
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (saved, ours)):
            return True
        raise ValueError(
            f"cannot resume from {path} with another learning-rate schedule: the checkpoint "
            f"was written with optimizer.learning_rate {saved!r}, this params file has "
            f"{ours!r}, and the scheduler's saved state (its step and its arguments) is the "
            "old schedule's. Fix: resume with the schedule it was written with; or, for the "
            "new schedule, start a new model_dir from its weights (runconfig.checkpoint_path: "
            f"{path}, load_checkpoint_states: model)."
        )

    def _keep_configured_settings(self, configured: list[dict], new_constant: bool) -> None:
        """Set each param group's hyperparameters back to this run's after the optimizer's
        state loaded (Note [settings on resume]), with a warning naming what changed.
        ``new_constant``: the learning rate is a constant changed since: this run's too."""
        scheduled = set()
        if self.lr_scheduler is not None and not new_constant:
            scheduled.add(getattr(self.lr_scheduler, "param_group_key", "lr"))
        changed = []
        for number, (group, ours) in enumerate(zip(self.optimizer.param_groups, configured)):
            for key, value in ours.items():
                if key in ("params", "initial_lr") or key in scheduled:
                    continue
                if _differs(group.get(key), value):
                    changed.append(f"{key} {group.get(key)!r} -> {value!r} (group {number})")
                    group[key] = value
        if changed:
            log.warning(
                "Resumed with this params file's optimizer settings where they differ from "
                "the checkpoint's: %s.",
                "; ".join(changed[:6]) + (f"; {len(changed) - 6} more" if len(changed) > 6 else ""),
            )

    def _load_model_state(self, state) -> None:
        """The checkpoint's model entry into the model: all of it, or exactly
        ``model_keys`` (the rest of the model is loaded from elsewhere)."""
        if self.s.model_keys is None:
            self.model.load_state_dict(state)
            return
        want, have = set(self.s.model_keys), set(state)
        if want != have:
            missing, unexpected = sorted(want - have), sorted(have - want)
            raise KeyError(
                f"the checkpoint's model entry has {len(have)} tensors, the run trains "
                f"{len(want)}: missing {missing[:4]}, unexpected {unexpected[:4]}."
            )
        self.model.load_state_dict(state, strict=False)

    def warm_start(self, path, states: list[str], dataloader=None, name_map=None) -> None:
        """Take ``states`` (runconfig.load_checkpoint_states) from the checkpoint at ``path``.

        ``model``: the weights, tensor by tensor (``checkpoint.weights``), from any
        checkpoint format; the other states need a trainer checkpoint. Training
        starts at global step 0 either way.
        """
        if "model" in states:
            load_weights(self.model, path, name_map=name_map)
        others = [x for x in states if x != "model"]
        if others:
            state = ckpt.load(path)
            if not isinstance(state, dict) or "model" not in state:
                raise ValueError(
                    f"load_checkpoint_states {', '.join(others)}: {path} holds weights only. "
                    "Fix: take only 'model' from it, or name a checkpoint written by this "
                    "command."
                )
            entries = {
                "optimizer": (self.optimizer, "optimizer"),
                "lr_scheduler": (self.lr_scheduler, "schedulers"),
                "grad_scaler": (self.grad_scaler, "grad_scaler"),
                "dataloader": (dataloader, "dataloader"),
            }
            for name in others:
                target, key = entries[name]
                if key not in state:
                    raise ValueError(f"{path} has no {key!r} state to warm-start {name} from.")
                if target is None:
                    continue
                value = state[key][0] if key == "schedulers" else state[key]
                target.load_state_dict(value if name == "optimizer" else _read(value))
        log.info("Warm-started from %s (%s) at global step 0", path, ", ".join(states))

    # ---- training ---------------------------------------------------------------------

    def _micro_batches(self, it: Iterator) -> tuple[list[dict], float]:
        t0 = time.perf_counter()
        batches = list(itertools.islice(it, self.s.grad_accum_steps))
        return batches, time.perf_counter() - t0

    # Note [the step's token mean]
    # -----------------------------
    # An lm step's loss is the mean over every token the step counts (lm_weights), on
    # all ranks and micro-batches together, as one device would take it over the whole
    # global batch. Where batches count different numbers of tokens (labels -100 on
    # prompts, padding), a mean per micro-batch and per rank, then averaged, weights
    # each batch's tokens by the inverse of its own count: another loss, which moves
    # with the number of ranks and of micro-batches. So the step's count W is summed
    # over its micro-batches and over the ranks first (a collective of one number: a
    # host sync point), and each micro-batch's loss is its tokens' sum over W / N (N
    # ranks): SwarmX's mean of the ranks' gradients (Note [swarm reduce]) is then the
    # gradient of sum / W. With one rank and one micro-batch this is the batch's own
    # mean, bit for bit.

    def _step_denominator(self, batches: list[dict]) -> torch.Tensor | None:
        """W / N of the Note for an lm step (None for other tasks: each batch's mean)."""
        if self.s.task != "lm":
            return None
        count = torch.zeros((), dtype=torch.float32)
        for batch in batches:
            count = count + lm_weights(batch).sum()
        count = swarm.sum_over_ranks(count)  # host sync point
        return count.clamp_min(1.0) / swarm.world_size()

    def _optimizer_step(self, batches: list[dict]) -> tuple[torch.Tensor, int]:
        """One optimizer step over ``batches`` (its micro-batches); returns the step's loss
        and the samples it took on all ranks (a rank's share of an epoch's last batch
        may be smaller than another's)."""
        total, samples = torch.zeros(()), 0
        denominator = self._step_denominator(batches)
        for i, batch in enumerate(batches):
            # SwarmX reduces once per optimizer step: the micro-batches before the
            # last only accumulate (Note [swarm reduce]).
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last else self.compiled.no_sync():
                loss, _, _ = _task_loss(
                    self.s.task, self.compiled, batch, self.attention, denominator,
                    self.router_coef,
                )  # fmt: skip
                # The lm loss is the micro-batch's share of the step's mean already.
                scaled = loss if denominator is not None else loss / len(batches)
                # The last backward may start the update (Note [updates in backward]).
                with self._backward_context() if last else contextlib.nullcontext():
                    self.grad_scaler.scale(scaled).backward()
            # The loss's mean over the ranks and their samples' sum: one collective.
            size = float(batch_size_of(batch))
            mine = torch.stack([scaled.detach().float().cpu(), torch.tensor(size)])
            every = swarm.sum_over_ranks(mine)  # host sync point
            total = total + every[0] / swarm.world_size()
            samples += int(every[1])
        # The step code of every loop (amp.optimizer_step's too).
        apply_gradients(
            self.optimizer,
            self.grad_scaler,
            self.s.max_gradient_norm,
            self.s.max_gradient_value,
        )
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return total, samples

    def _backward_context(self):
        return backward_context(
            self.optimizer,
            self.grad_scaler,
            self.s.max_gradient_norm,
            self.s.max_gradient_value,
        )

    def train(self, dataloader, num_steps: int) -> None:
        """Run ``num_steps`` optimizer steps from ``self.global_step``."""
        if self.s.save_initial_checkpoint and self.global_step == 0:
            self.save_checkpoint(dataloader)
        # Lines past the step this run starts from belong to a run that was
        # killed after it logged them: they are cut (Note in LossLog).
        if swarm.is_main():  # one log for the run, written by rank 0
            self._loss_log = LossLog(self.s.model_dir / LOSS_LOG, self.global_step)
        try:
            self._train(dataloader, num_steps)
        finally:
            if self._loss_log is not None:
                self._loss_log.close()
                self._loss_log = None

    def _train(self, dataloader, num_steps: int) -> None:
        it = iter(dataloader)
        self.perf.start()
        end = self.global_step + num_steps
        self._progress = ProgressBar(self.global_step, end) if sys.stdout.isatty() else None
        while self.global_step < end:
            batches, wait = self._micro_batches(it)
            if not batches:
                break
            # What this step runs with: the scheduler and the scaler move on in it.
            used = self._step_settings()
            t0 = time.perf_counter()
            loss, samples = self._optimizer_step(batches)
            loss_value = loss.item()  # host sync point: the step is complete
            seconds = time.perf_counter() - t0
            self.global_step += 1
            self.perf.add_step(seconds, wait, samples)
            self.losses.append(loss_value)
            self._check_loss(loss_value)
            self._log(loss_value, samples / max(seconds + wait, 1e-9), used)
            if self.s.checkpoint_steps and self.global_step % self.s.checkpoint_steps == 0:
                self.save_checkpoint(dataloader)
            if (
                self.eval_every
                and self.global_step % self.eval_every == 0
                and self.global_step < end
            ):
                self._evaluate_during_training()
        self.perf.stop()
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        # Decided from the run's own history, the same on every rank (a file check
        # could differ between ranks while rank 0 writes).
        if self._saved_step != self.global_step and not (
            ckpt.checkpoint_path(self.s.model_dir, self.global_step).exists()
            and swarm.world_size() == 1
        ):
            self.save_checkpoint(dataloader)

    def _check_loss(self, value: float) -> None:
        if math.isfinite(value) or not self.s.check_loss_values:
            return
        if self.grad_scaler.dynamic:
            return  # the scaler skipped the step; the loss scale adapts
        latest = ckpt.find_latest_checkpoint(self.s.model_dir)
        newest = (
            f"the newest checkpoint, {latest}, is the last good state (a new run in this "
            "model_dir resumes from it)"
            if latest is not None
            else "there is no checkpoint yet (a new run starts from step 0)"
        )
        raise FloatingPointError(
            f"the loss is {value} at global step {self.global_step}; training stopped and "
            f"{newest}. Lower the learning rate, enable dynamic loss scaling "
            "(loss_scaling_factor: dynamic) or set runconfig.check_loss_values: false to "
            "continue regardless."
        )

    def _step_settings(self) -> dict[str, float]:
        """The learning rate (of the first param group) and loss scale the next step uses."""
        found = {"lr": float(self.optimizer.param_groups[0]["lr"])} if self.optimizer else {}
        return {**found, "loss_scale": self.grad_scaler.get_scale()}

    def _log(self, loss: float, rate: float, used: dict[str, float]) -> None:
        step = self.global_step
        if self._loss_log is not None:
            self._loss_log.append(step, loss)
        if self.writer is not None:  # one event a step (Note [one event per step])
            self.writer.add(step, {"loss": loss, **used, "samples_per_sec": rate})
        if step % self.s.log_steps == 0 or step == 1:
            if self._progress is not None:
                self._progress.clear()
            log.info("global_step = %d, loss = %.5f", step, loss)
        if self._progress is not None:
            self._progress.update(step, loss)

    # ---- evaluation ---------------------------------------------------------------------

    # Note [evaluation during training]
    # ---------------------------------
    # train_and_eval with eval_frequency N evaluates the weights of every N-th step
    # while training, with the training's own compiled model (no second copy of the
    # weights), and once more after the last step as without it. An evaluation in the
    # middle must leave the training as it was: the optimizer's overlapped update is
    # applied first (the weights evaluated are the step's), the model returns to train
    # mode, and the global random generators are restored afterwards (a torch
    # DataLoader draws its seed from them when iterated, and the training's dropout
    # and sampling must not see that draw), so the losses equal a run without it. Its
    # time is not training time: the step rate leaves it out.

    def _evaluate_during_training(self) -> None:
        """One evaluation of the current weights (Note [evaluation during training])."""
        if self.optimizer is not None and hasattr(self.optimizer, "synchronize"):
            self.optimizer.synchronize()
        self.perf.pause()
        state = capture_rng_state()  # every generator the training draws from
        try:
            self.evaluate(self.eval_input(), self.eval_steps)
        finally:
            restore_rng_state(state)
            self.perf.resume()

    @torch.no_grad()
    def evaluate(self, dataloader, num_steps: int | None = None) -> dict[str, float]:
        from weightstream import metrics

        self.compiled.eval()
        # Per batch, this rank's sum of the loss over its targets (lm) or samples, and
        # their count: the global batch's mean is the ranks' sums over their counts.
        sums: list[float] = []
        counts: list[float] = []
        accuracy = metrics.AccuracyMetric("eval/accuracy")
        perplexity = metrics.PerplexityMetric("eval/perplexity") if self.s.task == "lm" else None
        for i, batch in enumerate(dataloader):
            if num_steps is not None and i >= num_steps:
                break
            loss, logits, extra = _task_loss(self.s.task, self.compiled, batch, self.attention)
            labels = extra["labels"]
            preds = logits.argmax(-1)
            if self.s.task == "lm":
                w = extra["weights"].view_as(labels)
                accuracy.update(labels, preds, weights=w)
                perplexity.update(labels, extra["per_token"].view_as(labels), weights=w)
                count = float(w.sum())  # host sync point
            else:
                accuracy.update(labels, preds)
                count = float(labels.shape[0])
            sums.append(loss.item() * max(count, 1.0))  # the loss divides by at least 1
            counts.append(count)
        self.compiled.train()
        steps = len(sums)
        # Each rank evaluated its share of every batch: sum the metrics' accumulators, and
        # the loss sums and counts batch by batch (one collective).
        for metric in (accuracy, perplexity):
            if metric is not None:
                for acc in metric.accumulators():
                    acc.copy_(swarm.sum_over_ranks(acc))
        if steps == 0:
            raise ValueError("the evaluation data loader produced no batch; check eval_input.")
        totals = torch.tensor([sums, counts], dtype=torch.float64)
        if swarm.world_size() > 1:
            totals = swarm.sum_over_ranks(totals)
        means = totals[0] / totals[1].clamp_min(1.0)
        results = {"loss": float(means.mean()), "accuracy": float(accuracy)}
        if perplexity is not None:
            results["perplexity"] = float(perplexity)
        if self.eval_writer is not None:
            self.eval_writer.add(self.global_step, results)
            self.eval_writer.flush()
        log.info(
            "Eval at global step %d over %d steps: %s",
            self.global_step,
            steps,
            ", ".join(f"{k} = {v:.5f}" for k, v in results.items()),
        )
        return results


def _task_loss(
    task: str, model, batch: dict, attention: str | None = None, denominator=None, router=0.0
):
    """``task_loss``, with an embedding's raw IndexError told as the data problem it is."""
    try:
        return task_loss(task, model, batch, attention, denominator, router)
    except IndexError as e:
        ids = batch.get("input_ids", batch.get("inputs"))
        length = f" (this batch's are {ids.shape[-1]} long)" if ids is not None else ""
        raise ValueError(
            f"a batch holds an index the model has no row for ({e}): a token id at or beyond "
            "the model's vocab_size, or a position beyond its learned position embeddings "
            f"for a sequence longer than the model takes{length}, such as GPT-2's n_positions "
            "or OPT's max_position_embeddings. Fix: the model's vocab_size for the data's "
            "vocabulary (its tokenizer's), or the data written with the model's tokenizer; "
            "a seq_len within the model's positions."
        ) from e


class LossLog:
    """``model_dir/train/losses.jsonl``: the loss of every optimizer step, one JSON line each.

    A line is ``{"step": 12, "loss": 3.41903...}``; Python's json writes the
    float with ``repr``, so it reads back bit for bit (a non-finite loss as
    ``NaN`` / ``Infinity``, which Python's json reads). Each line is appended
    and flushed when its step is complete, so it survives a kill of the process
    (not a crash of the machine: the file is not fsynced, the checkpoints are).

    Opening it for a run that starts at global step ``start`` cuts the file
    after the line of step ``start``: lines of later steps were written by a
    run that was killed before its next checkpoint, and a partial last line
    by a kill in the middle of a write. So the file always holds one line per
    step of the one history a resumed run continues, as if it had never
    stopped. Owner: the Trainer, for one call of ``train()``.
    """

    def __init__(self, path: Path, start: int) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")  # closed by close()
        try:
            self._cut(start)
        except BaseException:
            self._file.close()
            raise

    def _cut(self, start: int) -> None:
        keep = 0
        with open(self.path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break  # a partial line: the write was interrupted
                try:
                    step = json.loads(line)["step"]
                except (ValueError, KeyError, TypeError):
                    break
                if not isinstance(step, int) or step > start:
                    break
                keep += len(line)
        if keep != os.fstat(self._file.fileno()).st_size:
            self._file.truncate(keep)

    def append(self, step: int, loss: float) -> None:
        line = json.dumps({"step": step, "loss": loss}) + "\n"
        self._file.write(line.encode())
        self._file.flush()  # one write(2) per step: whole lines reach the file

    def close(self) -> None:
        self._file.close()

    @staticmethod
    def read(path: str | os.PathLike) -> list[tuple[int, float]]:
        """(step, loss) of every complete line of a loss log."""
        out = []
        with open(path, "rb") as f:
            for line in f:
                if line.endswith(b"\n"):
                    entry = json.loads(line)
                    out.append((entry["step"], entry["loss"]))
        return out


class ProgressBar:
    """The training progress line on a terminal: tqdm's bar, rate and time left, with the loss."""

    def __init__(self, start: int, end: int, stream=None):
        # shutil's size falls back to 80 x 24 where the terminal reports 0 x 0 (a
        # pseudo-terminal nobody sized), on which tqdm would hide the bar.
        cols, rows = shutil.get_terminal_size()
        self._bar = tqdm(
            total=end,
            initial=start,
            file=stream or sys.stdout,
            unit="step",
            ncols=cols,
            nrows=rows,
        )

    def update(self, step: int, loss: float) -> None:
        self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self._bar.update(step - self._bar.n)

    def clear(self) -> None:
        """Off the terminal before a log line; the next update draws it again."""
        self._bar.clear()

    def close(self) -> None:
        self._bar.close()


def _settings_differ(state, metadata: dict | None, most: int = 6) -> list[str]:
    """The model settings of the params the checkpoint recorded that differ from this
    run's, in words ("d_model: 128 in the checkpoint, 64 here"); [] where either is
    unknown."""
    try:
        saved = _read(_read(state.get("metadata") or {}).get("params") or {}).get("model")
    except (ckpt.CheckpointError, AttributeError, KeyError, TypeError, ValueError):
        return []
    ours = ((metadata or {}).get("params") or {}).get("model")
    if not isinstance(saved, dict) or not isinstance(ours, dict):
        return []
    differ = [
        f"model.{key}: {saved.get(key)!r} in the checkpoint, {ours.get(key)!r} here"
        for key in sorted(set(saved) | set(ours), key=str)
        if saved.get(key) != ours.get(key)
    ]
    return differ[:most] + ([f"{len(differ) - most} more"] if len(differ) > most else [])


def _plain(value):
    """A params value as plain Python (a checkpoint's lists may come back as tuples)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _differs(a, b) -> bool:
    """Whether two hyperparameter values differ (tensors by value, tuples as lists)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return _plain(a) != _plain(b)


def _first_lines(error: BaseException, most: int = 4) -> str:
    """An error's text, its first lines only (torch lists every mismatched tensor)."""
    lines = str(error).splitlines()
    more = f" ... ({len(lines) - most} more lines)" if len(lines) > most else ""
    return " ".join(line.strip() for line in lines[:most]) + more


def _read(value):
    """A small state of a lazily loaded checkpoint, read whole: its owner may keep it
    past the load, when the file is closed (the data loader reads its state when
    iteration starts)."""
    return value.to_dict() if isinstance(value, ckpt.LazyStateDict) else value
