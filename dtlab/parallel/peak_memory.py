"""Peak memory of a training step, measured: the CPU's answer to ``torch.cuda.max_memory_allocated``.

On a GPU, PyTorch's caching allocator keeps the bytes of live tensors and their peak
(``torch.cuda.memory_allocated`` / ``max_memory_allocated``). A CPU build keeps no such statistics by
default, and the process's resident set is no measure (libraries dominate it, and ``torch.empty`` maps
pages it has not touched). What it does have: c10's CPU allocator can keep a running total of the bytes
it has handed out and not got back (its ``caffe2_report_cpu_memory_usage`` flag), on every thread, and
log that total at every allocation and free (at c10's INFO log level). ``measure_peak`` turns the log on
for the phases it runs, reads it back and takes the maximum: the exact peak of live tensor bytes, the same
quantity ``max_memory_allocated`` reports on a GPU (without its rounding of each block to 512 bytes).

Why not the profiler (``torch.profiler.profile(profile_memory=True)``) alone? Its memory events come only
from threads the profiler follows. gloo frees the last reference to a collective's tensors on its worker
threads (a ``reduce_scatter_tensor``'s full-size copy, for one), so a sum of the events in order keeps
counting what was freed there; and a tensor allocated and freed on another thread (by any library) is never
seen, so a peak reached there is missed (``tests/test_peak_memory.py`` shows it). With the flag set, each
event at least carries the allocator's running total over all threads: ``measure_peak(..., cross_check=True)``
also reads those and reports the largest as ``profiler_peak``, a check on the log that agrees with ``peak``
unless the peak was reached on another thread.

Use::

    from dtlab.parallel import peak_memory
    peak_memory.track_cpu_allocations()      # first thing in the process, before the model is built
    ...                                      # build the model, run a warm-up step
    m = peak_memory.measure_peak([forward, backward, step])     # callables, run in turn
    m.start, m.peak, m.after, m.phase_peaks  # bytes live: at the start, the most ever, after/within each phase

Bytes are absolute on a GPU and, on a CPU, count every tensor allocated since ``track_cpu_allocations``
was called and not freed since (tensors made before are invisible, and so are their frees: call it
first). Tensors that do not come from PyTorch's CPU allocator (``torch.from_numpy``, shared memory made by
a library) are not counted on either device.

``worker`` (run it with ``dtlab.launch.run(worker, cfg, nprocs=2)``) trains one configuration (a model,
a strategy: DDP, FSDP2 or DeepSpeed ZeRO) for a warm-up step and then measures whole steps, per rank,
recording what a memory planner needs to price the same step; ``scripts/measure_memory_cpu.py`` runs
the grid and writes ``dtlab/planner/measured_cpu.json``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

_EVENT = re.compile(rb"C10 (alloc|deleted) (\d+) bytes, total alloc (\d+) bytes")
_MARK = re.compile(rb"dtlab-peak-mark (\d+)")
_MARK_TEXT = "\ndtlab-peak-mark {}\n"
_INFO = re.compile(rb"\[I\d{4} ")    # a c10 INFO line (its level letter and date), perhaps after a "[rank0]:" prefix


@dataclass(frozen=True)
class Peak:
    """Live tensor bytes measured over phases run in turn.

    ``start``: live when the first phase began; ``peak``: the most live at any moment of any phase;
    ``after[i]``: live when phase ``i`` ended; ``phase_peaks[i]``: the most live during phase ``i`` (the
    phase whose peak equals ``peak`` is where the step peaks). ``events``: allocations and frees counted
    (CPU; 0 on a GPU). ``profiler_peak``: with ``cross_check=True`` on a CPU, the most the profiler's
    memory events saw (only the calling thread's allocations carry a reading), else None.
    """

    start: int
    peak: int
    after: tuple[int, ...]
    phase_peaks: tuple[int, ...]
    events: int = 0
    profiler_peak: int | None = None

    @property
    def above_start(self) -> int:
        """``peak - start``: what the phases added at their most."""
        return self.peak - self.start

    def as_dict(self) -> dict[str, Any]:
        """The fields as a dict (tuples as lists), with ``above_start``."""
        d = asdict(self)
        d["after"], d["phase_peaks"] = list(self.after), list(self.phase_peaks)
        d["above_start"] = self.above_start
        return d


def _c10() -> ctypes.CDLL | None:
    import glob

    for lib in sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.*"))):
        try:
            return ctypes.CDLL(lib)
        except OSError:
            continue
    return None


def _flag(ctype: Any, name: str) -> Any:
    lib = _c10()
    if lib is None:
        return None
    try:
        return ctype.in_dll(lib, name)
    except ValueError:
        return None


def cpu_tracking_available() -> bool:
    """Whether this torch's c10 library exposes the two flags ``measure_peak`` needs on a CPU."""
    return (_flag(ctypes.c_bool, "FLAGS_caffe2_report_cpu_memory_usage") is not None
            and _flag(ctypes.c_int, "FLAGS_caffe2_log_level") is not None)


def track_cpu_allocations(on: bool = True) -> bool:
    """Make c10's CPU allocator keep its running total of live bytes on every thread (``on=False``: stop);
    return whether it did before. Call it first in a process: tensors allocated before are not counted.

    Raises:
        RuntimeError: this torch's c10 library has no ``caffe2_report_cpu_memory_usage`` flag.
    """
    flag = _flag(ctypes.c_bool, "FLAGS_caffe2_report_cpu_memory_usage")
    if flag is None:
        raise RuntimeError(f"torch {torch.__version__}'s c10 has no caffe2_report_cpu_memory_usage flag: the CPU "
                           "allocator cannot count live bytes here")
    before = bool(flag.value)
    if on and not before:
        older = torch.empty(1, dtype=torch.uint8)   # freed once the count runs: spends c10's one-in-1000 warning
        flag.value = True
        with _fd2_to(os.devnull):
            del older
    else:
        flag.value = on
    return before


@contextlib.contextmanager
def _fd2_to(path_or_fd: str | int):
    """Send what native code writes to file descriptor 2 to ``path_or_fd`` for the block."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    target = os.open(path_or_fd, os.O_WRONLY) if isinstance(path_or_fd, str) else os.dup(path_or_fd)
    try:
        os.dup2(target, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(target)


def measure_peak(phases: Callable[[], object] | Iterable[Callable[[], object]],
                 device: torch.device | str = "cpu", cross_check: bool = False) -> Peak:
    """Run each callable of ``phases`` (or the one callable) in turn; return the live tensor bytes (``Peak``).

    On a GPU: ``torch.cuda.memory_allocated`` at each boundary and ``max_memory_allocated`` within each phase
    (the peak statistics are reset). On a CPU: the c10 allocator's running total, logged at every allocation
    and free on every thread while the phases run (``track_cpu_allocations`` must be on; it is turned on if
    not, counting from now). During the phases, what native code writes to stderr goes to a temporary file;
    lines other than the allocator's are written back afterwards. ``cross_check=True`` (CPU) also runs
    ``torch.profiler`` with ``profile_memory`` and reports the most its events saw as ``profiler_peak``.
    """
    phases = [phases] if callable(phases) else list(phases)
    device = torch.device(device)
    if device.type == "cuda":
        return _measure_cuda(phases, device)
    return _measure_cpu(phases, cross_check)


def peak_bytes(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """The peak of live tensor bytes while ``fn()`` runs (``measure_peak(fn, device).peak``)."""
    return measure_peak(fn, device).peak


def _measure_cuda(phases: Sequence[Callable[[], object]], device: torch.device) -> Peak:
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    after, peaks = [], []
    for phase in phases:
        torch.cuda.reset_peak_memory_stats(device)
        phase()
        torch.cuda.synchronize(device)
        after.append(int(torch.cuda.memory_allocated(device)))
        peaks.append(int(torch.cuda.max_memory_allocated(device)))
    return Peak(start=int(start), peak=max(peaks + [int(start)]), after=tuple(after), phase_peaks=tuple(peaks))


def _measure_cpu(phases: Sequence[Callable[[], object]], cross_check: bool) -> Peak:
    if not cpu_tracking_available():
        raise RuntimeError(f"torch {torch.__version__}'s c10 lacks the allocator flags this measurement reads")
    track_cpu_allocations(True)
    level = _flag(ctypes.c_int, "FLAGS_caffe2_log_level")
    prof = None
    if cross_check:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with tempfile.TemporaryFile() as log:
        old_level = level.value
        with _fd2_to(log.fileno()):
            if prof is not None:
                with _fd2_to(os.devnull):
                    prof.start()
            level.value = 0                           # INFO: the allocator logs every allocation and free
            try:
                torch.empty(1, dtype=torch.uint8)     # one event before the first mark: the reading at it
                for i, phase in enumerate(phases):
                    os.write(2, _MARK_TEXT.format(i).encode())
                    phase()
                os.write(2, _MARK_TEXT.format(len(phases)).encode())
            finally:
                level.value = old_level
                if prof is not None:
                    with _fd2_to(os.devnull):
                        prof.stop()
        log.seek(0)
        text = log.read()
    start, after, peaks, events = _parse(text, len(phases))
    _pass_on(text)
    profiler_peak = _profiler_peak(prof) if prof is not None else None
    return Peak(start=start, peak=max(peaks + [start]), after=tuple(after), phase_peaks=tuple(peaks),
                events=events, profiler_peak=profiler_peak)


def _parse(text: bytes, n: int) -> tuple[int, list[int], list[int], int]:
    """The allocator's log between the marks: the reading at each mark (the total after the last event before
    it) and the most live within each phase."""
    tokens = sorted([(m.start(), "event", int(m.group(3))) for m in _EVENT.finditer(text)]
                    + [(m.start(), "mark", int(m.group(1))) for m in _MARK.finditer(text)])
    total = None
    readings: dict[int, int] = {}
    peaks = [0] * n
    phase = None
    events = 0
    for _, kind, value in tokens:
        if kind == "mark":
            if total is None:
                raise RuntimeError("no allocator event before the first mark: c10's allocator log is not working")
            readings[value] = total
            phase = value if value < n else None
            if phase is not None:
                peaks[phase] = total
            continue
        total = value
        if phase is not None:
            events += 1
            peaks[phase] = max(peaks[phase], total)
    missing = [i for i in range(n + 1) if i not in readings]
    if missing:
        raise RuntimeError(f"marks {missing} missing from the allocator log: it was cut short")
    return readings[0], [readings[i + 1] for i in range(n)], peaks, events


def _pass_on(text: bytes) -> None:
    """Write back to stderr what native code wrote during the measurement, less the INFO lines it was made
    to write (the allocator's, and any other c10 INFO line) and the marks."""
    keep = [line for line in text.splitlines()
            if line.strip() and not _INFO.search(line) and not _MARK.search(line) and not _EVENT.search(line)
            and b"Memory block of unknown size" not in line and b"ActivityProfilerHandler" not in line]
    if keep:
        os.write(2, b"\n".join(keep) + b"\n")


def _profiler_peak(prof: Any) -> int | None:
    import json

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        with _fd2_to(os.devnull):
            prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    totals = [e["args"].get("Total Allocated") for e in events
              if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0]
    totals = [t for t in totals if t is not None]
    return int(max(totals)) if totals else None


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts its whole storage, once; a DTensor its
    local part; storages already in ``seen`` are skipped and new ones added to it)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        t = getattr(t, "_local_tensor", t)
        storage = t.untyped_storage()
        key = (t.device.type, t.device.index, storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _tensors_in(obj: Any, depth: int = 2) -> list[torch.Tensor]:
    """Tensors in ``obj``: a tensor, or (``depth`` levels down) lists, tuples, dicts and ``.buffer`` attributes."""
    if torch.is_tensor(obj):
        return [obj]
    if depth == 0:
        return []
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors_in(x, depth - 1)]
    if hasattr(obj, "buffer"):
        return _tensors_in(obj.buffer, depth - 1)
    return []


