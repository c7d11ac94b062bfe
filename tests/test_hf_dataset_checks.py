"""HFDatasetProcessor's checks of the data: documents without targets, rows without the
format's column, suspicious messages, eval_fraction across the sections, the summary
line, the tokenizer without eos, and the keys' documentation.

The expected numbers (positions, line numbers, counts) come from the tokenizer's own
calls and from the files as the tests write them, not from the processor.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from test_hf_dataset import (
    PLAIN,
    _conversation,
    _examples,
    _load_tokenizer,
    _make_tokenizer,
    _rows,
    _section,
    _sentence,
    _write,
)

from weightstream.data import hf_dataset, processors
from weightstream.data.section import Section

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SUMMARY = "HFDatasetProcessor: "


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory) -> dict[str, Path]:
    return {"plain": _make_tokenizer(tmp_path_factory.mktemp("tokenizers") / "plain", PLAIN)}


def _write_lines(path: Path, rows: list) -> Path:
    """A .jsonl file; a None row is a blank line (no row for datasets)."""
    path.write_text("".join("\n" if r is None else json.dumps(r) + "\n" for r in rows))
    return path


# -- no target at all: an error before step 1 ---------------------------------------------


@pytest.mark.parametrize("is_training", [True, False])
def test_truncation_that_leaves_no_target_is_an_error(tmp_path, tokenizer_dirs, is_training):
    rows = [
        {"prompt": _sentence(i, 6 + i % 3), "completion": " " + _sentence(i, 2)} for i in range(8)
    ]
    path = _write(tmp_path / "pc.jsonl", rows)
    tok = _load_tokenizer(tokenizer_dirs["plain"])
    prompts = [len(tok(r["prompt"])["input_ids"]) for r in rows]
    seq = min(prompts) - 1  # every prompt fills its row: its completion is the dropped tail
    section = _section(tmp_path, path, tokenizer_dirs["plain"], seq_len=seq, overflow="truncate")
    # The label of a prompt's last token is the completion's first: position len(prompt) - 1.
    with pytest.raises(ValueError) as e:
        _rows(section, is_training)
    message = str(e.value)
    where = "train_input" if is_training else "eval_input"
    assert message.startswith(f"{where}: truncation to seq_len = {seq} (overflow: truncate)")
    assert "none of the 8 prompt_completion documents" in message
    assert f"position {min(prompts) - 1} or later" in message
    assert f"raise {where}.seq_len to at least {min(prompts)} (to {max(prompts)}" in message
    assert "overflow: split" in message
    assert ("loss 0" if is_training else "nan") in message
    # The fixes it names work: seq_len as it says, or split.
    assert _rows({**section, "seq_len": min(prompts)}, is_training)
    assert _rows({**section, "overflow": "split"}, is_training)


def test_split_pieces_cut_before_the_first_target_are_counted_and_warned(
    tmp_path, tokenizer_dirs, caplog
):
    """overflow: split cuts a prompt longer than seq_len into pieces without a target; the
    warning counts them (each document's first target // seq_len), and the rows agree."""
    rows = [
        {"prompt": _sentence(i, 6 + i % 3), "completion": " " + _sentence(i, 2)} for i in range(6)
    ]
    path = _write(tmp_path / "pc.jsonl", rows)
    tok = _load_tokenizer(tokenizer_dirs["plain"])
    seq = min(len(tok(r["prompt"])["input_ids"]) for r in rows) // 2
    section = _section(tmp_path, path, tokenizer_dirs["plain"], seq_len=seq)
    with caplog.at_level("WARNING", logger="weightstream"):
        got = _rows(section)
    firsts = [len(tok(r["prompt"])["input_ids"]) - 1 for r in rows]  # the first label
    pieces = sum(f // seq for f in firsts)
    assert pieces > 0
    # ... and a row of a document's last token alone (eos: nothing after it to predict)
    assert sum(1 for row in got if int((row["labels"] != -100).sum()) == 0) >= pieces
    assert f"cuts {pieces} piece(s) from before their document's first target" in caplog.text
    assert f"{path} line 1" in caplog.text


def test_conversations_without_any_assistant_turn_are_an_error(tmp_path, tokenizer_dirs):
    rows = [
        {"messages": [m for m in _conversation(i) if m["role"] != "assistant"]} for i in range(6)
    ]
    rows[2]["messages"].append({"role": "asistant", "content": "hello"})
    path = _write(tmp_path / "chat.jsonl", rows)
    section = _section(tmp_path, path, tokenizer_dirs["plain"])
    with pytest.raises(ValueError) as e:
        _rows(section)
    message = str(e.value)
    assert message.startswith("train_input: none of the 6 messages documents has a target")
    assert "6 without an assistant turn" in message
    assert "1 with a message whose role is none of system, user, assistant" in message
    assert f"first at {path} line 1, {path} line 2, {path} line 3" in message
    assert "completion_only_loss: false" in message
    # Without completion_only_loss every token is a target: it trains.
    assert _rows({**section, "completion_only_loss": False})


# -- some documents without targets, suspicious messages: counted and warned ---------------


def test_documents_without_targets_are_counted_and_located(tmp_path, tokenizer_dirs, caplog):
    rows: list = [{"messages": _conversation(i)} for i in range(10)]
    rows[3] = {"messages": [{"role": "user", "content": "hi"}]}  # no assistant turn
    rows[6] = {  # a misspelled assistant: rendered, never trained
        "messages": [{"role": "user", "content": "hi"}, {"role": "asistant", "content": "yo"}]
    }
    rows[8] = {
        "messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "ok"}]
    }
    rows.insert(1, None)  # a blank line: no row, so the lines after it are one further
    path = _write_lines(tmp_path / "chat.jsonl", rows)
    # Lines are 1-based and count the blank one: data rows 3, 6, 8 are lines 5, 8, 10.
    line = {3: 5, 6: 8, 8: 10}
    with caplog.at_level("INFO", logger="weightstream"):
        got = _rows(_section(tmp_path, path, tokenizer_dirs["plain"], seq_len=96))
    assert len(got) == 10
    summary = [r.getMessage() for r in caplog.records if SUMMARY in r.getMessage()]
    assert len(summary) == 1 and summary[0].endswith(
        "; 2 documents without a target (train nothing)"
    )
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    no_target = [w for w in warnings if "without a target token" in w]
    assert len(no_target) == 1
    assert no_target[0].startswith("train_input: 2 documents of 10 without a target token")
    assert "2 without an assistant turn" in no_target[0]
    assert f"first at {path} line {line[3]}, {path} line {line[6]}." in no_target[0]
    roles = [
        w for w in warnings if w.startswith("train_input: 1 document with a message whose role")
    ]
    assert len(roles) == 1
    assert f"first at {path} line {line[6]}:" in roles[0]
    nulls = [
        w for w in warnings if w.startswith("train_input: 1 document with a message whose content")
    ]
    assert len(nulls) == 1 and f"first at {path} line {line[8]}:" in nulls[0]


def test_a_row_without_the_formats_column_names_file_line_and_keys(tmp_path, tokenizer_dirs):
    rows = [{"messages": _conversation(i)} for i in range(5)]
    rows.insert(3, {"msgs": [{"role": "user", "content": "hi"}], "id": 7})
    path = _write_lines(tmp_path / "chat.jsonl", rows)
    with pytest.raises(ValueError) as e:
        _rows(_section(tmp_path, path, tokenizer_dirs["plain"]))
    message = str(e.value)
    assert message.startswith(f"train_input.data_dir: {path} line 4 has no 'messages'")
    assert "format 'messages' (detected from the columns: format auto)" in message
    assert "the row has 'msgs', 'id'" in message
    # A prompt without a completion: the same, in a parquet file (rows 0-based).
    pc = _examples("prompt_completion", 6)
    pc[4] = {"prompt": "hello"}
    path = _write(tmp_path / "pc.parquet", pc)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} row 4 has no 'completion'"):
        _rows(_section(tmp_path, path, tokenizer_dirs["plain"], format="prompt_completion"))


def test_an_empty_conversation_is_named_with_its_place(tmp_path, tokenizer_dirs):
    """transformers' own error for it ("Cannot apply chat template to an empty
    conversation") named no file, line or section."""
    rows = [{"messages": _conversation(i)} for i in range(5)]
    rows.insert(2, {"messages": []})
    path = _write_lines(tmp_path / "chat.jsonl", rows)
    with pytest.raises(ValueError) as e:
        _rows(_section(tmp_path, path, tokenizer_dirs["plain"]))
    assert str(e.value).startswith(
        f"train_input.data_dir: {path} line 3 has an empty 'messages' list"
    )


def test_an_empty_file_or_a_line_that_is_not_json_is_named_with_its_place(tmp_path, tokenizer_dirs):
    rows = [{"text": _sentence(i, 5)} for i in range(4)]
    good = _write_lines(tmp_path / "good.jsonl", rows)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=rf"{re.escape(repr(str(empty)))} is empty \(0 bytes\)"):
        _rows(_section(tmp_path, [str(good), str(empty)], tokenizer_dirs["plain"]))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(good.read_text().replace('"}', '"', 1) + "[1, 2]\n")
    with pytest.raises(ValueError, match=r"broken.jsonl' line 1 is not valid JSON \(.* column"):
        _rows(_section(tmp_path, broken, tokenizer_dirs["plain"]))
    broken.write_text(good.read_text() + "[1, 2]\n")
    with pytest.raises(ValueError, match=r"broken.jsonl' line 5 is a JSON list, not an object"):
        _rows(_section(tmp_path, broken, tokenizer_dirs["plain"]))


