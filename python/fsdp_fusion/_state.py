"""The engine's state as PyTorch sees it: checkpoints saved and loaded, safetensors exported and
imported, and whole parameters gathered into host tensors."""

from __future__ import annotations

import os
from ctypes import byref, c_size_t

import torch

from . import _capi
from ._capi import ParamInfo
from ._params import DTYPE_CODES, _Param
from .errors import InvalidArgumentError, MisuseError

# The key suffix of a module's extra state in `state_dict()` (torch's `_EXTRA_STATE_KEY_SUFFIX`).
_EXTRA_STATE = "_extra_state"


def _value(p: _Param, info: ParamInfo, group_bytes: torch.Tensor) -> torch.Tensor:
    """Parameter `p`'s value, a copy, out of its group's bytes."""
    element = p.tensor.element_size()
    values = group_bytes[info.offset * element:(info.offset + info.numel) * element]
    return values.view(p.tensor.dtype).view(p.tensor.shape).clone()


def _c_path(path: str | os.PathLike) -> bytes:
    """`path` as the C API takes it: a NUL byte would end it there, naming another file."""
    encoded = os.fsencode(path)
    if b"\0" in encoded:
        raise InvalidArgumentError(f"the path {path!r} holds a NUL byte")
    return encoded


def export_checkpoint(directory: str | os.PathLike, path: str | os.PathLike,
                      library: str | os.PathLike | None = None):
    """Writes the full model of the sharded checkpoint in `directory` (saved by `FusedFSDP.save`
    on every rank, at any world size) into the safetensors file `path`, under the module's
    parameter names, as `FusedFSDP.export` does at world size 1. No engine and no communication:
    one process calls it once every rank saved. A missing, incomplete or corrupted checkpoint
    raises `IoError`; an existing `path` raises `InvalidArgumentError`."""
    _capi.library(library).call("fsdp_checkpoint_export_safetensors", _c_path(directory),
                                _c_path(path))


