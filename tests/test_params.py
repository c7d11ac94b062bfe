"""The params file of ``weightstream run`` and its command line.

Every user mistake gets a TypeError/ValueError whose message names ``section.key``,
what was expected, what was given and the fix; the tests check that text.
"""

from __future__ import annotations

import copy
import sys
import types
import warnings
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightstream.cli.params import (
    SECTIONS,
    InputParams,
    ModelParams,
    OptimizerParams,
    Params,
    PeftParams,
    RunConfigParams,
    apply_overrides,
    load_params,
    parse_params,
    save_params,
)
from weightstream.cli.run_args import build_run_parser, params_from_args
from weightstream.models.fc_mnist import FCMNISTConfig
from weightstream.models.gpt import GPTConfig
from weightstream.runtime.config import StreamingConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PROCESSORS = "weightstream.data.processors"


@pytest.fixture(autouse=True)
def _no_processors_module(monkeypatch):
    """Tests run as if weightstream.data.processors did not exist (it is written
    separately); tests of the processor-key check install a stand-in."""
    monkeypatch.setitem(sys.modules, PROCESSORS, None)


@pytest.fixture
def fake_processors(monkeypatch):
    accepted = {
        "TextCorpusProcessor": {"seq_len", "vocab_size", "num_samples"},
        "DigitsProcessor": {"image_size", "num_classes"},
    }

    def processor_keys(name):
        if name not in accepted:
            raise ValueError(f"unknown data processor {name!r}")
        return accepted[name]

    module = types.ModuleType(PROCESSORS)
    module.processor_keys = processor_keys
    monkeypatch.setitem(sys.modules, PROCESSORS, module)


def gpt_raw() -> dict:
    return {
        "train_input": {
            "data_processor": "TextCorpusProcessor",
            "batch_size": 8,
            "seq_len": 32,
            "vocab_size": 256,
        },
        "eval_input": {"data_processor": "TextCorpusProcessor", "batch_size": 4, "seq_len": 32},
        "model": {"name": "gpt2", "d_model": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256},
        "optimizer": {"optimizer_type": "AdamW", "learning_rate": 1e-3},
        "runconfig": {"max_steps": 20},
    }


def parse_error(raw: dict, mode: str = "train", exc=(TypeError, ValueError)) -> str:
    with pytest.raises(exc) as info:
        parse_params(raw, mode)
    return str(info.value)


def with_value(section: str, key: str, value) -> dict:
    raw = gpt_raw()
    raw[section][key] = value
    return raw


def assert_mentions(message: str, *fragments: str) -> None:
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


# ---------------------------------------------------------------- valid files


# Parameter counts of the full-size zoo files, as published (GPT-2: tied embeddings
# and 1024 positions; GPT-3 XL: the paper's "1.3B"; GPT-J and Llama 2: the released
# checkpoints' tensors).
PUBLISHED_SIZES = {
    "gpt2_small": 124_439_808,
    "gpt2_medium": 354_823_168,
    "gpt2_large": 774_030_080,
    "gpt2_xl": 1_557_611_200,
    "gpt3_xl": 1_315_723_264,
    "gptj_6b": 6_050_882_784,
    "llama2_7b": 6_738_415_616,
    "llama2_13b": 13_015_864_320,
    "llama_20b": 20_228_933_120,  # not released: the configs/llama_20b.yaml shape
}


