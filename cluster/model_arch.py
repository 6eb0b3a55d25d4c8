"""A checkpoint's architecture from its Hugging Face `config.json` alone: parameter counts and
KV cache bytes per token. Pure: a dict in, numbers out (no torch, no files).

Covers the MoE families moe-serve serves: DeepSeek-V2/V3 (`deepseek_v2`, `deepseek_v3`: MLA,
shared experts, dense first layers), GLM-4.5 (`glm4_moe`: GQA, partial rotary, shared experts),
Qwen3-MoE (`qwen3_moe`) and Mixtral (`mixtral`); dense layers and attention are counted for any
Llama-like config. Rules:

- Attention. MLA (a config with `kv_lora_rank`) caches one latent of kv_lora_rank +
  qk_rope_head_dim values per token and layer, shared by all heads, so tensor parallelism
  replicates it on every rank. GQA caches K and V: 2 x kv_heads x head_dim per token and layer,
  split over tensor-parallel ranks (at least one KV head per rank, as vLLM replicates heads
  when TP exceeds their number).
- MoE layers. DeepSeek/GLM: layer i is MoE when i >= first_k_dense_replace and
  i % moe_layer_freq == 0. Qwen3-MoE: when i is not in mlp_only_layers and
  (i + 1) % decoder_sparse_step == 0. Mixtral: every layer.
- Not counted: the multi-token-prediction layers (`num_nextn_predict_layers`), which vLLM loads
  only for speculative decoding, and biases of the rare configs that have them on MLPs.
- FP8 checkpoints (`quantization_config.quant_method == "fp8"`): linear weights of attention
  and MLPs are 1 byte, plus one float32 scale per 128 x 128 block; embeddings, the LM head,
  norms and routers keep the checkpoint dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
_FP8_BLOCK = 128 * 128  # elements per float32 scale in DeepSeek-style block FP8


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by how they are placed: dense (every rank of an EP group holds them) and
    routed experts (split over an EP group). `linear_*`: the share in quantizable matmuls."""

    dense: int
    routed_experts: int
    linear_dense: int
    linear_routed: int

    @property
    def total(self) -> int:
        return self.dense + self.routed_experts


