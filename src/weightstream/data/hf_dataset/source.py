"""The data of ``data_dir``: its files resolved and fingerprinted, read a batch at a
time with ``datasets``' own readers, its rows checked for the format's columns, and
where a row is (file and line) for the messages that name it.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from weightstream.data.arrow_files import MappedFile
from weightstream.data.hf_dataset.settings import SUFFIXES, TOKENIZE_BATCH, HFDataSettings
from weightstream.data.section import Section


def import_datasets():
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            "HFDatasetProcessor needs the datasets package: pip install 'weightstream[hf]'"
        ) from e
    return datasets


def data_source(s: Section) -> tuple[str, list[str]]:
    """(builder, files): ``"json"``/``"parquet"``/``"csv"`` and the files, or ``"disk"`` and
    the save_to_disk folder."""
    where = s.where("data_dir")
    data_dir = s.params.get("data_dir")
    if data_dir is None:
        raise ValueError(
            f"{where} is required by HFDatasetProcessor: a .jsonl, .json, .parquet or .csv "
            "file, a glob or list of them, or a folder written by save_to_disk."
        )
    entries = [data_dir] if isinstance(data_dir, (str, os.PathLike)) else data_dir
    if not isinstance(entries, (list, tuple)) or not entries:
        raise TypeError(f"{where} must be a path, a glob or a list of them, got {data_dir!r}.")
    files: list[str] = []
    for entry in map(os.fspath, entries):
        path = Path(entry)
        if glob.has_magic(entry):
            found = sorted(p for p in glob.glob(entry, recursive=True) if Path(p).is_file())
            if not found:
                raise ValueError(f"{where}: the glob {entry!r} matches no file. Fix the pattern.")
            files += found
        elif path.is_dir():
            if not (path / "state.json").is_file() and not (path / "dataset_dict.json").is_file():
                raise ValueError(
                    f"{where}: {entry!r} is a folder, but not one written by save_to_disk (it "
                    f"has no state.json). Fix: name its data files, e.g. {entry}/*.jsonl."
                )
            if len(entries) > 1:
                raise ValueError(
                    f"{where}: a save_to_disk folder ({entry!r}) must be data_dir's only entry."
                )
            return "disk", [entry]
        elif path.is_file():
            files.append(entry)
        else:
            raise ValueError(f"{where}: {entry!r} does not exist. Fix: give an existing file.")
    kinds = set()
    for f in files:
        suffix = Path(f).suffix.lower()
        if suffix not in SUFFIXES:
            raise ValueError(
                f"{where}: {f!r} has the suffix {suffix or '(none)'!r}; HFDatasetProcessor reads "
                f"{', '.join(SUFFIXES)} files or save_to_disk folders. Fix: convert the file, "
                "or rename it if its content is one of these."
            )
        kinds.add(SUFFIXES[suffix])
    if len(kinds) > 1:
        raise ValueError(
            f"{where} mixes file kinds ({', '.join(sorted(kinds))}). Fix: give files of one kind."
        )
    return kinds.pop(), files


def digest(*parts: object) -> str:
    """A short digest of ``parts``' reprs (the cache files' fingerprints)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Source:
    """The data of ``data_dir``, not read yet: ``kind`` and ``files`` as
    :func:`data_source` gives them (for ``"disk"``, the folder's Arrow files), and a
    fingerprint that changes when they do."""

    kind: str
    files: list[str]
    fingerprint: str