def test_zoo_configs_exist():
    names = {p.stem for p in CONFIGS.glob("*.yaml")}
    assert names >= set(PUBLISHED_SIZES) | {"fc_mnist", "gpt2_tiny_ws", "llama_tiny_ws"}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_parse_and_build(path, monkeypatch):
    """Every file in configs/ parses for train_and_eval, and its model, optimizer and
    lr schedule can be built (with the real processors module if it exists)."""
    from weightstream.optim import configure_optimizer
    from weightstream.optim.lr_scheduler import configure_lr_scheduler

    monkeypatch.delitem(sys.modules, PROCESSORS, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        params = parse_params(load_params(path), "train_and_eval")
    model = params.model.build("meta")  # shapes only: the full-size zoo files are GBs
    size = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert size == PUBLISHED_SIZES.get(path.stem, size), (path.name, size)
    optimizer = configure_optimizer(
        params.optimizer.optimizer_type, model.parameters(), **params.optimizer.optimizer_kwargs()
    )
    configure_lr_scheduler(optimizer, params.optimizer.learning_rate)
    assert parse_params(params.to_dict(), "train_and_eval").to_dict() == params.to_dict()


def test_gpt2_tiny_config_values():
    p = parse_params(load_params(CONFIGS / "gpt2_tiny_ws.yaml"), "train")
    assert p.model.config == GPTConfig(
        d_model=128, n_layer=4, n_head=4, seq_len=128, vocab_size=256
    )
    assert p.model.spec.task == "lm"
    assert p.train_input.data_processor == "TextCorpusProcessor"
    assert p.train_input.batch_size == 16
    assert p.train_input.extra == {"seq_len": 128, "vocab_size": 256}
    assert p.optimizer.optimizer_type == "AdamW"
    assert [e["scheduler"] for e in p.optimizer.learning_rate] == ["Linear", "CosineDecay"]
    assert p.optimizer.betas == (0.9, 0.95)
    assert isinstance(p.optimizer.eps, float)
    assert (p.runconfig.max_steps, p.runconfig.checkpoint_steps, p.runconfig.log_steps) == (
        300,
        100,
        25,
    )


def test_fc_mnist_config_values():
    p = parse_params(load_params(CONFIGS / "fc_mnist.yaml"), "train")
    assert p.model.config == FCMNISTConfig(in_features=784, hidden=(256, 128), num_classes=10)
    assert p.train_input.data_processor == "DigitsProcessor"
    assert p.train_input.extra == {"image_size": 28}
    assert p.optimizer.optimizer_type == "SGD"
    assert p.optimizer.momentum == 0.9
    assert p.runconfig.max_steps == 200


def test_typed_values_and_conversions():
    raw = gpt_raw()
    raw["optimizer"].update(weight_decay=0, betas=[0.9, 0.99], eps=1, max_gradient_norm=1)
    p = parse_params(raw, "train")
    assert isinstance(p.train_input.batch_size, int)
    # ints where a float is expected become floats; lists where a pair is expected, tuples
    assert p.optimizer.weight_decay == 0.0 and isinstance(p.optimizer.weight_decay, float)
    assert p.optimizer.betas == (0.9, 0.99)
    assert isinstance(p.optimizer.eps, float) and isinstance(p.optimizer.max_gradient_norm, float)
    assert p.optimizer.learning_rate == 1e-3
    assert p.optimizer.optimizer_kwargs() == {
        "learning_rate": 1e-3,
        "weight_decay": 0.0,
        "betas": (0.9, 0.99),
        "eps": 1.0,
    }


def test_defaults():
    p = parse_params(gpt_raw(), "train")
    rc = p.runconfig
    assert rc.log_steps == 10
    assert rc.checkpoint_steps == 0
    assert rc.max_checkpoints is None
    assert rc.seed == 1
    assert rc.autoload_last_checkpoint is True
    assert rc.num_csx == 1
    assert rc.execution_mode == "weight_streaming"
    assert rc.model_dir == "model_dir"
    assert rc.check_loss_values is True
    assert (rc.compile_only, rc.validate_only, rc.save_initial_checkpoint) == (False,) * 3
    assert p.train_input.shuffle is True and p.eval_input.shuffle is False
    assert p.train_input.num_workers == 0
    assert p.model.mixed_precision is False and p.model.fp16_type == "float16"
    assert p.optimizer.grad_accum_steps == 1
    assert p.optimizer.loss_scaling_factor is None
    assert p.optimizer.grad_scaler_kwargs()["loss_scale"] is None


def test_runconfig_section_may_be_absent_for_eval():
    raw = gpt_raw()
    del raw["runconfig"], raw["optimizer"], raw["train_input"]
    p = parse_params(raw, "eval")
    assert p.optimizer is None and p.train_input is None
    assert p.runconfig == RunConfigParams()


def test_numeric_strings_for_learning_rate_pass_unchanged():
    p = parse_params(with_value("optimizer", "learning_rate", "2e-4"), "train")
    assert p.optimizer.learning_rate == "2e-4"


def test_scheduler_dict_passes_unchanged():
    schedule = {"scheduler": "CosineDecay", "initial_learning_rate": 0.1, "total_iters": 5}
    p = parse_params(with_value("optimizer", "learning_rate", schedule), "train")
    assert p.optimizer.learning_rate == schedule


def test_yaml_exponent_without_dot_is_a_float(tmp_path):
    path = tmp_path / "p.yaml"
    raw = gpt_raw()
    path.write_text(yaml.safe_dump(raw).replace("0.001", "1e-3"))
    assert "learning_rate: 1e-3" in path.read_text()
    assert load_params(path)["optimizer"]["learning_rate"] == 1e-3
    assert parse_params(load_params(path), "train").optimizer.learning_rate == 1e-3


# ---------------------------------------------------------------- model


def test_preset_applies_and_explicit_keys_override_it():
    raw = gpt_raw()
    raw["model"] = {"name": "gpt2", "preset": "small", "n_layer": 2}
    cfg = parse_params(raw, "train").model.config
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.vocab_size, cfg.seq_len) == (
        2,
        768,
        12,
        50257,
        1024,
    )


def test_unknown_model_field_names_section_and_suggestion():
    raw = gpt_raw()
    raw["model"]["n_layers"] = 3
    assert_mentions(parse_error(raw), "model", "'n_layers'", "did you mean 'n_layer'", "d_model")


def test_unknown_preset_suggests_close_name():
    msg = parse_error(with_value("model", "preset", "smal"))
    assert_mentions(msg, "model.preset", "'smal'", "Did you mean 'small'?", "'medium'")


def test_preset_on_model_without_presets():
    raw = gpt_raw()
    raw["model"] = {"name": "fc_mnist", "preset": "small"}
    assert_mentions(parse_error(raw), "model.preset", "'fc_mnist'", "no presets")


def test_unknown_model_name_suggests_close_name():
    assert_mentions(parse_error(with_value("model", "name", "gtp2")), "model.name", "'gpt2'")


def test_model_config_check_is_reported_with_section():
    raw = with_value("model", "n_head", 3)  # 64 is not divisible by 3
    assert_mentions(parse_error(raw), "model (gpt2)", "divisible by n_head", "model section")


