"""The KV pool's key space identifies the checkpoint, not only the model path: weights replaced at
the same path, another quantization, hf_overrides or rope settings, or another vLLM must not
load KV stored by the old one (the pool's master outlives engines). Identical engines, on any
node, must still agree, or the pool never hits.

The key-space tests go through engine_wiring.key_space with a hand-built vLLM config (plain
namespaces with the fields it reads); the fingerprint's own rules are tested on plain values."""

import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from kv_transfer.pool import engine_wiring
from kv_transfer.pool.store import PoolSettings

BLOCK_HASH = bytes(range(32))


def write_checkpoint(directory: Path, weights: bytes = b"\x01" * 4096, config: str = '{"model_type": "qwen3"}') -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(config)
    (directory / "model-00001-of-00002.safetensors").write_bytes(weights)
    (directory / "model-00002-of-00002.safetensors").write_bytes(b"\x02" * 1024)
    (directory / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (directory / "tokenizer.json").write_text("{}")  # not weights: never part of the key
    return directory


def vllm_config(model: Path | str, *, quantization=None, hf_overrides=None, rope_theta=1e6, load_format="auto"):
    """The parts of a VllmConfig that key_space reads."""
    text_config = SimpleNamespace(rope_theta=rope_theta, rope_scaling=None)
    return SimpleNamespace(
        model_config=SimpleNamespace(model=str(model), dtype="bfloat16", revision=None, quantization=quantization,
                                     hf_overrides=hf_overrides if hf_overrides is not None else {},
                                     hf_config=text_config, hf_text_config=text_config),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto", prefix_caching_hash_algo="sha256"),
        load_config=SimpleNamespace(load_format=load_format, download_dir=None),
        parallel_config=SimpleNamespace(tensor_parallel_size=1))


KV_CACHE_CONFIG = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec="FullAttentionSpec(block_size=16)")])


def key(config) -> str:
    """The pool key of one block under this engine's key space."""
    return engine_wiring.key_space(PoolSettings(key_prefix="app"), config, KV_CACHE_CONFIG).key(BLOCK_HASH, 0)


# -- through key_space ---------------------------------------------------------------------------


def test_identical_engines_get_identical_keys(tmp_path):
    model = write_checkpoint(tmp_path / "m")
    assert key(vllm_config(model)) == key(vllm_config(model))


def test_a_quantization_change_changes_the_key_space(tmp_path):
    model = write_checkpoint(tmp_path / "m")
    assert key(vllm_config(model, quantization="fp8")) != key(vllm_config(model))
    assert key(vllm_config(model, quantization="fp8")) != key(vllm_config(model, quantization="awq"))


def test_weights_replaced_at_the_same_path_change_the_key_space(tmp_path):
    model = write_checkpoint(tmp_path / "m")
    before = key(vllm_config(model))
    time.sleep(0.05)  # a replacement comes later than the original (file times tick every few ms)
    (model / "model-00001-of-00002.safetensors").write_bytes(b"\x07" * 4096)  # same name, same size
    assert key(vllm_config(model)) != before


def test_hf_overrides_rope_and_config_changes_change_the_key_space(tmp_path):
    model = write_checkpoint(tmp_path / "m")
    base = key(vllm_config(model))
    assert key(vllm_config(model, hf_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})) != base
    assert key(vllm_config(model, rope_theta=5e5)) != base
    write_checkpoint(model, config='{"model_type": "qwen3", "num_hidden_layers": 2}')
    assert key(vllm_config(model)) != base


def test_the_vllm_version_is_part_of_the_key_space(tmp_path, monkeypatch):
    import vllm

    model = write_checkpoint(tmp_path / "m")
    base = key(vllm_config(model))
    monkeypatch.setattr(vllm, "__version__", vllm.__version__ + ".post1")
    assert key(vllm_config(model)) != base


# -- what identifies the weights ----------------------------------------------------------------------


def test_a_copy_that_keeps_mtimes_shares_the_key_space(tmp_path):
    """Engines on two nodes (rsync -a, a shared file system) read copies with equal mtimes."""
    model = write_checkpoint(tmp_path / "node-a" / "m")
    copy = tmp_path / "node-b" / "m"
    shutil.copytree(model, copy)  # copy2: keeps mtimes
    fingerprint = lambda path: engine_wiring.checkpoint(vllm_config(path))  # noqa: E731
    assert fingerprint(model) == fingerprint(copy)


