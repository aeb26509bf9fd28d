"""rlvr against TRL's GRPOTrainer on SmolLM2-135M-Instruct: the same steps, side by side in one command.

    pip install -r benchmarks/requirements-trl.txt
    python benchmarks/trl_vs_rlvr.py [--model runs/smollm2] [--steps 5] [--out bench_out/trl_vs_rlvr] [--json r.json]

Needs the real-model demo's folder (python examples/make_smollm2.py runs/smollm2). Each trainer runs in its own
process, one after the other (never at once: 2 cores), on the first --steps problems of train.json with
examples/smollm2.yaml's prompt, and each step is one problem's group of 8 and one optimizer update:

- rlvr: python train_rlvr.py --config examples/smollm2.yaml num_problems=STEPS eval_problems=0 save_every=0;
  its seconds per step and per phase are its own metrics.jsonl's.
- TRL: GRPOTrainer with its settings matched to the spec's: num_generations 8, one prompt a step
  (per_device_train_batch_size 8, gradient_accumulation_steps 1), temperature 0.8, top_p 0.9, top_k 0,
  max_completion_length 48, beta 0 (no KL, no reference model), scale_rewards "group", loss_type "dr_grpo"
  (sum over every token of A_i * log-prob / (8 * 48): the spec's sequence sum times a constant), num_iterations
  1, AdamW (torch's) at lr 3e-6, weight decay 0.01, max_grad_norm 1.0, a constant schedule, float32 on the
  CPU, prompts in file order; the reward is rlvr's verifier (verifier.reward), called in the process.
  Its phases are timed from outside: model.generate (generation), the reward function (rewards), the
  optimizer's step between the on_pre_optimizer_step and on_optimizer_step callbacks (optimizer), the rest of
  the step (log-probabilities, loss, backward, clipping and TRL's own bookkeeping).

The two draw other samples (other samplers, other random streams), so a step with reward variance in one may
have none in the other: rlvr skips the forward and backward of a group whose 8 rewards are equal (its gradient
is exactly 0), TRL runs them. The table gives both the mean over all steps and over the steps with variance.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_rlvr(model: Path, steps: int, out: Path) -> list[dict]:
    cmd = [sys.executable, str(ROOT / "train_rlvr.py"), "--config", str(ROOT / "examples" / "smollm2.yaml"),
           f"model={model}", f"dataset={model / 'train.json'}", f"num_problems={steps}", "eval_problems=0",
           "save_every=0", f"output_dir={out}", "overwrite=true"]
    print("rlvr:", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{"step": m["step"], "seconds": m["seconds"], "generation": m["timings"]["generation"],
             "rewards": m["timings"]["rewards"], "logprob_backward": m["timings"].get("logprob_backward", 0.0),
             "optimizer": m["timings"].get("optimizer", 0.0), "variance": m["reward_std"] > 0,
             "correct": m["correct"]} for m in metrics]


def run_trl(model: Path, steps: int, out: Path) -> list[dict]:
    cmd = [sys.executable, __file__, "--trl-worker", "--model", str(model), "--steps", str(steps), "--out", str(out)]
    print("TRL:", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)
    return json.loads((out / "trl_steps.json").read_text())


def trl_worker(model_dir: Path, steps: int, out: Path) -> None:
    import torch
    import yaml
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import train_rlvr as T
    import verifier

    demo = yaml.safe_load((ROOT / "examples" / "smollm2.yaml").read_text())
    problems = json.loads((model_dir / "train.json").read_text())[:steps]
    data = Dataset.from_list([{"prompt": T.build_prompt(demo["prompt_template"], p["problem"]),
                               "answer": p["answer"]} for p in problems])
    clock = {"generation": 0.0, "rewards": 0.0, "optimizer": 0.0, "correct": 0, "rewards_seen": []}

    def reward(completions, answer, **kwargs):
        t0 = time.perf_counter()
        scores = [verifier.reward(c, a) for c, a in zip(completions, answer)]
        clock["rewards"] += time.perf_counter() - t0
        clock["rewards_seen"] = scores
        return scores

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generate = model.generate

    def timed_generate(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            clock["generation"] += time.perf_counter() - t0
    model.generate = timed_generate
    records = []

    class Timing(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.update(generation=0.0, rewards=0.0, optimizer=0.0, start=time.perf_counter())

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            clock["opt_start"] = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            clock["optimizer"] += time.perf_counter() - clock["opt_start"]

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - clock["start"]
            r = clock["rewards_seen"]
            records.append({"step": state.global_step, "seconds": seconds, "generation": clock["generation"],
                            "rewards": clock["rewards"], "optimizer": clock["optimizer"],
                            "logprob_backward": seconds - clock["generation"] - clock["rewards"] - clock["optimizer"],
                            "variance": len(set(r)) > 1, "correct": int(sum(r))})

    config = GRPOConfig(
        output_dir=str(out / "trl"), num_generations=8, per_device_train_batch_size=8, gradient_accumulation_steps=1,
        max_completion_length=demo["max_new_tokens"], temperature=0.8, top_p=0.9, top_k=0, beta=0.0,
        scale_rewards="group", loss_type="dr_grpo", num_iterations=1, learning_rate=float(demo["learning_rate"]),
        weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        use_cpu=True, bf16=False, max_steps=steps, logging_steps=1, save_strategy="no", report_to="none",
        shuffle_dataset=False, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tok,
                          callbacks=[Timing()])
    trainer.train()
    (out / "trl_steps.json").write_text(json.dumps(records, indent=1))


PHASES = ("seconds", "generation", "rewards", "logprob_backward", "optimizer")


def summary(rows: list[dict], which) -> dict:
    chosen = [r for r in rows if which(r)]
    return {p: statistics.mean(r[p] for r in chosen) if chosen else float("nan") for p in PHASES} | {"n": len(chosen)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="runs/smollm2", type=Path)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="bench_out/trl_vs_rlvr", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.trl_worker:
        trl_worker(args.model, args.steps, args.out)
        return 0
    if not (args.model / "train.json").is_file():
        print(f"error: {args.model} has no train.json; run python examples/make_smollm2.py {args.model}",
              file=sys.stderr)
        return 2
    rlvr = run_rlvr(args.model, args.steps, args.out / "rlvr")
    trl = run_trl(args.model, args.steps, args.out)
    import trl as trl_package
    import torch
    report = {"steps": args.steps, "torch": torch.__version__, "trl": trl_package.__version__,
              "threads": torch.get_num_threads(), "rlvr": rlvr, "trl_steps": trl,
              "mean": {"rlvr": summary(rlvr, lambda r: True), "trl": summary(trl, lambda r: True)},
              "mean_with_variance": {"rlvr": summary(rlvr, lambda r: r["variance"]),
                                     "trl": summary(trl, lambda r: r["variance"])}}
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def table(r: dict) -> str:
    lines = [f"SmolLM2-135M-Instruct, {r['steps']} steps each, torch {r['torch']}, TRL {r['trl']}, "
             f"{r['threads']} threads", "",
             "| step | rlvr s (correct/8) | TRL s (correct/8) |", "|---|---|---|"]
    for a, b in zip(r["rlvr"], r["trl_steps"]):
        lines.append(f"| {a['step']} | {a['seconds']:.1f} ({a['correct']}) | {b['seconds']:.1f} ({b['correct']}) |")
    lines += ["", "| mean seconds per step | rlvr | TRL | TRL / rlvr |", "|---|---|---|---|"]
    for label, key in (("all steps", "mean"), ("steps with reward variance", "mean_with_variance")):
        a, b = r[key]["rlvr"], r[key]["trl"]
        lines.append(f"| **{label}** (rlvr {a['n']}, TRL {b['n']}) | {a['seconds']:.2f} | {b['seconds']:.2f} | "
                     f"{b['seconds'] / a['seconds']:.2f}x |")
        for p in PHASES[1:]:
            lines.append(f"| {label}: {p} | {a[p]:.2f} | {b[p]:.2f} | "
                         f"{b[p] / a[p] if a[p] else float('inf'):.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