# ---------------------------------------------------------------------------------------------------------------
# The measured configurations
# ---------------------------------------------------------------------------------------------------------------

#: Strategies ``worker`` trains: torch's DDP, FSDP2 (``fully_shard`` per block and the root), DeepSpeed ZeRO.
STRATEGIES = ("DDP", "FSDP2", "ZeRO-1", "ZeRO-2", "ZeRO-3")


def model_shape(cfg: dict) -> dict[str, Any]:
    """What a planner needs of the model ``cfg["model"]`` describes (``dtlab.planner.formulas.ModelShape``'s
    fields and a few more), from the config alone."""
    m = cfg["model"]
    if m["family"] == "TinyGPT":
        return {"name": "TinyGPT", "n_layer": m["n_layer"], "n_embd": m["n_embd"], "n_head": m["n_head"],
                "n_kv_head": m["n_head"], "head_dim": m["n_embd"] // m["n_head"], "ffn": 4 * m["n_embd"],
                "gated": False, "activation": "GELU (exact)", "vocab": m["vocab"], "tied": False, "dropout": False,
                "norm": "LayerNorm (weight and bias)", "biases": True, "positions": "learned (block_size x n_embd)",
                "max_positions": cfg["seq_len"]}
    return {"name": "LlamaForCausalLM", "n_layer": m["n_layer"], "n_embd": m["hidden"], "n_head": m["n_head"],
            "n_kv_head": m["n_kv_head"], "head_dim": m["hidden"] // m["n_head"], "ffn": m["intermediate"],
            "gated": True, "activation": "SiLU (SwiGLU: gate, up, down)", "vocab": m["vocab"], "tied": False,
            "dropout": False, "norm": "RMSNorm (weight only)", "biases": False, "positions": "RoPE (no weights)",
            "max_positions": cfg["seq_len"]}


