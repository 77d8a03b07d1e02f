"""Small helpers around ``torch.distributed``: start, stop, who am I, rank-0-only work, seeding.

Lessons call ``dist.init_process_group`` themselves where the call *is* the lesson; these helpers
are the plumbing for everything else. Nothing here keeps global state of its own: every answer
comes from ``torch.distributed`` or from the environment variables a launcher sets
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), as torchrun,
TorchDistributor, the DeepSpeed launcher and ``dtlab.launch`` all do.

Typical worker::

    from dtlab import distributed as dd
    device = dd.setup()            # reads the launcher's env, picks backend, pins the GPU
    ...                            # train
    dd.print0("done")              # printed once, by rank 0
    dd.teardown()                  # barrier, then destroy_process_group (teardown(failed=True) on errors)
"""

from __future__ import annotations

import functools
import os
import random
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from dtlab import _compat  # noqa: F401  (work-arounds for the runtime's torch and DeepSpeed)
from dtlab.environment import plan

T = TypeVar("T")

#: ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` under the names torch 2.13 gives them (the old
#: names warn there); torch 2.3, on Databricks Runtime 15.4 LTS ML, has only the old ones.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

#: How long a collective may wait for its peers before raising instead of hanging forever.
#: Override with the environment variable ``DTLAB_TIMEOUT_S``. (PyTorch's own default is
#: 10 minutes for nccl and 30 minutes for gloo: far too long to notice a dead peer in a lesson.)
DEFAULT_TIMEOUT = timedelta(seconds=float(os.environ.get("DTLAB_TIMEOUT_S", "120")))


def initialized() -> bool:
    """True when this process is in a process group (``init_process_group`` ran and was not torn down)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank of this process (0 when not distributed)."""
    if initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def world_size() -> int:
    """Number of processes in the job (1 when not distributed)."""
    if initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    """Rank of this process on its own machine: the GPU it should use."""
    return int(os.environ.get("LOCAL_RANK", 0))


def machine_ranks() -> tuple[int, int]:
    """This rank's place among the ranks on its own machine, ``(local rank, ranks on this machine)``, from the
    machines' host names (a collective; needs a process group).

    ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` say what the launcher started on one "node", which is not always one
    machine: ``TorchDistributor(local_mode=False)`` starts every Spark task as its own node of one process, though a
    4-GPU worker runs four of them. Libraries that share memory between the ranks of a machine (Mosaic Streaming)
    need the machine. Raises ``ValueError`` where a machine's ranks are not consecutive (such libraries number
    machines as ``rank // ranks per machine``)."""
    hosts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    mine = [r for r, h in enumerate(hosts) if h == hosts[dist.get_rank()]]
    if mine != list(range(mine[0], mine[0] + len(mine))) or len(set(Counter(hosts).values())) != 1:
        raise ValueError(f"the ranks' machines are {hosts}: not the same number of ranks on each, in consecutive "
                         "runs. Fix: one process per machine, or TorchDistributor(local_mode=True) on one machine")
    return mine.index(dist.get_rank()), len(mine)


def is_main() -> bool:
    """True on the one process that logs, prints and saves (global rank 0)."""
    return rank() == 0


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only, flushed so that launchers show it at once."""
    if is_main():
        print(*args, **kwargs, flush=True)


def on_rank0(fn: Callable[..., T]) -> Callable[..., T | None]:
    """Decorator: run ``fn`` on rank 0 only (other ranks get None). Does not synchronise."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T | None:
        return fn(*args, **kwargs) if is_main() else None

    return wrapper


def barrier() -> None:
    """Wait for every rank (a no-op when not distributed)."""
    if initialized():
        dist.barrier()


