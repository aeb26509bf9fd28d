"""Measurements of the demo (examples/make_demo.py): held-out greedy accuracy, sampled format mix,
and training runs of train_rlvr.py on it. A stopgap until the trainer's own before/after
evaluation lands; it lives in examples/ next to the demo builder.

    python examples/measure_demo.py eval runs/demo [--n 200]              # greedy on heldout.json
    python examples/measure_demo.py sample runs/demo [--n 40]             # groups of 8 at T 0.8, top-p 0.9
    python examples/measure_demo.py run runs/demo OUT [--flip] [key=value ...]  # train, then eval before/after
    python examples/measure_demo.py sweep runs/demo OUTROOT "learning_rate=1e-4" "flip learning_rate=1e-3" ...
        # several runs, the base model evaluated once; each config: key=value settings, "flip" negates
        # the advantages, "random:SEED" gives each step's advantages a random sign

Greedy decoding here is transformers' generate with do_sample=False on a left-padded batch, at most
`--max-new-tokens` tokens, stopping at <|endoftext|>; the response is scored by verifier.score.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import train_rlvr as T  # noqa: E402
import verifier  # noqa: E402


def load(model_dir: str, weights: str | None = None):
    """The model of a folder, or with the weights of a trainer checkpoint (weights = its folder)."""
    from safetensors.torch import load_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if weights:
        load_model(model, str(Path(weights) / "model.safetensors"))
    return model, tok


@torch.no_grad()
def greedy_responses(model, tok, problems: list[dict], max_new_tokens: int, batch: int = 100) -> list[str]:
    eos = tok.convert_tokens_to_ids(T.Config.eos_token)
    texts = []
    for start in range(0, len(problems), batch):
        prompts = [tok(T.build_prompt(T.SPEC_PROMPT, p["problem"]), add_special_tokens=False)["input_ids"]
                   for p in problems[start:start + batch]]
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), eos, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=eos, top_k=None, top_p=None, temperature=None)
        for row in out[:, width:]:
            row = row.tolist()
            texts.append(tok.decode(row[:row.index(eos) + 1] if eos in row else row, skip_special_tokens=True))
    return texts


def classify(text: str, gold: str) -> str:
    """correct / nobox / ramble (a box, then more text) / wrong (other): which form the greedy took."""
    r, ans, status = verifier.score(text, gold)
    if r == 1.0:
        return "correct"
    if "\\boxed" not in text:
        return "nobox"
    if "Question" in text:
        return "ramble"
    return "wrong"


def evaluate(model_dir: str, heldout: str, n: int, max_new_tokens: int, weights: str | None = None) -> dict:
    model, tok = load(model_dir, weights)
    problems = json.loads(Path(heldout).read_text())[:n]
    t = time.perf_counter()
    texts = greedy_responses(model, tok, problems, max_new_tokens)
    kinds = [classify(x, p["answer"]) for x, p in zip(texts, problems)]
    by = {}
    for p, k in zip(problems, kinds):
        by.setdefault(p["subject"], []).append(k == "correct")
    return {"model": model_dir, "n": len(problems), "accuracy": kinds.count("correct") / len(kinds),
            "correct": [k == "correct" for k in kinds],
            "forms": {k: kinds.count(k) for k in ("correct", "nobox", "ramble", "wrong")},
            "by_subject": {s: round(sum(v) / len(v), 3) for s, v in sorted(by.items())},
            "examples": texts[:3], "seconds": round(time.perf_counter() - t, 1)}


def sample(model_dir: str, data: str, n: int, max_new_tokens: int, seed: int = 0) -> dict:
    """Groups of 8 with the trainer's own sampler: fraction correct, groups with reward variance."""
    model, tok = load(model_dir)
    cfg = T.Config(max_new_tokens=max_new_tokens, device="cpu", seed=seed)
    eos = tok.convert_tokens_to_ids(cfg.eos_token)
    gen = torch.Generator().manual_seed(seed)
    problems = json.loads(Path(data).read_text())[:n]
    correct, varied, kinds, by_subject = 0, 0, {}, {}
    for p in problems:
        ids = torch.tensor(tok(T.build_prompt(T.SPEC_PROMPT, p["problem"]), add_special_tokens=False)["input_ids"])
        responses, _ = T.generate_rollouts(model, ids, cfg, eos, gen, T.nullcontext())
        ks = [classify(tok.decode(r.tolist(), skip_special_tokens=True), p["answer"]) for r in responses]
        for k in ks:
            kinds[k] = kinds.get(k, 0) + 1
            per = by_subject.setdefault(p["subject"], {})
            per[k] = per.get(k, 0) + 1
        c = ks.count("correct")
        correct += c
        varied += 0 < c < len(ks)
    return {"n_groups": len(problems), "correct_fraction": correct / (8 * len(problems)),
            "groups_with_variance": varied / len(problems), "forms": kinds, "by_subject": by_subject}


