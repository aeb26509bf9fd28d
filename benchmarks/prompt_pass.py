"""The log-probability + backward phase of a SmolLM2 group, prompt_pass shared against per_response (issue 67).

    python benchmarks/prompt_pass.py [--model runs/smollm2] [--repeats 3] [--json out.json]

Needs the real-model demo's folder (python examples/make_smollm2.py runs/smollm2) and, for the GSM8K prompt, its
GSM8K files (make_smollm2.py --problems-only --task gsm8k). Three groups of 8 responses, each after the prompt
of its task's yaml for that task's first training problem:

- demo: examples/smollm2.yaml's two-shot addition prompt, 18-token responses (" a + b = c, so the answer is
  \\boxed{c}." and EOS, as the demo's responses are);
- sum4: examples/smollm2_sum4.yaml's three-shot prompt, the problem's chain written out line by line (about 40
  tokens);
- gsm8k: examples/smollm2_gsm8k.yaml's four-shot prompt of train solutions (about 460 tokens), a response of the
  problem's own reference solution, annotations dropped (about 100 tokens).

The 8 responses of a group differ in one token each (response i's token 4 moved by i), rewards [1, 1, 0, 0, 1, 0,
0, 0]. Each group runs the trainer's own accumulate_policy_gradient both ways, alternating (per_response, shared,
per_response, ...), --repeats times; the table gives each one's best seconds, their ratio, and the gradients'
|shared - per_response| / |per_response|. Time it alone on the cores.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train_rlvr as T  # noqa: E402

REWARDS = [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]


def fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def task_text(task: str, record: dict) -> tuple[str, str]:
    """The problem's text for the prompt and a response of the task's form."""
    if task == "demo":
        a, b = record["problem"].split(" + ")
        return record["problem"], f" {a} + {b} = {int(a) + int(b)}, so the answer is \\boxed{{{int(a) + int(b)}}}."
    if task == "sum4":
        terms = [int(x) for x in record["problem"].split(" + ")]
        lines = [f"{sum(terms[:k])} + {terms[k]} = {sum(terms[:k + 1])}" for k in range(1, len(terms))]
        return record["problem"], "\n".join(lines) + f"\nSo the answer is \\boxed{{{sum(terms)}}}."
    solution, _, answer = record["answer"].rpartition("####")
    solution = re.sub(r"<<[^>]*>>", "", solution).strip()
    return record["question"], f"{solution}\nSo the answer is \\boxed{{{answer.strip()}}}."


TASKS = {"demo": ("smollm2.yaml", "train.json"), "sum4": ("smollm2_sum4.yaml", "sum4-train.json"),
         "gsm8k": ("smollm2_gsm8k.yaml", "gsm8k-train.json")}


def group(model_dir: Path, tok, task: str):
    config, data = TASKS[task]
    settings = yaml.safe_load((ROOT / "examples" / config).read_text())
    path = model_dir / data
    if not path.is_file():
        fail(f"{path} is missing; python examples/make_smollm2.py {model_dir} --problems-only --task "
             f"{ {'demo': 'addition'}.get(task, task)}" + (" --gsm8k-dir ../shared/data" if task == "gsm8k" else ""))
    problem, response = task_text(task, json.loads(path.read_text())[0])
    text = T.build_prompt(settings["prompt_template"], problem)
    prompt = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    body = tok(response, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(settings["eos_token"])]
    responses = [torch.tensor(body) for _ in range(8)]
    for i, r in enumerate(responses):  # 8 different responses
        r[4] = (r[4] + i) % len(tok)
    return prompt, responses


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="runs/smollm2", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not (args.model / "config.json").is_file():
        fail(f"{args.model} is not a model folder; run python examples/make_smollm2.py {args.model}")
    if args.repeats < 1:
        fail("--repeats must be 1 or more")
    if args.json and not args.json.parent.is_dir():
        fail(f"--json {args.json}: its folder does not exist")
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    rewards = torch.tensor(REWARDS)
    advantages = T.compute_advantages(rewards, 1e-4, zero_variance=T.equal_rewards(rewards))
    report = {"threads": torch.get_num_threads(), "torch": torch.__version__, "tasks": {}}
    print(f"SmolLM2-135M-Instruct, float32, {torch.get_num_threads()} threads, best of {args.repeats} each, "
          "alternating\n")
    print("| prompt | prompt tokens | response tokens | per_response s | shared s | shared / per_response | "
          "gradient difference |")
    print("|---|---|---|---|---|---|---|")
    for task in args.tasks:
        prompt, responses = group(args.model, tok, task)
        seconds, grads = {"per_response": [], "shared": []}, {}
        for _ in range(args.repeats):
            for name in seconds:
                start = time.perf_counter()
                T.accumulate_policy_gradient(model, params, prompt, responses, advantages, 8, nullcontext(),
                                             shared=name == "shared")
                seconds[name].append(time.perf_counter() - start)
                grads[name] = torch.cat([p.grad.flatten() for p in params]).clone()
        best = {k: min(v) for k, v in seconds.items()}
        diff = float((grads["shared"] - grads["per_response"]).norm() / grads["per_response"].norm())
        report["tasks"][task] = {"prompt_tokens": len(prompt), "response_tokens": len(responses[0]),
                                 "seconds": seconds, "best_seconds": best,
                                 "ratio": best["shared"] / best["per_response"], "gradient_relative_difference": diff}
        print(f"| {task} | {len(prompt)} | {len(responses[0])} | {best['per_response']:.2f} | {best['shared']:.2f} | "
              f"{best['shared'] / best['per_response']:.2f} ({best['per_response'] / best['shared']:.2f}x faster) | "
              f"{diff:.1e} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
