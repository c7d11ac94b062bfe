"""Pretrained in: a Hugging Face causal LM fine-tuned by the run command.

A small transformers Llama (grouped-query attention, untied head) and GPT-2
(tied head), saved with ``save_pretrained``, are named by ``model: {name: hf,
hf_config: FOLDER}`` and warm-started from the same folder
(``load_checkpoint_states: model``) in weight streaming, with the store in host
memory and on disk, on text encoded by a BPE tokenizer trained here with the
`tokenizers` library (saved in the model folder, as Hugging Face keeps it). Their losses and final weights must equal eager
transformers training of the same batches with torch.optim.AdamW: bit for bit,
as the engine's HF tests show for the API (same fp32 kernels, same update
arithmetic; Note [matching torch.optim bit for bit]).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import params_files as pf
import pytest
import torch
from eager_lm import train_eagerly
from local_tokenizer import train_bpe

from weightstream import checkpoint as ckpt
from weightstream.cli.main import main
from weightstream.context import start_run
from weightstream.data.processors import get_data_processor

transformers = pytest.importorskip("transformers")

BATCH, SEQ, STEPS, LR = 4, 16, 3, 2e-3
MODEL_VOCAB, TOKENIZER_VOCAB = 320, 300


# The size of every small decoder below (GPT-2 names these differently).
_SMALL = dict(
    vocab_size=MODEL_VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
)


def _llama():
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**_SMALL, num_key_value_heads=2, tie_word_embeddings=False)
    )


def _gpt2():
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=MODEL_VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


def _gpt_neox():
    """Its head is ``lm_head`` in the model and ``embed_out`` in the file: transformers
    renames it on load, and so must a warm start."""
    return transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(**_SMALL, hidden_dropout=0.0, attention_dropout=0.0)
    )


def _gemma():
    """Its scaled embedding keeps ``embed_scale`` in a buffer of a module without a
    config: built on meta, only transformers' own init computes it."""
    return transformers.GemmaForCausalLM(
        transformers.GemmaConfig(**_SMALL, num_key_value_heads=2, head_dim=8)
    )


def _qwen3_moe():
    """A mixture of experts: the model holds each layer's experts stacked
    (``experts.gate_up_proj``), the file one tensor per expert and projection, which
    transformers' converters stack on load (Note [converted tensors] in
    checkpoint/hf_layout.py); its float32 experts multiply with ``_grouped_mm``, whose
    fake kernel takes bf16 only (Note [fake kernels] in runtime/trace.py)."""
    return transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            **_SMALL, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16,
        )
    )  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("tokenizer"), TOKENIZER_VOCAB)


def _save_pretrained(make, folder: Path, tokenizer: Path) -> Path:
    """The model as save_pretrained writes it, with the tokenizer beside it."""
    torch.manual_seed(0)
    make().save_pretrained(folder)
    shutil.copy(tokenizer, folder / "tokenizer.json")
    return folder


def _section(folder: Path) -> dict:
    """Text through the model folder's tokenizer, in order (no shuffle)."""
    section = pf.text_input(BATCH, SEQ, shuffle=False, max_bytes=2**18, tokenizer=str(folder))
    section["vocab_size"] = MODEL_VOCAB
    return section


def _params(tmp_path: Path, folder: Path, store: str) -> Path:
    runconfig = {
        "max_steps": STEPS,
        "checkpoint_steps": 0,
        "log_steps": 1,
        "seed": 1,
        "checkpoint_path": str(folder),
        "load_checkpoint_states": "model",
        "store": store,
    }
    return pf.write(
        tmp_path / f"hf_{store}.yaml",
        pf.params(
            train_input=_section(folder),
            model={"name": "hf", "hf_config": str(folder)},
            optimizer=pf.adamw(LR, weight_decay=0.0),
            runconfig=runconfig,
        ),
    )


