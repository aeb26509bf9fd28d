"""What this machine allows for the CPU stand-in: the LM head's cost in decoding and training.

    python benchmarks/bench_floors.py

Times, on the stand-in of bench_step.py (4 layers, hidden 512, the real 151,936-token vocabulary):
one decode forward of 8 rows with and without the LM head, the LM head alone, the three LM-head
GEMMs of one 128-token response's training pass, a square GEMM and a large copy.
"""
import time
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).resolve().parents[2] / "shared" / "qwen3-0.6b-base"


def timed(fn, n=10):
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def main():
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(CONFIG_DIR)
    for k, v in dict(num_hidden_layers=4, hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                     num_key_value_heads=4, head_dim=64).items():
        setattr(cfg, k, v)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    W = model.lm_head.weight.detach()
    V, H = W.shape
    rows = []
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(torch.randint(0, V, (8, 135)), past_key_values=cache)
        ids = torch.randint(0, V, (8, 1))
        length = cache.get_seq_length()

        def decode(full):
            extra = cache.get_seq_length() - length
            if extra:
                cache.crop(-extra)  # the same cache length at every call
            return model(ids, past_key_values=cache, logits_to_keep=1) if full else model.model(ids, past_key_values=cache)
        rows.append(("decode forward, 8 rows (ms)", timed(lambda: decode(True)) * 1e3, ""))
        rows.append(("  without the LM head (ms)", timed(lambda: decode(False)) * 1e3, ""))
        h8 = torch.randn(8, H)
        rows.append(("  LM head alone, 8 x 512 @ 512 x 151936 (ms)", timed(lambda: h8 @ W.T) * 1e3,
                     f"{W.numel() * 4 / 2**20:.0f} MiB of weights read"))
        h, dl = torch.randn(128, H), torch.randn(128, V)
        flop = 2 * 128 * H * V
        for name, fn in [("training: logits = h @ W.T", lambda: h @ W.T), ("training: dh = dlogits @ W", lambda: dl @ W),
                         ("training: dW = dlogits.T @ h", lambda: dl.t() @ h)]:
            s = timed(fn, 5)
            rows.append((name + " (ms)", s * 1e3, f"{flop / s / 1e9:.0f} GFLOPS"))
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        s = timed(lambda: a @ b, 20)
        rows.append(("GEMM 1024^3 (ms)", s * 1e3, f"{2 * 1024**3 / s / 1e9:.0f} GFLOPS"))
        big = torch.empty(100_000_000)
        s = timed(lambda: big.clone(), 5)
        rows.append(("copy 400 MB (ms)", s * 1e3, f"{2 * big.numel() * 4 / s / 1e9:.1f} GB/s read + write"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, ms, note in rows:
        print(f"{name:48s} {ms:8.1f}   {note}")


if __name__ == "__main__":
    main()
