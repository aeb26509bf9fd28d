"""Does the spec's step make a real pretrained model better? SmolLM2-135M-Instruct on 2-digit addition.

    python examples/make_smollm2.py runs/smollm2                              # once: model + problems
    python benchmarks/smollm2_learning.py --lrs 1e-5 3e-5 1e-4 3e-6 1e-6 --seeds 0 --on dev --no-sampled --out runs/sweep
    python benchmarks/smollm2_learning.py --lrs 3e-6 --seeds 0 1 2 --on heldout --out runs/smollm2-seeds

The measured figures: benchmarks/smollm2_sweep.json and benchmarks/smollm2_seeds.json (docs/demo.md).

Each (learning rate, seed) is one ordinary run, `python train_rlvr.py --config examples/smollm2.yaml
learning_rate=.. seed=.. output_dir=..` in its own process (50 steps, greedy evaluation of 200 problems
before step 1 and after step 50), then, unless --no-sampled, two evaluation-only runs (num_problems: 0)
of the start model and of the run's final/ that sample --sampled-k responses per problem on the first
--sampled-problems problems (temperature 0.8, top-p 0.9): the sampled pass@1. Settings are chosen on
--on dev (dev.json) and the result measured on --on heldout (heldout.json): held-out problems never
choose a setting.

Figures per run, all read from the run's own files (eval.jsonl, eval_summary.json, metrics.jsonl,
rollouts.jsonl):
  greedy before / after     right answers of the 200 greedy responses, and the exact McNemar p of
                            the paired change (eval_summary.json)
  EOS share                 responses that stopped with EOS (not cut at eval_max_new_tokens)
  right among EOS + box     accuracy among the responses that stopped with EOS and hold an answer:
                            arithmetic told apart from learning to stop (a response that runs on
                            is scored on its last box, the invented next question's)
  sampled pass@1            mean reward of the sampled evaluation responses, before and after
  rollout reward            mean reward of the training rollouts of problems 1-10 and 41-50 (each
                            problem is drawn once, so these are samples on problems not yet trained on)
  seconds                   the 50 steps (metrics.jsonl), and the whole run with its evaluations

The results go to OUT/results.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str], log: Path) -> float:
    start = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.call([sys.executable, str(ROOT / "train_rlvr.py"), *args], stdout=f, stderr=subprocess.STDOUT,
                               cwd=ROOT)
    if code != 0:
        sys.exit(f"error: train_rlvr.py {' '.join(args)} exited with {code}; see {log}")
    return time.perf_counter() - start


def phase_figures(records: list[dict]) -> dict:
    n = len(records)
    stopped = [r for r in records if not r["cut_at_limit"]]
    boxed = [r for r in stopped if r["status"] != "no_answer"]
    return {"n": n, "correct": sum(r["reward"] == 1.0 for r in records), "accuracy": sum(r["reward"] for r in records) / n,
            "eos_share": len(stopped) / n, "eos_boxed": len(boxed),
            "eos_boxed_accuracy": (sum(r["reward"] for r in boxed) / len(boxed)) if boxed else None,
            "mean_tokens": sum(r["tokens"] for r in records) / n}


def read_eval(folder: Path) -> dict:
    records = [json.loads(line) for line in (folder / "eval.jsonl").read_text().splitlines()]
    return {phase: phase_figures([r for r in records if r["phase"] == phase])
            for phase in dict.fromkeys(r["phase"] for r in records)}


def one_run(model: Path, lr: str, seed: int, on: str, out: Path, sampled: tuple[int, int] | None,
            settings: tuple[str, ...] = ()) -> dict:
    name = f"lr{lr}-seed{seed}" + "".join(f"-{x.replace('=', '')}" for x in settings)
    folder = out / name
    common = [f"eval_dataset={model / (on + '.json')}", f"seed={seed}", "overwrite=true"]
    wall = run(["--config", "examples/smollm2.yaml", f"model={model}", f"dataset={model / 'train.json'}",
                f"learning_rate={lr}", f"output_dir={folder}", *settings, *common], out / f"{name}.log")
    summary = json.loads((folder / "eval_summary.json").read_text())
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(line) for line in (folder / "rollouts.jsonl").read_text().splitlines()]
    trained = [r["reward"] for r in rollouts if not r.get("set_aside")]  # in problem order, whatever P
    group = metrics[0]["group_size"]  # rollouts per problem
    early, late = trained[:10 * group], trained[-10 * group:]  # the first and the last 10 problems' rollouts
    res = {"learning_rate": float(lr), "seed": seed, "on": on, "settings": list(settings), "greedy": read_eval(folder),
           "paired": summary["comparison"]["paired"], "steps": len(metrics),
           "nonzero_gradient_steps": sum(m["grad_norm"] > 0 for m in metrics),
           "rollout_reward_first10": sum(early) / len(early), "rollout_reward_last10": sum(late) / len(late),
           "generated_tokens": sum(m["response_tokens"] for m in metrics),
           "step_seconds": sum(m["seconds"] for m in metrics), "run_seconds": wall}
    if sampled:
        k, n = sampled
        res["sampled"] = {}
        for name, which in (("before", model), ("after", folder / "final")):
            sfolder = out / f"{folder.name}-sampled-{name}"
            run(["--config", "examples/smollm2.yaml", f"model={which}", "num_problems=0", f"eval_samples={k}",
                 f"eval_problems={n}", f"output_dir={sfolder}", *common], out / f"{sfolder.name}.log")
            res["sampled"][name] = read_eval(sfolder)["model"]
    return res


def fmt(x, spec=".1f", scale=100.0):
    return "-" if x is None else format(x * scale, spec)


def table(results: list[dict]) -> str:
    head = ("lr      seed  on       greedy before -> after   change  McNemar p  EOS share before/after  "
            "right|EOS+box before/after  sampled pass@1 before/after  rollout reward 1-10/41-50  s/step  run s")
    lines = [head]
    for r in results:
        b, a, p = r["greedy"]["before"], r["greedy"]["after"], r["paired"]
        s = r.get("sampled") or {}
        sb, sa = (s.get("before") or {}).get("accuracy"), (s.get("after") or {}).get("accuracy")
        lines.append(
            f"{r['learning_rate']:<7.0e} {r['seed']:<5} {r['on']:<8} {b['correct']:>3}/{b['n']} -> {a['correct']:>3}/{a['n']}"
            f"  ({fmt(b['accuracy'])}% -> {fmt(a['accuracy'])}%)  {fmt(a['accuracy'] - b['accuracy'], '+.1f')}"
            f"  {p['mcnemar_p']:.1e}    {fmt(b['eos_share'])}% / {fmt(a['eos_share'])}%"
            f"            {fmt(b['eos_boxed_accuracy'])}% ({b['eos_boxed']}) / {fmt(a['eos_boxed_accuracy'])}% ({a['eos_boxed']})"
            f"          {fmt(sb)}% / {fmt(sa)}%                {fmt(r['rollout_reward_first10'])}% / "
            f"{fmt(r['rollout_reward_last10'])}%            {r['step_seconds'] / r['steps']:.1f}   {r['run_seconds']:.0f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="runs/smollm2", help="the folder examples/make_smollm2.py wrote")
    ap.add_argument("--lrs", nargs="+", default=["1e-5"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--on", choices=["dev", "heldout"], default="dev", help="the evaluation problems")
    ap.add_argument("--out", default="runs/smollm2-learning")
    ap.add_argument("--sampled-k", type=int, default=2, help="samples per problem of the sampled evaluation")
    ap.add_argument("--sampled-problems", type=int, default=100)
    ap.add_argument("--no-sampled", action="store_true", help="skip the sampled evaluations")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="more settings of the training run (problems_per_step=4)")
    args = ap.parse_args()
    model, out = Path(args.model).resolve(), Path(args.out).resolve()
    if not (model / "config.json").is_file() or not (model / "train.json").is_file():
        sys.exit(f"error: {model} holds no model and problems; run python examples/make_smollm2.py {args.model}")
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for lr in args.lrs:
        for seed in args.seeds:
            results.append(one_run(model, lr, seed, args.on, out,
                                   None if args.no_sampled else (args.sampled_k, args.sampled_problems), tuple(args.set)))
            (out / "results.json").write_text(json.dumps(results, indent=1))
            print(table(results[-1:]).splitlines()[-1], flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