def _eager(folder: Path) -> tuple[list[float], dict]:
    """transformers' own model from the folder, trained on the run's batches."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model.config.use_cache = False
    model.train()
    loader = get_data_processor("TextCorpusProcessor")(_section(folder), True)
    losses, _ = train_eagerly(model, model.parameters(), loader, STEPS, LR)
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


# 3.5 s each on 2 cores: the default suite runs the Llama and GPT-2 in RAM and the Llama
# through the disk store (its 15 minutes); -m slow the rest.
@pytest.mark.parametrize(
    ("make", "store"),
    [
        (_llama, "ram"),
        (_gpt2, "ram"),
        (_llama, "disk"),
        (_qwen3_moe, "ram"),
        *(pytest.param(m, "ram", marks=pytest.mark.slow) for m in (_gpt_neox, _gemma)),
        *(pytest.param(m, "disk", marks=pytest.mark.slow) for m in (_gpt2, _gpt_neox, _gemma)),
    ],
    ids=lambda v: v if isinstance(v, str) else v.__name__.removeprefix("_"),
)
def test_warm_started_hf_model_trains_like_eager_transformers(tmp_path, tokenizer, make, store):
    folder = _save_pretrained(make, tmp_path / "pretrained", tokenizer)
    model_dir = tmp_path / "run"
    params = _params(tmp_path, folder, store)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WEIGHTSTREAM_QUICK_MACHINE_PROFILE", "1")
        mp.setenv("WEIGHTSTREAM_CACHE_DIR", str(tmp_path / "cache"))
        assert main(["run", "CPU", "-p", str(params), "-o", str(model_dir)]) == 0
    start_run()
    losses = [json.loads(line)["loss"] for line in (model_dir / "train" / "losses.jsonl").open()]
    want_losses, want = _eager(folder)
    assert losses == want_losses
    got = ckpt.load(model_dir / f"checkpoint_{STEPS}.mdl", map_location="cpu")["model"]
    for name, value in want.items():
        if name in got:
            assert torch.equal(got[name], value), name
    assert set(got) <= set(want)
    # The compile phase priced the transformers model (its dry run skips the mask
    # helpers' data-dependent checks as the trace's does).
    perf = json.loads((model_dir / "performance" / "performance.json").read_text())
    assert perf["est_samples_per_sec"] > 0


@pytest.mark.slow  # 18 s on 2 cores; one rank's warm start is checked by default
def test_a_warm_start_on_two_ranks_trains_like_eager_transformers(tmp_path, tokenizer):
    """A meta-device model warm-started in host memory gets new parameters: the shards'
    owners must be those of the new ones, or every rank takes itself for the owner of
    every unit and both ranks' broadcasts wait to send, forever."""
    from test_distributed import LOSS_RTOL

    folder = _save_pretrained(_llama, tmp_path / "pretrained", tokenizer)
    model_dir = tmp_path / "run"
    assert _run(tmp_path, _params(tmp_path, folder, "ram"), model_dir, ranks=2) == 0
    losses = [json.loads(line)["loss"] for line in (model_dir / "train" / "losses.jsonl").open()]
    want_losses, _ = _eager(folder)
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(want_losses), rtol=LOSS_RTOL, atol=0
    )


def _run(tmp_path: Path, params: Path, model_dir: Path, capsys=None, ranks: int = 1) -> int:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WEIGHTSTREAM_QUICK_MACHINE_PROFILE", "1")
        mp.setenv("WEIGHTSTREAM_CACHE_DIR", str(tmp_path / "cache"))
        dp = ["--num_csx", str(ranks)] if ranks > 1 else []
        try:
            return main(["run", "CPU", "-p", str(params), "-o", str(model_dir), *dp])
        finally:
            start_run()


def test_warm_start_names_a_missing_tensor(tmp_path, tokenizer, caplog):
    """A Llama warm-started from a GPT-2 folder: the error names what is missing."""
    other = _save_pretrained(_gpt2, tmp_path / "other", tokenizer)
    folder = _save_pretrained(_llama, tmp_path / "pretrained", tokenizer)
    values = pf.params(
        train_input=_section(folder),
        model={"name": "hf", "hf_config": str(folder)},
        optimizer=pf.adamw(LR),
        runconfig={
            "max_steps": 1,
            "checkpoint_path": str(other),
            "load_checkpoint_states": "model",
        },
    )
    params = pf.write(tmp_path / "p.yaml", values)
    start_run()
    logger = logging.getLogger("weightstream")  # the run's log, which does not propagate
    logger.addHandler(caplog.handler)
    try:
        assert main(["run", "CPU", "-p", str(params), "-o", str(tmp_path / "run")]) == 2
    finally:
        logger.removeHandler(caplog.handler)
    assert "cannot warm-start" in caplog.text and "'model.embed_tokens.weight'" in caplog.text


