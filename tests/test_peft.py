"""LoRA from the params file: a ``peft`` section on a warm-started ``model: {name: hf}``.

A small transformers Llama saved with ``save_pretrained`` is the frozen base;
the run command trains peft's LoRA adapters on it with weight streaming. The
losses and final adapters must equal eager peft (``get_peft_model`` on the same
pretrained weights, the same initial adapters, torch.optim.AdamW, the same
batches) bit for bit: the same fp32 kernels and update arithmetic as the full
fine-tune of tests/test_hf_finetune.py. Checkpoints hold the adapters and
their state only (Note [lora checkpoints] in cli/run.py); the exports load
with peft (``--to peft``) and transformers (``--to hf``, merged).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import params_files as pf
import pytest
import torch
import torch.nn.functional as F
from eager_lm import train_eagerly
from local_tokenizer import train_bpe
from test_hf_finetune import _llama, _save_pretrained, _section

from weightstream import checkpoint as ckpt
from weightstream.cli.main import main
from weightstream.context import start_run
from weightstream.data.processors import get_data_processor

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

BATCH, SEQ, STEPS, LR = 4, 16, 10, 5e-3
MODEL_VOCAB, TOKENIZER_VOCAB = 320, 300
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """The base: a Llama as save_pretrained writes it, with its tokenizer."""
    folder = tmp_path_factory.mktemp("pretrained")
    tokenizer = train_bpe(tmp_path_factory.mktemp("tokenizer"), TOKENIZER_VOCAB)
    return _save_pretrained(_llama, folder, tokenizer)


def _values(
    folder: Path, lora: dict | None = None, hf_config: Path | None = None, **runconfig
) -> dict:
    rc = {
        "max_steps": STEPS,
        "checkpoint_steps": 0,
        "log_steps": 1,
        "seed": 1,
        "checkpoint_path": str(folder),
        "load_checkpoint_states": "model",
        "save_initial_checkpoint": True,
        **runconfig,
    }
    values = pf.params(
        train_input=_section(hf_config or folder),
        model={"name": "hf", "hf_config": str(hf_config or folder)},
        optimizer=pf.adamw(LR, weight_decay=0.0),
        runconfig=rc,
    )
    values["peft"] = dict(LORA if lora is None else lora)
    return values


@pytest.fixture(scope="module", autouse=True)
def _machine_profile(tmp_path_factory):
    """conftest's machine profile (the session's cache) for the module-scoped run too,
    which starts before the function-scoped fixtures."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WEIGHTSTREAM_QUICK_MACHINE_PROFILE", "1")
        mp.setenv(
            "WEIGHTSTREAM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "weightstream-cache")
        )
        yield


def _run(tmp_path: Path, values: dict, model_dir: Path, mode: str = "train") -> int:
    params = pf.write(tmp_path / "lora.yaml", values)
    # The run's log handler is made again, on this test's stdout (capsys reads it).
    logging.getLogger("weightstream").handlers.clear()
    try:
        return main(["run", "CPU", "-p", str(params), "-m", mode, "-o", str(model_dir)])
    finally:
        start_run()


def _losses(model_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (model_dir / "train" / "losses.jsonl").open()]


def _adapters(path: Path) -> dict[str, torch.Tensor]:
    return dict(ckpt.load(path, map_location="cpu")["model"])


def _eager_peft(folder: Path, initial: dict[str, torch.Tensor], steps: int = STEPS):
    """peft's own model on the pretrained weights, its adapters set to ``initial``,
    trained with torch.optim.AdamW on the run's batches."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model.config.use_cache = False
    model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **LORA))
    missing = model.load_state_dict(initial, strict=False)
    assert not missing.unexpected_keys
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    loader = get_data_processor("TextCorpusProcessor")(_section(folder), True)
    losses, opt = train_eagerly(model, trainable, loader, steps, LR)
    return losses, model, opt


@pytest.fixture(scope="module")
def lora_run(pretrained, tmp_path_factory) -> Path:
    """One LoRA run of STEPS steps (several tests read it)."""
    tmp_path = tmp_path_factory.mktemp("lora_run")
    model_dir = tmp_path / "run"
    assert _run(tmp_path, _values(pretrained), model_dir) == 0
    return model_dir


def test_lora_run_trains_like_eager_peft(pretrained, lora_run):
    initial = _adapters(lora_run / "checkpoint_0.mdl")
    want_losses, model, _ = _eager_peft(pretrained, initial)
    assert _losses(lora_run) == want_losses
    final = _adapters(lora_run / f"checkpoint_{STEPS}.mdl")
    state = model.state_dict()
    assert set(final) == {n for n, p in model.named_parameters() if p.requires_grad}
    for name, value in final.items():
        assert torch.equal(value, state[name]), name


def _trained_peft(folder: Path, adapters: dict[str, torch.Tensor]):
    """peft's model on the pretrained weights with the run's adapters."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **LORA))
    result = model.load_state_dict(adapters, strict=False)
    assert not result.unexpected_keys
    return model.eval()