def test_model_field_type_checked_against_config_annotation():
    raw = gpt_raw()
    raw["model"] = {"name": "fc_mnist", "hidden": [64, "x"]}
    assert_mentions(parse_error(raw), "model.hidden[1] must be an integer", "str 'x'")


def test_fp16_type_without_mixed_precision_warns():
    with pytest.warns(UserWarning, match="fp16_type is ignored"):
        parse_params(with_value("model", "fp16_type", "bfloat16"), "train")
    raw = with_value("model", "fp16_type", "cbfloat16")
    raw["model"]["mixed_precision"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse_params(raw, "train").model.fp16_type == "cbfloat16"


# ---------------------------------------------------------------- unknown keys


@pytest.mark.parametrize(
    "section, key, suggestion",
    [
        ("train_input", "batch_sise", "batch_size"),
        ("eval_input", "shufle", "shuffle"),
        ("model", "d_modle", "d_model"),
        ("optimizer", "weight_decy", "weight_decay"),
        ("optimizer", "nesterv", "nesterov"),  # constructor argument of the optimizer
        ("runconfig", "max_step", "max_steps"),
        ("runconfig", "checkpoint_step", "checkpoint_steps"),
    ],
)
def test_unknown_key_names_key_section_and_closest_names(section, key, suggestion):
    raw = gpt_raw()
    if suggestion == "nesterov":
        raw["optimizer"]["optimizer_type"] = "SGD"
    raw[section][key] = 1
    msg = parse_error(raw, exc=ValueError)
    assert_mentions(msg, section, f"unknown key(s) '{key}'", f"'{suggestion}'", "Valid keys")


def test_unknown_top_level_section():
    raw = gpt_raw()
    raw["train_inputs"] = raw.pop("train_input")
    msg = parse_error(raw, exc=ValueError)
    assert_mentions(msg, "top level", "'train_inputs'", "did you mean 'train_input'")


@pytest.mark.parametrize("section", ["train_input", "optimizer"])
def test_extra_is_not_a_file_key(section):
    assert_mentions(parse_error(with_value(section, "extra", {})), f"{section}: 'extra'")


def test_optimizer_constructor_arguments_go_to_extra():
    raw = gpt_raw()
    raw["optimizer"] = {"optimizer_type": "SGD", "learning_rate": 0.1, "nesterov": True}
    raw["optimizer"]["momentum"] = 0.9
    p = parse_params(raw, "train")
    assert p.optimizer.extra == {"nesterov": True}
    assert p.optimizer.optimizer_kwargs()["nesterov"] is True


def test_retired_optimizer_alias_names_replacement():
    assert_mentions(
        parse_error(with_value("optimizer", "beta1", 0.9)), "optimizer.beta1", "retired", "betas"
    )


def test_beta1_is_not_retired_for_adafactor():
    raw = gpt_raw()
    raw["optimizer"] = {"optimizer_type": "Adafactor", "learning_rate": 0.01, "beta1": None}
    assert parse_params(raw, "train").optimizer.extra == {"beta1": None}


def test_lr_key_points_to_learning_rate():
    assert_mentions(
        parse_error(with_value("optimizer", "lr", 0.1)), "optimizer.lr", "learning_rate"
    )


def test_unknown_optimizer_type_is_left_to_configure_optimizer():
    raw = gpt_raw()
    raw["optimizer"] = {"optimizer_type": "MyOwnOptimizer", "learning_rate": 0.1, "gamma": 2}
    assert parse_params(raw, "train").optimizer.extra == {"gamma": 2}


def test_processor_keys_checked_when_module_exists(fake_processors):
    parse_params(gpt_raw(), "train")  # seq_len, vocab_size accepted
    raw = with_value("train_input", "seq_length", 16)
    msg = parse_error(raw, exc=ValueError)
    assert_mentions(msg, "train_input", "'seq_length'", "did you mean 'seq_len'")
    raw = with_value("eval_input", "data_processor", "NoSuchProcessor")
    assert_mentions(parse_error(raw), "eval_input.data_processor", "NoSuchProcessor")


def test_processor_keys_of_the_real_module(monkeypatch):
    monkeypatch.delitem(sys.modules, PROCESSORS, raising=False)
    pytest.importorskip(PROCESSORS)
    parse_params(with_value("train_input", "drop_last", False), "train")  # a common key
    msg = parse_error(with_value("train_input", "seq_length", 16), exc=ValueError)
    assert_mentions(msg, "train_input", "'seq_length'", "'seq_len'")
    msg = parse_error(with_value("train_input", "data_processor", "TextCorpusProcesor"))
    assert_mentions(msg, "train_input.data_processor", "'TextCorpusProcessor'")


def test_processor_keys_unchecked_without_module():
    p = parse_params(with_value("train_input", "anything_goes", 3), "train")
    assert p.train_input.extra["anything_goes"] == 3
    # ...except near-misspellings of the loader's own keys
    msg = parse_error(with_value("train_input", "num_worker", 2), exc=ValueError)
    assert_mentions(msg, "train_input", "'num_worker'", "did you mean 'num_workers'")


# ---------------------------------------------------------------- wrong types


@pytest.mark.parametrize(
    "section, key, value, fragments",
    [
        ("train_input", "batch_size", "eight", ["must be an integer", "str 'eight'"]),
        ("train_input", "batch_size", 8.0, ["must be an integer", "float 8.0", "write 8"]),
        ("train_input", "batch_size", True, ["must be an integer", "bool True"]),
        ("eval_input", "shuffle", "yes", ["must be true or false", "str 'yes'"]),
        ("eval_input", "data_dir", 3, ["a string, a list of strings or null", "int 3"]),
        ("train_input", "data_processor", ["a"], ["must be a string", "list"]),
        ("model", "d_model", "128", ["must be an integer", "in quotes"]),
        ("model", "mixed_precision", 1, ["must be true or false", "int 1"]),
        ("model", "dropout", "none", ["must be a number", "str 'none'"]),
        ("optimizer", "weight_decay", True, ["must be a number", "bool True"]),
        ("optimizer", "weight_decay", "0.01", ["in quotes"]),
        ("optimizer", "betas", 0.9, ["a list of 2 numbers", "float 0.9"]),
        ("optimizer", "eps", "1e-8", ["a number, a list of 2 numbers or null", "in quotes"]),
        ("optimizer", "grad_accum_steps", 2.5, ["must be an integer", "float 2.5"]),
        ("optimizer", "learning_rate", True, ["number or a schedule", "bool True"]),
        ("optimizer", "learning_rate", [1, 2], ["learning_rate[0]", "scheduler dict"]),
        ("optimizer", "learning_rate", object, ["number or a schedule"]),
        ("optimizer", "adjust_learning_rate", [1], ["must be a mapping"]),
        ("optimizer", "optimizer_type", 3, ["must be a string", "int 3"]),
        ("runconfig", "max_steps", 10.5, ["must be an integer", "float 10.5"]),
        ("runconfig", "log_steps", True, ["must be an integer", "bool True"]),
        ("runconfig", "checkpoint_path", 5, ["a string or null", "int 5"]),
        ("runconfig", "compile_only", "true", ["must be true or false", "str 'true'"]),
        ("runconfig", "model_dir", None, ["must be a string", "NoneType"]),
    ],
)
def test_wrong_type_is_a_type_error_naming_section_key(section, key, value, fragments):
    msg = parse_error(with_value(section, key, value), exc=TypeError)
    assert_mentions(msg, f"{section}.{key}", *fragments)


@pytest.mark.parametrize(
    "section, key, value, fragments",
    [
        (
            "model",
            "fp16_type",
            "float8",
            ["one of 'float16', 'bfloat16', 'cbfloat16'", "'float16'"],
        ),
        ("runconfig", "execution_mode", "pipelined", ["'weight_streaming'", "'layer_pipelined'"]),
        ("runconfig", "store", "ssd", ["'ram'", "'disk'"]),
        ("runconfig", "store_dir", "/scratch", ["configure the disk store", "set store: disk"]),
        ("runconfig", "host_memory_budget", 2**30, ["runconfig.store is 'ram'", "store: disk"]),
        ("optimizer", "loss_scaling_factor", "dinamic", ["'dynamic'", "str 'dinamic'"]),
        ("optimizer", "learning_rate", "fast", ["not a number", "'fast'"]),
        ("optimizer", "learning_rate", {"total_iters": 5}, ["needs a 'scheduler' key"]),
        ("optimizer", "betas", [0.9], ["a list of 2 numbers", "1 value(s)"]),
        ("model", "dropout", float("nan"), ["finite number", "nan"]),
        ("optimizer", "max_loss_scale", 10**400, ["finite number"]),
    ],
)
def test_bad_value_names_section_key_and_choices(section, key, value, fragments):
    assert_mentions(parse_error(with_value(section, key, value)), f"{section}.{key}", *fragments)


def test_section_that_is_not_a_mapping():
    raw = gpt_raw()
    raw["runconfig"] = [1, 2]
    assert_mentions(parse_error(raw, exc=TypeError), "runconfig must be a mapping", "list")


def test_non_string_key():
    raw = gpt_raw()
    raw["runconfig"][3] = 1
    assert_mentions(parse_error(raw, exc=TypeError), "runconfig: keys must be strings", "int 3")


# ---------------------------------------------------------------- out of range


@pytest.mark.parametrize(
    "section, key, value, fragments",
    [
        ("train_input", "batch_size", 0, [">= 1", "got 0", "Fix"]),
        ("train_input", "batch_size", -4, [">= 1", "got -4"]),
        ("train_input", "num_workers", -1, [">= 0"]),
        ("train_input", "shuffle_seed", -1, [">= 0"]),
        ("train_input", "prefetch_factor", 2, ["num_workers is 0", "set num_workers >= 1"]),
        ("train_input", "persistent_workers", True, ["num_workers is 0"]),
        ("runconfig", "max_steps", -5, [">= 1", "got -5"]),
        ("runconfig", "num_steps", 0, [">= 1"]),
        ("runconfig", "checkpoint_steps", -1, [">= 0"]),
        ("runconfig", "log_steps", 0, [">= 1"]),
        ("runconfig", "num_csx", 0, [">= 1"]),
        ("runconfig", "seed", -1, [">= 0"]),
        ("runconfig", "seed", 2**64, ["< 2**64"]),
        ("runconfig", "model_dir", "", ["empty"]),
        ("optimizer", "weight_decay", -0.1, [">= 0"]),
        ("optimizer", "max_gradient_norm", -1.0, [">= 0"]),
        ("optimizer", "eps", 0, ["> 0"]),
        ("optimizer", "eps", [1e-30, -1e-3], ["> 0"]),
        ("optimizer", "betas", [0.9, 1.0], ["[0, 1)", "betas: [0.9, 0.999]"]),
        ("optimizer", "grad_accum_steps", 0, [">= 1"]),
        ("optimizer", "loss_scaling_factor", -1, ["> 0 or 'dynamic'"]),
        ("optimizer", "learning_rate", -0.1, [">= 0"]),
        ("model", "dropout", 1.5, ["dropout must be in [0, 1)"]),
        ("model", "vocab_size", 0, ["vocab_size must be a positive int"]),
    ],
)
def test_out_of_range_is_a_value_error_with_fix(section, key, value, fragments):
    msg = parse_error(with_value(section, key, value), exc=ValueError)
    assert_mentions(msg, section, key, *fragments)


def test_clip_by_norm_and_by_value_exclude_each_other():
    raw = gpt_raw()
    raw["optimizer"].update(max_gradient_norm=1.0, max_gradient_value=0.5)
    msg = parse_error(raw, exc=ValueError)
    assert_mentions(msg, "max_gradient_norm", "max_gradient_value", "remove one")


def test_num_epochs_and_num_steps_exclude_each_other():
    raw = gpt_raw()
    raw["runconfig"].update(num_epochs=2, num_steps=10)
    assert_mentions(parse_error(raw, exc=ValueError), "num_epochs", "num_steps", "remove one")


def test_compile_only_and_validate_only_exclude_each_other():
    raw = gpt_raw()
    raw["runconfig"].update(compile_only=True, validate_only=True)
    assert_mentions(
        parse_error(raw, exc=ValueError), "compile_only", "validate_only", "at most one"
    )


def test_min_loss_scale_above_max():
    raw = gpt_raw()
    raw["optimizer"].update(loss_scaling_factor="dynamic", min_loss_scale=8, max_loss_scale=2)
    assert_mentions(parse_error(raw, exc=ValueError), "min_loss_scale", "max_loss_scale")


def test_dynamic_loss_scale_settings_ignored_without_dynamic_warn():
    with pytest.warns(UserWarning, match="steps_per_increase only apply to dynamic"):
        parse_params(with_value("optimizer", "steps_per_increase", 100), "train")


def test_steps_per_epoch_without_num_epochs_warns():
    with pytest.warns(UserWarning, match="steps_per_epoch is ignored"):
        parse_params(with_value("runconfig", "steps_per_epoch", 5), "train")


# ---------------------------------------------------------------- modes


@pytest.mark.parametrize(
    "mode, removed",
    [
        ("train", "train_input"),
        ("train", "model"),
        ("train", "optimizer"),
        ("train_and_eval", "eval_input"),
        ("train_and_eval", "optimizer"),
        ("eval", "eval_input"),
        ("eval", "model"),
        ("eval_all", "eval_input"),
    ],
)
def test_missing_section_for_mode(mode, removed):
    raw = gpt_raw()
    del raw[removed]
    msg = parse_error(raw, mode, exc=ValueError)
    assert_mentions(msg, f"mode {mode!r} needs", removed, f"add '{removed}:'")


def test_empty_section_counts_as_missing():
    raw = gpt_raw()
    raw["optimizer"] = None
    assert_mentions(parse_error(raw, exc=ValueError), "needs the section(s) optimizer")


@pytest.mark.parametrize("mode", ["train", "train_and_eval"])
def test_training_needs_a_step_count(mode):
    raw = gpt_raw()
    raw["runconfig"] = {}
    msg = parse_error(raw, mode, exc=ValueError)
    assert_mentions(msg, "max_steps", "num_steps", "num_epochs", "--max_steps")
    for key in ("num_steps", "num_epochs", "max_steps"):
        raw["runconfig"] = {key: 3}
        parse_params(raw, mode)


@pytest.mark.parametrize("mode", ["eval", "eval_all"])
def test_eval_modes_need_neither_optimizer_nor_steps(mode):
    raw = gpt_raw()
    del raw["optimizer"], raw["train_input"], raw["runconfig"]
    assert parse_params(raw, mode).eval_input.batch_size == 4


def test_unknown_mode():
    assert_mentions(parse_error(gpt_raw(), "predict", exc=ValueError), "mode must be one of")


def test_unused_sections_are_still_checked():
    raw = with_value("eval_input", "batch_sise", 3)
    assert_mentions(parse_error(raw, "train", exc=ValueError), "eval_input", "batch_sise")


@pytest.mark.parametrize(
    "section, key, example",
    [
        ("train_input", "batch_size", "batch_size:"),
        ("train_input", "data_processor", "data_processor:"),
        ("model", "name", "name:"),
        ("optimizer", "optimizer_type", "optimizer_type:"),
    ],
)
def test_missing_required_key(section, key, example):
    raw = gpt_raw()
    del raw[section][key]
    assert_mentions(
        parse_error(raw, exc=ValueError), section, f"missing required key {key!r}", example
    )


# ---------------------------------------------------------------- files


def test_missing_file_names_it(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(FileNotFoundError, match=r"nope\.yaml") as info:
        load_params(path)
    assert "does not exist" in str(info.value)


def test_bad_yaml_reports_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  name: gpt2\n  d_model: 64\n   n_head: 4\nrunconfig: {}\n")
    with pytest.raises(ValueError, match="not valid YAML") as info:
        load_params(path)
    assert_mentions(str(info.value), "bad.yaml", "line 4")


def test_unclosed_bracket_reports_where_it_opened(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("optimizer:\n  betas: [0.9, 0.99\nrunconfig:\n  max_steps: 3\n")
    with pytest.raises(ValueError) as info:
        load_params(path)
    assert_mentions(str(info.value), "bad.yaml", "line 3", "started at line 2")


def test_duplicate_key_is_an_error(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("runconfig:\n  max_steps: 3\n  log_steps: 1\n  max_steps: 5\n")
    with pytest.raises(ValueError) as info:
        load_params(path)
    assert_mentions(str(info.value), "dup.yaml", "line 4", "duplicate key 'max_steps'", "line 2")


def test_merge_keys_may_be_overridden(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text(
        "train_input: &inp\n  data_processor: P\n  batch_size: 4\n"
        "eval_input:\n  <<: *inp\n  batch_size: 2\n"
    )
    raw = load_params(path)
    assert raw["eval_input"] == {"data_processor": "P", "batch_size": 2}


@pytest.mark.parametrize(
    "text, exc, fragment",
    [
        ("- a\n- b\n", TypeError, "top level must be a mapping"),
        ("just a string\n", TypeError, "top level must be a mapping"),
        ("", ValueError, "is empty"),
        ("# only a comment\n", ValueError, "is empty"),
    ],
)
def test_top_level_not_a_mapping(tmp_path, text, exc, fragment):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(exc) as info:
        load_params(path)
    assert_mentions(str(info.value), "p.yaml", fragment)


def test_directory_is_not_a_params_file(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        load_params(tmp_path)


def test_unsafe_yaml_tags_are_refused(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("model: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_params(path)


# ---------------------------------------------------------------- round trip


def test_to_dict_round_trips_through_parse_params(tmp_path):
    raw = gpt_raw()
    raw["model"]["preset"] = None
    raw["optimizer"].update(
        learning_rate=[
            {
                "scheduler": "Linear",
                "initial_learning_rate": 0.0,
                "end_learning_rate": 0.1,
                "total_iters": 3,
            },
            {
                "scheduler": "CosineDecay",
                "initial_learning_rate": 0.1,
                "end_learning_rate": 0.0,
                "total_iters": 7,
            },
        ],
        betas=[0.8, 0.9],
        loss_scaling_factor="dynamic",
        steps_per_increase=100,
        amsgrad=True,
    )
    raw["runconfig"].update(checkpoint_steps=5, max_checkpoints=2, execution_mode="layer_pipelined")
    p = parse_params(raw, "train_and_eval")
    d = p.to_dict()
    path = tmp_path / "params.yaml"
    save_params(p, path)
    again = parse_params(load_params(path), "train_and_eval")
    assert again.to_dict() == d
    # every section but model (whose to_dict writes the resolved config) compares equal
    for name in ("train_input", "eval_input", "optimizer", "runconfig"):
        assert getattr(again, name) == getattr(p, name)
    assert again.model.config == p.model.config
    assert d["model"]["tie_embeddings"] is True  # the resolved config is complete
    assert d["optimizer"]["amsgrad"] is True  # extra keys written flat


def test_to_dict_is_plain_yaml():
    d = parse_params(load_params(CONFIGS / "fc_mnist.yaml"), "train").to_dict()
    assert d["model"]["hidden"] == [256, 128]
    assert yaml.safe_load(yaml.safe_dump(d)) == d
    assert set(d) == set(SECTIONS) - {"peft"}  # the one section this file leaves out


def test_dataclasses_check_themselves_when_built_in_python():
    with pytest.raises(TypeError, match=r"eval_input\.batch_size must be an integer"):
        InputParams("P", "8", section="eval_input")
    with pytest.raises(ValueError, match=r"optimizer\.grad_accum_steps must be >= 1"):
        OptimizerParams("SGD", grad_accum_steps=0)
    with pytest.raises(ValueError, match=r"model \(fc_mnist\): unknown key"):
        ModelParams("fc_mnist", fields={"hiden": [3]})
    with pytest.raises(TypeError, match=r"Params\.model must be a ModelParams"):
        Params(model="gpt2")
    params = Params(ModelParams("fc_mnist"), runconfig=RunConfigParams(max_steps=3))
    with pytest.raises(ValueError, match="needs the section"):
        params.check_mode("train")
    params.eval_input = InputParams("DigitsProcessor", 4, section="eval_input")
    params.check_mode("eval")


# ---------------------------------------------------------------- command line


def run_args(*argv: str):
    return build_run_parser().parse_args(list(argv))


def test_parser_defaults():
    args = run_args("cpu", "-p", "x.yaml")
    assert args.target == "CPU" and args.params == "x.yaml" and args.mode == "train"
    for name in ("model_dir", "max_steps", "eval_steps", "checkpoint_path", "compile_dir"):
        assert getattr(args, name) is None
    assert not args.compile_only and not args.validate_only


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["TPU", "-p", "x"], "choose CPU or GPU"),
        (["csx", "-p", "x"], "CSX"),
        (["CPU"], "-p/--params"),
        (["CPU", "-p", "x", "-m", "predict"], "invalid choice: 'predict'"),
        (["CPU", "-p", "x", "--max_steps", "0"], "--max_steps: expected a positive integer"),
        (["CPU", "-p", "x", "--eval_steps", "-3"], "--eval_steps: expected a positive integer"),
        (
            ["CPU", "-p", "x", "--num_csx", "two"],
            "got 'two'",
        ),
        (["CPU", "-p", "x", "--num_workers_per_csx", "-1"], "expected an integer >= 0"),
        (["CPU", "-p", "x", "--compile_only", "--validate_only"], "not allowed with"),
        (["CPU", "-p", "x", "--execution_mode", "pipeline"], "invalid choice: 'pipeline'"),
    ],
)
def test_parser_errors(argv, fragment, capsys):
    with pytest.raises(SystemExit) as info:
        run_args(*argv)
    assert info.value.code == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, key, value",
    [
        (["--max_steps", "7"], "max_steps", 7),
        (["--eval_steps", "3"], "eval_steps", 3),
        (["--checkpoint_path", "ck/checkpoint_5.mdl"], "checkpoint_path", "ck/checkpoint_5.mdl"),
        (["--compile_dir", "cache"], "compile_dir", "cache"),
        (["--num_csx", "2"], "num_csx", 2),
        (["--num_wgt_servers", "4"], "num_wgt_servers", 4),
        (["--num_workers_per_csx", "0"], "num_workers_per_csx", 0),
        (["--execution_mode", "layer_pipelined"], "execution_mode", "layer_pipelined"),
        (["-o", "out"], "model_dir", "out"),
        (["--compile_only"], "compile_only", True),
    ],
)
def test_command_line_overrides_the_file(flags, key, value):
    raw = gpt_raw()
    raw["runconfig"].update(
        max_steps=20,
        eval_steps=9,
        checkpoint_path="file.mdl",
        compile_dir="file_cache",
        num_csx=4,  # shares the batch of 8
        num_wgt_servers=8,
        num_workers_per_csx=5,
        execution_mode="weight_streaming",
        model_dir="file_dir",
        validate_only=True,
    )
    before = copy.deepcopy(raw)
    merged = apply_overrides(raw, run_args("CPU", "-p", "x", *flags))
    assert raw == before  # the caller's dict is not modified
    p = parse_params(merged, "train")
    assert getattr(p.runconfig, key) == value
    # flags not given leave the file's values
    file_values = RunConfigParams.from_dict(before["runconfig"])
    for other in ("max_steps", "num_csx", "model_dir", "checkpoint_path"):
        if other != key:
            assert getattr(p.runconfig, other) == getattr(file_values, other)


def test_compile_only_flag_replaces_validate_only_of_the_file():
    raw = with_value("runconfig", "validate_only", True)
    p = parse_params(apply_overrides(raw, run_args("CPU", "-p", "x", "--compile_only")), "train")
    assert p.runconfig.compile_only and not p.runconfig.validate_only


def test_overrides_create_runconfig_and_supply_steps():
    raw = gpt_raw()
    del raw["runconfig"]
    merged = apply_overrides(raw, run_args("CPU", "-p", "x", "--max_steps", "4"))
    assert parse_params(merged, "train").runconfig.max_steps == 4
    assert apply_overrides(raw, {"max_steps": None}) == raw  # a mapping works too


def test_model_dir_default_file_then_flag():
    raw = gpt_raw()
    assert (
        parse_params(apply_overrides(raw, run_args("CPU", "-p", "x")), "train").runconfig.model_dir
        == "model_dir"
    )
    raw["runconfig"]["model_dir"] = "from_file"
    assert (
        parse_params(apply_overrides(raw, run_args("CPU", "-p", "x")), "train").runconfig.model_dir
        == "from_file"
    )
    args = run_args("CPU", "-p", "x", "-o", "from_flag")
    assert parse_params(apply_overrides(raw, args), "train").runconfig.model_dir == "from_flag"


def test_params_from_args_end_to_end(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(gpt_raw()))
    args = run_args("gpu", "-p", str(path), "-m", "train_and_eval", "--max_steps", "2", "-o", "md")
    p = params_from_args(args)
    assert (p.runconfig.max_steps, p.runconfig.model_dir) == (2, "md")


def test_a_rank_of_torchrun_records_its_world_and_refuses_another_num_csx(tmp_path, monkeypatch):
    """Under torchrun the ranks are WORLD_SIZE: num_csx is recorded so (it said 1), and a
    file or --num_csx naming another number of ranks is refused with both numbers (it
    was accepted and recorded)."""
    raw = gpt_raw()
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("WORLD_SIZE", "2")
    p = params_from_args(run_args("cpu", "-p", str(path), "-m", "train"))
    assert p.runconfig.num_csx == 2
    assert (
        params_from_args(run_args("cpu", "-p", str(path), "--num_csx", "2")).runconfig.num_csx == 2
    )
    with pytest.raises(ValueError, match=r"num_csx is 4 .* one of 2 ranks \(WORLD_SIZE"):
        params_from_args(run_args("cpu", "-p", str(path), "--num_csx", "4"))
    # The batch is checked against the world's ranks.
    raw["train_input"]["batch_size"] = 3
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match=r"train_input\.batch_size"):
        params_from_args(run_args("cpu", "-p", str(path), "-m", "train"))
    monkeypatch.delenv("WORLD_SIZE")
    assert params_from_args(run_args("cpu", "-p", str(path), "-m", "train")).runconfig.num_csx == 1


# ---------------------------------------------------------------- fuzz


def _names(cls) -> list[str]:
    return [f for f in cls.__dataclass_fields__ if f not in ("extra", "config")]


_SECTION_KEYS = {
    "train_input": [*_names(InputParams), "seq_len", "vocab_size"],
    "eval_input": [*_names(InputParams), "seq_len"],
    "model": [*_names(ModelParams), *GPTConfig.__dataclass_fields__, "hidden"],
    "optimizer": [*_names(OptimizerParams), "amsgrad", "nesterov"],
    "runconfig": RunConfigParams.keys(),
    "peft": [*_names(PeftParams), "task_type", "inference_mode"],
}
_NOISE_KEYS = ["bogus", "batch_sise", "beta1", "lr", "optim_params", "extra", "section"]
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-3, max_value=300)
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from(
        ["dynamic", "gpt2", "fc_mnist", "small", "1e-3", "layer_pipelined", "SGD", "bfloat16"]
    )
)
_garbage = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["scheduler", "total_iters", "a", 1]), inner, max_size=3)
    ),
    max_leaves=6,
)
# Mostly a known key of a section set to garbage (so the checks past the first ones
# are reached); sometimes a noise key, a non-string key, a whole section or an
# unknown section.
_known_key_edit = st.sampled_from(SECTIONS).flatmap(
    lambda s: st.tuples(st.just(s), st.sampled_from(_SECTION_KEYS[s]), _garbage, st.just(False))
)
_noise_edit = st.tuples(
    st.sampled_from([*SECTIONS, "other"]),
    st.sampled_from(_NOISE_KEYS) | st.integers(0, 2),
    _garbage,
    st.booleans(),  # replace the whole section instead of one key
)
_edit = st.one_of(_known_key_edit, _known_key_edit, _known_key_edit, _noise_edit)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(_edit, min_size=1, max_size=3),
    mode=st.sampled_from(["train", "eval", "train_and_eval", "eval_all"]),
)
def test_garbage_never_crashes_with_anything_but_type_or_value_error(edits, mode):
    raw = gpt_raw()
    for section, key, value, whole in edits:
        if whole or not isinstance(raw.get(section), dict):
            raw[section] = value if whole else {key: value}
        else:
            raw[section][key] = value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            params = parse_params(raw, mode)
        except (TypeError, ValueError) as e:
            assert str(e)  # every error says something
            return
        # whatever parses writes back a dict that parses to the same settings
        again = parse_params(params.to_dict(), mode)
    assert again.to_dict() == params.to_dict()


