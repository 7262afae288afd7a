"""Hugging Face DeepSeek-V4 generating with our compressor (``dsv4_compressor.integrations.transformers``).

The model is a tiny random ``DeepseekV4Config`` (hidden 32, three layers: HCA at r = 8, CSA at r = 4 with its
indexer, one sliding-window layer; a 6-token sliding window so the compressed entries carry the history; DeepSeek's
YaRN on the compressor rope) whose position biases and compressor norm weights are randomized (HF initializes them
to 0 and 1, which would hide a wrong APE row or norm weight). It is compared with itself running its own eager
compressor:

* entries: each compressor module on the same inputs, streamed as prefill chunks then single decode rows, its
  cache's entries (HCA, CSA and indexer) after every call, its returned tensor and block bias, for every HCA
  backend; float32 tight (see ``ENTRY_TOL``), bfloat16 within its rounding (``BF16_TOL``);
* ``generate``: greedy, a batch of two prompts (one left-padded), 8 new tokens: the tokens equal, every step's
  logits within ``LOGIT_TOL``, and the final cache's entries; ``disable()`` brings the eager compressor back bit
  for bit; beam search, whose ``reorder_cache`` our states follow; training is refused.

Tiny tensors run single-threaded here: on a loaded 2-core machine OpenMP threads cost ~15 ms per op and nothing
is gained from them.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers", minversion="5.24")

from helpers.session import interpreting  # noqa: E402
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, DynamicCache  # noqa: E402

from dsv4_compressor.integrations import transformers as dc_hf  # noqa: E402

if interpreting():
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("the kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

HCA_RATIO, CSA_RATIO = 8, 4
PROMPT, NEW_TOKENS = 9, 8  # the forwards see positions 0..15: the last one (a decode row) closes both ratios
#: prefill chunks (groups close inside them, open rows carry over), then decode rows, the last closing both ratios
CHUNKS = (5, 6, 1, 1, 1, 1)
POSITIONS = sum(CHUNKS)

#: float32 entries (RMS-normalized, values up to ~4): ours and the eager compressor differ only in float32
#: summation order (softmax and weighted sum over <= 8 rows, the mean of squares over H channels, the rotation):
#: a few ulps (seen: 9.5e-7 absolute); a real difference (a rope position off by one: 0.8) is far larger.
ENTRY_TOL = dict(rtol=1e-5, atol=1e-5)
#: bfloat16: the eager compressor rounds the pooled sum, the normalized entry and the rotated entry to bf16 in
#: turn, we round once at the end: an ulp or two apart (seen: 1 ulp, 0.0156 at values in [2, 4)).
BF16_TOL = dict(rtol=2**-7, atol=2**-6)
#: logits (values up to ~4): the entries' float32 differences pass through three layers of attention, MoE and
#: hyper-connections (seen: 3.2e-6); the greedy choices are decided by >= 2.4e-2 (checked: > 10x this), and a
#: rope position off by one changes the generated tokens.
LOGIT_TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_config() -> DeepseekV4Config:
    return DeepseekV4Config(
        vocab_size=64, hidden_size=32, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        head_dim=128, partial_rotary_factor=0.5,  # rope 64, nope 64: one FP8 block (the ops' latent shape rule)
        q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
        mlp_layer_types=["moe"] * 3,
        compress_rates={"compressed_sparse_attention": CSA_RATIO, "heavily_compressed_attention": HCA_RATIO},
        hc_mult=2, sliding_window=6, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=64, index_topk=2,
        max_position_embeddings=256, initializer_range=0.2,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                         "beta_slow": 1},
        pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )  # fmt: skip


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = DeepseekV4ForCausalLM(tiny_config()).eval().to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("position_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif "compressor" in name and name.endswith("kv_norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
    yield m
    dc_hf.disable(m)


def compressors(m):
    return [(i, layer.self_attn.compressor) for i, layer in enumerate(m.model.layers) if layer.self_attn.compressor]


def stream_compressors(m, chunks=CHUNKS, batch=2, seed=2, layers=None):
    """Each compressor module (of ``layers``, default all) on the same random inputs, chunk by chunk, as the
    attention calls it (the cache's sliding-window update first). Returns, per call, ``(layer, output tuple,
    {stream: entries})``."""
    gen = torch.Generator().manual_seed(seed)
    dtype = next(m.parameters()).dtype
    total = sum(chunks)
    hidden = torch.randn(batch, total, m.config.hidden_size, generator=gen).to(DEVICE, dtype)
    q_residual = torch.randn(batch, total, m.config.q_lora_rank, generator=gen).to(DEVICE, dtype)
    cache = DynamicCache(config=m.config)
    calls = []
    start = 0
    for n in chunks:
        positions = torch.arange(start, start + n, device=DEVICE)[None].expand(batch, -1)
        for i, module in compressors(m):
            if layers is not None and i not in layers:
                continue
            window = hidden.new_zeros(batch, 1, n, m.config.head_dim)
            cache.layers[i].update(window, window)
            with torch.no_grad():
                out = module(hidden[:, start : start + n], q_residual[:, start : start + n], positions, cache, i)
            entries = {name: t.clone() for name, t in cache.layers[i].compressed_kv.items()}
            calls.append((i, out, entries))
        start += n
    return calls


def assert_same_calls(eager, ours, tol):
    assert len(eager) == len(ours)
    for (i, out_e, ent_e), (j, out_o, ent_o) in zip(eager, ours):
        assert i == j and ent_e.keys() == ent_o.keys() == ({"compressor"} if i == 0 else {"compressor", "indexer"})
        for name in ent_e:
            assert ent_o[name].dtype == ent_e[name].dtype and ent_o[name].shape == ent_e[name].shape
            torch.testing.assert_close(
                ent_o[name], ent_e[name], **tol, msg=lambda m, i=i, name=name: f"layer {i} {name}: {m}"
            )
        kv_e, bias_e = out_e
        kv_o, bias_o = out_o
        assert kv_o.shape == kv_e.shape and kv_o.dtype == kv_e.dtype
        torch.testing.assert_close(kv_o, kv_e, **tol)
        assert (bias_e is None) == (bias_o is None)
        if bias_e is not None:  # causality, and for CSA the indexer's top-k picks
            assert torch.equal(bias_o, bias_e), f"layer {i}: block bias differs"


def test_entries_match_eager(model):
    """HCA (online backend, the default), CSA and indexer entries, streamed; then the stateless call (no cache:
    one call, positions from 0)."""
    eager = stream_compressors(model)
    assert eager[-2][2]["compressor"].shape[1] == POSITIONS // HCA_RATIO  # each step calls layer 0, then 1
    assert eager[-1][2]["indexer"].shape[1] == POSITIONS // CSA_RATIO
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(1, 9, model.config.hidden_size, generator=gen).to(DEVICE)
    q_residual = torch.randn(1, 9, model.config.q_lora_rank, generator=gen).to(DEVICE)
    positions = torch.arange(9, device=DEVICE)[None]
    with torch.no_grad():
        stateless_e = [m(hidden, q_residual, positions, None, i) for i, m in compressors(model)]
    assert dc_hf.enable(model) == 2 and dc_hf.is_enabled(model)
    try:
        ours = stream_compressors(model)
        with torch.no_grad():
            stateless_o = [m(hidden, q_residual, positions, None, i) for i, m in compressors(model)]
    finally:
        assert dc_hf.disable(model) == 2
    assert_same_calls(eager, ours, ENTRY_TOL)
    for (kv_e, bias_e), (kv_o, bias_o) in zip(stateless_e, stateless_o):
        assert kv_e.shape[2] > 0
        torch.testing.assert_close(kv_o, kv_e, **ENTRY_TOL)
        assert torch.equal(bias_o, bias_e)


@pytest.mark.parametrize("hca_backend", [b for b in dc_hf.HCA_BACKENDS if b != "online"])
def test_hca_ring_backends_match_eager(model, hca_backend):
    """The ring kernels for HCA: the two-stage C128 kernel (``tiled``) and the single-stage one."""
    eager = stream_compressors(model, layers=(0,))
    dc_hf.enable(model, hca_backend=hca_backend)
    try:
        ours = stream_compressors(model, layers=(0,))
    finally:
        dc_hf.disable(model)
    assert_same_calls(eager, ours, ENTRY_TOL)


def test_entries_match_eager_bf16(model):
    """A bfloat16 model (position biases and norm weights kept float32, as ``_keep_in_fp32_modules_strict``
    loads them): bf16 entries, within bf16 rounding of the eager ones."""
    m = copy.deepcopy(model).to(torch.bfloat16)
    for _, module in compressors(m):
        for c in (module, getattr(module, "indexer", None)):
            if c is not None:
                c.position_bias.data = c.position_bias.data.float()
                c.kv_norm.weight.data = c.kv_norm.weight.data.float()
    eager = stream_compressors(m, batch=1)
    dc_hf.enable(m)
    ours = stream_compressors(m, batch=1)
    assert ours[-1][2]["compressor"].dtype == torch.bfloat16
    assert_same_calls(eager, ours, BF16_TOL)


def generate(m, input_ids, attention_mask, **kwargs):
    with torch.no_grad():
        return m.generate(input_ids, attention_mask=attention_mask, do_sample=False, return_dict_in_generate=True,
                          output_logits=True, **kwargs)  # fmt: skip


def prompts(batch, seed):
    ids = torch.randint(2, 64, (batch, PROMPT), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if batch > 1:  # the second prompt is 3 tokens shorter, left-padded
        ids[1, :3], mask[1, :3] = 0, 0
    return ids.to(DEVICE), mask.to(DEVICE)


def test_generate_matches_eager(model):
    ids, mask = prompts(2, seed=3)
    eager = generate(model, ids, mask, max_new_tokens=NEW_TOKENS)
    # every step's greedy choice is decided by far more than the tolerance: equal tokens mean something
    margins = torch.stack([step.topk(2).values.diff(dim=-1).abs().squeeze(-1) for step in eager.logits])
    assert margins.min() > 10 * LOGIT_TOL, margins.min()
    dc_hf.enable(model)
    try:
        ours = generate(model, ids, mask, max_new_tokens=NEW_TOKENS)
    finally:
        dc_hf.disable(model)
    assert torch.equal(ours.sequences, eager.sequences)
    assert len(ours.logits) == len(eager.logits) == NEW_TOKENS
    for step, (lo, le) in enumerate(zip(ours.logits, eager.logits)):
        torch.testing.assert_close(lo, le, rtol=0, atol=LOGIT_TOL, msg=lambda m, step=step: f"step {step}: {m}")
    positions = PROMPT + NEW_TOKENS - 1
    for i, _ in compressors(model):
        for name, entries in eager.cache.layers[i].compressed_kv.items():
            ours_entries = ours.cache.layers[i].compressed_kv[name]
            ratio = HCA_RATIO if i == 0 else CSA_RATIO
            assert ours_entries.shape == entries.shape == (2, positions // ratio, entries.shape[-1])
            assert ours.cache.layers[i].entry_count[name] == positions // ratio
            # the compressors' inputs differ by what earlier layers' entries changed (float32 level)
            torch.testing.assert_close(ours_entries, entries, rtol=0, atol=LOGIT_TOL)
    again = generate(model, ids, mask, max_new_tokens=NEW_TOKENS)  # disabled: the eager compressor, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(again.logits, eager.logits))


def test_beam_search_matches_eager(model):
    """Beam search reorders the cache's batch between steps (``reorder_cache``): our states follow. With this
    prompt the two beams swap slots (their histories cross), so the reorder permutes distinct states."""
    ids, mask = prompts(1, seed=7)
    kwargs = dict(max_new_tokens=4, num_beams=2, num_return_sequences=2, output_scores=True)
    eager = generate(model, ids, mask, **kwargs)
    histories = eager.beam_indices[:, :3]
    assert (histories[0] != histories[1]).sum() >= 2 and (histories[0] == 1).any() and (histories[1] == 0).any()
    dc_hf.enable(model)
    try:
        ours = generate(model, ids, mask, **kwargs)
    finally:
        dc_hf.disable(model)
    assert torch.equal(ours.sequences, eager.sequences)
    assert torch.equal(ours.beam_indices, eager.beam_indices)
    torch.testing.assert_close(ours.sequences_scores, eager.sequences_scores, rtol=0, atol=LOGIT_TOL)


def test_training_refused(model):
    """The op has no backward: a forward with gradients enabled is refused instead of silently losing them."""
    ids, _ = prompts(1, seed=6)
    dc_hf.enable(model)
    try:
        with pytest.raises(RuntimeError, match="inference"):
            model(ids[:, :4], use_cache=False)
    finally:
        dc_hf.disable(model)
    assert not dc_hf.is_enabled(model)
