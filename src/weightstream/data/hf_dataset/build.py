"""A section's rows, built once: the data tokenized into a documents file, cut or packed
into a rows file, both cached and read memory-mapped.

Note [hf dataset cache]
~~~~~~~~~~~~~~~~~~~~~~~
Data are tokenized once into two Arrow stream files under ``<cache_dir>/weightstream/``:
``docs-*`` (every document of the data: ``input_ids``, ``labels``, ``length``,
``first_target`` and ``issues`` (Note [documents without targets])) and
``rows-*`` (a section's rows, cut or packed). Training reads the rows file memory-mapped
(:class:`HFRows`), and the run command, which builds a section's loader more than once
(the compile phase's first batch, then training), tokenizes once.

The pass that makes them holds memory bounded by a batch, whatever the data's size,
page cache of mapped files included (a mapped page counts in RSS once touched; Note
[arrow file pages] in ``arrow_files.py``). The data are read a chunk at a time
(``load_dataset(..., streaming=True)``: datasets' own json, parquet and csv readers, no
Arrow copy of the data; a save_to_disk folder's files memory-mapped, their pages given
back batch by batch), tokenized :data:`TOKENIZE_BATCH` documents at a time (plain strings
in one tokenizer call) and appended to the docs file; the rows are made from the docs
file, memory-mapped, :data:`PACK_BATCH` documents at a time, their pages given back as
each batch is done. Both files are written a batch at a time, synced every few tens of
MB with their pages dropped from the page cache, under a temporary name renamed into
place when complete. One process builds a file at a time (a lock file beside it): the
other ranks of a run, or another run on the same data, wait for it and then read it.

Their names are fingerprints of what they depend on: the data's (the files' paths, sizes
and modification times, as datasets fingerprints local files; a save_to_disk folder's own
fingerprint), the tokenizer's files, the settings as given (``format`` as given: the
detected format, a function of the data and the key, is kept in the docs file's schema
metadata) and :data:`ROWS_VERSION`; a change of any gives new files. A build that finds
both files reads nothing of the data. The rows file is what ``datasets`` writes
too (``Dataset.from_file`` reads it). Beside each file is the digest of its bytes
(``.blake2b``): a resume compares the rows' digest with the one its checkpoint recorded,
so data edited in place are noticed and a touched file is not.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from weightstream.data.arrow_files import ArrowStreamWriter, MappedFile
from weightstream.data.hf_dataset.rows import HFRows, flat_lists, list_array, make_rows, rows_schema
from weightstream.data.hf_dataset.settings import (
    PACK_BATCH,
    ROWS_VERSION,
    HFDataSettings,
    read_settings,
)
from weightstream.data.hf_dataset.source import (
    FORMAT_COLUMNS,
    Source,
    check_columns,
    digest,
    import_datasets,
    open_source,
    python_columns,
    read_batches,
)
from weightstream.data.hf_dataset.summary import summarize
from weightstream.data.hf_dataset.tokens import (
    DocBatch,
    DocumentEncoder,
    chat_template,
    conversation_issues,
    detect_format,
    first_targets,
    load_hf_tokenizer,
    tokenizer_digest,
)
from weightstream.data.section import Section

DOCS_SCHEMA = pa.schema(
    [
        ("input_ids", pa.large_list(pa.int32())),
        ("labels", pa.large_list(pa.int32())),
        ("length", pa.int64()),
        ("first_target", pa.int64()),  # Note [documents without targets]
        ("issues", pa.uint8()),
    ]
)


def _progress(desc: str, total: int | None):
    """datasets' progress bar (``datasets.disable_progress_bars()`` silences it)."""
    return import_datasets().utils.tqdm(desc=desc, total=total, unit=" documents")


def _write_docs(path: Path, source: Source, s: Section, settings: HFDataSettings, tokenizer):
    """Tokenize the data into the documents file ``path`` (Note [hf dataset cache])."""
    batches = read_batches(source, s.where("data_dir"), settings.cache_dir)
    first = next(batches, None)
    while first is not None and first.num_rows == 0:
        first = next(batches, None)
    if first is None:
        raise ValueError(f"{s.where('data_dir')}: the data holds no document. Fix: give data.")
    fmt = detect_format(first.column_names, settings.format, f"{s.section} ({s.processor})")
    if fmt != "text" and not chat_template(tokenizer) and _uses_template(first, fmt):
        raise ValueError(
            f"{s.where('tokenizer')}: the data are conversations, but the tokenizer at "
            f"{settings.tokenizer!r} has no chat template. Fix: give a tokenizer with one "
            "(tokenizer_config.json's chat_template, or chat_template.jinja)."
        )
    encoder = DocumentEncoder(tokenizer, fmt, settings.completion_only_loss)
    schema = DOCS_SCHEMA.with_metadata({"format": fmt})
    # No total: a stream's length is known once it has been read.
    bar = _progress(f"{s.section}: tokenizing", None)
    row = 0  # the data row of the table's first (for errors naming file and line)
    with ArrowStreamWriter(path, schema) as writer, bar:
        for table in itertools.chain([first], batches):
            if table.num_rows == 0:
                continue
            check_columns(table, fmt, row, source, s, settings)
            columns = python_columns(table, FORMAT_COLUMNS[fmt])
            docs = encoder(columns)
            arrays = [
                list_array(docs.ids, docs.lengths),
                list_array(docs.labels, docs.lengths),
                pa.array(docs.lengths),
                pa.array(first_targets(docs.labels, docs.lengths)),
                pa.array(conversation_issues(columns, fmt), pa.uint8()),
            ]
            writer.write(pa.record_batch(arrays, schema=schema))
            bar.update(len(docs.lengths))
            row += table.num_rows


