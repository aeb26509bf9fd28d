"""Small random models for tests and quick runs: a tiny byte-level BPE tokenizer with a tiny Qwen3,
or a smaller random model of a given config folder's architecture with its tokenizer. Needs only
torch, transformers and tokenizers (no pytest), so tests/make_tiny_model.py can use it anywhere."""

import json
from pathlib import Path

import torch

EOS = "<|endoftext|>"
CORPUS = [
    "You are a helpful math assistant. Answer the question and write the final result on a new line as:",
    "\\boxed{ANSWER} Question: Answer: What is 1 + 1? The answer is \\boxed{2}.",
    "Let x = 3. Then 2x + 1 = 7, so \\boxed{7}. \\frac{1}{2} \\sqrt{2} 0123456789 ()[]{}+-*/=^_",
    "The sum of the roots is 5 and the product is 6, therefore \\boxed{(2, 3)}.",
]


def build_tiny_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.save_pretrained(folder)
    return fast


def build_tiny_qwen3(folder: Path, vocab_size: int, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=2048,
               tie_word_embeddings=True, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    cfg.update(overrides)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**cfg), dtype=torch.float32)
    same_everywhere(model, seed)
    model.save_pretrained(folder)
    return model


def same_everywhere(model, seed: int, std: float = 0.02) -> None:
    """Random weights that every machine draws bit for bit alike: transformers' init (torch's
    normal_) goes through vectorized log/cos kernels that round differently on another CPU
    (ATEN_CPU_CAPABILITY=default vs avx2 give other tiny models). Integers from torch's mt19937,
    each times one float32 constant (a correctly rounded product on every machine), spread as
    transformers' N(0, std) is; norms stay 1."""
    g = torch.Generator().manual_seed(seed)
    scale = std * 3 ** 0.5 / 2 ** 15  # uniform on [-sqrt(3) std, sqrt(3) std]: standard deviation std
    with torch.no_grad():
        for p in model.parameters():  # a tied embedding once
            if p.dim() >= 2:
                p.copy_(torch.randint(-2 ** 15, 2 ** 15, p.shape, generator=g).float() * scale)


def build_like(folder: Path, like: Path, layers: int = 2, hidden: int | None = None, seed: int = 0):
    """A random model of `like`'s architecture family (its config.json, made smaller) with its
    tokenizer files, e.g. the real Qwen3 tokenizer of ../shared/qwen3-0.6b-base."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    for f in like.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, folder / f.name)
    values = json.loads((like / "config.json").read_text())
    values.update(num_hidden_layers=layers, max_window_layers=layers)
    values.pop("layer_types", None)  # derived from num_hidden_layers
    if hidden:
        values.update(hidden_size=hidden, intermediate_size=3 * hidden, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=hidden // 4)
    cfg = AutoConfig.for_model(values.pop("model_type"), **values)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    same_everywhere(model, seed)
    model.save_pretrained(folder)
