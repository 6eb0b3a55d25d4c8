"""Tiny MoE checkpoints, built locally with a fixed seed (nothing is fetched from a hub).

A checkpoint is a real Hugging Face directory: ``config.json``, ``model.safetensors``, a
byte-level BPE tokenizer trained on a small built-in corpus, and a ChatML chat template.
vLLM's ordinary loader loads it, so the whole serving path (tokenizer, chat template, MoE
layers, KV cache) is exercised exactly as with a production checkpoint, only smaller.

Weights are random, so greedy outputs are gibberish, but they are deterministic: the same
prompt gives the same token ids on every engine, which is what the equality tests rely on.

    python -m cluster.checkpoints --all          # build every known checkpoint if missing
    python -m cluster.checkpoints tiny-mixtral   # build one
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cluster.settings import checkpoint_root

BUILTIN_SCHEME = "builtin://"
_FINGERPRINT_FILE = "moe_serve_fingerprint.json"
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, the template family of Qwen models; vLLM and transformers both render it with jinja.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A small English corpus for the tokenizer: enough merges that prompts are a few characters
# per token, like a real tokenizer, so "512 tokens" means a realistic amount of text.
_CORPUS = """
Mixture of experts models route each token to a few experts out of many.
Prefill processes the whole prompt at once and produces the key value cache.
Decode generates one token at a time and reads the key value cache of every previous token.
Serving large language models on many accelerators needs careful scheduling and placement.
The quick brown fox jumps over the lazy dog while the cluster autoscaler adds replicas.
Latency targets for time to first token and inter token latency define the service level.
Ray Serve deployments scale replicas across the nodes of a cluster.
Prometheus scrapes metrics and Grafana draws dashboards for operators.
Tell me a story about a robot who learns to paint the sea at night.
What is the capital of France? Paris is the capital and largest city of France.
Explain how a transformer attends to earlier tokens using queries keys and values.
One two three four five six seven eight nine ten eleven twelve.
"""


@dataclass(frozen=True)
class TinyCheckpointSpec:
    """Everything that determines a tiny checkpoint's bytes (hashed into its fingerprint)."""

    name: str
    model_type: str  # a transformers model type that vLLM 0.32 CPU loads
    config: dict = field(default_factory=dict)
    vocab_size: int = 1024
    seed: int = 0
    # Std of the random routing correction bias (noaux_tc routers). transformers initialises
    # it to zeros, under which a router that ignored the bias would still pick the same
    # experts; a bias as large as the spread of the sigmoid scores changes the choice.
    router_bias_std: float = 0.0

    def fingerprint(self) -> str:
        payload = json.dumps(
            {"model_type": self.model_type, "config": self.config, "vocab": self.vocab_size,
             "seed": self.seed, "template": CHAT_TEMPLATE, "corpus": _CORPUS, "format": 1,
             "router_bias_std": self.router_bias_std},
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


_COMMON = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    # Long enough for long-context work (manifests/local-long-context.yaml serves 32k-token
    # prompts); RoPE's cos/sin table is the only thing that grows with it.
    max_position_embeddings=65536,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

SPECS: dict[str, TinyCheckpointSpec] = {
    spec.name: spec
    for spec in (
        TinyCheckpointSpec(
            name="tiny-qwen3-moe",
            model_type="qwen3_moe",
            config=dict(
                _COMMON,
                head_dim=32,
                intermediate_size=256,
                moe_intermediate_size=64,
                num_experts=8,
                num_experts_per_tok=2,
                decoder_sparse_step=1,
                norm_topk_prob=True,
                mlp_only_layers=[],
            ),
        ),
        TinyCheckpointSpec(
            # DeepSeek-V3's layout at toy width: MLA (one 576-value latent per token and layer,
            # the head size vLLM's CPU MLA backend requires), a low-rank query, a dense first
            # layer, one shared expert, and the grouped sigmoid router with its correction bias
            # (8 experts in 4 groups: each token picks 2 groups, then 2 experts in them).
            name="tiny-deepseek-v3",
            model_type="deepseek_v3",
            config=dict(
                _COMMON,
                num_key_value_heads=4,  # MLA has no KV heads; kept equal to the query heads
                intermediate_size=256,
                moe_intermediate_size=64,
                q_lora_rank=64,
                kv_lora_rank=512,
                qk_rope_head_dim=64,
                qk_nope_head_dim=32,
                v_head_dim=32,
                n_routed_experts=8,
                n_shared_experts=1,
                num_experts_per_tok=2,
                n_group=4,
                topk_group=2,
                topk_method="noaux_tc",  # vLLM creates e_score_correction_bias only for noaux_tc
                scoring_func="sigmoid",
                norm_topk_prob=True,
                routed_scaling_factor=2.5,
                first_k_dense_replace=1,
                moe_layer_freq=1,
                rope_scaling=None,
                # At the default 0.02 this layout's logits are nearly flat and greedy output
                # repeats one token; 0.1 gives varied output, so a wrong KV page shows.
                initializer_range=0.1,
            ),
            router_bias_std=0.05,
        ),
        TinyCheckpointSpec(
            # GLM-4.5's layout (Glm4MoeForCausalLM): GQA with half-rotary heads, QK norm and
            # attention bias, a dense first layer, a shared expert, the grouped sigmoid router.
            name="tiny-glm4-moe",
            model_type="glm4_moe",
            config=dict(
                _COMMON,
                head_dim=32,
                partial_rotary_factor=0.5,
                attention_bias=True,
                use_qk_norm=True,
                intermediate_size=256,
                moe_intermediate_size=64,
                n_routed_experts=8,
                n_shared_experts=1,
                num_experts_per_tok=2,
                n_group=4,
                topk_group=2,
                norm_topk_prob=True,
                routed_scaling_factor=2.5,
                first_k_dense_replace=1,
            ),
            router_bias_std=0.05,
        ),
        TinyCheckpointSpec(
            name="tiny-mixtral",
            model_type="mixtral",
            config=dict(
                _COMMON,
                intermediate_size=64,
                num_local_experts=8,
                num_experts_per_tok=2,
            ),
        ),
    )
}


class UnknownCheckpointError(ValueError):
    pass


def resolve_model_path(path: str, *, build: bool = True) -> Path:
    """Turn a manifest's model path into a directory, building a builtin checkpoint if needed."""
    if path.startswith(BUILTIN_SCHEME):
        name = path[len(BUILTIN_SCHEME):]
        return ensure_checkpoint(name) if build else checkpoint_root() / name
    return Path(path).expanduser().resolve()


def ensure_checkpoint(name: str, root: Path | None = None, *, quiet: bool = False) -> Path:
    """Return the checkpoint directory, (re)building it when missing or stale."""
    if name not in SPECS:
        raise UnknownCheckpointError(
            f"unknown builtin checkpoint {name!r}; known: {', '.join(sorted(SPECS))}"
        )
    return ensure_spec(SPECS[name], root, quiet=quiet)


def ensure_spec(spec: TinyCheckpointSpec, root: Path | None = None, *, quiet: bool = False) -> Path:
    """`ensure_checkpoint` for any spec (a benchmark's variant of a builtin one, say): its
    directory under `root`, (re)built when missing or stale."""
    target = (root or checkpoint_root()) / spec.name
    marker = target / _FINGERPRINT_FILE
    if marker.exists() and json.loads(marker.read_text()).get("fingerprint") == spec.fingerprint():
        return target
    if not quiet:
        print(f"[checkpoints] building {spec.name} in {target}", file=sys.stderr)
    _build(spec, target)
    return target


def _build(spec: TinyCheckpointSpec, target: Path) -> None:
    # Heavy imports stay here: the CLI and manifest validation must not pay for torch.
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    tmp = target.with_name(target.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - len(_SPECIAL_TOKENS),
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS.strip().splitlines() * 4, trainer=trainer)
    bpe.add_special_tokens(_SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=spec.config["max_position_embeddings"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp)

    config = AutoConfig.for_model(
        spec.model_type,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
        **spec.config,
    )
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if spec.router_bias_std:
        generator = torch.Generator().manual_seed(spec.seed + 1)
        with torch.no_grad():
            for name, bias in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    bias.copy_(torch.randn(bias.shape, generator=generator) * spec.router_bias_std)
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / _FINGERPRINT_FILE).write_text(
        json.dumps({"name": spec.name, "fingerprint": spec.fingerprint()}, indent=2)
    )
    if target.exists():
        import shutil

        shutil.rmtree(target)
    os.replace(tmp, target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"checkpoints to build ({', '.join(SPECS)})")
    parser.add_argument("--all", action="store_true", help="build every builtin checkpoint")
    parser.add_argument("--root", type=Path, default=None, help="output folder (default: $MOE_SERVE_CHECKPOINTS)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    names = list(SPECS) if args.all else args.names
    if not names:
        parser.error("name a checkpoint or pass --all")
    for name in names:
        path = ensure_checkpoint(name, args.root, quiet=args.quiet)
        if not args.quiet:
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
