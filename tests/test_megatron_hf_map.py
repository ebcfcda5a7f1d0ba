"""HF <-> Megatron weight map (pure tensor functions; no megatron-core process state)."""

from types import SimpleNamespace

import pytest
import torch

from trainer.training.backends.megatron import hf_map


def _hf(model_type="qwen3", heads=4, kv=2, d=8, hidden=16, tied=True, **kw):
    return SimpleNamespace(model_type=model_type, num_attention_heads=heads,
                           num_key_value_heads=kv, head_dim=d, hidden_size=hidden,
                           intermediate_size=24, num_hidden_layers=2, rms_norm_eps=1e-6,
                           vocab_size=10, max_position_embeddings=64, hidden_act="silu",
                           rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
                           tie_word_embeddings=tied, **kw)


def test_fused_qkv_is_grouped_per_kv_head():
    hf = _hf(heads=4, kv=2, d=1)
    # Row r of q is query head r (d=1), k/v rows are kv heads: values label them.
    q = torch.tensor([[0.], [1.], [2.], [3.]])
    k = torch.tensor([[10.], [11.]])
    v = torch.tensor([[20.], [21.]])
    fused = hf_map.fuse_qkv(hf, q, k, v)
    # group 0: q heads 0,1 then k0, v0; group 1: q heads 2,3 then k1, v1
    assert fused.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    back = hf_map.split_qkv(hf, fused)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


@pytest.mark.parametrize("tp", [1, 2])
def test_tensor_parallel_shards_round_trip(tp):
    hf = _hf(heads=4, kv=2, d=8, hidden=16)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * 8, 16, generator=g) for n in (4, 2, 2))
    qkv = hf_map.fuse_qkv(hf, q, k, v)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    shards = [hf_map.shard(name, qkv, r, tp) for r in range(tp)]
    # Each TP rank holds whole query groups: [q of its heads, k, v] of its kv heads.
    if tp == 2:
        sq, sk, sv = hf_map.split_qkv(_hf(heads=2, kv=1, d=8, hidden=16), shards[1])
        assert torch.equal(sq, q[16:]) and torch.equal(sk, k[8:]) and torch.equal(sv, v[8:])
    assert torch.equal(hf_map.unshard(name, shards), qkv)
    fc1 = torch.randn(48, 16, generator=g)  # [gate; up]
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    shards = [hf_map.shard(name, fc1, r, tp) for r in range(tp)]
    if tp == 2:  # rank 1 = [gate rows 12:24; up rows 36:48]
        assert torch.equal(shards[1], torch.cat([fc1[12:24], fc1[36:48]]))
    assert torch.equal(hf_map.unshard(name, shards), fc1)
    proj = torch.randn(16, 32, generator=g)
    name = "decoder.layers.1.self_attention.linear_proj.weight"
    assert torch.equal(hf_map.unshard(name, [hf_map.shard(name, proj, r, tp) for r in range(tp)]),
                       proj)


@pytest.mark.parametrize("model_type,tied", [("qwen3", True), ("qwen2", False), ("llama", False)])
def test_every_hf_tensor_maps_back(model_type, tied):
    hf = _hf(model_type=model_type, tied=tied, attention_bias=model_type == "qwen2")
    names = hf_map.megatron_names(hf, te_names=False, layers=range(2), pre_process=True,
                                  post_process=True)
    covered = [n for mg in names for n in hf_map.hf_names_of(mg, te_names=False, tied=tied)]
    assert len(covered) == len(set(covered))
    assert ("lm_head.weight" in covered) == (not tied)
    assert ("model.layers.1.self_attn.q_norm.weight" in covered) == (model_type == "qwen3")
    assert ("model.layers.0.self_attn.q_proj.bias" in covered) == (model_type == "qwen2")
    kwargs = hf_map.transformer_config_kwargs(hf)
    assert kwargs["qk_layernorm"] == (model_type == "qwen3")
    assert kwargs["add_qkv_bias"] == (model_type == "qwen2")
    # TE names fuse the pre-attention/pre-MLP norms into the linear layers.
    te = hf_map.megatron_names(hf, te_names=True, layers=[0], pre_process=False,
                               post_process=False)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te


