"""The ``weightstream`` command.

weightstream run CPU -p params.yaml -m train -o model_dir   (or: weightstream CPU -p ...)
weightstream launch --num_csx N script.py [args]
weightstream checkpoint {info,convert,copy,diff} ...
"""

from __future__ import annotations

import importlib
import sys

USAGE = """usage: weightstream <command> [args]

commands:
  run {CPU,GPU} -p PARAMS -m MODE -o MODEL_DIR   train or evaluate a model from a params file
  launch --num_csx N script.py [args]            run an API script on N data-parallel ranks
  checkpoint {info,convert,copy,diff} ...        inspect, convert, copy and compare checkpoints
  data write-gpt-hdf5 ...                        write a text corpus in the GPT HDF5 format
  input-analyzer -p PARAMS [--max_workers N]     measure input workers against the model's need

`weightstream <command> -h` describes each command."""

# command -> the module whose main(argv) runs it
_COMMANDS = {
    "run": "weightstream.cli.run",
    "launch": "weightstream.cli.launch",
    "checkpoint": "weightstream.checkpoint.cli",
    "input-analyzer": "weightstream.cli.input_analyzer",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command.upper() in ("CPU", "GPU", "CSX"):  # the reference's `run.py CPU -p ...`
        command, rest = "run", argv
    if command in _COMMANDS:  # imported when used: each pulls in its own dependencies
        return importlib.import_module(_COMMANDS[command]).main(rest)
    if command == "data":
        if not rest or rest[0] != "write-gpt-hdf5":
            asked = bool(rest) and rest[0] in ("-h", "--help")
            print(
                "usage: weightstream data write-gpt-hdf5 [args]\n\n"
                "subcommands:\n"
                "  write-gpt-hdf5   write a text corpus in the GPT HDF5 format "
                "(`weightstream data write-gpt-hdf5 -h` describes its arguments)",
                file=sys.stdout if asked else sys.stderr,
            )
            return 0 if asked else 2
        from weightstream.data.hdf5_writer_cli import main as writer_main

        return writer_main(rest[1:])
    print(f"weightstream: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
