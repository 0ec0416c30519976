"""PyTorch training through fsdp-fusion's C API: ctypes over libfsdp_fusion.so, no build step.

    from fsdp_fusion_torch import FusedFSDP

    model = FusedFSDP(gpt, units=list(gpt.blocks), library="target/release/libfsdp_fusion.so",
                      lr=3e-4, weight_decay=0.1)
    for tokens, targets in batches:
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())
        loss.backward()
        model.step()  # finish_grad_sync, optimizer_step, end_step

`FusedFSDP` declares every parameter of the module to the engine (its unit is the index of the
unit module holding it, or the root; a parameter held by several modules is tied), loads the
initial values and drops the module's own parameter storage. Hooks then point each parameter's
`.data` at its gathered view while its unit runs, forward and backward, and hand every gradient to
the engine as soon as autograd accumulated it. A module on a GPU trains on the CUDA backend with
NCCL (world size and rank from `torch.distributed` when it is initialized, else 1), a module on
the CPU on the CPU backend (world size 1, or ranks as threads of a `LocalGroup`), where the same
hooks can be tested without a GPU.

Forward and backward must run on the stream that was current when the wrapper was made: the engine
makes it wait for gathers and reads gradients on it.
"""

from __future__ import annotations

import ctypes
import math
import os
from ctypes import POINTER, byref, c_bool, c_char_p, c_int, c_int32, c_int64, c_size_t
from ctypes import c_uint8, c_uint16, c_uint32, c_uint64, c_void_p
from dataclasses import dataclass

import torch

LIBRARY_ENV = "FSDP_FUSION_LIBRARY"
"""The variable naming libfsdp_fusion.so when no path is passed."""

ROOT = -1
"""The unit index of parameters outside every unit (`FSDP_ROOT`)."""

_STATUS = [
    "FSDP_OK",
    "FSDP_NULL_POINTER",
    "FSDP_INVALID_HANDLE",
    "FSDP_INVALID_ARGUMENT",
    "FSDP_MISUSE",
    "FSDP_UNAVAILABLE",
    "FSDP_DEVICE_ERROR",
    "FSDP_COMM_ERROR",
    "FSDP_IO_ERROR",
    "FSDP_PANIC",
    "FSDP_OUT_OF_MEMORY",
    "FSDP_TIMEOUT",
    "FSDP_ABORTED",
    "FSDP_POISONED",
]
_DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_UNIQUE_ID_BYTES = 128


class FsdpError(RuntimeError):
    """A failed call into the library: its status name and message."""


class _ParamSpec(ctypes.Structure):
    _fields_ = [
        ("name", c_char_p),
        ("shape", POINTER(c_uint64)),
        ("ndim", c_size_t),
        ("dtype", c_uint32),
        ("unit", c_int64),
        ("trainable", c_uint8),
        ("tied", c_uint8),
    ]


