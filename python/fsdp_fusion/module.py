"""`FusedFSDP`: a torch module trained through an fsdp-fusion engine.

The wrapper declares every parameter of the module to the engine (its unit is the index of the
unit module holding it, or the root; a parameter held by several modules is tied), loads the
initial values and drops the module's own parameter storage. Hooks then point each parameter's
`.data` at its gathered view while one of its unit's hooks is open, forward and backward, and
hand the unit's gradients to the engine once its backward is done: one C call for its views and
one for its gradients, whatever its number of parameters. At world size 1 with shard storage the
views are the shards themselves, which never move: parameters stay views between hooks, the
units' hooks are removed once every unit's views are mapped (where the root has parameters of its
own, whose hooks tell the engine where a pass begins), and the whole model's gradients go to the
engine in one call when the next forward or the step begins.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable, Mapping
from ctypes import byref, c_size_t, c_uint64, c_void_p
from dataclasses import dataclass

import torch

from . import _capi
from ._capi import ROOT, Counters, Memory, GradNorm, Releasing
from ._allocator import TorchAllocator
from ._dlpack import device_index
from ._engine import _EngineCreation, _choice, _membership
from ._hooks import _Hooks, _RootForward, _Unit
from .errors import InvalidArgumentError, MisuseError
from ._params import (
    DTYPE_CODES,
    _holds_placeholders,
    _check_placement,
    _exempt,
    _owners,
    _param_groups,
    _scales,
)
from ._state import _StateCopies
from .group import LocalGroup, LoopbackGroup


@torch.compiler.disable
def _refuse_compiling(compiling: bool):
    """Refuses a trace of the wrapped model. The hooks call the engine between the units and
    swap the parameters' storage: traced, they break the graph at every unit and the compiled
    code reads the wrong memory. Raised outside the trace (a disabled function), so that the
    error reaches the caller rather than sending the compiler on into the units."""
    if compiling:
        raise MisuseError("compile the units (`model.blocks[i] = torch.compile(block)` before "
                          "wrapping), not the wrapped model: the engine's hooks run between the "
                          "compiled regions")


def _refuse_compiled_in_place(module: torch.nn.Module, units: list[torch.nn.Module]):
    """`Module.compile()` compiles a module's call with its hooks: the wrapper's hooks would be
    traced, as in a compiled wrapped model. `torch.compile(block)` compiles around them."""
    for what, m in [("the module", module)] + [(f"unit {i}", u) for i, u in enumerate(units)]:
        # Where Module.compile() keeps the compiled call (torch >= 2.2).
        if getattr(m, "_compiled_call_impl", None) is not None:
            raise InvalidArgumentError(
                f"{what} was compiled in place (`Module.compile()`), which would trace the "
                "wrapper's hooks: compile the units as `model.blocks[i] = torch.compile(block)` "
                "before wrapping")


@dataclass(frozen=True)
class StepReport:
    """What `FusedFSDP.step` found: the gradient norms before clipping (when asked for, or when
    clipping or skipping needed them), the non-finite count (when asked for), and whether the
    optimizer step was skipped (None where the device decided: `read_device_skips` counts
    those)."""

    grad_norm: float | None = None
    grad_max: float | None = None
    nonfinite: int | None = None
    skipped: bool | None = False


class FusedFSDP(_EngineCreation, _Hooks, _StateCopies, Releasing, torch.nn.Module):
    """Trains `module` through an fsdp-fusion engine; `units` are its FSDP units in forward order
    (e.g. the transformer blocks). Call it like the module, then `step()` after the backward
    passes of a step (several backward passes accumulate).

    Optimizer: AdamW (`optimizer="adamw"`, PyTorch's defaults, weight decay 0.01) or SGD
    (`optimizer="sgd"`, `lr` and `weight_decay`, by default 0, as `torch.optim.SGD` without
    momentum), over every trainable parameter, with fp32 master weights for bf16/f16 parameters.
    `double_buffer_limit` counts gathered parameter groups: the root's stay gathered throughout,
    so leave room for them plus the unit in use and the one prefetched (a lower limit still
    gathers the root's and the running unit's, into slots planned and made with the wrapper).

    A module on a GPU trains on the CUDA backend with NCCL (world size and rank from
    `torch.distributed` when it is initialized, else 1); forward and backward must run on the
    stream that was current when the wrapper was made, the engine's compute stream. A CPU module
    trains at world size 1, or as rank `rank` of `local_group` (ranks as threads, each made and
    driven on its own thread: making an engine compares the ranks' plans). A GPU module trains
    as rank `rank` of `local_group` when that is a `LoopbackGroup` (ranks as threads sharing one
    GPU, for tests), each rank on its own current stream.

    Every forward goes through the wrapper (`model(...)`, or the module itself): the root's
    hooks tell the engine where a pass begins. A `KeyboardInterrupt` (any `BaseException` that
    is no `Exception`, which torch's hooks do not see) inside a forward ends that forward as it
    leaves the wrapper's call; inside a direct call of the module, at the next call of the
    wrapper, `step` or copy of the state (a direct call of the module before those fails once,
    with `MisuseError`). The parameters' `.grad` belong to the wrapper:
    it clears them when wrapping, and takes each unit's when the unit's backward ends (autograd
    accumulates them first); the step holds the gradients, not `.grad`. At world size 1 with
    shard storage nothing moves or travels, and the wrapper takes the whole model's `.grad` in
    one call when the next forward or `step` begins instead: until then `.grad` holds them, as
    for a plain PyTorch optimizer, and the step briefly holds both those and its fp32 gradient
    shards. A change to `.grad` there reaches the engine, where above world size 1 `.grad` is
    empty by then, and with several backward passes a step `.grad` holds the last pass's only
    (the engine holds their sum): clip with `step(max_grad_norm=...)`, which does the same at
    every world size and over every pass.

    Which parameters train is fixed when wrapping (`requires_grad` then; `step` refuses, with
    nothing changed, while a parameter's `requires_grad` differs from that); a trainable parameter
    that gets no gradient in a step counts as a zero gradient, so AdamW's decay and moments
    still move it, where `torch.optim` skips a parameter whose `.grad` is None.

    Between its unit's hooks a parameter is a NaN placeholder of its shape (a use outside the
    unit shows), except at world size 1 with `param_storage="shard"`, where it stays a view of
    its shard, current after every step. `param_storage="master"` keeps a bf16/f16 trainable
    parameter only as its fp32 master, cast into a gather slot at every gather: the memory of
    one bf16 copy of the model less, for a cast per gather and moving views.

    The module's forward must not change its input in place, nor a unit its input (an in-place
    ReLU as its first layer, say) where its inputs pass through the hook that ends its backward
    (above world size 1, with `param_storage="master"` or `step_in_backward`): torch refuses it
    there, as it does under FSDP2, rather than compute wrong gradients for a use of the input
    after it.

    Weight decay applies to every trainable parameter, as `torch.optim.AdamW` given
    `module.parameters()` applies it, except those `no_weight_decay` names: a collection of
    names, or a function of the module that returns them. The LLM recipe's exemptions (parameters
    of fewer than two dimensions and embeddings' weights) are
    `no_weight_decay=default_no_weight_decay`. `lr_scales` maps parameter names to
    factors of the learning rate (default 1). `set_lr` changes the learning rate between steps
    (a schedule), `step(max_grad_norm=...)` clips the gradient's norm as
    `torch.nn.utils.clip_grad_norm_` does.

    `grad_reduction` combines the ranks' gradients: "mean" (the sum over the world size), "sum",
    or a number, the factor each rank's gradient is multiplied by before the sum (a loop that
    normalizes by its global token count). `reduce_dtype` is the dtype gradients travel in
    between ranks: torch.float32, or torch.bfloat16 (half the bytes; each rank's gradient and the
    ranks' sum rounded to bf16, accumulated in fp32). `accumulation` says how a step's several
    backward passes come together: "reduce" (every pass reduce-scatters), "no-sync" (the passes
    add into an unsharded fp32 gradient, reduced once by `step`) or "keep-gathered" (parameters
    stay gathered from their first use until `step`, so later passes gather nothing).

    On a GPU the engine's buffers come from PyTorch's caching allocator (on the compute stream),
    so `torch.cuda.memory_allocated` and its peak count them. `grad_shards="per-step"` (the
    default) makes each fp32 gradient shard when a step's backward first writes it and frees it
    when `step` ends, so the forward's activations use that memory; "persistent" keeps them for
    the engine's life.

    `moment_dtype=torch.bfloat16` stores AdamW's moments in bf16 (half their memory), each new
    moment computed in fp32 and rounded stochastically so that it stays unbiased; the update
    itself is the fp32 one.

    `step_in_backward=True` updates each parameter group inside the backward, as soon as its
    gradient is final, and (with per-step gradient shards) frees its fp32 gradient shard right
    after: the step then holds the gradient shards of the groups in flight only, not the
    model's, and the update runs while the backward does. It trains exactly as the ordinary
    step; what needs the whole gradient first is refused: one backward per step (no
    micro-batches), no `max_grad_norm`, `grad_norm`, `skip_nonfinite` or `count_nonfinite`, and
    `set_lr` / `set_weight_decay` only between steps.

    `process_groups` maps names to sizes of process groups other than the data-parallel world
    (mixture-of-experts parameters), and `param_groups` parameter names to one of them: the
    world's ranks split into groups of `size` consecutive ranks, each group holding its own copy
    of those parameters (the values its ranks' modules hold when wrapped), sharded over its
    ranks, their gradients summed over its ranks only ("mean" still divides by the world size).
    `full_state_dict` gives a rank its group's copy.

    `timeout` (seconds) bounds every wait of the engine, a collective whose peers never come
    included; `verify_collectives` compares the ranks' collectives every step (NCCL does not).
    `save_staging=True` makes the host memory `save(wait=False)` copies the state into
    (page-locked on a GPU, the size of the rank's state) with the wrapper, so that even the first
    asynchronous save returns after the copy alone.
    `library` is libfsdp_fusion.so's path (else found as `fsdp_fusion.library_candidates()` lists).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        units: list[torch.nn.Module],
        library: str | os.PathLike | None = None,
        *,
        optimizer: str = "adamw",
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float | None = None,
        double_buffer_limit: int = 4,
        max_reduces_in_flight: int = 2,
        overlap: bool = True,
        grad_reduction: str | float = "mean",
        reduce_dtype: torch.dtype = torch.float32,
        accumulation: str = "reduce",
        param_storage: str = "shard",
        grad_shards: str = "per-step",
        moment_dtype: torch.dtype = torch.float32,
        step_in_backward: bool = False,
        timeout: float = 600.0,
        verify_collectives: bool = False,
        save_staging: bool = False,
        no_weight_decay: Iterable[str] | Callable[[torch.nn.Module], Iterable[str]] | None = None,
        lr_scales: Mapping[str, float] | None = None,
        process_groups: Mapping[str, int] | None = None,
        param_groups: Mapping[str, str] | None = None,
        local_group: LocalGroup | LoopbackGroup | None = None,
        rank: int = 0,
    ):
        super().__init__()
        units = list(units)
        if _holds_placeholders(module):
            raise MisuseError("the module's parameters are placeholders of another FusedFSDP "
                              "(it wraps them, or was closed): wrap a fresh copy of the model")
        _refuse_compiled_in_place(module, units)
        self.module = module
        self._params = _owners(module, units)
        self._process_groups = dict(process_groups or {})
        self._param_groups = _param_groups(self._params, module, self._process_groups,
                                          param_groups)
        self._device = _check_placement(self._params)
        self._exempt = _exempt(self._params, module, no_weight_decay)
        self._lr_scales = _scales(self._params, module, lr_scales)
        self._lib = _capi.library(library)
        self._local_group = local_group
        if local_group is not None:
            if not isinstance(local_group, (LocalGroup, LoopbackGroup)):
                raise InvalidArgumentError(f"local_group {local_group!r} is not a LocalGroup or "
                                           "a LoopbackGroup")
            wants = "cpu" if isinstance(local_group, LocalGroup) else "cuda"
            if self._device.type != wants:
                raise InvalidArgumentError(f"a {type(local_group).__name__} runs {wants} ranks; "
                                           f"this module is on {self._device}")
            if not 0 <= rank < local_group.world_size:
                raise InvalidArgumentError(
                    f"rank {rank} is not in a local group of {local_group.world_size}")
            self._rank, self._world = rank, local_group.world_size
        else:
            self._rank, self._world = _membership(self._device)
        config = self._config(optimizer, lr, betas, eps, weight_decay, double_buffer_limit,
                              max_reduces_in_flight, overlap, grad_reduction, timeout,
                              verify_collectives)
        config.reduce_dtype = _choice("reduce_dtype", reduce_dtype,
                                      {torch.float32: DTYPE_CODES[torch.float32],
                                       torch.bfloat16: DTYPE_CODES[torch.bfloat16]})
        config.accumulation = _choice("accumulation", accumulation,
                                      {"reduce": 0, "no-sync": 1, "keep-gathered": 2})
        config.param_storage = _choice("param_storage", param_storage, {"shard": 0, "master": 1})
        config.grad_shard_memory = _choice("grad_shards", grad_shards,
                                           {"persistent": 0, "per-step": 1})
        config.moment_dtype = _choice("moment_dtype", moment_dtype,
                                      {torch.float32: DTYPE_CODES[torch.float32],
                                       torch.bfloat16: DTYPE_CODES[torch.bfloat16]})
        config.save_staging = int(bool(save_staging))
        config.step_in_backward = int(bool(step_in_backward))
        self._config_struct = config
        self._plan = self._make_plan()
        self._group = c_void_p()
        self._allocator = None
        if self._device.type == "cpu":
            self._stream = None
            self._engine = self._make_cpu_engine(config)
        else:
            # The engine's compute stream is the caller's: keep the object so the stream lives on.
            self._stream = torch.cuda.current_stream(self._device)
            self._allocator = TorchAllocator(device_index(self._device), self._stream)
            self._engine = self._make_cuda_engine(config)
        self._units = [_Unit(u, [p for p in self._params if p.unit == u])
                       for u in range(len(units))]
        self._root = _Unit(ROOT, [p for p in self._params if p.unit == ROOT])
        self._unit_of = {u.index: u for u in (*self._units, self._root)}
        # Every parameter, for the one hand-over of a pass where the views do not move.
        self._whole_model = _Unit(ROOT, self._params)
        self._load_and_release()
        # At world size 1 the views are the shards, which never move: autograd's saved views
        # stay right without the saved-tensor hooks below. Without shards (master storage) they
        # are gather slots, at every world size.
        self._views_move = self._world > 1 or param_storage == "master"
        # Inside `capture`, and the graph it captured last (the one step the engine keeps).
        self._capturing, self._captured = False, None
        # Each view's parameter and storage, for `close`.
        self._storages: list[tuple[str, torch.UntypedStorage]] = []
        # Whether each unit's gradients go to the engine when its backward ends, rather than the
        # whole model's when the next forward or the step begins.
        self._per_unit = self._views_move or step_in_backward
        self._step_in_backward = step_in_backward
        self._open_units: list[_Unit] = []
        # Whether a unit's backward began since the last forward of the whole module.
        self._backward_began = False
        # The module's own forwards under way, innermost last (a forward calling itself nests
        # them).
        self._root_forwards: list[_RootForward] = []
        # Whether the step so far had forward passes, and gradients: a step of forwards only
        # (an evaluation) is ended before a save or a load.
        self._forwards, self._gradients = False, False
        self._install_hooks(units)

    # -- engine calls ----------------------------------------------------------------------

    def _call(self, name: str, *args):
        self._check(getattr(self._lib, name)(*args), name)

    def _check(self, status: int, name: str):
        if status != 0:
            failure = self._allocator.take_failure() if self._allocator else None
            if failure is None:
                raise self._lib.error(name, status)
            if not isinstance(failure, Exception):
                raise failure  # KeyboardInterrupt in an allocation: not the engine's error
            raise self._lib.error(name, status) from failure

    # -- the step --------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        _refuse_compiling(torch.compiler.is_compiling())
        self._end_forwards_left_open()
        try:
            return self.module(*args, **kwargs)
        except BaseException as interrupted:
            # Torch's always-call hooks end a forward on an `Exception` only.
            if not isinstance(interrupted, Exception):
                self._end_interrupted_forward()
            raise

    def step(self, max_grad_norm: float | None = None, *, grad_norm: bool = False,
             skip_nonfinite: bool = False, count_nonfinite: bool = False,
             clip_on_device: bool = False) -> StepReport:
        """Ends the step: syncs the gradients of its backward passes, steps the optimizer on the
        shards and releases gathered parameters. `max_grad_norm` clips the whole gradient's
        2-norm to it inside the optimizer step, as `torch.nn.utils.clip_grad_norm_`;
        `skip_nonfinite` skips the optimizer step when the norm is not finite (AMP's
        `found_inf`); `grad_norm` only reports the norm. Each of these, and `count_nonfinite`
        (the infinite or NaN values in this rank's gradient shards), is a collective or a read
        that waits for the device; without them the step does not block the host on a GPU.
        `clip_on_device` clips and skips the same (from the same norm bit for bit; on a GPU
        the sum of squares, added as the device's threads finish, can differ in its last bits
        from one computation to the next), without that wait: the norm
        stays on the device, which clips by it and skips a step that is not finite, and is not
        reported (so `grad_norm` is refused with it, and the report's `skipped` is None: the
        step count leaves a skipped step out as the host's skip does, and `read_device_skips`
        counts such steps). Where the optimizer steps in the backward, each of them is refused
        (`MisuseError`) before anything changes: the updates ran before the whole gradient
        existed."""
        if clip_on_device and (grad_norm or (max_grad_norm is None and not skip_nonfinite)):
            raise MisuseError("clip_on_device keeps the norm on the device, which clips by "
                              "max_grad_norm and skips a step that is not finite "
                              "(skip_nonfinite): give one of them, and no grad_norm, which "
                              "needs the norm on the host")
        if self._step_in_backward and (max_grad_norm is not None or grad_norm or skip_nonfinite
                                       or count_nonfinite):
            raise MisuseError("step_in_backward updated each group as its gradient became "
                              "final: the gradient norm, clipping, skipping and the non-finite "
                              "count need the whole gradient first")
        changed = [p.name for p in self._params if p.tensor.requires_grad != p.trains]
        if changed:
            raise MisuseError(f"requires_grad of {', '.join(changed)} changed since wrapping, "
                              "which fixed the parameters that train: set it back (or wrap a "
                              "fresh copy of the model); the step is left to take")
        self._end_forwards_left_open()
        self._end_interrupted_recomputes()
        self._close_backwards()
        for u in self._unit_of.values():
            # Calls of a forward whose graph is still held with no backward run.
            u.calls_pending.clear()
            u.untracked_call = False
        self._call("fsdp_engine_finish_grad_sync", self._engine)
        norm = None
        if clip_on_device:
            if max_grad_norm is not None:
                self._call("fsdp_engine_clip_grad_norm_on_device", self._engine, max_grad_norm)
            if skip_nonfinite:
                self._call("fsdp_engine_skip_nonfinite_on_device", self._engine)
        elif max_grad_norm is not None:
            norm = GradNorm()
            self._call("fsdp_engine_clip_grad_norm", self._engine, max_grad_norm,
                           byref(norm))
        elif grad_norm or skip_nonfinite:
            norm = GradNorm()
            self._call("fsdp_engine_grad_norm", self._engine, byref(norm))
        nonfinite = None
        if count_nonfinite:
            found = c_uint64()
            self._call("fsdp_engine_nonfinite_grads", self._engine, byref(found))
            nonfinite = found.value
        skipped = (None if clip_on_device and skip_nonfinite else
                   skip_nonfinite and not (math.isfinite(norm.l2) and math.isfinite(norm.max)))
        if not skipped:
            self._call("fsdp_engine_optimizer_step", self._engine)
        self._call("fsdp_engine_end_step", self._engine)
        self._forwards, self._gradients = False, False
        return StepReport(norm.l2 if norm else None, norm.max if norm else None, nonfinite,
                          skipped)

    def read_device_skips(self) -> int:
        """The steps the device skipped (`step(skip_nonfinite=True, clip_on_device=True)`)
        since the last read, now counted by the engine: its optimizer steps less them, its
        counters' `skipped_steps` plus them (a save reads them first). Between steps, not during
        a capture; waits for the device where a decision was made since the last read."""
        found = c_uint64()
        self._call("fsdp_engine_read_device_skips", self._engine, byref(found))
        return found.value

    @contextlib.contextmanager
    def capture(self, graph: torch.cuda.CUDAGraph, pool=None):
        """Captures one training step into `graph` for `replay`: forward, backward and `step()`
        go inside, as `torch.cuda.graph(graph, pool, stream=<the engine's compute stream>,
        capture_error_mode="thread_local")` captures them, the engine's own streams and
        collectives joining the capture. Right after a training step (the warm-up: an
        evaluation step between them is none), on a wrapper made under a stream other than the
        default one (CUDA captures no work of the default stream), with `grad_shards="persistent"` (a step with per-step shards allocates
        them) and no `verify_collectives`. Inside, a host read is refused (`MisuseError`): clip
        with `step(max_grad_norm=m, clip_on_device=True)`. Replays read their inputs from the
        tensors the captured step read: copy each step's batch into them. An error inside gives
        the capture up: before the step's first work nothing changes; mid-step the engine is
        poisoned (its state is a step's that never ran)."""
        if self._stream is None or self._stream == torch.cuda.default_stream(self._device):
            raise MisuseError("capture needs the wrapper made under a CUDA stream other than "
                              "the default one (torch.cuda.stream(s)): the engine's compute "
                              "stream is that stream, and CUDA captures no default stream")
        self._call("fsdp_engine_join_capture", self._engine)
        self._capturing = True
        try:
            with torch.cuda.graph(graph, pool=pool, stream=self._stream,
                                  capture_error_mode="thread_local"):
                try:
                    yield
                    # Refused (mid-step: the step did not end inside) with the capture still
                    # under way: given up below, before the capture ends.
                    self._call("fsdp_engine_leave_capture", self._engine)
                    # The engine keeps this step now, whether or not the capture then ends.
                    self._captured = graph
                except BaseException:
                    # Inside the capture, so that the engine's streams join back before it ends.
                    # The step's own error is the one to see: a step given up mid-way poisons
                    # the engine (it never ran), one that never began changes nothing.
                    self._lib.fsdp_engine_abandon_capture(self._engine)
                    raise
        except BaseException:
            # The capture did not begin, or did not end: the engine gives it up too.
            self._lib.fsdp_engine_abandon_capture(self._engine)
            raise
        finally:
            self._capturing = False

    def replay(self, graph: torch.cuda.CUDAGraph):
        """Replays the step `capture` captured into `graph`: the learning rate set now and the
        next step count take effect, and the engine's step and counters move on as the captured
        step's did. No host wait. Only the graph of the last capture (the engine keeps its
        step alone): another is refused (`MisuseError`), with nothing changed."""
        if graph is not self._captured:
            raise MisuseError("replay of a graph other than the last capture's: the engine "
                              "keeps the last captured step only, whose counts and "
                              "collectives another graph's replay would not move")
        self._call("fsdp_engine_before_replay", self._engine)
        try:
            with torch.cuda.stream(self._stream):
                graph.replay()
        except BaseException:
            # Whether the replay's work was queued is not known: the engine cannot go on.
            self.abort()
            raise
        self._call("fsdp_engine_replayed", self._engine)

    def _end_forwards_left_open(self):
        """Ends the module's forwards that an interrupt left open inside a direct call of the
        module, which no hook sees: the wrapper's own call, `step` and the copies of the state
        never run inside a forward."""
        if self._root_forwards:
            self._end_interrupted_forward()

    def _end_evaluation(self):
        """Ends a step of forward passes only (an evaluation under `no_grad`), which would
        otherwise hold the engine inside a step; a step with gradients (handed over, or in a
        backward still open) is left to `step`."""
        self._end_forwards_left_open()
        backward = any(u.backward_open for u in self._unit_of.values())
        if self._forwards and not self._gradients and not backward:
            self._call("fsdp_engine_end_step", self._engine)
            self._forwards = False

    def set_lr(self, lr: float):
        """Sets the learning rate of the next steps (every rank the same); a parameter's is this
        times its `lr_scales` factor."""
        self._call("fsdp_engine_set_lr", self._engine, lr)

    def set_weight_decay(self, weight_decay: float):
        """Sets the weight decay of the next steps, for the parameters that take it."""
        self._call("fsdp_engine_set_weight_decay", self._engine, weight_decay)

    def counters(self) -> Counters:
        """What the engine did so far; never waits for a call in progress."""
        counters = Counters()
        self._call("fsdp_engine_counters", self._engine, byref(counters))
        return counters

    def memory(self) -> tuple[int, int]:
        """The engine's device (or host) bytes now and at their peak: between steps
        `planned_memory().between_steps`, at the peak `planned_memory().peak` (more only where a
        gather needed a slot beyond the planned ones: the root's and one unit's, where several
        units' forwards or backwards were open at once). Never waits for a call in progress."""
        current, peak = c_size_t(), c_size_t()
        self._call("fsdp_engine_memory", self._engine, byref(current), byref(peak))
        return current.value, peak.value

    def planned_memory(self) -> Memory:
        """The plan's bytes per rank under this engine's settings, buffer by buffer."""
        memory = Memory()
        self._lib.call("fsdp_plan_memory", self._plan, byref(self._config_struct), byref(memory))
        return memory

    def _apply(self, fn, recurse=True):
        """A move or cast of the wrapper (`to`, `cuda`, `half`, ...) that would change a
        parameter is refused (`MisuseError`): the engine holds the parameters' memory on its
        device in their dtypes, and a copy would train nothing. One that changes no parameter
        (to the device and dtypes they have) applies to the buffers alone, as in PyTorch."""
        for p in getattr(self, "_params", ()):
            if fn(p.tensor) is not p.tensor:
                raise MisuseError(f"moving or casting {p.name} would leave the engine's memory "
                                  f"({p.tensor.dtype} on {p.tensor.device}): the wrapper's "
                                  "parameters stay where the engine holds them")
        return super()._apply(fn, recurse)

    def share_memory(self):
        """Refused (`MisuseError`): it would copy the parameters into shared memory in place,
        away from the engine's, which `_apply`'s check cannot see without doing it."""
        raise MisuseError("share_memory would move the wrapper's parameters out of the engine's "
                          "memory: the engine holds them")

    def abort(self):
        """Makes every wait of the engine under way end with `AbortedError` (from any thread),
        and every later call raise `PoisonedError`: a rank that must give up without hanging
        its peers' collectives."""
        self._call("fsdp_engine_abort", self._engine)

    def close(self):
        """Releases the engine, its group and the plan; the module's parameters become
        placeholders (they never point at released memory), the wrapper's hooks go, and a
        forward of the module is then refused (`MisuseError`), as is wrapping it again: wrap a
        fresh copy of the model (`full_state_dict()` gives its values). Also after a
        construction that failed part way (each handle made is released). Refused
        (`MisuseError`, nothing released or changed) while a tensor outside the wrapper still
        holds the engine's memory: a
        `state_dict()`'s tensor at world size 1, a detached parameter, an autograd graph not
        run backward (copies, such as `full_state_dict()`'s, are the caller's); drop them and
        close again. Garbage-collected with such a tensor alive, the wrapper keeps its engine."""
        # The views are let go first, so that only tensors outside hold their memory; a refusal
        # points the units that had views at their addresses again (only numbers are kept
        # meanwhile: a tensor kept would count as one outside).
        mapped = [(u, u.views.addresses) for u in getattr(self, "_unit_of", {}).values()
                  if u.views is not None]
        try:
            for u in getattr(self, "_unit_of", {}).values():
                self._unmap_views(u)
                u.cache.clear()
        finally:
            held = self._views_held_elsewhere()
            if held:
                for u, addresses in mapped:
                    self._point_at(u, addresses)
                raise MisuseError(f"close while tensors outside the wrapper hold the engine's "
                                  f"memory of {', '.join(held)} (a state_dict(), a detached "
                                  "parameter, a graph not run backward): drop them first, or "
                                  "copy with full_state_dict()")
            self._storages, self._captured = [], None
            self._close_hooks()
            for name, attr in (("fsdp_engine_destroy", "_engine"),
                               ("fsdp_local_group_destroy", "_group"),
                               ("fsdp_plan_destroy", "_plan")):
                handle = getattr(self, attr, None)
                if handle is not None and handle.value:
                    self._lib.call(name, handle)
                setattr(self, attr, None)
