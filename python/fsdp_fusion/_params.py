"""The parameters of a module as the engine is told them: which unit holds each, whether it is
tied, which take weight decay, their learning-rate scales and process groups, and the device and
dtypes they are on."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._capi import ROOT
from .errors import InvalidArgumentError

DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
"""The engine's dtypes: `fsdp_dtype` codes of the torch dtypes it trains."""

# Set on a parameter once it is a wrapper's placeholder, for good: a wrapper of a module
# holding it (the same module, a parent, a child) would load it (NaN) as its value.
_PLACEHOLDERS = "_fsdp_fusion_placeholder"


def _holds_placeholders(module: torch.nn.Module) -> bool:
    return any(getattr(p, _PLACEHOLDERS, False) for p in module.parameters())

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
"""The engine's dtypes as a model file names them."""


@dataclass
class _Param:
    id: int
    name: str
    tensor: torch.nn.Parameter
    unit: int
    tied: bool
    # Whether it trains: its `requires_grad` when wrapped.
    trains: bool
    # What `.data` holds while the parameter is not gathered: one NaN broadcast to its shape, so
    # that the shape stays right and a use outside its unit shows.
    placeholder: torch.Tensor | None = None


def _owners(module: torch.nn.Module, units: list[torch.nn.Module]) -> list[_Param]:
    """Every parameter of `module` once, in model order, with its unit and whether it is tied."""
    inside = {id(m) for m in module.modules()}
    unit_of_module = {}
    for index, unit in enumerate(units):
        if not isinstance(unit, torch.nn.Module):
            raise InvalidArgumentError(f"units[{index}] is a {type(unit).__name__}, not a module")
        if unit is module or id(unit) not in inside:
            raise InvalidArgumentError(f"units[{index}] ({type(unit).__name__}) is not a "
                                       "submodule of the module")
        for sub in unit.modules():
            if unit_of_module.setdefault(id(sub), index) != index:
                raise InvalidArgumentError(
                    f"units {unit_of_module[id(sub)]} and {index} share a module")
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
        params.append(_Param(index, name, p, unit, slots > 1, p.requires_grad))
    if not params:
        raise InvalidArgumentError("the module has no parameters")
    return params


def default_no_weight_decay(module: torch.nn.Module) -> set[str]:
    """The names of `module`'s parameters that LLM recipes exempt from weight decay: those with
    fewer than two dimensions (biases, norm weights) and the weights of embeddings (every name of
    a parameter held under several)."""
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    return {name for name, p in module.named_parameters(remove_duplicate=False)
            if p.dim() < 2 or id(p) in embeddings}


def _exempt(params: list[_Param], module: torch.nn.Module, rule) -> list[bool]:
    """Per parameter, whether weight decay skips it under `rule` (see `FusedFSDP`): nothing when
    `rule` is None, as `torch.optim.AdamW` given the parameters; else the names `rule` holds, or
    that `rule(module)` returns."""
    if rule is None:
        return [False] * len(params)
    names = set(rule(module) if callable(rule) else rule)
    known = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    unknown = sorted(names - known)
    if unknown:
        raise InvalidArgumentError(f"no_weight_decay names no parameter: {unknown}")
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), set()).add(name)
    return [bool(aliases[id(p.tensor)] & names) for p in params]


def _by_alias(module: torch.nn.Module, given: dict, what: str) -> dict[int, list[str]]:
    """Every parameter's names (a tied one has several), by the tensor's id; refuses a name in
    `given` (the `what` argument) that is no parameter."""
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    unknown = sorted(set(given) - {n for names in aliases.values() for n in names})
    if unknown:
        raise InvalidArgumentError(f"{what} names no parameter: {unknown}")
    return aliases


def _scales(params: list[_Param], module: torch.nn.Module, scales) -> list[float]:
    """Per parameter, its learning-rate scale from `scales` (names to factors), else 1."""
    scales = dict(scales or {})
    aliases = _by_alias(module, scales, "lr_scales")
    out = []
    for p in params:
        given = {scales[n] for n in aliases[id(p.tensor)] if n in scales}
        if len(given) > 1:
            raise InvalidArgumentError(f"lr_scales gives {p.name} several scales: {sorted(given)}")
        scale = float(given.pop()) if given else 1.0
        if not (math.isfinite(scale) and scale > 0.0):
            raise InvalidArgumentError(f"lr_scales: {p.name}'s scale {scale} is not finite and "
                                       "> 0 (freeze a parameter that must not move)")
        out.append(scale)
    return out


def _param_groups(params: list[_Param], module: torch.nn.Module, declared: dict,
                  given) -> list[str | None]:
    """Each parameter's process group, in `params` order, from `given` (names, a tied
    parameter's under any of them, to groups): refuses a name that is no parameter, a group
    that `declared` lacks, and two groups for one parameter."""
    given = dict(given or {})
    aliases = _by_alias(module, given, "param_groups")
    for name, group in given.items():
        if group not in declared:
            raise InvalidArgumentError(
                f"param_groups puts {name!r} in {group!r}, which process_groups does not declare")
    out = []
    for p in params:
        groups = {given[n] for n in aliases[id(p.tensor)] if n in given}
        if len(groups) > 1:
            raise InvalidArgumentError(f"param_groups gives {p.name} several groups: "
                                       f"{sorted(groups)}")
        out.append(groups.pop() if groups else None)
    return out


def _check_placement(params: list[_Param]) -> torch.device:
    """The one device every parameter is on, with every dtype one the engine trains."""
    device = params[0].tensor.device
    for p in params:
        if p.tensor.dtype not in DTYPE_CODES:
            raise InvalidArgumentError(
                f"{p.name}: dtype {p.tensor.dtype} is not one the engine trains (bfloat16, "
                "float16, float32)")
        if p.tensor.device != device:
            raise InvalidArgumentError(
                f"the module is on several devices: {p.name} is on {p.tensor.device}, "
                f"{params[0].name} on {device}")
    if device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"the module is on {device}: the engine runs on cpu or cuda")
    return device
