"""Capture and restore every random number generator a training run draws from.

A resumed run continues exactly as if it had never stopped only if Python's
``random``, NumPy's global generator and torch's CPU (and accelerator)
generators all continue where they were; the states are stored in the trainer
checkpoint as tensors and plain Python values.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def capture_rng_state() -> dict:
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state = {
        "python": {
            "version": py_version,
            "state": torch.tensor(py_state, dtype=torch.int64),
            "gauss": py_gauss,
        },
        "numpy": {
            "name": np_name,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def restore_rng_state(state) -> None:
    """Restore what :func:`capture_rng_state` returned (from a checkpoint mapping)."""
    try:
        py = state["python"]
        random.setstate(
            (int(py["version"]), tuple(int(v) for v in _tensor(py["state"]).tolist()), py["gauss"])
        )
        nps = state["numpy"]
        np.random.set_state(
            (
                str(nps["name"]),
                _tensor(nps["keys"]).numpy().astype(np.uint32),
                int(nps["pos"]),
                int(nps["has_gauss"]),
                float(nps["gauss"]),
            )
        )
        torch.set_rng_state(_tensor(state["torch"]).to(torch.uint8))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(_tensor(state["cuda"]).to(torch.uint8)))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(
            f"the checkpoint's random number generator state is malformed ({exc}); the run cannot "
            "resume exactly. Resume from another checkpoint."
        ) from exc


def _tensor(value) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
