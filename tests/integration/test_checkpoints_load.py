"""Tiny checkpoints load in vLLM's real loader and generate deterministically. (Qwen3-MoE is
exercised by every other integration test and DeepSeek-V3 by test_architectures.py; this covers
Mixtral, and GLM-4.5, whose P/D and expert-parallel runs are in the extended tier.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.conftest import REPO

pytestmark = pytest.mark.integration

SMOKE = """
import json, os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    # float32, as every CPU manifest: vLLM 0.32's bf16 CPU kernels die now and then with SIGILL
    # on AMX machines (2 of 3 runs of this script on one), and this test is about the layout.
    llm = LLM(model=sys.argv[1], enforce_eager=True, max_model_len=512, gpu_memory_utilization=0.15,
              dtype="float32")
    greedy = SamplingParams(temperature=0, max_tokens=8)
    runs = [llm.generate(["Mixture of experts"] * 2, greedy, use_tqdm=False) for _ in range(2)]
    print("RESULT " + json.dumps([[list(o.outputs[0].token_ids) for o in run] for run in runs]), flush=True)
"""


@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-glm4-moe"])
def test_a_tiny_checkpoint_loads_in_vllm_and_is_deterministic(tmp_path, name):
    from cluster.checkpoints import ensure_checkpoint

    path = ensure_checkpoint(name, quiet=True)
    script = tmp_path / "smoke.py"
    script.write_text(SMOKE)
    result = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True,
                            timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    runs = json.loads(line[len("RESULT "):])
    assert len(runs[0][0]) == 8
    assert runs[0][0] == runs[0][1] == runs[1][0] == runs[1][1]
