"""The tests train small models on the CPU backend against plain PyTorch; no GPU needed.

The library is found as the package finds it ($FSDP_FUSION_LIBRARY, beside the package, or the
checkout's target/release); the example model comes from the checkout's examples/torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(CHECKOUT / "examples" / "torch"))
