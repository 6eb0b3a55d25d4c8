"""CPU MLA RoPE fix: vLLM 0.32's CPU rotary kernel vs a plain-PyTorch reference, on MLA's views.

DeepSeek's MLA layer calls ``rotary_emb(positions, q[..., nope:], k_pe)`` with 3-D views
(``q_pe`` [T, H, rope] inside [T, H, nope + rope]; ``k_pe`` [T, 1, rope] inside the
[T, kv_lora_rank + rope] projection). No engines: small tensors, the real kernel.
"""

import pytest
import torch

import vllm
from deployments.engine import vllm_cpu_mla_fix as fix
from vllm import _custom_ops as ops
from vllm.platforms import current_platform

pytestmark = pytest.mark.skipif(not current_platform.is_cpu(), reason="CPU kernel only")

NOPE, ROPE, KV_LORA, HEADS = 32, 64, 512, 4  # tiny-deepseek-v3's MLA dims


def _cache(rot_dim: int = ROPE, max_pos: int = 4096) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()  # [max_pos, rot_dim]


def _mla_inputs(num_tokens: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4000, (num_tokens,), generator=gen)
    q = torch.randn(num_tokens, HEADS, NOPE + ROPE, generator=gen).to(dtype)  # q_b_proj output
    kv_lora = torch.randn(num_tokens, KV_LORA + ROPE, generator=gen).to(dtype)  # kv_a output
    return positions, q, kv_lora


def _run(rope_fn, positions, q, kv_lora, is_neox):
    """Apply rope_fn the way vllm/model_executor/layers/mla.py does; return the expected views."""
    cache = _cache().to(q.dtype)
    q_pe, k_pe = q[..., NOPE:], kv_lora[:, KV_LORA:].unsqueeze(1)
    want_q = fix.reference_rope(positions, q_pe, cache, is_neox)
    want_k = fix.reference_rope(positions, k_pe, cache, is_neox)
    q_nope, kv_c = q[..., :NOPE].clone(), kv_lora[:, :KV_LORA].clone()
    rope_fn(positions, q_pe, k_pe, ROPE, cache, is_neox)
    return (q_pe, want_q), (k_pe, want_k), (q[..., :NOPE], q_nope), (kv_lora[:, :KV_LORA], kv_c)


@pytest.fixture(autouse=True)
def _restore():
    # Each test starts from vLLM's own kernel: the fix is a vLLM general plugin, so any test in
    # this process that built a vLLM config (the ingress's front end does) has installed it.
    fix.uninstall()
    original = ops.rotary_embedding
    yield
    fix.uninstall()
    ops.rotary_embedding = original


def _max_err(pair):
    got, want = pair
    return (got.float() - want.float()).abs().max().item()


@pytest.mark.skipif(not vllm.__version__.startswith(fix.EXPECTED_VLLM_PREFIX),
                    reason="documents vLLM 0.32's kernel")
@pytest.mark.parametrize("is_neox", [False, True])
def test_unpatched_kernel_rotates_mla_views_wrongly(is_neox):
    positions, q, kv_lora = _mla_inputs(5)
    q_pair, k_pair, nope_pair, kv_c_pair = _run(ops.rotary_embedding, positions, q, kv_lora, is_neox)
    assert _max_err(q_pair) > 0.1  # heads rotated with other tokens' positions, or not at all
    assert _max_err(k_pair) > 0.1  # k_pe of tokens 1.. left unrotated
    assert _max_err(kv_c_pair) > 0.1  # and rotated garbage written into the latent columns
    assert fix.kernel_mishandles_3d(ops.rotary_embedding)


@pytest.mark.parametrize("num_tokens", [1, 2, 17, 121])
@pytest.mark.parametrize("is_neox", [False, True])
def test_patched_kernel_matches_reference_on_mla_views(num_tokens, is_neox):
    assert fix.install()
    positions, q, kv_lora = _mla_inputs(num_tokens, seed=num_tokens)
    q_pair, k_pair, nope_pair, kv_c_pair = _run(ops.rotary_embedding, positions, q, kv_lora, is_neox)
    assert _max_err(q_pair) < 1e-5
    assert _max_err(k_pair) < 1e-5
    assert torch.equal(*nope_pair)  # q_nope untouched
    assert torch.equal(*kv_c_pair)  # kv_c untouched


