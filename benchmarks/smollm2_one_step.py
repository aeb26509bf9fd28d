"""How far does one spec step move SmolLM2-135M-Instruct? The learning rate's scale, measured on one group.

    python benchmarks/smollm2_one_step.py --run runs/sweep/lr1e-5-seed0 --step 2 --lrs 1e-4 1e-5 1e-6 3e-7

Takes one step's group from a run's rollouts.jsonl (a step with reward variance: its 8 responses and
advantages), rebuilds the start model, and does the spec's update at each learning rate with the
trainer's own build_prompt, token_log_probs, sequence_log_prob and policy_loss: the loss
-(1/8) * sum_i A_i * seq_log_prob_i, backward, clip_grad_norm_(1.0), one AdamW step (PyTorch
defaults, weight decay 0.01). It prints each response's sequence log-probability before and after.
Why it matters: AdamW's first step moves every weight by about lr whatever the gradient's size (m / sqrt(v)
is +-1 at step 1; clipping does not change that), so on a model this size one step at lr 1e-5 can move a
response's log-probability by nats, not hundredths. The responses are re-tokenized from their text; the
script checks that the start model's log-probabilities equal the run's recorded ones.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train_rlvr as T  # noqa: E402  the trainer's own prompt, log-probability and loss


def fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def sequence_log_probs(model, prompt_ids: torch.Tensor, responses: list[torch.Tensor]) -> list[torch.Tensor]:
    return [T.sequence_log_prob(T.token_log_probs(model, prompt_ids, r, contextlib.nullcontext())) for r in responses]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="a run's output_dir (its rollouts.jsonl and run_config.yaml)")
    ap.add_argument("--step", type=int, required=True, help="a step whose 8 rewards are not all equal")
    ap.add_argument("--lrs", nargs="+", type=float, default=[1e-4, 1e-5, 1e-6, 3e-7])
    args = ap.parse_args()
    run = Path(args.run)
    if not (run / "rollouts.jsonl").is_file() or not (run / "run_config.yaml").is_file():
        fail(f"{run} is not a run's output_dir (no rollouts.jsonl and run_config.yaml); train one first")
    cfg = yaml.safe_load((run / "run_config.yaml").read_text())
    group = [r for r in map(json.loads, (run / "rollouts.jsonl").read_text().splitlines()) if r["step"] == args.step]
    if not group or all(r["sequence_log_prob"] is None for r in group):
        fail(f"step {args.step} of {run} has no group with reward variance; pick a step with a grad norm > 0")
    problem = json.loads(Path(cfg["dataset"]).read_text())[group[0]["problem_index"]]
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
    eos = tokenizer.convert_tokens_to_ids(cfg["eos_token"])
    prompt_ids = torch.tensor(tokenizer(T.build_prompt(cfg["prompt_template"], problem["problem"]),
                                        add_special_tokens=False)["input_ids"])
    responses = [torch.tensor(tokenizer(r["response"], add_special_tokens=False)["input_ids"]
                              + ([eos] if not r["cut_at_limit"] else [])) for r in group]
    advantages = torch.tensor([r["advantage"] for r in group])
    print(f"step {args.step} of {run}: problem {problem['problem']} = {problem['answer']}, rewards "
          f"{[r['reward'] for r in group]}")
    for lr in args.lrs:
        model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
        before = sequence_log_probs(model, prompt_ids, responses)
        off = max(abs(b.item() - r["sequence_log_prob"]) for b, r in zip(before, group))
        if off > 1e-3:
            fail(f"re-tokenized responses give log-probabilities {off:.2e} away from the run's; not comparable")
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg["weight_decay"])
        sum(T.policy_loss(a, lp, len(group)) for a, lp in zip(advantages, before)).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        with torch.no_grad():
            after = sequence_log_probs(model, prompt_ids, responses)
        moves = ", ".join(f"{r['answer']} (A {a:+.2f}) {b.item():.2f} -> {f.item():.2f}"
                          for r, a, b, f in zip(group, advantages, before, after))
        print(f"lr {lr:.0e}  grad norm {grad_norm:.1f}  seq log-prob before -> after: {moves}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
