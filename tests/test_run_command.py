"""The run command end to end: params file in, model_dir out."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import params_files as pf
import pytest
import torch
import yaml
from trees import assert_same_tree

import weightstream as cstorch
from weightstream import checkpoint as ckpt
from weightstream.cli.main import main

pytest.importorskip("tensorboard")


def _params(tmp_path: Path, optimizer: dict | None = None, **runconfig) -> Path:
    section = pf.text_input(4, 32)
    return pf.write(
        tmp_path / "params.yaml",
        pf.params(
            train_input={**section, "shuffle_seed": 3},
            eval_input=section,
            model=pf.gpt2(2, 32, 32),
            optimizer=optimizer
            or pf.adamw(pf.warmup_cosine(3e-3, 4, 100), weight_decay=0.01, max_gradient_norm=1.0),
            runconfig={
                "max_steps": 8,
                "checkpoint_steps": 4,
                "log_steps": 2,
                "seed": 7,
                "unit_size_target": 20_000,
                **runconfig,
            },
        ),
    )


def _scalars(event_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(event_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.fixture(autouse=True)
def _quiet_logs():
    import logging

    logging.getLogger("weightstream").handlers.clear()
    yield


def test_train_writes_every_artifact(tmp_path):
    model_dir = tmp_path / "model_dir"
    rc = main(["run", "CPU", "-p", str(_params(tmp_path)), "-m", "train", "-o", str(model_dir)])
    assert rc == 0
    # checkpoints every 4 steps and at the end
    assert [s for s, _ in ckpt.list_checkpoints(model_dir)] == [4, 8]
    state = ckpt.load(model_dir / "checkpoint_8.mdl", map_location="cpu")
    assert state["global_step"] == 8
    assert {"model", "optimizer", "schedulers", "grad_scaler", "dataloader", "rng"} <= set(state)
    # performance.json fields and types (seed 000)
    perf = json.loads((model_dir / "performance" / "performance.json").read_text())
    assert set(perf) == {
        "compile_time",
        "est_samples_per_sec",
        "programming_time",
        "samples_per_sec",
        "suspected_input_bottleneck",
        "total_samples",
        "total_time",
    }
    assert perf["total_samples"] == 8 * 4
    assert isinstance(perf["suspected_input_bottleneck"], bool)
    assert perf["samples_per_sec"] > 0 and perf["total_time"] > 0 and perf["compile_time"] > 0
    # TensorBoard scalars, read back with tensorboard's own reader
    losses = _scalars(model_dir / "train", "loss")
    assert [s for s, _ in losses] == list(range(1, 9))
    # Each step's lr is the one its update used: warmup from 0 over 4 steps, then the
    # cosine from the peak (the schedule of _params, in closed form).
    used = [3e-3 * k / 4 for k in range(4)]
    used += [1e-4 + (3e-3 - 1e-4) * (1 + math.cos(math.pi * k / 100)) / 2 for k in range(4)]
    logged = _scalars(model_dir / "train", "lr")
    assert [s for s, _ in logged] == list(range(1, 9))
    assert [v for _, v in logged] == pytest.approx(used, rel=1e-6, abs=1e-12)
    assert len(_scalars(model_dir / "train", "samples_per_sec")) == 8
    # one event per step holds them all (Note [one event per step])
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    (events,) = (model_dir / "train").glob("events.out.tfevents.*")
    tags = [
        (e.step, sorted(v.tag for v in e.summary.value))
        for e in EventFileLoader(str(events)).Load()
        if e.HasField("summary")
    ]
    assert tags == [(s, ["loss", "loss_scale", "lr", "samples_per_sec"]) for s in range(1, 9)]
    # the run's params
    saved = yaml.safe_load((model_dir / "train" / "params_train.yaml").read_text())
    assert saved["runconfig"]["max_steps"] == 8 and saved["model"]["name"] == "gpt2"


def test_resume_continues_exactly(tmp_path):
    """Train 8 steps at once, or 4, stop, and resume for 4 more: same weights and losses."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    params = _params(tmp_path)
    assert main(["run", "CPU", "-p", str(params), "-o", str(whole)]) == 0
    assert main(["run", "CPU", "-p", str(params), "-o", str(split), "--max_steps", "4"]) == 0
    assert main(["run", "CPU", "-p", str(params), "-o", str(split)]) == 0  # autoload resumes
    a = ckpt.load(whole / "checkpoint_8.mdl", map_location="cpu")
    b = ckpt.load(split / "checkpoint_8.mdl", map_location="cpu")
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    la = [v for _, v in _scalars(whole / "train", "loss")]
    lb = [v for _, v in _scalars(split / "train", "loss")]
    assert la == lb


