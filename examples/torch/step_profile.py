"""Where a training step's time goes: fsdp-fusion and plain PyTorch on the same transformers
model and batches, their steps interleaved (the order alternating) so that the machine's drift
falls on both alike.

Per phase (forward, backward, the optimizer step) it reports the device time (CUDA events) and
the host time (until the phase's calls returned; the host runs ahead of the device when it is
not the bottleneck), as the median over the measured steps with the 10th and 90th percentiles;
and with `--hook-times` the host time in fsdp-fusion's hooks, split into the C calls (by
function) and the Python around them, with the cost of a ctypes call that does nothing for scale
(the timing costs host time of its own, so the steps are timed without it otherwise).

    NCCL_NVLS_ENABLE=0 python examples/torch/step_profile.py --model gpt2 [--micro-batches 2]
        [--checkpointing] [--compile] [--fsdp2] [--hook-times] [--trace-steps 3]
        [--python-profile 5]

`--trace-steps N` runs N more steps of each trainer under torch.profiler and lists the CUDA
driver and runtime calls a step makes, and inside each of the engine's calls (the profiler sees
the kernel launches, not every driver call: the time an engine call spends outside them is its
own and the driver's other calls'). `--python-profile N` lists the Python functions N steps of
the engine's trainer spend the most time in (cProfile).

`--model` is transformers' GPT-2 (12 layers, 768, tied), Llama (8 layers, 1024, 4 KV heads) or
Qwen2 (6 layers, 896, tied, biased attention projections).

Plain PyTorch is a bf16 model trained through an fp32 master copy with `torch.optim.AdamW`
(foreach), the engine's numerics; both at world size 1 on NCCL.
"""

from __future__ import annotations

import argparse
import bisect
import copy
import cProfile
import functools
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parents[2] / "python"))
from fsdp_fusion import FusedFSDP, default_no_weight_decay  # noqa: E402
from world_of_one import nccl_world_of_one  # noqa: E402

PHASES = ("forward", "backward", "optimizer")
# The client's methods that its hooks enter through (the outermost call is timed).
HOOK_ENTRIES = ("_open", "_close", "_wrap_inputs", "_hook_outputs", "_pre_backward",
                "_post_backward", "_close_backwards", "_hand_over")


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", help="libfsdp_fusion.so (default: as fsdp_fusion finds it)")
    parser.add_argument("--model", default="gpt2", choices=["gpt2", "llama", "qwen2"])
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--checkpointing", action="store_true",
                        help="transformers' gradient checkpointing in both trainers")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--fsdp2", action="store_true", help="FSDP2 as a third trainer")
    parser.add_argument("--compile", action="store_true",
                        help="each layer compiled with torch.compile before wrapping, in the "
                             "engine's trainer and plain PyTorch's (FSDP2's stay eager)")
    parser.add_argument("--grad-shards", default="per-step", choices=["per-step", "persistent"],
                        help="the engine's fp32 gradient shards: made each step, or kept")
    parser.add_argument("--hook-times", action="store_true",
                        help="time the engine's hooks (the Python around them and each C call); "
                             "the timing's own cost then falls on the engine's steps")
    parser.add_argument("--trace-steps", type=int, default=0,
                        help="after the measured steps, this many more of each trainer under "
                             "torch.profiler: the CUDA driver and runtime calls inside each "
                             "engine call, and each trainer's calls a step")
    parser.add_argument("--python-profile", type=int, default=0, metavar="STEPS",
                        help="after the measured steps, this many fsdp-fusion steps under "
                             "cProfile: the Python functions the step spends most time in")
    return parser.parse_args()


