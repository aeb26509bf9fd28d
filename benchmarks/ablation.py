"""Each variant of the step alone against the spec, on the CPU demo, several seeds.

What it measures, per (variant, seed), from the run's own files:
  - held-out greedy accuracy after training, k/60 (eval_summary.json, phase "after", group "overall");
  - held-out before (the same for every run: a check that all runs start from the same model);
  - the first step whose group is all correct (8/8), or "never" (metrics.jsonl, the "step" field);
  - generated tokens (sum of response_tokens over the steps, with the groups set aside by
    zero_variance=resample), problems drawn, training seconds (sum of the steps'
    seconds) and the process's wall seconds.
Each variant is a list of key=value overrides of examples/demo.yaml (its lr 1e-3, everything else
unchanged); `seed` is the config's seed (the rollouts' random streams); the demo model is one build.

    python benchmarks/ablation.py OUT [--demo DIR] [--variants spec,skip,...] [--seeds 0,1,2] [--json PATH] [--force]

It builds the demo once (python examples/make_demo.py OUT/demo, the real tokenizer when ../shared
exists, as the README's demo) unless --demo DIR names a built one. Results go to --json (default
OUT/ablation.json), one entry per (variant, seed); a rerun skips the entries already there (--force
reruns them), so variants can be added later into the same file. It prints a markdown table.

Caveat: the seconds depend on the machine, its load and the thread count (OMP_NUM_THREADS, passed
through to each run, 1 if unset, printed with the table); the accuracies and steps depend on the
demo build (docs/demo.md: its weights are machine-dependent). Runs are one at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUP = 8  # demo.yaml keeps the spec's group of 8

VARIANTS = {
    "spec": [],
    "advantage_std=none": ["advantage_std=none"],
    "loss_aggregation=sequence_mean": ["loss_aggregation=sequence_mean"],
    "loss_aggregation=token_mean": ["loss_aggregation=token_mean"],
    "loss_aggregation=dr_grpo": ["loss_aggregation=dr_grpo"],
    "zero_variance=skip": ["zero_variance=skip"],
    "format_reward=0.5": ["format_reward=0.5"],
    # beyond the spec's step: resampling zero-variance groups, a KL penalty, several PPO epochs
    "zero_variance=resample": ["zero_variance=resample"],
    "kl_coef=0.04": ["kl_coef=0.04"],
    "ppo_epochs=2": ["ppo_epochs=2"],
}


# Measuring one run (pure functions of its records)

def step_records(metrics: list[dict]) -> dict[int, dict]:
    """One record per step (by its "step" field; a later record of the same step replaces an earlier one).
    A list "epochs" in a record is ignored."""
    steps = {}
    for m in metrics:
        if isinstance(m.get("step"), int):
            steps[m["step"]] = m
    return steps


def first_all_correct(metrics: list[dict], group: int = GROUP):
    """The first step whose group is group/group correct, or "never"."""
    hits = [s for s, m in step_records(metrics).items() if m.get("correct") == m.get("group_size", group)]
    return min(hits) if hits else "never"


def overall(summary: dict, phase: str):
    """(correct, n) of the phase's overall group in eval_summary.json, or None."""
    p = summary.get("phases", {}).get(phase)
    if not p:
        return None
    g = next(g for g in p["groups"] if g["group"] == "overall")
    return [g["correct"], g["n"]]


def measure(metrics: list[dict], summary: dict, group: int = GROUP) -> dict:
    steps = step_records(metrics)
    return {
        "before": overall(summary, "before"), "after": overall(summary, "after"),
        "first_all_correct": first_all_correct(metrics, group), "steps": len(steps),
        # the groups zero_variance=resample set aside were generated too
        "generated_tokens": sum(m["response_tokens"] + sum(g["response_tokens"] for g in m.get("set_aside", []))
                                for m in steps.values()),
        "problems_drawn": sum(m.get("problems_drawn", 1) for m in steps.values()),
        "train_seconds": round(sum(m["seconds"] for m in steps.values()), 2),
    }


# Aggregating (a pure function of the JSON entries)

def mean(xs):
    return sum(xs) / len(xs) if xs else None


