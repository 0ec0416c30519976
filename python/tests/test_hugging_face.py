"""A transformers model trained through the client at world size 2 goes back to transformers:
the sharded checkpoint exported to safetensors loads with `from_pretrained`, the full state dict
with `load_state_dict`, each into a plain model that computes the wrapper's logits, the tied
embedding stored once as transformers stores it."""

from __future__ import annotations

import copy

import pytest
import torch
from training import on_ranks

import fsdp_fusion
from fsdp_fusion import FusedFSDP, LocalGroup

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

WORLD, VOCAB, SEQ, BATCH, STEPS = 2, 64, 16, 2, 2


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config).float()


def test_a_model_trained_at_world_size_2_loads_back_into_transformers(tmp_path):
    model = tiny_llama()
    modules = [copy.deepcopy(model) for _ in range(WORLD)]
    group = LocalGroup(WORLD)
    g = torch.Generator().manual_seed(1)
    tokens = [[torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(WORLD)]
              for _ in range(STEPS)]
    probe = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)

    def train(rank):
        m = modules[rank]
        fused = FusedFSDP(m, list(m.model.layers), local_group=group, rank=rank, lr=1e-2,
                          weight_decay=0.1)
        for step in tokens:
            fused(step[rank], labels=step[rank]).loss.backward()
            fused.step()
        with torch.no_grad():
            logits = fused(probe).logits
        fused.save(tmp_path / "saved")
        return fused.full_state_dict(), logits

    (state, logits), (other_state, other_logits) = on_ranks(WORLD, train)
    assert torch.equal(logits, other_logits)
    assert not torch.equal(state["model.embed_tokens.weight"],
                           model.model.embed_tokens.weight), "the steps changed the model"

    # The keys transformers itself writes: the tied head is not stored, it is the embedding.
    model.save_pretrained(tmp_path / "plain")
    want_keys = sorted(safetensors_torch.load_file(str(tmp_path / "plain" / "model.safetensors")))
    exported = tmp_path / "exported"
    model.config.save_pretrained(exported)
    fsdp_fusion.export_checkpoint(tmp_path / "saved", exported / "model.safetensors")
    assert sorted(safetensors_torch.load_file(str(exported / "model.safetensors"))) == want_keys
    # A plain model's own `state_dict()` names the tied head too.
    assert sorted(state) == sorted(tiny_llama().state_dict())
    assert sorted(set(state) - set(want_keys)) == ["lm_head.weight"]
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    for name, value in other_state.items():
        assert torch.equal(value, state[name]), name

    loaded = transformers.LlamaForCausalLM.from_pretrained(exported)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    plain = tiny_llama()
    plain.load_state_dict(state)
    with torch.no_grad():
        for copy_of_model in (loaded, plain):
            for name, p in copy_of_model.named_parameters():
                assert torch.equal(p, state[name]), name
            assert torch.equal(copy_of_model(probe).logits, logits)
