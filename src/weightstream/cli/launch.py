"""Start ``--num_csx N`` local ranks of the run command and watch them.

Each rank is a process running the same command with the torchrun environment
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); the ranks talk
through torch.distributed. If a rank exits with an error or is killed, the
launcher stops the others and exits non-zero with a message naming that rank,
so a run never hangs on a lost peer.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

log = logging.getLogger("weightstream")

# After the first failure, how long the other ranks get to notice and exit.
GRACE_SECONDS = 10.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: list[str], num_ranks: int) -> int:
    """Run ``python -m weightstream run *argv`` as ``num_ranks`` ranks; return the exit code."""
    port = _free_port()
    procs = []
    for r in range(num_ranks):
        env = dict(os.environ)
        env.update(
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(num_ranks),
            LOCAL_WORLD_SIZE=str(num_ranks),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            # Two ranks share this machine's cores.
            OMP_NUM_THREADS=env.get(
                "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // num_ranks))
            ),
        )
        procs.append(
            subprocess.Popen([sys.executable, "-m", "weightstream", "run", *argv], env=env)
        )
    log.info("Started %d ranks: pids %s", num_ranks, ", ".join(str(p.pid) for p in procs))
    failed: tuple[int, int] | None = None
    deadline = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            if failed is None:
                for r, c in enumerate(codes):
                    if c is not None and c != 0:
                        failed = (r, c)
                        deadline = time.monotonic() + GRACE_SECONDS
                        break
            if all(c is not None for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                for p in procs:
                    p.wait()
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait()
        return 130
    if failed is not None:
        r, c = failed
        how = f"was killed by signal {-c}" if c < 0 else f"exited with code {c}"
        log.error(
            "rank %d of %d %s; the run was stopped. The newest complete checkpoint in the model "
            "directory is intact: rerun the same command to resume from it.",
            r,
            num_ranks,
            how,
        )
        return 1
    return 0