class _StateCopies:
    """`FusedFSDP`'s copies of its state in and out: checkpoints, safetensors, whole parameters."""

    def _call_on_path(self, function: str, path: str | os.PathLike):
        """The engine's `function` on `path`, once a step of forwards only ended; a path the C
        API cannot take is refused first, with nothing changed."""
        encoded = _c_path(path)
        self._end_evaluation()
        self._call(function, self._engine, encoded)

    def save(self, directory: str | os.PathLike, *, wait: bool = True):
        """Writes this rank's part of a sharded checkpoint into `directory`: shards, fp32
        masters, AdamW moments, the optimizer's step and settings; not the module's buffers
        (BatchNorm's running statistics, say), which the caller saves (`full_state_dict()`
        holds them, and `load_full_state_dict` loads them). A collective: every rank
        calls it with the same directory; the ranks first agree on the save's id and that the
        directory holds no checkpoint (else every rank raises `InvalidArgumentError` and nothing
        is written). Each file is written under a unique temporary name, flushed to disk and
        linked into place, never over an existing file. Then the ranks agree on the outcome: a
        rank that could not write raises `IoError`, and so does every other rank, naming it,
        with no rank's file of the save left. Between steps only (forward passes with no
        gradient since the last step, an evaluation, end their step first). `wait=False` copies
        the state into host memory and returns while a thread writes the files; `wait_save()`
        gives the outcome (one save pending at a time, until then)."""
        self._call_on_path("fsdp_engine_save" if wait else "fsdp_engine_save_async", directory)

    def wait_save(self):
        """The outcome of `save(wait=False)`, a collective: every rank calls it, between steps.
        Each rank waits for its files (within half the engine's timeout above world size 1),
        then the ranks agree: every rank raises `FsdpTimeoutError` while a rank's files are
        still being written (the save stays pending: call again), and what failed on any rank
        (`IoError`, ...) where a write failed, with no rank's file of the save left. Returns
        once every rank's files are on disk, or when no save is pending on any rank."""
        self._end_evaluation()
        self._call("fsdp_engine_wait_save", self._engine)

    def load(self, directory: str | os.PathLike):
        """Restores this rank's part of the checkpoint in `directory`, saved by a wrapper of the
        same model and optimizer at any world size; the optimizer continues from the saved step.
        A collective: nothing changes on any rank unless every rank's part checked out. A
        missing, incomplete, truncated, corrupted or changed checkpoint, or rank files of two
        saves, raise `IoError` naming the file and field; one of another model
        `InvalidArgumentError` listing the differences, as do ranks that read node-local copies
        of two saves (on every rank, naming both); a rank whose own part was fine raises the
        failing rank's error, naming it."""
        self._call_on_path("fsdp_engine_load", directory)

    def export(self, path: str | os.PathLike):
        """Writes the full model's parameters into the safetensors file `path` under the
        module's parameter names, shapes and dtypes, a tied parameter under its first name
        (`safetensors.torch.load_file` and `load_state_dict(..., strict=False)` take it back
        into a plain PyTorch model; it holds no buffers and no tied parameter's other names,
        which a strict load asks for: `full_state_dict` holds those). Atomic; an existing file
        raises `InvalidArgumentError`. World size 1, between steps."""
        self._call_on_path("fsdp_engine_export_safetensors", path)

    def import_(self, path: str | os.PathLike):
        """Loads every parameter's values from the safetensors file `path` (an export, or a
        pretrained model's with the same names, shapes and dtypes), each rank reading only its
        shard's part; a file of another model raises `InvalidArgumentError` listing every
        difference. A collective: nothing is loaded on any rank unless every rank read its
        part, and ranks whose files differ (node-local copies of two models) in their length,
        header or the first 4 KiB of a tensor raise `InvalidArgumentError` alike. The optimizer's state is unchanged. Between steps."""
        self._call_on_path("fsdp_engine_import_safetensors", path)

    def full_parameter(self, name: str) -> torch.Tensor:
        """A host copy of parameter `name` from this rank's shard, at world size 1 (where the
        shard is the whole group). Blocks until the copy is done."""
        if self._world != 1:
            raise MisuseError("full_parameter reads the whole group from the shard: world size 1")
        p = next((p for p in self._params if p.name == name), None)
        if p is None:
            raise InvalidArgumentError(f"no parameter named {name!r}")
        info = self._info(p.id)
        members = [(q, i) for q, i in zip(self._params, map(self._info, range(len(self._params))))
                   if i.group == info.group]
        shard = self._group_bytes("fsdp_engine_param_shard", info.group, members)
        return _value(p, info, shard)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole value as a host tensor under the module's names (a tied
        one's under each of its names), gathered from every rank's shards, and the module's
        persistent buffers (this rank's, copied to the host) and extra states (what
        `get_extra_state` returns, under `<module>._extra_state`): what `load_state_dict` of a
        plain copy takes, strictly. A collective, every rank calls it. Between steps (an
        evaluation's step is ended first).
        The module's own `state_dict()` holds the engine's views (at world size 1, after a
        forward), and is refused (`MisuseError`) where a parameter is a placeholder."""
        self._end_evaluation()
        infos = [self._info(p.id) for p in self._params]
        state = {}
        for group in sorted({i.group for i in infos}):
            members = [(p, i) for p, i in zip(self._params, infos) if i.group == group]
            whole = self._group_bytes("fsdp_engine_gather_group", group, members)
            for p, i in members:
                state[p.name] = _value(p, i, whole)
        for name, aliases in self._names().items():
            for alias in aliases[1:]:
                # A tied parameter's other names: the same tensor, as in `state_dict()`.
                state[alias] = state[name]
        # Every name, as `state_dict()` gives a module registered under two.
        for prefix, module in self.module.named_modules(remove_duplicate=False):
            for name, buffer in module._buffers.items():
                if buffer is not None and name not in module._non_persistent_buffers_set:
                    state[f"{prefix}.{name}" if prefix else name] = buffer.detach().to("cpu").clone()
        for key, module in self._extra_states("get_extra_state").items():
            state[key] = module.get_extra_state()
        return state

    def _extra_states(self, method: str) -> dict[str, torch.nn.Module]:
        """The modules whose class overrides `method` (`get_extra_state`, which `state_dict()`
        saves, or `set_extra_state`, which `load_state_dict()` requires), under the key of
        their extra state: `<module's name>._extra_state`."""
        return {f"{prefix}.{_EXTRA_STATE}" if prefix else _EXTRA_STATE: module
                for prefix, module in self.module.named_modules(remove_duplicate=False)
                if getattr(type(module), method) is not getattr(torch.nn.Module, method)}

    def _names(self) -> dict[str, list[str]]:
        """Each parameter's names in the module, its own first (a tied one has several)."""
        primary = {id(p.tensor): p.name for p in self._params}
        names = {p.name: [p.name] for p in self._params}
        for name, t in self.module.named_parameters(remove_duplicate=False):
            if name != primary.get(id(t), name):
                names[primary[id(t)]].append(name)
        return names

    def load_full_state_dict(self, state: dict[str, torch.Tensor]):
        """Loads every parameter's whole value from `state`, under the module's names (as
        `full_state_dict` gives them, or a plain copy's `state_dict()`, a tied parameter under
        any of its names), into the engine: its shards and fp32 masters, so that the next step
        trains from them; the module's buffers in `state` load as in PyTorch, and so does each
        module's extra state, through `set_extra_state` (its key required where the module's
        class overrides it, as PyTorch's strict load requires it), before any parameter or
        buffer: one that raises leaves them as they were. Every rank loads every parameter,
        between steps, and checks its own `state` alone: ranks must pass equal states (one
        file, say), or one may refuse while the others load. Names missing from `state` or not
        the module's, values that are not tensors, of another shape, or that cannot be copied
        (a meta tensor, say), and a tied parameter's names holding different values raise
        `InvalidArgumentError` before anything is loaded; a value of another float dtype is
        converted as `Tensor.to` converts it. The optimizer's state is unchanged. (The module's
        own `load_state_dict` is refused: it would write the engine's views or placeholders,
        not its state.)"""
        self._end_evaluation()
        if self._forwards:
            # The engine would refuse the parameters once the extra states changed.
            raise MisuseError("load_full_state_dict between steps: this step's gradients wait "
                              "for step()")
        buffers = dict(self.module.named_buffers(remove_duplicate=False))
        names = self._names()
        problems = {"missing": [], "not tensors": [], "other shapes": [], "tied names differ": [],
                    "not copied": []}
        extra = self._extra_states("set_extra_state")
        problems["missing"] += sorted(extra.keys() - state.keys())
        known = {n for aliases in names.values() for n in aliases} | buffers.keys() | extra.keys()
        problems["neither parameters nor buffers"] = sorted(state.keys() - known)
        tensors = {n for n, v in state.items() if isinstance(v, torch.Tensor)}
        problems["not tensors"] = sorted((known - extra.keys()) & (state.keys() - tensors))
        # Every value as it loads, converted before anything is loaded.
        hosts, copies = {}, {}

        def converted(name, shape, convert):
            if state[name].shape != shape:
                problems["other shapes"].append(
                    f"{name} {tuple(state[name].shape)}, the module's {tuple(shape)}")
                return None
            try:
                return convert(state[name].detach())
            except (RuntimeError, NotImplementedError, TypeError) as e:
                problems["not copied"].append(f"{name} ({e})")
                return None

        for p in self._params:
            given = [n for n in names[p.name] if n in tensors]
            if not given:
                if not any(n in state for n in names[p.name]):
                    problems["missing"].append(p.name)
                continue
            if any(not torch.equal(state[n], state[given[0]]) for n in given[1:]):
                problems["tied names differ"].append(", ".join(given))
            hosts[p.name] = converted(
                given[0], p.tensor.shape,
                lambda v, dtype=p.tensor.dtype: v.to("cpu", dtype).contiguous())
        for name, buffer in buffers.items():
            if name in tensors:
                copies[name] = converted(
                    name, buffer.shape, lambda v, b=buffer: v.to(b.device, b.dtype))
        found = [f"{what}: {', '.join(items)}" for what, items in problems.items() if items]
        if found:
            raise InvalidArgumentError("load_full_state_dict: " + "; ".join(found))
        # First, so that one refusing its state leaves the parameters and buffers as they were.
        for key, module in extra.items():
            module.set_extra_state(state[key])
        for p in self._params:
            host = hosts[p.name]
            self._call("fsdp_engine_load_param", self._engine, p.id, host.data_ptr(),
                       host.numel(), DTYPE_CODES[host.dtype])
        with torch.no_grad():
            for name, value in copies.items():
                buffers[name].copy_(value)

    def _group_bytes(self, function: str, group: int, members) -> torch.Tensor:
        """The bytes `function` (`fsdp_engine_param_shard` or `fsdp_engine_gather_group`) copies
        of `group`, whose parameters and their infos are `members`."""
        element = members[0][0].tensor.element_size()
        # Parameters lie padded one after another: the group ends where its last one does.
        numel = max(i.offset + i.padded_numel for _, i in members)
        whole = torch.empty(numel * element, dtype=torch.uint8)
        written = c_size_t()
        self._call(function, self._engine, group, whole.data_ptr(), whole.numel(), byref(written))
        return whole

    def _info(self, param: int) -> ParamInfo:
        info = ParamInfo()
        self._lib.call("fsdp_plan_param_info", self._plan, param, byref(info))
        return info
