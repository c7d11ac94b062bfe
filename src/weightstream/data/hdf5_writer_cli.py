"""``weightstream data write-gpt-hdf5``: text files -> GPT HDF5 files for GptHDF5DataProcessor.

Tokens are bytes (vocabulary 256), so any text works without a tokenizer file,
or the ids of ``--tokenizer PATH`` (a tokenizers ``tokenizer.json`` or a Hugging
Face folder holding one); the default input is the Python standard library's
source, present everywhere.

    weightstream data write-gpt-hdf5 -o data/train --seq_len 256 --examples_per_file 1000
    weightstream data write-gpt-hdf5 -o data/mine --input notes/ book.txt --seq_len 512
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from weightstream.data.corpus import read_corpus, read_texts, stdlib_source_files, text_files


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="weightstream data write-gpt-hdf5",
        description="Write text as GPT HDF5 files (data [N, 3, seq]: input_ids, "
        "attention_mask, labels) for data_processor: GptHDF5DataProcessor; byte-level "
        "unless --tokenizer is given.",
    )
    p.add_argument("-o", "--output_dir", required=True, help="directory to write the .h5 files to")
    p.add_argument(
        "--input",
        nargs="+",
        metavar="PATH",
        help="text files or directories (default: the Python standard library's source)",
    )
    p.add_argument("--seq_len", type=int, default=256, help="tokens per example (default 256)")
    p.add_argument(
        "--examples_per_file", type=int, default=1000, help="examples per .h5 file (default 1000)"
    )
    p.add_argument(
        "--max_bytes", type=int, default=8 * 2**20, help="bytes of text to read (default 8 MiB)"
    )
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="a tokenizers tokenizer.json, or a Hugging Face folder holding one (default: bytes)",
    )
    p.add_argument("--compression", choices=["none", "gzip", "lz4"], default="none")
    p.add_argument(
        "--overwrite", action="store_true", help="delete .h5 files already in output_dir"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (0 written, 2 bad arguments or input)."""
    from weightstream.data.gpt_hdf5 import PARAMS_FILE, write_gpt_hdf5

    args = build_parser().parse_args(argv)
    try:
        if args.max_bytes < 1:
            raise ValueError(f"--max_bytes must be >= 1, got {args.max_bytes}.")
        files = (
            text_files(args.input, "--input", "give text files or directories of them")
            if args.input
            else stdlib_source_files()
        )
        tokenizer = None
        if args.tokenizer:
            from weightstream.data.tokenize import load_tokenizer

            tokenizer = load_tokenizer(args.tokenizer)
            # Each file is a document, encoded on its own (data/tokenize.py).
            corpus = read_texts(files, max_bytes=args.max_bytes)
        else:
            corpus = read_corpus(files, max_bytes=args.max_bytes)
        written = write_gpt_hdf5(
            args.output_dir,
            corpus,
            seq_len=args.seq_len,
            examples_per_file=args.examples_per_file,
            compression=None if args.compression == "none" else args.compression,
            overwrite=args.overwrite,
            tokenizer=tokenizer,
            tokenizer_name=args.tokenizer,
        )
    except (ValueError, TypeError) as exc:
        print(f"weightstream data write-gpt-hdf5: error: {exc}", file=sys.stderr)
        return 2
    params = json.loads((Path(args.output_dir) / PARAMS_FILE).read_text())
    print(
        f"wrote {params['n_examples']} examples of {args.seq_len} tokens from "
        f"{params['source_bytes']} bytes of text in {len(written)} file(s) to {args.output_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
