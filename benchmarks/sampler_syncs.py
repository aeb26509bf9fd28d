"""Host syncs and ATen ops per token of the sampler (sampling_pick: top-p mask, weights, inverse CDF,
uniforms), counted with torch.profiler on the CPU.

    python benchmarks/sampler_syncs.py [--rows 8] [--vocab 151936] [--tokens 128] [--gpu-path]

Every token samples fresh logits of `rows` x `vocab` (random at scale 0.45, the random stand-in's;
--bf16 rounds them to bfloat16 first, as bf16 logits are, which makes ties at the top-p boundary
common). A sync is an op that needs a device value on the host: aten::_local_scalar_dense (under
aten::item and bool(tensor), counted once) and aten::nonzero (its output size). On the CPU none of
them waits for anything; they are counted here because on CUDA each one stalls the host until the
GPU catches up.

--gpu-path runs, on the CPU, the code that CUDA tensors take (train_rlvr.sampler_on_host returning
False), where the trainer has that switch. `ops` counts every ATen op the profiler records, nested
ones included; `top-level` only those called from Python (each one or a few kernel launches on
CUDA; host-only ones included, e.g. the generator state checks' torch.equal)."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_rlvr as T  # noqa: E402

SYNCS = ("aten::_local_scalar_dense", "aten::nonzero")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--gpu-path", action="store_true")
    ap.add_argument("--list", action="store_true", help="also print each top-level op's count per token")
    args = ap.parse_args()
    if args.gpu_path:
        T.sampler_on_host = lambda device: False
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(args.rows, args.vocab, generator=g) * 0.45 for _ in range(args.tokens)]
    if args.bf16:
        logits = [x.bfloat16().float() for x in logits]
    pick = T.sampling_pick(T.rollout_streams(0, 1, range(args.rows), "cpu"), 0.8, 0.9, "cpu")
    pick(logits[0])  # warm-up outside the count
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for x in logits[1:]:
            pick(x)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    counts = Counter(e.name for e in events)
    n = args.tokens - 1
    syncs = sum(counts[s] for s in SYNCS)
    inner = {id(c) for e in events for c in e.cpu_children}
    outer = Counter(e.name for e in events if id(e) not in inner)
    print(f"rows {args.rows} vocab {args.vocab} tokens {n} bf16 {args.bf16} gpu_path {args.gpu_path}")
    print(f"per token: syncs {syncs / n:.2f} ({', '.join(f'{s} {counts[s] / n:.2f}' for s in SYNCS)}); "
          f"ops {len(events) / n:.1f}; top-level {sum(outer.values()) / n:.1f}")
    if args.list:
        print("  ".join(f"{name[6:]} {c / n:.2f}" for name, c in outer.most_common()))


if __name__ == "__main__":
    main()