def build_model(cfg: dict) -> torch.nn.Module:
    """The model of ``cfg["model"]``, the same weights on every rank: ``dtlab.models.TinyGPT`` (untied head,
    ``side_by_side.make_model``) or a Hugging Face ``LlamaForCausalLM`` built from a ``LlamaConfig`` (untied)."""
    m = cfg["model"]
    if m["family"] == "TinyGPT":
        from dtlab.parallel import side_by_side

        return side_by_side.make_model({**m, "block": cfg["seq_len"]})
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["intermediate"],
                         num_hidden_layers=m["n_layer"], num_attention_heads=m["n_head"],
                         num_key_value_heads=m["n_kv_head"], max_position_embeddings=cfg["seq_len"],
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def loss_of(model: Any, family: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position's logits (batch x seq rows, vocab wide, fp32):
    TinyGPT computes it in its forward; for Llama, ``F.cross_entropy`` on ``.logits`` (as notebook 21)."""
    import torch.nn.functional as F

    if family == "TinyGPT":
        return model(x, y)[1]
    return F.cross_entropy(model(input_ids=x, use_cache=False).logits.flatten(0, 1), y.flatten())


class _SdpaCalls:
    """Record how ``F.scaled_dot_product_attention`` is called inside the block (the first call)."""

    def __enter__(self):
        import torch.nn.functional as F

        self.F, self.original, self.calls = F, F.scaled_dot_product_attention, []

        def recording(q, k, v, *args, **kwargs):
            if not self.calls:
                self.calls.append({"q": list(q.shape), "k": list(k.shape), "v": list(v.shape),
                                   "attn_mask": None if kwargs.get("attn_mask", args[0] if args else None) is None
                                   else "tensor", "is_causal": bool(kwargs.get("is_causal", False)),
                                   "enable_gqa": bool(kwargs.get("enable_gqa", False)),
                                   "dropout_p": float(kwargs.get("dropout_p", 0.0))})
            return self.original(q, k, v, *args, **kwargs)

        F.scaled_dot_product_attention = recording
        return self

    def __exit__(self, *exc):
        self.F.scaled_dot_product_attention = self.original


def _ops_seen(prof: Any, words: Sequence[str]) -> list[str]:
    return sorted({e.name for e in prof.events() if any(w in e.name for w in words)})


def worker(cfg: dict) -> dict[str, Any]:
    """Train one configuration on this rank and measure its steps; see the module help.

    ``cfg``: ``model`` (``family`` "TinyGPT" with ``n_layer``, ``n_embd``, ``n_head``, ``vocab``; or "Llama" with
    ``n_layer``, ``hidden``, ``intermediate``, ``n_head``, ``n_kv_head``, ``vocab``), ``seq_len``, ``batch``
    (sequences per rank), ``strategy`` (one of ``STRATEGIES``), ``options`` (DDP: ``gradient_as_bucket_view``;
    FSDP2: ``reshard_after_forward``; ZeRO: entries for ``zero_optimization``; all: ``foreach``),
    ``measured_steps``, ``backend``. Returns this rank's record: the bytes (``Peak`` of each measured step:
    forward, backward, optimizer step), what they are made of at the start of the step, the settings in force.
    """
    track_cpu_allocations(True)
    import gc
    import logging
    import warnings

    import torch.distributed as dist

    from dtlab import data, ds_config

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    warnings.filterwarnings("ignore", message=".* is deprecated. Please use .*_single")
    strategy, options = cfg["strategy"], dict(cfg.get("options", {}))
    family = cfg["model"]["family"]
    zero_stage = int(strategy.split("-")[1]) if strategy.startswith("ZeRO") else None
    if zero_stage is not None:
        import deepspeed
        from deepspeed.utils import logger

        logger.setLevel(logging.ERROR)
        deepspeed.init_distributed(dist_backend=cfg["backend"])
    else:
        dist.init_process_group(cfg["backend"])
    rank, world = dist.get_rank(), dist.get_world_size()
    before_model = measure_peak(lambda: None).start

    per_rank = cfg["batch"]
    x, y = data.synthetic_tokens(per_rank * world, cfg["seq_len"], cfg["model"]["vocab"], seed=1).tensors
    x, y = x[rank * per_rank:(rank + 1) * per_rank].clone(), y[rank * per_rank:(rank + 1) * per_rank].clone()

    model = build_model(cfg)
    params_total = sum(p.numel() for p in model.parameters())
    settings: dict[str, Any] = {}
    foreach = options.pop("foreach", None)
    adamw = {"lr": 1e-3, "weight_decay": 0.01}
    engine = opt = wrapped = None
    if strategy == "DDP":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model, gradient_as_bucket_view=bool(options.get("gradient_as_bucket_view", False)))
        opt = torch.optim.AdamW(model.parameters(), foreach=foreach, **adamw)
        settings["ddp"] = {"gradient_as_bucket_view": wrapped.gradient_as_bucket_view,
                           "bucket_cap_bytes": int(wrapped.bucket_bytes_cap),
                           "first_bucket_bytes": int(getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 0)) or None,
                           "find_unused_parameters": wrapped.find_unused_parameters,
                           "static_graph": bool(wrapped.static_graph), "broadcast_buffers": wrapped.broadcast_buffers}
    elif strategy == "FSDP2":
        from torch.distributed.device_mesh import init_device_mesh

        from dtlab.parallel import fsdp2

        given = {k: options[k] for k in ("reshard_after_forward",) if k in options}
        fsdp2.shard_blocks(model, init_device_mesh("cpu", (world,)),
                           blocks="blocks" if family == "TinyGPT" else "model.layers", **given)
        wrapped = model
        opt = torch.optim.AdamW(model.parameters(), foreach=foreach, **adamw)
        settings["fsdp2"] = {"units": "fully_shard on each transformer block, then on the root (embeddings, final "
                                      "norm, output layer)",
                             "reshard_after_forward_argument": given.get("reshard_after_forward", "not given (None)"),
                             "mp_policy": "none (fp32 parameters, gradients, reduction)", "offload": "none"}
    else:
        import deepspeed

        config = ds_config.build(stage=zero_stage, micro_batch=per_rank, accumulation=1, world_size=world,
                                 lr=adamw["lr"], weight_decay=adamw["weight_decay"])
        config["zero_optimization"].update(options)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        wrapped = engine
        zc = engine._config.zero_config
        settings["deepspeed"] = {"version": deepspeed.__version__, "config": config,
                                 "zero_optimization": json_safe(zc.model_dump(by_alias=True)),
                                 "gradient_clipping": float(engine.gradient_clipping()),
                                 "communication_data_type": str(engine.communication_data_type),
                                 "optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__}
    settings["zero_grad"] = ("DeepSpeed's engine.step() (it zeroes its own gradient buffers)" if engine is not None
                             else "optimizer.zero_grad(set_to_none=True) at the end of each step (no gradient is "
                                  "live between steps)")

    state: dict[str, Any] = {}

    def forward():
        state["loss"] = loss_of(wrapped, family, x, y)

    if engine is not None:
        def backward():
            engine.backward(state.pop("loss"))

        def step():
            engine.step()
    else:
        def backward():
            state.pop("loss").backward()

        def step():
            opt.step()
            opt.zero_grad(set_to_none=True)

    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    prof = profile(activities=[ProfilerActivity.CPU])
    with _SdpaCalls() as sdpa:
        with _fd2_to(os.devnull):                     # Kineto prints a line at every start and stop
            prof.start()
        try:
            forward()
        finally:
            with _fd2_to(os.devnull):
                prof.stop()
    attention_ops = _ops_seen(prof, ("attention",))
    loss_ops = _ops_seen(prof, ("log_softmax", "nll_loss", "cross_entropy"))
    backward()
    step()
    warmup_s = time.perf_counter() - t0
    del prof
    settings["optimizer"] = _optimizer_settings(engine.optimizer.optimizer if engine is not None else opt)
    if strategy == "FSDP2":
        settings["fsdp2"]["reshard_after_forward_in_force"] = _fsdp2_resharding(model)

    steps = []
    for _ in range(cfg.get("measured_steps", 1)):
        gc.collect()
        dist.barrier()
        held = _held(wrapped, engine, opt)
        t0 = time.perf_counter()
        peak = measure_peak([forward, backward, step], cross_check=cfg.get("cross_check", False))
        steps.append({**peak.as_dict(), "seconds": time.perf_counter() - t0, "held_at_start": held,
                      "other_at_start": peak.start - held["total"]})
    record = {"rank": rank, "world": world, "params_total": params_total, "before_model": before_model,
              "warmup_s": warmup_s, "steps": steps, "settings": settings,
              "attention": {"ops": attention_ops, "sdpa_call": sdpa.calls[0] if sdpa.calls else None,
                            "implementation": ("torch.nn.functional.scaled_dot_product_attention" if family == "TinyGPT"
                                               else f"transformers attn_implementation="
                                                    f"{model.config._attn_implementation!r}")},
              "loss_ops": loss_ops}
    if engine is not None:
        from dtlab import _compat

        record["deepspeed_buffers"] = _deepspeed_buffers(engine)
        shm = _compat.deepspeed_shm_buffers(os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""),
                                            [rank])
        record["deepspeed_shm_bytes"] = sum(f.stat().st_size for f in shm if f.exists())
    dist.barrier()
    dist.destroy_process_group()
    return record


def json_safe(value: Any) -> Any:
    """``value`` with what JSON cannot hold (enums, dtypes, devices...) turned into strings."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _optimizer_settings(opt: Any) -> dict[str, Any]:
    defaults = dict(opt.defaults)
    state_shapes = sorted({(k, str(t.dtype), "scalar" if t.dim() == 0 else "parameter-sized")
                           for s in opt.state.values() for k, t in s.items() if torch.is_tensor(t)})
    return {"name": type(opt).__name__, "lr": defaults.get("lr"), "weight_decay": defaults.get("weight_decay"),
            "betas": list(defaults.get("betas", ())), "eps": defaults.get("eps"),
            "foreach": defaults.get("foreach"), "fused": defaults.get("fused"),
            "capturable": defaults.get("capturable"),
            "implementation": "single-tensor loop (torch's default for CPU tensors)"
                              if not defaults.get("foreach") and not defaults.get("fused") else
                              ("foreach" if defaults.get("foreach") else "fused"),
            "state": "exp_avg and exp_avg_sq (fp32, the size of each parameter it steps) and step (an fp32 scalar "
                     "tensor per parameter); created at the first step",
            "state_tensors": [list(k) for k in state_shapes]}