class _Config(ctypes.Structure):
    _fields_ = [
        ("double_buffer_limit", c_size_t),
        ("max_reduces_in_flight", c_size_t),
        ("overlap", c_uint8),
        ("grad_reduction", c_uint32),
        ("optimizer", c_uint32),
        ("lr", ctypes.c_float),
        ("beta1", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("timeout_seconds", ctypes.c_double),
        ("verify_collectives", c_uint8),
    ]


class _ParamInfo(ctypes.Structure):
    _fields_ = [
        ("numel", c_size_t),
        ("dtype", c_uint32),
        ("unit", c_int64),
        ("trainable", c_bool),
        ("group", c_size_t),
        ("offset", c_size_t),
        ("padded_numel", c_size_t),
    ]


class Counters(ctypes.Structure):
    """What the engine did so far (`fsdp_counters`)."""

    _fields_ = [
        (name, c_uint64)
        for name in (
            "all_gathers",
            "prefetches",
            "reuses",
            "evictions",
            "reduce_scatters",
            "extra_slots",
            "host_waits",
            "steps",
        )
    ]


_HANDLE = c_void_p
_OUT = POINTER(c_void_p)
_SIGNATURES = {
    "fsdp_last_error": ([], c_char_p),
    "fsdp_config_default": ([POINTER(_Config)], c_int),
    "fsdp_plan_from_specs": ([POINTER(_ParamSpec), c_size_t, c_size_t, _OUT], c_int),
    "fsdp_plan_destroy": ([_HANDLE], c_int),
    "fsdp_plan_param_info": ([_HANDLE, c_size_t, POINTER(_ParamInfo)], c_int),
    "fsdp_local_group_create": ([c_size_t, _OUT], c_int),
    "fsdp_local_group_destroy": ([_HANDLE], c_int),
    "fsdp_engine_create_cpu": ([_HANDLE, POINTER(_Config), _HANDLE, c_size_t, _OUT], c_int),
    "fsdp_nccl_unique_id": ([POINTER(c_uint8), c_size_t], c_int),
    "fsdp_engine_create_cuda_nccl": (
        [_HANDLE, POINTER(_Config), c_int, POINTER(c_uint8), c_size_t, c_size_t, c_size_t,
         c_uint64, _OUT],
        c_int,
    ),
    "fsdp_engine_destroy": ([_HANDLE], c_int),
    "fsdp_engine_pre_forward": ([_HANDLE, c_int64], c_int),
    "fsdp_engine_post_forward": ([_HANDLE, c_int64], c_int),
    "fsdp_engine_pre_backward": ([_HANDLE, c_int64], c_int),
    "fsdp_engine_post_backward": ([_HANDLE, c_int64], c_int),
    "fsdp_engine_load_param": ([_HANDLE, c_size_t, c_void_p, c_size_t, c_uint32], c_int),
    "fsdp_engine_param": (
        [_HANDLE, c_size_t, POINTER(c_void_p), POINTER(c_size_t), POINTER(c_uint32)],
        c_int,
    ),
    "fsdp_engine_grad": ([_HANDLE, c_size_t, c_void_p, c_size_t, c_uint32], c_int),
    "fsdp_engine_finish_grad_sync": ([_HANDLE], c_int),
    "fsdp_engine_optimizer_step": ([_HANDLE], c_int),
    "fsdp_engine_end_step": ([_HANDLE], c_int),
    "fsdp_engine_counters": ([_HANDLE, POINTER(Counters)], c_int),
    "fsdp_engine_nonfinite_grads": ([_HANDLE, POINTER(c_uint64)], c_int),
    "fsdp_engine_abort": ([_HANDLE], c_int),
    "fsdp_engine_param_shard": (
        [_HANDLE, c_size_t, c_void_p, c_size_t, POINTER(c_size_t)],
        c_int,
    ),
}


class Library:
    """libfsdp_fusion.so with typed functions; `call` raises `FsdpError` on a failed status."""

    def __init__(self, path: str | os.PathLike | None = None):
        path = path or os.environ.get(LIBRARY_ENV)
        if not path:
            raise FsdpError(f"no library: pass the path of libfsdp_fusion.so or set {LIBRARY_ENV}")
        self._lib = ctypes.CDLL(os.fspath(path))
        for name, (args, result) in _SIGNATURES.items():
            function = getattr(self._lib, name)
            function.argtypes, function.restype = args, result

    def call(self, name: str, *args) -> None:
        status = getattr(self._lib, name)(*args)
        if status != 0:
            message = self._lib.fsdp_last_error().decode("utf-8", "replace")
            code = _STATUS[status] if 0 <= status < len(_STATUS) else str(status)
            raise FsdpError(f"{name}: {code}: {message}")


@dataclass(frozen=True)
class _Saved:
    """A tensor autograd saved that lies in a managed parameter's gathered memory: which
    parameter, and where in it, so that backward reads the parameter's memory of that time."""

    param: int
    dtype: torch.dtype
    size: torch.Size
    stride: tuple
    byte_offset: int


@dataclass
class _Param:
    id: int
    name: str
    tensor: torch.nn.Parameter
    unit: int
    tied: bool
    # What `.data` holds while the parameter is not gathered: one NaN broadcast to its shape, so
    # that the shape stays right and a use outside its unit shows.
    placeholder: torch.Tensor | None = None


def _owners(module: torch.nn.Module, units: list[torch.nn.Module]):
    """Every parameter of `module` once, in model order, with its unit and whether it is tied."""
    unit_of_module = {}
    for index, unit in enumerate(units):
        for sub in unit.modules():
            if unit_of_module.setdefault(id(sub), index) != index:
                raise FsdpError(f"units {unit_of_module[id(sub)]} and {index} share a module")
    found = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, p in sub.named_parameters(prefix, recurse=False, remove_duplicate=False):
            first = found.setdefault(id(p), [name, p, set(), 0])
            first[2].add(unit_of_module.get(id(sub), ROOT))
            first[3] += 1
    params = []
    for index, (name, p, owner_units, slots) in enumerate(found.values()):
        # A parameter that several units (or a unit and the root) use stays gathered with the
        # root, which is open for the whole forward and backward.
        unit = owner_units.pop() if len(owner_units) == 1 else ROOT
        params.append(_Param(index, name, p, unit, slots > 1))
    return params


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


# Gathered memory becomes a torch tensor through DLPack, for host and device memory alike: no
# copy, no NumPy, and bf16 is a DLPack type (the CUDA array interface has none).
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", _DLDevice),
        ("ndim", c_int32),
        ("dtype", _DLDataType),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("byte_offset", c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", c_void_p), ("deleter", c_void_p)]


class _Export(ctypes.Structure):
    """A 1-D DLPack tensor with its shape and stride beside it."""

    _fields_ = [("managed", _DLManagedTensor), ("shape", c_int64), ("stride", c_int64)]


_DL_DEVICES = {"cpu": 1, "cuda": 2}  # kDLCPU, kDLCUDA
_DL_DTYPES = {torch.float32: (2, 32), torch.float16: (2, 16), torch.bfloat16: (4, 16)}
_DLTENSOR = b"dltensor"  # the capsule keeps a pointer to its name: a module constant outlives it
# A prototype of its own, so that ctypes.pythonapi.PyCapsule_New keeps whatever types others set.
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, c_void_p, c_char_p, c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))
# The engine owns the memory, so the exports have no deleter; torch still reads that field when a
# tensor dies, so they are kept for the process's life (one per parameter and gather slot).
_EXPORTS = []


