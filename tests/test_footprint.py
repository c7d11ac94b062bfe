"""The training state's host bytes and where they go, as ``--validate_only`` reports them
(Note [host footprint] in runtime/footprint.py): counted on the meta device, checked
against what a real run's store allocates and against the arithmetic of each setting."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import params_files as pf
import pytest
import torch
import torch.nn.functional as F

import weightstream as cstorch
from weightstream.cli.main import main
from weightstream.models.llama import Llama, LlamaConfig
from weightstream.optim.compact import BLOCK
from weightstream.runtime import budgets, footprint, placement

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TINY = dict(n_layer=2, d_model=32, n_head=4, d_ff=64, vocab_size=256, seq_len=32)


@pytest.fixture(autouse=True)
def _quiet_logs():
    logging.getLogger("weightstream").handlers.clear()
    yield
    logging.getLogger("weightstream").handlers.clear()


def _meta_llama(master_dtype: torch.dtype) -> Llama:
    with torch.device("meta"):
        return Llama(LlamaConfig(**TINY)).to(master_dtype)


def _expected(model: torch.nn.Module, master: int, state_dtype: str) -> dict[str, int]:
    """The bytes of each kind written out: masters and gradients of ``master`` bytes,
    AdamW's two moments (int8: a code each and a float32 scale per BLOCK values), a
    Kahan buffer for bf16 masters, and one float32 step count per tensor."""
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    steps = 4 * len(params)
    if state_dtype == "int8":
        scales = 2 * 4 * sum(math.ceil(p.numel() / BLOCK) for p in params)
        state = 2 * n + scales + steps
    else:
        state = 2 * {"float32": 4, "bfloat16": 2}[state_dtype] * n + steps
    if master == 2:
        state += 2 * n  # kahan_comp
    return {"master": master * n, "state": state, "grad": master * n, "mirror": 0}


@pytest.mark.parametrize(
    "master_dtype, state_dtype",
    [(torch.float32, "float32"), (torch.bfloat16, "int8"), (torch.bfloat16, "bfloat16")],
)
def test_count_is_what_a_real_runs_store_allocates(tmp_path, master_dtype, state_dtype):
    # A disk store counts every master, gradient and state tensor it creates
    # (placement's ``actual``): the real allocation, after a real step.
    torch.manual_seed(0)
    model = _meta_llama(master_dtype)
    runner = cstorch.compile(
        model, backend="wse_ws", store="disk", store_dir=str(tmp_path), device="cpu"
    )
    opt = cstorch.optim.AdamW(model.parameters(), lr=1e-3, state_dtype=state_dtype)
    x = torch.randint(0, 256, (2, 16))
    F.cross_entropy(runner(x).flatten(0, 1).float(), x.flatten()).backward()
    opt.step()
    store = runner.engine.store.placement()
    real = {k: store.ram.get(k, 0) + store.disk.get(k, 0) for k in ("master", "state", "grad")}
    # The step counts are ordinary 0-dim tensors beside the store's.
    real["state"] += sum(t.nbytes for st in opt.state.values() for t in st.values() if t.dim() == 0)

    # The footprint of the same run, counted on a meta model and optimizer.
    shapes = _meta_llama(master_dtype)
    meta_opt = cstorch.optim.AdamW(shapes.parameters(), lr=1e-3, state_dtype=state_dtype)
    found = footprint.host_footprint(
        shapes, meta_opt, runner.engine.plan, runner.engine.config, torch.device("cpu")
    )
    runner.close()
    assert {k: found.bytes[k] for k in real} == real
    assert found.bytes == _expected(shapes, master_dtype.itemsize, state_dtype)


@pytest.mark.parametrize("from_state", ["float32", "bfloat16"])
def test_the_compact_fix_projects_what_compact_state_counts(from_state):
    """The fix's "about N bytes" for float32 masters is what the count gives the same
    model with bf16 masters and int8 AdamW state (the fix's settings), byte for byte."""
    runner = cstorch.compile(_meta_llama(torch.float32), backend="wse_ws", granularity="module")
    plan, config = runner.engine.plan, runner.engine.config
    wide = _meta_llama(torch.float32)
    opt = cstorch.optim.AdamW(wide.parameters(), lr=1e-3, state_dtype=from_state)
    found = footprint.host_footprint(wide, opt, plan, config, torch.device("cpu"))
    compact = _meta_llama(torch.bfloat16)
    opt8 = cstorch.optim.AdamW(compact.parameters(), lr=1e-3, state_dtype="int8")
    counted = footprint.host_footprint(compact, opt8, plan, config, torch.device("cpu"))
    assert found.compact and counted.compact == []
    assert found.compact_total == counted.total == sum(_expected(compact, 2, "int8").values())


def _validate(tmp_path: Path, capsys, caplog, params: Path, *args: str) -> str:
    caplog.set_level(logging.INFO, "weightstream")
    out = tmp_path / params.stem
    assert main(["run", "CPU", "-p", str(params), "-o", str(out), "--validate_only", *args]) == 0
    text = capsys.readouterr().out + caplog.text  # the run's handler, or pytest's
    caplog.clear()
    assert not (out / "store").exists()  # shapes only: nothing allocated
    return text


def _tiny_params(
    tmp_path: Path, optimizer: dict | None = None, name: str = "params", **runconfig
) -> Path:
    section = pf.text_input(2, 32)
    return pf.write(
        tmp_path / f"{name}.yaml",
        pf.params(
            train_input=section,
            model={"name": "llama", **TINY},
            optimizer=pf.adamw(1e-3, **(optimizer or {})),
            runconfig={"max_steps": 1, **runconfig},
        ),
    )


def _report(text: str) -> tuple[float, int, str]:
    per, total = re.search(
        r"Host training state: ([\d.]+) bytes a parameter .* \(([\d,]+) bytes\)", text
    ).groups()
    where = re.search(r"The state goes to: (RAM \+ disk|RAM|neither)", text).group(1)
    return float(per), int(total.replace(",", "")), where


def test_validate_only_prints_bytes_per_parameter_and_the_verdict(tmp_path, capsys, caplog):
    text = _validate(tmp_path, capsys, caplog, _tiny_params(tmp_path))
    per, total, where = _report(text)
    model = _meta_llama(torch.float32)
    n = sum(p.numel() for p in model.parameters())
    # fp32 AdamW on the CPU: masters 4 + moments 8 + gradients 4 (no host mirror).
    assert total == sum(_expected(model, 4, "float32").values())
    assert per == pytest.approx(total / n, rel=1e-3) and round(per) == 16
    assert "(masters 4 + optimizer state 8" in text and "gradients 4)" in text
    assert where == "RAM"  # 0.3 MB
    assert "Host: RAM" in text

    # int8 moments and bf16 masters: 2 + (2 codes + scales + 2 Kahan) + 2.
    compact = _tiny_params(
        tmp_path, optimizer={"state_dtype": "int8"}, name="compact", master_dtype="bfloat16"
    )
    text8 = _validate(tmp_path, capsys, caplog, compact)
    per8, total8, _ = _report(text8)
    assert total8 == sum(_expected(model, 2, "int8").values())
    # the plan's Training state line counts the same optimizer's state, not fp32 moments
    from weightstream.common.units import format_bytes

    state = format_bytes(_expected(model, 2, "int8")["state"])
    assert re.search(rf"Training state: .*host: .*optimizer state {re.escape(state)}\)", text8)
    assert 8 < per8 < 8.1 and total8 < total / 1.9


def test_a_ram_store_that_does_not_fit_names_the_fixes(tmp_path, capsys, caplog, monkeypatch):
    monkeypatch.setattr(placement, "default_budget", lambda: 1000)
    monkeypatch.setattr(budgets, "default_budget", lambda: 1000)
    text = _validate(tmp_path, capsys, caplog, _tiny_params(tmp_path))
    assert _report(text)[2] == "neither"
    assert re.search(r"WARNING .*Host training state", text)  # not the INFO of a fit
    assert "validate_only: done without training. The model compiles, but its training" in text
    fix = text.split("Fix: ")[1]
    for setting in ("state_dtype: int8", "master_dtype: bfloat16", "runconfig.store: disk"):
        assert setting in fix, fix
    assert "its files 578.6 KiB" in fix  # all of it: the budget holds none
    assert re.search(r"under runconfig.store_dir, where [\d.]+ [KMGT]iB is free\)", fix)
    # bf16 masters, gradients and Kahan buffer, int8 moments: about 8 bytes a parameter,
    # still more than the budget of 1000 bytes; the disk store, which fits, comes first.
    assert "still more than the budget of 1000 B" in fix, fix
    assert fix.index("a disk store") < fix.index("compact state")
    assert "(a RAM store: it exceeds the budget, and there is no disk tier)" in text
    assert "does not fit this host's RAM budget (a RAM store)" in text


@pytest.mark.parametrize("free, where", [(0, "neither"), (2**50, "RAM + disk")])
def test_a_disk_store_splits_the_state_between_ram_and_the_free_disk(
    tmp_path, capsys, caplog, monkeypatch, free, where
):
    monkeypatch.setattr(footprint, "_free_disk", lambda _dir: free)
    params = _tiny_params(tmp_path, store="disk", host_memory_budget=700_000)  # room for part of it
    text = _validate(tmp_path, capsys, caplog, params)
    _, total, got = _report(text)
    assert got == where
    ram, disk = (
        int(v.replace(",", ""))
        for v in re.search(r"\(RAM .*?, ([\d,]+) bytes; disk .*?, ([\d,]+) bytes\)", text).groups()
    )
    assert ram + disk == total and ram > 0 and disk > 0
    assert ("store_dir on a disk with" in text) == (where == "neither")
    # the budget set below the default: raising it moves state from the disk to RAM
    assert ("a larger runconfig.host_memory_budget (without one: " in text) == (where == "neither")


def test_llama2_13b_and_20b_on_this_machine(tmp_path, capsys, caplog):
    """The full-size files, on the meta device: 13B's fp32 state (16 bytes a parameter,
    208 GB) and 20B's compact state (about 8) against this machine's RAM and disk."""
    n13 = 13_015_864_320
    text = _validate(tmp_path, capsys, caplog, CONFIGS / "llama2_13b.yaml")
    per, total, where = _report(text)
    assert f"x {n13:,} parameters" in text and round(per, 3) == 16
    if total > (placement.total_memory() or 0):  # more than this machine's RAM
        assert where in ("neither", "RAM + disk")
    assert ("Fix: " in text) == (where == "neither")
    if where == "neither":
        # Each fix says what it would take, checked against this machine: compact state
        # alone is about 8 bytes a parameter, 97.4 GiB, whose disk part is compared with
        # the free disk like the store's.
        fix = text.split("Fix: ")[1]
        assert "compact state: " in fix and "(about 8.03 bytes a parameter, 97.4 GiB: " in fix
    text = _validate(tmp_path, capsys, caplog, CONFIGS / "llama_20b.yaml")
    per20, _, _ = _report(text)
    assert f"x {20_228_933_120:,} parameters" in text and 8 < per20 < 8.1


@pytest.mark.parametrize("mode", ["--validate_only", "--compile_only"])
def test_shapes_only_runs_refuse_a_host_budget_training_would_refuse(tmp_path, mode):
    """The plan is made in RAM, as shapes; the disk store's budget is checked all the same,
    as the training run of the same file checks it before its first step."""
    params = _tiny_params(tmp_path, store="disk", host_memory_budget=1000)
    out = tmp_path / "m"
    assert main(["run", "CPU", "-p", str(params), "-o", str(out), mode]) != 0
    assert main(["run", "CPU", "-p", str(params), "-o", str(tmp_path / "t")]) != 0
    assert not (out / "train").exists()


@pytest.mark.parametrize("mode", ["--validate_only", "--compile_only"])
def test_shapes_only_runs_refuse_a_store_dir_training_could_not_write(tmp_path, mode, caplog):
    """A store_dir through a file: validate says what the training run would meet at
    its first store file, instead of "The state goes to: RAM + disk" and exit 0."""
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory")
    params = _tiny_params(tmp_path, store="disk", store_dir=str(blocker / "store"))
    logger = logging.getLogger("weightstream")
    logger.addHandler(caplog.handler)
    try:
        assert main(["run", "CPU", "-p", str(params), "-o", str(tmp_path / "m"), mode]) == 2
    finally:
        logger.removeHandler(caplog.handler)
    assert f"{blocker} is a file, so the disk store cannot make its directory" in caplog.text
    assert main(["run", "CPU", "-p", str(params), "-o", str(tmp_path / "t")]) == 2


def test_layer_pipelined_validation_counts_the_resident_state_and_warns_past_memory(
    tmp_path, capsys, caplog, monkeypatch
):
    """Layer pipelined keeps masters, gradients and optimizer state on the device (the
    host's memory on the CPU): validate_only counts them and warns where they do not fit
    (it said "Validation passed" for a 100 GiB 7B on a 23 GiB host)."""
    params = _tiny_params(tmp_path, execution_mode="layer_pipelined")
    model = _meta_llama(torch.float32)
    want = sum(_expected(model, 4, "float32").values())
    n = sum(p.numel() for p in model.parameters())
    text = _validate(tmp_path, capsys, caplog, params)
    line = re.search(r"INFO .*Training state \(layer pipelined, all on cpu\): .*", text).group(0)
    assert f"({want / n:.1f} bytes a parameter" in line and "fits this host's available RAM" in line
    monkeypatch.setattr(placement, "available_memory", lambda: want - 1)
    text = _validate(tmp_path, capsys, caplog, params)
    assert re.search(r"WARNING .*Training state \(layer pipelined.*more than this host's", text)
    assert "execution_mode: weight_streaming" in text.split("Fix: ")[1]
    assert "does not fit cpu's memory (layer pipelined)" in text


def test_a_device_tier_is_out_of_the_disk_stores_predicted_placement(tmp_path):
    """validate_only predicted the disk store's files as if no unit were in the device
    tier (a trial: 33.5 MiB predicted, 32.0 MiB in the files; with the tier's units left
    out, 32.0 MiB). The store places the masters before the tier takes its units, and
    the RAM their masters took stays unused, which the prediction does not copy: here it
    is 33 KB short of the files (the tier left in, 99 KB over), with the same total."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(LlamaConfig(**{**TINY, "n_layer": 4}))
    runner = cstorch.compile(
        model, backend="wse_ws", store="disk", store_dir=str(tmp_path), device="cpu",
        host_memory_budget=500_000, device_tier_budget=150_000,
    )  # fmt: skip
    opt = cstorch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 16))
    F.cross_entropy(runner(x).flatten(0, 1).float(), x.flatten()).backward()
    opt.step()
    engine = runner.engine
    assert engine.resident  # some units in the tier, the rest streamed from RAM and files
    actual = engine.store.placement()
    place = [engine.plan, engine.config, torch.device("cpu"), str(tmp_path)]
    found = footprint.host_footprint(model, opt, *place, device_tier=engine.resident)
    old = footprint.host_footprint(model, opt, *place)
    runner.close()
    files = sum(actual.disk.values())
    assert files > 0
    assert abs(found.placement.disk_bytes - files) < abs(old.placement.disk_bytes - files) / 2
    assert found.total == old.total  # the tier's bytes are host memory on the CPU
