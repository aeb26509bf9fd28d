"""How long a checkpoint of the full-size stand-in takes to write and to load.

The exact Qwen3-0.6B-Base architecture (596M parameters, random weights, float32 master weights as
in the default precision) with a populated AdamW state, written by train_rlvr.save_checkpoint
(temporary folder, fsync, rename) and read back by train_rlvr.load_checkpoint.

    python benchmarks/bench_checkpoint.py [--config-dir ../shared/qwen3-0.6b-base] [--out DIR]
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train_rlvr as T  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config-dir", default=str(ROOT.parent / "shared" / "qwen3-0.6b-base"))
    ap.add_argument("--out", default=None, help="folder to write in (default: a temporary one)")
    args = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.config_dir), dtype=torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        out = Path(tmp)
        for name in ("metrics.jsonl", "rollouts.jsonl"):
            (out / name).write_text("{}\n")
        cfg = T.Config(output_dir=str(out))
        t = time.perf_counter()
        ckpt = T.save_checkpoint(out, 1, model, optimizer, cfg, None)
        write_s = time.perf_counter() - t
        size = sum(f.stat().st_size for f in ckpt.iterdir())
        t = time.perf_counter()
        T.load_checkpoint(ckpt, model, optimizer, [])
        load_s = time.perf_counter() - t
    print(f"parameters {n / 1e6:.1f}M; checkpoint {size / 2**30:.2f} GiB; "
          f"write (with fsync) {write_s:.1f} s ({size / 2**20 / write_s:.0f} MiB/s); load {load_s:.1f} s")


if __name__ == "__main__":
    main()
