"""rlvr's optimizer phase against AdamW's own cost, side by side on SmolLM2-135M-Instruct (issue 67).

    python benchmarks/optimizer_phase.py [--model runs/smollm2] [--steps 15] [--json out.json] [--trainer FOLDER]

Needs the real-model demo's folder (python examples/make_smollm2.py runs/smollm2). Two copies of the model in one
process, each with a torch.optim.AdamW at the demo's settings (lr 3e-6, weight decay 0.01) and the same random
gradient (scaled to a norm of 10, so that clipping acts) copied into its gradient buffers before every step (a run
reuses them from step to step):

- rlvr: train_rlvr.optimizer_step, the trainer's whole phase (clip_grad_norm_, the copy of the weights the update
  norm and the undo read, the copy of AdamW's state for the undo, AdamW's step, the finiteness check, the update
  norm), with its buffers allocated once as a run does (update_norm_buffers);
- bare: torch.nn.utils.clip_grad_norm_(params, 1.0) and optimizer.step(), nothing else.

The two alternate step by step (rlvr, bare, rlvr, bare, ...) so that a slower stretch of the machine touches both;
the first step of each (AdamW allocating its moments) is left out. Prints each one's median and the ratio, the CPU
and the threads; --json writes them. --trainer FOLDER times the train_rlvr.py of another checkout (an earlier
commit's optimizer_step, which took the weights' and the state's buffers as two arguments). Time it alone on the
cores: a process beside it makes both slower, unevenly.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load(model_dir: Path):
    from transformers import AutoModelForCausalLM
    if not (model_dir / "config.json").is_file():
        print(f"error: {model_dir} is not a model folder; run python examples/make_smollm2.py {model_dir}",
              file=sys.stderr)
        sys.exit(2)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="runs/smollm2", type=Path)
    ap.add_argument("--steps", type=int, default=15, help="timed steps of each (after one untimed)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--trainer", type=Path, default=ROOT, help="the folder of the train_rlvr.py to time")
    args = ap.parse_args(argv)
    if args.steps < 1:
        print("error: --steps must be 1 or more", file=sys.stderr)
        return 2
    if not (args.trainer / "train_rlvr.py").is_file():
        print(f"error: --trainer {args.trainer} holds no train_rlvr.py; pass a checkout's folder", file=sys.stderr)
        return 2
    sys.path.insert(0, str(args.trainer.resolve()))
    import train_rlvr as T
    models = {name: load(args.model) for name in ("rlvr", "bare")}
    params = {k: [p for p in m.parameters() if p.requires_grad] for k, m in models.items()}
    optimizers = {k: torch.optim.AdamW(ps, lr=3e-6, weight_decay=0.01) for k, ps in params.items()}
    before = T.update_norm_buffers(params["rlvr"], torch.device("cpu"))
    buffers = (T.StepCopies(before),) if hasattr(T, "StepCopies") else (before, {})  # an earlier commit's: two
    g = torch.Generator().manual_seed(0)
    times = {"rlvr": [], "bare": []}
    norms = []
    for step in range(args.steps + 1):
        grads = [torch.randn(p.shape, generator=g) for p in params["rlvr"]]
        scale = 10.0 / float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in grads])))
        for name in ("rlvr", "bare"):
            for p, x in zip(params[name], grads):
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(x).mul_(scale)
            start = time.perf_counter()
            if name == "rlvr":
                norms.append(T.optimizer_step(params[name], optimizers[name], 1.0, 0.0, *buffers))
            else:
                torch.nn.utils.clip_grad_norm_(params[name], 1.0)
                optimizers[name].step()
            if step:
                times[name].append(time.perf_counter() - start)
    same = all(torch.equal(a, b) for a, b in zip(params["rlvr"], params["bare"]))
    med = {k: statistics.median(v) for k, v in times.items()}
    report = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "trainer": str(args.trainer),
              "parameters": sum(p.numel() for p in params["rlvr"]), "steps": args.steps,
              "seconds": times, "median_seconds": med, "ratio": med["rlvr"] / med["bare"],
              "grad_norm": norms[-1][0], "update_norm": norms[-1][1], "same_weights": same}
    print(f"SmolLM2-135M-Instruct ({report['parameters'] / 1e6:.1f} M parameters, float32), {report['cpu']}, "
          f"{report['threads']} threads, torch {torch.__version__}; median of {args.steps} steps each, alternating\n")
    print("| optimizer phase | median seconds |")
    print("|---|---|")
    print(f"| rlvr's optimizer_step (clip, copies for the undo, AdamW, finiteness, update norm) | {med['rlvr']:.3f} |")
    print(f"| bare clip_grad_norm_ + AdamW.step() | {med['bare']:.3f} |")
    print(f"\nrlvr / bare: {report['ratio']:.2f}x; the same weights after every step: {same}; "
          f"last update norm {norms[-1][1]:.6e}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
