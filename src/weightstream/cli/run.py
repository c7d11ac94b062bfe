"""``weightstream run``: a params file in, a model directory out.

model_dir after a training run:
    checkpoint_{step}.mdl        trainer checkpoints (every checkpoint_steps and at the end)
    train/                       TensorBoard events of training, params_train.yaml,
                                 losses.jsonl (the loss of every step; see trainer.LossLog)
    eval/                        TensorBoard events of evaluation, params_eval.yaml
    ws_<checksum>/               the compile directory: plan.json, compile_report.txt
    performance/performance.json compile_time, est_samples_per_sec, ... (seed 000)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import random
import signal
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import yaml

import weightstream as cstorch
from weightstream import checkpoint as ckpt
from weightstream.cli.launch import report_error
from weightstream.cli.params import Params, save_params
from weightstream.cli.run_args import build_run_parser, params_from_args
from weightstream.cli.run_checkpoints import (
    finished,
    latest_or_given,
    own_checkpoint,
    resume_from,
)
from weightstream.cli.run_checks import (
    check_model_takes_input,
    check_vocabulary,
    warn_streaming_settings_unused,
    warn_wrapping_eval,
)
from weightstream.cli.run_lora import base_record, check_base_of, load_base, trained_keys
from weightstream.common import lora
from weightstream.common.hf_names import hf_name_map
from weightstream.common.materialize import materialize, materialize_buffers
from weightstream.common.scalars import NoScalarWriter, ScalarWriter
from weightstream.context import run_configuration
from weightstream.data.streaming import batch_size_of
from weightstream.models import hf
from weightstream.models.tasks import attention_of, model_inputs, model_kwargs
from weightstream.runtime import swarm
from weightstream.runtime.budgets import check_budget
from weightstream.runtime.config import StreamingConfig
from weightstream.runtime.footprint import HostFootprint, host_footprint, resident_footprint
from weightstream.runtime.performance import PerformanceTracker
from weightstream.runtime.rng import capture_rng_state, restore_rng_state
from weightstream.runtime.store import check_store_dir
from weightstream.train.trainer import Trainer, TrainerSettings

log = logging.getLogger("weightstream")


def _setup_logging() -> None:
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Run:
    """One invocation of the run command."""

    def __init__(self, params: Params, mode: str, target: str):
        self.params = params
        self.mode = mode
        self.rc = params.runconfig
        if target.upper() == "GPU" and not torch.cuda.is_available():
            raise ValueError(
                "weightstream run GPU needs a CUDA device, and torch.cuda.is_available() is "
                "False here. Fix: weightstream run CPU ..., or a CUDA build of torch on a "
                "machine with a GPU."
            )
        self.device = torch.device("cuda" if target.upper() == "GPU" else "cpu")
        self.model_dir = Path(self.rc.model_dir)
        self.perf = PerformanceTracker()
        self.task = params.model.spec.task
        self.ws = self.rc.execution_mode == "weight_streaming"
        if not self.ws:
            warn_streaming_settings_unused(self.rc.streaming)
        # Owner: this run. Why: a compiled model's engine holds a prefetch thread,
        # hooks and, with the disk store, mapped files; the run closes them when
        # it ends, so a process that runs the command again (tests, benchmarks)
        # keeps none of them.
        self._compiled: list = []

    # ---- building ---------------------------------------------------------------------

    def _write_performance(self) -> None:
        if swarm.is_main():
            self.perf.write(self.model_dir)

    def _write_params(self, sub: str) -> None:
        """The first write of a phase: model_dir/sub/params_{sub}.yaml (rank 0)."""
        if not swarm.is_main():
            return
        directory = self.model_dir / sub
        # Say plainly when model_dir cannot be written, before TensorBoard's
        # writer thread or a checkpoint save finds out on its own.
        for d in (self.model_dir, directory):
            try:
                d.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryFile(dir=d):
                    pass
            except OSError as e:
                raise OSError(
                    e.errno,
                    f"cannot write in {d} ({e.strerror}); make it writable, or give another "
                    "model directory with -o",
                ) from e
        save_params(self.params, directory / f"params_{sub}.yaml")

    def _compute_dtype(self):
        m = self.params.model
        return m.fp16_type if m.mixed_precision else None

    def _autocast(self):
        dt = self._compute_dtype()
        if dt in ("float16", "bfloat16"):
            return torch.autocast(self.device.type, dtype=getattr(torch, dt))
        return contextlib.nullcontext()

    def _build_model(self, weights_from_checkpoint: bool = False):
        """The model and its compiled form. ``weights_from_checkpoint``: a warm start
        will fill the weights (runconfig.load_checkpoint_states), so none are drawn."""
        # Validating or compiling needs shapes only, and a model of billions of
        # parameters fits no host's memory: both build on the meta device. The
        # disk store materializes a meta model in its files, module by module,
        # drawing what the in-memory build draws (common.materialize); for a warm
        # start the engine gives it storage and the checkpoint gives the values.
        rc = self.rc
        shapes_only = rc.validate_only or rc.compile_only
        warm = weights_from_checkpoint and self.ws and not shapes_only
        on_meta = shapes_only or (self.ws and rc.streaming.store == "disk") or warm
        peft = self.params.peft
        model = self.params.model.build("meta" if on_meta or peft else "cpu")
        # A transformers model streams (and recomputes) decoder layer by decoder layer.
        units = hf.unit_classes(model) if hf.is_hf_model(model) else None
        if peft is not None:
            if not on_meta:  # layer pipelined: storage for the warm start, nothing drawn
                materialize_buffers(model, "cpu")
                materialize(model, _zeros, skip=lambda _name: True, without_rule="leave")
            # The adapters are drawn here, after the seed and before anything else
            # draws (Note [lora on meta] in common/lora.py).
            model = lora.wrap(model, peft.config)
        if rc.master_dtype != "float32":
            # Before the store takes the model: its masters keep the parameters' dtype
            # (Note [Kahan summation] in optim/compact.py). Buffers keep theirs.
            _convert_parameters(model, getattr(torch, rc.master_dtype))
        if self._compute_dtype() is not None:
            # The run's half type, as a reference script sets it before its model: the
            # GradScaler's default loss scales follow it (this run's context only).
            cstorch.amp.set_half_dtype(self._compute_dtype())
        kwargs = {"device": self.device}
        if self.ws:
            # The runconfig's streaming settings are the engine's StreamingConfig;
            # the run derives the rest. Nothing is stored when only shapes are
            # needed. The disk store's files go beside the run's other outputs by
            # default: on the disk the user chose, not in /tmp.
            disk = rc.streaming.store == "disk" and not shapes_only
            store_dir = rc.streaming.store_dir or str(self.model_dir / "store")
            kwargs["streaming"] = dataclasses.replace(
                rc.streaming,
                compute_dtype=self._compute_dtype(),
                init_weights=not warm,
                unit_classes=units,
                store="disk" if disk else "ram",
                store_dir=store_dir if disk else None,
                host_memory_budget=rc.streaming.host_memory_budget if disk else None,
            )
        elif rc.streaming.activation_checkpointing:
            # Layer pipelined recomputes the units these settings choose (Note
            # [activation checkpointing] in runtime/recompute.py).
            kwargs["streaming"] = dataclasses.replace(rc.streaming, unit_classes=units)
        # compile() joins the ranks: every rank starts from rank 0's weights, and
        # SwarmX reduces the gradients in every backward (Note [swarm reduce]).
        compiled = cstorch.compile(model, backend="wse_ws" if self.ws else "wse_lp", **kwargs)
        self._compiled.append(compiled)
        return model, compiled

    def _input_fn(self, section, is_training: bool):
        from weightstream.data.processors import get_data_processor

        processor = get_data_processor(section.data_processor)
        values = section.to_dict()
        return lambda: processor(values, is_training)

    def _dataloader(self, section, is_training: bool, **steps):
        return cstorch.utils.data.DataLoader(self._input_fn(section, is_training), **steps)

    # ---- compile ----------------------------------------------------------------------

    def compile(self, compiled, section) -> None:
        """Trace with the real batch shape, build the plan and the report (seeds 001/002).

        Draws no random number from the run's generators (the example batch's
        loader draws its seed from torch's): a run resumed from a checkpoint
        restores them before compiling, and must continue from them exactly.
        """
        rng = capture_rng_state()
        try:
            self._compile(compiled, section)
        finally:
            restore_rng_state(rng)

    def _compile(self, compiled, section) -> None:
        t0 = time.perf_counter()
        example = next(iter(self._input_fn(section, True)()))
        args = model_inputs(self.task, example)
        # A packed batch's position_ids and mask (Note [packed batches] in models/tasks.py):
        # the plan and the estimate trace the call the trainer makes.
        kwargs = model_kwargs(self.task, example, attention_of(compiled._orig_mod))
        if self.ws:
            with self._autocast():
                plan = compiled.engine.prepare(*args, **kwargs)
            if self.rc.validate_only or self.rc.compile_only:
                # Planned in RAM, as shapes: check the plan against the streaming settings
                # as training will have them, a disk store's host_memory_budget too.
                check_budget(plan, self._streaming(), self.device)
                if self.rc.streaming.store == "disk":
                    check_store_dir(self.rc.streaming.store_dir or self.model_dir / "store")
            log.info("Streaming plan: %d units\n%s", len(plan.units), plan.describe())
            log.info("Training state: %s", compiled.engine.describe_tiers())
            predicted = compiled.engine.store.predicted_placement()
            if predicted is not None:  # a disk store's (Note [hybrid placement])
                log.info("Disk store: %s", predicted.describe())
        from weightstream.compiler import compile_phase

        result = compile_phase.run(self, compiled, args, batch_size_of(example), kwargs)
        self.perf.est_samples_per_sec = result.get("est_samples_per_sec")
        self.perf.compile_time = time.perf_counter() - t0
        log.info("Compile finished in %.2f s", self.perf.compile_time)

    # ---- modes ------------------------------------------------------------------------

    def execute(self) -> int:
        joined_here = swarm.world_size() == 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1
        if swarm.init_from_env(self.device) and not swarm.is_main():
            log.setLevel(logging.WARNING)  # rank 0 reports for the run
        try:
            self._check_same_params_on_every_rank()
            return self._execute_configured()
        finally:
            if joined_here:
                # The process group this run joined ends with it: its threads are
                # stopped before the interpreter exits.
                swarm.shutdown()

    def _check_same_params_on_every_rank(self) -> None:
        """Ranks started by hand (torchrun) with other params files or overrides: another
        learning rate or clipping trains on silently (a sharded store updates each rank's
        units by its own), another model or accumulation hangs in a collective. One
        all-reduce of a digest of the params as this run reads them. Collective."""
        if swarm.world_size() == 1:
            return
        text = yaml.safe_dump(self.params.to_dict(), sort_keys=True) + self.mode
        digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")
        mine = torch.tensor([digest, -digest], dtype=torch.int64)
        high = swarm.max_over_ranks(mine)  # [largest digest, -smallest digest]
        if int(high[0]) != -int(high[1]):
            raise ValueError(
                f"the {swarm.world_size()} data-parallel ranks were started with different "
                "params (the params file, its overrides on the command line, or the mode "
                f"differ between ranks; this is rank {swarm.rank()}, mode {self.mode}). "
                "Fix: start every rank with the same params file and arguments "
                "(`weightstream run ... --num_csx N` does)."
            )

    def _execute_configured(self) -> int:
        self.model_dir.mkdir(parents=True, exist_ok=True)
        servers = self.rc.streaming.num_wgt_servers  # null: configure()'s default
        with run_configuration(
            model_dir=str(self.model_dir),
            compile_dir=self.rc.compile_dir,
            compile_only=self.rc.compile_only,
            validate_only=self.rc.validate_only,
            checkpoint_steps=self.rc.checkpoint_steps,
            num_csx=self.rc.num_csx,
            **({"max_wgt_servers": servers} if servers else {}),
            num_workers_per_csx=self.rc.num_workers_per_csx,
        ):
            try:
                return self._execute()
            finally:
                while self._compiled:
                    self._compiled.pop().close()

    def _execute(self) -> int:
        _seed_everything(self.rc.seed)
        if self.mode in ("train", "train_and_eval"):
            self.train()
            if self.mode == "train_and_eval" and not (
                self.rc.compile_only or self.rc.validate_only
            ):
                # What this run trained: its newest checkpoint, never the one it
                # started from (checkpoint_path).
                latest = ckpt.find_latest_checkpoint(self.model_dir)
                self.evaluate(latest or latest_or_given(self.model_dir, self.rc))
        elif self.mode == "eval":
            self.evaluate(latest_or_given(self.model_dir, self.rc))
        elif self.mode == "eval_all":
            checkpoints = ckpt.list_checkpoints(self.model_dir)
            if not checkpoints:
                raise ValueError(
                    f"eval_all found no checkpoint_*.mdl in {self.model_dir}; train first or "
                    "pass -o with a model directory that has checkpoints."
                )
            complete = []
            for _, path in checkpoints:
                if ckpt.is_complete_checkpoint(path):
                    complete.append(path)
                else:
                    log.warning("eval_all: skipping %s: it is incomplete or unreadable.", path)
            if not complete:
                raise ValueError(
                    f"eval_all found no complete checkpoint in {self.model_dir}: every "
                    "checkpoint_*.mdl there is incomplete or unreadable."
                )
            # In step order, into one events file whose first step purges the events
            # logged earlier from there on: each step once (eval_all evaluates them again).
            writer = None
            try:
                for path in complete:
                    step, results = self.evaluate(path, record=False)
                    writer = writer or self._eval_writer(purge_step=step)
                    writer.add(step, results)
                    writer.flush()  # on disk as each evaluation ends
            finally:
                if writer is not None:
                    writer.close()
        return 0

    def train(self) -> None:
        p, rc = self.params, self.rc
        # A run resumes from its own newest checkpoint; only a run that has none
        # warm-starts (runconfig.load_checkpoint_states) from checkpoint_path.
        own = own_checkpoint(self.model_dir, rc)
        warm = rc.warm_start_states if own is None else []
        check_vocabulary(p)
        peft = p.peft is not None
        if peft and own is not None:
            # Before building anything (Note [lora checkpoints] in cli/run_lora.py).
            check_base_of(own, rc.checkpoint_path)
        model, compiled = self._build_model(weights_from_checkpoint="model" in warm or peft)
        check_model_takes_input(self.params, model)
        if rc.validate_only or rc.compile_only:
            # The run's optimizer, on the meta device, bound before the plan's log line
            # (Training state:) so that it counts the state this optimizer makes.
            optimizer = self._optimizer(model)
            self.compile(compiled, p.train_input)
            footprint = self._host_footprint(model, compiled, optimizer) if self.ws else None
            fits = footprint is None or footprint.where != "neither"
            if footprint is not None:
                log.log(logging.INFO if fits else logging.WARNING, "%s", footprint.describe())
            else:  # layer pipelined: the whole state on the device
                fits, line = resident_footprint(model, optimizer, self.device)
                log.log(logging.INFO if fits else logging.WARNING, "%s", line)
            self._write_params("train")
            self._write_performance()
            mode = "validate_only" if rc.validate_only else "compile_only"
            if fits:
                log.info("%s: done without training.", mode)
            else:
                if footprint is None:
                    room = f"does not fit {self.device}'s memory (layer pipelined)"
                elif footprint.store == "disk":
                    room = "fits neither this host's RAM nor the store's disk"
                else:
                    room = "does not fit this host's RAM budget (a RAM store)"
                log.warning(
                    "%s: done without training. The model compiles, but its training state "
                    "%s: trained here as set up, it would run out of memory or disk (the "
                    "fixes are above).",
                    mode,
                    room,
                )
            return
        # Everything that can be wrong with the input (data settings and files,
        # optimizer, the checkpoint to resume from) is checked before the first
        # write to model_dir: bad input changes nothing on disk (invariant 3).
        t_program = time.perf_counter()
        opt_params = p.optimizer
        optimizer = self._optimizer(model)
        learning_rate = opt_params.optimizer_kwargs().get("learning_rate")
        lr_scheduler = None
        if learning_rate is not None:
            lr_scheduler = cstorch.optim.configure_lr_scheduler(
                optimizer, learning_rate, adjust_learning_rate=opt_params.adjust_learning_rate
            )
        scaler = cstorch.amp.GradScaler(**opt_params.grad_scaler_kwargs())
        settings = TrainerSettings(
            task=self.task,
            model_dir=self.model_dir,
            log_steps=rc.log_steps,
            checkpoint_steps=rc.checkpoint_steps,
            max_checkpoints=rc.max_checkpoints,
            save_initial_checkpoint=rc.save_initial_checkpoint,
            grad_accum_steps=opt_params.grad_accum_steps,
            max_gradient_norm=opt_params.max_gradient_norm,
            max_gradient_value=opt_params.max_gradient_value,
            check_loss_values=rc.check_loss_values,
            metadata={
                "version": cstorch.__version__,
                "model": p.model.name,
                "params": _recorded_params(p),
                **({"peft": base_record(rc.checkpoint_path, p.peft)} if peft else {}),
            },
            model_keys=trained_keys(model) if peft else None,
        )
        trainer = Trainer(
            settings,
            model,
            _Autocast(compiled, self._autocast),
            optimizer,
            lr_scheduler,
            scaler,
            perf=self.perf,
        )
        dataloader = self._dataloader(
            p.train_input,
            True,
            num_steps=rc.num_steps,
            max_steps=rc.max_steps,
            num_epochs=rc.num_epochs,
            steps_per_epoch=rc.steps_per_epoch,
            grad_accum_steps=opt_params.grad_accum_steps,
        )
        if rc.warm_start_states:
            resume = own  # checkpoint_path is the warm start's source
        else:
            resume = Path(rc.checkpoint_path) if rc.checkpoint_path else own
        if resume is not None and finished(resume, rc.max_steps):
            return
        if peft:
            load_base(model, rc.checkpoint_path)
        if resume is not None:
            resume_from(trainer, resume, dataloader, self.model_dir, bool(rc.checkpoint_path))
        elif peft:
            log.info("Warm-started the base model from %s at global step 0", rc.checkpoint_path)
        elif warm:
            # A zoo model reads a Hugging Face checkpoint of its architecture by its
            # transformers names (common/hf_names.py).
            names = hf_name_map(p.model.name)
            trainer.warm_start(Path(rc.checkpoint_path), warm, dataloader, name_map=names)
        if self.mode == "train_and_eval":
            self._check_eval_input(compiled)
        self.perf.programming_time = time.perf_counter() - t_program
        # Compiling reads the first batch (checking the data) and writes only the
        # compile directory, and that only once everything compiled.
        self.compile(compiled, p.train_input)
        self._write_params("train")
        # purge_step: TensorBoard hides the events of steps after the checkpoint this
        # run starts from, logged by an earlier run that was killed before its next
        # checkpoint (this run logs those steps again).
        writer = trainer.writer = (
            ScalarWriter(self.model_dir / "train", purge_step=trainer.global_step + 1)
            if swarm.is_main()
            else NoScalarWriter()
        )
        if swarm.is_main():
            for path, size in ckpt.remove_stale_temporaries(self.model_dir):
                log.info("Removed %s (%d bytes): the temporary file of a save killed midway.",
                         path.name, size)  # fmt: skip
        steps = dataloader.num_steps
        if self.mode == "train_and_eval" and rc.eval_frequency:
            # Note [evaluation during training] in train/trainer.py.
            trainer.eval_every, trainer.eval_steps = rc.eval_frequency, rc.eval_steps
            trainer.eval_input = lambda: self._eval_loader(p.eval_input, rc.eval_steps)
            trainer.eval_writer = self._eval_writer(purge_step=trainer.global_step + 1)
        log.info("Training %d steps from global step %d", steps, trainer.global_step)
        try:
            trainer.train(dataloader, steps)
        except BaseException:
            # Never let a failure to write these hide the error that stopped training.
            with contextlib.suppress(Exception):
                writer.close()
            if trainer.eval_writer is not None:
                with contextlib.suppress(Exception):
                    trainer.eval_writer.close()
            with contextlib.suppress(Exception):
                self._write_performance()
            raise
        writer.close()
        if trainer.eval_writer is not None:
            trainer.eval_writer.close()
        self._write_performance()
        est = self.perf.est_samples_per_sec
        log.info(
            "Training finished with %d samples in %.3f seconds, %.2f samples/second%s.",
            self.perf.total_samples,
            self.perf.total_time,
            self.perf.samples_per_sec,
            f" (estimated {est:.2f})" if est else "",
        )
        if trainer.losses:
            log.info("Loss for final step: %.5f", trainer.losses[-1])
        self.trainer = trainer

    def _check_eval_input(self, compiled) -> None:
        """Build train_and_eval's eval input once before step 1, so that what is wrong
        with it (no section, a missing file, fewer samples than a batch, sequences the
        model does not take) stops the run before training, not after it. The random
        generators are left as they were: training draws what it draws in mode train."""
        p = self.params
        if p.eval_input is None:
            raise ValueError(
                "train_and_eval needs an eval_input section in the params file; add one, or "
                "run with -m train."
            )
        state = capture_rng_state()
        try:
            loader = self._input_fn(p.eval_input, False)()
            if self.task == "lm":
                self._check_longer_eval_batches(compiled, next(iter(loader)))
        finally:
            restore_rng_state(state)

    def _check_longer_eval_batches(self, compiled, example: dict) -> None:
        """Eval batches longer than the training ones: the model's forward on their shape,
        traced on fake tensors (nothing computed). Training traces its own batch when it
        compiles; a model that cannot be traced at all is left to the run."""
        from weightstream.runtime.trace import trace_forward

        train = next(iter(self._input_fn(self.params.train_input, True)()))
        if example["input_ids"].shape[-1] <= train["input_ids"].shape[-1]:
            return
        model = compiled._orig_mod
        attention = attention_of(model)

        def trace(batch: dict) -> None:
            with self._autocast():
                trace_forward(
                    model, model_inputs(self.task, batch), model_kwargs(self.task, batch, attention)
                )

        try:
            trace(example)
        except Exception as exc:
            try:
                trace(train)
            except Exception:
                return  # not traceable here: the training run's own trace says so
            raise ValueError(
                f"eval_input: the model does not take its batches of "
                f"{example['input_ids'].shape[-1]} tokens ({exc}). Fix: eval_input.seq_len "
                "at most the model's sequence length."
            ) from exc

    def _optimizer(self, model):
        """The params file's optimizer over ``model``'s trainable parameters."""
        opt_params = self.params.optimizer
        # Only what trains has optimizer state (a LoRA run's frozen base has none).
        groups = [{"params": [q for q in model.parameters() if q.requires_grad]}]
        if opt_params.weight_decay:
            groups = cstorch.optim.param_groups_with_weight_decay(model, opt_params.weight_decay)
            for group in groups:
                group["params"] = [q for q in group["params"] if q.requires_grad]
            groups = [g for g in groups if g["params"]]
        optimizer = cstorch.optim.configure_optimizer(
            opt_params.optimizer_type, params=groups, **opt_params.optimizer_kwargs()
        )
        if self.rc.master_dtype != "float32" and not hasattr(optimizer, "kahan_summation"):
            warnings.warn(
                f"weightstream: runconfig.master_dtype {self.rc.master_dtype} with "
                f"{type(optimizer).__name__}, which keeps no Kahan buffer (Note [Kahan "
                "summation] in optim/compact.py): an update below half a "
                f"{self.rc.master_dtype} ulp of its weight (lr 1e-4 on a weight of 0.5) "
                "rounds away, every step. Fix: master_dtype float32, or an optimizer of "
                "the Adam family or SGD.",
                stacklevel=2,
            )
        return optimizer

    def _streaming(self) -> StreamingConfig:
        """The runconfig's streaming settings as a training run of this file takes them."""
        return dataclasses.replace(self.rc.streaming, compute_dtype=self._compute_dtype())

    def _host_footprint(self, model, compiled, optimizer) -> HostFootprint:
        """The training state's host bytes as configured, and where they go (Note [host
        footprint] in runtime/footprint.py). ``model`` is on the meta device: so is the
        state of ``optimizer`` (the run's, built over it), which is what gets counted."""
        streaming = self._streaming()
        return host_footprint(
            model,
            optimizer,
            compiled.engine.plan,
            streaming,
            self.device,
            store_dir=streaming.store_dir or str(self.model_dir / "store"),
            device_tier=compiled.engine.resident,  # a budget's units, chosen at compile
        )

    def _eval_loader(self, section, steps: int | None):
        """An evaluation's batches: ``steps`` of them (a warning where that reads some
        again), else one pass over the eval input."""
        if not steps:
            return self._input_fn(section, False)()
        loader = self._dataloader(section, False, num_steps=steps)
        warn_wrapping_eval(steps, loader.loader)
        return loader

    def _eval_writer(self, purge_step: int | None = None):
        """The eval events' writer (rank 0's; ``purge_step`` as :class:`ScalarWriter`'s)."""
        if not swarm.is_main():
            return NoScalarWriter()
        return ScalarWriter(self.model_dir / "eval", purge_step=purge_step)

    def evaluate(self, checkpoint_path: Path, record: bool = True) -> tuple[int, dict]:
        """Evaluate the weights of ``checkpoint_path``: (its step, the results), written
        to the eval events where ``record`` (eval_all writes its own)."""
        p, rc = self.params, self.rc
        if p.eval_input is None:
            raise ValueError("evaluation needs an eval_input section in the params file.")
        # The checkpoint gives every weight: nothing is drawn for them first.
        peft = p.peft is not None
        if peft and ckpt.is_trainer_checkpoint(checkpoint_path):
            check_base_of(checkpoint_path, rc.checkpoint_path)
        model, compiled = self._build_model(weights_from_checkpoint=True)
        check_model_takes_input(self.params, model)
        trainer = Trainer(
            TrainerSettings(
                task=self.task,
                model_dir=self.model_dir,
                model_keys=trained_keys(model) if peft else None,
                metadata={"params": _recorded_params(p)},  # to name a mismatched checkpoint's
            ),
            model,
            _Autocast(compiled, self._autocast),
        )
        if peft:
            # The base from its folder, the adapters from the checkpoint (none yet: the
            # base folder itself is the start, with the initial adapters).
            load_base(model, rc.checkpoint_path)
            if ckpt.is_trainer_checkpoint(checkpoint_path):
                trainer.load_checkpoint(checkpoint_path, weights_only=True)
        else:
            trainer.load_checkpoint(
                checkpoint_path, weights_only=True, name_map=hf_name_map(p.model.name)
            )
        steps = rc.eval_steps
        loader = self._eval_loader(p.eval_input, steps)
        # model_dir is written once the evaluation ran: a batch the model cannot take
        # leaves no empty events file and keeps the last params_eval.yaml.
        results = trainer.evaluate(loader, steps)
        self._write_params("eval")
        if record:
            writer = self._eval_writer()
            try:
                writer.add(trainer.global_step, results)
            finally:
                writer.close()
        return trainer.global_step, results


