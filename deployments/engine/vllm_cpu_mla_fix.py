"""Correct RoPE for DeepSeek-style MLA models on vLLM 0.32's CPU build (a vLLM general plugin).

Root cause of both CPU MLA defects in docs/architectures.md (batched steps not batch-invariant;
prefill with cached context diverging): not the MLA attention backend but the CPU rotary
embedding kernel ``torch.ops._C.rotary_embedding`` (csrc/cpu/pos_encoding.cpp), reached through
``vllm._custom_ops.rotary_embedding`` from ``RotaryEmbedding.forward_cpu``
(vllm/model_executor/layers/rotary_embedding/base.py). That kernel only understands the 2-D
layout ``[num_tokens, num_heads * head_size]`` (unit last stride, any row stride): it takes
``num_heads = x.size(-1) // head_size`` and the token stride from ``x.stride(-2)``.
The MLA layer (vllm/model_executor/layers/mla.py, ``rotary_emb(positions, q[..., nope:], k_pe)``)
passes 3-D views instead:

* ``q_pe``: ``[T, H, rope]`` with strides ``(H * qk_head_dim, qk_head_dim, 1)``. The kernel sees one
  "head" and walks ``T`` rows of stride ``qk_head_dim``: it rotates only the first ``T`` (token, head)
  slots in flattened order, slot ``i`` with ``positions[i]`` (the position of another token), and
  leaves every other head unrotated.
* ``k_pe``: ``[T, 1, rope]``, a view into the ``kv_a`` projection with token stride
  ``kv_lora_rank + rope`` but ``stride(-2) == rope``. The kernel rotates token 0 and then writes
  rotated garbage into the latent (``kv_c``) columns of later rows; the real ``k_pe`` of tokens
  ``1..T-1`` stays unrotated (and is cached that way).

So which positions each query head gets depends on how many tokens share the step: outputs depend
on batch composition (and, with the multi-process engine, on how requests happen to be grouped
into steps, hence "different from run to run"), and a prompt whose KV was computed in one step
and then partly reloaded (ExampleConnector / P/D) sees other RoPE than a plain full prefill.
GQA models pass 2-D ``[T, H * D]`` tensors and are unaffected; GPU kernels handle 3-D layouts.

The patch: on CPU, when ``query`` or ``key`` is not 2-D with unit last stride, run the kernel on
contiguous ``[num_tokens, -1]`` copies and copy the result back in place (same in-place contract).
2-D inputs, and any non-CPU tensor, go straight to the original function.

Hook: register ``install`` under ``[project.entry-points."vllm.general_plugins"]`` (it must run in
the process that runs the model; general plugins run in every vLLM process). ``install`` is
idempotent and does nothing (with a warning) off CPU, on another vLLM version, when the wrapper's
signature changed, or when the kernel no longer shows the defect.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

EXPECTED_VLLM_PREFIX = "0.32."
EXPECTED_PARAMS = ("positions", "query", "key", "head_size", "cos_sin_cache", "is_neox",
                   "rope_dim_offset", "inverse")
_PATCH_MARK = "__moe_serve_cpu_mla_rope_fix__"
_original: Callable | None = None


# ---------------------------------------------------------------- pure tensor functions

def reference_rope(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor,
                   is_neox: bool) -> torch.Tensor:
    """Plain-PyTorch RoPE of ``x`` ``[T, H, D]`` (or ``[T, H*D]`` with D = rot_dim), float32 math.

    ``cos_sin_cache`` is ``[max_pos, rot_dim]`` = ``cat(cos, sin)``; the first ``rot_dim`` features
    of every head are rotated, the rest pass through. Returns a new tensor shaped like ``x``.
    """
    rot_dim = cos_sin_cache.shape[-1]
    num_tokens = positions.numel()
    x3 = x.reshape(num_tokens, -1, x.shape[-1] if x.dim() == 3 else rot_dim).float()  # [T, H, D]
    cos, sin = cos_sin_cache.float()[positions.flatten().long()].chunk(2, dim=-1)  # [T, rot/2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = x3[..., :rot_dim], x3[..., rot_dim:]
    if is_neox:
        a, b = rot[..., : rot_dim // 2], rot[..., rot_dim // 2:]
        rot = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return torch.cat([rot, rest], dim=-1).reshape(x.shape).to(x.dtype)


def _kernel_layout_ok(x: torch.Tensor | None) -> bool:
    """The layout the CPU kernel indexes correctly: ``[num_tokens, heads * head_size]``."""
    return x is None or (x.dim() == 2 and x.stride(-1) == 1)


def make_fixed_rotary_embedding(original: Callable) -> Callable:
    """Wrap ``vllm._custom_ops.rotary_embedding`` so CPU calls with 3-D / strided views are exact."""

    @functools.wraps(original)
    def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                         head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool,
                         rope_dim_offset: int = 0, inverse: bool = False) -> None:
        num_tokens = positions.numel()
        if (query.device.type != "cpu" or num_tokens == 0
                or (_kernel_layout_ok(query) and _kernel_layout_ok(key))
                or query.numel() % num_tokens or (key is not None and key.numel() % num_tokens)):
            return original(positions, query, key, head_size, cos_sin_cache, is_neox,
                            rope_dim_offset, inverse)
        # [T, H, D] views -> private contiguous [T, H*D] rows, which the kernel indexes correctly.
        q2 = query.reshape(num_tokens, -1).clone(memory_format=torch.contiguous_format)
        k2 = None if key is None else key.reshape(num_tokens, -1).clone(
            memory_format=torch.contiguous_format)
        original(positions, q2, k2, head_size, cos_sin_cache, is_neox, rope_dim_offset, inverse)
        query.copy_(q2.view(query.shape))
        if key is not None:
            key.copy_(k2.view(key.shape))
        return None

    setattr(rotary_embedding, _PATCH_MARK, True)
    return rotary_embedding


def kernel_mishandles_3d(rope_fn: Callable) -> bool:
    """Run ``rope_fn`` on a tiny MLA-shaped input; True when it disagrees with the reference."""
    gen = torch.Generator().manual_seed(0)
    rot_dim, num_tokens, heads = 16, 3, 2
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    freqs = torch.outer(torch.arange(16, dtype=torch.float64), inv_freq)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()  # [16, rot_dim]
    positions = torch.tensor([5, 6, 7])
    q_full = torch.randn(num_tokens, heads, 8 + rot_dim, generator=gen)  # nope 8 + rope 16
    latent = torch.randn(num_tokens, 32 + rot_dim, generator=gen)  # kv_c 32 + k_pe 16
    q, k = q_full[..., 8:], latent[:, 32:].unsqueeze(1)
    want_q, want_k = reference_rope(positions, q, cache, False), reference_rope(positions, k, cache, False)
    rope_fn(positions, q, k, rot_dim, cache, False)
    return not (torch.allclose(q, want_q, atol=1e-5) and torch.allclose(k, want_k, atol=1e-5))


# ---------------------------------------------------------------- install

def install() -> bool:
    """Patch ``vllm._custom_ops.rotary_embedding`` in this process; True when the fix is active."""
    global _original
    try:
        import vllm
        from vllm import _custom_ops as ops
        from vllm.platforms import current_platform
    except Exception as exc:  # noqa: BLE001 - never break vLLM start-up from a plugin
        logger.warning("cpu_mla_fix: vLLM not importable (%s); not patching", exc)
        return False
    current = getattr(ops, "rotary_embedding", None)
    if current is not None and getattr(current, _PATCH_MARK, False):
        return True
    if not current_platform.is_cpu():
        return False  # GPU kernels take [T, H, D] views; nothing to fix
    version = getattr(vllm, "__version__", "?")
    if not version.startswith(EXPECTED_VLLM_PREFIX):
        logger.warning("cpu_mla_fix: written for vLLM %sx, found %s; not patching",
                       EXPECTED_VLLM_PREFIX, version)
        return False
    try:
        params = tuple(inspect.signature(current).parameters) if current is not None else ()
    except (TypeError, ValueError):
        params = ()
    if params != EXPECTED_PARAMS:
        logger.warning("cpu_mla_fix: vllm._custom_ops.rotary_embedding%s is not the expected %s; "
                       "not patching", params, EXPECTED_PARAMS)
        return False
    try:
        broken = kernel_mishandles_3d(current)
    except Exception as exc:  # noqa: BLE001
        logger.warning("cpu_mla_fix: probing the CPU rotary kernel failed (%s); not patching", exc)
        return False
    if not broken:
        logger.info("cpu_mla_fix: the CPU rotary kernel handles [T, H, D] views; not patching")
        return False
    fixed = make_fixed_rotary_embedding(current)
    if kernel_mishandles_3d(fixed):
        logger.warning("cpu_mla_fix: the wrapped CPU rotary kernel still disagrees with the "
                       "reference; not patching")
        return False
    _original = current
    ops.rotary_embedding = fixed
    logger.info("cpu_mla_fix: patched vllm._custom_ops.rotary_embedding for [T, H, D] views on CPU")
    return True


def uninstall() -> None:
    """Restore the original function (tests)."""
    global _original
    if _original is None:
        return
    from vllm import _custom_ops as ops

    ops.rotary_embedding = _original
    _original = None
