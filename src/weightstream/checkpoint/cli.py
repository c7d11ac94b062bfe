"""``weightstream checkpoint {info,convert,copy,diff}``: the checkpoint command.

Exit status: 0 success (``diff``: identical), 1 ``diff`` found differences,
2 an error (printed on stderr, naming the problem and the fix).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from weightstream.checkpoint.convert import convert
from weightstream.checkpoint.errors import CheckpointError
from weightstream.checkpoint.report import diff, format_diff, format_info, info
from weightstream.checkpoint.source import sniff_format

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(text: str) -> int:
    """ "5GB" -> 5e9 bytes, "500MiB" -> 500 * 2**20, "1024" -> 1024."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 5GB, 500MiB or 1024")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    prefix = unit[:1] if unit[:1] in "kmgt" else ""
    scale = 1024 ** ("kmgt".index(prefix) + 1) if prefix and "i" in unit else _UNITS[prefix]
    return int(number * scale)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightstream checkpoint",
        description="Inspect, compare and convert checkpoints (H5, safetensors, torch).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="keys, shapes, dtypes, sizes and format version")
    p.add_argument("path", help="checkpoint file (H5, safetensors, index.json, directory)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--verify",
        action="store_true",
        help="read every tensor back (one at a time); exit status 1 if one does not",
    )
    p.add_argument("--allow-pickle", action="store_true", help="read torch.save files")

    p = sub.add_parser(
        "convert", help="convert between H5, safetensors and torch files, or to a HF folder"
    )
    p.add_argument("src", help="checkpoint to read")
    p.add_argument(
        "dst",
        help="output: .mdl/.h5 (H5), .safetensors, a directory or .index.json "
        "(Hugging Face sharded safetensors), .pt/.pth/.bin (torch); with --to hf a "
        "Hugging Face model folder (config.json + model.safetensors); with --to peft a "
        "peft adapter folder (adapter_config.json + adapter_model.safetensors)",
    )
    p.add_argument(
        "--to", choices=["h5", "safetensors", "torch", "hf", "peft"], help="output format"
    )
    p.add_argument(
        "--config",
        help="with --to hf: the config.json (or its folder) to write; with --to peft: the "
        "base model's; default: the run's",
    )
    p.add_argument(
        "--base",
        help="with a LoRA run's checkpoint: the base model folder (default: the one the run "
        "recorded); --to hf merges the adapters into its weights",
    )
    p.add_argument("--key", help="convert only this subtree, e.g. 'model'")
    p.add_argument("--max-shard-size", type=parse_size, help="safetensors shard size, e.g. 5GB")
    p.add_argument("--compression", choices=["none", "gzip", "lz4"], help="H5 compression")
    p.add_argument("--allow-pickle", action="store_true", help="read torch.save files")
    p.add_argument("--no-fsync", action="store_true", help="do not fsync the output")

    p = sub.add_parser(
        "copy",
        help="copy a checkpoint to DST in its own format, a tensor at a time (a safetensors "
        "folder stays a folder; --compression re-compresses an H5 file)",
    )
    p.add_argument("src", help="checkpoint to read")
    p.add_argument("dst", help="where the copy goes (its format: the source's)")
    p.add_argument("--compression", choices=["none", "gzip", "lz4"], help="H5 compression")
    p.add_argument("--allow-pickle", action="store_true", help="read torch.save files")
    p.add_argument("--no-fsync", action="store_true", help="do not fsync the output")

    p = sub.add_parser("diff", help="keys only in one, shape/dtype/value differences")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default: bitwise)")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default: bitwise)")
    p.add_argument("--allow-pickle", action="store_true", help="read torch.save files")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the checkpoint command; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "info":
            result = info(args.path, allow_pickle=args.allow_pickle, verify=args.verify)
            if args.json:
                printed = {**result, "entries": [asdict(e) for e in result["entries"]]}
                print(json.dumps(printed, indent=2))
            else:
                print(format_info(result))
            return 1 if result.get("unreadable") else 0
        if args.command == "copy":
            # The source's own format whatever DST's name says ("safetensors-sharded":
            # a folder, shards kept by convert's default shard size).
            fmt = sniff_format(Path(args.src)).removesuffix("-sharded")
            written = convert(
                args.src,
                args.dst,
                to=fmt,
                allow_pickle=args.allow_pickle,
                compression=None if args.compression in (None, "none") else args.compression,
                fsync=not args.no_fsync,
            )
            for path in written:
                print(path)
            return 0
        if args.command == "convert":
            written = convert(
                args.src,
                args.dst,
                to=args.to,
                key=args.key,
                allow_pickle=args.allow_pickle,
                max_shard_size=args.max_shard_size,
                compression=None if args.compression in (None, "none") else args.compression,
                fsync=not args.no_fsync,
                config=args.config,
                base=args.base,
            )
            for path in written:
                print(path)
            return 0
        result = diff(
            args.a, args.b, allow_pickle=args.allow_pickle, rtol=args.rtol, atol=args.atol
        )
        print(format_diff(result, args.a, args.b))
        return 0 if result.identical else 1
    except BrokenPipeError:
        # The reader stopped early (``| head``): not an error of ours. Python's own
        # flush at exit would fail again on the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (CheckpointError, OSError, ValueError, TypeError, KeyError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