def _write_rows(
    path: Path, docs: MappedFile, head: tuple[int, int], settings: HFDataSettings, desc: str
):
    """Cut or pack documents ``head[0]:head[1]`` of ``docs`` into the rows file ``path``,
    :data:`PACK_BATCH` documents at a time (Note [packing])."""
    schema = rows_schema(settings.packing)
    with ArrowStreamWriter(path, schema) as writer, _progress(desc, head[1] - head[0]) as bar:
        for start in range(head[0], head[1], PACK_BATCH):
            piece = docs.table.slice(start, min(PACK_BATCH, head[1] - start))
            ids, lengths = flat_lists(piece.column("input_ids"))
            labels, _ = flat_lists(piece.column("labels"))
            rows = make_rows(
                DocBatch(ids, labels, lengths),
                settings.seq_len,
                settings.packing,
                settings.overflow,
            )
            columns = [list_array(rows[name], rows["length"]) for name in schema.names[:-2]]
            columns += [pa.array(rows["length"]), pa.array(rows["targets"])]
            writer.write(pa.record_batch(columns, schema=schema))
            docs.drop_pages(piece.columns)
            bar.update(piece.num_rows)


@contextlib.contextmanager
def _one_builder(path: Path) -> Iterator[None]:
    """Hold the build of cache file ``path`` for this process: another process (a rank of
    the same run, another run on the same data) waits here until it is built, then finds
    it and reads nothing of the data (it tokenized all of it a second time). A lock of
    the kernel's: a builder killed mid-way lets the next one in."""
    with open(path.with_name(f".{path.name}.lock"), "a+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # waits for another process's build
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def build_rows(s: Section, is_training: bool) -> HFRows:
    """The rows of section ``s``: read, tokenized and cut or packed, from the cache when there."""
    settings = read_settings(s)
    tokenizer = load_hf_tokenizer(settings.tokenizer, s.where("tokenizer"))
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(_no_eos_message(s, settings.tokenizer, tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    source = open_source(s)
    cache = Path(settings.cache_dir or import_datasets().config.HF_DATASETS_CACHE)
    cache = cache / "weightstream"
    cache.mkdir(parents=True, exist_ok=True)
    # The format key as given, not as detected: the detected one is a function of the
    # data and the key, and a cached build then reads nothing of the data.
    fp_docs = digest(
        ROWS_VERSION,
        source.fingerprint,
        tokenizer_digest(settings.tokenizer),
        settings.format,
        settings.completion_only_loss,
    )
    docs_path = cache / f"docs-{fp_docs}.arrow"
    with _one_builder(docs_path):
        if not docs_path.is_file():
            _write_docs(docs_path, source, s, settings, tokenizer)
    docs = MappedFile(docs_path)
    fmt = docs.table.schema.metadata[b"format"].decode()
    n_docs, head = docs.table.num_rows, (0, docs.table.num_rows)
    if settings.eval_fraction is not None:
        cut = int(n_docs * (1.0 - settings.eval_fraction))
        head = (0, cut) if is_training else (cut, n_docs)
        if head[0] == head[1]:
            raise ValueError(
                f"{s.where('eval_fraction')} = {settings.eval_fraction} of {n_docs} documents "
                f"leaves none for {s.section}. Fix: give more data or another eval_fraction."
            )
    fp_rows = digest(fp_docs, head, settings.seq_len, settings.packing, settings.overflow)
    rows_path = cache / f"rows-{fp_rows}.arrow"
    with _one_builder(rows_path):
        if not rows_path.is_file():
            verb = "packing" if settings.packing else "cutting"
            _write_rows(rows_path, docs, head, settings, f"{s.section}: {verb} rows")
    summarize(s, settings, fmt, docs, head, rows_path, source)
    rows = HFRows(rows_path, settings.seq_len, pad, settings.packing)
    if len(rows) == 0:
        raise ValueError(f"{s.where('data_dir')}: the data holds no document. Fix: give data.")
    return rows


def _no_eos_message(s: Section, path: str, tokenizer) -> str:
    """The error of a tokenizer without eos: the fix for its folder as it is (a bare
    tokenizer.json has no tokenizer_config.json to edit)."""
    special = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
    added = [t for t in getattr(tokenizer, "get_added_vocab", dict)() if t not in special]
    known = special + added
    names = f" (its special/added tokens: {', '.join(map(repr, known[:8]))})" if known else ""
    eos = known[0] if known else "<eos>"
    folder = Path(path)
    if (folder / "tokenizer_config.json").is_file():
        fix = f'set "eos_token": "<its end token>"{names} in {folder / "tokenizer_config.json"}'
    else:
        fix = (
            f"{path!r} has no tokenizer_config.json to set it in (only tokenizer.json?); write "
            "one with: from transformers import PreTrainedTokenizerFast; "
            f"PreTrainedTokenizerFast(tokenizer_file={str(folder / 'tokenizer.json')!r}, "
            f"eos_token={eos!r}).save_pretrained({path!r}), with the tokenizer's own end "
            f"token{names} (add chat_template=... for conversations)"
        )
    return (
        f"{s.where('tokenizer')}: the tokenizer at {path!r} has no eos token, which ends "
        f"every document. Fix: {fix}."
    )


def _uses_template(first: pa.Table, fmt: str) -> bool:
    if fmt == "messages":
        return True
    return isinstance(first.column("prompt")[0].as_py(), list)