def test_padded_vocab_is_dropped_on_export():
    hf = _hf()
    emb = torch.randn(10, 16)
    padded = hf_map.to_megatron(hf, "embedding.word_embeddings.weight", [emb], 12)
    assert padded.shape == (12, 16) and torch.equal(padded[:10], emb)
    ((name, back),) = hf_map.to_hf(hf, "embedding.word_embeddings.weight", padded,
                                   te_names=False, tied=True)
    assert name == "model.embed_tokens.weight" and torch.equal(back, emb)


def test_unsupported_architecture_is_named():
    with pytest.raises(NotImplementedError, match="gpt2"):
        hf_map.transformer_config_kwargs(_hf(model_type="gpt2"))


# ---------------------------------------------------------------------- Qwen3.5
def _q35(heads=4, kv=2, d=8, hidden=16, layers=("linear_attention", "full_attention")):
    hf = _hf(model_type="qwen3_5_text", heads=heads, kv=kv, d=d, hidden=hidden,
             layer_types=list(layers))
    hf.rope_parameters["partial_rotary_factor"] = 0.25
    return hf


def test_gated_qkv_is_grouped_queries_then_gates():
    """Qwen3.5's q_proj rows are per head [query; gate]; Megatron's gated linear_qkv is per
    query group [its queries, their gates, key, value] (transformer/attention.py)."""
    hf = _q35(heads=4, kv=2, d=1)
    # q_proj row 2h is query head h, row 2h + 1 its gate (d=1).
    q = torch.tensor([[0.], [100.], [1.], [101.], [2.], [102.], [3.], [103.]])
    k, v = torch.tensor([[10.], [11.]]), torch.tensor([[20.], [21.]])
    fused = hf_map.fuse_qkv(hf, q, k, v)
    assert fused.flatten().tolist() == [0, 1, 100, 101, 10, 20, 2, 3, 102, 103, 11, 21]
    assert all(torch.equal(a, b) for a, b in zip(hf_map.split_qkv(hf, fused), (q, k, v)))


@pytest.mark.parametrize("tp", [1, 2])
def test_gated_qkv_shards_keep_whole_query_groups(tp):
    hf = _q35(heads=4, kv=2, d=8, hidden=16)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 16, generator=g) for n in (4 * 2 * 8, 2 * 8, 2 * 8))
    qkv = hf_map.fuse_qkv(hf, q, k, v)
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    shards = [hf_map.shard(name, qkv, r, tp) for r in range(tp)]
    if tp == 2:  # rank 1: query heads 2, 3 with their gates, kv head 1
        sq, sk, sv = hf_map.split_qkv(_q35(heads=2, kv=1, d=8, hidden=16), shards[1])
        assert torch.equal(sq, q[32:]) and torch.equal(sk, k[8:]) and torch.equal(sv, v[8:])
    assert torch.equal(hf_map.unshard(name, shards), qkv)


def test_every_qwen3_5_text_tensor_maps_back(tiny_qwen3_5_path):
    """Each tensor of tiny-qwen3_5's text model is covered once: Gated DeltaNet tensors
    under self_attention (replicated over TP), gated attention, (1 + w) norms, tied head;
    the config asks Megatron for the output gate, q/k norms and a quarter of each head
    rotated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.from_pretrained(tiny_qwen3_5_path).get_text_config()
    names = hf_map.megatron_names(hf, te_names=False, layers=range(hf.num_hidden_layers),
                                  pre_process=True, post_process=True)
    covered = [n for mg in names for n in hf_map.hf_names_of(mg, te_names=False, tied=True)]
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_path)
    assert sorted(covered) == sorted(n for n, _ in model.named_parameters())
    assert "decoder.layers.0.self_attention.A_log" in names
    assert all(hf_map.tp_split_dim(n) is None for n in names if ".self_attention." in n
               and "linear_" not in n and "layernorm" not in n)
    kwargs = hf_map.transformer_config_kwargs(hf)
    assert kwargs["attention_output_gate"] and kwargs["qk_layernorm"]
    assert hf_map.model_kwargs(hf, 512)["rotary_percent"] == 0.25
