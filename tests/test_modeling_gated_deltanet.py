"""rollout.modeling.gated_deltanet: Qwen3.5's Gated DeltaNet over packed sequences, with
initial and final states, against transformers' own torch fallback.

Tolerances: fp32 comparisons use 1e-5; each test also measures the fp32 result against the
same computation in fp64 and asserts that noise is below the tolerance (measured here on an
AMD EPYC: 8e-8 for the rule's outputs, 3e-7 for its state, 6e-9 for a whole layer; this
implementation and transformers' differ by 0 and 2e-10), so the bound is float noise, not
slack a wrong implementation could hide in (a leaked conv token or a dropped state changes
outputs by 1e-2 .. 1).
"""

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from rollout.modeling import gated_deltanet as gdn

ATOL = 1e-5


@pytest.fixture(scope="module")
def layer(tiny_qwen3_5_path):
    """Layer 0 (Gated DeltaNet) of tiny-qwen3_5, with its (1 + w) gated norm weights and
    decay parameters perturbed off their init so every term matters."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_path, dtype=torch.float32)
    module = model.model.layers[0].linear_attn
    assert isinstance(module, hf.Qwen3_5GatedDeltaNet)
    torch.manual_seed(1)
    with torch.no_grad():
        module.norm.weight.add_(0.1 * torch.randn_like(module.norm.weight))
        module.dt_bias.add_(0.3 * torch.randn_like(module.dt_bias))
        module.conv1d.weight.mul_(4.0)  # the conv's reach across tokens dominates a leak
    return module


def _rule_inputs(b, t, dtype=torch.float32, hk=2, hv=4, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, hk, d, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(b, t, hv, d, generator=g, dtype=dtype)
    decay = -0.5 * torch.rand(b, t, hv, generator=g, dtype=dtype)
    beta = torch.rand(b, t, hv, generator=g, dtype=dtype)
    h0 = 0.1 * torch.randn(b, hv, d, d, generator=g, dtype=dtype)
    return q, k, v, decay, beta, h0


def test_chunk_rule_equals_transformers_fallback():
    # 150 tokens: two whole chunks of 64 and a partial one; GVA (2 key heads, 4 value heads).
    q, k, v, g, beta, h0 = _rule_inputs(2, 150)
    ref_o, ref_s = hf.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    o64, s64 = gdn.chunk_gated_delta_rule(*(x.double() for x in (q, k, v, g, beta)),
                                          initial_state=h0.double())
    assert (o.double() - o64).abs().max() < ATOL and (s.double() - s64).abs().max() < ATOL
    assert (o - ref_o).abs().max() <= ATOL and (s - ref_s).abs().max() <= ATOL
    # The token-by-token recurrence is the same rule.
    state, outs = h0, []
    for i in range(q.shape[1]):
        out, state = gdn.recurrent_gated_delta_rule_step(q[:, i], k[:, i], v[:, i], g[:, i],
                                                         beta[:, i], state)
        outs.append(out)
    assert (torch.stack(outs, 1) - ref_o).abs().max() <= ATOL
    assert (state - ref_s).abs().max() <= ATOL


def test_conv_equals_transformers_fallback_and_returns_the_last_inputs():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 9, 16, generator=g), torch.randn(16, 4, generator=g)
    ref = hf.causal_conv1d_fn(x.transpose(1, 2), w, None, activation="silu").transpose(1, 2)
    y, state = gdn.causal_conv1d(x, w)
    assert (y - ref).abs().max() <= ATOL
    assert torch.equal(state, x[:, -3:].transpose(1, 2))


def test_layer_equals_transformers_module(layer):
    torch.manual_seed(2)
    hidden = torch.randn(2, 100, layer.hidden_size)
    with torch.no_grad():
        ref = layer(hidden)
        out, _ = gdn.gated_deltanet(layer, hidden)
        out64, _ = gdn.gated_deltanet(layer.double(), hidden.double())
        layer.float()
    assert (out.double() - out64).abs().max() < ATOL  # the float noise is below the bound
    assert (out - ref).abs().max() <= ATOL


def _random_states(layer, n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return gdn.GDNState(torch.randn(n, layer.conv_dim, 3, generator=g),
                        0.1 * torch.randn(n, layer.num_v_heads, layer.head_k_dim,
                                          layer.head_v_dim, generator=g))


def test_packed_sequences_equal_each_sequence_alone(layer):
    # Lengths below the conv's reach (1, 2), across a chunk boundary (70) and several chunks.
    lengths = [1, 70, 2, 130, 5]
    cu = torch.tensor([0] + lengths).cumsum(0)
    torch.manual_seed(4)
    hidden = torch.randn(1, int(cu[-1]), layer.hidden_size)
    for states in (None, _random_states(layer, len(lengths))):
        with torch.no_grad():
            out, final = gdn.gated_deltanet(layer, hidden, cu_seqlens=cu, initial_state=states)
            for i in range(len(lengths)):
                own = None if states is None else gdn.GDNState(*(s[i:i + 1] for s in states))
                alone, fin = gdn.gated_deltanet(layer, hidden[:, cu[i]:cu[i + 1]],
                                                initial_state=own)
                assert (out[:, cu[i]:cu[i + 1]] - alone).abs().max() <= ATOL
                assert (final.conv[i] - fin.conv[0]).abs().max() <= ATOL
                assert (final.recurrent[i] - fin.recurrent[0]).abs().max() <= ATOL


def test_a_state_continues_the_sequence_it_came_from(layer):
    """Prefill in two parts (split inside the conv's reach, at a chunk edge, anywhere) or
    decode token by token: the same outputs and final state as one pass."""
    torch.manual_seed(5)
    hidden = torch.randn(2, 80, layer.hidden_size)
    with torch.no_grad():
        whole, final = gdn.gated_deltanet(layer, hidden)
        for split in (1, 2, 64, 79):
            first, state = gdn.gated_deltanet(layer, hidden[:, :split])
            rest, end = gdn.gated_deltanet(layer, hidden[:, split:], initial_state=state)
            assert (torch.cat([first, rest], 1) - whole).abs().max() <= ATOL
            assert all((a - b).abs().max() <= ATOL for a, b in zip(end, final))
        state = gdn.empty_state(layer, 2, dtype=hidden.dtype)
        steps = []
        for i in range(hidden.shape[1]):
            out, state = gdn.gated_deltanet_step(layer, hidden[:, i], state)
            steps.append(out)
    assert (torch.stack(steps, 1) - whole).abs().max() <= ATOL
    assert all((a - b).abs().max() <= ATOL for a, b in zip(state, final))


def test_gradients_flow_through_a_shared_prefix_state(layer):
    """A prefix run once whose final state seeds two packed suffixes gives the gradients of
    running prefix + suffix as one sequence per sample (fp64: exact up to rounding)."""
    layer = layer.double()
    try:
        torch.manual_seed(6)
        prefix = torch.randn(1, 9, layer.hidden_size, dtype=torch.float64)
        suffixes = [torch.randn(1, n, layer.hidden_size, dtype=torch.float64) for n in (3, 70)]
        weights = [torch.randn(1, s.shape[1], layer.hidden_size, dtype=torch.float64)
                   for s in suffixes]

        def grads(loss):
            params = [prefix, *suffixes, *layer.parameters()]
            return torch.autograd.grad(loss, params)

        for t in (prefix, *suffixes):
            t.requires_grad_(True)
        _, state = gdn.gated_deltanet(layer, prefix)
        seeded = gdn.GDNState(*(s.expand(2, *s.shape[1:]) for s in state))
        cu = torch.tensor([0, 3, 73])
        out, _ = gdn.gated_deltanet(layer, torch.cat(suffixes, 1), cu_seqlens=cu,
                                    initial_state=seeded)
        shared = grads((out * torch.cat(weights, 1)).sum())
        separate = 0
        for s, w in zip(suffixes, weights):
            full, _ = gdn.gated_deltanet(layer, torch.cat([prefix, s], 1))
            separate = separate + (full[:, prefix.shape[1]:] * w).sum()
        alone = grads(separate)
        assert shared[0].abs().max() > 0  # the prefix does get a gradient through the state
        for a, b in zip(shared, alone):
            assert (a - b).abs().max() <= 1e-9 * max(1.0, b.abs().max())
    finally:
        layer.float()


def test_in_place_step_and_smaller_chunks_compute_the_same_rule(layer):
    """The engine's forms of the rule: the in-place decode step equals the functional step
    (state and output, fp32 within the fp64-measured noise), and a prefill in 16-token
    chunks equals one in 64-token chunks, over packed rows from initial states."""
    q, k, v, g, beta, h0 = _rule_inputs(5, 1)
    want_o, want_s = gdn.recurrent_gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0],
                                                         beta[:, 0], h0)
    state = h0.clone()
    o = gdn.recurrent_gated_delta_rule_step_(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0],
                                             state)
    state64 = h0.double()
    o64 = gdn.recurrent_gated_delta_rule_step_(*(x[:, 0].double() for x in (q, k, v, g, beta)),
                                               state64)
    assert (o.double() - o64).abs().max() < ATOL and (state.double() - state64).abs().max() < ATOL
    assert (o - want_o).abs().max() < ATOL and (state - want_s).abs().max() < ATOL
    hidden = torch.randn(1, 40, layer.hidden_size, generator=torch.Generator().manual_seed(4))
    cu = torch.tensor([0, 13, 20, 40])
    start = _random_states(layer, 3)
    out64, end64 = gdn.gated_deltanet(layer, hidden, cu_seqlens=cu, initial_state=start)
    out16, end16 = gdn.gated_deltanet(layer, hidden, cu_seqlens=cu, initial_state=start,
                                      chunk_size=16)
    assert (out16 - out64).abs().max() < ATOL
    assert (end16.recurrent - end64.recurrent).abs().max() < ATOL
    assert torch.equal(end16.conv, end64.conv)
    # A layer step in place leaves the states the functional step returns.
    step_state = gdn.GDNState(end64.conv.clone(), end64.recurrent.clone())
    out_step = gdn.gated_deltanet_step_(layer, hidden[0, :3], step_state)
    want_out, want_state = gdn.gated_deltanet_step(layer, hidden[0, :3], end64)
    assert (out_step - want_out).abs().max() < ATOL
    assert torch.equal(step_state.conv, want_state.conv)
    assert (step_state.recurrent - want_state.recurrent).abs().max() < ATOL