def layers_of(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's transformer layers: its FSDP units."""
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def compiled(args, model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's layers, each compiled in its place first under `--compile` (as torchtitan
    compiles each layer before sharding it: the engine's hooks stay between compiled regions)."""
    layers = layers_of(model)
    if args.compile:
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer)
    return list(layers)


def build(args):
    """The fp32 model."""
    torch.manual_seed(0)
    if args.model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=4096,
                            n_positions=args.seq)
        model = GPT2LMHeadModel(config)
    elif args.model == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        # Tied, with biases on the attention's projections.
        config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=6,
                             num_attention_heads=14, num_key_value_heads=2, vocab_size=4096,
                             max_position_embeddings=args.seq, tie_word_embeddings=True)
        model = Qwen2ForCausalLM(config)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                             num_attention_heads=16, num_key_value_heads=4, vocab_size=4096,
                             max_position_embeddings=args.seq)
        model = LlamaForCausalLM(config)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


class Phases:
    """CUDA events and host clocks at the start of a step and the end of each phase."""

    def __init__(self):
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(len(PHASES) + 1)]
        self.clocks = [0.0] * (len(PHASES) + 1)

    def mark(self, i: int):
        self.events[i].record()
        self.clocks[i] = time.perf_counter()

    def times(self) -> tuple[list[float], list[float]]:
        """Device and host milliseconds of each phase (after a synchronize)."""
        device = [a.elapsed_time(b) for a, b in zip(self.events, self.events[1:])]
        host = [(b - a) * 1e3 for a, b in zip(self.clocks, self.clocks[1:])]
        return device, host


class HookClock:
    """Host time in the client's hooks (outermost entries) and in each C function they call."""

    def __init__(self, fused: FusedFSDP):
        self.depth, self.hooks = 0, 0.0
        self.calls = defaultdict(lambda: [0, 0.0])
        for name in HOOK_ENTRIES:
            setattr(fused, name, self.entry(getattr(fused, name)))
        fused._lib = TimedLibrary(fused._lib, self.calls)

    def entry(self, method):
        @functools.wraps(method)
        def timed(*args, **kwargs):
            self.depth += 1
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.hooks += time.perf_counter() - start

        return timed

    def take(self) -> tuple[float, dict]:
        """The hooks' seconds and the calls' (count, seconds) by function since the last take."""
        hooks, calls = self.hooks, {k: tuple(v) for k, v in self.calls.items()}
        self.hooks = 0.0
        self.calls.clear()
        return hooks, calls


class TimedLibrary:
    """The client's library, each C function timed (and, while `annotate` is set, named in the
    profiler's trace)."""

    def __init__(self, lib, calls):
        self._lib, self._calls = lib, calls
        self.annotate = False

    def __getattr__(self, name):
        function = getattr(self._lib, name)
        if not name.startswith("fsdp_engine_"):
            return function
        calls = self._calls

        def timed(*args):
            start = time.perf_counter()
            try:
                if self.annotate:
                    with torch.profiler.record_function(name):
                        return function(*args)
                return function(*args)
            finally:
                entry = calls[name]
                entry[0] += 1
                entry[1] += time.perf_counter() - start

        timed.__name__ = name
        return timed


def fusion_trainer(args, model, device):
    module = model.to(device=device, dtype=torch.bfloat16)
    fused = FusedFSDP(module, compiled(args, module), args.library, lr=3e-4, betas=(0.9, 0.95),
                      weight_decay=0.1, no_weight_decay=default_no_weight_decay,
                      grad_shards=args.grad_shards)
    # The clock's wrappers cost host time of their own: the step is timed without them.
    clock = HookClock(fused) if args.hook_times or args.trace_steps else None
    return stepper(fused, fused.step), clock, fused


def stepper(model, optimizer_step):
    """A trainer's step: forward and backward of every micro-batch through `model`, then
    `optimizer_step()`, the phases marked; returns the last loss."""

    def step(batches, phases):
        loss = None
        phases.mark(0)
        for i, tokens in enumerate(batches):
            loss = model(input_ids=tokens, labels=tokens).loss
            if i == 0:
                phases.mark(1)
            loss.backward()
        phases.mark(2)
        optimizer_step()
        phases.mark(3)
        return loss

    return step


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """torch's AdamW (foreach) with the client's recipe: no decay for the LLM exemptions."""
    exempt = default_no_weight_decay(model)
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if n not in exempt]},
              {"params": [p for n, p in named if n in exempt], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)