# ---------------------------------------------------------------- one schema


def test_runconfig_streaming_keys_are_the_engines_streaming_config():
    raw = gpt_raw()
    raw["runconfig"].update(prefetch_depth=2, granularity="module", store="disk", num_csx=1)
    rc = parse_params(raw, "train").runconfig
    assert isinstance(rc.streaming, StreamingConfig)
    assert (rc.streaming.prefetch_depth, rc.streaming.granularity) == (2, "module")
    assert rc.prefetch_depth == 2 and rc.store == "disk"  # runconfig.<key> reads it
    # Written back flat, as the file had it, and read back to the same settings.
    again = parse_params(parse_params(raw, "train").to_dict(), "train").runconfig
    assert again == rc and "streaming" not in parse_params(raw, "train").to_dict()["runconfig"]
    # Settings the run derives itself are not params keys.
    for key in ("compute_dtype", "init_weights", "data_parallel", "unit_classes"):
        assert_mentions(parse_error(with_value("runconfig", key, None)), "unknown key", key)


def test_one_name_per_setting_with_documented_aliases():
    raw = with_value("runconfig", "max_wgt_servers", 4)
    assert parse_params(raw, "train").runconfig.streaming.num_wgt_servers == 4
    assert "num_wgt_servers: 4" in yaml.safe_dump(parse_params(raw, "train").to_dict())
    raw["runconfig"]["num_wgt_servers"] = 8
    assert_mentions(parse_error(raw), "'max_wgt_servers'", "'num_wgt_servers'", "keep one")
    assert StreamingConfig.from_kwargs(weight_servers=3).num_wgt_servers == 3
    with pytest.raises(ValueError, match=r"'prefetch_dept' \(did you mean 'prefetch_depth'"):
        StreamingConfig.from_kwargs(prefetch_dept=2)


def test_eval_frequency_is_taken_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        params = parse_params(with_value("runconfig", "eval_frequency", 5), "train_and_eval")
    assert params.runconfig.eval_frequency == 5


@pytest.mark.parametrize(
    ("given", "hint"),
    [("2GB", "2000000000"), ("1.5GiB", "1610612736"), ("64 MiB", "67108864"), ("10", None)],
)
def test_a_byte_count_written_with_its_unit_gets_the_number(given, hint):
    """host_memory_budget: 2GB (a trial's first try): the error gives the bytes to write."""
    with pytest.raises(TypeError, match=r"host_memory_budget must be an integer or null") as e:
        StreamingConfig.from_kwargs(store="disk", host_memory_budget=given)
    if hint is None:
        assert "without quotes" in str(e.value)
    else:
        assert f"(bytes as a number: write {hint})" in str(e.value)
