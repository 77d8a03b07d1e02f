"""The reliability suite: exact resume, elastic restart, kill -9 during writes, dead peers, bad checkpoints.

Every distributed result is compared with a run that never failed; equality is bitwise
(``torch.equal``), which CPU training with a fixed reduction order makes possible.
"""

import json
import os
import random
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from dtlab import checkpoint, data, faults, launch, models, resumable

STEPS, EVERY, CRASH = 24, 5, 17  # 24 steps span two epochs of 16 batches: resume crosses an epoch boundary


pytestmark = pytest.mark.slow  # every test here starts a cluster, a browser, a set-up or several launches


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A fault-free 2-process run, the yardstick for every resumed run."""
    ckpt = tmp_path_factory.mktemp("reference")
    return launch.run(resumable.train, {"steps": STEPS, "every_steps": EVERY, "ckpt_dir": str(ckpt)}, nprocs=2)


def _crash_then_resume(ckpt_dir, resume="all"):
    cfg = {"steps": STEPS, "every_steps": EVERY, "ckpt_dir": str(ckpt_dir), "resume": resume}
    with pytest.raises(launch.WorkerError, match=r"rank 1 failed: process exited with code -9"):
        launch.run(resumable.train, {**cfg, "crash_at_step": CRASH}, nprocs=2)
    return launch.run(resumable.train, {**cfg, "attempt": 1}, nprocs=2)


def test_the_reference_run_is_repeatable_and_ranks_agree(reference, tmp_path):
    again = launch.run(resumable.train, {"steps": STEPS, "every_steps": EVERY, "ckpt_dir": str(tmp_path)}, nprocs=2)
    assert torch.equal(reference[0]["weights"], reference[1]["weights"])
    assert torch.equal(reference[0]["weights"], again[0]["weights"])


def test_a_killed_run_resumes_exactly_and_recomputes_less_than_one_interval(reference, tmp_path):
    resumed = _crash_then_resume(tmp_path)
    assert resumed[0]["resumed_from"] == 15  # the newest checkpoint before the crash at 17
    recomputed = CRASH - resumed[0]["resumed_from"]
    assert 0 <= recomputed < EVERY
    for rank in (0, 1):
        assert torch.equal(resumed[rank]["weights"], reference[rank]["weights"]), f"rank {rank} drifted"
    assert resumed[0]["losses"] == reference[0]["losses"][15:]


def test_resuming_only_the_weights_is_not_exact(reference, tmp_path):
    """The check above can fail: restoring weights and step alone ends elsewhere."""
    resumed = _crash_then_resume(tmp_path, resume="weights")
    assert not torch.equal(resumed[0]["weights"], reference[0]["weights"])


@pytest.mark.timeout(180)
def test_torchrun_restarts_after_a_kill_and_ends_with_the_fault_free_weights(reference, tmp_path):
    out, ckpt = tmp_path / "final.pt", tmp_path / "ckpt"
    cmd = [shutil.which("torchrun", path=os.path.dirname(sys.executable)), "--standalone", "--nproc_per_node", "2",
           "--max-restarts", "1", "-m", "dtlab.resumable", "--steps", str(STEPS), "--every-steps", str(EVERY),
           "--ckpt-dir", str(ckpt), "--crash-at-step", str(CRASH), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exitcode: -9" in proc.stderr  # the injected preemption really happened
    attempts = [json.loads(line) for line in (ckpt / "attempts.jsonl").read_text().splitlines()]
    assert [a["attempt"] for a in attempts] == [1] and attempts[0]["resumed_from"] == 15
    final = checkpoint.load(out)
    assert torch.equal(final["weights"], reference[0]["weights"])


def test_kill_9_during_checkpoint_writes_never_loses_the_previous_checkpoint(tmp_path):
    """20 writers killed at random moments: a complete checkpoint is always there, and it never goes back."""
    rng, newest, outcomes = random.Random(0), 0, []
    for trial in range(20):
        state = faults.kill_checkpoint_writer(tmp_path, 1_000_000, delay=rng.uniform(0.05, 0.4))
        assert state is not None, f"trial {trial}: nothing loadable"
        assert torch.all(state["model"]["w"] == state["step"]), f"trial {trial}: a checkpoint mixes two steps"
        assert state["step"] >= newest, f"trial {trial}: the newest checkpoint went back in time"
        outcomes.append(state["step"])
        newest = state["step"]
        # keep=2, plus at most one more when the kill fell between writing the new file and pruning
        assert len(faults.checkpoint_files(tmp_path)) <= 3, "keep=2 was not honoured"
    assert len(outcomes) == 20 and not list(tmp_path.glob(".step-*.tmp"))  # a new Checkpointer swept temp files


@pytest.mark.timeout(60)
@pytest.mark.parametrize("behaviour", ["stuck", "dies"])
def test_rank0_gets_an_error_within_the_timeout_when_its_peer_is_stuck_or_dead(behaviour):
    if behaviour == "dies":
        with pytest.raises(launch.WorkerError, match="rank 1 failed: process exited with code 1"):
            launch.run(faults.all_reduce_with_failing_peer, 3, behaviour, nprocs=2, timeout=30)
        return
    outcome = launch.run(faults.all_reduce_with_failing_peer, 3, behaviour, nprocs=2, timeout=30)[0]
    assert outcome["error"] is not None, "rank 0's all_reduce returned without its peer"
    assert outcome["seconds"] < 3 + 5, f"took {outcome['seconds']:.1f} s for a 3 s timeout"
    assert "timed out" in outcome["error"].lower() or "timeout" in outcome["error"].lower(), outcome["error"]


# --- bad checkpoints -------------------------------------------------------------------------------

def _model_opt(hidden=16):
    torch.manual_seed(0)
    model = models.MLP(8, hidden, 3, depth=1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_checkpointer_keeps_the_newest_m_and_loads_with_weights_only(tmp_path):
    model, opt = _model_opt()
    ckpt = checkpoint.Checkpointer(tmp_path, every_steps=2, keep=3)
    saved = [ckpt.maybe_save(step, lambda s=step: checkpoint.training_state(model, optimizer=opt, step=s))
             for step in range(1, 11)]
    assert [p.name for p in saved if p] == [f"step-{s:08d}.pt" for s in (2, 4, 6, 8, 10)]
    assert [p.name for p in ckpt.checkpoints()] == [f"step-{s:08d}.pt" for s in (6, 8, 10)]
    assert torch.load(ckpt.latest(), weights_only=True)["step"] == 10


def test_time_based_checkpoints(tmp_path):
    model, _ = _model_opt()
    ckpt = checkpoint.Checkpointer(tmp_path, every_seconds=600)   # far from due, however loaded the machine
    assert ckpt.maybe_save(1, lambda: checkpoint.training_state(model, step=1)) is None
    ckpt._last_save -= 601                                          # ten minutes later, as far as it knows
    assert ckpt.maybe_save(2, lambda: checkpoint.training_state(model, step=2)) is not None
    assert ckpt.maybe_save(3, lambda: checkpoint.training_state(model, step=3)) is None, "the clock restarted"


def test_an_unreadable_newest_checkpoint_falls_back_to_the_one_before(tmp_path):
    model, opt = _model_opt()
    ckpt = checkpoint.Checkpointer(tmp_path, every_steps=1, keep=3)
    for step in (1, 2):
        ckpt.save(step, checkpoint.training_state(model, optimizer=opt, step=step))
    newest = ckpt.latest()
    newest.write_bytes(newest.read_bytes()[:100])  # a disk fault truncated it
    with pytest.warns(UserWarning, match="skipping unreadable checkpoint step-00000002.pt"):
        assert ckpt.load_latest()["step"] == 1


def test_nan_weights_are_never_written_over_a_good_checkpoint(tmp_path):
    model, opt = _model_opt()
    ckpt = checkpoint.Checkpointer(tmp_path, every_steps=1, keep=1)
    ckpt.save(1, checkpoint.training_state(model, optimizer=opt, step=1))
    with torch.no_grad():
        model.net[0].weight[0, 0] = float("nan")
    with pytest.raises(checkpoint.CheckpointError, match="NaN or inf at step 2.*step-00000001.pt"):
        ckpt.save(2, checkpoint.training_state(model, optimizer=opt, step=2))
    assert [p.name for p in ckpt.checkpoints()] == ["step-00000001.pt"]


def test_mismatched_checkpoints_are_refused_before_anything_changes(tmp_path):
    model, opt = _model_opt()
    state = checkpoint.training_state(model, optimizer=opt, step=3)
    other, other_opt = _model_opt(hidden=32)
    before = [p.clone() for p in other.parameters()]
    with pytest.raises(checkpoint.CheckpointError, match=r"does not fit this model: net.0.weight"):
        checkpoint.restore(state, other, optimizer=other_opt)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))

    fresh, _ = _model_opt()
    grouped = torch.optim.SGD([{"params": [fresh.net[0].weight]}, {"params": list(fresh.parameters())[1:]}], lr=0.1)
    with pytest.raises(checkpoint.CheckpointError, match=r"parameter groups of sizes \[4\].*\[1, 3\]"):
        checkpoint.restore(state, fresh, optimizer=grouped)

    state["world_size"] = 4
    with pytest.raises(checkpoint.CheckpointError, match="run of 4 processes; this run has 1.*allow_new_world_size"):
        checkpoint.restore(state, fresh)
    assert checkpoint.restore(state, fresh, allow_new_world_size=True) == (0, 3)


def test_the_loader_resumes_mid_epoch_and_refuses_another_sharding():
    dataset = data.synthetic_classification(96)
    full = data.DistributedLoader(dataset, batch_size=8, rank=1, world_size=2, seed=3)
    reference = [y for _ in range(2) for _, y in full]
    first = data.DistributedLoader(dataset, batch_size=8, rank=1, world_size=2, seed=3)
    seen = []
    for _, y in first:
        seen.append(y)
        if len(seen) == 4:
            state = first.state_dict()  # saved mid-epoch, as a checkpoint at step 4 does; then "killed"
            break
    assert (state["epoch"], state["batches_done"]) == (0, 4)
    second = data.DistributedLoader(dataset, batch_size=8, rank=1, world_size=2, seed=3)
    second.load_state_dict(state)
    seen += [y for _ in range(2) for _, y in second][: len(reference) - 4]
    assert all(torch.equal(a, b) for a, b in zip(seen, reference)) and len(seen) == len(reference)
    with pytest.raises(ValueError, match="world_size: saved 2, now 3"):
        data.DistributedLoader(dataset, batch_size=8, rank=1, world_size=3, seed=3).load_state_dict(state)


def _rank0_builds_the_state_alone():
    import torch.distributed as dist

    from dtlab import distributed

    distributed.setup(timeout=timedelta(seconds=10))
    model, opt = _model_opt()
    state = checkpoint.training_state(model, optimizer=opt, step=1) if dist.get_rank() == 0 else None
    dist.barrier()
    return state is not None and "rng_per_rank" not in state


@pytest.mark.timeout(60)
def test_training_state_runs_no_collective_so_rank0_may_call_it_alone():
    """Notebook 03 calls it on rank 0 only; a collective inside it hung that notebook once."""
    assert launch.run(_rank0_builds_the_state_alone, nprocs=2, timeout=30) == [True, False]


# --- every rank resumes from the same checkpoint; a failed save fails everywhere ---------------------

def _resume_from_node_local_folders(root):
    """Each rank keeps checkpoints in its own folder, as on node-local disks; rank 1 lacks the newest."""
    import torch.distributed as dist

    from dtlab import distributed

    distributed.setup(timeout=timedelta(seconds=20))
    rank = dist.get_rank()
    folder = Path(root) / f"node{rank}"
    model, opt = _model_opt()
    ckpt = checkpoint.Checkpointer(folder, every_steps=1, keep=5)
    for step in (1, 2, 3):
        state = checkpoint.training_state(model, optimizer=opt, step=step)
        checkpoint.save(folder / f"step-{step:08d}.pt", state)    # what each node's disk holds
    if rank == 1:
        (folder / "step-00000003.pt").unlink()                   # this node missed the last copy
        (folder / "step-00000002.pt").write_bytes(b"torn")       # and has a damaged one
    try:
        state = ckpt.load_latest()
        outcome = {"step": state["step"]}
    except checkpoint.CheckpointError as exc:
        outcome = {"error": str(exc)}
    distributed.teardown()
    return outcome


@pytest.mark.timeout(60)
def test_rank0_chooses_the_checkpoint_and_a_rank_that_cannot_read_it_fails_everywhere(tmp_path):
    # Before: rank 0 resumed from step 3 and rank 1 from step 1 (its newest readable file), silently.
    results = launch.run(_resume_from_node_local_folders, str(tmp_path), nprocs=2, timeout=45)
    assert all("error" in r for r in results), results
    assert all("rank 0 chose" in r["error"] and "step-00000003.pt" in r["error"] and "[1]" in r["error"]
               for r in results), results


def _same_folder_resume(root):
    from dtlab import distributed

    distributed.setup(timeout=timedelta(seconds=20))
    model, opt = _model_opt()
    ckpt = checkpoint.Checkpointer(root, every_steps=1, keep=3)
    for step in (1, 2):
        ckpt.save(step, checkpoint.training_state(model, optimizer=opt, step=step))
    step = ckpt.load_latest()["step"]
    distributed.teardown()
    return step


@pytest.mark.timeout(60)
def test_every_rank_resumes_from_the_step_rank0_chose(tmp_path):
    assert launch.run(_same_folder_resume, str(tmp_path), nprocs=2, timeout=45) == [2, 2]


def _save_fails_on_rank0(root):
    import time as _time

    from dtlab import distributed

    distributed.setup(timeout=timedelta(seconds=30))
    model, opt = _model_opt()
    ckpt = checkpoint.Checkpointer(root, every_steps=1)
    if distributed.is_main():
        ckpt.directory = Path(root) / "deleted"                  # rank 0's write will fail
    start = _time.monotonic()
    try:
        ckpt.save(1, checkpoint.training_state(model, optimizer=opt, step=1))
        return {"error": None}
    except checkpoint.CheckpointError as exc:
        return {"error": str(exc).splitlines()[0], "seconds": _time.monotonic() - start}
    finally:
        distributed.teardown(failed=True)


@pytest.mark.timeout(90)
def test_a_save_that_fails_on_rank0_fails_on_every_rank_at_once(tmp_path):
    # Before: rank 0 raised and the others waited at the barrier for the whole timeout (30 s here).
    results = launch.run(_save_fails_on_rank0, str(tmp_path), nprocs=2, timeout=80)
    assert "does not exist" in results[0]["error"], results[0]
    assert results[1]["error"].startswith("rank 0 failed writing checkpoint"), results[1]
    assert results[1]["seconds"] < 15, "rank 1 heard of the failure instead of waiting for the timeout"
