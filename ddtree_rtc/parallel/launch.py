"""Where a rank learns who it is, and the local spawner behind ``ddtree-rtc run --nproc N``.

A rank's identity comes from the variables the usual launchers set: torchrun (RANK, WORLD_SIZE,
LOCAL_RANK), mpirun (OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK), srun (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID); rank 0 hands out the NCCL id at MASTER_ADDR, port MASTER_PORT + 1 (or
DDTREE_RTC_STORE_PORT). ``spawn`` starts N
copies of a command with those variables set, lets rank 0 alone print, and ends the whole job as
soon as one rank fails, with that rank's own error text.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass

from .comm import Communicator, DistError, SingleRank

# (rank, world size, local rank) variable names per launcher, first match wins
LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)
DEFAULT_PORT = 29500  # torchrun's


@dataclass(frozen=True)
class RankEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    launcher: str = "none"
    store_port: int | None = None  # DDTREE_RTC_STORE_PORT

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def nccl_id_port(self) -> int:
        """Where rank 0 hands out the NCCL id: DDTREE_RTC_STORE_PORT, else MASTER_PORT + 1 (torchrun's
        own store already listens on MASTER_PORT)."""
        return self.store_port if self.store_port is not None else self.master_port + 1


def _int(env, name: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise DistError(f"{name}={raw!r}: expected an integer") from None


def rank_env(environ=None) -> RankEnv:
    """This process's place in the job (world size 1 when no launcher variables are set)."""
    env = os.environ if environ is None else environ
    for launcher, r, w, lr in LAUNCHERS:
        if r in env and w in env:
            rank, world = _int(env, r), _int(env, w)
            local = _int(env, lr) if lr in env else rank
            if world < 1 or not 0 <= rank < world:
                raise DistError(f"{r}={rank}, {w}={world}: need 0 <= rank < world size")
            port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_PORT
            store = _int(env, "DDTREE_RTC_STORE_PORT") if "DDTREE_RTC_STORE_PORT" in env else None
            return RankEnv(rank, world, local, env.get("MASTER_ADDR", "127.0.0.1"), port, launcher, store)
    return RankEnv()


def make_communicator(env: RankEnv, cuda: bool) -> Communicator:
    """NCCL on the CUDA backend, the shared-memory transport on the numpy backend; world 1: none."""
    if env.world_size == 1:
        return SingleRank()
    if cuda:
        from .nccl import NcclCommunicator

        return NcclCommunicator(env.rank, env.world_size, env.local_rank, env.master_addr, env.nccl_id_port)
    from .local import LocalCommunicator, job_id

    return LocalCommunicator(env.rank, env.world_size, job_id())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(DistError):
    """A spawned rank exited with an error; ``rank``, ``code`` and its error text."""

    def __init__(self, rank: int, code: int, text: str):
        self.rank, self.code, self.text = rank, code, text
        tail = text.strip() or "(no error text)"
        super().__init__(f"rank {rank} failed (exit code {code}): {tail}")


def _tail(path: str, limit: int = 4000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-limit:]


def spawn(command: list[str], nproc: int, poll_s: float = 0.05, env: dict | None = None) -> None:
    """Run ``command`` as ranks 0..nproc-1 of one local job and wait. Rank 0 keeps this process's
    stdout / stderr; the others' stdout is dropped and their stderr kept for their error text. The
    first rank to fail ends the job: the others are killed and ``RankFailed`` carries the failing
    rank's text (a rank that exits 0 while others run is fine)."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    base = dict(os.environ if env is None else env)
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), DDTREE_RTC_STORE_PORT=str(free_port()),
                WORLD_SIZE=str(nproc), DDTREE_RTC_JOB=uuid.uuid4().hex[:12])
    procs, logs = [], []
    with tempfile.TemporaryDirectory(prefix="ddtree_ranks_") as tmp:
        try:
            for r in range(nproc):
                e = dict(base, RANK=str(r), LOCAL_RANK=str(r))
                if r == 0:
                    log = None
                    procs.append(subprocess.Popen(command, env=e))
                else:
                    log = os.path.join(tmp, f"rank{r}.err")
                    with open(log, "w") as f:
                        procs.append(subprocess.Popen(command, env=e, stdout=subprocess.DEVNULL, stderr=f))
                logs.append(log)
            running = set(range(nproc))
            while running:
                for r in sorted(running):
                    code = procs[r].poll()
                    if code is None:
                        continue
                    running.discard(r)
                    if code != 0:
                        stop_ranks(procs)
                        raise RankFailed(r, code, _tail(logs[r]) if logs[r] else
                                         "(its error is printed above)")
                time.sleep(poll_s)
        finally:
            stop_ranks(procs)


def stop_ranks(procs, wait_s: float = 5.0) -> None:
    """SIGTERM every rank still running (and SIGCONT, so a stopped one can act on it); SIGKILL what is
    left after ``wait_s``."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
            p.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + wait_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def rank_command(args: list[str]) -> list[str]:
    """The command a spawned rank runs: this Python, ``-m ddtree_rtc.cli`` and ``args``."""
    return [sys.executable, "-m", "ddtree_rtc.cli", *args]