def _fsdp2_resharding(model: torch.nn.Module) -> dict[str, bool]:
    """Whether each FSDP2 unit frees its gathered parameters after forward (read after the first forward: FSDP2
    decides the root's at its lazy initialisation). Keys: ``root`` and the blocks' module names."""
    out = {}
    for name, module in model.named_modules():
        state = getattr(module, "_get_fsdp_state", None)
        if state is None:
            continue
        group = state()._fsdp_param_group
        if group is not None:
            out[name or "root"] = group.post_forward_mesh_info is not None
    return out


def _local_param(p: torch.Tensor) -> torch.Tensor:
    if hasattr(p, "ds_tensor"):
        return p.ds_tensor
    return getattr(p, "_local_tensor", p)


def _held(wrapped: Any, engine: Any, opt: Any) -> dict[str, int]:
    """Bytes this rank holds now, by part, each storage counted once (the first part that names it):
    parameters (local shards), gradients, optimizer state (DeepSpeed: moments and fp32 master weights)."""
    seen: set = set()
    module = engine.module if engine is not None else getattr(wrapped, "module", wrapped)
    params = [_local_param(p) for p in module.parameters()]
    held = {"params": storage_bytes(params, seen)}
    grads = [p.grad for p in module.parameters()]
    if engine is not None:
        zopt = engine.optimizer
        grads += _tensors_in(getattr(zopt, "grad_partitions_flat_buffer", None))
        grads += _tensors_in(getattr(zopt, "averaged_gradients", None))
        inner = zopt.optimizer
        state = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t)]
        state += _tensors_in(getattr(zopt, "single_partition_of_fp32_groups", None))
        state += _tensors_in(getattr(zopt, "fp32_partitioned_groups_flat", None))
    else:
        state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    held["grads"] = storage_bytes(grads, seen)
    held["optimizer"] = storage_bytes(state, seen)
    held["total"] = held["params"] + held["grads"] + held["optimizer"]
    return held


#: DeepSpeed ZeRO optimizer attributes that hold tensors, by the name its source gives them.
DEEPSPEED_BUFFERS = ("bit16_groups_flat", "fp16_partitioned_groups_flat", "single_partition_of_fp32_groups",
                     "fp32_partitioned_groups_flat", "grad_partitions_flat_buffer", "averaged_gradients",
                     "ipg_buckets", "grads_in_partition", "parallel_partitioned_bit16_groups")


def _deepspeed_buffers(engine: Any) -> dict[str, int]:
    """Bytes of each tensor-holding attribute of DeepSpeed's ZeRO optimizer (storages counted once overall)."""
    zopt, seen, out = engine.optimizer, set(), {}
    for name in DEEPSPEED_BUFFERS:
        value = getattr(zopt, name, None)
        if value is not None:
            out[name] = storage_bytes(_tensors_in(value, depth=3), seen)
    return out