def test_disk_store_run_and_resume_equal_the_ram_store_run(tmp_path):
    """runconfig store: disk (Note [disk tier]): 4 steps, stop, resume for 4 more
    from the checkpoint written out of the disk store; bitwise the RAM run."""
    ram, disk = tmp_path / "ram", tmp_path / "disk"
    params = _params(tmp_path)
    (tmp_path / "d").mkdir()
    disk_params = _params(tmp_path / "d", store="disk", overlap_updates=True)
    assert main(["run", "CPU", "-p", str(params), "-o", str(ram)]) == 0
    assert main(["run", "CPU", "-p", str(disk_params), "-o", str(disk), "--max_steps", "4"]) == 0
    assert main(["run", "CPU", "-p", str(disk_params), "-o", str(disk)]) == 0
    a = ckpt.load(ram / "checkpoint_8.mdl", map_location="cpu")
    b = ckpt.load(disk / "checkpoint_8.mdl", map_location="cpu")
    assert_same_tree(a["model"], b["model"], "model")
    assert_same_tree(a["optimizer"], b["optimizer"], "optimizer")
    la = [v for _, v in _scalars(ram / "train", "loss")]
    lb = [v for _, v in _scalars(disk / "train", "loss")]
    assert la == lb
    assert not (disk / "store").exists()  # made by the store, empty, removed with it


def test_compile_prices_the_disk_stores_file_traffic(tmp_path):
    """A disk store whose files hold part of the state: the compile estimate prices
    the bytes its placement moves a step (Note [the roofline] in compiler/estimate.py); with
    the whole state in RAM there are none. Either way a disk store's process maps every
    allocation of 128 KiB or more afresh (Note [fresh pages] in compiler/cost.py): the
    logits of this batch (4 x 32 x 256 floats) are fresh pages there, not in a RAM store's."""
    priced, fresh = {}, {}
    for name, store in (("tight", "disk"), ("roomy", "disk"), ("ram", "ram")):
        (tmp_path / name).mkdir()
        budget = {"tight": 400_000, "roomy": 2**30}.get(name)
        keys = {"host_memory_budget": budget} if budget else {}
        params = _params(tmp_path / name, store=store, compile_only=True, **keys)
        out = tmp_path / name / "out"
        assert main(["run", "CPU", "-p", str(params), "-o", str(out)]) == 0
        (compile_dir,) = out.glob("ws_*")
        plan = json.loads((compile_dir / "plan.json").read_text())
        est, report = plan["estimate"], (compile_dir / "compile_report.txt").read_text()
        priced[name] = (est["disk_bytes"], est["disk_s"], ", disk " in report)
        fresh[name] = sum(u["fresh_bytes"] for u in [*plan["units"], plan["outside_units"]])
    disk_bytes, disk_s, shown = priced["tight"]
    assert disk_bytes > 0 and disk_s > 0 and shown
    assert priced["roomy"] == priced["ram"] == (0, 0.0, False)
    assert fresh["ram"] == 0 and fresh["roomy"] >= 4 * 32 * 256 * 4


