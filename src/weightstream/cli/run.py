"""``weightstream run``: a params file in, a model directory out.

model_dir after a training run:
    checkpoint_{step}.mdl        trainer checkpoints (every checkpoint_steps and at the end)
    train/                       TensorBoard events of training, params_train.yaml
    eval/                        TensorBoard events of evaluation, params_eval.yaml
    ws_<checksum>/               the compile directory: plan.json, compile_report.txt
    performance/performance.json compile_time, est_samples_per_sec, ... (seed 000)
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

import weightstream as cstorch
from weightstream import checkpoint as ckpt
from weightstream.cli.params import Params, save_params
from weightstream.cli.run_args import build_run_parser, params_from_args
from weightstream.config import run_configuration
from weightstream.runtime.performance import PerformanceTracker
from weightstream.runtime.trainer import Trainer, TrainerSettings, batch_size_of

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
        self.device = torch.device("cuda" if target.upper() == "GPU" else "cpu")
        self.model_dir = Path(self.rc.model_dir)
        self.perf = PerformanceTracker()
        self.task = params.model.spec.task
        self.ws = self.rc.execution_mode == "weight_streaming"

    # ---- building ---------------------------------------------------------------------

    def _write_params(self, sub: str) -> None:
        directory = self.model_dir / sub
        directory.mkdir(parents=True, exist_ok=True)
        save_params(self.params, directory / f"params_{sub}.yaml")

    def _compute_dtype(self):
        m = self.params.model
        return m.fp16_type if m.mixed_precision else None

    def _autocast(self):
        dt = self._compute_dtype()
        if dt in ("float16", "bfloat16"):
            return torch.autocast(self.device.type, dtype=getattr(torch, dt))
        return contextlib.nullcontext()

    def _build_model(self):
        model = self.params.model.build()
        kwargs = {"device": self.device}
        if self.ws:
            kwargs.update(
                prefetch_depth=self.rc.prefetch_depth,
                unit_size_target=self.rc.unit_size_target,
                compute_dtype=self._compute_dtype(),
            )
        compiled = cstorch.compile(model, backend="wse_ws" if self.ws else "wse_lp", **kwargs)
        return model, compiled

    def _input_fn(self, section, is_training: bool):
        from weightstream.data.processors import get_data_processor

        processor = get_data_processor(section.data_processor)
        values = section.to_dict()
        return lambda: processor(values, is_training)

    def _dataloader(self, section, is_training: bool, **steps):
        return cstorch.utils.data.DataLoader(self._input_fn(section, is_training), **steps)

    def _model_inputs(self, batch: dict):
        return (batch["input_ids"],) if self.task == "lm" else (batch["inputs"],)

    # ---- compile ----------------------------------------------------------------------

    def compile(self, compiled, section) -> None:
        """Trace with the real batch shape, build the plan and the report (seeds 001/002)."""
        t0 = time.perf_counter()
        example = next(iter(self._input_fn(section, True)()))
        args = self._model_inputs(example)
        if self.ws:
            with self._autocast():
                plan = compiled.engine.prepare(*args)
            log.info("Streaming plan: %d units\n%s", len(plan.units), plan.describe())
        try:
            from weightstream.compiler import compile_phase
        except ImportError:
            compile_phase = None
        if compile_phase is not None:
            result = compile_phase.run(self, compiled, args, batch_size_of(example))
            self.perf.est_samples_per_sec = result.get("est_samples_per_sec")
        self.perf.compile_time = time.perf_counter() - t0
        log.info("Compile finished in %.2f s", self.perf.compile_time)

    # ---- modes ------------------------------------------------------------------------

    def execute(self) -> int:
        self.model_dir.mkdir(parents=True, exist_ok=True)
        with run_configuration(
            model_dir=str(self.model_dir),
            compile_dir=self.rc.compile_dir,
            compile_only=self.rc.compile_only,
            validate_only=self.rc.validate_only,
            checkpoint_steps=self.rc.checkpoint_steps,
            num_csx=self.rc.num_csx,
            max_wgt_servers=self.rc.num_wgt_servers,
            num_workers_per_csx=self.rc.num_workers_per_csx,
        ):
            return self._execute()

    def _execute(self) -> int:
        _seed_everything(self.rc.seed)
        if self.mode in ("train", "train_and_eval"):
            self.train()
            if self.mode == "train_and_eval" and not (
                self.rc.compile_only or self.rc.validate_only
            ):
                self.evaluate(self._latest_or_given())
        elif self.mode == "eval":
            self.evaluate(self._latest_or_given())
        elif self.mode == "eval_all":
            checkpoints = ckpt.list_checkpoints(self.model_dir)
            if not checkpoints:
                raise ValueError(
                    f"eval_all found no checkpoint_*.mdl in {self.model_dir}; train first or "
                    "pass -o with a model directory that has checkpoints."
                )
            for _, path in checkpoints:
                self.evaluate(path)
        return 0

    def _latest_or_given(self) -> Path:
        if self.rc.checkpoint_path:
            return Path(self.rc.checkpoint_path)
        latest = ckpt.find_latest_checkpoint(self.model_dir)
        if latest is None:
            raise ValueError(
                f"no checkpoint to evaluate: {self.model_dir} has no complete checkpoint_*.mdl. "
                "Train first, or pass --checkpoint_path."
            )
        return latest

    def train(self) -> None:
        self._write_params("train")
        p, rc = self.params, self.rc
        model, compiled = self._build_model()
        self.compile(compiled, p.train_input)
        if rc.validate_only or rc.compile_only:
            self.perf.write(self.model_dir)
            log.info(
                "%s: done without training.",
                "validate_only" if rc.validate_only else "compile_only",
            )
            return
        t_program = time.perf_counter()
        opt_params = p.optimizer
        groups = model.parameters()
        if opt_params.weight_decay:
            groups = cstorch.optim.param_groups_with_weight_decay(model, opt_params.weight_decay)
        kwargs = opt_params.optimizer_kwargs()
        learning_rate = kwargs.get("learning_rate")
        optimizer = cstorch.optim.configure_optimizer(
            opt_params.optimizer_type, params=groups, **kwargs
        )
        lr_scheduler = None
        if learning_rate is not None:
            lr_scheduler = cstorch.optim.configure_lr_scheduler(
                optimizer, learning_rate, adjust_learning_rate=opt_params.adjust_learning_rate
            )
        scaler = cstorch.amp.GradScaler(**opt_params.grad_scaler_kwargs())
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(self.model_dir / "train"))
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
            metadata={"version": cstorch.__version__, "model": p.model.name, "params": p.to_dict()},
        )
        trainer = Trainer(
            settings,
            model,
            _Autocast(compiled, self._autocast),
            optimizer,
            lr_scheduler,
            scaler,
            writer=writer,
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
        resume = Path(rc.checkpoint_path) if rc.checkpoint_path else None
        if resume is None and rc.autoload_last_checkpoint:
            resume = ckpt.find_latest_checkpoint(self.model_dir)
        if resume is not None:
            trainer.load_checkpoint(resume, dataloader)
        self.perf.programming_time = time.perf_counter() - t_program
        steps = dataloader.num_steps
        log.info("Training %d steps from global step %d", steps, trainer.global_step)
        try:
            trainer.train(dataloader, steps)
        finally:
            writer.close()
            self.perf.write(self.model_dir)
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

    def evaluate(self, checkpoint_path: Path) -> dict:
        self._write_params("eval")
        p, rc = self.params, self.rc
        if p.eval_input is None:
            raise ValueError("evaluation needs an eval_input section in the params file.")
        model, compiled = self._build_model()
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(self.model_dir / "eval"))
        trainer = Trainer(
            TrainerSettings(task=self.task, model_dir=self.model_dir),
            model,
            _Autocast(compiled, self._autocast),
            eval_writer=writer,
        )
        state = ckpt.load(checkpoint_path, map_location="cpu")
        model.load_state_dict(state["model"])
        trainer.global_step = int(state.get("global_step", 0))
        steps = rc.eval_steps
        loader = self._dataloader(p.eval_input, False, num_steps=steps) if steps else None
        if loader is None:
            loader = self._input_fn(p.eval_input, False)()
        try:
            return trainer.evaluate(loader, steps)
        finally:
            writer.close()


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


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``weightstream run``; returns the exit code."""
    _setup_logging()
    args = build_run_parser().parse_args(argv)
    try:
        params = params_from_args(args)
        os.makedirs(params.runconfig.model_dir, exist_ok=True)
        return Run(params, args.mode, args.target).execute()
    except (ValueError, TypeError, FileNotFoundError, FloatingPointError) as exc:
        log.error("%s", exc)
        return 2