def _wrap_memory(address: int, numel: int, dtype: torch.dtype, device: torch.device):
    """A zero-copy 1-D tensor over `numel` elements of `dtype` at `address` on `device`."""
    export = _Export(shape=numel, stride=1)
    base = ctypes.addressof(export)
    t = export.managed.dl_tensor
    t.data, t.ndim, t.byte_offset = address, 1, 0
    t.device = _DLDevice(_DL_DEVICES[device.type], device.index or 0)
    t.dtype = _DLDataType(*_DL_DTYPES[dtype], 1)
    t.shape = ctypes.cast(base + _Export.shape.offset, POINTER(c_int64))
    t.strides = ctypes.cast(base + _Export.stride.offset, POINTER(c_int64))
    _EXPORTS.append(export)
    return torch.from_dlpack(_capsule_new(base, _DLTENSOR, None))


class LocalGroup:
    """The communicators of `world_size` CPU ranks that run as threads of this process: give it,
    with its rank, to each rank's `FusedFSDP` of a CPU module, and drive each from its own thread."""

    def __init__(self, world_size: int, library: str | os.PathLike | None = None):
        self.world_size = world_size
        self._lib = Library(library)
        self.handle = c_void_p()
        self._lib.call("fsdp_local_group_create", world_size, byref(self.handle))

    def close(self):
        """Releases the group; the engines made from it keep their communicators."""
        if self.handle is not None and self.handle.value:
            self._lib.call("fsdp_local_group_destroy", self.handle)
            self.handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing to report to at interpreter exit
            pass