@pytest.mark.parametrize(
    "make", [_llama, _gpt2, _gpt_neox, _qwen3_moe], ids=["llama", "gpt2", "gpt_neox", "qwen3_moe"]
)
def test_export_to_hf_loads_with_from_pretrained_and_gives_the_runs_logits(
    tmp_path, tokenizer, make
):
    """The exported folder holds the tensors under the names save_pretrained writes
    (GPT-NeoX's head as embed_out, a mixture's experts one tensor each: what older
    readers expect; GPT-2's tied head not at all), and loads as the run."""
    from safetensors import safe_open

    folder = _save_pretrained(make, tmp_path / "pretrained", tokenizer)
    model_dir = tmp_path / "run"
    assert _run(tmp_path, _params(tmp_path, folder, "disk"), model_dir) == 0
    out = tmp_path / "exported"
    assert main(["checkpoint", "convert", str(model_dir / f"checkpoint_{STEPS}.mdl"), str(out),
                 "--to", "hf"]) == 0  # fmt: skip
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    names = [set(safe_open(d / "model.safetensors", "pt").keys()) for d in (out, folder)]
    assert names[0] == names[1]
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True
    )
    assert info["missing_keys"] == set() or not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    # The run's final weights in transformers' own model give the same logits.
    final = dict(ckpt.load(model_dir / f"checkpoint_{STEPS}.mdl", map_location="cpu")["model"])
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder)
    reference.load_state_dict(final)
    x = torch.randint(0, MODEL_VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(exported(input_ids=x).logits, reference(input_ids=x).logits)


def test_export_with_learning_rate_zero_is_the_pretrained_model(tmp_path, tokenizer, monkeypatch):
    """The run names its model folder relative to where it started; the export, started
    elsewhere, still finds the configuration (the checkpoint records it absolute)."""
    monkeypatch.chdir(tmp_path)
    folder = _save_pretrained(_gpt2, Path("pretrained"), tokenizer)
    params = _params(tmp_path, folder, "ram")
    import yaml

    values = yaml.safe_load(params.read_text())
    values["optimizer"]["learning_rate"] = 0.0
    params.write_text(yaml.safe_dump(values))
    model_dir = tmp_path / "run"
    assert _run(tmp_path, params, model_dir) == 0
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    folder = tmp_path / folder
    out = tmp_path / "exported"
    ckpt_file = model_dir / f"checkpoint_{STEPS}.mdl"
    assert main(["checkpoint", "convert", str(ckpt_file), str(out), "--to", "hf"]) == 0
    sharded = tmp_path / "sharded"  # above --max-shard-size: shards and an index
    args = ["checkpoint", "convert", str(ckpt_file), str(sharded), "--to", "hf"]
    assert main([*args, "--max-shard-size", "20000"]) == 0
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    for directory in (out, sharded):
        exported = transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()
        assert pretrained.keys() == exported.keys()
        for key, value in pretrained.items():
            assert torch.equal(exported[key], value), key


def test_convert_to_a_directory_never_writes_an_h5_file_named_like_it(tmp_path):
    src = tmp_path / "c.mdl"
    ckpt.save({"model": {"w": torch.ones(2)}}, src)
    for dst in (tmp_path / "new_folder", str(tmp_path / "slash") + "/"):
        assert main(["checkpoint", "convert", str(src), str(dst)]) == 0
        assert Path(dst).is_dir(), dst
        assert (Path(dst) / "model.safetensors").is_file()
    assert main(["checkpoint", "convert", str(src), str(tmp_path / "x"), "--to", "h5"]) != 0
    assert not (tmp_path / "x").exists()


def test_convert_to_a_suffix_of_no_format_asks_for_the_format(tmp_path, capsys):
    """A misspelt suffix (.safetensor) is not written as another format silently."""
    src = tmp_path / "c.mdl"
    ckpt.save({"model": {"w": torch.ones(2)}}, src)
    assert main(["checkpoint", "convert", str(src), str(tmp_path / "w.safetensor")]) != 0
    assert "its suffix '.safetensor' is none of" in capsys.readouterr().err
    assert not (tmp_path / "w.safetensor").exists()
    dst = tmp_path / "w.safetensor"
    assert main(["checkpoint", "convert", str(src), str(dst), "--to", "safetensors"]) == 0
    from safetensors import safe_open

    with safe_open(dst / "model.safetensors", "pt") as f:  # a folder, as --to says
        assert torch.equal(f.get_tensor("model.w"), torch.ones(2))


def test_api_meta_model_on_the_disk_store_is_filled_by_load_state_dict(tmp_path):
    """No init hook: a transformers Llama built on meta (rotary tables, RMSNorm) is given
    storage by the disk store and its values by load_state_dict, then trains like eager."""
    import weightstream as cstorch

    torch.manual_seed(0)
    ref = _llama()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(ref.config)
    compiled = cstorch.compile(
        model, backend="ws", store="disk", store_dir=str(tmp_path / "store"), init_weights=False
    )
    x = torch.randint(0, MODEL_VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="have no values"):
        compiled(input_ids=x)
    model.load_state_dict(ref.state_dict())
    opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=LR, foreach=False) for m in (model, ref))
    for _ in range(2):
        for m, o in ((compiled, opt), (ref, opt_ref)):
            m(input_ids=x, labels=x).loss.backward()
            o.step()
            o.zero_grad()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
    compiled.close()