def test_patched_kernel_bfloat16():
    assert fix.install()
    positions, q, kv_lora = _mla_inputs(9, dtype=torch.bfloat16)
    q_pair, k_pair, _, kv_c_pair = _run(ops.rotary_embedding, positions, q, kv_lora, False)
    assert _max_err(q_pair) < 5e-2 and _max_err(k_pair) < 5e-2
    assert torch.equal(*kv_c_pair)


def test_result_does_not_depend_on_batch_composition():
    """The defect's symptom: one request's rows alone vs inside a batch of three."""
    assert fix.install()
    positions, q, kv_lora = _mla_inputs(30)
    lens = [7, 11, 12]
    positions = torch.cat([torch.arange(n) for n in lens])
    batched_q, batched_kv = q.clone(), kv_lora.clone()
    ops.rotary_embedding(positions, batched_q[..., NOPE:], batched_kv[:, KV_LORA:].unsqueeze(1), ROPE,
                         _cache(), False)
    start = 0
    for n in lens:
        alone_q, alone_kv = q[start:start + n].clone(), kv_lora[start:start + n].clone()
        ops.rotary_embedding(positions[start:start + n], alone_q[..., NOPE:],
                             alone_kv[:, KV_LORA:].unsqueeze(1), ROPE, _cache(), False)
        assert torch.equal(batched_q[start:start + n], alone_q)
        assert torch.equal(batched_kv[start:start + n], alone_kv)
        start += n


def test_two_dimensional_layout_goes_straight_to_the_kernel():
    original = ops.rotary_embedding
    assert fix.install()
    gen = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 4000, (6,), generator=gen)
    qkv = torch.randn(6, (HEADS + 2) * ROPE, generator=gen)  # GQA: q, k views of one row
    a, b = qkv.clone(), qkv.clone()
    original(positions, a[:, : HEADS * ROPE], a[:, HEADS * ROPE: (HEADS + 1) * ROPE], ROPE, _cache(), True)
    ops.rotary_embedding(positions, b[:, : HEADS * ROPE], b[:, HEADS * ROPE: (HEADS + 1) * ROPE], ROPE,
                         _cache(), True)
    assert torch.equal(a, b)
    want = fix.reference_rope(positions, qkv[:, : HEADS * ROPE], _cache(), True)
    assert (b[:, : HEADS * ROPE] - want).abs().max().item() < 1e-5


def test_install_is_idempotent_and_uninstall_restores():
    original = ops.rotary_embedding
    assert fix.install() and fix.install()
    patched = ops.rotary_embedding
    assert patched is not original and fix._original is original
    fix.uninstall()
    assert ops.rotary_embedding is original


def test_install_refuses_other_vllm_versions(monkeypatch):
    original = ops.rotary_embedding
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    assert not fix.install()
    assert ops.rotary_embedding is original


def test_install_refuses_changed_signature(monkeypatch):
    def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, new_arg=None):
        raise AssertionError("must not be called")

    monkeypatch.setattr(ops, "rotary_embedding", rotary_embedding)
    assert not fix.install()
    assert ops.rotary_embedding is rotary_embedding


def test_install_skips_a_kernel_that_is_already_correct(monkeypatch):
    def correct(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset=0,
                inverse=False):
        query.copy_(fix.reference_rope(positions, query, cos_sin_cache, is_neox))
        if key is not None:
            key.copy_(fix.reference_rope(positions, key, cos_sin_cache, is_neox))

    monkeypatch.setattr(ops, "rotary_embedding", correct)
    assert not fix.install()
    assert ops.rotary_embedding is correct


def test_install_does_nothing_off_cpu(monkeypatch):
    original = ops.rotary_embedding
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    assert not fix.install()
    assert ops.rotary_embedding is original