def _tokens(seed: int = 5) -> torch.Tensor:
    return torch.randint(0, MODEL_VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def test_export_to_peft_loads_with_peft_and_gives_the_runs_logits(pretrained, lora_run, tmp_path):
    from safetensors import safe_open

    final = _adapters(lora_run / f"checkpoint_{STEPS}.mdl")
    out = tmp_path / "adapter"
    args = ["checkpoint", "convert", str(lora_run / f"checkpoint_{STEPS}.mdl"), str(out)]
    assert main([*args, "--to", "peft", "--config", str(pretrained)]) == 0
    assert (out / "adapter_config.json").is_file()
    # The names and values peft's own save_pretrained writes for the same adapters.
    reference = _trained_peft(pretrained, final)
    reference.save_pretrained(tmp_path / "by_peft")
    files = [safe_open(d / "adapter_model.safetensors", "pt") for d in (out, tmp_path / "by_peft")]
    assert set(files[0].keys()) == set(files[1].keys())
    for key in files[1].keys():
        assert torch.equal(files[0].get_tensor(key), files[1].get_tensor(key)), key
    ours, theirs = (
        json.loads((d / "adapter_config.json").read_text()) for d in (out, tmp_path / "by_peft")
    )
    for key in ("r", "lora_alpha", "target_modules", "task_type", "peft_type", "use_rslora"):
        assert ours[key] == theirs[key], key
    base = transformers.AutoModelForCausalLM.from_pretrained(pretrained)
    loaded = peft.PeftModel.from_pretrained(base, out).eval()
    x = _tokens()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, reference(input_ids=x).logits)
        # The adapters changed the model: the test would not see a lost adapter otherwise.
        assert not torch.equal(
            loaded(input_ids=x).logits,
            transformers.AutoModelForCausalLM.from_pretrained(pretrained)(input_ids=x).logits,
        )


def test_export_to_hf_merges_the_adapters_as_merge_and_unload(pretrained, lora_run, tmp_path):
    final = _adapters(lora_run / f"checkpoint_{STEPS}.mdl")
    out = tmp_path / "merged"
    ckpt_file = lora_run / f"checkpoint_{STEPS}.mdl"
    assert main(["checkpoint", "convert", str(ckpt_file), str(out), "--to", "hf"]) == 0
    merged, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    reference = _trained_peft(pretrained, final)
    by_peft = _trained_peft(pretrained, final).merge_and_unload().state_dict()
    for key, value in merged.state_dict().items():
        # peft's merge, on the same tensors: the same arithmetic.
        assert torch.equal(value, by_peft[key]), key
    x = _tokens()
    with torch.no_grad():
        # W x + B (A x) s against (W + s B A) x: other rounding, float32 ulps.
        torch.testing.assert_close(
            merged.eval()(input_ids=x).logits,
            reference(input_ids=x).logits,
            rtol=1e-5,
            atol=1e-5,
        )