def _convert_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Floating-point parameters to ``dtype`` (on meta too: shapes only)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def _zeros(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros(p.shape, dtype=p.dtype)


def _recorded_params(p: Params) -> dict:
    """The params a checkpoint records: ``model.hf_config`` made absolute, so that
    ``checkpoint convert --to hf`` finds it from any directory."""
    values = p.to_dict()
    model = values.get("model")
    if isinstance(model, dict) and model.get("hf_config"):
        model["hf_config"] = os.path.abspath(model["hf_config"])
    return values


class _Autocast:
    """The compiled module called under the run's autocast (mixed precision)."""

    def __init__(self, compiled, autocast):
        self.compiled = compiled
        self.autocast = autocast

    def __call__(self, *args, **kwargs):
        with self.autocast():
            return self.compiled(*args, **kwargs)

    def eval(self):
        self.compiled.eval()

    def train(self):
        self.compiled.train()

    def no_sync(self):
        return self.compiled.no_sync()


class Stopped(BaseException):
    """SIGTERM asked the run to stop: raised where the main thread is, so that what it
    was doing ends as on Ctrl-C (a save in progress removes its temporary file)."""


@contextlib.contextmanager
def _stopped_by_sigterm():
    # Signal handlers belong to the main thread. Under data parallel the default stays:
    # torchrun stops the other ranks with SIGTERM when one fails, and a rank blocked in
    # a collective with the failed one would see the exception only when it times out.
    single = int(os.environ.get("WORLD_SIZE", "1")) == 1
    if not single or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Stopped()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``weightstream run``; returns the exit code."""
    _setup_logging()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_run_parser().parse_args(argv)
    try:
        params = params_from_args(args)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as exc:
        # ImportError: a library of the hf extra missing or too old (common/hf_config.py).
        message = str(exc)
        if str(args.params) not in message:
            message = f"params file {str(args.params)!r}: {message}"
        log.error("%s", message)
        return 2
    if params.runconfig.num_csx > 1 and "WORLD_SIZE" not in os.environ:
        from weightstream.cli.launch import launch

        return launch(["-m", "weightstream", "run", *argv], params.runconfig.num_csx)
    model_dir = Path(params.runconfig.model_dir)
    created = not model_dir.exists()
    if model_dir.exists() and not model_dir.is_dir():
        log.error(
            "the model directory %s (-o) is a file, not a directory. Fix: -o a directory "
            "(a new name is made), or move the file away.",
            model_dir,
        )
        return 2
    try:
        os.makedirs(model_dir, exist_ok=True)
    except OSError as exc:
        log.error(
            "cannot create the model directory %s (-o): %s. Fix: -o a writable place.",
            model_dir,
            exc,
        )
        return 2
    try:
        with _stopped_by_sigterm():
            return Run(params, args.mode, args.target).execute()
    except (KeyboardInterrupt, Stopped) as exc:
        if os.environ.get("RANK", "0") == "0":  # one line for the run, not one a rank
            cause = "interrupted (Ctrl-C)" if isinstance(exc, KeyboardInterrupt) else "SIGTERM"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a damaged file is named by the rerun
                latest = ckpt.find_latest_checkpoint(model_dir)
            where = (
                f"its newest complete checkpoint is {latest}, from which the same command resumes"
                if latest is not None
                else f"{model_dir} holds no complete checkpoint yet"
            )
            log.error("the run stopped: %s. Nothing is left half-written; %s.", cause, where)
        return 130 if isinstance(exc, KeyboardInterrupt) else 128 + signal.SIGTERM
    except (ValueError, TypeError, OSError, FloatingPointError, ImportError) as exc:
        message = str(exc)
        if (
            isinstance(exc, OSError)
            and not isinstance(exc, (FileNotFoundError, ckpt.CheckpointWriteError))
            and "writable" not in message
        ):
            # A write failed (full disk, file size limit, read-only model_dir or
            # store_dir) or a file could not be read; the other two errors say what to
            # do themselves.
            places = [str(model_dir)]
            streaming = params.runconfig.streaming
            if streaming.store == "disk":
                places.append(f"store_dir {streaming.store_dir or model_dir / 'store'}")
            message += (
                f" (Check that {' and '.join(places)} are writable and their disks have "
                "free space, and that the input files are readable.)"
            )
        # Every rank may meet the same bad input: said once (Note [one line per error]).
        report_error(message)
        if created:
            # Bad input found before anything was written: leave no empty model_dir behind.
            with contextlib.suppress(OSError):
                model_dir.rmdir()
        return 2