def fsdp2_trainer(model, layers, device):
    """FSDP2 on every layer and the root: fp32 sharded parameters gathered as bf16, gradients
    reduced in fp32."""
    model = model.to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cuda", (1,))
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = adamw(model)

    def optimizer_step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return stepper(model, optimizer_step)


def plain_trainer(args, model, device):
    master = model.to(device)
    compute = copy.deepcopy(master).to(torch.bfloat16)
    compiled(args, compute)
    pairs = list(zip(master.parameters(), compute.parameters()))
    optimizer = adamw(master)

    def step(batches, phases):
        loss = None
        phases.mark(0)
        with torch.no_grad():
            torch._foreach_copy_([c for _, c in pairs], [m for m, _ in pairs])
        for i, tokens in enumerate(batches):
            loss = compute(input_ids=tokens, labels=tokens).loss
            if i == 0:
                phases.mark(1)
            loss.backward()
        for m, c in pairs:
            m.grad = c.grad.float()
            c.grad = None
        phases.mark(2)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        phases.mark(3)
        return loss

    return step


DEVICE_API = ("cuda_driver", "cuda_runtime")


def traced_steps(step, make_batches, steps: int) -> list[dict]:
    """The complete events of `steps` steps of `step` under torch.profiler (chrome-trace form)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(make_batches(), Phases()).item()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def device_api_report(name: str, events: list[dict], steps: int):
    """Prints the CUDA driver and runtime calls a step of trainer `name` makes, and for the
    engine's calls (the annotations `TimedLibrary` makes) the device calls inside each."""
    engine = sorted((e for e in events if e.get("cat") == "user_annotation"
                     and e["name"].startswith("fsdp_engine_")), key=lambda e: e["ts"])
    by_thread = defaultdict(list)
    for e in engine:
        by_thread[e["tid"]].append(e)
    starts = {tid: [e["ts"] for e in spans] for tid, spans in by_thread.items()}
    own = defaultdict(lambda: [0, 0.0])
    inside = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for call in (e for e in events if e.get("cat") in DEVICE_API):
        spans = by_thread.get(call["tid"], [])
        i = bisect.bisect_right(starts.get(call["tid"], []), call["ts"]) - 1
        if i >= 0 and call["ts"] + call["dur"] <= spans[i]["ts"] + spans[i]["dur"]:
            entry = inside[spans[i]["name"]][call["name"]]
        else:
            entry = own[call["name"]]
        entry[0] += 1
        entry[1] += call["dur"]
    print(f"{name}: CUDA driver and runtime calls a step outside the engine's calls "
          "(count x us each):")
    for call, (count, us) in sorted(own.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"    {call:<36} {count / steps:7.1f} x {us / count:7.2f}")
    if not engine:
        return
    spans = defaultdict(lambda: [0, 0.0])
    for e in engine:
        spans[e["name"]][0] += 1
        spans[e["name"]][1] += e["dur"]
    print(f"{name}: the engine's calls, and the device calls inside one (count x us each):")
    for function, (count, us) in sorted(spans.items(), key=lambda kv: -kv[1][1]):
        calls = inside[function]
        device_us = sum(v[1] for v in calls.values())
        print(f"  {function:<34} {count / steps:5.1f} a step x {us / count:7.1f} us; "
              f"outside device calls {(us - device_us) / count:6.1f} us")
        for call, (n, call_us) in sorted(calls.items(), key=lambda kv: -kv[1][1]):
            print(f"      {call:<32} {n / count:6.2f} x {call_us / n:6.2f} us")