def test_a_resumed_lora_run_equals_one_that_never_stopped(pretrained, lora_run, tmp_path):
    model_dir = tmp_path / "run"
    half = STEPS // 2
    assert _run(tmp_path, _values(pretrained, max_steps=half), model_dir) == 0
    # The checkpoint holds the adapters, not the frozen base (Note [lora checkpoints]).
    state = ckpt.load(model_dir / f"checkpoint_{half}.mdl", map_location="cpu")
    assert state["model"] and all(".lora_" in k for k in state["model"])
    base_bytes = (pretrained / "model.safetensors").stat().st_size
    assert sum(v.nbytes for v in state["model"].values()) < base_bytes / 10
    assert state["metadata"]["peft"]["base"] == str(pretrained.resolve())
    assert _run(tmp_path, _values(pretrained), model_dir) == 0
    assert _losses(model_dir) == _losses(lora_run)
    want = _adapters(lora_run / f"checkpoint_{STEPS}.mdl")
    got = _adapters(model_dir / f"checkpoint_{STEPS}.mdl")
    assert want.keys() == got.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_resume_names_the_missing_or_changed_base(pretrained, tmp_path, capsys):
    base = tmp_path / "base"
    shutil.copytree(pretrained, base)
    model_dir = tmp_path / "run"
    assert _run(tmp_path, _values(base, hf_config=pretrained, max_steps=2), model_dir) == 0
    listing = sorted(p.name for p in model_dir.iterdir())
    # The base moved away: the resume stops before anything is built or written.
    shutil.move(base, tmp_path / "moved")
    capsys.readouterr()
    assert _run(tmp_path, _values(base, hf_config=pretrained, max_steps=4), model_dir) == 2
    out = capsys.readouterr().out
    assert "holds LoRA adapters of the base model at" in out and "does not exist" in out
    assert str(base.resolve()) in out
    assert sorted(p.name for p in model_dir.iterdir()) == listing
    # Other weights in its place: refused too.
    torch.manual_seed(1)
    _llama().save_pretrained(base)
    assert _run(tmp_path, _values(base, hf_config=pretrained, max_steps=4), model_dir) == 2
    assert "holds other weights" in capsys.readouterr().out
    # Back where it was: the run resumes.
    shutil.rmtree(base)
    shutil.move(tmp_path / "moved", base)
    assert _run(tmp_path, _values(base, hf_config=pretrained, max_steps=4), model_dir) == 0


def test_the_frozen_base_has_no_optimizer_state_no_gradient_and_does_not_change(
    pretrained, tmp_path
):
    from weightstream.cli.params import parse_params
    from weightstream.cli.run import Run

    values = _values(pretrained, max_steps=2, store="disk")
    values["runconfig"]["model_dir"] = str(tmp_path / "run")
    run = Run(parse_params(values, "train"), "train", "CPU")
    try:
        assert run.execute() == 0
    finally:
        start_run()
    model, optimizer = run.trainer.model, run.trainer.optimizer
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    named = dict(model.named_parameters())
    assert trainable and all(".lora_" in n for n, p in named.items() if p.requires_grad)
    in_optimizer = [p for g in optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in in_optimizer} == trainable
    assert len(optimizer.state_dict()["state"]) == len(trainable)
    pretrained_state = transformers.AutoModelForCausalLM.from_pretrained(pretrained).state_dict()
    from weightstream.common import lora

    for name, base_name in lora.base_names(model).items():
        p = named.get(name)
        if base_name is None or p is None:
            continue
        assert not p.requires_grad and p.grad is None, name
        assert torch.equal(p.detach(), pretrained_state[base_name]), name


def test_the_frozen_base_streams_in_the_compute_dtype_and_sends_no_gradient(pretrained):
    """Through the API: each base weight reaches its layer in bfloat16 (the compute
    dtype), no gradient of a base weight comes back, the adapters get theirs."""
    import weightstream as cstorch
    from weightstream.common import lora

    model = transformers.AutoModelForCausalLM.from_pretrained(pretrained)
    model.config.use_cache = False
    wrapped = lora.wrap(model, lora.lora_config(LORA))
    compiled = cstorch.compile(
        wrapped, backend="ws", compute_dtype="bf16", unit_classes=["LlamaDecoderLayer"]
    )
    seen: dict[str, torch.dtype] = {}
    hooks = []
    for name, m in wrapped.named_modules():
        if name.endswith("q_proj.base_layer"):
            hooks.append(
                m.register_forward_pre_hook(
                    lambda mod, _args, name=name: seen.__setitem__(name, mod.weight.dtype)
                )
            )
    x = _tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = compiled(input_ids=x, labels=x).loss
    loss.backward()
    for h in hooks:
        h.remove()
    assert seen and set(seen.values()) == {torch.bfloat16}, seen
    for name, p in wrapped.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.dtype == torch.float32, name
        else:
            assert p.grad is None, name
    compiled.close()


# ---- the params section and its errors ---------------------------------------------------


def _parse(values: dict):
    from weightstream.cli.params import parse_params

    values = {**values, "runconfig": {**values["runconfig"], "model_dir": "unused"}}
    return parse_params(values, "train")


