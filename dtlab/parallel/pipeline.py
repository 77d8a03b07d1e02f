"""Pipeline parallelism built from scratch: the model cut into stages, micro-batches passed along.

Rank s holds stage s: a contiguous run of the model's layers. A batch is cut into M
micro-batches; stage s receives a micro-batch's activation from stage s-1, runs its layers and
sends the result to stage s+1; the last stage computes the loss. Backward runs the other way:
stage s receives the gradient of its output from stage s+1, back-propagates through its layers
(its parameters get their gradients) and sends the gradient of its input to stage s-1.

Which micro-batch a stage works on when is the *schedule*, a list of actions per stage:

    GPipe:  F0 F1 ... F(M-1)  B0 B1 ... B(M-1)         all forwards, then all backwards
    1F1B:   (P-s-1 warm-up forwards)  then F, B, F, B ...  then the remaining backwards

Both compute the same gradients. GPipe holds all M micro-batches' activations at once before the
first backward; 1F1B starts backward as soon as the last stage can, so stage s holds at most
P - s. Both leave each stage idle while the pipeline fills and drains: with equal stages, a
fraction (P-1)/(M+P-1) of the step (``bubble_fraction``) — more micro-batches, smaller bubble.

    stage = PipelineStage(layers_of_this_rank, stage=rank, stages=world)   # after init_process_group
    stage.check_shapes(micro_batch_shape)           # once: every stage agrees, or all raise
    result = stage.step(one_f_one_b(M, world, rank), inputs=micro_batches, targets=targets,
                        loss_fn=F.cross_entropy)    # gradients now in stage.module's parameters
    result.losses, result.peak_in_flight, result.events   # last stage's losses, activations held, timeline

Sends are posted without waiting, as soon as their tensor is ready — except when the stage's next
action receives from the same neighbour: then send and receive go out together
(``batch_isend_irecv``), so two neighbours each sending to the other never wait on each other
(NCCL runs a pair's point-to-point operations in order; gloo does not care).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from dtlab.measure import SavedBytes

Action = tuple[str, int]          # ("F", micro-batch) or ("B", micro-batch)


def gpipe(micro_batches: int, stages: int, stage: int) -> list[Action]:
    """GPipe's actions for ``stage``: every forward, then every backward."""
    _check_schedule(micro_batches, stages, stage)
    return [("F", m) for m in range(micro_batches)] + [("B", m) for m in range(micro_batches)]


def one_f_one_b(micro_batches: int, stages: int, stage: int) -> list[Action]:
    """1F1B's actions for ``stage``: ``stages - stage - 1`` warm-up forwards, then alternate, then drain."""
    _check_schedule(micro_batches, stages, stage)
    warm = min(stages - stage - 1, micro_batches)
    actions: list[Action] = [("F", m) for m in range(warm)]
    for f, b in zip(range(warm, micro_batches), range(micro_batches)):
        actions += [("F", f), ("B", b)]
    actions += [("B", b) for b in range(micro_batches - warm, micro_batches)]
    return actions


SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def bubble_fraction(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """Share of a step each stage sits idle: (P-1) / (v·M + P-1) with v model chunks per stage (v = 1: plain)."""
    return (stages - 1) / (chunks * micro_batches + stages - 1)


def bubble_ratio(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """Idle time over useful time, the Megatron-LM paper's form: (P-1) / (v·M)."""
    return (stages - 1) / (chunks * micro_batches)


def split_model(model: nn.Sequential, stages: int) -> list[nn.Sequential]:
    """Cut an ``nn.Sequential`` into ``stages`` contiguous pieces with as equal a number of layers as can be.

    A "layer" is a module with parameters together with the parameter-free modules after it (its
    activation), so no stage starts with a stray ReLU. Raises ``ValueError`` with more stages than layers.
    """
    units: list[list[nn.Module]] = []
    for module in model:
        if any(True for _ in module.parameters()) or not units:
            units.append([module])
        else:
            units[-1].append(module)
    if not 1 <= stages <= len(units):
        raise ValueError(f"{stages} pipeline stages for a model of {len(units)} layers: every stage needs at least "
                         f"one. Fix: at most {len(units)} stages (or a deeper model)")
    base, extra = divmod(len(units), stages)
    pieces, start = [], 0
    for s in range(stages):
        end = start + base + (1 if s < extra else 0)
        pieces.append(nn.Sequential(*[m for unit in units[start:end] for m in unit]))
        start = end
    return pieces


def split_micro_batches(batch: torch.Tensor, micro_batches: int) -> list[torch.Tensor]:
    """``micro_batches`` equal slices of ``batch`` along dimension 0 (the batch must divide evenly)."""
    if micro_batches < 1 or batch.shape[0] % micro_batches:
        size = batch.shape[0]
        fits = max(d for d in range(1, size + 1) if size % d == 0 and d <= max(1, micro_batches))
        raise ValueError(f"a batch of {size} cannot be cut into {micro_batches} equal micro-batches. "
                         f"Fix: a micro-batch count that divides the batch (e.g. {fits})")
    return list(batch.chunk(micro_batches))


@dataclass
class StepResult:
    """What one ``PipelineStage.step`` did on this rank.

    ``losses``: each micro-batch's loss as computed (last stage only; unscaled); ``peak_in_flight``:
    the most micro-batches whose activations this stage held at once; ``saved_bytes``: per micro-batch,
    the bytes its forward saved for backward (saved-tensor hooks: ``dtlab.measure.SavedBytes``), and
    ``peak_saved_bytes`` the most of those this stage held at once; ``events``: (action, micro-batch,
    start, end) of each action's compute, seconds from the step's start (after a barrier).
    """

    losses: list[float] = field(default_factory=list)
    peak_in_flight: int = 0
    saved_bytes: dict[int, int] = field(default_factory=dict)
    peak_saved_bytes: int = 0
    events: list[tuple[str, int, float, float]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def busy(self) -> float:
        """Seconds this stage computed."""
        return sum(end - start for _, _, start, end in self.events)


class PipelineStage:
    """One stage of a pipeline: ``module`` on rank ``stage`` of ``group``, talking to its neighbours.

    ``work_s`` adds a fixed cost per micro-batch (sleeping ``work_s`` in each forward and twice that
    in each backward, the usual ratio), so a lesson can make stage work dominate a noisy machine's.
    """

    def __init__(self, module: nn.Module, stage: int, stages: int, group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu", work_s: float = 0.0):
        if dist.get_world_size(group) != stages or dist.get_rank(group) != stage:
            raise ValueError(f"stage {stage} of {stages} on rank {dist.get_rank(group)} of a group of "
                             f"{dist.get_world_size(group)}. Fix: one stage per rank "
                             "(stage = rank, stages = group size)")
        self.module, self.stage, self.stages, self.group = module, stage, stages, group
        self.device, self.work_s = torch.device(device), work_s
        self.first, self.last = stage == 0, stage == stages - 1
        self.in_shape: tuple[int, ...] | None = None
        self.out_shape: tuple[int, ...] | None = None
        self.dtype = next(module.parameters()).dtype

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage) if self.group is not None else stage

    def check_shapes(self, micro_batch_shape: Sequence[int], input_dtype: torch.dtype = torch.float32) -> None:
        """Pass one micro-batch's shape down the pipeline, each stage running its layers on zeros of it.

        Every stage learns the shape it receives and sends. If any stage cannot take what the one
        before it sends, every rank raises the same ``ValueError`` naming the stage (nobody is left
        waiting for an activation that will never come).
        """
        problem = ""
        shape = tuple(micro_batch_shape)
        if not self.first:
            message = torch.zeros(8, dtype=torch.long)
            dist.recv(message, src=self._peer(self.stage - 1), group=self.group)
            shape = tuple(int(d) for d in message if d > 0) if message[0] >= 0 else ()
            if not shape:
                problem = "upstream"
        if not problem:
            try:
                with torch.no_grad():
                    probe = torch.zeros(shape, dtype=input_dtype if self.first else self.dtype, device=self.device)
                    out = self.module(probe)
                self.in_shape, self.out_shape = shape, tuple(out.shape)
            except (RuntimeError, ValueError, IndexError) as err:
                problem = f"stage {self.stage} cannot take the {list(shape)} it receives: {str(err).splitlines()[0]}"
        if not self.last:
            message = torch.full((8,), -1, dtype=torch.long)
            if not problem:
                message[:len(self.out_shape)] = torch.tensor(self.out_shape)
                message[len(self.out_shape):] = 0
            dist.send(message, dst=self._peer(self.stage + 1), group=self.group)
        reports = [None] * self.stages
        dist.all_gather_object(reports, problem if problem != "upstream" else "", group=self.group)
        found = [r for r in reports if r]
        if found:
            raise ValueError(f"the pipeline's stages disagree on shapes: {found[0]}. Fix: make each stage's "
                             "output shape the next stage's input shape (split the model at a layer boundary)")

    def step(self, schedule: Sequence[Action], inputs: Sequence[torch.Tensor] | None = None,
             targets: Sequence[torch.Tensor] | None = None, loss_fn: Callable | None = None,
             average: bool = True) -> StepResult:
        """Run ``schedule`` (this stage's actions) on one batch; gradients accumulate in the module's parameters.

        ``inputs``: the micro-batches (first stage only); ``targets`` and ``loss_fn(output, target)``
        (last stage only). ``average=True`` divides each micro-batch's loss by M, so the gradients are
        those of the whole batch's mean loss, as one process would compute them.
        """
        if self.in_shape is None:
            raise RuntimeError("call check_shapes(micro_batch_shape) once before step(): the stages must agree "
                               "on the shapes they exchange")
        m_count = sum(1 for kind, _ in schedule if kind == "F")
        if self.first and (inputs is None or len(inputs) != m_count):
            raise ValueError(f"the first stage needs the {m_count} micro-batches of its schedule as inputs")
        if self.last and (targets is None or loss_fn is None or len(targets) != m_count):
            raise ValueError(f"the last stage needs {m_count} targets and a loss_fn")
        held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        pending: list[dist.P2POp] = []
        sent: list = []
        result = StepResult()
        holding = 0                                    # bytes saved for backward by the micro-batches held
        dist.barrier(group=self.group)
        t0 = time.perf_counter()

        def exchange(recv_from: int | None, shape: tuple[int, ...]) -> torch.Tensor | None:
            """Post the pending sends together with this receive; wait for the receive."""
            ops = list(pending)
            pending.clear()
            buffer = None
            if recv_from is not None:
                buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buffer, self._peer(recv_from), self.group))
            if ops:
                works = dist.batch_isend_irecv(ops)
                sent.extend(zip(works[:-1] if buffer is not None else works, ops))   # the op keeps its tensor alive
                if buffer is not None:
                    works[-1].wait()
            return buffer

        def send(tensor: torch.Tensor, to: int, index: int) -> None:
            """Post a send now; or, when this stage's next action first receives from the same peer, with
            that receive (NCCL runs a pair's operations in order: a send waiting for a peer that is itself
            sending to us would never start)."""
            pending.append(dist.P2POp(dist.isend, tensor, self._peer(to), self.group))
            if self._next_receive_from(schedule, index + 1) != to:
                exchange(None, ())

        for index, (kind, m) in enumerate(schedule):
            if kind == "F":
                x = inputs[m].to(self.device) if self.first else exchange(self.stage - 1, self.in_shape)
                if not self.first:
                    x.requires_grad_(True)
                start = time.perf_counter()
                with SavedBytes() as saved:
                    out = self.module(x)
                    if self.last:
                        loss = loss_fn(out, targets[m].to(self.device))
                        result.losses.append(loss.item())
                        out = loss / m_count if average else loss
                result.saved_bytes[m] = saved.bytes
                holding += saved.bytes
                result.peak_saved_bytes = max(result.peak_saved_bytes, holding)
                self._work(1)
                result.events.append(("F", m, start - t0, time.perf_counter() - t0))
                held[m] = (x, out)
                result.peak_in_flight = max(result.peak_in_flight, len(held))
                if not self.last:
                    send(out.detach().contiguous(), self.stage + 1, index)
            else:
                grad = None if self.last else exchange(self.stage + 1, self.out_shape)
                x, out = held.pop(m)
                start = time.perf_counter()
                torch.autograd.backward(out, grad_tensors=grad)
                holding -= result.saved_bytes[m]
                self._work(2)
                result.events.append(("B", m, start - t0, time.perf_counter() - t0))
                if not self.first:
                    send(x.grad.contiguous(), self.stage - 1, index)
        exchange(None, ())
        for work, _op in sent:
            work.wait()
        result.seconds = time.perf_counter() - t0
        return result

    def _next_receive_from(self, schedule: Sequence[Action], index: int) -> int | None:
        """The stage the action at ``index`` receives from first (None: no action, or one that receives nothing)."""
        if index >= len(schedule):
            return None
        if schedule[index][0] == "F":
            return None if self.first else self.stage - 1
        return None if self.last else self.stage + 1

    def _work(self, units: int) -> None:
        if self.work_s:
            time.sleep(units * self.work_s)


def _check_schedule(micro_batches: int, stages: int, stage: int) -> None:
    if micro_batches < 1 or stages < 1 or not 0 <= stage < stages:
        raise ValueError(f"micro_batches={micro_batches}, stages={stages}, stage={stage}: need M >= 1, P >= 1 and "
                         "0 <= stage < P")


def idle_fraction(results: Sequence[StepResult]) -> float:
    """The measured bubble: the mean over stages of 1 - busy / step time (the slowest stage's step time)."""
    span = max(r.seconds for r in results)
    return sum(1 - r.busy / span for r in results) / len(results)


def plot_timeline(ax, results: Sequence[StepResult], title: str = "") -> None:
    """A Gantt chart of one step: a row per stage, forward (light) and backward (dark) boxes labelled by micro-batch."""
    for s, r in enumerate(results):
        for kind, m, start, end in r.events:
            ax.barh(s, end - start, left=start, color="tab:blue" if kind == "F" else "tab:orange",
                    edgecolor="white", height=0.8)
            ax.text((start + end) / 2, s, f"{m}", ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(results)), [f"stage {s}" for s in range(len(results))], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (blue: forward, orange: backward; white space: the bubble)", fontsize=7)
    ax.set_title(title, fontsize=8)
