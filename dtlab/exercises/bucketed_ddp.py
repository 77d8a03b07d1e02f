"""Exercise 03.bucketed_ddp: data parallelism with gradient buckets, all-reduced while backward still runs.

Write ``class MyBucketedDDP(torch.nn.Module)`` with:

* ``__init__(self, module, bucket_cap_mb)``: wrap ``module`` (already on its device; the process group is
  initialised). Every rank must start from rank 0's weights, whatever it was built with.
* ``forward(self, *args)``: run the module.
* ``finish_gradient_synchronization(self)``: called after ``loss.backward()``, before ``optimizer.step()``;
  when it returns, every parameter's ``.grad`` holds the gradient *averaged* over the ranks.

What must hold (what the grader checks, on 3, 2 and 4 processes, each case a stack of linear layers of its own
sizes whose ranks are seeded differently, 3 steps of SGD with lr 0.1 and momentum 0.9, each rank on its 1/N
of every global batch; every input seeded, so a report names the case that failed and it fails the same way
again). The cases:

  - N = 3, layers 6-5-3-7-3 (8 tensors, 105 elements), a cap of 96 bytes: 5 buckets of 24, 7, 24, 20 and 30
    elements (the first and the third exactly full, the last one tensor larger than the cap on its own);
  - N = 2, layers 6-2-3-2 (6 tensors, 31 elements), a cap of 43 bytes: 4 buckets of 8, 9, 2 and 12 elements
    (a cap that is not a whole number of float32 gradients: the first two would reach 44 bytes with one more
    tensor, one byte past it; the last a weight larger than the cap);
  - N = 4, layers 3-7-2 (4 tensors, 44 elements), a cap of 25 MiB: 1 bucket.

On every rank:

* right after wrapping, the rank holds rank 0's initial parameters and buffers (each model has one);
* after each step's ``finish_gradient_synchronization``, every ``.grad`` equals the gradient of one process on
  the full batch (within float32 rounding: ``dtlab.measure.reduction_tolerance``), in every step, not only the
  first; after the steps, the weights equal the one-process run's, identical on every rank;
* the gradients travel in buckets, one ``all_reduce`` per bucket and no other communication in a step, every
  gradient element sent once per step. A bucket holds at most ``bucket_cap_mb`` MiB (2**20 bytes) of
  gradients, or a single tensor larger than that on its own; buckets are filled in the order backward
  computes the gradients (the reverse of ``module.parameters()``), a new one started only when the next
  tensor would take the bucket past the cap, so each step's all-reduces carry exactly the buckets that
  gives: as many, of the same sizes;
* each bucket's all-reduce is started *asynchronously* (``async_op=True``, or a functional collective) during
  ``loss.backward()``, as soon as its last gradient is ready: the grader notes, from hooks of its own, how
  many gradients backward had computed when each all-reduce was issued. The first bucket must leave while
  the rest of backward is still ahead, and no bucket may leave before all its gradients are computed;
* each handle is waited once, in ``finish_gradient_synchronization`` (``work.wait()`` or the handle's
  future's ``wait()``; a functional collective's result is waited when first used), never inside
  ``loss.backward()``: that would stop backward until the bucket had travelled.

The grader watches the process group itself (every collective is seen, whatever name it was imported under),
and notices when the course's own ``BucketedDataParallel`` or torch's ``DistributedDataParallel`` runs: the
exercise is to write it.

Hints: which gradients does backward compute first? A bucket can leave the moment every gradient in it is
final, and torch can call a function of yours when a parameter's gradient is final (look at the hooks a
tensor offers). One bucket is one message, so it travels as one flat tensor. An all-reduce can be started
without waiting for it to finish. Whatever remembers which gradients have arrived belongs to one step only.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch

from dtlab.exercises.grading import Case, Rank, Report, compare, grade_cases, run_ranks, scale_of

NPROCS = 3
#: the batches and the optimizer (lr and momentum not SGD's defaults)
LOCAL_BATCH, STEPS, LR, MOMENTUM = 4, 3, 0.1, 0.9
SEED = 1234
MIB = 2**20


def _sizes(widths: list[int]) -> list[int]:
    """Elements of each parameter of ``_model(widths)``, in ``parameters()`` order (weight, bias, weight, ...)."""
    out = []
    for a, b in zip(widths, widths[1:]):
        out += [a * b, b]
    return out


def plan_buckets(sizes_bytes: list[int], cap_bytes: float) -> list[list[int]]:
    """Indices of the tensors in each bucket, filled in reverse order, a new one when the cap would be passed."""
    buckets: list[list[int]] = [[]]
    size = 0
    for i in reversed(range(len(sizes_bytes))):
        if buckets[-1] and size + sizes_bytes[i] > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += sizes_bytes[i]
    return buckets


def _case(n: int, widths: list[int], cap_bytes: int, note: str) -> Case:
    sizes = _sizes(widths)
    plan = plan_buckets([4 * s for s in sizes], cap_bytes)
    cap = f"{cap_bytes // MIB} MiB" if cap_bytes >= MIB else f"{cap_bytes} bytes"
    count = f"{len(plan)} bucket{'s' if len(plan) > 1 else ''}"
    if len(plan) > 1:
        elements = [sum(sizes[i] for i in b) for b in plan]
        count += f" of {', '.join(map(str, elements[:-1]))} and {elements[-1]} elements"
    name = (f"N = {n}, layers {'-'.join(map(str, widths))} ({len(sizes)} tensors, {sum(sizes)} elements), "
            f"a cap of {cap}: {count}" + (f" ({note})" if note else ""))
    return Case(name, n, {"widths": widths, "cap_bytes": cap_bytes})


#: The cases, in the order they are graded: N, the layers' widths, the cap (bytes) and what makes it telling.
CASES = [
    _case(3, [6, 5, 3, 7, 3], 96, "the first and the third exactly full, the last one tensor larger than the cap "
          "on its own"),
    _case(2, [6, 2, 3, 2], 43, "not a whole number of float32 gradients: the next tensor would take the first two "
          "to 44 bytes, one past the cap; the last a weight larger than the cap"),
    _case(4, [3, 7, 2], 25 * MIB, ""),
]


class _Stack(torch.nn.Module):
    """Linear layers with tanh between them, and a buffer (a fixed shift of the input): a model's state is more
    than its parameters."""

    def __init__(self, widths: list[int]):
        super().__init__()
        layers: list[torch.nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
        self.net = torch.nn.Sequential(*layers[:-1])
        self.register_buffer("shift", 0.1 * torch.randn(widths[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x + self.shift)


def _model(widths: list[int], seed: int) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):            # leave the caller's random state alone
        torch.manual_seed(seed)
        return _Stack(widths)


def _batches(widths: list[int], world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    n = LOCAL_BATCH * world
    return [(torch.randn(n, widths[0], generator=g), torch.randint(0, widths[-1], (n,), generator=g))
            for _ in range(STEPS)]


def _one_process(widths: list[int], world: int) -> dict[str, Any]:
    """The same training in one process, on the full batches, from rank 0's initial weights."""
    import torch.nn.functional as F

    model = _model(widths, SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    grads = []
    for x, y in _batches(widths, world):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
    return {"grads": grads, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _labels(step: int) -> tuple[str, str, str]:
    return (f"step {step}: forward", f"step {step}: loss.backward() (your gradient hooks run in it)",
            f"step {step}: finish_gradient_synchronization()")


def _course() -> tuple:
    """What the learner's class must not run: the course's own data parallelism, and torch's: each method, the
    function under a decorator (a ``contextmanager``'s wrapper is shared by every decorated function)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    from dtlab.parallel import data_parallel

    found = []
    for cls in (data_parallel.BucketedDataParallel, data_parallel.DataParallel, data_parallel._SyncBase,
                DistributedDataParallel):
        for member in vars(cls).values():
            member = getattr(member, "fget", getattr(member, "__func__", member))
            if callable(member):
                member = inspect.unwrap(member)
                if hasattr(member, "__code__") and member.__qualname__.startswith(cls.__qualname__ + "."):
                    found.append(member)
    return tuple(found)


@contextmanager
def _other_waits(record: list[tuple[str, str]], phase: dict[str, str]):
    """Note what the tracer does not: a handle's future's ``wait()``, a functional collective's ``wait_tensor``
    (its result's first use), the functional all-reduces themselves, and which all-reduces blocked (a
    ``dist.all_reduce`` without ``async_op=True``; a ``ProcessGroup.allreduce`` never does), each with the
    grader's step."""
    import sys

    import torch.distributed._functional_collectives as funcol
    from torch.utils._python_dispatch import TorchDispatchMode

    future_wait, wait_tensor = torch._C.Future.wait, funcol.wait_tensor

    def waiting_future(self: Any, *args: Any, **kwargs: Any) -> Any:
        record.append((phase["label"], "future"))
        return future_wait(self, *args, **kwargs)

    def waiting_tensor(*args: Any, **kwargs: Any) -> Any:
        record.append((phase["label"], "functional"))
        return wait_tensor(*args, **kwargs)

    class Functional(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if getattr(func, "namespace", "") in ("_c10d_functional", "c10d_functional"):
                name = func._schema.name.split("::")[-1]
                if name.startswith("all_reduce"):
                    record.append((phase["label"], "functional all_reduce"))
                elif name == "wait_tensor":
                    record.append((phase["label"], "functional"))
            elif getattr(func, "namespace", "") == "c10d" and func._schema.name.endswith("allreduce_"):
                frame = sys._getframe(1)
                while frame is not None:
                    if frame.f_code.co_filename.endswith("distributed_c10d.py") and "async_op" in frame.f_locals:
                        if not frame.f_locals["async_op"]:
                            record.append((phase["label"], "blocking all_reduce"))
                        break
                    frame = frame.f_back
            return func(*args, **(kwargs or {}))

    torch._C.Future.wait, funcol.wait_tensor = waiting_future, waiting_tensor
    try:
        with Functional():
            yield
    finally:
        torch._C.Future.wait, funcol.wait_tensor = future_wait, wait_tensor


def _body(impl: Any, me: Rank, widths: list[int], cap_bytes: int) -> dict[str, Any]:
    import torch.nn.functional as F

    model = _model(widths, SEED + me.rank).to(me.device)        # different on each rank, on purpose
    params = list(model.parameters())
    phase = {"label": "", "step": "-1"}
    # the grader's own hooks, registered before yours so that each runs first: "tensor i's gradient is computed"
    for i, p in enumerate(params):
        p.register_hook(lambda grad, i=i: me.tracer.mark(f"gradient {phase['step']} {i}"))
    waits: list[tuple[str, str]] = []

    @contextmanager
    def doing(label: str):
        phase["label"] = label
        with me.tracer.doing(label):
            yield
        phase["label"] = ""

    def weights() -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}

    with doing("wrapping the model: MyBucketedDDP(model, bucket_cap_mb)"):
        ddp = impl(model, cap_bytes / MIB)
    start = {n: t.detach().cpu().clone() for n, t in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    rows = slice(me.rank * LOCAL_BATCH, (me.rank + 1) * LOCAL_BATCH)
    grads = []
    with _other_waits(waits, phase):
        for step, (x, y) in enumerate(_batches(widths, me.world)):
            forward, backward, finish = _labels(step)
            phase["step"] = str(step)
            opt.zero_grad()
            with doing(forward):
                loss = F.cross_entropy(ddp(x[rows].to(me.device)), y[rows].to(me.device))
            with doing(backward):
                loss.backward()
            with doing(finish):
                ddp.finish_gradient_synchronization()
            grads.append({n: (p.grad.detach().cpu().clone() if p.grad is not None else None)
                          for n, p in model.named_parameters()})
            opt.step()
    return {"start": start, "grads": grads, "weights": weights(), "waits": waits}


def grade(impl: Any, report: Report, nprocs: int | None = None, limit_s: float = 30.0) -> Report:
    """Grade ``impl`` (your ``MyBucketedDDP`` class) on each case (those on ``nprocs`` processes, if given)."""
    grade_cases(report, CASES, lambda case, rep: _grade_case(impl, case, rep, limit_s), nprocs)
    return report


def _grade_case(impl: Any, case: Case, report: Report, limit_s: float) -> None:
    n, widths, cap_bytes = case.nprocs, case.params["widths"], case.params["cap_bytes"]
    out = run_ranks(report, _body, impl, widths, cap_bytes, nprocs=n, limit_s=limit_s, watched=_course())
    if out is None:
        return
    seen = sorted({s for r in out for s in r["traffic"]["seen"]})
    if seen:
        classes = [c for c in dict.fromkeys(name.rsplit(".", 1)[0] for name in seen)]   # module.Class.method
        for name in sorted(classes, key=lambda c: c.rpartition(".")[2].startswith("_"))[:1]:  # the one they named
            where, _, what = name.rpartition(".")
            report.fail(f"your code runs the course's own {what.lstrip('_')} ({where}): the exercise is to write it"
                        if where.startswith("dtlab") else
                        f"your code runs torch's {what} ({where}): the exercise is to write it")
        return
    _check_values(report, out, widths, n)
    _check_traffic(report, out, widths, cap_bytes)


# ---------------------------------------------------------------------------------------------- the values

def _ranks_compare(report: Report, out: list[dict], get: Any, expected: dict[str, torch.Tensor], bound: float,
                   where: str, what: str, against: str = "one process") -> list[int]:
    """``compare`` each rank's tensors (``get(result)``) with ``expected``: the first rank that differs in
    detail, the others in one line. Returns the ranks that differ."""
    bad, first = [], None
    for rank, r in enumerate(out):
        scratch = Report(report.exercise, report.title)
        compare(scratch, f"rank {rank}, {where}", get(r), expected, bound, what, listed=2, against=against)
        if scratch.problems:
            bad.append(rank)
            first = first or scratch
    if first is not None:
        for p in first.problems:
            report.fail(p)
        if len(bad) > 1:
            report.fail(f"{where}: rank{'s' if len(bad) > 2 else ''} {', '.join(map(str, bad[1:]))} "
                        f"differ{'' if len(bad) > 2 else 's'} too")
    return bad


def _check_values(report: Report, out: list[dict], widths: list[int], n: int) -> None:
    from dtlab.measure import reduction_tolerance

    start = _model(widths, SEED).state_dict()
    bad = _ranks_compare(report, out, lambda r: r["start"], start, 0.0, "right after wrapping",
                         "parameter or buffer", "rank 0's")
    if bad:
        differ = {k for r in bad for k, t in out[r]["start"].items() if not torch.equal(t, start[k])}
        buffers = {k for k, _ in _model(widths, SEED).named_buffers()}
        report.fail("a rank does not start from rank 0's weights (each rank built its model from its own seed)",
                    "the parameters were broadcast, the buffers not (module.buffers(): state that is not trained, "
                    "here a fixed shift of the input): broadcast them too" if differ <= buffers else
                    "broadcast rank 0's parameters and buffers when you wrap (dist.broadcast(t, src=0) for each, in "
                    "__init__)")
        return
    report.ok("every rank starts from rank 0's weights")

    one = _one_process(widths, n)
    for step, expected in enumerate(one["grads"]):
        scale = max(g.abs().max().item() for g in expected.values())
        bound = reduction_tolerance(LOCAL_BATCH * n, 1, scale)
        where = f"step {step}, after finish_gradient_synchronization"
        bad = _ranks_compare(report, out, lambda r, s=step: r["grads"][s], expected, bound, where,
                             "gradient of parameter")
        if bad:
            got = out[bad[0]]["grads"][step]
            cause = _grad_cause(got, expected, bound, n)
            if step > 0 and cause is None:
                cause = (f"step 0's gradients were right, step {step}'s are not: something of an earlier step was "
                         "used again (a bucket's flat tensor or values built once, an old handle, a counter that "
                         "was not reset): build each step's buckets from that step's gradients")
            if cause and cause not in report.causes:
                report.causes.append(cause)
            return
    report.ok("in every step, every .grad after finish_gradient_synchronization is the full batch's gradient "
              "(one process's, within float32 rounding)")

    scale = max(w.abs().max().item() for w in one["weights"].values())
    bound = reduction_tolerance(LOCAL_BATCH * n, STEPS, scale)
    if _ranks_compare(report, out, lambda r: r["weights"], one["weights"], bound, f"after {STEPS} steps",
                      "parameter"):
        return
    for rank, r in enumerate(out[1:], start=1):
        differ = [k for k, w in r["weights"].items() if not torch.equal(w, out[0]["weights"][k])]
        if differ:
            report.fail(f"after {STEPS} steps rank {rank} and rank 0 hold different weights "
                        f"({', '.join(differ[:3])}{' ...' if len(differ) > 3 else ''})",
                        "the ranks stepped with different gradients: every rank must end "
                        "finish_gradient_synchronization with the same averaged gradients")
            return
    report.ok(f"after {STEPS} SGD steps (lr {LR}, momentum {MOMENTUM}) every rank's weights equal one process's "
              "on the full batch, identical on every rank")


def _grad_cause(got: dict[str, torch.Tensor | None], expected: dict[str, torch.Tensor], bound: float,
                n: int) -> str | None:
    missing = [name for name, g in got.items() if g is None]
    if missing:
        return (f"{', '.join(missing)} had no .grad after finish_gradient_synchronization: copy each bucket's "
                "averaged values back into every parameter's .grad")
    if any(g.shape != expected[name].shape for name, g in got.items()):
        return None
    c = scale_of(torch.cat([g.flatten() for g in got.values()]), torch.cat([e.flatten() for e in expected.values()]))
    if abs(c - n) < 0.02 * n:
        return f"the gradients are {n} times one process's: summed, not averaged (divide by the world size)"
    if abs(c - 1 / n) < 0.02 / n:
        return "the gradients are 1/N of one process's: divided by the world size twice"
    right = [name for name, g in got.items() if (g - expected[name]).abs().max().item() <= bound]
    if right:
        return (f"some gradients are right ({', '.join(right[:3])}{' ...' if len(right) > 3 else ''}), others "
                "not: a bucket was all-reduced before all its gradients had arrived (it sent zeros or stale "
                "values for the late ones), or its values were copied back before its all-reduce had finished")
    return None


# ---------------------------------------------------------------------------------------------- the traffic

def _greedy(sizes: list[int], cap: float, strict: bool = True) -> list[int]:
    """The elements of each bucket, filling ``sizes`` in order (a new bucket when the next would pass ``cap``,
    or reach it when not ``strict``)."""
    buckets, size = [[]], 0
    for s in sizes:
        if buckets[-1] and (size + s > cap if strict else size + s >= cap):
            buckets.append([])
            size = 0
        buckets[-1].append(s)
        size += s
    return [sum(b) for b in buckets]


def _plan_cause(got: list[int], sizes: list[int], cap_elements: float) -> str:
    """What a learner's bucket sizes (issue order) say about the way the buckets were made."""
    backward = list(reversed(sizes))
    causes = []
    if got == _greedy(backward, cap_elements, strict=False):
        causes.append("a bucket may be exactly full: start a new one only when the next tensor would take it PAST "
                      "the cap (>, not >=)")
    if got == _greedy(backward, cap_elements * 10**6 / MIB):
        causes.append("a MiB is 2**20 bytes (1024 * 1024), not 10**6")
    if got == _greedy(backward, cap_elements * 4):
        causes.append("the cap is in bytes: a tensor takes numel() * element_size() bytes of it (4 per float32 "
                      "element), not numel()")
    closed, size = [], 0
    for s in backward:                                  # each tensor added, then the bucket closed once full
        size += s
        if size >= cap_elements:
            closed.append(size)
            size = 0
    if got == closed + ([size] if size else []):
        causes.append("a bucket holds at most the cap: start a new bucket BEFORE adding a tensor that would take "
                      "it past the cap, not after (a tensor larger than the cap goes alone)")
    if causes:
        return "; or ".join(causes)
    if got == backward:
        return ("no buckets: one all-reduce per tensor pays the latency per tensor. Pack a bucket's gradients into "
                "one flat tensor and all-reduce that")
    if len(got) == 1:
        return ("everything went in one bucket: it can only leave when backward has finished. Start a new bucket "
                "when the next gradient would take it past bucket_cap_mb MiB (bucket_cap_mb * 2**20 bytes)")
    return ("fill the buckets walking the parameters in reverse (the order backward computes their gradients), "
            "starting a new one when the next tensor would take the bucket past bucket_cap_mb * 2**20 bytes")


def _check_traffic(report: Report, out: list[dict], widths: list[int], cap_bytes: int) -> None:
    sizes = _sizes(widths)
    tensors, total = len(sizes), sum(sizes)
    cap_elements = cap_bytes / 4                                # float32 gradients
    buckets = plan_buckets([4 * s for s in sizes], cap_bytes)
    plan = [sum(sizes[i] for i in b) for b in buckets]
    complete = [sum(len(b) for b in buckets[:i + 1]) for i in range(len(buckets))]   # gradients computed by then
    lone = {s for s in sizes if s > cap_elements}
    cap = f"{cap_bytes // MIB} MiB" if cap_bytes >= MIB else f"{cap_bytes} bytes"
    plan_text = (f"a cap of {cap} over these {tensors} tensors makes {len(plan)} bucket{'s' if len(plan) > 1 else ''}"
                 + (f" (of {', '.join(map(str, plan))} elements)" if len(plan) > 1 else ""))
    found: dict[str, list] = {}                 # kind -> [(rank, step), ...], the first one's problem and cause

    def note(kind: str, rank: int, step: int, problem: str, cause: str | None = None) -> None:
        entry = found.setdefault(kind, [[], problem, cause])
        entry[0].append((rank, step))

    hook = ("launch a bucket from a gradient hook (register_post_accumulate_grad_hook, or a tensor hook) when its "
            "last gradient is computed, not after backward: that is what overlaps communication with the rest of "
            "the backward pass")
    for rank, r in enumerate(out):
        log, waits = r["traffic"]["log"], r["traffic"]["waits"]
        synced_during = []
        for step in range(STEPS):
            forward, backward, finish = labels = _labels(step)
            seq = [e for e in log if (e["op"] == "mark" and e["label"].startswith(f"gradient {step} "))
                   or (e["op"] != "mark" and e["label"] in labels)]
            comm = [e for e in seq if e["op"] != "mark"]
            others = [e for e in comm if e["op"] != "all_reduce"]
            if others:
                e = others[0]
                note("others", rank, step, f"rank {rank}, step {step}: dist.{e['api']} during "
                     f"{e['label'].split(': ', 1)[1]}"
                     + (f" (at {e['line']})" if e["line"] else "") + ": a step needs one all_reduce per bucket and "
                     "nothing else", "each bucket is one flat tensor, all-reduced (summed) and divided by N")
            reduces = [e for e in comm if e["op"] == "all_reduce"]
            during = [e for e in reduces if e["label"] == backward]
            synced_during.append(bool(during))
            # where: every bucket's last gradient is computed in backward, so every bucket leaves in backward
            if reduces and not during:
                if step > 0 and synced_during[0]:
                    note("where", rank, step, f"rank {rank}: in step {step} no dist.all_reduce was issued during "
                         f"loss.backward() (step 0 did; all {len(reduces)} waited for "
                         "finish_gradient_synchronization)",
                         "the first step sent buckets during backward, later ones did not: reset what counts a "
                         "bucket's arrived gradients at the end of finish_gradient_synchronization")
                else:
                    note("where", rank, step, f"rank {rank}, step {step}: no dist.all_reduce was issued during "
                         f"loss.backward(); all {len(reduces)} waited for "
                         f"{'finish_gradient_synchronization' if reduces[0]['label'] == finish else 'the forward'}",
                         hook)
            elif len(during) < len(reduces):
                late = [e for e in reduces if e["label"] != backward]
                note("where", rank, step, f"rank {rank}, step {step}: {len(late)} of the {len(reduces)} "
                     f"all-reduces {'was' if len(late) == 1 else 'were'} issued in "
                     f"{late[0]['label'].split(': ', 1)[1]}, not during loss.backward()",
                     "every gradient is computed during backward, so every bucket can leave from the hook of its "
                     "last gradient, the last bucket too")
            elif not reduces:
                note("where", rank, step, f"rank {rank}, step {step}: no dist.all_reduce at all",
                     "every step's gradients must be all-reduced: reset what tells you a bucket was sent at the "
                     "end of finish_gradient_synchronization")
            blocking = [e for e in during if not e["asynchronous"]][
                :sum(1 for label, kind in r["waits"] if label == backward and kind == "blocking all_reduce")]
            if blocking:
                note("blocking", rank, step, f"rank {rank}, step {step}: {len(blocking)} of the all-reduces issued "
                     "during loss.backward() were blocking (dist.all_reduce without async_op=True"
                     + (f", at {blocking[0]['line']}" if blocking[0]["line"] else "") + "): backward stood "
                     "still until each bucket had travelled, nothing overlapped",
                     "dist.all_reduce(flat, async_op=True) returns a handle at once: keep it, and wait() on it in "
                     "finish_gradient_synchronization")
            # how many, how large, every element once
            got = [e["sent"] for e in reduces]
            if got and len(got) != len(plan):
                calls = f"{len(got)} dist.all_reduce call{'s' if len(got) > 1 else ''}"
                of = ", ".join(map(str, got[:8])) + (" ..." if len(got) > 8 else "")
                note("count", rank, step, f"rank {rank}, step {step}: {calls} for {tensors} gradient tensors (of {of} "
                     f"elements); {plan_text}", _plan_cause(got, sizes, cap_elements))
            elif got and sorted(got) != sorted(plan):
                note("plan", rank, step, f"rank {rank}, step {step}: your {len(got)} buckets held "
                     f"{', '.join(map(str, got))} elements (in the order sent); filled in the order backward "
                     f"computes the gradients, {plan_text}", _plan_cause(got, sizes, cap_elements))
            over = [s for s in got if s > cap_elements and s not in lone]
            if over:
                note("size", rank, step, f"rank {rank}, step {step}: an all-reduce of {over[0]} elements "
                     f"({4 * over[0]} bytes) for a cap of {cap}",
                     "a bucket holds at most bucket_cap_mb MiB: start a new bucket BEFORE adding a tensor that "
                     "would take it past the cap (a tensor larger than the cap goes alone)")
            if got and sum(got) != total:
                note("total", rank, step, f"rank {rank}, step {step}: the all-reduces sent {sum(got)} elements for "
                     f"the model's {total} gradient elements",
                     "every gradient is sent once per step, in its bucket: a bucket sent twice (from its hook and "
                     "again in finish_gradient_synchronization), or one never sent")
            # when, against the gradients backward had computed: the grader's marks come before your hooks
            arrived, cumulative, sent_so_far, k = [0], [], 0, 0
            for e in seq:
                if e["op"] == "mark":
                    k += 1
                    arrived.append(arrived[-1] + sizes[int(e["label"].split()[-1])])
                elif e["op"] == "all_reduce" and e["label"] == backward:
                    sent_so_far += e["sent"]
                    cumulative.append((k, sent_so_far, e["sent"]))
            for i, (k, so_far, sent) in enumerate(cumulative):
                if so_far > arrived[k]:
                    note("early", rank, step, f"rank {rank}, step {step}: all-reduce {i + 1} ({sent} elements) was "
                         f"issued when backward had computed {k} of the {tensors} gradients ({arrived[k]} elements), "
                         f"but your all-reduces had sent {so_far} elements by then",
                         "a bucket left before all its gradients were computed: launch a bucket when its LAST "
                         "gradient is ready")
                    break
                if i < len(complete) and k > complete[i]:
                    which = "the first all-reduce" if i == 0 else f"all-reduce {i + 1}"
                    note("late", rank, step, f"rank {rank}, step {step}: {which} was issued only after backward had "
                         f"computed {k} of the {tensors} gradients; filled in the order backward computes them, "
                         f"{'the first bucket is' if i == 0 else f'{i + 1} buckets are'} complete after "
                         f"{complete[i]}, with {tensors - complete[i]} gradients still to come",
                         "send each bucket the moment its own last gradient is computed, whatever the other buckets "
                         "are doing: buckets sent in the order of the parameters wait for the first layer's "
                         "gradients, which backward computes last")
                    break
            # the waits: each handle once, in finish_gradient_synchronization, none in backward
            in_backward = [w for w in waits if w == backward] + [
                kind for label, kind in r["waits"] if label == backward and kind in ("future", "functional")]
            if in_backward:
                note("wait here", rank, step, f"rank {rank}, step {step}: waited for an all-reduce inside "
                     "loss.backward() (in a gradient hook): backward stood still until the bucket had travelled, "
                     "nothing overlapped", "keep the handle and wait() on it in finish_gradient_synchronization")
            functional = sum(1 for label, kind in r["waits"] if label in labels and kind == "functional all_reduce")
            handles = len(reduces) - functional - sum(
                1 for label, kind in r["waits"] if label in labels and kind == "blocking all_reduce")
            waited = sum(1 for w in waits if w == finish) + sum(
                1 for label, kind in r["waits"] if label == finish and kind == "future")
            if handles > 0 and waited != handles and not in_backward:
                note("waits", rank, step, f"rank {rank}, step {step}: {waited} wait() call{'s' if waited != 1 else ''}"
                     f" in finish_gradient_synchronization for {handles} bucket all-reduce"
                     f"{'s' if handles != 1 else ''}: each handle is waited once",
                     "without wait() nothing says a bucket's all-reduce has finished before you copy its values "
                     "back (on a GPU it usually has not)" if waited < handles else
                     "each handle is waited once: a second wait() on it, or waiting on every handle for each bucket, "
                     "is not needed")
    for kind in ("others", "where", "blocking", "count", "plan", "size", "total", "early", "late", "wait here",
                 "waits"):
        if kind in found:
            where, problem, cause = found[kind]
            report.fail(problem + _elsewhere(where, len(out)), cause)
    if not found:
        report.ok("one all-reduce per bucket in every step on every rank, the buckets the cap makes (number and "
                  "sizes), each of at most the cap (or one larger tensor), every gradient element sent once")
        report.ok("each bucket's all-reduce issued asynchronously during loss.backward() the moment its last "
                  "gradient was computed, and waited once in finish_gradient_synchronization, on every rank and "
                  "step")


def _elsewhere(where: list[tuple[int, int]], ranks: int) -> str:
    """' (the same ...)': where else, after the first (rank, step), the problem was seen."""
    if len(where) == 1:
        return ""
    if len(where) == ranks * STEPS:
        return " (the same in every step, on every rank)"
    steps = sorted({s for _, s in where})
    by_rank = sorted({r for r, _ in where})
    if len(where) == len(steps) * len(by_rank):
        return (f" (the same in step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}, on rank"
                f"{'s' if len(by_rank) > 1 else ''} {', '.join(map(str, by_rank))})")
    return " (the same in " + ", ".join(f"rank {r} step {s}" for r, s in where[1:4]) + (
        " ..." if len(where) > 4 else "") + ")"


# ---------------------------------------------------------------------------------------------- the answer

def reference() -> Any:
    """A correct implementation (the grader's own test uses it; try yours first)."""
    import torch.distributed as dist

    class MyBucketedDDP(torch.nn.Module):
        def __init__(self, module: torch.nn.Module, bucket_cap_mb: float):
            super().__init__()
            self.module = module
            self.world = dist.get_world_size()
            with torch.no_grad():                                   # every replica starts from rank 0's weights
                for t in list(module.parameters()) + list(module.buffers()):
                    dist.broadcast(t, src=0)
            cap = bucket_cap_mb * 2**20
            params = [p for p in module.parameters() if p.requires_grad]
            self.buckets: list[list[torch.nn.Parameter]] = [[]]
            size = 0
            for p in reversed(params):                              # the order backward computes the gradients
                nbytes = p.numel() * p.element_size()
                if self.buckets[-1] and size + nbytes > cap:        # p would pass the cap: it starts a new bucket
                    self.buckets.append([])
                    size = 0
                self.buckets[-1].append(p)
                size += nbytes
            self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
            self.arrived = [0] * len(self.buckets)
            self.in_flight: dict[int, tuple[torch.Tensor, Any]] = {}
            for p in params:
                p.register_post_accumulate_grad_hook(self.gradient_ready)

        def forward(self, *args: Any) -> Any:
            return self.module(*args)

        def gradient_ready(self, p: torch.nn.Parameter) -> None:    # during backward, once p.grad is complete
            i = self.bucket_of[id(p)]
            self.arrived[i] += 1
            if self.arrived[i] == len(self.buckets[i]):             # the bucket's last gradient: send it now
                flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]]) / self.world
                self.in_flight[i] = (flat, dist.all_reduce(flat, async_op=True))

        def finish_gradient_synchronization(self) -> None:
            for i, (flat, work) in self.in_flight.items():
                work.wait()
                offset = 0
                for p in self.buckets[i]:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
            self.arrived = [0] * len(self.buckets)
            self.in_flight = {}

    return MyBucketedDDP
