"""Local stand-ins the tests build themselves: a tiny byte-level BPE tokenizer and a tiny random
Qwen3, written to a temp folder and loaded back through the product's real from_pretrained code."""

import functools
import getpass
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from tiny_models import EOS, build_like, build_tiny_qwen3, build_tiny_tokenizer  # noqa: E402,F401

# torch.compile's on-disk cache does not key its code by the CPU kernels ATEN_CPU_CAPABILITY picks: code cached in
# a run under one capability and reloaded under another computed NaN and 1e32 logits (the trainer's check against
# eager decoding caught it and fell back; the compiled-path tests failed). One cache per capability, unless the
# caller chose a folder.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_aten_{os.environ['ATEN_CPU_CAPABILITY']}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    tok = build_tiny_tokenizer(folder)
    assert tok.convert_tokens_to_ids(EOS) == 0
    build_tiny_qwen3(folder, vocab_size=len(tok))
    return folder


@pytest.fixture(scope="session")
def tiny_data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "problems.json"
    records = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i), "level": "Level 1"} for i in range(12)]
    path.write_text(json.dumps(records))
    return path


@pytest.fixture()
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(tiny_model_dir))


@functools.cache
def inductor_problem() -> str | None:
    """Why torch.compile cannot build for the CPU here, or None: no C++ compiler, or inductor's generated
    C++ fails to compile (seen under ATEN_CPU_CAPABILITY=default on one machine: "'at::vec' has not been
    declared"). The trainer falls back to eager then, as designed; the tests of the compiled path skip."""
    if shutil.which("g++") is None:
        return "torch.compile on the CPU needs a C++ compiler (g++)"
    try:
        probe = torch.compile(lambda x: (x.sin() * 2 + 1).sum(dim=-1), dynamic=False)
        probe(torch.arange(256, dtype=torch.float32).reshape(4, 64))
    except Exception as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        errors = [line.split("error:", 1)[1].strip() for line in lines if "error:" in line]
        why = errors[0] if errors else lines[-1] if lines else ""
        return f"torch.compile's C++ (inductor) does not build on this machine ({type(e).__name__}: {why[:160]})"
    return None


@functools.cache
def bf16_attention_problem() -> str | None:
    """Why bfloat16 attention does not run on this CPU under the kernels chosen, or None. Seen with torch 2.13
    under ATEN_CPU_CAPABILITY=default and =avx2 on a CPU with AMX: from about 64 positions its flash kernel packs
    the operands for AMX (the CPU has it) with a routine built per capability, which a forced capability below
    avx512 refuses ("pack_vnni2 is only supported when avx512 is supported"). No real CPU pairs AMX with those
    kernels, so the bf16 tests skip there, with the reason, rather than test the override."""
    q = torch.zeros(1, 2, 96, 16, dtype=torch.bfloat16)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    except RuntimeError as e:
        return f"bfloat16 attention fails with these CPU kernels (torch {torch.__version__}: {str(e)[:100]})"
    return None


@pytest.fixture()
def bf16_attention():
    """A test that runs bfloat16 attention: skipped, with the reason, where it cannot run (above)."""
    problem = bf16_attention_problem()
    if problem:
        pytest.skip(problem)


@pytest.fixture()
def inductor():
    """A test of the compiled decode path: skipped, with the reason, where inductor cannot build."""
    problem = inductor_problem()
    if problem:
        pytest.skip(problem)