def test_bad_params_file_is_reported_without_training(tmp_path, capsys):
    path = _params(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["runconfig"]["max_stepz"] = 3
    path.write_text(yaml.safe_dump(raw))
    model_dir = tmp_path / "out"
    assert main(["run", "CPU", "-p", str(path), "-o", str(model_dir)]) == 2
    assert not list(model_dir.glob("checkpoint_*"))


def _compile_dirs(root: Path) -> list[Path]:
    return sorted(root.glob("ws_*"))


def test_validate_only_and_compile_only_do_not_train(tmp_path):
    params = _params(tmp_path)
    v_dir, c_dir = tmp_path / "v", tmp_path / "c"
    assert main(["run", "CPU", "-p", str(params), "-o", str(v_dir), "--validate_only"]) == 0
    assert not list(v_dir.glob("checkpoint_*")) and not _compile_dirs(v_dir)
    assert main(["run", "CPU", "-p", str(params), "-o", str(c_dir), "--compile_only"]) == 0
    assert not list(c_dir.glob("checkpoint_*"))
    (compiled,) = _compile_dirs(c_dir)
    report = (compiled / "compile_report.txt").read_text()
    plan = json.loads((compiled / "plan.json").read_text())
    assert plan["est_samples_per_sec"] > 0
    for unit in plan["units"]:
        assert unit["name"] in report
    perf = json.loads((c_dir / "performance" / "performance.json").read_text())
    assert perf["est_samples_per_sec"] == plan["est_samples_per_sec"]
    assert perf["total_samples"] == 0


def test_compile_cache_hit_and_checksum_follows_the_batch_size(tmp_path):
    params = _params(tmp_path)
    cache = tmp_path / "cache"
    args = ["run", "CPU", "-p", str(params), "--compile_only", "--compile_dir", str(cache)]
    assert main([*args, "-o", str(tmp_path / "a")]) == 0
    (compiled,) = _compile_dirs(cache)
    written = (compiled / "plan.json").stat().st_mtime_ns
    assert main([*args, "-o", str(tmp_path / "b")]) == 0
    # The second compile reused the first: same directory, plan not rewritten,
    # and the same estimate reported.
    assert _compile_dirs(cache) == [compiled]
    assert (compiled / "plan.json").stat().st_mtime_ns == written
    first, second = (
        json.loads((tmp_path / d / "performance" / "performance.json").read_text())
        for d in ("a", "b")
    )
    assert second["est_samples_per_sec"] == first["est_samples_per_sec"]
    raw = yaml.safe_load(params.read_text())
    raw["train_input"]["batch_size"] = 8
    params.write_text(yaml.safe_dump(raw))
    assert main([*args, "-o", str(tmp_path / "c")]) == 0
    assert len(_compile_dirs(cache)) == 2  # a new batch size is a new checksum


# Layer pipelined with the slow tests (the default suite's 15 minutes).
@pytest.mark.parametrize(
    "execution_mode", ["weight_streaming", pytest.param("layer_pipelined", marks=pytest.mark.slow)]
)
def test_train_and_eval_then_eval_all(tmp_path, execution_mode):
    params = _params(tmp_path, eval_steps=3)
    model_dir = tmp_path / "m"
    base = ["run", "CPU", "-p", str(params), "-o", str(model_dir)]
    assert main([*base, "-m", "train_and_eval", "--execution_mode", execution_mode]) == 0
    assert (model_dir / "eval" / "params_eval.yaml").exists()
    assert [s for s, _ in _scalars(model_dir / "eval", "loss")] == [8]
    first = _scalars(model_dir / "eval", "loss")
    assert main([*base, "-m", "eval_all", "--execution_mode", execution_mode]) == 0
    # Every checkpoint evaluated again: one event a step, in step order (TensorBoard
    # hides train_and_eval's event at 8, which eval_all logged again, with the same value).
    again = _scalars(model_dir / "eval", "loss")
    assert [s for s, _ in again] == [4, 8] and again[1] == first[0]
    assert [s for s, _ in _scalars(model_dir / "eval", "perplexity")] == [4, 8]


@pytest.fixture
def run_log(caplog):
    """The run command's log (its logger does not propagate to the root's handlers)."""
    logger = logging.getLogger("weightstream")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.mark.slow  # 12 s on 2 cores (one batch of all the eval data); with the slow tests
def test_train_and_eval_checks_the_eval_data_before_training(tmp_path, run_log):
    """An eval set smaller than one batch stops train_and_eval before step 1 (nothing
    written), not after training; the same data trains and evaluates with drop_last off."""
    raw = yaml.safe_load(_params(tmp_path, max_steps=2, checkpoint_steps=0).read_text())
    raw["eval_input"]["batch_size"] = 10**6
    params = pf.write(tmp_path / "big_eval_batch.yaml", raw)
    model_dir = tmp_path / "m"
    argv = ["run", "CPU", "-p", str(params), "-m", "train_and_eval", "-o", str(model_dir)]
    assert main(argv) != 0
    out = run_log.text
    assert "fewer than one global batch" in out and "global_step" not in out  # no step ran
    assert not list(model_dir.glob("checkpoint_*.mdl")) and not (model_dir / "train").exists()
    raw["eval_input"]["drop_last"] = False  # one batch of all the eval data
    argv[3] = str(pf.write(params, raw))
    assert main(argv) == 0
    with pytest.warns(UserWarning, match="eval input has 1 batches, so the evaluation reads"):
        assert main([*argv[:5], "eval", *argv[6:], "--eval_steps", "2"]) == 0


def test_eval_sequences_the_model_does_not_take_stop_before_anything_is_written(tmp_path, run_log):
    """eval_input.seq_len past the model's: train_and_eval stops before step 1, naming
    eval_input (it used to train every step, save, then fail); -m eval leaves model_dir
    as it was (it used to leave an empty events file and its params_eval.yaml)."""
    raw = yaml.safe_load(_params(tmp_path, max_steps=2, checkpoint_steps=2).read_text())
    good = tmp_path / "good.yaml"
    pf.write(good, raw)
    raw["eval_input"]["seq_len"] = 2 * raw["model"]["seq_len"]
    params = pf.write(tmp_path / "long_eval.yaml", raw)
    model_dir = tmp_path / "m"
    argv = ["run", "CPU", "-p", str(params), "-m", "train_and_eval", "-o", str(model_dir)]
    assert main(argv) == 2
    out = run_log.text
    assert "eval_input: the model does not take its batches of" in out
    assert "global_step" not in out  # no step ran
    assert not list(model_dir.glob("checkpoint_*.mdl")) and not (model_dir / "train").exists()
    assert main(["run", "CPU", "-p", str(good), "-m", "train", "-o", str(model_dir)]) == 0
    before = sorted(p.relative_to(model_dir) for p in model_dir.rglob("*"))
    assert main(["run", "CPU", "-p", str(params), "-m", "eval", "-o", str(model_dir)]) == 2
    assert sorted(p.relative_to(model_dir) for p in model_dir.rglob("*")) == before


def test_sequences_longer_than_the_models_positions_are_named_as_such():
    """GPT-2's learned positions end at n_positions: the embedding's IndexError is told as
    the sequence length it is, beside the vocabulary."""
    transformers = pytest.importorskip("transformers")
    from weightstream.train.trainer import _task_loss

    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.zeros(2, 32, dtype=torch.long)
    with pytest.raises(ValueError, match=r"learned position embeddings .*are 32 long"):
        _task_loss("lm", model, {"input_ids": ids, "labels": ids})


@pytest.mark.parametrize("mode", ["--validate_only", None])
def test_a_seq_len_past_the_models_position_table_is_refused_before_step_1(tmp_path, run_log, mode):
    """validate_only said passed (the meta trace reads no table) and the first step
    stopped; now both stop before anything runs, naming the table and the fix."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "gpt2"
    transformers.GPT2Config(
        vocab_size=256, n_positions=16, n_embd=16, n_layer=1, n_head=2
    ).save_pretrained(folder)
    params = pf.write(
        tmp_path / "params.yaml",
        pf.params(
            train_input=pf.text_input(4, 32),
            model={"name": "hf", "hf_config": str(folder)},
            optimizer=pf.adamw(1e-3),
            runconfig={"max_steps": 2},
        ),
    )
    out = tmp_path / "m"
    argv = ["run", "CPU", "-p", str(params), "-o", str(out)] + ([mode] if mode else [])
    assert main(argv) == 2
    assert (
        "train_input.seq_len 32 is longer than the model's 16 positions (its position table "
        in (run_log.text)
    )
    assert "transformer.wpe" in run_log.text and not out.exists()


def test_progress_bar_line():
    import io

    from weightstream.train.trainer import ProgressBar

    out = io.StringIO()
    bar = ProgressBar(0, 10, stream=out)
    bar.update(5, 2.5)
    bar.close()
    text = out.getvalue()
    # tqdm's line: steps done of the total, the loss, the rate; a newline at the end.
    assert "5/10" in text and "loss=2.5000" in text and "step/s" in text
    assert text.endswith("\n")


def test_run_leaves_no_engine_threads_behind(tmp_path):
    """The run closes its engines: a process that runs the command again (a notebook,
    a benchmark) keeps no prefetch thread and no store per finished run."""
    import threading

    def prefetch_threads():
        return [t for t in threading.enumerate() if t.name.startswith("weightstream-")]

    before = len(prefetch_threads())
    params = _params(tmp_path, max_steps=2, checkpoint_steps=0)
    argv = ["run", "CPU", "-p", str(params), "-m", "train_and_eval", "-o", str(tmp_path / "m")]
    assert main([*argv, "--eval_steps", "1"]) == 0
    assert len(prefetch_threads()) == before, prefetch_threads()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_run_gpu_without_cuda_names_the_command_to_run(tmp_path, run_log):
    params = _params(tmp_path, max_steps=1)
    assert main(["run", "GPU", "-p", str(params), "-o", str(tmp_path / "m")]) != 0
    assert "Fix: weightstream run CPU" in run_log.text
    assert not (tmp_path / "m").exists()


def test_a_damaged_newest_checkpoint_is_named_as_damaged_not_as_another_runs(tmp_path, run_log):
    """A flipped byte in the newest checkpoint: the resume names the checksum and the
    earlier checkpoint to resume from, not a params file that does not fit."""
    import h5py

    model_dir = tmp_path / "m"
    argv = ["run", "CPU", "-m", "train", "-o", str(model_dir)]
    params = _params(tmp_path, max_steps=4, checkpoint_steps=2)
    assert main([*argv, "-p", str(params)]) == 0
    newest = model_dir / "checkpoint_4.mdl"
    with h5py.File(newest, "r") as f:  # h5py's own offset of one tensor's bytes
        offset = f["model.blocks.0.mlp.fc.weight"].id.get_offset()
    with open(newest, "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)[0]
        f.seek(offset + 100)
        f.write(bytes([byte ^ 0x10]))
    assert main([*argv, "-p", str(_params(tmp_path, max_steps=6, checkpoint_steps=2))]) != 0
    assert "does not match its checksum" in run_log.text
    assert "--checkpoint_path " + str(model_dir / "checkpoint_2.mdl") in run_log.text
    assert "another params file" not in run_log.text


def test_eval_all_skips_an_incomplete_checkpoint_as_a_resume_does(tmp_path, run_log):
    params = _params(tmp_path, eval_steps=1)
    model_dir = tmp_path / "m"
    base = ["run", "CPU", "-p", str(params), "-o", str(model_dir)]
    assert main([*base, "-m", "train"]) == 0
    newest = model_dir / "checkpoint_8.mdl"
    with open(newest, "r+b") as f:  # cut short, as a crash in a copy leaves it
        f.truncate(newest.stat().st_size // 2)
    assert main([*base, "-m", "eval_all"]) == 0
    assert [s for s, _ in _scalars(model_dir / "eval", "loss")] == [4]
    assert f"eval_all: skipping {newest}: it is incomplete" in run_log.text


def test_a_run_from_checkpoint_path_evaluates_what_it_trained_and_keeps_newer_checkpoints(
    tmp_path, run_log
):
    """train_and_eval resuming from checkpoint_path (step 4 of another run) evaluates its
    own newest checkpoint, as -m eval of its model_dir does; the same command again would
    replace that run's checkpoints after step 4, so it stops and changes nothing."""
    params = _params(tmp_path, eval_steps=1)
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(["run", "CPU", "-p", str(params), "-o", str(first), "--max_steps", "4"]) == 0
    start = first / "checkpoint_4.mdl"
    argv = ["run", "CPU", "-p", str(params), "-o", str(second), "--checkpoint_path", str(start)]
    assert main([*argv, "-m", "train_and_eval"]) == 0
    assert [s for s, _ in _scalars(second / "eval", "loss")] == [8]
    assert main(["run", "CPU", "-p", str(params), "-o", str(second), "-m", "eval"]) == 0
    losses = [v for _, v in _scalars(second / "eval", "loss")]
    assert len(losses) == 2 and losses[0] == losses[1]
    before = {p.name: p.read_bytes() for p in second.glob("checkpoint_*.mdl")}
    assert sorted(before) == ["checkpoint_8.mdl"]
    run_log.clear()
    assert main([*argv, "-m", "train"]) != 0
    text = run_log.text
    assert "holds checkpoints after global step 4" in text and "(checkpoint_8.mdl)" in text
    assert "leave checkpoint_path out" in text and "global_step =" not in text
    assert {p.name: p.read_bytes() for p in second.glob("checkpoint_*.mdl")} == before


def test_a_model_dir_whose_only_checkpoint_is_damaged_is_not_trained_over(tmp_path, run_log):
    """No complete checkpoint to resume from: a run from step 0 would replace the damaged
    one (the evidence), so it stops and changes nothing; moved away, training starts."""
    params = _params(tmp_path, max_steps=4, checkpoint_steps=4)
    model_dir = tmp_path / "m"
    argv = ["run", "CPU", "-p", str(params), "-o", str(model_dir)]
    assert main(argv) == 0
    damaged = model_dir / "checkpoint_4.mdl"
    with open(damaged, "r+b") as f:
        f.truncate(damaged.stat().st_size // 2)
    before = damaged.read_bytes()
    run_log.clear()
    with pytest.warns(UserWarning, match="no complete one is left"):
        assert main(argv) != 0
    assert "none is complete and readable" in run_log.text and "global_step =" not in run_log.text
    assert damaged.read_bytes() == before
    damaged.rename(tmp_path / "kept.mdl")
    assert main(argv) == 0 and (model_dir / "checkpoint_4.mdl").exists()


def test_a_checkpoint_of_another_model_is_refused_naming_the_settings_that_differ(
    tmp_path, run_log
):
    """Resuming (or evaluating) a checkpoint of a GPT-2 of width 32 with a params file of
    width 64 says which model settings differ, not only torch's list of every tensor."""
    model_dir = tmp_path / "m"
    assert (
        main(["run", "CPU", "-p", str(_params(tmp_path, max_steps=4)), "-o", str(model_dir)]) == 0
    )
    raw = yaml.safe_load(_params(tmp_path, max_steps=8).read_text())
    raw["model"]["d_model"] = 64
    wider = pf.write(tmp_path / "wider.yaml", raw)
    for mode in ("train", "eval"):
        run_log.clear()
        assert main(["run", "CPU", "-p", str(wider), "-m", mode, "-o", str(model_dir)]) == 2
        (error,) = {r.getMessage() for r in run_log.records if r.levelname == "ERROR"}
        assert "other model settings (model.d_model: 32 in the checkpoint, 64 here)" in error
        assert "size mismatch" in error and "more lines" in error and error.count("\n") == 0


def test_a_run_that_does_not_resume_refuses_an_earlier_runs_checkpoints(tmp_path, run_log):
    """autoload_last_checkpoint: false in a model_dir with checkpoints: the run would
    replace some of them (and keep the others), so it stops first and changes nothing."""
    model_dir = tmp_path / "m"
    argv = ["run", "CPU", "-m", "train", "-o", str(model_dir)]
    assert main([*argv, "-p", str(_params(tmp_path, max_steps=6, checkpoint_steps=4))]) == 0
    before = {p.name: p.read_bytes() for p in model_dir.glob("checkpoint_*.mdl")}
    assert sorted(before) == ["checkpoint_4.mdl", "checkpoint_6.mdl"]
    again = _params(tmp_path, max_steps=4, checkpoint_steps=0, autoload_last_checkpoint=False)
    assert main([*argv, "-p", str(again)]) != 0
    assert "holds checkpoints of an earlier run (checkpoint_4.mdl, checkpoint_6.mdl)" in (
        run_log.text
    )
    assert {p.name: p.read_bytes() for p in model_dir.glob("checkpoint_*.mdl")} == before


def test_a_failed_write_names_the_store_dir_too(tmp_path, run_log, monkeypatch):
    """A write that fails with the disk store on (a full or read-only disk) may be the
    store's: the hint names store_dir beside model_dir, not model_dir alone."""
    import errno

    from weightstream.cli import run as run_module

    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_module.Run, "execute", full)
    params = _params(tmp_path, store="disk", store_dir=str(tmp_path / "st"))
    assert main(["run", "CPU", "-p", str(params), "-o", str(tmp_path / "m")]) == 2
    assert f"{tmp_path / 'm'} and store_dir {tmp_path / 'st'} are writable" in run_log.text


def test_layer_pipelined_names_the_streaming_settings_it_ignores(tmp_path, run_log):
    """Weight streaming settings in a layer pipelined run change nothing; the run says so
    (the Python API refuses them for 'wse_lp'). Its own (activation_checkpointing, the
    units) are not named."""
    params = _params(
        tmp_path,
        max_steps=1,
        checkpoint_steps=0,
        execution_mode="layer_pipelined",
        store="disk",
        overlap_updates=True,
        activation_checkpointing=True,
    )
    assert main(["run", "CPU", "-p", str(params), "-m", "train", "-o", str(tmp_path / "m")]) == 0
    (line,) = {r.getMessage() for r in run_log.records if "ignored in layer pipelined" in r.message}
    assert line.startswith("runconfig: overlap_updates: True, store: 'disk' apply only to")
    run_log.clear()
    plain = _params(tmp_path, max_steps=1, checkpoint_steps=0, execution_mode="layer_pipelined")
    assert main(["run", "CPU", "-p", str(plain), "-m", "train", "-o", str(tmp_path / "n")]) == 0
    assert "ignored in layer pipelined" not in run_log.text


def test_a_resume_trains_with_the_params_files_learning_rate_and_says_so(tmp_path, run_log):
    """Note [settings on resume]: a constant learning rate changed for the resume is the one
    used (torch's load put the checkpoint's back, while params_train.yaml and the next
    checkpoint said the new one), with a warning; the moments are the checkpoint's."""
    model_dir = tmp_path / "m"
    first = _params(tmp_path, optimizer=pf.adamw(1e-3), max_steps=4)
    assert main(["run", "CPU", "-p", str(first), "-o", str(model_dir)]) == 0
    later = tmp_path / "later"
    later.mkdir()
    second = _params(later, optimizer=pf.adamw(5e-3), max_steps=6)
    run_log.clear()
    assert main(["run", "CPU", "-p", str(second), "-o", str(model_dir)]) == 0
    assert "optimizer settings where they differ from the checkpoint's: lr 0.001 -> 0.005" in (
        run_log.text
    )
    assert [v for s, v in _scalars(model_dir / "train", "lr") if s > 4] == pytest.approx([5e-3] * 2)
    saved = cstorch.load(str(model_dir / "checkpoint_6.mdl"))
    assert [g["lr"] for g in saved["optimizer"]["param_groups"]] == pytest.approx(
        [5e-3] * len(saved["optimizer"]["param_groups"])
    )


def test_a_resume_with_another_schedule_is_refused_and_changes_nothing(tmp_path, run_log):
    model_dir = tmp_path / "m"
    first = _params(tmp_path, max_steps=4)  # warmup then cosine
    assert main(["run", "CPU", "-p", str(first), "-o", str(model_dir)]) == 0
    before = {p.name: p.read_bytes() for p in model_dir.glob("checkpoint_*.mdl")}
    later = tmp_path / "later"
    later.mkdir()
    other = pf.adamw(pf.warmup_cosine(3e-3, 2, 100), weight_decay=0.01, max_gradient_norm=1.0)
    second = _params(later, optimizer=other, max_steps=6)
    run_log.clear()
    assert main(["run", "CPU", "-p", str(second), "-o", str(model_dir)]) == 2
    text = run_log.text
    assert "with another learning-rate schedule" in text and "load_checkpoint_states: model" in text
    assert {p.name: p.read_bytes() for p in model_dir.glob("checkpoint_*.mdl")} == before


def test_validate_only_fails_where_the_models_forward_refuses_the_batch(tmp_path, run_log):
    """A sequence longer than the model's: the meta trace stops at the model's own check,
    as a training run's first step would; validation said "passed" (exit 0)."""
    section = pf.text_input(4, 64)
    params = pf.write(
        tmp_path / "params.yaml",
        pf.params(
            train_input=section,
            model=pf.gpt2(2, 32, 32),  # seq_len 32
            optimizer=pf.adamw(1e-3),
            runconfig={"max_steps": 2},
        ),
    )
    out = tmp_path / "m"
    assert main(["run", "CPU", "-p", str(params), "-o", str(out), "--validate_only"]) == 2
    text = run_log.text
    assert "the model's forward refused the input batch (ValueError: sequence length 64" in text
    assert "Validation passed" not in text and not out.exists()


def test_a_model_dir_that_is_a_file_is_named_as_one(tmp_path, run_log):
    params = _params(tmp_path, max_steps=1)
    afile = tmp_path / "afile"
    afile.write_text("mine")
    assert main(["run", "CPU", "-p", str(params), "-o", str(afile)]) == 2
    assert "(-o) is a file, not a directory" in run_log.text and afile.read_text() == "mine"


def test_the_data_command_describes_its_subcommand(capsys):
    assert main(["data", "--help"]) == 0
    assert "write-gpt-hdf5   write a text corpus" in capsys.readouterr().out
    assert main(["data"]) == 2


@pytest.mark.slow  # 9 s on 2 cores: three runs, with the slow tests
def test_eval_frequency_evaluates_while_training_and_leaves_the_training_as_it_was(tmp_path):
    """Note [evaluation during training]: every 2 steps the training's weights are
    evaluated; each value is what -m eval of that step's checkpoint gives (another
    model, loaded from the file), and the training's losses are those of a run without
    evaluations, dropout and shuffled data included."""
    model = pf.gpt2(2, 32, 32, dropout=0.1)
    plain = _params(tmp_path, eval_steps=2, checkpoint_steps=2, max_steps=6)
    values = yaml.safe_load(plain.read_text())
    values["model"] = model
    plain.write_text(yaml.safe_dump(values))
    values["runconfig"]["eval_frequency"] = 2
    every = tmp_path / "every.yaml"
    every.write_text(yaml.safe_dump(values))
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["run", "CPU", "-p", str(plain), "-o", str(a), "-m", "train_and_eval"]) == 0
    assert main(["run", "CPU", "-p", str(every), "-o", str(b), "-m", "train_and_eval"]) == 0
    assert _scalars(a / "train", "loss") == _scalars(b / "train", "loss")
    during = _scalars(b / "eval", "loss")
    assert [s for s, _ in during] == [2, 4, 6]
    for step, value in during[:2]:
        c = tmp_path / f"eval{step}"
        ckpt_file = str(b / f"checkpoint_{step}.mdl")
        argv = ["run", "CPU", "-p", str(plain), "-o", str(c), "-m", "eval"]
        assert main([*argv, "--checkpoint_path", ckpt_file]) == 0
        assert _scalars(c / "eval", "loss") == [(step, value)]
    assert during[2] == _scalars(a / "eval", "loss")[0]
