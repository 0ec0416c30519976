"""How `FusedFSDP` makes its engine: the plan of the module's parameters, the engine's config,
the engine on its backend (CPU, NCCL or a loopback group), and the initial load of the
parameters' values."""

from __future__ import annotations

import json
import math
import operator
from ctypes import byref, c_uint8, c_uint64, c_void_p

import torch

from . import errors
from ._capi import ROOT, UNIQUE_ID_BYTES, Config, ParamSpec
from ._dlpack import device_index
from ._params import _PLACEHOLDERS, DTYPE_CODES, DTYPE_NAMES
from .errors import FsdpError, InvalidArgumentError


def _choice(what: str, value, codes: dict) -> int:
    if value not in codes:
        raise InvalidArgumentError(f"{what} {value!r} is not one of {sorted(map(str, codes))}")
    return codes[value]


def _count(what: str, value) -> int:
    """`value` as a count of at least 1: ctypes would wrap a negative one into the C field's
    largest value, which reads as no limit at all."""
    try:
        count = operator.index(value)
    except TypeError:
        count = None
    if isinstance(value, bool) or count is None or count < 1:
        raise InvalidArgumentError(f"{what} {value!r} is not a positive integer")
    return count


def _membership(device: torch.device) -> tuple[int, int]:
    """This process's rank and the world size: torch.distributed's when initialized. A CPU
    model among several processes is refused: the CPU engine's ranks are threads of one process
    (`local_group`), and alone each process would train a model of its own."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    if device.type == "cuda":
        return dist.get_rank(), dist.get_world_size()
    if dist.get_world_size() > 1:
        raise InvalidArgumentError(
            f"a CPU model in a torch.distributed group of {dist.get_world_size()} processes: "
            "CPU ranks are threads of one process (local_group=LocalGroup(n), rank=r); each "
            "process alone would train a model of its own")
    return 0, 1


class _EngineCreation:
    """`FusedFSDP`'s making of its plan, config and engine, and the hand-over of the module's
    parameter values to the engine."""

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
        config.double_buffer_limit = _count("double_buffer_limit", double_buffer_limit)
        config.max_reduces_in_flight = _count("max_reduces_in_flight", max_reduces_in_flight)
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
                       device_index(self._device), self._local_group.handle, self._rank,
                       self._stream.cuda_stream, byref(self._allocator.struct), byref(engine))
            return engine
        uid = self._unique_id()
        self._call("fsdp_engine_create_cuda_nccl", self._plan, byref(config),
                       device_index(self._device), uid, len(uid), self._rank, self._world,
                       self._stream.cuda_stream, byref(self._allocator.struct), byref(engine))
        return engine

    def _unique_id(self):
        """Rank 0's fresh NCCL id, sent to the others through torch.distributed (whose current
        device each rank has set). Rank 0's failure to make it is sent instead, and raised on
        every rank (its class, naming rank 0): the others would otherwise wait for an id until
        torch.distributed's own timeout."""
        uid = (c_uint8 * UNIQUE_ID_BYTES)()
        failure = None
        if self._rank == 0:
            try:
                self._lib.call("fsdp_nccl_unique_id", uid, len(uid))
            except FsdpError as e:
                failure = e
        if self._world > 1:
            shared = [bytes(uid) if failure is None else (type(failure).__name__, str(failure))]
            torch.distributed.broadcast_object_list(shared, src=0)
            if isinstance(shared[0], tuple):
                if failure is not None:
                    raise failure
                name, message = shared[0]
                raise getattr(errors, name, FsdpError)(f"rank 0 could not make the NCCL id: "
                                                       f"{message}")
            uid = (c_uint8 * UNIQUE_ID_BYTES).from_buffer_copy(shared[0])
        elif failure is not None:
            raise failure
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
            # A gradient from before the wrapper is no gradient of its steps.
            t.grad = None
            setattr(t, _PLACEHOLDERS, True)
