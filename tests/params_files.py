"""Params files for the tests that drive the run command: a tiny GPT-2 (or FC-MNIST) on
the byte-level text corpus (or the digits), built section by section.

Each test states what matters to it (sizes, dropout, optimizer, schedule, runconfig) and
takes the rest from here, so the sections keep one spelling of the reference's key names
and a change of that schema is made once. ``yaml.safe_dump`` sorts the keys, so the
file does not depend on the order in which a test assembles its sections.
"""

from __future__ import annotations

from pathlib import Path

import yaml

VOCAB = 256  # the byte-level corpus: one token per byte


def text_input(batch_size: int, seq_len: int, **extra) -> dict:
    """A train_input / eval_input section of the byte-level text corpus."""
    return {
        "data_processor": "TextCorpusProcessor",
        "batch_size": batch_size,
        "seq_len": seq_len,
        "vocab_size": VOCAB,
        **extra,
    }


def gpt2(n_layer: int, d_model: int, seq_len: int, n_head: int = 2, **extra) -> dict:
    """A model section of the zoo's GPT-2 over the byte vocabulary."""
    return {
        "name": "gpt2",
        "n_layer": n_layer,
        "d_model": d_model,
        "n_head": n_head,
        "seq_len": seq_len,
        "vocab_size": VOCAB,
        **extra,
    }


def warmup_cosine(peak: float, warmup: int, decay: int, end: float = 1e-4) -> list[dict]:
    """A learning_rate schedule: linear from 0 to ``peak`` over ``warmup`` steps, then a
    cosine decay to ``end`` over ``decay`` steps."""
    return [
        {
            "scheduler": "Linear",
            "initial_learning_rate": 0.0,
            "end_learning_rate": peak,
            "total_iters": warmup,
        },
        {
            "scheduler": "CosineDecay",
            "initial_learning_rate": peak,
            "end_learning_rate": end,
            "total_iters": decay,
        },
    ]


def adamw(learning_rate, **extra) -> dict:
    """An optimizer section of AdamW (``learning_rate``: a number or a schedule)."""
    return {"optimizer_type": "AdamW", "learning_rate": learning_rate, **extra}


def params(
    train_input: dict,
    model: dict,
    optimizer: dict,
    runconfig: dict,
    eval_input: dict | None = None,
) -> dict:
    """The sections of one params file (``eval_input`` only when given)."""
    out = {"train_input": train_input, "model": model, "optimizer": optimizer}
    if eval_input is not None:
        out["eval_input"] = eval_input
    out["runconfig"] = runconfig
    return out


def write(path: Path, sections: dict) -> Path:
    """Write ``sections`` (see :func:`params`) as YAML to ``path``; returns ``path``."""
    path.write_text(yaml.safe_dump(sections))
    return path


def train_tiny_gpt2(out: Path, optimizer: dict, runconfig: dict) -> list[float]:
    """Train a 2-block GPT-2 (d_model 32, seq 32, batch 4) on the text corpus with the
    run command into ``out`` (its params file beside it); the losses it logged to
    TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from weightstream.cli.main import main

    section = text_input(4, 32)
    path = write(
        out.with_suffix(".yaml"),
        params(
            train_input={**section, "shuffle_seed": 3},
            eval_input=section,
            model=gpt2(2, 32, 32),
            optimizer=optimizer,
            runconfig={"seed": 7, **runconfig},
        ),
    )
    assert main(["run", "CPU", "-p", str(path), "-m", "train", "-o", str(out)]) == 0
    acc = EventAccumulator(str(out / "train"))
    acc.Reload()
    return [e.value for e in acc.Scalars("loss")]