def test_first_targets_are_each_documents_first_label():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 9, 50)
    labels = np.where(rng.random(int(lengths.sum())) < 0.15, 5, -100).astype(np.int32)
    expected, start = [], 0
    for n in lengths.tolist():
        hits = [t for t in range(n) if labels[start + t] != -100]
        expected.append(hits[0] if hits else -1)
        start += n
    assert hf_dataset.first_targets(labels, lengths).tolist() == expected
    assert -1 in expected and any(e > 0 for e in expected)


# -- the summary line, once ----------------------------------------------------------------


def test_the_summary_is_logged_once_per_section(tmp_path, tokenizer_dirs, caplog):
    path = _write(tmp_path / "t.jsonl", _examples("text", 12))
    section = _section(tmp_path, path, tokenizer_dirs["plain"], eval_fraction=0.25)
    with caplog.at_level("INFO", logger="weightstream"):
        for _ in range(3):  # as the run command: compile, input analysis, training
            _rows(section, True)
        _rows(section, False)
    summary = [r.getMessage() for r in caplog.records if SUMMARY in r.getMessage()]
    assert [m.split(":")[0] for m in summary] == ["train_input", "eval_input"]


# -- eval_fraction across the sections -----------------------------------------------------


def test_eval_fraction_must_agree_over_the_same_data(tmp_path, caplog):
    base = {"data_processor": "HFDatasetProcessor", "data_dir": "data/chat.jsonl"}
    check = processors.check_input_sections
    for train, evals in ((0.1, None), (None, 0.1), (0.1, 0.2)):
        with pytest.raises(ValueError, match=r"over the same data_dir") as e:
            check({**base, "eval_fraction": train}, {**base, "eval_fraction": evals})
        assert f"Fix: set eval_fraction: {train or evals} in both sections" in str(e.value)
    check({**base, "eval_fraction": 0.1}, {**base, "eval_fraction": 0.1})
    check({**base, "eval_fraction": 0.1}, {**base, "data_dir": "data/eval.jsonl"})
    check({**base, "eval_fraction": 0.1}, None)
    other = {**base, "data_processor": "TextCorpusProcessor"}
    check({**other, "eval_fraction": 0.1}, other)  # its default fraction applies to both
    with caplog.at_level("WARNING", logger="weightstream"):
        check(base, {**base, "data_dir": str(Path("data/chat.jsonl").absolute())})
    assert "eval measures the documents that trained" in caplog.text


