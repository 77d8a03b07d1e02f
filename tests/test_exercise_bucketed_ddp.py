"""The grader of exercise 03.bucketed_ddp: a correct bucketed DDP passes, however it is written (tensor hooks, a
handle's future, torch's flatten helpers, functional collectives); typical wrong ones fail with the right words."""

import pytest
import torch
from exercise_checks import assert_fails_with

from dtlab.exercises import check, exercise

NAME = "03.bucketed_ddp"
FIRST = "in case N = 3, layers 6-5-3-7-3"


@pytest.mark.cluster
def test_reference_passes():
    report = check(NAME, exercise(NAME).reference(), quiet=True).raise_for_failure()
    assert any("during loss.backward()" in c for c in report.checks)
    assert any("3 cases" in c for c in report.checks)


def test_the_reference_is_the_exercises_own_not_the_course_class():
    from dtlab.parallel.data_parallel import BucketedDataParallel

    assert exercise(NAME).reference() is not BucketedDataParallel
    assert exercise(NAME).reference().__module__ == "dtlab.exercises.bucketed_ddp"


def test_each_case_has_the_bucket_count_its_name_says():
    """The cases: different N, caps that make several buckets (some exactly full), one tensor larger than the cap,
    a cap that makes one bucket."""
    m = exercise(NAME)
    counts = []
    for case in m.CASES:
        sizes = m._sizes(case.params["widths"])
        plan = m.plan_buckets([4 * s for s in sizes], case.params["cap_bytes"])
        counts.append(len(plan))
        assert f"{len(plan)} bucket" in case.name
    assert sorted({c.nprocs for c in m.CASES}) == [2, 3, 4] and counts == [5, 4, 1]
    first, second = (m.plan_buckets([4 * s for s in m._sizes(c.params["widths"])], c.params["cap_bytes"])
                     for c in m.CASES[:2])
    # exactly full buckets, first and later (a cap counted from 1 byte, or reset to it, is seen); a cap that is
    # not a whole number of gradients (one counted from -1 byte is seen)
    assert [sum(4 * m._sizes(m.CASES[0].params["widths"])[i] for i in b) for b in first][:3:2] == [96, 96]
    assert m.CASES[1].params["cap_bytes"] % 4 == 3 and len(second) == 4
    for case in m.CASES:                        # the statement lists them as they are
        assert f"N = {case.nprocs}, layers {'-'.join(map(str, case.params['widths']))}" in m.__doc__


def learner_ddp(average=True, broadcast="all", cap_rule="bytes", in_hook=True, launch_on="last", reset=True,
                asynchronous=True, wait="in finish", order="backward", stale=False):
    """A learner's bucketed DDP, right with the defaults; each switch is one typical mistake."""
    import torch.distributed as dist

    class Learner(torch.nn.Module):
        def __init__(self, module, bucket_cap_mb):
            super().__init__()
            self.module = module
            self.world = dist.get_world_size()
            if broadcast:
                for t in list(module.parameters()) + (list(module.buffers()) if broadcast == "all" else []):
                    dist.broadcast(t.data, src=0)
            cap = {"bytes": bucket_cap_mb * 2**20, "per tensor": 0, "none": float("inf"),
                   "elements": bucket_cap_mb * 2**20 * 4, "10**6": bucket_cap_mb * 10**6,
                   ">=": bucket_cap_mb * 2**20, "add then close": bucket_cap_mb * 2**20}[cap_rule]
            params = list(module.parameters())
            self.buckets, size = [[]], 0
            for p in (reversed(params) if order == "backward" else params):
                nbytes = p.numel() * p.element_size()
                if cap_rule == "add then close":
                    self.buckets[-1].append(p)
                    size += nbytes
                    if size >= cap:
                        self.buckets.append([])
                        size = 0
                    continue
                if self.buckets[-1] and (size + nbytes >= cap if cap_rule == ">=" else size + nbytes > cap):
                    self.buckets.append([])
                    size = 0
                self.buckets[-1].append(p)
                size += nbytes
            self.buckets = [b for b in self.buckets if b]
            self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
            self.ready, self.sent, self.flat = [0] * len(self.buckets), {}, {}
            for p in module.parameters():
                p.register_post_accumulate_grad_hook(self.on_grad)

        def forward(self, *args):
            return self.module(*args)

        def on_grad(self, p):
            i = self.bucket_of[id(p)]
            self.ready[i] += 1
            if not in_hook:
                return
            if order == "forward, sent in order":      # a bucket leaves once it and every one before it is ready
                while len(self.sent) < len(self.buckets) and self.ready[len(self.sent)] == len(
                        self.buckets[len(self.sent)]):
                    self.send(len(self.sent))
            elif launch_on == "next bucket":           # a bucket is done when the next one starts arriving
                if i > 0 and i - 1 not in self.sent:
                    self.send(i - 1)
            elif self.ready[i] == (1 if launch_on == "first" else len(self.buckets[i])):
                self.send(i)

        def send(self, i):
            if not (stale and i in self.flat):
                flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                                  for p in self.buckets[i]])
                if average:
                    flat /= self.world
                self.flat[i] = flat
            work = dist.all_reduce(self.flat[i], async_op=asynchronous)
            if wait == "in the hook":
                work.wait()
            self.sent[i] = (self.flat[i], work)

        def finish_gradient_synchronization(self):
            for i in range(len(self.buckets)):
                if i not in self.sent:
                    self.send(i)
            for i, (flat, work) in self.sent.items():
                if wait == "in finish" and work is not None:
                    work.wait()
                if wait == "twice":
                    work.wait()
                    work.wait()
                offset = 0
                for p in self.buckets[i]:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
            if reset:
                self.ready = [0] * len(self.buckets)
            self.sent = {}

    return Learner