def aggregate(entries: list[dict], order: list[str]) -> list[dict]:
    """Per variant (in `order`, then any others): the seeds, held-out after (k of n per seed, mean k),
    first 8/8 step per seed, mean generated tokens and training seconds; failed runs listed apart."""
    names = order + sorted({e["variant"] for e in entries} - set(order))
    rows = []
    for v in names:
        es = sorted((e for e in entries if e["variant"] == v), key=lambda e: e["seed"])
        if not es:
            continue
        ok = [e for e in es if not e.get("error")]
        rows.append({
            "variant": v, "seeds": [e["seed"] for e in ok], "failed": {e["seed"]: e["error"] for e in es if e.get("error")},
            "after": [e["after"][0] for e in ok], "n": ok[0]["after"][1] if ok else None,
            "after_mean": mean([e["after"][0] for e in ok]),
            "before": sorted({e["before"][0] for e in ok}),
            "first_all_correct": [e["first_all_correct"] for e in ok],
            "tokens_mean": mean([e["generated_tokens"] for e in ok]),
            "seconds_mean": mean([e["train_seconds"] for e in ok]),
            "wall_mean": mean([e["wall_seconds"] for e in ok]),
        })
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| variant | seeds | held-out before | held-out after (mean; per seed) | first 8/8 step (per seed) "
             "| generated tokens (mean) | training s (mean) | wall s (mean) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["seeds"]:
            lines.append(f"| {r['variant']} | - | failed: {'; '.join(f'seed {s}: {m}' for s, m in r['failed'].items())} "
                         "| | | | | |")
            continue
        fails = f" (failed: {', '.join(map(str, r['failed']))})" if r["failed"] else ""
        lines.append(
            f"| {r['variant']} | {','.join(map(str, r['seeds']))}{fails} | {'/'.join(map(str, r['before']))}/{r['n']} "
            f"| {r['after_mean']:.1f}/{r['n']}; {', '.join(map(str, r['after']))} "
            f"| {', '.join(map(str, r['first_all_correct']))} | {r['tokens_mean']:.0f} | {r['seconds_mean']:.1f} "
            f"| {r['wall_mean']:.1f} |")
    return "\n".join(lines)


# Running

def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_one(demo: Path, out: Path, variant: str, seed: int, env: dict) -> dict:
    run_dir = out / variant / f"seed{seed}"
    cmd = [sys.executable, "train_rlvr.py", "--config", "examples/demo.yaml", f"model={demo}",
           f"dataset={demo}/train.json", f"eval_dataset={demo}/heldout.json", f"output_dir={run_dir}",
           f"seed={seed}", *VARIANTS[variant]]
    if run_dir.exists():  # --force or an earlier failed run: start clean (the trainer refuses a used folder)
        import shutil
        shutil.rmtree(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = round(time.time() - t0, 1)
    (run_dir.parent / f"seed{seed}.stdout").write_text(p.stdout)
    (run_dir.parent / f"seed{seed}.stderr").write_text(p.stderr)
    entry = {"variant": variant, "seed": seed, "overrides": VARIANTS[variant], "command": shlex.join(cmd),
             "wall_seconds": wall, "omp_num_threads": env["OMP_NUM_THREADS"]}
    if p.returncode != 0:
        last = [line for line in p.stderr.splitlines() if line.strip()]
        entry["error"] = f"exit {p.returncode}: {last[-1] if last else '(no stderr)'}"
        return entry
    summary = json.loads((run_dir / "eval_summary.json").read_text())
    entry.update(measure(read_jsonl(run_dir / "metrics.jsonl"), summary))
    return entry


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="folder for the runs (and the demo build unless --demo)")
    ap.add_argument("--demo", type=Path, help="a demo folder built by examples/make_demo.py (default: build OUT/demo)")
    ap.add_argument("--variants", default="spec,advantage_std=none,loss_aggregation=sequence_mean,"
                    "loss_aggregation=token_mean,loss_aggregation=dr_grpo,zero_variance=skip,format_reward=0.5")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--json", type=Path, help="results file (default OUT/ablation.json)")
    ap.add_argument("--force", action="store_true", help="rerun entries already in the JSON")
    a = ap.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"ablation: unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    try:
        seeds = [int(s) for s in a.seeds.split(",") if s]
    except ValueError:
        print(f"ablation: --seeds {a.seeds!r} is not a comma-separated list of integers, e.g. 0,1,2", file=sys.stderr)
        return 2
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    json_path = a.json or out / "ablation.json"
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}", flush=True)
    demo = a.demo.resolve() if a.demo else out / "demo"
    if not a.demo and not (demo / "model.safetensors").exists():
        t0 = time.time()
        subprocess.run([sys.executable, "examples/make_demo.py", str(demo)], cwd=ROOT, env=env, check=True)
        print(f"demo built in {time.time() - t0:.0f} s: {demo}", flush=True)
    if not (demo / "train.json").exists():
        print(f"ablation: {demo} holds no demo build (train.json); build it with python examples/make_demo.py DIR",
              file=sys.stderr)
        return 2
    entries = json.loads(json_path.read_text()) if json_path.exists() else []
    for s in seeds:  # seed-major: when time runs short, every variant has the same seeds
        for v in variants:
            if any(e["variant"] == v and e["seed"] == s for e in entries):
                if not a.force:
                    continue
                entries = [e for e in entries if not (e["variant"] == v and e["seed"] == s)]
            e = run_one(demo, out, v, s, env)
            print(f"{v} seed {s}: " + (e["error"] if e.get("error") else
                  f"after {e['after'][0]}/{e['after'][1]}, first 8/8 {e['first_all_correct']}, "
                  f"{e['train_seconds']} s training, {e['wall_seconds']} s wall"), flush=True)
            entries.append(e)
            json_path.write_text(json.dumps(entries, indent=1) + "\n")
    print(f"\n`{shlex.join(['python', 'benchmarks/ablation.py', *(argv if argv is not None else sys.argv[1:])])}`, "
          f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}\n")
    print(table(aggregate([e for e in entries if e["variant"] in variants and e["seed"] in seeds], variants)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
