"""Rollout generation with several problems a step: P problems x 8 rollouts in one batched decode, P = 1, 2, 4, 8.

    python benchmarks/batched_decode.py [--smollm2 runs/smollm2] [--qwen3 ../shared/qwen3-0.6b-base] [--json out.json]

Each row of the batch is one rollout: 8 rows per problem (the first P problems of the SmolLM2 demo's train.json,
in examples/smollm2.yaml's prompt), each drawn from its own random stream with the run's sampler (temperature
0.8, top-p 0.9), through the trainer's decode (left-padded prompts, ended rows fed EOS, as a batch of P problems
would be). Every batch is decoded for the same fixed number of steps (--steps) so that P's are compared on equal
work per row: decode steps per second (the batch's steps over its seconds, prompt pass included) and response
tokens per second (rows x steps over seconds). Two models: SmolLM2-135M-Instruct (the demo's folder,
examples/make_smollm2.py) and a model of Qwen3-0.6B-Base's exact architecture and size with random weights (its
config and tokenizer from ../shared/qwen3-0.6b-base), in float32 on the CPU. Run it alone: a second job on a
2-core machine makes every figure several times slower. The whole step's seconds per problem at P = 1, 2, 4, 8:
benchmarks/step_seconds.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train_rlvr as T  # noqa: E402


def prompts_of(tok, problems: list[dict], template: str) -> list[torch.Tensor]:
    return [torch.tensor(tok(T.build_prompt(template, p["problem"]), add_special_tokens=False)["input_ids"])
            for p in problems]


@torch.no_grad()
def timed_batch(model, prompts: list[torch.Tensor], rollouts: int, steps: int, seed: int) -> float:
    """Seconds to decode `steps` tokens for every (prompt, rollout) row, no EOS (eos -1: every row runs on)."""
    rows = [p for p in prompts for _ in range(rollouts)]
    streams = [torch.Generator().manual_seed(T.stream_seed(seed, "rollout", k, i))
               for k in range(len(prompts)) for i in range(rollouts)]
    began = time.perf_counter()
    T.decode(model, rows, steps, -1, T.sampling_pick(streams, 0.8, 0.9, "cpu"), T.nullcontext())
    return time.perf_counter() - began


def measure(name: str, model, prompts: list[torch.Tensor], ps: list[int], steps: int, repeats: int) -> dict:
    timed_batch(model, prompts[:1], 8, 4, 0)  # warm-up
    out = {}
    for p in ps:
        seconds = min(timed_batch(model, prompts[:p], 8, steps, r) for r in range(repeats))
        out[p] = {"rows": 8 * p, "seconds": round(seconds, 3), "decode_steps_per_second": round(steps / seconds, 2),
                  "response_tokens_per_second": round(8 * p * steps / seconds, 1)}
        print(f"{name}  P={p}  {8 * p} rows  {steps / seconds:.2f} decode steps/s  "
              f"{8 * p * steps / seconds:.1f} tokens/s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smollm2", type=Path, default=Path("runs/smollm2"))
    ap.add_argument("--qwen3", type=Path, default=ROOT.parent / "shared" / "qwen3-0.6b-base")
    ap.add_argument("--problems", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--steps", type=int, default=32, help="decode steps per batch (every row runs them all)")
    ap.add_argument("--repeats", type=int, default=2, help="the fastest of this many batches is kept")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    for folder, what in ((args.smollm2 / "train.json", "python examples/make_smollm2.py runs/smollm2"),
                         (args.qwen3 / "config.json", "a checkout beside ../shared")):
        if not folder.is_file():
            print(f"error: {folder} is missing ({what}); pass --smollm2 / --qwen3", file=sys.stderr)
            return 2
    torch.manual_seed(0)
    demo = yaml.safe_load((ROOT / "examples" / "smollm2.yaml").read_text())
    problems = json.loads((args.smollm2 / "train.json").read_text())[:max(args.problems)]
    report = {"threads": torch.get_num_threads(), "steps": args.steps}
    tok = AutoTokenizer.from_pretrained(args.smollm2)
    model = AutoModelForCausalLM.from_pretrained(args.smollm2, dtype=torch.float32).eval()
    report["smollm2"] = measure("smollm2", model, prompts_of(tok, problems, demo["prompt_template"]), args.problems,
                                args.steps, args.repeats)
    from transformers import AutoConfig
    tok = AutoTokenizer.from_pretrained(args.qwen3)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.qwen3), dtype=torch.float32).eval()
    report["qwen3_shaped"] = measure("qwen3-0.6b-shaped", model, prompts_of(tok, problems, T.SPEC_PROMPT),
                                     args.problems, args.steps, args.repeats)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
