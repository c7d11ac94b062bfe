"""What a section's documents and rows hold, counted from the cache files' small
columns: the summary line, the warnings, and the error where nothing trains.

Note [documents without targets]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A document can end up with no target token (labels -100 everywhere): a conversation
without an assistant turn, or whose assistant's role is misspelled (the template renders
``asistant`` like any role, and only ``assistant`` turns are targets), or, with
``overflow: truncate``, a prompt at least ``seq_len`` tokens long (the completion is the
dropped tail). Such a document costs a row and trains nothing, and data where *no*
document keeps a target trains at loss 0 (eval: nan metrics) without any other sign. So
the docs file keeps, per document, the position of its first target (``first_target``, -1
for none) and what looked wrong when it was tokenized (``issues``, bits ``ISSUE_*``);
every build counts them from these two small columns (no token is read): data without a
single target is an error before step 1, naming the cause and the fix; some documents
without one are a warning, with where the first few are (file and line), and a count in
the summary line. A row without the format's column (``{"msgs": ...}`` in messages data)
is an error naming its file and line.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from weightstream.context import current_run
from weightstream.data.arrow_files import MappedFile
from weightstream.data.hf_dataset.settings import (
    ISSUE_NO_ASSISTANT,
    ISSUE_NULL_CONTENT,
    ISSUE_ROLE,
    KNOWN_ROLES,
    PACK_BATCH,
    HFDataSettings,
)
from weightstream.data.hf_dataset.source import Source, places
from weightstream.data.section import Section

log = logging.getLogger("weightstream")


@dataclass(frozen=True)
class _Counts:
    """What a section's documents and rows hold (Note [documents without targets])."""

    docs: int
    long: int  # longer than seq_len
    excess: int  # their tokens beyond seq_len
    rows: int
    tokens: int
    targets: int  # labels != -100 in the rows
    no_target: int  # documents without any target
    cut_off: int  # documents with targets, none of them kept by truncation
    first_min: int  # the earliest first target of the cut-off documents
    first_max: int  # and the latest
    # overflow: split: the pieces cut before a document's first target (its prompt longer
    # than seq_len), which hold no target
    untargeted_pieces: int
    issues: dict[int, int]  # ISSUE_* bit -> documents with it
    untrained_issues: dict[int, int]  # ISSUE_* bit -> documents with it and no target