def hub_snapshot(cache: Path, weights: bytes, blob_name: str) -> Path:
    """The Hub cache's layout: snapshot files link to blobs named after their content's hash."""
    blobs, snapshot = cache / "blobs", cache / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (blobs / blob_name).write_bytes(weights)
    os.symlink(f"../../blobs/{blob_name}", snapshot / "model.safetensors")
    (snapshot / "config.json").write_text("{}")
    return snapshot


def test_hub_cache_weights_count_by_blob_hash_not_mtime(tmp_path):
    from kv_transfer.pool.keys import checkpoint_fingerprint

    blob = "a" * 64
    one = hub_snapshot(tmp_path / "node-a", b"\x01" * 512, blob)
    time.sleep(0.05)
    two = hub_snapshot(tmp_path / "node-b", b"\x01" * 512, blob)  # downloaded later: another mtime
    other = hub_snapshot(tmp_path / "node-c", b"\x02" * 512, "b" * 64)  # other content, same size
    (weights,), _, _ = engine_wiring.weight_files(one)
    assert weights.version == f"blob:{blob}"
    fingerprint = lambda path: checkpoint_fingerprint(engine_wiring.checkpoint(vllm_config(path)))  # noqa: E731
    assert fingerprint(one) == fingerprint(two) != fingerprint(other)


def test_only_weights_files_config_and_index_are_read(tmp_path):
    model = write_checkpoint(tmp_path / "m")
    weights, config, index = engine_wiring.weight_files(model)
    assert [w.name for w in weights] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert [w.size_bytes for w in weights] == [4096, 1024]
    assert config == b'{"model_type": "qwen3"}' and index == b'{"weight_map": {}}'


def test_weights_id_names_the_weights_instead_of_their_files(tmp_path):
    from kv_transfer.pool.keys import checkpoint_fingerprint

    a = engine_wiring.checkpoint(vllm_config(write_checkpoint(tmp_path / "a")), weights_id="release-7")
    time.sleep(0.05)
    b = engine_wiring.checkpoint(vllm_config(write_checkpoint(tmp_path / "b")), weights_id="release-7")
    assert a.weights != b.weights  # other mtimes
    assert checkpoint_fingerprint(a) == checkpoint_fingerprint(b)
    assert checkpoint_fingerprint(a) != checkpoint_fingerprint(replace(a, weights_id="release-8"))


def test_unlisted_weights_still_key_on_the_rest(tmp_path, caplog):
    """A Hub id that is not in the local cache (or a remote loader): warn, and key on the rest."""
    from kv_transfer.pool.keys import checkpoint_fingerprint

    config = vllm_config("no-such-org/no-such-model-xyz")
    assert engine_wiring.checkpoint(config).weights == ()
    assert "set the pool's weights_id" in caplog.text
    assert checkpoint_fingerprint(engine_wiring.checkpoint(config)) != checkpoint_fingerprint(
        engine_wiring.checkpoint(vllm_config("no-such-org/no-such-model-xyz", quantization="fp8")))


# -- the fingerprint on plain values ------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("quantization", "fp8"), ("hf_overrides", {"num_experts": 8}), ("rope", {"rope_theta": 1.0}),
    ("load_format", "dummy"), ("vllm_version", "0.33.0"), ("config_json", b"{ }"), ("weights_index_json", b"[]"),
])
def test_every_field_of_the_checkpoint_changes_the_fingerprint(field, value):
    from kv_transfer.pool.keys import Checkpoint, WeightFile, checkpoint_fingerprint

    base = Checkpoint((WeightFile("m.safetensors", 10, "mtime_ns:1"),), b"{}", b"", None, {}, {}, "auto", "0.32.0")
    assert checkpoint_fingerprint(base) == checkpoint_fingerprint(replace(base))
    assert checkpoint_fingerprint(replace(base, **{field: value})) != checkpoint_fingerprint(base)
    for weights in [(WeightFile("m.safetensors", 11, "mtime_ns:1"),), (WeightFile("m.safetensors", 10, "mtime_ns:2"),)]:
        assert checkpoint_fingerprint(replace(base, weights=weights)) != checkpoint_fingerprint(base)


def test_a_callable_hf_overrides_fingerprints_the_same_in_every_process():
    """Its repr holds an address that differs per process: the scheduler and the workers (other
    processes) would then key the same blocks differently and never find each other's."""
    script = ("from kv_transfer.pool.keys import Checkpoint, checkpoint_fingerprint\n"
              "def overrides(config):\n"
              "    return config\n"
              "print(checkpoint_fingerprint(Checkpoint((), hf_overrides=overrides)))\n")
    root = Path(__file__).resolve().parents[3]
    outputs = {subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip() for _ in range(3)}
    assert len(outputs) == 1, outputs
