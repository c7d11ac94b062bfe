"""Arrow stream files written and read a batch at a time (data/arrow_files.py).

Pins Note [arrow file pages]: pages of a mapped file read and then given back leave
the resident set (RssFile, Linux), and a file is in place only once complete.
"""

from __future__ import annotations

import hashlib
import os
import sys

import numpy as np
import pyarrow as pa
import pytest

from weightstream.data.arrow_files import ArrowStreamWriter, MappedFile, content_digest

SCHEMA = pa.schema([("x", pa.large_list(pa.int32())), ("n", pa.int64())])


def _batch(i: int, rows: int = 4, width: int = 1000) -> pa.RecordBatch:
    values = np.arange(rows * width, dtype=np.int32) + i
    offsets = np.arange(0, rows * width + 1, width, dtype=np.int64)
    x = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))
    return pa.record_batch([x, pa.array(np.full(rows, i, np.int64))], schema=SCHEMA)


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_a_written_file_reads_back_and_datasets_reads_it(tmp_path):
    path = tmp_path / "f.arrow"
    with ArrowStreamWriter(path, SCHEMA) as writer:
        for i in range(3):
            writer.write(_batch(i))
        assert not path.exists()  # under a temporary name until complete
    # The file and the digest of its bytes (content_digest), nothing else.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.arrow", "f.arrow.blake2b"]
    assert content_digest(path) == hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()
    table = MappedFile(path).table
    assert table.num_rows == 12 and table.column("n").to_pylist() == [0] * 4 + [1] * 4 + [2] * 4
    assert table.column("x")[5].as_py() == list(range(1001, 2001))
    datasets = pytest.importorskip("datasets")
    assert datasets.Dataset.from_file(str(path))[5]["x"] == list(range(1001, 2001))


def test_an_exception_leaves_no_file(tmp_path):
    with pytest.raises(RuntimeError), ArrowStreamWriter(tmp_path / "f.arrow", SCHEMA) as w:
        w.write(_batch(0))
        raise RuntimeError("stop")
    assert list(tmp_path.iterdir()) == []


def test_a_killed_writer_s_temporary_file_goes_with_the_next_write(tmp_path):
    """A rank stopped by its launcher mid-write (SIGTERM's default under data parallel)
    leaves ``<file>.<pid>-<random>.tmp``: the next writer of the same file removes it
    once that process is gone, and leaves a live writer's and other files' alone (a
    trial's cache kept two such files, 13.6 MB, after its rerun had succeeded)."""
    import subprocess

    path = tmp_path / "docs.arrow"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead = tmp_path / f"docs.arrow.{int(gone.stdout)}-0123456789ab.tmp"
    live = tmp_path / f"docs.arrow.{os.getpid()}-0123456789ab.tmp"  # this process: alive
    other = tmp_path / f"rows.arrow.{int(gone.stdout)}-0123456789ab.tmp"  # another file's
    for f in (dead, live, other):
        f.write_bytes(b"x" * 100)
    with ArrowStreamWriter(path, SCHEMA) as writer:
        writer.write(_batch(0))
        (ours,) = [p for p in tmp_path.glob("docs.arrow.*.tmp") if p != live]
        assert ours.name.startswith(f"docs.arrow.{os.getpid()}-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["docs.arrow", "docs.arrow.blake2b", live.name, other.name]
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RssFile is Linux's")
def test_dropped_pages_leave_the_resident_set(tmp_path):
    path = tmp_path / "big.arrow"
    with ArrowStreamWriter(path, SCHEMA) as writer:
        for i in range(16):
            writer.write(_batch(i, rows=64, width=16384))  # 4 MiB a batch, 64 MiB in all
    mapped = MappedFile(path)
    column = mapped.table.column("x")
    before = _rss_file()
    total = sum(int(np.asarray(chunk.values).sum(dtype=np.int64)) for chunk in column.chunks)
    assert total > 0
    touched = _rss_file() - before
    assert touched > 48 << 20  # the 64 MiB read through the map count in RSS
    mapped.drop_pages([column])
    assert _rss_file() - before < 8 << 20  # and leave it when given back
    assert column.chunks[3].values[5].as_py() == 3 + 5  # still readable: read again