def _count(settings: HFDataSettings, docs: MappedFile, head: tuple[int, int], rows_path: Path):
    """The section's :class:`_Counts`, from the length, first_target and issues columns
    of the memory-mapped files (no copy of the tokens; their pages given back)."""
    import pyarrow.compute as pc

    n = head[1] - head[0]
    lengths, first, issues = (
        docs.table.column(c).slice(head[0], n) for c in ("length", "first_target", "issues")
    )
    # Split: longer than a row once its last token, which has no target, is left out.
    split = settings.overflow == "split"
    long = pc.greater(lengths, settings.seq_len + (1 if split else 0))
    over = pc.subtract(pc.filter(lengths, long), settings.seq_len)
    late = pc.filter(first, pc.greater_equal(first, settings.seq_len))
    if settings.overflow == "truncate":
        cut_first, untargeted = late, 0
    else:  # split keeps every token, targets included; the pieces before the first have none
        cut_first = pa.array([], pa.int64())
        untargeted = sum(f // settings.seq_len for f in late.to_pylist())
    none = pc.equal(first, -1)
    has = {
        bit: pc.not_equal(pc.bit_wise_and(issues, bit), 0)
        for bit in (ISSUE_ROLE, ISSUE_NO_ASSISTANT, ISSUE_NULL_CONTENT)
    }
    rows = MappedFile(rows_path)
    row_lengths, row_targets = rows.table.column("length"), rows.table.column("targets")
    counts = _Counts(
        docs=n,
        long=int(pc.sum(long).as_py() or 0),
        excess=int(pc.sum(over).as_py() or 0),
        rows=rows.table.num_rows,
        tokens=int(pc.sum(row_lengths).as_py() or 0),
        targets=int(pc.sum(row_targets).as_py() or 0),
        no_target=_sum(none),
        cut_off=len(cut_first),
        first_min=int(pc.min(cut_first).as_py() or 0),
        first_max=int(pc.max(cut_first).as_py() or 0),
        untargeted_pieces=untargeted,
        issues={bit: _sum(has[bit]) for bit in has},
        untrained_issues={bit: _sum(pc.and_(has[bit], none)) for bit in has},
    )
    docs.drop_pages([lengths, first, issues])
    rows.drop_pages([row_lengths, row_targets])
    return counts


def _sum(values) -> int:
    import pyarrow.compute as pc

    return int(pc.sum(values).as_py() or 0)


def _first_rows(docs: MappedFile, head: tuple[int, int], column: str, test, limit: int = 3):
    """The data rows (0-based) of the first ``limit`` documents of ``head`` whose
    ``column`` value passes ``test`` (a numpy predicate)."""
    found: list[int] = []
    for start in range(head[0], head[1], PACK_BATCH):
        values = docs.table.column(column).slice(start, min(PACK_BATCH, head[1] - start))
        hits = np.flatnonzero(test(values.to_numpy()))
        found += (start + hits[: limit - len(found)]).tolist()
        docs.drop_pages([values])
        if len(found) >= limit:
            break
    return found


_ISSUE_WORDS = {
    ISSUE_NO_ASSISTANT: "without an assistant turn (role 'assistant')",
    ISSUE_ROLE: f"with a message whose role is none of {', '.join(KNOWN_ROLES)} (misspelled?)",
    ISSUE_NULL_CONTENT: "with a message whose content is null (and no tool_calls)",
}


def _where(source: Source, docs: MappedFile, head: tuple[int, int], column: str, test) -> str:
    rows = _first_rows(docs, head, column, test)
    return "; first at " + ", ".join(places(source, rows)) if rows else ""


def summarize(
    s: Section,
    settings: HFDataSettings,
    fmt: str,
    docs: MappedFile,
    head: tuple[int, int],
    rows_path: Path,
    source: Source,
) -> None:
    """Refuse rows without a single target; log the section's summary line and warn of
    documents without targets or with suspicious messages, once per process (Note
    [documents without targets])."""
    c = _count(settings, docs, head, rows_path)
    if c.targets == 0:
        raise ValueError(_no_targets_message(s, settings, fmt, c, docs, head, source))
    # Once a run (the run context's record): the run command builds a section's loader
    # more than once (the compile phase's example batch, the training loader).
    said, key = current_run().logged, ("hf data summary", s.section, os.fspath(rows_path))
    if key in said:
        return
    said.add(key)
    seq = settings.seq_len
    if c.long == 0:
        cut = f"none longer than seq_len = {seq}"
    elif settings.overflow == "split":
        cut = f"{c.long} longer than seq_len = {seq}, split into pieces"
    else:
        cut = f"{c.long} longer than seq_len = {seq}, truncated ({c.excess} tokens dropped)"
    untrained = ""
    if c.no_target or c.cut_off:
        untrained = f"; {_documents(c.no_target + c.cut_off)} without a target (train nothing)"
    log.info(
        "%s: HFDatasetProcessor: %d %s documents (%s) in %d %s rows; %d tokens, %.1f%% of the "
        "rows' positions (the rest is padding); %d targets (labels != -100)%s",
        s.section,
        c.docs,
        fmt,
        cut,
        c.rows,
        "packed" if settings.packing else "unpacked",
        c.tokens,
        100.0 * c.tokens / max(1, c.rows * seq),
        c.targets,
        untrained,
    )
    if c.no_target:
        log.warning(
            "%s: %s of %d without a target token (labels != -100 nowhere): they train "
            "nothing%s%s. Fix: %s",
            s.section,
            _documents(c.no_target),
            c.docs,
            _reasons(c, fmt),
            _where(source, docs, head, "first_target", lambda v: v == -1),
            _no_target_fix(settings, fmt),
        )
    if c.cut_off:
        log.warning(
            "%s: truncation to seq_len = %d (overflow: truncate) leaves %d of %d documents "
            "without a target: their first target is at position %d to %d, beyond the row%s. "
            "Fix: raise seq_len to at least %d, or set overflow: split.",
            s.section,
            seq,
            c.cut_off,
            c.docs,
            c.first_min,
            c.first_max,
            _where(source, docs, head, "first_target", lambda v: v >= seq),
            c.first_max + 1,
        )
    if c.untargeted_pieces:
        log.warning(
            "%s: splitting at seq_len = %d (overflow: split) cuts %d piece(s) from before "
            "their document's first target (prompts longer than seq_len%s): they hold no "
            "target and train nothing, and a batch of only such rows steps at loss 0 (AdamW "
            "still applies its weight decay and momentum). Fix: raise seq_len past the "
            "prompts, shorten them, or drop those documents.",
            s.section,
            seq,
            c.untargeted_pieces,
            _where(source, docs, head, "first_target", lambda v: v >= seq),
        )
    for bit, effect in (
        (ISSUE_ROLE, "the template renders it like any role (its header) and trains none of it"),
        (ISSUE_NULL_CONTENT, "the template renders null as it does (Jinja: 'None' or nothing)"),
    ):
        if c.issues[bit]:
            log.warning(
                "%s: %s %s%s: %s. Fix: correct these messages, or remove them.",
                s.section,
                _documents(c.issues[bit]),
                _ISSUE_WORDS[bit],
                _where(source, docs, head, "issues", lambda v, b=bit: (v & b) != 0),
                effect,
            )


def _documents(n: int) -> str:
    return f"{n} document{'' if n == 1 else 's'}"


def _reasons(c: _Counts, fmt: str) -> str:
    """`` (messages: N without an assistant turn; ...)``: what the documents without a
    target had wrong, where their issues say."""
    counts = c.untrained_issues
    parts = [f"{counts[bit]} {_ISSUE_WORDS[bit]}" for bit in _ISSUE_WORDS if counts[bit]]
    return f" ({fmt}: {'; '.join(parts)})" if parts else ""


def _no_target_fix(settings: HFDataSettings, fmt: str) -> str:
    if fmt == "messages":
        fix = "give each conversation an assistant turn (role 'assistant', spelled so)"
    elif fmt == "prompt_completion":
        fix = "give each prompt a non-empty completion"
    else:
        fix = "give non-empty texts"
    if settings.completion_only_loss and fmt != "text":
        fix += ", or set completion_only_loss: false to train on every token"
    return fix + ", or remove these documents."


def _no_targets_message(
    s: Section,
    settings: HFDataSettings,
    fmt: str,
    c: _Counts,
    docs: MappedFile,
    head: tuple[int, int],
    source: Source,
) -> str:
    use = (
        "training would run at loss 0 and learn nothing"
        if s.section == "train_input"
        else "the eval loss and metrics would be 0 or nan"
    )
    if c.no_target < c.docs:  # the documents have targets: truncation dropped them all
        what = (
            f"truncation to seq_len = {settings.seq_len} (overflow: truncate) leaves none of "
            f"the {c.docs} {fmt} documents a target token (labels != -100): in each the first "
            f"target (the completion's or the assistant's first token) is at position "
            f"{c.first_min} or later, beyond the row"
        )
        if c.no_target:
            what += f" ({c.no_target} have no target at all)"
        fix = (
            f"raise {s.where('seq_len')} to at least {c.first_min + 1} (to {c.first_max + 1} "
            "to keep targets in every document), or set overflow: split (the pieces "
            "after the first hold the targets)"
        )
    else:
        what = (
            f"none of the {c.docs} {fmt} documents has a target token (labels != -100)"
            f"{_reasons(c, fmt)}"
            f"{_where(source, docs, head, 'first_target', lambda v: v == -1)}"
        )
        fix = _no_target_fix(settings, fmt).rstrip(".")
    return f"{s.section}: {what}, so {use}. Fix: {fix}."
