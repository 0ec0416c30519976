"""A training step captured with `torch.cuda.graph` through `FusedFSDP.capture` and replayed
trains as the same steps taken eagerly, bit for bit: at world size 1 on a GPU, with a learning
rate changed every step and the gradients clipped on the device. Off a GPU only the refusal runs."""

from __future__ import annotations

import pytest
import torch

from fsdp_fusion import FusedFSDP
from fsdp_fusion.errors import MisuseError, PoisonedError

STEPS = 6
WIDTH = 64

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, WIDTH, generator=g), torch.randn(16, WIDTH, generator=g))
            for _ in range(STEPS)]


def loss_of(fused: FusedFSDP, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(fused(x), y)


def train(captured: bool, param_storage: str = "shard") -> tuple[list[float],
                                                                  dict[str, torch.Tensor], int]:
    """STEPS steps (the second to the one before last replayed when `captured`): the losses, the
    parameters at the end and the engine's step count."""
    torch.manual_seed(0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        module = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(),
                                     torch.nn.Linear(WIDTH, WIDTH)).cuda()
        fused = FusedFSDP(module, [module[0], module[2]], lr=1e-2, weight_decay=0.01,
                          grad_shards="persistent", param_storage=param_storage)
        x = torch.zeros(16, WIDTH, device="cuda")
        y = torch.zeros(16, WIDTH, device="cuda")
        graph, losses = None, []

        def step():
            loss = loss_of(fused, x, y)
            loss.backward()
            fused.step(max_grad_norm=0.5, clip_on_device=True)
            return loss

        for s, (xs, ys) in enumerate(batches()):
            fused.set_lr(1e-2 / (1 + s))
            x.copy_(xs)
            y.copy_(ys)
            if captured and 1 <= s < STEPS - 1:
                if graph is None:
                    graph = torch.cuda.CUDAGraph()
                    with fused.capture(graph):
                        loss = step()
                fused.replay(graph)
            else:
                loss = step()
            losses.append(loss.detach().clone())
        state = {k: v.clone() for k, v in fused.full_state_dict().items()}
        steps = fused.counters().steps
        fused.close()
    return [loss.item() for loss in losses], state, steps


@needs_gpu
@pytest.mark.parametrize("param_storage", ["shard", "master"])
def test_replays_of_a_captured_step_train_as_eager_steps_do(param_storage):
    """Also where the views move (gather slots, not the shards: master storage), so that the
    captured step maps its units' views anew."""
    eager_losses, eager_state, eager_steps = train(False, param_storage)
    losses, state, steps = train(True, param_storage)
    assert losses == eager_losses
    assert steps == eager_steps == STEPS
    for name, value in eager_state.items():
        assert torch.equal(state[name], value), name
    # Each step moved the loss: the replays ran, with their own batches.
    assert len(set(losses)) == STEPS


@needs_gpu
def test_a_capture_refuses_host_reads_and_the_default_stream():
    module = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH)).cuda()
    fused = FusedFSDP(module, [module[0]], grad_shards="persistent")
    with pytest.raises(MisuseError, match="default"):
        with fused.capture(torch.cuda.CUDAGraph()):
            pass
    fused.close()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        module = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH)).cuda()
        fused = FusedFSDP(module, [module[0]], grad_shards="persistent")
        x = torch.randn(4, WIDTH, device="cuda")
        with pytest.raises(MisuseError, match="warm-up"):
            with fused.capture(torch.cuda.CUDAGraph()):
                pass
        fused(x).sum().backward()
        fused.step()
        with pytest.raises(MisuseError, match="gradient norm"):
            with fused.capture(torch.cuda.CUDAGraph()):
                fused(x).sum().backward()
                fused.step(max_grad_norm=1.0)
        fused.close()


@needs_gpu
def test_only_the_last_captured_graph_replays():
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        module = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH)).cuda()
        fused = FusedFSDP(module, [module[0]], grad_shards="persistent")
        x = torch.randn(4, WIDTH, device="cuda")

        def step():
            fused(x).sum().backward()
            fused.step()

        step()
        graphs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()]
        for graph in graphs:
            with fused.capture(graph):
                step()
        before = fused.counters().steps
        with pytest.raises(MisuseError, match="last capture"):
            fused.replay(graphs[0])
        assert fused.counters().steps == before
        fused.replay(graphs[1])
        assert fused.counters().steps == before + 1
        # A step left open inside the capture is given up before the capture ends: the
        # engine's error, not CUDA's, and the engine poisoned (its step never ran).
        with pytest.raises(MisuseError):
            with fused.capture(torch.cuda.CUDAGraph()):
                fused(x).sum().backward()
        with pytest.raises(PoisonedError):
            step()
        fused.close()
