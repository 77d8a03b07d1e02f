"""Pipeline parallelism built from scratch: the model cut into stages, micro-batches passed along.

Rank s holds stage s: a contiguous run of the model's layers. A batch is cut into M
micro-batches; stage s receives a micro-batch's activation from stage s-1, runs its layers and
sends the result to stage s+1; the last stage computes the loss. Backward runs the other way:
stage s receives the gradient of its output from stage s+1, back-propagates through its layers
(its parameters get their gradients) and sends the gradient of its input to stage s-1.

Which micro-batch a stage works on when is the *schedule*, a list of actions per stage:

    GPipe:  F0 F1 ... F(M-1)  B0 B1 ... B(M-1)         all forwards, then all backwards
    1F1B:   (P-s-1 warm-up forwards)  then F, B, F, B ...  then the remaining backwards
    interleaved 1F1B (Megatron-LM): rank s holds v model chunks, the virtual stages s, s+P, ...,
            s+(v-1)P of a v·P-stage pipeline; micro-batches go round the ranks v times

Both compute the same gradients. GPipe holds all M micro-batches' activations at once before the
first backward; 1F1B starts backward as soon as the last stage can, so stage s holds at most
P - s. Both leave each stage idle while the pipeline fills and drains: with equal stages, a
fraction (P-1)/(M+P-1) of the step (``bubble_fraction``) — more micro-batches, smaller bubble.
Interleaving cuts each rank's layers into v chunks: a fill or drain step is then one chunk's work,
1/v of a stage's, and the bubble shrinks to (P-1)/(v·M+P-1), for v times as many sends.

    stage = PipelineStage(layers_of_this_rank, stage=rank, stages=world)   # after init_process_group
    stage.check_shapes(micro_batch_shape)           # once: every stage agrees, or all raise
    result = stage.step(one_f_one_b(M, world, rank), inputs=micro_batches, targets=targets,
                        loss_fn=F.cross_entropy)    # gradients now in stage.module's parameters
    result.losses, result.peak_in_flight, result.events   # last stage's losses, activations held, timeline

    chunks = pp.split_model(model, 2 * world)                            # interleaved: v = 2 chunks per rank
    stage = PipelineStage([chunks[rank], chunks[rank + world]], stage=rank, stages=world)
    stage.check_shapes(micro_batch_shape)
    result = stage.step(interleaved_one_f_one_b(M, world, rank, chunks=2), ...)

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
ChunkAction = tuple[str, int, int]   # ("F" or "B", micro-batch, chunk): the chunk's index on this rank


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


def interleaved_one_f_one_b(micro_batches: int, stages: int, stage: int, chunks: int = 2) -> list[ChunkAction]:
    """Megatron-LM's interleaved 1F1B for ``stage``, which holds ``chunks`` (v) model chunks.

    Chunk c of rank s is virtual stage c·P + s of a v·P-stage pipeline. Forwards run in groups of P
    micro-batches, the whole group through chunk 0, then through chunk 1, ...; backwards the same,
    chunks in reverse. Rank s first runs 2(P-s-1) + (v-1)·P forwards (so that its steady state never
    waits), then alternates one forward and one backward, then drains. Actions are ("F" or "B",
    micro-batch, chunk). With v = 1 this is ``one_f_one_b``.

    Raises ``ValueError`` when M is not a multiple of P: a group of fewer than P micro-batches would
    come back to rank 0 for its next chunk before rank 0 has finished the group (Megatron-LM refuses it too).
    """
    _check_schedule(micro_batches, stages, stage)
    if chunks < 1:
        raise ValueError(f"chunks={chunks}: each rank needs at least one model chunk")
    if chunks == 1:
        return [(kind, m, 0) for kind, m in one_f_one_b(micro_batches, stages, stage)]
    if micro_batches % stages:
        fits = max(stages, micro_batches // stages * stages)
        raise ValueError(f"interleaved 1F1B runs micro-batches in groups of P = {stages}: M = {micro_batches} is not "
                         f"a multiple of {stages}. Fix: M = {fits} (a multiple of the pipeline's ranks), or "
                         "one_f_one_b, which takes any M")
    total = micro_batches * chunks

    def unit(k: int, forward: bool) -> tuple[int, int]:
        """(micro-batch, chunk) of this rank's k-th forward (or backward)."""
        group, position = divmod(k, stages * chunks)
        chunk = position // stages
        return group * stages + position % stages, chunk if forward else chunks - 1 - chunk

    warm = min(total, 2 * (stages - stage - 1) + (chunks - 1) * stages)
    actions: list[ChunkAction] = [("F", *unit(k, True)) for k in range(warm)]
    for k in range(total - warm):
        actions += [("F", *unit(warm + k, True)), ("B", *unit(k, False))]
    actions += [("B", *unit(k, False)) for k in range(total - warm, total)]
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
    the most micro-batches (per chunk) whose activations this stage held at once; ``saved_bytes``: per
    micro-batch, the bytes its forwards on this rank saved for backward (saved-tensor hooks:
    ``dtlab.measure.SavedBytes``), and ``peak_saved_bytes`` the most of those this stage held at once;
    ``events``: (action, micro-batch, start, end, chunk) of each action's compute, seconds from the
    step's start (after a barrier).
    """

    losses: list[float] = field(default_factory=list)
    peak_in_flight: int = 0
    saved_bytes: dict[int, int] = field(default_factory=dict)
    peak_saved_bytes: int = 0
    events: list[tuple[str, int, float, float, int]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def busy(self) -> float:
        """Seconds this stage computed."""
        return sum(event[3] - event[2] for event in self.events)


class PipelineStage:
    """One stage of a pipeline: ``module`` on rank ``stage`` of ``group``, talking to its neighbours.

    ``module`` may be a list of v modules (model chunks) for an interleaved schedule: chunk c is
    virtual stage c·P + stage of a v·P-stage pipeline (``split_model(model, v * P)[c * P + stage]``);
    ``self.module`` is then an ``nn.ModuleList`` of them.

    ``work_s`` adds a fixed cost per micro-batch (sleeping ``work_s`` in each forward and twice that
    in each backward, the usual ratio; with v chunks, each chunk sleeps 1/v of it), so a lesson can
    make stage work dominate a noisy machine's.
    """

    def __init__(self, module: nn.Module | Sequence[nn.Module], stage: int, stages: int,
                 group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu", work_s: float = 0.0):
        if dist.get_world_size(group) != stages or dist.get_rank(group) != stage:
            raise ValueError(f"stage {stage} of {stages} on rank {dist.get_rank(group)} of a group of "
                             f"{dist.get_world_size(group)}. Fix: one stage per rank "
                             "(stage = rank, stages = group size)")
        self.chunks = list(module) if isinstance(module, (list, tuple, nn.ModuleList)) else [module]
        self.module = self.chunks[0] if len(self.chunks) == 1 else nn.ModuleList(self.chunks)
        self.stage, self.stages, self.group = stage, stages, group
        self.device, self.work_s = torch.device(device), work_s
        self.first, self.last = stage == 0, stage == stages - 1
        self.in_shape: list[tuple[int, ...]] | None = None      # per chunk, set by check_shapes
        self.out_shape: list[tuple[int, ...]] | None = None
        self.dtype = next(self.module.parameters()).dtype

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage) if self.group is not None else stage

    def _virtual(self, chunk: int) -> int:
        """The pipeline position of this rank's ``chunk``: chunk·P + stage."""
        return chunk * self.stages + self.stage

    @property
    def _previous(self) -> int:
        """The stage (rank) the previous virtual stage lives on."""
        return (self.stage - 1) % self.stages

    @property
    def _next(self) -> int:
        return (self.stage + 1) % self.stages

    def check_shapes(self, micro_batch_shape: Sequence[int], input_dtype: torch.dtype = torch.float32) -> None:
        """Pass one micro-batch's shape down the pipeline, each stage running its layers on zeros of it.

        Every stage (each chunk, in pipeline order) learns the shape it receives and sends. If any
        stage cannot take what the one before it sends, every rank raises the same ``ValueError``
        naming the stage (nobody is left waiting for an activation that will never come).
        """
        problem, broken = "", False
        last = len(self.chunks) * self.stages - 1
        self.in_shape, self.out_shape = [], []
        for c, chunk in enumerate(self.chunks):
            k = self._virtual(c)
            shape = tuple(micro_batch_shape)
            if k > 0:
                message = torch.zeros(8, dtype=torch.long)
                dist.recv(message, src=self._peer(self._previous), group=self.group)
                broken = bool(message[0] < 0)
                shape = tuple(int(d) for d in message if d > 0)
            if not broken:
                try:
                    with torch.no_grad():
                        probe = torch.zeros(shape, dtype=input_dtype if k == 0 else self.dtype, device=self.device)
                        out = chunk(probe)
                    self.in_shape.append(shape)
                    self.out_shape.append(tuple(out.shape))
                except (RuntimeError, ValueError, IndexError) as err:
                    problem = f"stage {k} cannot take the {list(shape)} it receives: {str(err).splitlines()[0]}"
                    broken = True
            if k < last:
                message = torch.full((8,), -1, dtype=torch.long)
                if not broken:
                    message[:len(self.out_shape[c])] = torch.tensor(self.out_shape[c])
                    message[len(self.out_shape[c]):] = 0
                dist.send(message, dst=self._peer(self._next), group=self.group)
        reports = [None] * self.stages
        dist.all_gather_object(reports, problem, group=self.group)
        found = [r for r in reports if r]
        if found:
            self.in_shape = self.out_shape = None
            raise ValueError(f"the pipeline's stages disagree on shapes: {found[0]}. Fix: make each stage's "
                             "output shape the next stage's input shape (split the model at a layer boundary)")

    def step(self, schedule: Sequence[Action | ChunkAction], inputs: Sequence[torch.Tensor] | None = None,
             targets: Sequence[torch.Tensor] | None = None, loss_fn: Callable | None = None,
             average: bool = True) -> StepResult:
        """Run ``schedule`` (this stage's actions) on one batch; gradients accumulate in the module's parameters.

        ``inputs``: the micro-batches (first stage only); ``targets`` and ``loss_fn(output, target)``
        (last stage only). ``average=True`` divides each micro-batch's loss by M, so the gradients are
        those of the whole batch's mean loss, as one process would compute them. An interleaved
        schedule's actions name the chunk: ("F", micro-batch, chunk).
        """
        if self.in_shape is None:
            raise RuntimeError("call check_shapes(micro_batch_shape) once before step(): the stages must agree "
                               "on the shapes they exchange")
        schedule = [(*action, 0) if len(action) == 2 else tuple(action) for action in schedule]
        if any(not 0 <= c < len(self.chunks) for _, _, c in schedule):
            raise ValueError(f"the schedule names chunks this stage does not hold (it holds {len(self.chunks)}). "
                             "Fix: build the stage with one module per chunk of the schedule")
        last = len(self.chunks) * self.stages - 1
        m_count = sum(1 for kind, _, c in schedule if kind == "F" and c == 0)
        if self.first and (inputs is None or len(inputs) != m_count):
            raise ValueError(f"the first stage needs the {m_count} micro-batches of its schedule as inputs")
        if self.last and (targets is None or loss_fn is None or len(targets) != m_count):
            raise ValueError(f"the last stage needs {m_count} targets and a loss_fn")
        held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        saved_by: dict[tuple[int, int], int] = {}
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

        for index, (kind, m, c) in enumerate(schedule):
            k = self._virtual(c)
            if kind == "F":
                x = inputs[m].to(self.device) if k == 0 else exchange(self._previous, self.in_shape[c])
                if k > 0:
                    x.requires_grad_(True)
                start = time.perf_counter()
                with SavedBytes() as saved:
                    out = self.chunks[c](x)
                    if k == last:
                        loss = loss_fn(out, targets[m].to(self.device))
                        result.losses.append(loss.item())
                        out = loss / m_count if average else loss
                saved_by[c, m] = saved.bytes
                result.saved_bytes[m] = result.saved_bytes.get(m, 0) + saved.bytes
                holding += saved.bytes
                result.peak_saved_bytes = max(result.peak_saved_bytes, holding)
                self._work(1 / len(self.chunks))
                result.events.append(("F", m, start - t0, time.perf_counter() - t0, c))
                held[c, m] = (x, out)
                result.peak_in_flight = max(result.peak_in_flight, len(held))
                if k < last:
                    send(out.detach().contiguous(), self._next, index)
            else:
                grad = None if k == last else exchange(self._next, self.out_shape[c])
                x, out = held.pop((c, m))
                start = time.perf_counter()
                torch.autograd.backward(out, grad_tensors=grad)
                holding -= saved_by[c, m]
                self._work(2 / len(self.chunks))
                result.events.append(("B", m, start - t0, time.perf_counter() - t0, c))
                if k > 0:
                    send(x.grad.contiguous(), self._previous, index)
        exchange(None, ())
        for work, _op in sent:
            work.wait()
        result.seconds = time.perf_counter() - t0
        return result

    def _next_receive_from(self, schedule: Sequence[ChunkAction], index: int) -> int | None:
        """The stage the action at ``index`` receives from first (None: no action, or one that receives nothing)."""
        if index >= len(schedule):
            return None
        kind, _, c = schedule[index]
        k = self._virtual(c)
        if kind == "F":
            return None if k == 0 else self._previous
        return None if k == len(self.chunks) * self.stages - 1 else self._next

    def _work(self, units: float) -> None:
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
    """A Gantt chart of one step: a row per stage, forward and backward boxes labelled by micro-batch.

    Forward is blue, backward orange; with an interleaved schedule, a rank's second chunk is cyan
    (forward) and red (backward), and further chunks cycle through those colours.
    """
    colours = {"F": ("tab:blue", "tab:cyan"), "B": ("tab:orange", "tab:red")}
    chunked = any(event[4] for r in results for event in r.events)
    for s, r in enumerate(results):
        for kind, m, start, end, chunk in r.events:
            ax.barh(s, end - start, left=start, color=colours[kind][chunk % 2], edgecolor="white", height=0.8)
            ax.text((start + end) / 2, s, f"{m}", ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(results)), [f"stage {s}" for s in range(len(results))], fontsize=7)
    ax.invert_yaxis()
    legend = "blue: forward, orange: backward" + ("; cyan, red: a rank's second chunk" if chunked else "")
    ax.set_xlabel(f"seconds ({legend}; white space: the bubble)", fontsize=7)
    ax.set_title(title, fontsize=8)
