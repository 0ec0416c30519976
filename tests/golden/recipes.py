"""Prints the golden values of tests/recipe_golden.rs: a warmup-cosine schedule
(torch.optim.lr_scheduler.SequentialLR of LinearLR and CosineAnnealingLR), the whole gradient's
norm and its clipping (torch.nn.utils.clip_grad_norm_), and AdamW over two parameter groups (one
without weight decay, at half the learning rate), for 4 steps from fixed values and gradients.

Run: python3 tests/golden/recipes.py (needs torch; the test's comment names the version used).
"""

import struct

import torch

DECAYED = [1.0, -0.5, 0.25, 3.0, -2.0, 0.0, 1e-3, -7.5]
EXEMPT = [0.5, -1.5, 2.0, 0.125, -0.25]
LR, WARMUP, TOTAL, MIN_FACTOR, MAX_NORM, STEPS = 1e-2, 2, 6, 0.1, 1.0, 4


def gradient(step: int, i: int) -> float:
    """The gradient of element `i` of the parameters laid end to end, at `step` (from 1)."""
    return ((i + 1) * 0.37 - step * 0.51) * (3.0 if i % 4 == 1 else 1.0)


def f32(x: float) -> str:
    """The shortest decimal that reads back as the same f32."""
    bits = struct.pack("<f", x)
    x = struct.unpack("<f", bits)[0]
    for digits in range(1, 10):
        text = f"{x:.{digits}g}"
        if struct.pack("<f", float(text)) == bits:
            return text if any(c in text for c in ".e") else text + ".0"
    raise ValueError(x)


def row(values):
    return "[" + ", ".join(f32(float(x)) for x in values) + "]"


def warmup_cosine(optimizer, min_factor):
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1 / WARMUP, total_iters=WARMUP),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=TOTAL - WARMUP,
                                                   eta_min=min_factor * LR),
    ], milestones=[WARMUP])


# The schedule's factors over every step to TOTAL, on a group at lr LR (torch's cosine would
# rise again past T_max; the engine's stays at the minimum).
probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
schedule = warmup_cosine(probe, MIN_FACTOR)
factors = []
for _ in range(TOTAL + 1):
    factors.append(probe.param_groups[0]["lr"] / LR)
    probe.step()
    schedule.step()

# Training: torch's eta_min is absolute, so with a minimum of 0 both groups follow the same
# factors of their own rates, as the engine's lr_scale does.
decayed = torch.nn.Parameter(torch.tensor(DECAYED))
exempt = torch.nn.Parameter(torch.tensor(EXEMPT))
optimizer = torch.optim.AdamW(
    [{"params": [decayed], "weight_decay": 0.1, "lr": LR},
     {"params": [exempt], "weight_decay": 0.0, "lr": LR * 0.5}],
    lr=LR, betas=(0.9, 0.999), eps=1e-8)
schedule = warmup_cosine(optimizer, 0.0)
norms, values = [], []
for step in range(1, STEPS + 1):
    n = len(DECAYED)
    decayed.grad = torch.tensor([gradient(step, i) for i in range(n)])
    exempt.grad = torch.tensor([gradient(step, n + i) for i in range(len(EXEMPT))])
    norms.append(float(torch.nn.utils.clip_grad_norm_([decayed, exempt], MAX_NORM)))
    optimizer.step()
    schedule.step()
    values.append((decayed.detach().tolist(), exempt.detach().tolist()))

print(f"// torch {torch.__version__}")
print(f"const FACTORS: [f32; {len(factors)}] = {row(factors)};")
print(f"const NORMS: [f32; {STEPS}] = {row(norms)};")
print(f"const DECAYED_AFTER: [[f32; {len(DECAYED)}]; {STEPS}] = [")
for d, _ in values:
    print(f"    {row(d)},")
print("];")
print(f"const EXEMPT_AFTER: [[f32; {len(EXEMPT)}]; {STEPS}] = [")
for _, e in values:
    print(f"    {row(e)},")
print("];")
