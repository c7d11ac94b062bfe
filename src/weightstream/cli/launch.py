"""Start N local data-parallel ranks with torchrun's machinery, and watch them.

``weightstream launch --num_csx N script.py [args]`` runs a script written for
the API (``import weightstream as cstorch``) on N ranks, and the run command's
``--num_csx N`` runs itself the same way. The ranks are started and watched by
torch's elastic agent (what ``torchrun --standalone`` runs): it sets the
torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
for each, and the API joins the process group from it by itself
(``cstorch.compile``). If a rank exits with an error or is killed, the agent
stops the others; the launcher then exits non-zero with a message naming that
rank, so a run never hangs on a lost peer.

Note [one line per error]
-------------------------
The ranks read the same params, checkpoint and data, so bad input stops every
rank with the same message. The launcher gives the ranks a directory
(``WEIGHTSTREAM_RANK_ERRORS``) where the run command leaves the message it
stopped with (:func:`report_error`): rank 0 also logs its own at once, the
others only leave theirs, and when the ranks have stopped the launcher prints
each message rank 0 did not, once, with the ranks that met it. Without the
launcher (ranks started by hand under torchrun) each rank logs its own, the
line of a rank other than 0 saying whose it is.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from pathlib import Path

log = logging.getLogger("weightstream")

#: The directory where each rank leaves the message it stopped with (Note [one line
#: per error]); set by the launcher for its ranks.
RANK_ERRORS = "WEIGHTSTREAM_RANK_ERRORS"


def report_error(message: str) -> None:
    """Log the error a rank stops with, once over the ranks (Note [one line per error])."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE", "1")
    directory = os.environ.get(RANK_ERRORS)
    if rank is not None and directory:
        path = Path(directory) / f"{rank}.txt"
        try:  # whole or not at all: the launcher may read it as soon as this rank ends
            tmp = path.with_suffix(".tmp")
            tmp.write_text(message)
            tmp.replace(path)
        except OSError:
            directory = None  # no place to leave it: this rank says it itself
    if rank in (None, "0") or not directory:
        log.error("%s", message if rank in (None, "0") else f"rank {rank} of {world}: {message}")


def _print_rank_errors(directory: Path, num_ranks: int) -> None:
    """The messages the ranks other than 0 left that rank 0 did not log, each once."""
    said: dict[str, list[int]] = {}
    for rank in range(num_ranks):
        with_error = directory / f"{rank}.txt"
        if with_error.is_file():
            said.setdefault(with_error.read_text(), []).append(rank)
    for message, ranks in said.items():
        if 0 in ranks:
            continue  # rank 0 logged it as it stopped
        whose = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        log.error("%s of %d: %s", whose, num_ranks, message)


def launch(command: list[str], num_ranks: int) -> int:
    """Run ``python *command`` as ``num_ranks`` local ranks; return the exit code."""
    from torch.distributed.launcher.api import LaunchConfig

    # The ranks share this machine's cores (torchrun would set 1 thread, with a warning).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // num_ranks)))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=num_ranks,
        run_id=str(uuid.uuid4()),
        # torchrun --standalone: a rendezvous on this machine, on a free port.
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.2,
    )
    # torch's agent logs every start and stop at INFO; only its warnings matter here. A
    # rank's failure it logs at ERROR too ("failed (exitcode: 2) local_rank: 0 ..."):
    # the summary below says it, with what to do.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    errors = Path(tempfile.mkdtemp(prefix="weightstream-rank-errors-"))
    os.environ[RANK_ERRORS] = str(errors)  # the ranks inherit it
    try:
        return _launch(command, num_ranks, config, errors)
    finally:
        del os.environ[RANK_ERRORS]
        shutil.rmtree(errors, ignore_errors=True)


def _launch(command: list[str], num_ranks: int, config, errors: Path) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    try:
        elastic_launch(config, sys.executable)(*command)
    except ChildFailedError as e:
        _print_rank_errors(errors, num_ranks)
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        if code < 0:
            how = f"was killed by signal {-code}"
        elif failure.signal_name() != "<N/A>":
            how = f"was killed by {failure.signal_name()}"
        else:
            how = f"exited with code {code}"
        # What the run command's checkpoints promise; a script's are its own.
        resume = (
            " A checkpoint is never left half-written: once the cause is fixed, the run "
            "command resumes from its newest complete one."
            if command[:3] == ["-m", "weightstream", "run"]
            else ""
        )
        log.error(
            "rank %d of %d %s, and the other ranks were stopped: its output above says why "
            "(a rank that ended early, having run fewer steps than the others, leaves them "
            "failing in a collective instead).%s",
            rank,
            num_ranks,
            how,
            resume,
        )
        return 1
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except SignalException as e:  # SIGTERM (a scheduler's stop) or SIGHUP to this launcher
        log.error(
            "stopped by %s: the %d ranks were stopped with it. A checkpoint is never left "
            "half-written: the same command resumes from the newest complete one.",
            e.sigval.name,
            num_ranks,
        )
        return 128 + int(e.sigval)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``weightstream launch --num_csx N script.py [args]``."""
    parser = argparse.ArgumentParser(
        prog="weightstream launch",
        description="Run a Python script written for the weightstream API on N local "
        "data-parallel ranks (torchrun's machinery; the API joins the ranks by itself).",
    )
    parser.add_argument(
        "--num_csx", type=int, required=True, help="number of data-parallel ranks (>= 1)"
    )
    parser.add_argument("script", help="the Python script to run on every rank")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    args = parser.parse_args(argv)
    if args.num_csx < 1:
        parser.error(f"--num_csx must be >= 1, got {args.num_csx}")
    if not os.path.isfile(args.script):
        parser.error(f"no such script: {args.script}")
    if not logging.getLogger("weightstream").handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return launch([args.script, *args.args], args.num_csx)
