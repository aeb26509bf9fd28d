"""Local stand-ins the tests build themselves: a tiny byte-level BPE tokenizer and a tiny random
Qwen3, written to a temp folder and loaded back through the product's real from_pretrained code."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from tiny_models import EOS, build_like, build_tiny_qwen3, build_tiny_tokenizer  # noqa: E402,F401


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
