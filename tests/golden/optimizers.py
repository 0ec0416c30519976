"""Prints the golden values of tests/optimizer_golden.rs: torch.optim.AdamW and torch.optim.SGD
(without and with weight decay) on one f32 parameter of 8 elements for 5 steps, from fixed values
and gradients.

Run: python3 tests/golden/optimizers.py (needs torch; the test's comment names the version used).
"""

import struct

import torch

INITIAL = [1.0, -0.5, 0.25, 3.0, -2.0, 0.0, 1e-3, -7.5]


def gradient(step: int, i: int) -> float:
    """The gradient of element `i` at `step` (from 1): mixed signs and magnitudes, one zero."""
    if i == 5 and step % 2 == 0:
        return 0.0
    return ((i + 1) * 0.37 - step * 0.51) * (10.0 if i == 3 else 1.0)


def run(make, steps=5):
    p = torch.nn.Parameter(torch.tensor(INITIAL, dtype=torch.float32))
    opt = make([p])
    out = []
    for step in range(1, steps + 1):
        p.grad = torch.tensor([gradient(step, i) for i in range(len(INITIAL))], dtype=torch.float32)
        opt.step()
        out.append([float(x) for x in p.detach()])
    return out


def f32(x: float) -> str:
    """The shortest decimal that reads back as the same f32."""
    bits = struct.pack("<f", x)
    for digits in range(1, 10):
        text = f"{x:.{digits}g}"
        if struct.pack("<f", float(text)) == bits:
            return text if any(c in text for c in ".e") else text + ".0"
    raise ValueError(x)


def show(name, rows):
    print(f"const {name}: [[f32; 8]; 5] = [")
    for row in rows:
        print("    [" + ", ".join(f32(x) for x in row) + "],")
    print("];")


print(f"// torch {torch.__version__}")
show("ADAMW", run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)))
show("SGD", run(lambda ps: torch.optim.SGD(ps, lr=0.1)))
show("SGD_DECAY", run(lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.1)))