@dataclass(frozen=True)
class Architecture:
    model_type: str
    num_layers: int
    moe_layers: int
    num_experts: int | None  # routed experts per MoE layer
    experts_per_token: int | None
    shared_experts: int
    mla: bool
    kv_heads: int
    head_dim: int
    kv_latent: int  # MLA: kv_lora_rank + qk_rope_head_dim values per token and layer; else 0
    quantization: str | None  # "fp8" when the checkpoint's linear weights are FP8
    params: ParamCounts

    @property
    def attention(self) -> str:
        return f"MLA ({self.kv_latent}-value latent)" if self.mla else f"GQA ({self.kv_heads} KV heads x {self.head_dim})"

    def kv_bytes_per_token(self, element_bytes: int, tensor_parallel: int = 1) -> int:
        """KV cache bytes one token takes on one rank (all layers)."""
        if self.mla:
            return self.num_layers * self.kv_latent * element_bytes
        heads = max(1, self.kv_heads // max(tensor_parallel, 1))
        return self.num_layers * 2 * heads * self.head_dim * element_bytes

    def weight_bytes(self, element_bytes: int, quantization: str | None = None) -> tuple[int, int]:
        """(all weights, the routed experts' share) in bytes. `quantization` overrides the
        checkpoint's (e.g. vLLM's online fp8 of a bf16 checkpoint)."""
        quant = quantization or self.quantization
        p = self.params
        if quant != "fp8":
            return p.total * element_bytes, p.routed_experts * element_bytes
        routed = p.linear_routed + -(-p.linear_routed // _FP8_BLOCK) * 4 + (p.routed_experts - p.linear_routed) * element_bytes
        dense = p.linear_dense + -(-p.linear_dense // _FP8_BLOCK) * 4 + (p.dense - p.linear_dense) * element_bytes
        return dense + routed, routed


class ArchitectureError(ValueError):
    """A config.json this module cannot read (the message names the missing key)."""


def read_architecture(config: dict) -> Architecture:
    config = config.get("text_config", config)
    try:
        return _read(config)
    except KeyError as exc:
        raise ArchitectureError(f"config.json has no {exc.args[0]!r}, which the plan needs") from exc


def _read(c: dict) -> Architecture:
    model_type = str(c.get("model_type", ""))
    hidden, layers, vocab = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["vocab_size"])
    heads = int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    mla = c.get("kv_lora_rank") is not None
    attn_linear, attn_other = (_mla_attention(c, hidden, heads) if mla
                               else _gqa_attention(c, hidden, heads, kv_heads, head_dim))

    experts = c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts")
    experts = int(experts) if experts else None
    moe = [i for i in range(layers) if experts and _is_moe_layer(c, model_type, i)]
    expert_inter = int(c.get("moe_intermediate_size") or c["intermediate_size"])
    shared = int(c.get("n_shared_experts") or 0)
    shared_inter = shared * expert_inter or int(c.get("shared_expert_intermediate_size") or 0)
    dense_mlp = 3 * hidden * int(c["intermediate_size"])
    routed = len(moe) * (experts or 0) * 3 * hidden * expert_inter
    shared_mlp = len(moe) * 3 * hidden * shared_inter
    router = len(moe) * (experts or 0) * (hidden + (1 if c.get("topk_method") == "noaux_tc"
                                                    or model_type == "glm4_moe" else 0))
    embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings") else 2)
    norms = layers * 2 * hidden + hidden
    linear_dense = layers * attn_linear + (layers - len(moe)) * dense_mlp + shared_mlp
    dense = linear_dense + layers * attn_other + router + embeddings + norms
    quant = c.get("quantization_config") or {}
    return Architecture(
        model_type=model_type, num_layers=layers, moe_layers=len(moe), num_experts=experts,
        experts_per_token=int(c["num_experts_per_tok"]) if c.get("num_experts_per_tok") else None,
        shared_experts=shared, mla=mla, kv_heads=kv_heads, head_dim=head_dim,
        kv_latent=int(c["kv_lora_rank"]) + int(c["qk_rope_head_dim"]) if mla else 0,
        quantization="fp8" if quant.get("quant_method") == "fp8" else None,
        params=ParamCounts(dense=dense, routed_experts=routed, linear_dense=linear_dense, linear_routed=routed),
    )


def _mla_attention(c: dict, hidden: int, heads: int) -> tuple[int, int]:
    """(linear params, other params) of one MLA layer."""
    nope, rope, v = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
    kv_lora, q_lora = int(c["kv_lora_rank"]), c.get("q_lora_rank")
    q = hidden * int(q_lora) + int(q_lora) * heads * (nope + rope) if q_lora else hidden * heads * (nope + rope)
    linear = q + hidden * (kv_lora + rope) + kv_lora * heads * (nope + v) + heads * v * hidden
    norms = kv_lora + (int(q_lora) if q_lora else 0)
    return linear, norms


def _gqa_attention(c: dict, hidden: int, heads: int, kv_heads: int, head_dim: int) -> tuple[int, int]:
    linear = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    other = (heads + 2 * kv_heads) * head_dim if c.get("attention_bias") else 0
    if c.get("use_qk_norm") or c.get("model_type") == "qwen3_moe":
        other += 2 * head_dim
    return linear, other


def _is_moe_layer(c: dict, model_type: str, i: int) -> bool:
    if "first_k_dense_replace" in c or model_type.startswith(("deepseek", "glm4_moe")):
        return i >= int(c.get("first_k_dense_replace") or 0) and i % int(c.get("moe_layer_freq") or 1) == 0
    if model_type == "qwen3_moe" or "decoder_sparse_step" in c:
        return i not in (c.get("mlp_only_layers") or []) and (i + 1) % int(c.get("decoder_sparse_step") or 1) == 0
    return True  # Mixtral and other all-MoE layouts
