"""``weightstream input-analyzer``: the measured table and the recommendation logic.

The recommendation is a pure function of a throughput table and the model's
consumption, checked on hand-made tables; the command itself runs on
configs/fc_mnist.yaml with 0 and 1 workers and a few batches.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from weightstream.cli.input_analyzer import (
    Recommendation,
    format_table,
    keeps_up,
    main,
    recommend_workers,
)
from weightstream.data.throughput import measure_input, section_with_workers

ROOT = Path(__file__).resolve().parent.parent
FC_MNIST = ROOT / "configs" / "fc_mnist.yaml"


# ---- the recommendation (pure) ---------------------------------------------------------


def test_smallest_worker_count_with_the_margin_is_recommended():
    # The model consumes 1000 samples/sec; workers need >= 1.2 x 1000 = 1200.
    table = {0: 2000.0, 1: 1100.0, 2: 1250.0, 3: 2400.0}
    rec = recommend_workers(table, consumption=1000.0, margin=0.2)
    # 0 workers: a batch would cost 1000/2000 = 50% of the step (> 10%): no.
    # 1 worker: 1100 < 1200: no. 2 workers: 1250 >= 1200: yes (3 is not needed).
    assert rec == Recommendation(2, True, rec.reason)
    assert "1.25 x" in rec.reason and "at least 1.20 x" in rec.reason


def test_no_workers_when_the_input_is_a_small_part_of_the_step():
    # 1000 / 20000 = 5% of the step: serial input is fine, workers are not needed.
    rec = recommend_workers({0: 20000.0, 1: 30000.0}, consumption=1000.0)
    assert (rec.num_workers, rec.keeps_up) == (0, True)
    assert "5%" in rec.reason
    # Exactly at the bound (10%) still keeps up; above it does not.
    assert keeps_up(0, 10000.0, 1000.0)
    assert not keeps_up(0, 9999.0, 1000.0)
    assert keeps_up(1, 1200.0, 1000.0, margin=0.2)
    assert not keeps_up(1, 1199.0, 1000.0, margin=0.2)


def test_the_fastest_is_recommended_with_a_warning_when_none_keeps_up():
    rec = recommend_workers({0: 500.0, 1: 800.0, 2: 900.0, 3: 900.0}, consumption=1000.0)
    # 2 and 3 tie: the smaller count wins.
    assert (rec.num_workers, rec.keeps_up) == (2, False)
    assert "no worker count up to 3 keeps up" in rec.reason and "--max_workers" in rec.reason
    serial = recommend_workers({0: 5000.0, 1: 900.0}, consumption=1000.0)
    assert (serial.num_workers, serial.keeps_up) == (0, False)
    assert "20% of the model's step" in serial.reason


def test_recommendation_rejects_empty_tables_and_no_consumption():
    with pytest.raises(ValueError, match="at least one"):
        recommend_workers({}, 1.0)
    with pytest.raises(ValueError, match="consumption"):
        recommend_workers({0: 1.0}, 0.0)


def test_table_lists_every_worker_count_against_the_model():
    rows = [
        {"num_workers": 0, "samples_per_sec": 500.0, "batches_per_sec": 7.8, "startup_s": 0.1},
        {"num_workers": 1, "samples_per_sec": 1500.0, "batches_per_sec": 23.4, "startup_s": 0.5},
    ]
    lines = format_table(rows, consumption=1000.0, margin=0.2).splitlines()
    assert lines[0].split() == [
        "num_workers",
        "samples/sec",
        "batches/sec",
        "startup",
        "s",
        "x",
        "model",
        "keeps",
        "up",
    ]
    assert lines[2].split() == ["0", "500.0", "7.8", "0.10", "0.50", "no"]
    assert lines[3].split() == ["1", "1500.0", "23.4", "0.50", "1.50", "yes"]


# ---- the measurement and the command --------------------------------------------------------


def test_measure_input_times_the_processor_loader():
    section = {"data_processor": "DigitsProcessor", "batch_size": 16, "image_size": 28}
    m = measure_input(section, True, num_workers=0, steps=3)
    assert (m.num_workers, m.batches, m.samples) == (0, 3, 48)
    assert m.seconds > 0 and m.samples_per_sec == pytest.approx(48 / m.seconds)
    assert section_with_workers({**section, "prefetch_factor": 2}, 0).get("prefetch_factor") is None
    with pytest.raises(ValueError, match="steps"):
        measure_input(section, True, steps=0)


def test_input_analyzer_on_fc_mnist(capsys):
    assert main(["-p", str(FC_MNIST), "--max_workers", "1", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    consumption = float(re.search(r"estimated consumption: ([\d.]+) samples/sec", out)[1])
    assert consumption > 0
    assert "model: fc_mnist (weight_streaming), batch size 64" in out
    rows = re.findall(
        r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(yes|no)$", out, re.M
    )
    assert [int(r[0]) for r in rows] == [0, 1]  # one row per worker count
    for workers, rate, _, _, ratio, ok in rows:
        # the "x model" column is the throughput over the consumption (both printed
        # rounded: compared to 1%)
        assert float(ratio) == pytest.approx(float(rate) / consumption, rel=0.01, abs=0.006)
        assert (ok == "yes") == keeps_up(int(workers), float(rate), consumption)
    # The recommendation is the pure function's on the printed table.
    rec = recommend_workers({int(r[0]): float(r[1]) for r in rows}, consumption)
    assert f"recommended input workers: {rec.num_workers}" in out
    assert f"set train_input.num_workers: {rec.num_workers} in" in out
    assert f"train_input.num_workers: {rec.num_workers}" in out
    assert ("warning:" in out) == (not rec.keeps_up)


def test_input_analyzer_reports_bad_arguments(capsys, tmp_path):
    assert main(["-p", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["-p", str(FC_MNIST), "--max_workers", "-1"]) == 2
    assert "--max_workers" in capsys.readouterr().err