def test_the_peft_section_reads_back_to_the_same_lora_config(pretrained):
    lora = {**LORA, "lora_dropout": 0.1, "use_rslora": True, "layers_to_transform": [1]}
    lora["layers_pattern"] = "layers"
    params = _parse(_values(pretrained, lora=lora))
    assert params.peft.config.r == 4 and params.peft.config.use_rslora
    assert params.peft.config.task_type == "CAUSAL_LM"
    again = _parse({**_values(pretrained), "peft": params.to_dict()["peft"]})
    assert again.peft.lora_values() == params.peft.lora_values()
    # A LoraConfig field the section does not type passes through, checked by peft.
    assert _parse(_values(pretrained, lora={**LORA, "inference_mode": False})).peft.extra == {
        "inference_mode": False
    }


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        ({"peft": {**LORA, "lora_alpah": 16}}, ValueError, ["'lora_alpah'", "'lora_alpha'"]),
        ({"peft": {**LORA, "r": 0}}, ValueError, ["peft.r must be >= 1"]),
        ({"peft": {**LORA, "r": "8"}}, TypeError, ["peft.r must be an integer"]),
        ({"peft": {**LORA, "use_dora": True}}, ValueError, ["peft.use_dora", "DoRA"]),
        ({"peft": {**LORA, "init_lora_weights": "pissa"}}, ValueError, ["init_lora_weights"]),
        ({"model": {"name": "gpt2"}}, ValueError, ["peft:", "'gpt2'", "name: hf"]),
        ({"runconfig": {"max_steps": 1}}, ValueError, ["checkpoint_path", "load_checkpoint"]),
    ],
    ids=["unknown_key", "rank", "quoted_rank", "dora", "pissa", "not_hf", "no_base"],
)
def test_bad_peft_settings_name_the_key_and_the_fix(pretrained, change, error, words):
    values = {**_values(pretrained), **change}
    with pytest.raises(error) as info:
        _parse(values)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_peft_without_a_hf_model_stops_the_run_command(pretrained, tmp_path, capsys):
    values = _values(pretrained)
    values["model"] = {"name": "gpt2", "n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 16}
    assert _run(tmp_path, values, tmp_path / "run") == 2
    assert "LoRA adapters need a Hugging Face model" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()


def test_old_transformers_or_peft_is_one_clear_error(monkeypatch):
    import sys

    from weightstream.common import hf_config

    # The module ``import transformers`` gives now (importing peft replaces the one
    # this file bound at its top).
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")
    with pytest.raises(ImportError, match=r"needs transformers>=5\.0, but transformers 4\.57\.1"):
        hf_config.transformers_module()
    with pytest.raises(ImportError, match=r"weightstream\[hf\]"):
        hf_config.peft_module()
    monkeypatch.undo()
    monkeypatch.setattr(sys.modules["peft"], "__version__", "0.10.0")
    with pytest.raises(ImportError, match=r"needs peft>=0\.17, but peft 0\.10\.0"):
        hf_config.peft_module()
    monkeypatch.setitem(sys.modules, "peft", None)  # not installed
    with pytest.raises(ImportError, match=r"pip install 'weightstream\[hf\]'"):
        hf_config.peft_module()


def test_evaluation_reads_the_base_from_its_folder_and_the_adapters_from_the_run(
    pretrained, lora_run, tmp_path
):
    """-m eval of a LoRA run's model_dir: the base from checkpoint_path, the adapters
    from the newest checkpoint; the loss is eager peft's on the same batches."""
    values = _values(pretrained, eval_steps=2)
    values["eval_input"] = _section(pretrained)
    model_dir = tmp_path / "run"
    shutil.copytree(lora_run, model_dir)
    assert _run(tmp_path, values, model_dir, mode="eval") == 0
    from test_run_command import _scalars

    (step, got), *_ = _scalars(model_dir / "eval", "loss")
    assert step == STEPS
    model = _trained_peft(pretrained, _adapters(lora_run / f"checkpoint_{STEPS}.mdl"))
    loader = get_data_processor("TextCorpusProcessor")(_section(pretrained), False)
    losses = []
    with torch.no_grad():
        for step, batch in enumerate(loader):
            if step == 2:
                break
            logits = model(input_ids=batch["input_ids"]).logits
            losses.append(F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item())
    assert got == pytest.approx(sum(losses) / 2, rel=1e-6)


def test_wrapping_logs_the_adapted_modules_and_warns_of_a_target_that_matched_none(caplog):
    """The count is peft's own (get_nb_trainable_parameters); a partly misspelled
    target_modules list, which peft accepts, is named."""
    import logging

    from test_hf_finetune import _llama

    from weightstream.common import lora

    config = lora.lora_config({"r": 4, "target_modules": ["q_prj", "v_proj", "down_proj"]})
    logger = logging.getLogger("weightstream")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="weightstream"):
            with pytest.warns(UserWarning, match=r"\['q_prj'\] matched no module") as caught:
                wrapped = lora.wrap(_llama(), config)
    finally:
        logger.removeHandler(caplog.handler)
    trainable, total = wrapped.get_nb_trainable_parameters()
    layers = wrapped.config.num_hidden_layers
    assert f"LoRA adapters on {2 * layers} modules (down_proj x{layers}, v_proj x{layers})" in (
        caplog.text
    )
    assert f"{trainable:,} of {total:,} parameters train" in caplog.text
    # The names offered are the model's own matrices, not the adapters' inner parts.
    offered = "'down_proj', 'embed_tokens', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', "
    assert offered + "'q_proj', 'up_proj', 'v_proj']" in str(caught[0].message)