#: Lowest port ``free_port`` hands out, and how long a port it handed out stays promised to its caller.
PORTS_FROM, PORT_CLAIM_S = 15000, 300.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and stays free until the caller's workers bind it.

    A port the kernel picks (``bind(("", 0))``) is only free for a moment: it comes from the ephemeral range, and
    any other program's next connection or listening socket may take it before the launched rank 0 binds it
    (two test suites side by side then meet in one rendezvous and fail at their first collective). So the port is
    drawn at random *below* the ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), where the kernel
    never hands out ports, and promised to this caller for ``PORT_CLAIM_S`` seconds by a file in
    ``$TMPDIR/dtlab-ports`` that other ``free_port`` calls respect. Where that range is too small, the kernel's
    pick is returned, as before.
    """
    low, high = PORTS_FROM, _ephemeral_start() - 1
    if high - low >= 1000:
        draw = random.SystemRandom()                  # not the seeded ``random``: two seeded processes would agree
        for _ in range(100):
            port = draw.randint(low, high)
            if _bindable(port) and _claim(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sweep(folder: str, before: float) -> None:
    for name in os.listdir(folder):
        try:
            if os.path.getmtime(os.path.join(folder, name)) < before:
                os.unlink(os.path.join(folder, name))
        except OSError:
            pass


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768                                  # Linux's default; macOS's starts at 49152


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _claim(port: int) -> bool:
    """Promise ``port`` to this caller unless another ``free_port`` promised it less than PORT_CLAIM_S ago."""
    import tempfile
    import time

    folder = os.path.join(tempfile.gettempdir(), "dtlab-ports")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, str(port))
    for _ in range(2):
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            if random.SystemRandom().random() < 0.02:  # now and then, forget the promises that have lapsed
                _sweep(folder, time.time() - PORT_CLAIM_S)
            return True
        except FileExistsError:
            try:
                if time.time() - os.path.getmtime(path) < PORT_CLAIM_S:
                    return False
                os.unlink(path)                       # a stale promise: take it (one of two racing callers wins)
            except OSError:
                return False
        except OSError:
            return True                               # no writable temp folder: the range alone must do
    return False


def setup(backend: str | None = None, timeout: timedelta | None = None) -> torch.device:
    """Join the process group described by the launcher's environment variables.

    Picks the backend with ``dtlab.environment.plan`` for the ``LOCAL_WORLD_SIZE`` processes of this
    machine (nccl with a GPU per process, gloo otherwise) unless one is given, pins
    ``cuda:LOCAL_RANK`` when on GPUs, and uses ``DEFAULT_TIMEOUT`` so that a dead peer raises
    instead of hanging. Returns the device this rank should use.

    Without a launcher (no ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``, e.g. the
    training function called directly in a notebook cell to debug it) it starts a group of one
    process on 127.0.0.1, as nanoGPT runs without torchrun: the same code, world size 1.

    Raises:
        RuntimeError: when only some of the launcher's variables are set, naming the missing ones.
    """
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    missing = [k for k in names if k not in os.environ]
    if 0 < len(missing) < len(names):
        raise RuntimeError(f"setup() found only some of the launcher's environment variables; missing: "
                           f"{', '.join(missing)}. Fix: start this code with dtlab.launch.run, torchrun, "
                           "TorchDistributor or the deepspeed launcher (which set all four), or unset them all "
                           "to run as a single process.")
    # The processes on this machine decide: more of them than GPUs means CPU processes with gloo
    # (a one-GPU workstation running a 2-process lesson), as dtlab.environment.plan explains.
    p = plan(backend=backend, nprocs=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if p.device == "cuda":
        device = torch.device("cuda", local_rank())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        timeout = timeout or DEFAULT_TIMEOUT
        if missing:  # no launcher: a world of one
            dist.init_process_group(p.backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                    timeout=timeout)
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            dist.init_process_group(p.backend, store=_attempt_store(timeout), rank=rank(), world_size=world_size(),
                                    timeout=timeout)
        else:
            dist.init_process_group(p.backend, timeout=timeout)
    return device


def local_device(device_type: str) -> torch.device:
    """This rank's device for a plan's device type: ``cuda:LOCAL_RANK`` for ``"cuda"``, else the CPU.

    Lessons write ``dev = local_device(cfg["device"])`` with ``cfg["device"]`` from
    ``dtlab.environment.plan``, so no cell names a device itself.
    """
    if device_type == "cuda":
        return torch.device("cuda", local_rank())
    if device_type != "cpu":
        raise ValueError(f"device type {device_type!r}: use a plan's device, 'cuda' or 'cpu'")
    return torch.device("cpu")


def collective_device() -> torch.device:
    """Where a tensor must live to go through the current process group: the GPU for nccl, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``src``'s ``obj`` on every rank (any picklable value; works on gloo and nccl). Not distributed: ``obj``."""
    if not initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_agree(ok: bool) -> list[bool]:
    """Every rank's ``ok``, in rank order, on every rank: a collective to agree on success *before*
    a barrier, so one rank's failure becomes an error everywhere instead of a wait for the timeout."""
    if not initialized() or dist.get_world_size() == 1:
        return [bool(ok)]
    flags = torch.tensor([int(bool(ok))], device=collective_device())
    gathered = [torch.zeros_like(flags) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flags)
    return [bool(f.item()) for f in gathered]


def _attempt_store(timeout: timedelta) -> dist.Store:
    """torchrun's store, with keys private to this restart attempt.

    torchrun keeps one key-value store across restarts; without a per-attempt prefix a restarted
    rank can read the address a rank of the *previous* attempt published, and gloo then fails
    with "connectFullMesh ... Connection refused" (or waits) on about half the restarts (measured
    with torch 2.13; pytorch/pytorch#167288 reports the same with NCCL).
    """
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size(),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"dtlab/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


def teardown(failed: bool = False) -> None:
    """Leave the process group.

    Normally a barrier comes first, so no rank exits while others still talk. ``failed=True`` (call
    it so from an ``except`` block) skips the barrier: a rank that raised must not wait for peers
    that are busy elsewhere — it would sit out the whole timeout and then stack a barrier error on
    top of the real one. Leaving at once closes its connections, so the peers' next collective fails
    quickly too.
    """
    if initialized():
        try:
            if not failed:
                dist.barrier()
        finally:
            dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every GPU) so a run can be repeated exactly."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


@dataclass
class GroupTally:
    """A process group (``None``: the default, whole-world one) and a tally of what was sent over it.

    The from-scratch strategies in ``dtlab.parallel`` each extend it with their own collectives and
    count them in ``counts``, so a lesson can show what a step communicated.
    """

    group: dist.ProcessGroup | None = None
    counts: Counter = field(default_factory=Counter)

    @property
    def rank(self) -> int:
        """This process's rank within the group."""
        return dist.get_rank(self.group)

    @property
    def size(self) -> int:
        """The number of ranks in the group."""
        return dist.get_world_size(self.group)

    def global_rank(self, group_rank: int) -> int:
        """The world rank of the group's rank ``group_rank`` (what point-to-point calls take)."""
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank


class AllToAll(torch.autograd.Function):
    """A differentiable all-to-all over a ``GroupTally`` with an ``all_to_all(x, a, b)`` method whose inverse is
    ``all_to_all(y, b, a)`` (the same exchange, its two layouts swapped): ``AllToAll.apply(x, group, a, b)``.

    Its backward sends each gradient back where its row came from. Expert parallelism passes the split sizes
    (``a``: sent, ``b``: received), Ulysses the dimensions (``a``: scattered, ``b``: gathered).
    """

    @staticmethod
    def forward(ctx, x, group, a, b):
        ctx.group, ctx.layouts = group, (a, b)
        return group.all_to_all(x, a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.layouts
        return ctx.group.all_to_all(grad, b, a), None, None, None
