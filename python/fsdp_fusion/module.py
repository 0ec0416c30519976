"""`FusedFSDP`: a torch module trained through an fsdp-fusion engine.

The wrapper declares every parameter of the module to the engine (its unit is the index of the
unit module holding it, or the root; a parameter held by several modules is tied), loads the
initial values and drops the module's own parameter storage. Hooks then point each parameter's
`.data` at its gathered view while one of its unit's hooks is open, forward and backward (at
world size 1 the views are the shards themselves, which never move: parameters stay views
between hooks), and hand the unit's gradients to the engine once its backward is done. Each unit costs one C call for
its views and one for its gradients per hook, whatever its number of parameters.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from ctypes import byref, c_size_t, c_uint8, c_uint64, c_void_p
from dataclasses import dataclass

import torch

from . import _capi
from ._capi import (
    ROOT,
    UNIQUE_ID_BYTES,
    Config,
    Counters,
    Memory,
    Grad,
    GradNorm,
    ParamSpec,
    Releasing,
)
from ._allocator import TorchAllocator
from ._dlpack import tensor_at
from .errors import InvalidArgumentError, MisuseError
from ._params import (
    DTYPE_CODES,
    DTYPE_NAMES,
    _check_placement,
    _exempt,
    _owners,
    _Param,
    _param_groups,
    _scales,
)
from ._state import _StateCopies
from .group import LocalGroup, LoopbackGroup

class _Views:
    """A unit's gathered views at one set of addresses: the tensors, and the position of the
    parameter whose memory starts at an address."""

    def __init__(self, tensors: list[torch.Tensor], addresses: tuple):
        self.tensors = tensors
        self.position = {address: i for i, address in enumerate(addresses) if address}


class _Unit:
    """One unit's parameters as the hooks handle them."""

    def __init__(self, index: int, params: list[_Param]):
        self.index = index
        self.params = params
        count = len(params)
        self.ids = (c_size_t * count)(*[p.id for p in params])
        self.addresses = (c_void_p * count)()
        self.cache: dict[tuple, _Views] = {}
        # Hooks of the unit open now (a recomputing forward may open it inside its backward).
        self.opens = 0
        self.views: _Views | None = None
        self.backward_open = False
        # Gradients arrived in the open backward: kept alive until handed over in one batch.
        self.pending: list[tuple[_Param, torch.Tensor]] = []
        self.batch = (Grad * count)()


@dataclass(frozen=True)
class _Saved:
    """A tensor autograd saved that lies in a parameter's gathered memory: which parameter of
    which unit, and where in it, so that backward reads the parameter's memory of that time."""

    unit: _Unit
    position: int
    dtype: torch.dtype
    size: torch.Size
    stride: tuple
    byte_offset: int


@dataclass(frozen=True)
class StepReport:
    """What `FusedFSDP.step` found: the gradient norms before clipping (when asked for, or when
    clipping or skipping needed them), the non-finite count (when asked for), and whether the
    optimizer step was skipped."""

    grad_norm: float | None = None
    grad_max: float | None = None
    nonfinite: int | None = None
    skipped: bool = False