def mcnemar_exact(before: list[bool], after: list[bool]) -> tuple[int, int, float]:
    """(b, c, two-sided exact p): b problems right only before, c right only after."""
    b = sum(x and not y for x, y in zip(before, after))
    c = sum(y and not x for x, y in zip(before, after))
    n, k = b + c, min(b, c)
    p = 1.0 if n == 0 else min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)
    return b, c, p


def train(model_dir: str, out: str, overrides: list[str], flip) -> tuple[str, float, int]:
    """train_rlvr.py (through tests/rlvr_driver.py when the advantages' sign is flipped: flip True,
    or random per step: flip "random:SEED"), niced."""
    script = [str(ROOT / "tests" / "rlvr_driver.py")] if flip else [str(ROOT / "train_rlvr.py")]
    cmd = ["nice", "-n", "10", sys.executable, *script, f"model={model_dir}",
           f"dataset={Path(model_dir) / 'train.json'}", "device=cpu", f"output_dir={out}", "overwrite=true",
           "save_every=0", *overrides]
    opts = {"random_sign": int(flip.split(":")[1])} if isinstance(flip, str) else {"flip_advantages": True}
    env = dict(os.environ, RLVR_DRIVER=json.dumps(opts)) if flip else None
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-3000:])
    return proc.stdout, time.perf_counter() - t, proc.returncode


def run_one(args, out: str, overrides: list[str], flip: bool, before: dict | None) -> dict:
    heldout = str(Path(args.model) / "heldout.json")
    if not any(o.startswith("max_new_tokens=") for o in overrides):
        overrides = [*overrides, f"max_new_tokens={args.max_new_tokens}"]
    table, seconds, rc = train(args.model, out, overrides, flip)
    print(table, flush=True)
    before = before or evaluate(args.model, heldout, args.n, args.max_new_tokens)
    after = evaluate(str(Path(out) / "final"), heldout, args.n, args.max_new_tokens) if rc == 0 else None
    res = {"model": args.model, "overrides": overrides, "flip": flip, "train_seconds": round(seconds, 1), "rc": rc,
           "before": before["accuracy"], "after": after and after["accuracy"],
           "before_forms": before["forms"], "after_forms": after and after["forms"],
           "after_by_subject": after and after["by_subject"], "n_eval": before["n"]}
    if after:
        res["mcnemar"] = mcnemar_exact(before["correct"], after["correct"])
    res["summary"] = [line for line in table.splitlines()
                      if line.startswith(("correct rollouts", "zero-variance", "non-zero", "total time"))]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["eval", "sample", "run", "sweep", "curve"])
    ap.add_argument("model")
    ap.add_argument("rest", nargs="*", help="run: OUT then key=value settings for train_rlvr.py")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--flip", action="store_true", help="negate the advantages (tests/rlvr_driver.py)")
    ap.add_argument("--json", help="append the result as one JSON line to this file")
    ap.add_argument("--every", type=int, default=5, help="curve: checkpoint (and evaluate) every N steps")
    args = ap.parse_args(argv)
    heldout = str(Path(args.model) / "heldout.json")
    if args.what == "eval":
        res = evaluate(args.model, heldout, args.n, args.max_new_tokens)
    elif args.what == "sample":
        res = sample(args.model, heldout, args.n, args.max_new_tokens)
    elif args.what == "curve":  # held-out accuracy after every --every steps of one run
        out, overrides = args.rest[0], args.rest[1:]
        flip = "flip" in overrides or next((w for w in overrides if w.startswith("random:")), False)
        overrides = [w for w in overrides if w != "flip" and not w.startswith("random:")]
        overrides += [f"max_new_tokens={args.max_new_tokens}", f"save_every={args.every}", "keep_last=1000"]
        table, seconds, rc = train(args.model, out, overrides, flip)
        curve = [(0, evaluate(args.model, heldout, args.n, args.max_new_tokens)["accuracy"])]
        for ckpt in T.list_checkpoints(Path(out)):
            acc = evaluate(args.model, heldout, args.n, args.max_new_tokens, str(ckpt))["accuracy"]
            curve.append((int(ckpt.name[5:]), acc))
        res = {"model": args.model, "overrides": overrides, "flip": flip, "curve": curve,
               "summary": [line for line in table.splitlines() if line.startswith(("correct rollouts", "zero-var"))]}
    elif args.what == "run":
        res = run_one(args, args.rest[0], args.rest[1:], args.flip, None)
    else:
        before = evaluate(args.model, heldout, args.n, args.max_new_tokens)
        for i, config in enumerate(args.rest[1:]):
            words = config.split()
            out = str(Path(args.rest[0]) / f"run{i}")
            flip = "flip" in words or next((w for w in words if w.startswith("random:")), False)
            res = run_one(args, out, [w for w in words if w != "flip" and not w.startswith("random:")], flip, before)
            print(json.dumps(res), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(res) + "\n")
        return 0
    res.pop("correct", None)
    print(json.dumps(res))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