def _gptj():
    return transformers.GPTJForCausalLM(
        transformers.GPTJConfig(
            vocab_size=MODEL_VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            rotary_dim=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


_ZOO_SHAPES = {
    # The zoo's config of the same shape as each transformers model above.
    "llama": (
        _llama,
        {"n_layer": 2, "d_model": 32, "n_head": 4, "n_kv_head": 2, "d_ff": 64, "norm_eps": 1e-6},
        ("blocks.1.attn.k_proj.weight", "model.layers.1.self_attn.k_proj.weight", False),
    ),
    "gpt2": (
        _gpt2,
        {"n_layer": 2, "d_model": 32, "n_head": 4},
        ("blocks.1.attn.qkv.weight", "transformer.h.1.attn.c_attn.weight", True),
    ),
    "gptj": (
        _gptj,
        {"n_layer": 2, "d_model": 32, "n_head": 4, "rotary_dim": 4},
        ("blocks.0.mlp.fc_in.weight", "transformer.h.0.mlp.fc_in.weight", False),
    ),
}


def _llama_first(names):
    """The default suite: the zoo's Llama (its 15 minutes); -m slow the others too."""
    return [n if n == "llama" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(names)]


@pytest.mark.parametrize("zoo_name", _llama_first(_ZOO_SHAPES))
def test_zoo_model_warm_starts_from_a_hugging_face_folder_of_its_architecture(
    tmp_path, tokenizer, zoo_name
):
    """A zoo model of the same shape reads transformers' weights by their names
    (common/hf_names.py; GPT-2's Conv1D matrices transposed) and computes
    transformers' logits with them."""
    make, fields, (zoo_key, hf_key, transposed) = _ZOO_SHAPES[zoo_name]
    folder = _save_pretrained(make, tmp_path / "pretrained", tokenizer)
    zoo = {"name": zoo_name, "vocab_size": MODEL_VOCAB, "seq_len": 64, **fields}
    values = pf.params(
        train_input=_section(folder),
        model=zoo,
        optimizer=pf.adamw(0.0),
        runconfig={
            "max_steps": 1,
            "checkpoint_path": str(folder),
            "load_checkpoint_states": "model",
        },
    )
    params = pf.write(tmp_path / "zoo.yaml", values)
    model_dir = tmp_path / "run"
    assert _run(tmp_path, params, model_dir) == 0
    weights = dict(ckpt.load(model_dir / "checkpoint_1.mdl", map_location="cpu")["model"])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    hf_value = hf_model.state_dict()[hf_key]
    assert torch.equal(weights[zoo_key], hf_value.t() if transposed else hf_value)
    from weightstream.cli.params import ModelParams

    model = ModelParams.from_dict(dict(zoo)).build("cpu")
    model.load_state_dict(weights)
    model.eval()
    x = torch.randint(0, MODEL_VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        # The same formulas with other kernels and operation order: a few ulps.
        torch.testing.assert_close(model(x), hf_model(input_ids=x).logits, rtol=1e-5, atol=1e-5)


_ZOO_EXPORTS = {
    # Settings off their defaults where transformers has a field for them.
    "llama": {
        "n_kv_head": 2,
        "d_ff": 48,
        "rope_theta": 5000.0,
        "norm_eps": 1e-6,
        "tie_embeddings": True,
    },
    "gpt2": {},  # tied head: one tensor in the checkpoint under two names
    "gptj": {"rotary_dim": 4, "d_ff": 80, "norm_eps": 1e-6},
}


@pytest.mark.parametrize("zoo_name", _llama_first(_ZOO_EXPORTS))
def test_a_zoo_models_checkpoint_exports_to_its_hugging_face_architecture(tmp_path, zoo_name):
    """--to hf of a zoo run: transformers' names (GPT-2's Conv1D matrices transposed) and
    a config built from the run's model section; transformers' model computes the zoo
    model's logits. A --config of another architecture is refused: its from_pretrained
    would start the weights at random."""
    zoo = {**pf.gpt2(2, 32, 32, n_head=4), **_ZOO_EXPORTS[zoo_name], "name": zoo_name}
    section = pf.text_input(2, 32)
    values = pf.params(train_input=section, model=zoo, optimizer=pf.adamw(1e-2),
                       runconfig={"max_steps": 2, "seed": 3})  # fmt: skip
    model_dir = tmp_path / "run"
    assert _run(tmp_path, pf.write(tmp_path / "zoo.yaml", values), model_dir) == 0
    checkpoint = model_dir / "checkpoint_2.mdl"
    out = tmp_path / "exported"
    assert main(["checkpoint", "convert", str(checkpoint), str(out), "--to", "hf"]) == 0
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    from weightstream.cli.params import ModelParams

    state = ckpt.load(checkpoint, map_location="cpu")
    model = ModelParams.from_dict(dict(state["metadata"]["params"]["model"])).build("cpu")
    model.load_state_dict(dict(state["model"]))
    model.eval()
    x = torch.randint(0, pf.VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        # The same formulas with other kernels and operation order: a few ulps.
        torch.testing.assert_close(model(x), exported(input_ids=x).logits, rtol=1e-5, atol=1e-5)

    config = tmp_path / "other"  # another architecture's config.json
    (_gpt2 if zoo_name != "gpt2" else _llama)().config.save_pretrained(config)
    wrong = tmp_path / "wrong"
    args = ["checkpoint", "convert", str(checkpoint), str(wrong), "--to", "hf"]
    assert main([*args, "--config", str(config)]) != 0
    assert not wrong.exists()


def test_bf16_master_run_exports_bf16_weights(tmp_path, tokenizer):
    """runconfig.master_dtype: bfloat16 trains bf16 masters (Note [Kahan summation] in
    optim/compact.py); --to hf writes them as they are, bf16."""
    import yaml
    from safetensors import safe_open

    folder = _save_pretrained(_gpt2, tmp_path / "pretrained", tokenizer)
    params = _params(tmp_path, folder, "ram")
    values = yaml.safe_load(params.read_text())
    values["runconfig"]["master_dtype"] = "bfloat16"
    params.write_text(yaml.safe_dump(values))
    model_dir = tmp_path / "run"
    assert _run(tmp_path, params, model_dir) == 0
    out = tmp_path / "exported"
    ckpt_file = model_dir / f"checkpoint_{STEPS}.mdl"
    assert main(["checkpoint", "convert", str(ckpt_file), str(out), "--to", "hf"]) == 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert next(exported.parameters()).dtype == torch.bfloat16


def test_a_tied_models_own_file_loads_without_an_unused_tensor_warning(tmp_path):
    """Its head is stored under both names with the same values: both are used. An
    untied file's head differs from the embedding the tied model keeps: not used, said."""
    import warnings

    from weightstream.checkpoint.weights import load_weights

    def gpt2(tied: bool):
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=MODEL_VOCAB, n_positions=16, n_embd=32,
                                    n_layer=1, n_head=2, tie_word_embeddings=tied)
        )  # fmt: skip

    torch.manual_seed(0)
    for tied, unused in ((True, []), (False, ["'lm_head.weight'"])):
        source = gpt2(tied)
        ckpt.save({"model": source.state_dict()}, tmp_path / f"{tied}.mdl")
        target = gpt2(True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_weights(target, tmp_path / f"{tied}.mdl")
        said = [str(w.message) for w in caught if "not used by the model" in str(w.message)]
        assert [u for u in unused if any(u in s for s in said)] == unused and len(said) == len(
            unused
        )
        assert torch.equal(target.transformer.wte.weight, source.transformer.wte.weight)


def _mixtral():
    """Its file names the experts' projections w1, w2, w3 under ``block_sparse_moe``:
    renamed, then stacked by transformers' converters."""
    return transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**_SMALL, num_key_value_heads=2, num_local_experts=4,
                                   num_experts_per_tok=2)
    )  # fmt: skip


@pytest.mark.parametrize("make", [_qwen3_moe, _mixtral], ids=["qwen3_moe", "mixtral"])
def test_a_mixture_of_experts_warm_starts_as_from_pretrained_loads_it(tmp_path, make):
    """The file holds one tensor per expert and projection; the model one stacked
    tensor per layer and projection (Note [converted tensors] in checkpoint/hf_layout.py)."""
    import warnings

    from safetensors import safe_open

    from weightstream.checkpoint.weights import load_weights

    torch.manual_seed(0)
    make().save_pretrained(tmp_path / "pretrained")
    keys = set(safe_open(tmp_path / "pretrained" / "model.safetensors", "pt").keys())
    assert any(".experts.3." in k for k in keys)  # the file's per-expert layout
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pretrained")
    torch.manual_seed(1)
    model = make()  # other values in every tensor
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every tensor of the file is used
        used = load_weights(model, tmp_path / "pretrained")
    assert set(used) == keys
    got, want = model.state_dict(), want.state_dict()
    assert set(got) == set(want) and any("experts.gate_up_proj" in k for k in got)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_a_mixture_of_experts_file_short_of_an_expert_is_refused_before_any_copy(tmp_path):
    from safetensors.torch import load_file, save_file

    from weightstream.checkpoint.weights import load_weights

    torch.manual_seed(0)
    _qwen3_moe().save_pretrained(tmp_path / "pretrained")
    path = tmp_path / "pretrained" / "model.safetensors"
    tensors = load_file(path)
    dropped = [k for k in tensors if ".layers.1.mlp.experts.3." in k]
    save_file({k: v for k, v in tensors.items() if k not in dropped}, path)
    model = _qwen3_moe()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"cannot warm-start .*'model\.layers\.1\.mlp\.experts"
                       r"\.(gate_up|down)_proj' is \(3, .* \(4, "):  # fmt: skip
        load_weights(model, tmp_path / "pretrained")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_mixture_with_router_logits_trains_on_transformers_load_balancing_loss_too(
    tmp_path, tokenizer
):
    """``output_router_logits: true`` in the model section: each step's loss is the
    cross-entropy plus ``router_aux_loss_coef`` x transformers' own ``aux_loss`` (Note
    [router loss] in models/tasks.py), as the model's forward adds it with labels."""
    from eager_lm import train_eagerly

    folder = _save_pretrained(_qwen3_moe, tmp_path / "pretrained", tokenizer)
    model = {"name": "hf", "hf_config": str(folder), "output_router_logits": True,
             "router_aux_loss_coef": 0.5}  # a weight that moves every loss  # fmt: skip
    runconfig = {"max_steps": STEPS, "checkpoint_steps": 0, "log_steps": 1, "seed": 1,
                 "checkpoint_path": str(folder), "load_checkpoint_states": "model"}  # fmt: skip
    params = pf.write(
        tmp_path / "moe.yaml",
        pf.params(
            train_input=_section(folder),
            model=model,
            optimizer=pf.adamw(LR, weight_decay=0.0),
            runconfig=runconfig,
        ),
    )
    model_dir = tmp_path / "run"
    assert _run(tmp_path, params, model_dir) == 0
    losses = [json.loads(line)["loss"] for line in (model_dir / "train" / "losses.jsonl").open()]

    def eager(router: bool):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, output_router_logits=router, router_aux_loss_coef=0.5
        )
        model.config.use_cache = False
        model.train()
        loader = get_data_processor("TextCorpusProcessor")(_section(folder), True)
        return train_eagerly(model, model.parameters(), loader, STEPS, LR, router=router)[0]

    assert losses == eager(router=True)
    assert losses[0] != eager(router=False)[0]  # the load-balancing term counts
