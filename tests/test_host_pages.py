"""Large host tensors on transparent huge pages (Note [huge pages for host tensors] in
weightstream/__init__.py): the kernel's own page-fault count, in fresh processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# Imports weightstream, then makes and fills four 64 MiB tensors one after the
# other (each a new mapping: over glibc's largest mmap threshold, 32 MiB), counting
# minor page faults.
CHILD = """
import json, os, resource
import weightstream
import torch
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    t = torch.ones(16 * 2**20)
    del t
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"faults": faults, "env": os.environ.get("THP_MEM_ALLOC_ENABLE")}))
"""


def _child(env_value: str | None) -> dict:
    env = dict(os.environ)
    env.pop("THP_MEM_ALLOC_ENABLE", None)
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # 8 s on 2 cores: processes of their own, with the slow tests
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's transparent huge pages")
def test_large_host_tensors_fault_in_huge_pages_unless_the_user_says_otherwise():
    default = _child(None)
    assert default["env"] == "1"  # set by importing weightstream
    kept = _child("0")
    assert kept["env"] == "0"  # the user's value is kept
    # 256 MiB of 4 KiB pages: 65,536 faults without huge pages.
    assert kept["faults"] >= 65_536
    if not THP_MODE.exists() or "[never]" in THP_MODE.read_text():
        pytest.skip("this kernel gives no transparent huge pages")
    # 2 MiB pages: 128 faults for the tensors; the kernel may fall back to small
    # pages where it finds no free 2 MiB block, so the bound is loose.
    assert default["faults"] < kept["faults"] / 4, (default, kept)