class FusedFSDP(torch.nn.Module):
    """Trains `module` through an fsdp-fusion engine; `units` are its FSDP units in forward order
    (e.g. the transformer blocks). Call it like the module, then `step()` after the backward
    passes of a step (several backward passes accumulate).

    Optimizer: AdamW (`optimizer="adamw"`, PyTorch's defaults, weight decay 0.01) or SGD
    (`optimizer="sgd"`, `lr` and `weight_decay`, by default 0, as `torch.optim.SGD` without
    momentum), over every trainable parameter, with fp32 master weights for bf16/f16 parameters.
    `double_buffer_limit` counts gathered parameter groups: the root's stay gathered throughout,
    so leave room for them plus the unit in use and the one prefetched.

    A CPU module trains at world size 1, or as rank `rank` of `local_group` (ranks as threads,
    each made and driven on its own thread: making an engine compares the ranks' plans).
    `timeout` (seconds) bounds every wait of the engine, a collective whose peers never come
    included; `verify_collectives` compares the ranks' collectives every step (NCCL does not).
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
        grad_reduction: str = "mean",
        timeout: float = 600.0,
        verify_collectives: bool = False,
        local_group: LocalGroup | None = None,
        rank: int = 0,
    ):
        super().__init__()
        self.module = module
        self._lib = Library(library)
        self._params = _owners(module, units)
        self._device = self._params[0].tensor.device
        self._local_group = local_group
        if local_group is not None:
            if self._device.type != "cpu":
                raise FsdpError("a local group runs CPU ranks; this module is on the GPU")
            self._rank, self._world = rank, local_group.world_size
        else:
            self._rank, self._world = _membership(self._device)
        self._plan = self._make_plan()
        config = self._config(optimizer, lr, betas, eps, weight_decay, double_buffer_limit,
                              max_reduces_in_flight, overlap, grad_reduction)
        config.timeout_seconds = timeout
        config.verify_collectives = int(verify_collectives)
        self._group = c_void_p()
        if self._device.type == "cpu":
            self._stream = None
            self._engine = self._make_cpu_engine(config)
        else:
            # The engine's compute stream is the caller's: keep the object so the stream lives on.
            self._stream = torch.cuda.current_stream(self._device)
            self._engine = self._make_cuda_engine(config)
        self._units = [[p for p in self._params if p.unit == u] for u in range(len(units))]
        self._root = [p for p in self._params if p.unit == ROOT]
        self._load_and_release()
        # Gathered views: by (param, address), made once per slot; the views of the parameters
        # mapped now, by param; and the param whose gathered memory starts at an address.
        self._view_cache = {}
        self._mapped = {}
        self._param_at = {}
        self._backward_open = set()
        self._saved_hooks = None
        self._install_hooks(units)

    # -- construction ----------------------------------------------------------------------

    def _make_plan(self) -> c_void_p:
        # ctypes keeps the names and shapes assigned to `specs` alive as long as `specs`.
        specs = (_ParamSpec * len(self._params))()
        for spec, p in zip(specs, self._params):
            dtype = _DTYPE_CODES.get(p.tensor.dtype)
            if dtype is None:
                raise FsdpError(f"{p.name}: dtype {p.tensor.dtype} is not bf16, f16 or f32")
            if p.tensor.device != self._device:
                raise FsdpError(f"{p.name} is on {p.tensor.device}, the first parameter on "
                                f"{self._device}")
            shape = (c_uint64 * max(p.tensor.dim(), 1))(*p.tensor.shape)
            spec.name, spec.shape, spec.ndim = p.name.encode(), shape, p.tensor.dim()
            spec.dtype, spec.unit = dtype, p.unit
            spec.trainable, spec.tied = int(p.tensor.requires_grad), int(p.tied)
        plan = c_void_p()
        self._lib.call("fsdp_plan_from_specs", specs, len(specs), self._world, byref(plan))
        return plan

    def _config(self, optimizer, lr, betas, eps, weight_decay, double_buffer_limit,
                max_reduces_in_flight, overlap, grad_reduction) -> _Config:
        config = _Config()
        self._lib.call("fsdp_config_default", byref(config))
        config.optimizer = _choice("optimizer", optimizer, {"adamw": 0, "sgd": 1})
        config.grad_reduction = _choice("grad_reduction", grad_reduction, {"mean": 0, "sum": 1})
        config.lr, (config.beta1, config.beta2) = lr, betas
        if weight_decay is None:
            weight_decay = 0.01 if optimizer == "adamw" else 0.0
        config.eps, config.weight_decay = eps, weight_decay
        config.double_buffer_limit = double_buffer_limit
        config.max_reduces_in_flight = max_reduces_in_flight
        config.overlap = int(overlap)
        return config

    def _make_cpu_engine(self, config: _Config) -> c_void_p:
        """This rank on the CPU backend: of the caller's local group, else of a group of one."""
        if self._local_group is not None:
            group = self._local_group.handle
        elif self._world != 1:
            raise FsdpError("CPU ranks of several processes do not exist: pass a local group")
        else:
            self._lib.call("fsdp_local_group_create", 1, byref(self._group))
            group = self._group
        engine = c_void_p()
        self._lib.call("fsdp_engine_create_cpu", self._plan, byref(config), group, self._rank,
                       byref(engine))
        return engine

    def _make_cuda_engine(self, config: _Config) -> c_void_p:
        """This process's rank on its GPU with NCCL; blocks until every rank joined."""
        engine = c_void_p()
        uid = self._unique_id()
        self._lib.call("fsdp_engine_create_cuda_nccl", self._plan, byref(config),
                       self._device.index or 0, uid, len(uid), self._rank, self._world,
                       self._stream.cuda_stream, byref(engine))
        return engine

    def _unique_id(self):
        """Rank 0's fresh NCCL id, sent to the others through torch.distributed (whose current
        device each rank has set)."""
        uid = (c_uint8 * _UNIQUE_ID_BYTES)()
        if self._rank == 0:
            self._lib.call("fsdp_nccl_unique_id", uid, len(uid))
        if self._world > 1:
            shared = [bytes(uid)]
            torch.distributed.broadcast_object_list(shared, src=0)
            uid = (c_uint8 * _UNIQUE_ID_BYTES).from_buffer_copy(shared[0])
        return uid

    def _load_and_release(self):
        """Loads each parameter's value (a host copy) and replaces its storage by a placeholder
        until the parameter is gathered."""
        for p in self._params:
            host = p.tensor.detach().to("cpu").contiguous()
            self._lib.call("fsdp_engine_load_param", self._engine, p.id, host.data_ptr(),
                           host.numel(), _DTYPE_CODES[host.dtype])
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
        for p in self._params:
            if p.tensor.requires_grad:
                p.tensor.register_post_accumulate_grad_hook(self._grad_hook(p))

    # -- hooks -----------------------------------------------------------------------------

    def _pre_forward_hook(self, unit: int):
        def hook(_module, args, kwargs):
            self._open(unit, "fsdp_engine_pre_forward")
            return self._wrap_inputs(unit, args, kwargs)

        return hook

    def _post_forward_hook(self, unit: int):
        def hook(_module, _args, output):
            self._close(unit, "fsdp_engine_post_forward")
            self._hook_outputs(unit, output)

        return hook

    def _root_pre_forward(self, _module, args, kwargs):
        if self._stream is not None and torch.cuda.current_stream(self._device) != self._stream:
            raise FsdpError("run forward and backward on the stream current when the wrapper "
                            "was made: the engine's compute stream")
        # A backward left open (the root's, or a unit's whose inputs needed no gradient) ends
        # when the next forward starts: every gradient of that pass has arrived by then.
        self._close_backwards()
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saved_hooks.__enter__()
        self._open(ROOT, "fsdp_engine_pre_forward")
        return self._wrap_inputs(ROOT, args, kwargs)

    def _root_post_forward(self, _module, _args, output):
        self._saved_hooks.__exit__(None, None, None)
        self._saved_hooks = None
        self._close(ROOT, "fsdp_engine_post_forward")
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

    def _pre_backward(self, unit):
        if unit not in self._backward_open:
            self._open(unit, "fsdp_engine_pre_backward")
            self._backward_open.add(unit)

    def _post_backward(self, unit):
        if unit in self._backward_open:
            self._backward_open.discard(unit)
            self._close(unit, "fsdp_engine_post_backward")

    def _close_backwards(self):
        for unit in sorted(self._backward_open):
            self._post_backward(unit)

    def _grad_hook(self, p: _Param):
        def hook(param):
            grad = param.grad.detach()
            param.grad = None
            if not grad.is_contiguous():
                grad = grad.contiguous()
            # On the CPU the engine reads the gradient before returning; on a GPU it reads it on
            # the compute stream, where the caching allocator reuses its memory only afterwards.
            self._lib.call("fsdp_engine_grad", self._engine, p.id, grad.data_ptr(),
                           grad.numel(), _DTYPE_CODES[grad.dtype])

        return hook

    # -- gathered views --------------------------------------------------------------------

    def _members(self, unit):
        return self._root if unit == ROOT else self._units[unit]

    def _open(self, unit, hook):
        """Runs the engine's pre hook for `unit` and points its parameters at their views."""
        members = self._members(unit)
        if not members:
            return
        self._lib.call(hook, self._engine, unit)
        for p in members:
            view = self._view(p)
            self._mapped[p.id] = view
            self._param_at[view.data_ptr()] = p.id
            p.tensor.data = view

    def _close(self, unit, hook):
        """Points `unit`'s parameters back at placeholders and runs the engine's post hook."""
        members = self._members(unit)
        if not members:
            return
        for p in members:
            view = self._mapped.pop(p.id, None)
            if view is not None:
                self._param_at.pop(view.data_ptr(), None)
            p.tensor.data = p.placeholder
        self._lib.call(hook, self._engine, unit)

    def _view(self, p: _Param) -> torch.Tensor:
        address, numel, dtype = c_void_p(), c_size_t(), c_uint32()
        self._lib.call("fsdp_engine_param", self._engine, p.id, byref(address), byref(numel),
                       byref(dtype))
        key = (p.id, address.value)
        view = self._view_cache.get(key)
        if view is None:
            view = self._tensor_at(address.value, numel.value, p.tensor.dtype).view(p.tensor.shape)
            self._view_cache[key] = view
        return view

    def _tensor_at(self, address: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-copy 1-D tensor over the engine's memory at `address`."""
        if numel == 0:
            return torch.empty(0, dtype=dtype, device=self._device)
        return _wrap_memory(address, numel, dtype, self._device)

    # -- saved tensors ---------------------------------------------------------------------
    # Autograd keeps tensors of the forward for backward, among them parameters and views of
    # them (a weight's transpose): memory of the slot the unit was gathered into then. By the
    # backward the engine may have gathered the unit into another slot, and given the old one
    # to another group. So a saved tensor in a parameter's gathered memory is saved as where it
    # lies in that parameter, and read back from the parameter's memory at backward time (its
    # unit's pre_backward ran before any node of the unit executes).

    def _pack(self, t: torch.Tensor):
        if t.device != self._device or t.layout != torch.strided:
            return t
        param = self._param_at.get(t.untyped_storage().data_ptr())
        if param is None:
            return t
        return _Saved(param, t.dtype, t.size(), t.stride(), t.storage_offset() * t.element_size())

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        view = self._mapped.get(saved.param)
        if view is None:
            name = self._params[saved.param].name
            raise FsdpError(f"backward needs {name}, whose unit's backward is not open")
        flat = view.reshape(-1)
        if flat.dtype != saved.dtype:
            flat = flat.view(saved.dtype)
        offset = saved.byte_offset // flat.element_size()
        return flat.as_strided(saved.size, saved.stride, offset)

    # -- the step --------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def step(self, count_nonfinite: bool = False) -> int | None:
        """Ends the step: syncs the gradients of its backward passes, steps the optimizer on the
        shards and releases gathered parameters. Does not block the host on a GPU, unless
        `count_nonfinite`: then it returns the number of infinite or NaN values in this rank's
        synced gradient shards (a host wait)."""
        self._close_backwards()
        self._lib.call("fsdp_engine_finish_grad_sync", self._engine)
        count = None
        if count_nonfinite:
            found = c_uint64()
            self._lib.call("fsdp_engine_nonfinite_grads", self._engine, byref(found))
            count = found.value
        self._lib.call("fsdp_engine_optimizer_step", self._engine)
        self._lib.call("fsdp_engine_end_step", self._engine)
        return count

    def counters(self) -> Counters:
        counters = Counters()
        self._lib.call("fsdp_engine_counters", self._engine, byref(counters))
        return counters

    def full_parameter(self, name: str) -> torch.Tensor:
        """A host copy of parameter `name` from this rank's shard, at world size 1 (where the
        shard is the whole group). Blocks until the copy is done."""
        if self._world != 1:
            raise FsdpError("full_parameter reads the whole group from the shard: world size 1")
        p = next((p for p in self._params if p.name == name), None)
        if p is None:
            raise FsdpError(f"no parameter named {name!r}")
        info = self._info(p.id)
        # Parameters lie padded one after another: the group ends where its last one does.
        group_numel = max(i.offset + i.padded_numel
                          for i in map(self._info, range(len(self._params)))
                          if i.group == info.group)
        element = p.tensor.element_size()
        shard = torch.empty(group_numel * element, dtype=torch.uint8)
        written = c_size_t()
        self._lib.call("fsdp_engine_param_shard", self._engine, info.group, shard.data_ptr(),
                       shard.numel(), byref(written))
        values = shard[info.offset * element:(info.offset + info.numel) * element]
        return values.view(p.tensor.dtype).view(p.tensor.shape).clone()

    def _info(self, param: int) -> _ParamInfo:
        info = _ParamInfo()
        self._lib.call("fsdp_plan_param_info", self._plan, param, byref(info))
        return info

    def close(self):
        """Releases the engine, its group and the plan; the module's parameters stay
        placeholders."""
        for name, attr in (("fsdp_engine_destroy", "_engine"),
                           ("fsdp_local_group_destroy", "_group"),
                           ("fsdp_plan_destroy", "_plan")):
            handle = getattr(self, attr, None)
            if handle is not None and handle.value:
                self._lib.call(name, handle)
                setattr(self, attr, None)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing to report to at interpreter exit
            pass


def _choice(what: str, value: str, codes: dict[str, int]) -> int:
    if value not in codes:
        raise FsdpError(f"{what} {value!r} is not one of {sorted(codes)}")
    return codes[value]


def _membership(device: torch.device) -> tuple[int, int]:
    """This process's rank and the world size: torch.distributed's when initialized."""
    dist = torch.distributed
    if device.type == "cuda" and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