def python_profile(step, make_batches, steps: int):
    """Prints the Python functions `steps` steps of `step` spend the most own time in."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step(make_batches(), Phases()).item()
    torch.cuda.synchronize()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
    print(f"fsdp-fusion under cProfile, {steps} steps, by own time:")
    print(out.getvalue())


def spread(values: list[float]) -> str:
    q = statistics.quantiles(values, n=10)
    return f"{statistics.median(values):7.2f} ({q[0]:.2f}-{q[-1]:.2f})"


def main() -> int:
    args = arguments()
    device = nccl_world_of_one()
    model = build(args)
    plain_model = copy.deepcopy(model)
    trainers = {}
    if args.fsdp2:
        # A copy of the model whose layers FSDP2 shards in place.
        fsdp2_model = build(args)
        trainers["FSDP2"] = fsdp2_trainer(fsdp2_model, list(layers_of(fsdp2_model)), device)
    fusion, clock, fused = fusion_trainer(args, model, device)
    trainers = {"fsdp-fusion": fusion, "plain PyTorch": plain_trainer(args, plain_model, device),
                **trainers}
    g = torch.Generator(device=device).manual_seed(1)

    def make_batches():
        return [torch.randint(0, 4096, (args.batch, args.seq), device=device, generator=g)
                for _ in range(args.micro_batches)]

    record = {name: defaultdict(list) for name in trainers}
    hook_steps, call_steps = [], defaultdict(lambda: [0, 0.0])
    for i in range(args.steps):
        batches = make_batches()
        order = list(trainers) if i % 2 == 0 else list(reversed(trainers))
        for name in order:
            phases = Phases()
            if clock:
                clock.take()
            loss = trainers[name](batches, phases)
            loss_value = loss.item()
            torch.cuda.synchronize()
            hooks, calls = clock.take() if clock else (0.0, {})
            if i < args.warmup:
                continue
            device_ms, host_ms = phases.times()
            r = record[name]
            r["step"].append(sum(device_ms))
            r["loss"].append(loss_value)
            for phase, d, h in zip(PHASES, device_ms, host_ms):
                r[f"{phase} device"].append(d)
                r[f"{phase} host"].append(h)
            if name == "fsdp-fusion":
                hook_steps.append(hooks * 1e3)
                for function, (count, seconds) in calls.items():
                    call_steps[function][0] += count
                    call_steps[function][1] += seconds
    measured = args.steps - args.warmup
    print(f"{args.model}, batch {args.batch} x {args.seq}, {args.micro_batches} micro-batch(es)"
          f"{', gradient checkpointing' if args.checkpointing else ''}"
          f"{', layers compiled' if args.compile else ''}, bf16, AdamW, world size 1, "
          f"{measured} steps after {args.warmup}, interleaved; ms, median (p10-p90)")
    for name, r in record.items():
        print(f"{name:>14}: step {spread(r['step'])}  "
              + "  ".join(f"{p} device {spread(r[f'{p} device'])} host {spread(r[f'{p} host'])}"
                          for p in PHASES))
    plain = statistics.median(record["plain PyTorch"]["step"])
    for name in trainers:
        if name != "plain PyTorch":
            print(f"{name} / plain PyTorch, median step: "
                  f"{statistics.median(record[name]['step']) / plain:.3f}")
    if clock:
        c_ms = sum(seconds for _, seconds in call_steps.values()) * 1e3 / measured
        hooks_ms = statistics.mean(hook_steps)
        print(f"fsdp-fusion hooks, host ms per step: {hooks_ms:.2f} in all, {c_ms:.2f} in C "
              f"calls, {hooks_ms - c_ms:.2f} in Python around them")
        for function, (count, seconds) in sorted(call_steps.items(), key=lambda kv: -kv[1][1]):
            print(f"  {function:<32} {count / measured:6.1f} calls/step "
                  f"{seconds / count * 1e6:8.1f} us/call")
    if args.trace_steps:
        # The clock's library names each engine call in the trace.
        fused._lib.annotate = True
        for name, step in trainers.items():
            device_api_report(name, traced_steps(step, make_batches, args.trace_steps),
                              args.trace_steps)
        fused._lib.annotate = False
    if args.python_profile:
        python_profile(trainers["fsdp-fusion"], make_batches, args.python_profile)
    if clock:
        lib = fused._lib._lib._lib  # the CDLL under the timing and the typed wrapper
        start, n = time.perf_counter(), 20000
        for _ in range(n):
            lib.fsdp_abi_version()
        print(f"a ctypes call that does nothing: {(time.perf_counter() - start) / n * 1e6:.2f} us")
    fused.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