def test_the_learner_template_is_right():
    """The wrong variants below differ from a correct implementation in one switch each."""
    report = check(NAME, learner_ddp(), quiet=True)
    assert report.passed, report.text()


# ------------------------------------------------------------------------------------------- correct, not ours

def tensor_hooks_ddp():
    """Tensor hooks (``p.register_hook``) instead of post-accumulate hooks: the gradient comes as the hook's
    argument, before it is accumulated into ``.grad``; the bucket is flattened from those arguments and sent with
    the process group's own ``allreduce`` (which never blocks)."""
    import torch.distributed as dist

    class TensorHooks(torch.nn.Module):
        def __init__(self, module, bucket_cap_mb):
            super().__init__()
            self.module = module
            with torch.no_grad():
                for t in [*module.parameters(), *module.buffers()]:
                    dist.broadcast(t, 0)
            limit = int(bucket_cap_mb * 1024 * 1024)
            self.buckets = []
            for p in reversed(list(module.parameters())):
                if self.buckets and sum(q.numel() * 4 for q in self.buckets[-1]) + p.numel() * 4 <= limit:
                    self.buckets[-1].append(p)
                else:
                    self.buckets.append([p])
            self.grads, self.pending = {}, []
            for b, bucket in enumerate(self.buckets):
                for p in bucket:
                    p.register_hook(lambda grad, p=p, b=b: self.arrived(p, b, grad))

        def forward(self, *args):
            return self.module(*args)

        def arrived(self, p, b, grad):
            self.grads[p] = grad
            if all(q in self.grads for q in self.buckets[b]):
                flat = torch.cat([self.grads[q].reshape(-1) for q in self.buckets[b]])
                self.pending.append((b, flat, dist.group.WORLD.allreduce([flat])))
            return None

        def finish_gradient_synchronization(self):
            world = dist.get_world_size()
            for b, flat, work in self.pending:
                work.wait()
                for q, piece in zip(self.buckets[b], flat.split([q.numel() for q in self.buckets[b]])):
                    q.grad.copy_(piece.view_as(q) / world)
            self.grads, self.pending = {}, []

    return TensorHooks