def test_the_params_parser_refuses_an_eval_fraction_in_one_section_only(tmp_path):
    from weightstream.cli.params import parse_params

    section = {
        "data_processor": "HFDatasetProcessor",
        "data_dir": "data/chat.jsonl",
        "tokenizer": "tok",
        "batch_size": 2,
    }
    raw = {
        "train_input": {**section, "eval_fraction": 0.1},
        "eval_input": section,
        "model": {"name": "gpt2", "n_layer": 1, "d_model": 8, "n_head": 1},
        "optimizer": {"optimizer_type": "AdamW", "learning_rate": 1e-3},
        "runconfig": {"max_steps": 1},
    }
    with pytest.raises(ValueError, match="eval_input reads all of it"):
        parse_params(raw, "train_and_eval")
    raw["eval_input"] = {**section, "eval_fraction": 0.1}
    parse_params(raw, "train_and_eval")


# -- the tokenizer without eos -------------------------------------------------------------


def _bare_tokenizer(folder: Path) -> Path:
    """A folder with a tokenizer.json alone (no tokenizer_config.json: no eos)."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=280,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|end|>"],
        show_progress=False,
    )
    tok.train_from_iterator(["the quick brown fox"] * 5, trainer)
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_the_no_eos_error_gives_a_fix_that_works(tmp_path):
    folder = _bare_tokenizer(tmp_path / "bare")
    path = _write(tmp_path / "t.jsonl", _examples("text", 4))
    section = _section(tmp_path, path, folder)
    with pytest.raises(ValueError) as e:
        _rows(section)
    message = str(e.value)
    assert "has no tokenizer_config.json" in message and "'<|end|>'" in message
    code = re.search(r"write one with: (.*?), with the tokenizer's own", message).group(1)
    exec(code.replace("; ", "\n"), {})  # the fix as the message gives it
    assert (folder / "tokenizer_config.json").is_file()
    assert _rows(section)
    # With a tokenizer_config.json the fix is to edit it.
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("eos_token")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r'Fix: set "eos_token": .* in .*tokenizer_config.json'):
        _rows(section)


# -- the keys' documentation ---------------------------------------------------------------


def test_the_key_docs_cover_the_keys_with_the_defaults_applied(tmp_path):
    docs = processors.processor_key_docs("HFDatasetProcessor")
    own = processors.processor_keys("HFDatasetProcessor") - processors.COMMON_KEYS
    assert set(docs) == own and all(text.strip() for _, text in docs.values())
    # The defaults as documented are the ones the processor applies to a section without them.
    settings = hf_dataset.read_settings(
        Section(
            "HFDatasetProcessor",
            {"tokenizer": str(tmp_path)},
            True,
            frozenset(processors.processor_keys("HFDatasetProcessor")),
        )
    )
    for key, (default, _) in docs.items():
        if key in ("tokenizer", "max_sequence_length"):
            continue
        assert getattr(settings, key) == default, key
    assert docs["tokenizer"][0] == "required"
    assert processors.processor_key_docs("SyntheticDataProcessor") == {}
