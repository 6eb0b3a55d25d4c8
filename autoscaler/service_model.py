"""How long one replica takes to prefill a prompt and to run one decode step, and two
calibrations. Approximations for comparing policies, not predictions of a real deployment.

Model:
    prefill_s(prompt)  = prefill_base_s + prefill_s_per_token * prompt      (one prompt at a time)
    decode_step_s(b)   = decode_base_s + decode_per_seq_s * b              (b running sequences,
                                                                            one token each per step)
    kv_transfer_s      = kv_transfer_s_per_token * prompt                  (prefill -> decode hop)
A decode replica admits a sequence when it runs fewer than max_batch and its KV cache can hold
the whole sequence (prompt + output reserved up front, so the model needs no preemption).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServiceModel:
    name: str
    prefill_base_s: float
    prefill_s_per_token: float
    decode_base_s: float
    decode_per_seq_s: float
    max_batch: int  # sequences one decode replica runs at once (vLLM max_num_seqs)
    kv_capacity_tokens: int  # per decode replica
    kv_transfer_s_per_token: float
    replica_startup_s: float  # from placement to serving (weights load, warm-up)

    def prefill_s(self, prompt_tokens: int) -> float:
        return self.prefill_base_s + self.prefill_s_per_token * prompt_tokens

    def decode_step_s(self, batch: int) -> float:
        return self.decode_base_s + self.decode_per_seq_s * batch

    def kv_transfer_s(self, prompt_tokens: int) -> float:
        return self.kv_transfer_s_per_token * prompt_tokens


# The tiny Qwen3-MoE checkpoint (4 layers, hidden 128, 8 experts top-2) on this project's
# 2-core CPU box, from BENCHMARKS.md: TTFT p50 ~140-250 ms for ~1k-token prompts, ITL p50
# ~25-31 ms at a handful of sequences; our TCP KV transport moves ~1.5-2.8 GB/s, and a tiny-model
# token is a few KiB of KV (hence ~4 us/token). Startup: Ray actor + vLLM CPU engine ~40 s.
# max_batch 16 and the 512k-token KV cache mirror the local manifest (1 GiB of KV).
CPU_TINY_MODEL = ServiceModel(
    name="cpu-tiny-qwen3-moe",
    prefill_base_s=0.020,
    prefill_s_per_token=0.3e-3,
    decode_base_s=0.025,
    decode_per_seq_s=0.001,
    max_batch=16,
    kv_capacity_tokens=524_288,
    kv_transfer_s_per_token=4e-6,
    replica_startup_s=40.0,
)

# DeepSeek-V3 (671B MoE, FP8) on H200 nodes. A prefill replica is one node (8 GPUs, EP8); a
# decode replica is an expert-parallel group of 16 GPUs (2 nodes). Published reference points,
# for orientation only: DeepSeek's inference-system overview (Feb 2025) reports ~73.7k input
# tok/s per H800 node in prefill (cache hits included) and ~14.8k output tok/s per node in decode
# at ~20 tok/s per user (TPOT ~50 ms), using very large EP (EP144 decode); LMSYS's SGLang PD +
# large-scale EP write-up (May 2025) reports ~52k input and ~22k output tok/s per H100 node for
# 2k-token inputs. We assume a smaller vLLM deployment does much worse per node:
#   prefill 0.05 ms/token per node (~20k tok/s) + 30 ms fixed;
#   decode step 25 ms + 0.1 ms per running sequence: 31 ms at batch 64, 51 ms at 256
#   (~5k output tok/s per 2-node group at full batch);
#   MLA KV ~70 KB/token (61 layers x 576 values x 2 bytes) over RDMA at ~25 GB/s: ~3 us/token;
#   KV capacity per group: ~1 TB left after FP8 weights on 16 x 141 GB, kept to 4M tokens for
#   activations and CUDA graphs;
#   startup 300 s: loading ~700 GB of weights from node-local NVMe plus CUDA graph capture.
H200_DEEPSEEK_V3 = ServiceModel(
    name="h200-deepseek-v3",
    prefill_base_s=0.030,
    prefill_s_per_token=0.05e-3,
    decode_base_s=0.025,
    decode_per_seq_s=0.1e-3,
    max_batch=256,
    kv_capacity_tokens=4_000_000,
    kv_transfer_s_per_token=3e-6,
    replica_startup_s=300.0,
)