def _tensors(obj):
    """The tensors in an output: a tensor, or tuples, lists and dicts of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, wrapper, unit, *inputs):
        ctx.wrapper, ctx.unit = wrapper, unit
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.wrapper._post_backward(ctx.unit)
        return (None, None, *grads)


def _choice(what: str, value, codes: dict) -> int:
    if value not in codes:
        raise InvalidArgumentError(f"{what} {value!r} is not one of {sorted(map(str, codes))}")
    return codes[value]


def _membership(device: torch.device) -> tuple[int, int]:
    """This process's rank and the world size: torch.distributed's when initialized."""
    dist = torch.distributed
    if device.type == "cuda" and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class FusedFSDP(_StateCopies, Releasing, torch.nn.Module):
    """Trains `module` through an fsdp-fusion engine; `units` are its FSDP units in forward order
    (e.g. the transformer blocks). Call it like the module, then `step()` after the backward
    passes of a step (several backward passes accumulate).

    Optimizer: AdamW (`optimizer="adamw"`, PyTorch's defaults, weight decay 0.01) or SGD
    (`optimizer="sgd"`, `lr` and `weight_decay`, by default 0, as `torch.optim.SGD` without
    momentum), over every trainable parameter, with fp32 master weights for bf16/f16 parameters.
    `double_buffer_limit` counts gathered parameter groups: the root's stay gathered throughout,
    so leave room for them plus the unit in use and the one prefetched.

    A module on a GPU trains on the CUDA backend with NCCL (world size and rank from
    `torch.distributed` when it is initialized, else 1); forward and backward must run on the
    stream that was current when the wrapper was made, the engine's compute stream. A CPU module
    trains at world size 1, or as rank `rank` of `local_group` (ranks as threads, each made and
    driven on its own thread: making an engine compares the ranks' plans). A GPU module trains
    as rank `rank` of `local_group` when that is a `LoopbackGroup` (ranks as threads sharing one
    GPU, for tests), each rank on its own current stream.

    Between its unit's hooks a parameter is a NaN placeholder of its shape (a use outside the
    unit shows), except at world size 1 with `param_storage="shard"`, where it stays a view of
    its shard, current after every step. `param_storage="master"` keeps a bf16/f16 trainable
    parameter only as its fp32 master, cast into a gather slot at every gather: the memory of
    one bf16 copy of the model less, for a cast per gather and moving views.

    Weight decay skips the parameters `no_weight_decay` names (a collection of names, or a
    function of the name and the parameter); by default `default_no_weight_decay(module)`: those
    with fewer than two dimensions and embeddings' weights. `lr_scales` maps parameter names to
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
        timeout: float = 600.0,
        verify_collectives: bool = False,
        save_staging: bool = False,
        no_weight_decay: Iterable[str] | Callable[[str, torch.nn.Parameter], bool] | None = None,
        lr_scales: Mapping[str, float] | None = None,
        process_groups: Mapping[str, int] | None = None,
        param_groups: Mapping[str, str] | None = None,
        local_group: LocalGroup | LoopbackGroup | None = None,
        rank: int = 0,
    ):
        super().__init__()
        self.module = module
        self._params = _owners(module, list(units))
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
            self._allocator = TorchAllocator(self._device.index or 0, self._stream)
            self._engine = self._make_cuda_engine(config)
        self._units = [_Unit(u, [p for p in self._params if p.unit == u])
                       for u in range(len(units))]
        self._root = _Unit(ROOT, [p for p in self._params if p.unit == ROOT])
        self._unit_of = {u.index: u for u in (*self._units, self._root)}
        self._load_and_release()
        # At world size 1 the views are the shards, which never move: autograd's saved views
        # stay right without the saved-tensor hooks below. Without shards (master storage) they
        # are gather slots, at every world size.
        self._views_move = self._world > 1 or param_storage == "master"
        self._open_units: list[_Unit] = []
        self._saved_hooks = None
        # Whether the step so far had forward passes, and gradients: a step of forwards only
        # (an evaluation) is ended before a save or a load.
        self._forwards, self._gradients = False, False
        self._install_hooks(units)

    # -- construction ----------------------------------------------------------------------

    def _make_plan(self) -> c_void_p:
        if self._process_groups:
            return self._plan_from_json()
        # ctypes keeps the names and shapes assigned to `specs` alive as long as `specs`.
        specs = (ParamSpec * len(self._params))()
        for spec, p, exempt, scale in zip(specs, self._params, self._exempt, self._lr_scales):
            shape = (c_uint64 * max(p.tensor.dim(), 1))(*p.tensor.shape)
            spec.name, spec.shape, spec.ndim = p.name.encode(), shape, p.tensor.dim()
            spec.dtype, spec.unit = DTYPE_CODES[p.tensor.dtype], p.unit
            spec.trainable, spec.tied = int(p.tensor.requires_grad), int(p.tied)
            spec.no_weight_decay, spec.lr_scale = int(exempt), scale
        plan = c_void_p()
        self._lib.call("fsdp_plan_from_specs", specs, len(specs), self._world, byref(plan))
        return plan

    def _plan_from_json(self) -> c_void_p:
        """The plan of a model file, which declares process groups as the specs cannot."""
        params = []
        for p, exempt, scale, group in zip(self._params, self._exempt, self._lr_scales,
                                           self._param_groups):
            entry = {"name": p.name, "shape": list(p.tensor.shape),
                     "dtype": DTYPE_NAMES[p.tensor.dtype],
                     "unit": None if p.unit == ROOT else p.unit,
                     "trainable": p.tensor.requires_grad, "tied": p.tied,
                     "weight_decay": not exempt, "lr_scale": scale}
            if group is not None:
                entry["group"] = group
            params.append(entry)
        model = {"params": params, "process_groups": [
            {"name": name, "size": size} for name, size in self._process_groups.items()]}
        plan = c_void_p()
        self._lib.call("fsdp_plan_from_json", json.dumps(model).encode(), self._world,
                       byref(plan))
        return plan

    def _config(self, optimizer, lr, betas, eps, weight_decay, double_buffer_limit,
                max_reduces_in_flight, overlap, grad_reduction, timeout,
                verify_collectives) -> Config:
        config = Config()
        self._lib.call("fsdp_config_default", byref(config))
        config.optimizer = _choice("optimizer", optimizer, {"adamw": 0, "sgd": 1})
        if isinstance(grad_reduction, str):
            config.grad_reduction = _choice("grad_reduction", grad_reduction,
                                            {"mean": 0, "sum": 1})
        else:
            config.grad_reduction, config.grad_scale = 2, grad_reduction
        config.lr, (config.beta1, config.beta2) = lr, betas
        if weight_decay is None:
            weight_decay = 0.01 if optimizer == "adamw" else 0.0
        config.eps, config.weight_decay = eps, weight_decay
        config.double_buffer_limit = double_buffer_limit
        config.max_reduces_in_flight = max_reduces_in_flight
        config.overlap = int(bool(overlap))
        config.timeout_seconds = timeout
        config.verify_collectives = int(bool(verify_collectives))
        return config

    def _make_cpu_engine(self, config: Config) -> c_void_p:
        """This rank on the CPU backend: of the caller's local group, else of a group of one."""
        if self._local_group is not None:
            group = self._local_group.handle
        elif self._world != 1:
            raise InvalidArgumentError("CPU ranks of several processes do not exist: pass a "
                                       "local group")
        else:
            self._lib.call("fsdp_local_group_create", 1, byref(self._group))
            group = self._group
        engine = c_void_p()
        self._call("fsdp_engine_create_cpu", self._plan, byref(config), group, self._rank,
                       byref(engine))
        return engine

    def _make_cuda_engine(self, config: Config) -> c_void_p:
        """This process's rank on its GPU with NCCL, or the rank of the caller's loopback
        group; blocks until every rank joined."""
        engine = c_void_p()
        if self._local_group is not None:
            self._call("fsdp_engine_create_cuda_loopback", self._plan, byref(config),
                       self._device.index or 0, self._local_group.handle, self._rank,
                       self._stream.cuda_stream, byref(self._allocator.struct), byref(engine))
            return engine
        uid = self._unique_id()
        self._call("fsdp_engine_create_cuda_nccl", self._plan, byref(config),
                       self._device.index or 0, uid, len(uid), self._rank, self._world,
                       self._stream.cuda_stream, byref(self._allocator.struct), byref(engine))
        return engine

    def _unique_id(self):
        """Rank 0's fresh NCCL id, sent to the others through torch.distributed (whose current
        device each rank has set)."""
        uid = (c_uint8 * UNIQUE_ID_BYTES)()
        if self._rank == 0:
            self._lib.call("fsdp_nccl_unique_id", uid, len(uid))
        if self._world > 1:
            shared = [bytes(uid)]
            torch.distributed.broadcast_object_list(shared, src=0)
            uid = (c_uint8 * UNIQUE_ID_BYTES).from_buffer_copy(shared[0])
        return uid

    def _load_and_release(self):
        """Loads each parameter's value (a host copy) and replaces its storage by a placeholder
        until the parameter is gathered."""
        for p in self._params:
            host = p.tensor.detach().to("cpu").contiguous()
            self._call("fsdp_engine_load_param", self._engine, p.id, host.data_ptr(),
                           host.numel(), DTYPE_CODES[host.dtype])
        for p in self._params:
            t = p.tensor
            p.placeholder = torch.full((), math.nan, dtype=t.dtype, device=t.device).expand(t.shape)
            t.data = p.placeholder

    def _install_hooks(self, units):
        for index, unit in enumerate(units):
            unit.register_forward_pre_hook(self._pre_forward_hook(index), with_kwargs=True)
            unit.register_forward_hook(self._post_forward_hook(index), always_call=True)
        self.module.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True)
        self.module.register_forward_hook(self._root_post_forward, always_call=True)
        for u in self._unit_of.values():
            for p in u.params:
                if p.tensor.requires_grad:
                    p.tensor.register_post_accumulate_grad_hook(self._grad_hook(p, u))

    # -- hooks -----------------------------------------------------------------------------

    def _pre_forward_hook(self, unit: int):
        def hook(_module, args, kwargs):
            self._open(self._units[unit], self._lib.fsdp_engine_pre_forward)
            return self._wrap_inputs(unit, args, kwargs)

        return hook

    def _post_forward_hook(self, unit: int):
        def hook(_module, _args, output):
            self._close(self._units[unit], self._lib.fsdp_engine_post_forward)
            self._hook_outputs(unit, output)

        return hook

    def _root_pre_forward(self, _module, args, kwargs):
        if self._stream is not None and torch.cuda.current_stream(self._device) != self._stream:
            raise MisuseError("run forward and backward on the stream current when the wrapper "
                              "was made: the engine's compute stream")
        # A backward left open (the root's, or a unit's whose inputs needed no gradient) ends
        # when the next forward starts: every gradient of that pass has arrived by then.
        self._close_backwards()
        if self._views_move:
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_hooks.__enter__()
        self._forwards = True
        self._open(self._root, self._lib.fsdp_engine_pre_forward)
        return self._wrap_inputs(ROOT, args, kwargs)

    def _root_post_forward(self, _module, _args, output):
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        self._close(self._root, self._lib.fsdp_engine_post_forward)
        self._hook_outputs(ROOT, output)

    def _wrap_inputs(self, unit, args, kwargs):
        """Passes the unit's tensor inputs (top-level args and kwargs) through `_PostBackward`."""
        if not torch.is_grad_enabled():
            return args, kwargs
        keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not keys and not slots:
            return args, kwargs
        outs = _PostBackward.apply(self, unit, *[args[i] for i in slots],
                                   *[kwargs[k] for k in keys])
        args = list(args)
        for i, out in zip(slots, outs):
            args[i] = out
        kwargs = dict(kwargs, **dict(zip(keys, outs[len(slots):])))
        return tuple(args), kwargs

    def _hook_outputs(self, unit, output):
        if not torch.is_grad_enabled():
            return

        def on_grad(_grad):
            self._pre_backward(unit)

        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(on_grad)

    def _pre_backward(self, unit: int):
        u = self._unit_of[unit]
        if not u.backward_open:
            self._open(u, self._lib.fsdp_engine_pre_backward)
            u.backward_open = True

    def _post_backward(self, unit: int):
        u = self._unit_of[unit]
        if u.backward_open:
            u.backward_open = False
            self._hand_over(u)
            self._close(u, self._lib.fsdp_engine_post_backward)

    def _close_backwards(self):
        for u in self._unit_of.values():
            if u.backward_open:
                self._post_backward(u.index)

    def _grad_hook(self, p: _Param, u: _Unit):
        def hook(param):
            grad = param.grad.detach()
            param.grad = None
            if not grad.is_contiguous():
                grad = grad.contiguous()
            u.pending.append((p, grad))
            if not u.backward_open:
                # A gradient outside its unit's backward (the unit's outputs needed none).
                self._hand_over(u)

        return hook

    def _hand_over(self, u: _Unit):
        """Hands the unit's pending gradients to the engine in one call. On the CPU the engine
        reads them before returning; on a GPU it reads them on the compute stream, where the
        caching allocator reuses their memory only afterwards."""
        if not u.pending:
            return
        self._gradients = True
        batch = u.batch
        for k, (p, grad) in enumerate(u.pending):
            entry = batch[k]
            entry.param, entry.data, entry.numel = p.id, grad.data_ptr(), grad.numel()
            entry.dtype = DTYPE_CODES.get(grad.dtype, 99)
        # The tensors live until the call returned: clear only after it.
        status = self._lib.fsdp_engine_grads(self._engine, batch, len(u.pending))
        u.pending.clear()
        self._check(status, "fsdp_engine_grads")

    # -- gathered views --------------------------------------------------------------------

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

    def _open(self, u: _Unit, hook):
        """Runs the engine's pre hook for the unit and points its parameters at their views."""
        if not u.params:
            return
        self._check(hook(self._engine, u.index), hook.__name__)
        u.opens += 1
        if u.views is None:
            self._map_views(u)

    def _map_views(self, u: _Unit):
        """Points the unit's parameters at their gathered views (made once per slot)."""
        self._check(self._lib.fsdp_engine_params(self._engine, u.ids, len(u.params), u.addresses),
                    "fsdp_engine_params")
        key = tuple(u.addresses)
        views = u.cache.get(key)
        if views is None:
            views = _Views([self._view(p, address) for p, address in zip(u.params, key)], key)
            u.cache[key] = views
        u.views = views
        for p, view in zip(u.params, views.tensors):
            p.tensor.data = view
        if self._views_move:
            self._open_units.append(u)

    def _close(self, u: _Unit, hook):
        """Runs the engine's post hook for the unit; its parameters go back to placeholders once
        none of its hooks is open. At world size 1 they stay views: the views are the shards,
        which never move, so they always hold the current values."""
        if not u.params or u.opens == 0:
            # Nothing to close: the pre hook failed (torch runs post hooks all the same).
            return
        u.opens -= 1
        if u.opens == 0 and self._views_move:
            self._unmap_views(u)
        self._check(hook(self._engine, u.index), hook.__name__)

    def _unmap_views(self, u: _Unit):
        for p in u.params:
            p.tensor.data = p.placeholder
        u.views = None
        if u in self._open_units:
            self._open_units.remove(u)

    def _view(self, p: _Param, address: int | None) -> torch.Tensor:
        numel = p.tensor.numel()
        return tensor_at(address or 0, numel, p.tensor.dtype, self._device).view(p.tensor.shape)

    # -- saved tensors ---------------------------------------------------------------------
    # Autograd keeps tensors of the forward for backward, among them parameters and views of
    # them (a weight's transpose): memory of the slot the unit was gathered into then. By the
    # backward the engine may have gathered the unit into another slot, and given the old one
    # to another group. So a saved tensor in a parameter's gathered memory is saved as where it
    # lies in that parameter, and read back from the parameter's memory at backward time (its
    # unit's pre_backward ran before any node of the unit executes).

    def _pack(self, t: torch.Tensor):
        if t.layout != torch.strided:
            return t
        address = t.untyped_storage().data_ptr()
        for u in self._open_units:
            position = u.views.position.get(address)
            if position is not None:
                return _Saved(u, position, t.dtype, t.size(), t.stride(),
                              t.storage_offset() * t.element_size())
        return t

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        u = saved.unit
        if u.views is None:
            name = u.params[saved.position].name
            raise MisuseError(f"backward needs {name}, whose unit's backward is not open")
        flat = u.views.tensors[saved.position].reshape(-1)
        if flat.dtype != saved.dtype:
            flat = flat.view(saved.dtype)
        offset = saved.byte_offset // flat.element_size()
        return flat.as_strided(saved.size, saved.stride, offset)

    # -- the step --------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def step(self, max_grad_norm: float | None = None, *, grad_norm: bool = False,
             skip_nonfinite: bool = False, count_nonfinite: bool = False) -> StepReport:
        """Ends the step: syncs the gradients of its backward passes, steps the optimizer on the
        shards and releases gathered parameters. `max_grad_norm` clips the whole gradient's
        2-norm to it inside the optimizer step, as `torch.nn.utils.clip_grad_norm_`;
        `skip_nonfinite` skips the optimizer step when the norm is not finite (AMP's
        `found_inf`); `grad_norm` only reports the norm. Each of these, and `count_nonfinite`
        (the infinite or NaN values in this rank's gradient shards), is a collective or a read
        that waits for the device; without them the step does not block the host on a GPU."""
        self._close_backwards()
        self._call("fsdp_engine_finish_grad_sync", self._engine)
        norm = None
        if max_grad_norm is not None:
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
        skipped = skip_nonfinite and not (math.isfinite(norm.l2) and math.isfinite(norm.max))
        if not skipped:
            self._call("fsdp_engine_optimizer_step", self._engine)
        self._call("fsdp_engine_end_step", self._engine)
        self._forwards, self._gradients = False, False
        return StepReport(norm.l2 if norm else None, norm.max if norm else None, nonfinite,
                          skipped)

    def _end_evaluation(self):
        """Ends a step of forward passes only (an evaluation under `no_grad`), which would
        otherwise hold the engine inside a step; a step with gradients is left to `step`."""
        if self._forwards and not self._gradients:
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
        gather needed a slot beyond the limit). Never waits for a call in progress."""
        current, peak = c_size_t(), c_size_t()
        self._call("fsdp_engine_memory", self._engine, byref(current), byref(peak))
        return current.value, peak.value

    def planned_memory(self) -> Memory:
        """The plan's bytes per rank under this engine's settings, buffer by buffer."""
        memory = Memory()
        self._lib.call("fsdp_plan_memory", self._plan, byref(self._config_struct), byref(memory))
        return memory

    def abort(self):
        """Makes every wait of the engine end with `AbortedError`, now and later (from any
        thread): a rank that must give up without hanging its peers' collectives."""
        self._call("fsdp_engine_abort", self._engine)

    def close(self):
        """Releases the engine, its group and the plan; the module's parameters become
        placeholders (they never point at released memory)."""
        for u in getattr(self, "_unit_of", {}).values():
            self._unmap_views(u)
        for name, attr in (("fsdp_engine_destroy", "_engine"),
                           ("fsdp_local_group_destroy", "_group"),
                           ("fsdp_plan_destroy", "_plan")):
            handle = getattr(self, attr, None)
            if handle is not None and handle.value:
                self._lib.call(name, handle)
                setattr(self, attr, None)

