"""configure(): the seed's arguments, typed and validated, once per process."""

from __future__ import annotations

import pytest

import weightstream as cstorch
from weightstream.config import RunConfig
from weightstream.context import current_config


def test_defaults_are_the_seeds():
    cfg = current_config()
    assert cfg == RunConfig()
    assert (cfg.model_dir, cfg.compile_only, cfg.validate_only, cfg.checkpoint_steps) == (
        "./",
        False,
        False,
        0,
    )
    assert (cfg.num_csx, cfg.max_wgt_servers, cfg.transfer_processes) == (1, 24, 5)
    assert (cfg.num_workers_per_csx, cfg.max_act_per_csx) == (1, 1)
    assert cfg.mount_dirs is None and cfg.python_paths is None and cfg.job_labels is None


def test_configure_sets_every_seed_argument_and_keeps_cluster_addresses(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # one of 2 ranks (torchrun's environment)
    cfg = cstorch.configure(
        model_dir="out",
        compile_dir="cc",
        compile_only=True,
        validate_only=False,
        checkpoint_steps=10,
        num_csx=2,
        max_wgt_servers=4,
        mount_dirs=["/data"],
        python_paths=["/src"],
        transfer_processes=3,
        num_workers_per_csx=2,
        job_labels=["team=ml"],
        max_act_per_csx=2,
        mgmt_address="localhost:9000",
    )
    assert current_config() is cfg
    assert cfg.checkpoint_steps == 10 and cfg.num_csx == 2 and cfg.job_labels == ["team=ml"]
    assert cfg.extra == {"mgmt_address": "localhost:9000"}


def test_num_csx_in_a_single_process_warns_how_to_start_the_ranks(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.warns(UserWarning, match=r"one of 1 rank\(s\).*weightstream launch --num_csx 2"):
        cstorch.configure(num_csx=2)


def test_second_call_is_an_error():
    cstorch.configure()
    with pytest.raises(RuntimeError, match="only once"):
        cstorch.configure(checkpoint_steps=5)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"checkpoint_steps": -1}, ValueError, "checkpoint_steps must be >= 0"),
        ({"checkpoint_steps": 1.5}, TypeError, "checkpoint_steps must be an int"),
        ({"num_csx": 0}, ValueError, "num_csx must be >= 1"),
        ({"compile_only": "yes"}, TypeError, "compile_only must be true or false"),
        ({"compile_only": True, "validate_only": True}, ValueError, "mutually exclusive"),
        ({"job_labels": ["nokey"]}, ValueError, "key=value"),
        ({"mount_dirs": "/data"}, TypeError, "list of strings"),
        ({"checkpoint_step": 5}, TypeError, "did you mean checkpoint_steps"),
        # A streaming option given to configure: the error points to compile.
        ({"update_in_backward": True}, TypeError, r"keywords of cstorch\.compile\(model"),
    ],
)
def test_bad_arguments_name_the_key_and_the_fix(kwargs, error, message):
    with pytest.raises(error, match=message):
        cstorch.configure(**kwargs)
    assert current_config() == RunConfig()  # nothing was set