def futures_and_flatten_ddp():
    """torch's own flatten helpers (``_flatten_dense_tensors``) for the buckets, a set of arrived gradients, and
    each handle's future waited instead of the handle; the cap checked in elements times element size."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    class Flattened(torch.nn.Module):
        def __init__(self, module, bucket_cap_mb):
            super().__init__()
            self.module = module
            for t in module.state_dict().values():
                dist.broadcast(t, src=0)
            cap, used, self.buckets = bucket_cap_mb * 2**20, 0, []
            for p in reversed([p for p in module.parameters() if p.requires_grad]):
                if not self.buckets or used + p.numel() * p.element_size() > cap:
                    self.buckets.append([])
                    used = 0
                self.buckets[-1].append(p)
                used += p.numel() * p.element_size()
            self.where = {p: b for b, bucket in enumerate(self.buckets) for p in bucket}
            self.done, self.futures = set(), []
            for p in self.where:
                p.register_post_accumulate_grad_hook(self.ready)

        def forward(self, *args):
            return self.module(*args)

        def ready(self, p):
            self.done.add(p)
            bucket = self.buckets[self.where[p]]
            if all(q in self.done for q in bucket):
                flat = _flatten_dense_tensors([q.grad for q in bucket])
                flat.div_(dist.get_world_size())
                self.futures.append((bucket, flat, dist.all_reduce(flat, async_op=True).get_future()))

        def finish_gradient_synchronization(self):
            for bucket, flat, future in self.futures:
                future.wait()
                for q, g in zip(bucket, _unflatten_dense_tensors(flat, [q.grad for q in bucket])):
                    q.grad.copy_(g)
            self.done, self.futures = set(), []

    return Flattened


def functional_ddp():
    """Functional collectives (``torch.distributed._functional_collectives.all_reduce``): asynchronous by
    nature, waited when the result is first used, in finish_gradient_synchronization."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    class Functional(torch.nn.Module):
        def __init__(self, module, bucket_cap_mb):
            super().__init__()
            self.module = module
            with torch.no_grad():
                for t in module.state_dict().values():
                    t.copy_(funcol.broadcast(t, 0, dist.group.WORLD))
            cap = bucket_cap_mb * 2**20
            self.buckets, size = [[]], 0
            for p in reversed(list(module.parameters())):
                if self.buckets[-1] and size + 4 * p.numel() > cap:
                    self.buckets.append([])
                    size = 0
                self.buckets[-1].append(p)
                size += 4 * p.numel()
            self.count = [0] * len(self.buckets)
            self.results = {}
            for i, bucket in enumerate(self.buckets):
                for p in bucket:
                    p.register_post_accumulate_grad_hook(lambda p, i=i: self.on_grad(i))

        def forward(self, *args):
            return self.module(*args)

        def on_grad(self, i):
            self.count[i] += 1
            if self.count[i] == len(self.buckets[i]):
                flat = torch.cat([p.grad.flatten() for p in self.buckets[i]])
                self.results[i] = funcol.all_reduce(flat, "avg" if flat.is_cuda else "sum", dist.group.WORLD)

        def finish_gradient_synchronization(self):
            world = dist.get_world_size()
            for i, result in self.results.items():
                values = result.wait() if hasattr(result, "wait") else result
                if not values.is_cuda:
                    values = values / world
                offset = 0
                for p in self.buckets[i]:
                    p.grad.copy_(values[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
            self.count, self.results = [0] * len(self.buckets), {}

    return Functional


CORRECT = {
    "tensor hooks, the hook's grad argument, ProcessGroup.allreduce": tensor_hooks_ddp,
    "_flatten_dense_tensors, the handle's future waited": futures_and_flatten_ddp,
    "functional collectives": functional_ddp,
}


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.parametrize("variant", list(CORRECT))
def test_another_correct_implementation_passes(variant):
    """Hook kind, flattening and the way a handle is waited are the learner's choice."""
    check(NAME, CORRECT[variant](), quiet=True).raise_for_failure()


# ------------------------------------------------------------------------------------------- wrong

def course_class():
    """The course's own BucketedDataParallel under another name: the answer, not the exercise."""
    from dtlab.parallel.data_parallel import BucketedDataParallel as Mine

    class MyBucketedDDP(Mine):
        pass

    return MyBucketedDDP


def torch_ddp():
    """torch's DistributedDataParallel, with a finish_gradient_synchronization that does nothing."""
    from torch.nn.parallel import DistributedDataParallel

    class Wrapped(DistributedDataParallel):
        def __init__(self, module, bucket_cap_mb):
            super().__init__(module, bucket_cap_mb=bucket_cap_mb)

        def finish_gradient_synchronization(self):
            pass

    return Wrapped


WRONG = {
    "summed, not averaged": (dict(average=False), ["gradient of parameter", "summed, not averaged"]),
    "no initial broadcast": (dict(broadcast=False), ["right after wrapping", "does not start from rank 0's weights",
                                                     "broadcast rank 0's parameters and buffers when you wrap"]),
    "parameters broadcast, buffers not": (dict(broadcast="parameters"), [
        FIRST, "rank 1, right after wrapping: parameter or buffer shift differs from rank 0's",
        "the buffers not"]),
    "one all-reduce per tensor": (dict(cap_rule="per tensor"), ["8 dist.all_reduce calls for 8 gradient tensors",
                                                                "makes 5 buckets (of 24, 7, 24, 20, 30 elements)",
                                                                "no buckets"]),
    "one bucket only": (dict(cap_rule="none"), ["1 dist.all_reduce call for 8 gradient tensors", "one bucket",
                                                "the first all-reduce was issued only after backward had computed "
                                                "8 of the 8 gradients"]),
    "cap compared with >=": (dict(cap_rule=">="), [FIRST, "6 dist.all_reduce calls", "exactly full", ">, not >="]),
    "cap in elements, not bytes": (dict(cap_rule="elements"), [FIRST, "2 dist.all_reduce calls",
                                                               "the cap is in bytes"]),
    "a MiB of 10**6 bytes": (dict(cap_rule="10**6"), [FIRST, "7 dist.all_reduce calls", "of 3, 21, 7, 21, 18, 5, 30",
                                                      "not 10**6"]),
    "tensor added, then the bucket closed": (dict(cap_rule="add then close"), [
        FIRST, "an all-reduce of 28 elements (112 bytes) for a cap of 96 bytes", "BEFORE adding a tensor"]),
    "all-reduce only after backward": (dict(in_hook=False), ["no dist.all_reduce was issued during loss.backward()",
                                                            "register_post_accumulate_grad_hook"]),
    "blocking all-reduce in the hook": (dict(asynchronous=False), [FIRST, "were blocking", "nothing overlapped",
                                                                  "async_op=True"]),
    "waited in the hook": (dict(wait="in the hook"), [FIRST, "waited for an all-reduce inside loss.backward()",
                                                      "wait() on it in finish_gradient_synchronization"]),
    "never waited": (dict(wait="never"), ["0 wait() calls in finish_gradient_synchronization for 5 bucket "
                                          "all-reduces", "without wait()"]),
    "waited twice": (dict(wait="twice"), ["10 wait() calls in finish_gradient_synchronization for 5",
                                          "each handle is waited once"]),
    "forward-order buckets, sent in order": (dict(order="forward, sent in order"), [
        FIRST, "the first all-reduce was issued only after backward had computed 8 of the 8 gradients",
        "the first bucket is complete after 2", "wait for the first layer's gradients"]),
    "buckets filled walking the parameters forward": (dict(order="forward"), [
        FIRST, "your 5 buckets held 24, 7, 21, 23, 30 elements", "cap of 96 bytes over these 8 tensors makes 5 "
        "buckets (of 24, 7, 24, 20, 30 elements)", "walking the parameters in reverse"]),
    "bucket sent at its first gradient": (dict(launch_on="first"), ["gradient of parameter",
                                                                   "before all its gradients had arrived"]),
    "bucket sent when the next one starts": (dict(launch_on="next bucket"), [
        FIRST, "1 of the 5 all-reduces was issued in finish_gradient_synchronization()",
        "the first all-reduce was issued only after backward had computed 3 of the 8 gradients",
        "the first bucket is complete after 2", "the last bucket too"]),
    "arrivals not reset after a step": (dict(reset=False), ["in step 1 no dist.all_reduce was issued during",
                                                           "reset what counts a bucket's arrived gradients"]),
    "flat buckets built once, sent again in later steps": (dict(stale=True), [
        "step 1, after finish_gradient_synchronization", "step 0's gradients were right, step 1's are not"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(WRONG))
def test_wrong_implementations_fail_with_their_cause(variant):
    switches, expected = WRONG[variant]
    assert_fails_with(NAME, learner_ddp(**switches), expected)


@pytest.mark.slow
@pytest.mark.parametrize("impl, words", [
    (course_class, "runs the course's own BucketedDataParallel (dtlab.parallel.data_parallel)"),
    (torch_ddp, "runs torch's DistributedDataParallel"),
])
def test_the_courses_own_or_torchs_ddp_is_not_the_exercise(impl, words):
    assert_fails_with(NAME, impl(), [FIRST, words, "the exercise is to write it"])