def open_source(s: Section) -> Source:
    kind, files = data_source(s)
    if kind != "disk":
        # As datasets fingerprints local files: their paths and modification times.
        stats = [(os.path.abspath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
        return Source(kind, files, digest(kind, stats))
    datasets = import_datasets()
    data = datasets.load_from_disk(files[0])  # memory-mapped, not read: its files and state
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise ValueError(
                f"{s.where('data_dir')}: {files[0]!r} holds the splits "
                f"{', '.join(data)} and no 'train'. Fix: name one split's folder "
                f"({files[0]}/<split>)."
            )
        data = data["train"]
    assert data._indices is None, "save_to_disk writes the rows themselves, not indices"
    return Source(kind, [f["filename"] for f in data.cache_files], data._fingerprint)


def read_batches(source: Source, where: str, cache_dir: str | None) -> Iterator[pa.Table]:
    """The data's rows in order, as tables of at most :data:`TOKENIZE_BATCH` rows, read a
    batch at a time (Note [hf dataset cache]). ``cache_dir``: where datasets keeps its
    lock files (it writes nothing else when streaming)."""
    if source.kind == "disk":
        for name in source.files:
            mapped = MappedFile(Path(name))
            for start in range(0, mapped.table.num_rows, TOKENIZE_BATCH):
                batch = mapped.table.slice(start, TOKENIZE_BATCH)
                yield batch
                mapped.drop_pages(batch.columns)  # the caller is done with it
        return
    datasets = import_datasets()
    files = source.files
    what = f"{files[0]!r}{f' (and {len(files) - 1} more)' if len(files) > 1 else ''}"
    empty = [f for f in files if os.path.getsize(f) == 0]
    if empty:
        raise ValueError(
            f"{where}: {empty[0]!r} is empty (0 bytes){f', and {len(empty) - 1} more' if len(empty) > 1 else ''}: "
            "it has no rows. Fix: remove it from data_dir, or write its rows."
        )
    try:
        # streaming: read a chunk at a time (datasets' own parsers), no Arrow copy made.
        stream = datasets.load_dataset(
            source.kind, data_files=files, split="train", streaming=True, cache_dir=cache_dir
        )
        yield from stream.with_format("arrow").iter(batch_size=TOKENIZE_BATCH)
    except Exception as e:  # datasets' own errors (DatasetGenerationError) have no common base
        bad = _first_bad_json_line(files) if source.kind == "json" else None
        if bad is not None:
            raise ValueError(
                f"{where}: {bad}. Fix: make each line of a .jsonl file one JSON object."
            ) from e
        raise ValueError(
            f"{where}: cannot read {what} as {source.kind} ({type(e).__name__}: {e}). "
            "Fix: check that every file is valid and that all have the same columns."
        ) from e


def _first_bad_json_line(files: list[str]) -> str | None:
    """Where the first line of JSON Lines ``files`` that is not a JSON object is, and why
    (None: every line parses; a .json file holding one document is not read by lines)."""
    for name in files:
        if not name.endswith((".jsonl", ".jsonl.gz")) and not name.endswith(".ndjson"):
            continue
        opener = gzip.open if name.endswith(".gz") else open
        with opener(name, "rt", encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as e:
                    return f"{name!r} line {number} is not valid JSON ({e.msg} at column {e.colno})"
                if not isinstance(value, dict):
                    return f"{name!r} line {number} is a JSON {type(value).__name__}, not an object"
    return None


def python_columns(table: pa.Table, names) -> dict[str, list]:
    """``names`` of ``table`` as Python values, decoded by the table's datasets features
    where it has them: datasets 5 reads messages of different keys (one with a
    ``name``) as its ``Json`` type, JSON text in Arrow, which decodes to the dicts."""
    columns = {c: table.column(c).to_pylist() for c in names}
    if b"huggingface" in (table.schema.metadata or {}):
        features = import_datasets().Features.from_arrow_schema(table.schema)
        columns = {c: features.decode_column(v, c) for c, v in columns.items()}
    return columns


# The columns each format reads.
FORMAT_COLUMNS = {
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
    "messages": ("messages",),
}


def check_columns(
    table: pa.Table, fmt: str, row: int, source: Source, s: Section, settings: HFDataSettings
) -> None:
    """A row without the format's column (absent from its line, or null) is an error
    naming where it is, what it has and the format; ``row``: the table's first row."""
    for name in FORMAT_COLUMNS[fmt]:
        if name not in table.column_names:
            missing = 0
        else:
            column = table.column(name)
            if column.null_count == 0:
                continue
            missing = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        has = [c for c in table.column_names if table.column(c)[missing].is_valid]
        how = " (detected from the columns: format auto)" if settings.format == "auto" else ""
        raise ValueError(
            f"{s.where('data_dir')}: {places(source, [row + missing])[0]} has no {name!r} "
            f"(missing or null), which format {fmt!r}{how} reads; the row has "
            f"{', '.join(map(repr, has)) or 'no keys'}. Fix: give every row {name!r} (rename "
            "its key), or remove the row."
        )
    if fmt == "messages" and pa.types.is_list(table.schema.field("messages").type):
        import pyarrow.compute as pc

        empty = np.flatnonzero(pc.equal(pc.list_value_length(table.column("messages")), 0))
        if len(empty):
            raise ValueError(
                f"{s.where('data_dir')}: {places(source, [row + int(empty[0])])[0]} has an "
                "empty 'messages' list: a conversation needs at least one message. Fix: give "
                "it its messages, or remove the row."
            )


def places(source: Source, rows: Sequence[int]) -> list[str]:
    """Where data rows ``rows`` (0-based, the files in order) are, for messages: ``file
    line N`` in .jsonl files (blank lines hold no row, as datasets reads them), ``file row
    N`` (0-based) in parquet files, else ``row N of the data``. Reads the files: only on
    the way to an error or a warning."""
    found: dict[int, str] = {}
    wanted = set(rows)
    base = 0
    try:
        for f in source.files if source.kind in ("json", "parquet") else ():
            if source.kind == "parquet":
                import pyarrow.parquet as pq

                n = pq.ParquetFile(f).metadata.num_rows
                found.update({r: f"{f} row {r - base}" for r in wanted if 0 <= r - base < n})
            elif f.lower().endswith(".jsonl"):
                n = 0
                with open(f, "rb") as lines:
                    for number, line in enumerate(lines, 1):
                        if line.strip():
                            if base + n in wanted:
                                found[base + n] = f"{f} line {number}"
                            n += 1
            else:  # a .json file's rows need not be lines: the later files' are unknown
                break
            base += n
    except OSError:
        pass
    return [found.get(r, f"row {r} of the data (0-based)") for r in rows]
