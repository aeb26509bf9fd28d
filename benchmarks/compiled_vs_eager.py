"""How far the compiled decode step's logits lie from eager decoding's: the measurement behind
train_rlvr.compiled_tolerance (the check at a run's first compiled generation).

    python benchmarks/compiled_vs_eager.py [--prompts 3] [--steps 8] [--precisions fp32,bf16-autocast,bf16]
                                           [--models tiny,stand-in]

On this machine's device (CPU here; CUDA if present), for float32, bf16 autocast and bf16 weights, on the tiny
random Qwen3 of the tests and on the CPU stand-in of bench_step.py (the real tokenizer and vocabulary,
4 layers, hidden 512; needs ../shared/qwen3-0.6b-base), runs train_rlvr.compiled_decode_difference
on real MATH prompts and prints the largest |compiled - eager| and its ratio to the largest |logit|.
"""
import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import train_rlvr as T  # noqa: E402
from tiny_models import build_like, build_tiny_qwen3, build_tiny_tokenizer  # noqa: E402


def models(folder: Path, names: list[str]):
    if "tiny" in names:
        tiny = folder / "tiny"
        tiny.mkdir()
        build_tiny_qwen3(tiny, vocab_size=len(build_tiny_tokenizer(tiny)))
        yield "tiny (29k)", tiny
    if "stand-in" in names and (SHARED / "qwen3-0.6b-base").exists():
        stand_in = folder / "stand-in"
        stand_in.mkdir()
        build_like(stand_in, SHARED / "qwen3-0.6b-base", layers=4, hidden=512)
        yield "stand-in (4 x 512)", stand_in


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--precisions", default="fp32,bf16-autocast,bf16", help="bf16: bfloat16 weights, no autocast")
    ap.add_argument("--models", default="tiny,stand-in")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = SHARED / "data" / "math_train_first50.json"
    problems = [r["problem"] for r in json.loads(data.read_text())] if data.exists() else ["What is 1 + 1?"] * 3
    print(f"{'model':20s} {'precision':14s} {'max |diff|':>11s} {'max |logit|':>12s} {'ratio':>9s}  tolerance")
    with tempfile.TemporaryDirectory() as tmp:
        for name, folder in models(Path(tmp), args.models.split(",")):
            tok = AutoTokenizer.from_pretrained(folder)
            master = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
            for precision in args.precisions.split(","):
                amp = T.autocast(device, precision)
                model = master if precision != "bf16" else copy.deepcopy(master).to(torch.bfloat16)
                worst = scale = 0.0
                decoders = T.Decoders()  # one decoder per precision, reused across the prompts as a run does
                for problem in problems[:args.prompts]:
                    ids = tok(T.build_prompt(T.SPEC_PROMPT, problem), add_special_tokens=False)["input_ids"]
                    decoder = decoders.get(model, amp)
                    with torch.no_grad(), torch.autocast(device.type, enabled=False):
                        d, s = T.compiled_decode_difference(decoder, model, [torch.tensor(ids, device=device)] * 4,
                                                            args.steps + 1, amp, steps=args.steps)
                    worst, scale = max(worst, d), max(scale, s)
                tol = T.compiled_tolerance(scale, decoder.low_precision)
                print(f"{name:20s} {precision:14s} {worst:11.3g} {scale:12.3g} {worst / scale:9.2e}  {tol:.3g}",
                      flush=True)


if __name__ == "__main__":
    main()