@pytest.mark.parametrize(
    ("make", "targets", "error"),
    [
        (
            "_llama",
            ["qq"],
            r"peft.target_modules \{'qq'\} matched no module of the model \(peft: .*\)\. Fix: "
            r"name modules the model has, such as \['down_proj', 'embed_tokens', 'gate_proj', "
            r"'k_proj', 'lm_head'",
        ),
        # peft maps gate_proj, up_proj and down_proj of a mixture of experts onto its
        # stacked experts' tensors (LoRA on bare parameters, applied as a
        # parametrization in the forward): refused, with what can be targeted instead.
        (
            "_qwen3_moe",
            ["q_proj", "gate_proj", "up_proj"],
            r"peft.target_modules \['gate_proj', 'q_proj', 'up_proj'\] make peft put LoRA on the "
            r"bare parameters \['gate_up_proj'\] .* Fix: target Linear modules only, such as "
            r"\[.*'q_proj'.*\]; or train the experts whole with modules_to_save: \[experts\]",
        ),
    ],
    ids=["no-match", "moe-experts"],
)
def test_targets_it_cannot_adapt_are_refused_with_the_modules_it_can(make, targets, error):
    import test_hf_finetune

    from weightstream.common import lora

    config = lora.lora_config({"r": 4, "target_modules": targets})
    with pytest.raises(ValueError, match=error):
        lora.wrap(getattr(test_hf_finetune, make)(), config)


def test_export_to_hf_refuses_trained_experts_it_cannot_merge_into_the_base_files(tmp_path, capsys):
    """A mixture's experts trained whole (``modules_to_save``) are one stacked tensor
    in the run and one tensor per expert in the base's files (Note [converted
    tensors]): the merged export would have written the base's experts unchanged."""
    from test_hf_finetune import _qwen3_moe

    tokenizer = train_bpe(tmp_path / "tokenizer", TOKENIZER_VOCAB)
    folder = _save_pretrained(_qwen3_moe, tmp_path / "pretrained", tokenizer)
    lora = {**LORA, "target_modules": ["q_proj"], "modules_to_save": ["experts"]}
    values = _values(folder, lora, max_steps=1, checkpoint_steps=1)
    assert _run(tmp_path, values, tmp_path / "run") == 0
    out = tmp_path / "merged"
    ckpt_file = tmp_path / "run" / "checkpoint_1.mdl"
    assert main(["checkpoint", "convert", str(ckpt_file), str(out), "--to", "hf"]) != 0
    said = capsys.readouterr().err
    assert "'model.layers.0.mlp.experts.down_proj'" in said and "--to peft" in said, said
    assert not out.exists()
    assert main(["checkpoint", "convert", str(ckpt_file), str(out), "--to", "peft"]) == 0


def test_a_parameter_replaced_during_the_forward_is_an_error_naming_it():
    """From the API: peft's own model with LoRA on the stacked experts, compiled for
    weight streaming: the experts' tensor leaves its module in the forward (peft's
    parametrization), which the streamer says, not a KeyError of its own."""
    from test_hf_finetune import _qwen3_moe

    import weightstream as cstorch

    torch.manual_seed(0)
    model = peft.get_peft_model(
        _qwen3_moe(), peft.LoraConfig(r=4, target_modules=["q_proj", "gate_proj", "up_proj"])
    )
    runner = cstorch.compile(model, backend="wse_ws", granularity="module")
    x = torch.randint(0, MODEL_VOCAB, (2, SEQ))
    with pytest.raises(ValueError, match=r"the parameter 'gate_up_proj' of a .*Experts is no "
                       r"longer in its module when its unit runs: .* Fix: "):  # fmt: skip
        runner(input_ids=x, labels=x)
