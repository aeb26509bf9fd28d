"""Which step earned the reward: the credit methods side by side on SmolLM2-135M-Instruct (docs/variants.md).

    python examples/make_smollm2.py runs/smollm2 && python examples/make_smollm2.py runs/smollm2 --problems-only --task sum3
    python examples/make_smollm2.py runs/smollm2 --problems-only --task gsm8k --gsm8k-dir ../shared/data   # gsm8k
    python benchmarks/credit_methods.py --tasks sum3 addition --seeds 0 1 2 --on heldout --out runs/credit
    python benchmarks/credit_methods.py --tasks sum3 addition --seeds 0 1 2 --on heldout --out runs/credit --add-sampled
    python benchmarks/credit_methods.py --out runs/credit --summary      # every run, then each method over seeds
    python benchmarks/credit_methods.py --out runs/credit --pictures     # one group of each run, drawn
    python benchmarks/credit_methods.py --out runs/credit --siblings     # each tree run's identical siblings
    python benchmarks/credit_methods.py --out runs/credit --masks        # where each entropy mask's kept tokens lie
    python benchmarks/credit_methods.py --out runs/credit --errors       # where each run's credit went, by line
    python benchmarks/credit_methods.py --out runs/credit --add-lines    # credit=steps runs: their line figures
    python benchmarks/credit_methods.py --out runs/credit --operands     # sum runs: right sums of the wrong numbers
    python benchmarks/credit_methods.py --tasks addition --methods tree --seeds 0 --on dev --out runs/credit-dev \
        --set credit_segment_tokens=2                                     # a setting tried on the dev set
The modes (--summary, --add-lines, --add-sampled, --pictures, --siblings, --masks, --errors, --operands) each do
their one thing and stop: one a call, two together are refused (one line, exit 2), not one of them ignored.

The committed records: benchmarks/credit_methods.json (the grid, runs/credit), credit_dev.json (runs/credit-dev)
and credit_tuned.json (runs/credit-tuned: the tree at the segment length chosen on dev, and the spec's credit run
again beside it on the same machine), all with the methods' earlier definitions; credit47_dev.json (runs/credit47-
dev: the sum4 task's dev runs, the methods as their papers define them), credit62_dev.json and
credit62_heldout.json (runs/credit62-dev, runs/credit62: credit=steps, with their line figures);
docs/variants.md has the commands of each.

Each (task, method, seed) is one ordinary run, `python train_rlvr.py --config examples/smollm2_sum3.yaml` (task
sum3; sum4, sum5: smollm2_sum4.yaml, smollm2_sum5.yaml), `examples/smollm2.yaml` (addition) or
`examples/smollm2_gsm8k.yaml` (gsm8k: GSM8K's word problems, worked in sentences) with the method's settings,
`seed=..` and greedy evaluation of the 200 --on problems before step 1 and after the last step (step 50;
`--set num_problems=N`: N steps, the spec's credit given a slower method's seconds), in its own process, one at a
time. The tasks' problem sets are the model folder's, examples/make_smollm2.py's (--task). The methods:
  sequence     the spec (credit=sequence)
  monte_carlo  credit=monte_carlo (credit_samples and credit_segment_tokens as the yaml or the defaults say)
  tree         credit=tree (tree_branching 2,2,2)
  entropy      top_entropy_quantile=0.2 (the spec's credit, the policy term on the top 20 % entropy tokens)
  steps        credit=steps with the built-in arithmetic checker
  steps_chain  credit=steps with the sum tasks' chain checker (examples/sum_steps.py:chain)
  steps_grounded  credit=steps with the built-in grounded checker (step_checker=grounded: arithmetic stated in a
               sentence, "so he bought 120 + 2 = 140 rabbits", for gsm8k's lines)
--errors, --masks and --operands read the sum tasks' lines: --errors says a gsm8k run is not read, --operands passes
over it (its problems are not sums), --masks names its tokens by the sums' kinds.
Figures, all from the run's files: greedy before -> after and the exact McNemar p (eval_summary.json), the
tokens generated in the steps (metrics.jsonl: generated_tokens, or response_tokens for the spec's credit),
the steps' seconds, and the points gained per million generated tokens; with --sampled (or later, for the
finished runs, --add-sampled), the sampled pass@1 of the start model and of final/ (evaluation-only runs as
benchmarks/smollm2_learning.py's: 2 samples on each of the first 100 problems). A recorded run's checkpoints/
is deleted (final/ and the logs stay): resuming a finished benchmark run has no use, and each is 1.6 GB.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))  # sum_steps.py, the sum tasks' chain checker (--operands)
sys.path.insert(0, str(ROOT))
from smollm2_learning import read_eval, run  # noqa: E402

METHODS = {"sequence": [], "monte_carlo": ["credit=monte_carlo"], "tree": ["credit=tree"],
           "entropy": ["top_entropy_quantile=0.2"],
           "steps": ["credit=steps"], "steps_chain": ["credit=steps", "step_checker=examples/sum_steps.py:chain"],
           "steps_grounded": ["credit=steps", "step_checker=grounded"]}
TASKS = {"sum3": ("examples/smollm2_sum3.yaml", "sum3-"), "addition": ("examples/smollm2.yaml", ""),
         "sum4": ("examples/smollm2_sum4.yaml", "sum4-"), "sum5": ("examples/smollm2_sum5.yaml", "sum5-"),
         "gsm8k": ("examples/smollm2_gsm8k.yaml", "gsm8k-")}
SUMS = ("sum3", "addition", "sum4", "sum5")  # the tasks whose problems are sums (--errors reads their lines)
PHASES = ("generation", "rewards", "credit", "logprob_backward", "optimizer")  # metrics.jsonl's timings


def run_folder(out: Path, task: str, method: str, seed: int, settings: list[str] = ()) -> Path:
    """A run's folder: TASK-METHOD-seedS, then each --set setting (credit_segment_tokens=4 -> -credit_segment_tokens4).
    The problem set (--on) is not in the name: dev runs go to their own --out."""
    return out / "-".join([task, method, f"seed{seed}", *(s.replace("=", "") for s in settings)])


def one_run(model: Path, task: str, method: str, seed: int, on: str, out: Path, sampled: bool,
            settings: list[str] = ()) -> dict:
    config, prefix = TASKS[task]
    folder = run_folder(out, task, method, seed, settings)
    common = [f"model={model}", f"eval_dataset={model / (prefix + on + '.json')}", f"seed={seed}", "overwrite=true"]
    wall = run(["--config", config, f"dataset={model / (prefix + 'train.json')}", f"output_dir={folder}", *common,
                *METHODS[method], *settings], out / f"{folder.name}.log")
    summary = json.loads((folder / "eval_summary.json").read_text())
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    greedy = read_eval(folder)
    generated = sum(m.get("generated_tokens", m["response_tokens"]) for m in metrics)
    gain = 100 * (greedy["after"]["accuracy"] - greedy["before"]["accuracy"])
    res = {"task": task, "method": method, "seed": seed, "on": on, "settings": list(settings), "greedy": greedy,
           "paired": summary["comparison"]["paired"], "steps": len(metrics),
           "nonzero_gradient_steps": sum(m["grad_norm"] > 0 for m in metrics), "generated_tokens": generated,
           "points_per_million_tokens": gain / (generated / 1e6), "step_seconds": sum(m["seconds"] for m in metrics),
           "points_per_hour": gain / (sum(m["seconds"] for m in metrics) / 3600),
           # where the steps' time went: sampling the group (a tree: its branches), scoring, the continuations
           # (monte_carlo) and the entropy mask, the forward + backward passes, the optimizer step
           "phase_seconds": {p: round(sum(m["timings"].get(p, 0.0) for m in metrics), 1) for p in PHASES},
           "run_seconds": wall}
    # a finished run's last checkpoint (weights and AdamW's moments, 1.6 GB for SmolLM2) is only for resuming it;
    # what the benchmark reads later (--add-sampled, --pictures) is final/ and the logs, kept
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    lines = line_figures(folder)
    if lines:
        res["lines"] = lines
    if sampled:
        res["sampled"] = sampled_pass1(model, task, method, seed, on, out, settings)
    return res


METRICS_KEYS = ("step", "problem_index", "correct", "group_size", "lines_checked", "lines_right", "lines_unknown",
                "responses_unchecked", "step_checker_failures")  # what line_figures reads of a credit=steps step
ROLLOUT_KEYS = ("step", "problem_index", "rollout", "response", "reward", "advantage", "tokens", "cut_at_limit")


def line_figures(folder: Path, edge: int = 10) -> dict | None:
    """A credit=steps run's line figures, from its metrics.jsonl and rollouts.jsonl (None for another credit): how
    many all-wrong groups it trained on (each group's own correct: with problems_per_step P > 1 a step's "groups"
    hold P of them) and how many of those had a gradient (a token advantage not 0: the spec's credit has none there;
    a checked line can give one); and, over its first and its last `edge` steps, the checked and unknown lines per
    response (each step's P x G responses), the share of checked lines that were right, the share of responses with
    no checked line (a policy that stops writing checkable lines games the checker: this figure would rise; the
    mean over the responses, each step's share weighed by its P x G) and the distinct responses per group, a group
    being a (step, problem) (equal responses: equal verdicts, no line's verdicts to standardize). The groups a step
    set aside (zero_variance=resample) were not trained on: not read. A missing or damaged file: one line, exit 2."""
    metrics = read_run_file(folder / "metrics.jsonl")
    if "lines_checked" not in metrics[0]:
        return None
    check_keys(folder / "metrics.jsonl", metrics, METRICS_KEYS)
    groups_of = {}  # each step's groups: P = 1, the step is its group
    for number, m in enumerate(metrics, 1):
        gs = groups_of[m["step"]] = m.get("groups", [m])
        if not isinstance(gs, list) or not all(isinstance(g, dict) and {"problem_index", "correct"} <= g.keys()
                                               for g in gs):
            fail(f"{folder / 'metrics.jsonl'} line {number} is not a record rlvr writes (a group without its "
                 f"problem_index or correct): the file is damaged; {RUN_FILE_FIX.format(folder=folder)}")
    texts: dict[tuple, set] = {}
    moved: dict[tuple, bool] = {}  # a group with a token advantage not 0: a gradient
    for r in read_run_file(folder / "rollouts.jsonl", ROLLOUT_KEYS):
        if r.get("set_aside"):
            continue
        key = (r["step"], r["problem_index"])
        texts.setdefault(key, set()).add(r["response"])
        moved[key] = moved.get(key, False) or any(a != 0 for a in r.get("token_advantages", [r["advantage"]]))

    def ends(ms: list[dict]) -> dict:
        steps = {m["step"] for m in ms}
        sizes = [m["group_size"] * len(groups_of[m["step"]]) for m in ms]  # each step's responses (P x G)
        n, checked = sum(sizes), sum(m["lines_checked"] for m in ms)
        distinct = [len(t) for (step, _), t in texts.items() if step in steps]
        return {"checked_per_response": checked / n, "unknown_per_response": sum(m["lines_unknown"] for m in ms) / n,
                "right_share": sum(m["lines_right"] for m in ms) / checked if checked else None,
                "responses_unchecked": sum(m["responses_unchecked"] * k for m, k in zip(ms, sizes)) / n,
                "distinct_per_group": sum(distinct) / len(distinct) if distinct else None}
    all_wrong = [(m["step"], g["problem_index"]) for m in metrics for g in groups_of[m["step"]] if g["correct"] == 0]
    return {"all_wrong_groups": len(all_wrong), "all_wrong_groups_with_gradient": sum(moved.get(k, False)
                                                                                      for k in all_wrong),
            "first": ends(metrics[:edge]), "last": ends(metrics[-edge:]),
            "responses_unchecked_most": max(m["responses_unchecked"] for m in metrics),  # at any one step
            "step_checker_failures": sum(m["step_checker_failures"] for m in metrics)}


def sampled_pass1(model: Path, task: str, method: str, seed: int, on: str, out: Path, settings: list[str] = ()
                  ) -> dict:
    """The sampled pass@1 of the start model and of the run's final/: two evaluation-only runs (num_problems=0)
    that sample 2 responses on each of the first 100 --on problems at the yaml's evaluation temperature. The
    start model's is the same for every method at one seed (same model, problems and seed), so it is run once
    per task, problem set and seed and read back after."""
    config, prefix = TASKS[task]
    folder = run_folder(out, task, method, seed, settings)
    common = [f"eval_dataset={model / (prefix + on + '.json')}", f"seed={seed}", "overwrite=true", "num_problems=0",
              "eval_samples=2", "eval_problems=100"]
    figures = {}
    for name, which, sfolder in (("before", model, out / f"{task}-{on}-seed{seed}-sampled-before"),
                                 ("after", folder / "final", out / f"{folder.name}-sampled-after")):
        if name == "after" or not (sfolder / "eval.jsonl").is_file():
            run(["--config", config, f"model={which}", f"output_dir={sfolder}", *common], out / f"{sfolder.name}.log")
        figures[name] = read_eval(sfolder)["model"]["accuracy"]
    return figures


def run_order(r: dict) -> tuple:
    return r["task"], r["on"], list(METHODS).index(r["method"]), r.get("settings", []), r["seed"]


def variant(r: dict) -> str:
    """The method as the tables name it: with its --set settings, if any (tree credit_segment_tokens=2)."""
    return " ".join([r["method"], *r.get("settings", [])])


def points(r: dict) -> float:
    """A run's change of held-out (or dev) greedy accuracy, in percentage points."""
    return 100 * (r["greedy"]["after"]["accuracy"] - r["greedy"]["before"]["accuracy"])


def table(results: list[dict]) -> str:
    lines = ["| task | method | seed | greedy before -> after | change | McNemar p | sampled pass@1 | "
             "steps with a gradient | generated tokens | points / M tokens | step seconds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        b, a = r["greedy"]["before"], r["greedy"]["after"]
        s = r.get("sampled")
        pass1 = f"{100 * s['before']:.1f} % -> {100 * s['after']:.1f} %" if s else "-"
        lines.append(f"| {r['task']} | {variant(r)} | {r['seed']} | {b['correct']}/{b['n']} -> {a['correct']}/{a['n']} "
                     f"| {points(r):+.1f} | {r['paired']['mcnemar_p']:.2g} | "
                     f"{pass1} | "
                     f"{r['nonzero_gradient_steps']}/{r['steps']} | {r['generated_tokens']:,} | "
                     f"{r['points_per_million_tokens']:+,.0f} | {r['step_seconds']:.0f} s |")
    return "\n".join(lines)


def answers_after(out: Path, r: dict) -> list[dict] | None:
    """The run's evaluation records after its last step; None where its folder is gone (results.json outlives the run
    folders: benchmarks/credit_methods.json is the committed copy)."""
    path = run_folder(out, r["task"], r["method"], r["seed"], r.get("settings", [])) / "eval.jsonl"
    if not path.is_file():
        return None
    return [x for x in map(json.loads, path.read_text().splitlines()) if x["phase"] == "after"]


def summary(results: list[dict], out: Path) -> str:
    """One row per (task, problem set, method with its settings) over its seeds: each seed's greedy after, the mean change and its spread,
    and the paired comparison of each seed's final model against the spec's credit at the same seed (problems
    won / lost, exact McNemar p), computed from the two runs' eval.jsonl."""
    import statistics

    import train_rlvr as T

    lines = ["| task | method | seeds | greedy after, per seed | change, mean (sd) | against `sequence`, per seed: "
             "won/lost (p) | sampled pass@1 change, mean | steps with a gradient | generated tokens | points / M tokens | "
             "step seconds, per seed |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    runs = {(r["task"], r["on"], variant(r), r["seed"]): r for r in results}
    for task, on, method in dict.fromkeys((r["task"], r["on"], variant(r)) for r in sorted(results, key=run_order)):
        rs = sorted((r for r in results if (r["task"], r["on"], variant(r)) == (task, on, method)),
                    key=lambda r: r["seed"])
        change = [points(r) for r in rs]
        against = []
        for r in rs:
            base = runs.get((task, on, "sequence", r["seed"]))
            if method == "sequence" or base is None:
                continue
            b, a = answers_after(out, base), answers_after(out, r)
            if a is None or b is None:
                against.append("n/a (run files not here)")
                continue
            b, a = T.correct_counts(b), T.correct_counts(a)
            won, lost = sum(a[i] > b[i] for i in a), sum(a[i] < b[i] for i in a)
            against.append(f"{won}/{lost} ({T.mcnemar_exact_p(won, lost):.2g})")
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        seconds = [f"{r['step_seconds']:.0f}" for r in rs]
        sd = f" ({statistics.stdev(change):.1f})" if len(change) > 1 else ""
        sampled = [100 * (r["sampled"]["after"] - r["sampled"]["before"]) for r in rs if "sampled" in r]
        sampled = f"{mean(sampled):+.1f} ({len(sampled)} seeds)" if sampled else "-"
        lines.append(f"| {task} | {method} | {len(rs)} | {', '.join(str(r['greedy']['after']['correct']) for r in rs)}"
                     f"/{rs[0]['greedy']['after']['n']} (from {rs[0]['greedy']['before']['correct']}) | "
                     f"{mean(change):+.1f}{sd} | {'; '.join(against) or '-'} | {sampled} | "
                     f"{mean([r['nonzero_gradient_steps'] for r in rs]):.1f}/{rs[0]['steps']} | "
                     f"{mean([r['generated_tokens'] for r in rs]):,.0f} | "
                     f"{mean([r['points_per_million_tokens'] for r in rs]):+,.0f} | "
                     f"{' / '.join(seconds)} s |")
    return "\n".join(lines)


def paired_differences(results: list[dict]) -> str:
    """Each method's change of greedy accuracy minus `sequence`'s at the same task, problem set and seed (the two
    runs share the seed's problems, sampling seed and start model): per seed, their mean and sd, and an exact
    two-sided sign test over the seeds (ties dropped; the binomial test of seeds above against seeds below)."""
    import statistics

    import train_rlvr as T

    change = {(r["task"], r["on"], variant(r), r["seed"]): points(r) for r in results}
    lines = ["| task | set | method | seeds | difference from `sequence` per seed (points) | mean (sd) | "
             "seeds above / below | sign test p |", "|---|---|---|---|---|---|---|---|"]
    for task, on, method in dict.fromkeys((r["task"], r["on"], variant(r)) for r in sorted(results, key=run_order)):
        seeds = sorted(seed for (t, o, m, seed) in change if (t, o, m) == (task, on, method)
                       and (task, on, "sequence", seed) in change)
        if method == "sequence" or not seeds:
            continue
        diffs = [change[task, on, method, seed] - change[task, on, "sequence", seed] for seed in seeds]
        above, below = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
        sd = f" ({statistics.stdev(diffs):.1f})" if len(diffs) > 1 else ""
        lines.append(f"| {task} | {on} | {method} | {', '.join(map(str, seeds))} | "
                     f"{', '.join(f'{d:+.1f}' for d in diffs)} | {statistics.mean(diffs):+.1f}{sd} | {above} / {below} | "
                     f"{T.mcnemar_exact_p(above, below):.2g} |")
    return "\n".join(lines)


def response_pieces(r: dict, tokenizer, eos) -> list:
    """A rollouts.jsonl record's response as its tokens' texts: re-tokenized, plus `eos` where it ended (not cut at
    the limit). Usable only where that gives back as many tokens as the record's per-token lists."""
    ids = tokenizer(r["response"], add_special_tokens=False)["input_ids"]
    return [tokenizer.decode([i]) for i in ids] + ([] if r["cut_at_limit"] else [eos])


def token_credit(r: dict) -> list[float]:
    """A rollouts.jsonl record's advantage per token before any entropy mask: its token_advantages, or for the
    spec's credit A_i on every token."""
    return r.get("token_advantages", [r["advantage"]] * r["tokens"])


def group_picture(folder: Path, tokenizer, eos: str, out: Path) -> Path | None:
    """One group of a finished run drawn as credit.png draws it (train_rlvr.credit_figure): the first step with
    reward variance, each token on a background coloured by the advantage the loss gave it. Its tokens are the
    response re-tokenized (plus the EOS where it ended), used only where that gives back as many tokens as the
    record's token_advantages; the spec's credit (no token_advantages) is drawn with A_i on every token, and under
    the entropy mask (the record's entropy_mask) a token it leaves out with 0. A credit=steps run (its records
    carry line_verdicts) is drawn at its first group whose rewards are all equal and whose checked lines still gave
    a token a nonzero advantage, the gradient the spec's credit lacks; failing one, as the others."""
    import train_rlvr as T

    rollouts = [json.loads(line) for line in (folder / "rollouts.jsonl").read_text().splitlines()]
    steps = sorted({r["step"] for r in rollouts if r["advantage"] != 0})
    if rollouts and "line_verdicts" in rollouts[0]:
        lines_only = {r["step"] for r in rollouts if any(r.get("token_advantages", []))} - set(steps)
        steps = sorted(lines_only) or steps
    if not steps:
        return None
    records = []
    for r in (r for r in rollouts if r["step"] == steps[0]):
        pieces = response_pieces(r, tokenizer, eos)
        credit = token_credit(r)
        if len(pieces) != len(credit):
            return None
        records.append(dict(r, tokens=pieces, token_advantages=credit))  # entropy_mask, if any, rides along
    T.save_picture(T.credit_figure(records), out)
    return out


def tree_siblings(folder: Path, tokenizer) -> str | None:
    """What a finished credit=tree run's groups were made of (docs/variants.md, "the identical sibling"): at each
    depth, how many nodes have children that all hold the same tokens (their advantages then cancel in the
    gradient); the groups with reward variance against the steps with a gradient; and the nonzero token
    advantages counted by segment. Tokens are the responses re-tokenized, as group_picture's; None for a run
    that is not a tree."""
    import yaml

    import train_rlvr as T

    cfg = yaml.safe_load((folder / "run_config.yaml").read_text())
    if cfg.get("credit") != "tree":
        return None
    levels = T.credit.tree_levels(str(cfg["tree_branching"]))
    rollouts = [json.loads(line) for line in (folder / "rollouts.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    paths = T.credit.leaf_paths(levels)
    same = [0] * len(levels)
    parents = [len(T.credit.leaf_paths(levels[:k])) * len(metrics) for k in range(len(levels))]
    by_segment: dict[int, int] = {}
    for step in sorted({r["step"] for r in rollouts}):
        group = sorted((r for r in rollouts if r["step"] == step), key=lambda r: r["rollout"])
        ids = [tokenizer(r["response"], add_special_tokens=False)["input_ids"] for r in group]

        def segment(leaf: int, k: int) -> tuple | None:
            starts = group[leaf]["segments"]
            return tuple(ids[leaf][starts[k]:starts[k + 1] if k + 1 < len(starts) else None]) if k < len(starts) \
                else None
        for k in range(len(levels)):
            children: dict[tuple, set] = {}
            for leaf, path in enumerate(paths):
                children.setdefault(path[:k], {}).setdefault(path[k], segment(leaf, k))
            same[k] += sum(len(set(c.values())) == 1 for c in children.values())
        for r in group:
            for k, start in enumerate(r["segments"]):
                end = r["segments"][k + 1] if k + 1 < len(r["segments"]) else len(r["token_advantages"])
                by_segment[k] = by_segment.get(k, 0) + sum(a != 0 for a in r["token_advantages"][start:end])
    varied = sum(len({r["reward"] for r in rollouts if r["step"] == m["step"]}) > 1 for m in metrics)
    return (f"nodes whose children hold the same tokens, by depth: "
            f"{', '.join(f'{n}/{d}' for n, d in zip(same, parents))}; steps with reward variance {varied}, with a "
            f"gradient {sum(m['grad_norm'] > 0 for m in metrics)} (of {len(metrics)}); nonzero token advantages by "
            f"segment: {', '.join(str(by_segment.get(k, 0)) for k in range(len(levels)))}")


TOKEN_KINDS = ("digit of a line's sum", "digit of a number added", "line end", "digit of the boxed answer",
               "other (+, =, words)", "EOS")


def token_kind(line: str, piece: str | None) -> str:
    """What a response token of the sum tasks is, from the text of its line before it: a digit after the line's
    "=" writes the sum (the step's decision), one inside \\boxed{ the answer copied from the last sum, any other
    digit a number added; then the line end, EOS (None) and the rest."""
    if piece is None:
        return "EOS"
    if "\n" in piece:
        return "line end"
    if piece.strip().isdigit():
        return ("digit of the boxed answer" if "\\boxed{" in line else
                "digit of a line's sum" if "=" in line else "digit of a number added")
    return "other (+, =, words)"


def mask_kinds(folder: Path, tokenizer) -> dict[str, tuple[int, int]] | None:
    """Where a finished entropy-mask run's policy term went: per TOKEN_KINDS, (tokens the mask kept, tokens) over
    every response of its 50 steps (rollouts.jsonl's entropy_mask). Tokens are the responses re-tokenized, as
    group_picture's, a response counted only where that gives back as many tokens as its mask; None for a run
    without the mask."""
    rollouts = [json.loads(line) for line in (folder / "rollouts.jsonl").read_text().splitlines()]
    if not any("entropy_mask" in r for r in rollouts):
        return None
    counts = {kind: [0, 0] for kind in TOKEN_KINDS}
    for r in rollouts:
        pieces = response_pieces(r, tokenizer, None)
        if len(pieces) != len(r["entropy_mask"]):
            continue
        line = ""  # the text of the token's line before it
        for piece, kept in zip(pieces, r["entropy_mask"]):
            kind = token_kind(line, piece)
            counts[kind][0] += kept
            counts[kind][1] += 1
            line = (line + (piece or "")).split("\n")[-1]
    return {kind: (k, n) for kind, (k, n) in counts.items()}


PLACES = ("right response", "before the error", "the error line", "after the error", "wrong, every line right")


def error_credit(folder: Path, tokenizer, problems: list[dict]) -> dict[str, tuple[int, int, int, float]]:
    """Where a finished run's credit went against its lines' own correctness: every token of its steps' responses,
    by PLACES (a right response; in a wrong one, its lines before the first line that is wrong by
    credit_diagnostic.lines_right, that line, the lines after it; a wrong response whose checked lines are all
    right, its answer line having gone wrong), as (tokens the loss pushed up, pushed down, left at 0, the sum of
    |A_it|). A token's A_it is the one the loss gave it: token_advantages, else the spec's A_i; under the entropy
    mask, 0 where the mask drops it. Tokens are the responses re-tokenized, as group_picture's, a response counted
    only where that gives back as many tokens as its record; a token holding a line end closes its line. problems:
    the training set the run's problem_index counts in."""
    from credit_diagnostic import lines_right

    counts = {place: [0, 0, 0, 0.0] for place in PLACES}
    for r in (json.loads(line) for line in (folder / "rollouts.jsonl").read_text().splitlines()):
        pieces = response_pieces(r, tokenizer, None)
        credit = token_credit(r)
        if "entropy_mask" in r:
            credit = [a * kept for a, kept in zip(credit, r["entropy_mask"])]
        if len(pieces) != len(credit):
            continue
        right = lines_right(problems[r["problem_index"]]["problem"], r["response"])
        error = next((k for k, ok in enumerate(right) if not ok), None)
        line = 0
        for piece, a in zip(pieces, credit):
            place = ("right response" if r["reward"] else "wrong, every line right" if error is None else
                     PLACES[1 + (line >= error) + (line > error)])
            c = counts[place]
            c[0], c[1], c[2], c[3] = c[0] + (a > 0), c[1] + (a < 0), c[2] + (a == 0), c[3] + abs(a)
            line += "\n" in (piece or "")
    return {place: tuple(c) for place, c in counts.items()}


def sum_terms(problem) -> list[int] | None:
    """A problem record's numbers where its problem is a sum of whole numbers ("23 + 4 + 7"), else None."""
    try:
        terms = [int(x) for x in str(problem.get("problem", "")).split(" + ")] if isinstance(problem, dict) else []
    except ValueError:
        return None
    return terms if len(terms) > 1 else None


def operand_lines(folder: Path) -> dict[str, dict[str, int]] | None:
    """A finished sum run's greedy answers before its first step and after its last (eval.jsonl), line by line: the
    lines a chain should hold (line k < the problem's terms - 1), how many the built-in arithmetic checker calls right
    (a line it cannot read, unknown, is no right sum), how many the sum tasks' chain checker calls right, and how many
    are right sums of numbers that are not the problem's chain (arithmetic right, chain wrong: what the arithmetic
    checker credits and the answer does not need). The problems are the run's eval_dataset (run_config.yaml); None
    where they are not sums. A run_config.yaml that is damaged or names no problem file here, an eval.jsonl that is
    damaged or counts past that file's problems: one line, exit 2."""
    import yaml

    import verifier
    from sum_steps import chain

    config, answers = folder / "run_config.yaml", folder / "eval.jsonl"
    fix = RUN_FILE_FIX.format(folder=folder)
    try:
        cfg = yaml.safe_load(config.read_text())
    except (yaml.YAMLError, ValueError) as e:  # not YAML, or not text
        mark = getattr(e, "problem_mark", None)
        why = " ".join(str(getattr(e, "problem", None) or e).split()) + (f", line {mark.line + 1}" if mark else "")
        fail(f"{config} is not YAML ({why}): the file is damaged; {fix}")
    dataset = cfg.get("eval_dataset") if isinstance(cfg, dict) else None
    if not dataset:
        fail(f"{config} names no eval_dataset (the problems of its answers); {fix}")
    path = Path(str(dataset))
    if not path.is_file():
        fail(f"{folder.name}'s eval_dataset {path} is no file here; put the problems the run evaluated there "
             f"(python examples/make_smollm2.py writes them), or move {folder} out of --out")
    try:
        problems = json.loads(path.read_text())
    except ValueError as e:  # not JSON, or not text
        fail(f"{path}, {folder.name}'s eval_dataset, is not JSON ({e}); put the problems the run evaluated there, or "
             f"move {folder} out of --out")
    if not isinstance(problems, list):
        fail(f"{path}, {folder.name}'s eval_dataset, holds no list of problems; put the problems the run evaluated "
             f"there, or move {folder} out of --out")
    out = {}
    for number, r in enumerate(read_run_file(answers, ("phase", "problem_index", "response")), 1):
        i = r["problem_index"]
        if not (type(i) is int and 0 <= i < len(problems)):
            fail(f"{answers} line {number}: problem_index {i!r} is not one of the {len(problems)} problems of {path}, "
                 f"its eval_dataset; put the problems the run evaluated there, or move {folder} out of --out")
        problem = problems[i]
        if sum_terms(problem) is None:
            return None
        c = out.setdefault(r["phase"], {"chain_lines": 0, "arithmetic_right": 0, "chain_right": 0,
                                        "right_sum_wrong_numbers": 0})
        lines = str(r["response"]).split("\n")
        for said, right in zip(map(verifier.arithmetic_verdict, lines), chain(lines, problem)):
            if right is not None:
                c["chain_lines"] += 1
                c["arithmetic_right"] += said is True
                c["chain_right"] += right
                c["right_sum_wrong_numbers"] += said is True and not right
    return out


def fail(message: str):
    """A user's mistake: one line on stderr and exit status 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


RUN_FILE_FIX = "run it again, or move {folder} out of --out"


def read_run_file(path: Path, keys: tuple[str, ...] = ()) -> list[dict]:
    """A finished run's JSON Lines file (metrics.jsonl, rollouts.jsonl, eval.jsonl), every line an object with `keys`:
    one missing, empty, cut short or edited is one line and exit 2 naming the file and the line, not a traceback."""
    fix = RUN_FILE_FIX.format(folder=path.parent)
    if not path.is_file():
        fail(f"{path.parent} has no {path.name} (a finished run has one); {fix}")
    try:
        lines = path.read_text().splitlines()
    except ValueError as e:  # not text (UnicodeDecodeError)
        fail(f"{path} is not text ({e}): the file is damaged; {fix}")
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except ValueError as e:
            fail(f"{path} line {number} is not a JSON record ({e.msg}, column {e.colno}): the file is damaged; {fix}")
    if not records:
        fail(f"{path} holds no record: the file is damaged; {fix}")
    check_keys(path, records, keys)
    return records


def check_keys(path: Path, records: list, keys: tuple[str, ...]) -> None:
    """Each of a run file's records an object with `keys` (record k: the file's line k + 1)."""
    for number, r in enumerate(records, 1):
        missing = [k for k in keys if k not in r] if isinstance(r, dict) else None
        if missing is None or missing:
            why = "not an object" if missing is None else f"it lacks {missing[0]}"
            fail(f"{path} line {number} is not a record rlvr writes ({why}): the file is damaged; "
                 f"{RUN_FILE_FIX.format(folder=path.parent)}")


RECORD_KEYS = frozenset({"task", "on", "method", "seed", "greedy", "paired", "steps", "nonzero_gradient_steps",
                         "generated_tokens", "points_per_million_tokens", "step_seconds"})  # what the tables read


def read_results(saved: Path) -> list[dict]:
    """--out's results.json, checked before it is used: a damaged one (cut short, edited) is one line and exit 2,
    not a traceback from the tables, nor, where runs are added, from rewriting it after a run's minutes."""
    fix = ("restore it from a copy (benchmarks/credit_methods.json holds the committed grid's) or pass --out the "
           "folder a run of this script wrote")
    try:
        results = json.loads(saved.read_text())
    except ValueError as e:  # not JSON (JSONDecodeError), or not text (UnicodeDecodeError)
        fail(f"{saved} is not JSON ({e}); {fix}")
    if not isinstance(results, list):
        fail(f"{saved} holds no list of runs; {fix}")
    for i, r in enumerate(results):
        missing = sorted(RECORD_KEYS - r.keys() if isinstance(r, dict) else RECORD_KEYS)
        if missing:
            fail(f"{saved}: its entry {i} is not a run's record (no {', '.join(missing)}); {fix}")
    return results


MODES = ("summary", "add_lines", "add_sampled", "pictures", "siblings", "masks", "errors", "operands")  # one a call


def check_inputs(args, model: Path, out: Path) -> None:
    """What each mode reads, there before it starts: --summary, --add-sampled and --add-lines --out's results.json;
    --pictures, --siblings, --masks, --errors and --operands --out's run folders and the model's tokenizer; training
    each task's training set, --add-sampled its --on set (the model folder's problem files, examples/make_smollm2.py's).
    --out is a folder, or can be made one. One mode a call: two together (--summary --add-lines) are refused."""
    chosen = [f"--{m.replace('_', '-')}" for m in MODES if getattr(args, m)]
    if len(chosen) > 1:  # each mode does its one thing and stops: the second would be ignored, silently
        fail(f"{chosen[0]} and {chosen[1]} are two modes, and each does its one thing and stops; pass one, and the "
             "other in a call of its own")
    blocker = next(p for p in (out, *out.parents) if p.exists())
    if not blocker.is_dir():
        fail(f"--out {out}: {blocker} is a file; pass --out a folder (runs/credit by default)")
    if (args.summary or args.add_sampled or args.add_lines) and not (out / "results.json").is_file():
        fail(f"{out} holds no results.json (no finished run of this script there); pass --out the folder a run of "
             "this script wrote (runs/credit by default)")
    reads_runs = args.pictures or args.siblings or args.masks or args.errors or args.operands
    if reads_runs and not out.is_dir():
        fail(f"{out} does not exist; pass --out the folder a run of this script wrote (runs/credit by default)")
    if reads_runs and not model.is_dir():
        fail(f"{model} does not exist; pass --model the model folder the runs trained (runs/smollm2 by default, "
             f"written by python examples/make_smollm2.py {args.model})")
    # each of these modes reads the responses back with the model's tokenizer (a fast one: tokenizer.json; a slow
    # one's files come with tokenizer_config.json), a folder of problems alone (--problems-only) has none
    if reads_runs and not any((model / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        fail(f"{model} holds no tokenizer (no tokenizer.json or tokenizer_config.json); pass --model the model folder "
             f"the runs trained (runs/smollm2 by default, written by python examples/make_smollm2.py {args.model})")
    if args.summary or reads_runs or args.add_lines:
        return
    split = args.on if args.add_sampled else "train"
    names = {t: TASKS[t][1] + split + ".json" for t in args.tasks}
    missing = [t for t in args.tasks if not (model / names[t]).is_file()]
    if missing:  # the addition sets come with the model; a sum task's are written on their own, named by --task
        how = "" if missing[0] == "addition" else f" (--problems-only --task {missing[0]} for the {missing[0]} task)"
        if missing[0] == "gsm8k":  # read from GSM8K's own files
            how = " --problems-only --task gsm8k --gsm8k-dir DIR (DIR: GSM8K's files, e.g. ../shared/data)"
        fail(f"{model} has no {names[missing[0]]}; run python examples/make_smollm2.py {args.model}{how}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="runs/smollm2")
    ap.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=["sum3"])
    # the default is the grid of the committed records (steps came later: --methods steps)
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=["sequence", "monte_carlo", "tree", "entropy"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--on", choices=["dev", "heldout"], default="dev")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="settings for every run of this call "
                    "beyond the method's (credit_segment_tokens=2): named in the run folder and in the tables")
    ap.add_argument("--sampled", action="store_true", help="also the sampled pass@1 (two evaluation-only runs each)")
    ap.add_argument("--out", default="runs/credit")
    ap.add_argument("--pictures", action="store_true", help="only draw one group of each finished run in --out "
                    "(FOLDER.png beside each run folder), and stop")
    ap.add_argument("--summary", action="store_true", help="only print the runs in --out/results.json, one row "
                    "each, then one row per task and method over its seeds (against the spec's credit at the same "
                    "seed), and stop")
    ap.add_argument("--siblings", action="store_true", help="only say, for each finished tree run in --out, how "
                    "often sibling nodes hold the same tokens and where the nonzero token advantages lie, and stop")
    ap.add_argument("--masks", action="store_true", help="only say, for each finished entropy-mask run in --out, "
                    "which kinds of token the mask kept (the digits of a line's sum, of a number added, ...), and stop")
    ap.add_argument("--errors", action="store_true", help="only say, for each finished run in --out, where its "
                    "credit went against its lines' correctness (a right response; a wrong one's lines before its "
                    "first wrong line, that line, after it), and stop")
    ap.add_argument("--operands", action="store_true", help="only say, for each finished sum run in --out, how "
                    "many of its greedy answers' chain lines (before and after training) the arithmetic checker and "
                    "the chain checker call right, and how many are right sums of numbers not the problem's, and stop")
    ap.add_argument("--add-lines", action="store_true", help="only add the line figures (credit=steps) to the "
                    "finished runs in --out/results.json that lack them, read from their metrics.jsonl, and stop")
    ap.add_argument("--add-sampled", action="store_true", help="only add the sampled pass@1 to the finished runs in "
                    "--out/results.json that lack it (those of --tasks, --methods, --seeds, --on), and stop")
    args = ap.parse_args()
    model, out = Path(args.model).resolve(), Path(args.out).resolve()
    check_inputs(args, model, out)
    if args.summary:
        results = read_results(out / "results.json")
        print(table(sorted(results, key=run_order)))
        print()
        print(summary(results, out))
        print()
        print(paired_differences(results))
        return 0
    if args.add_lines:
        saved = out / "results.json"
        results = read_results(saved)
        # a record that has its figures keeps them (its folder is not read); a run whose folder is gone stays as it
        # is; every other run's folder is read (a missing or damaged file: one line) before a line is printed or
        # results.json rewritten
        found = [None if "lines" in r or not folder.is_dir() else line_figures(folder)
                 for r, folder in ((r, run_folder(out, r["task"], r["method"], r["seed"], r.get("settings", [])))
                                   for r in results)]
        for r, lines in zip(results, found):
            if lines:
                r["lines"] = lines
                print(f"{r['task']} {variant(r)} seed {r['seed']}: {json.dumps(lines)}")
        saved.write_text(json.dumps(results, indent=1))
        return 0
    if args.add_sampled:
        saved = out / "results.json"
        results = read_results(saved)
        for r in sorted(results, key=run_order):
            if "sampled" in r or r["task"] not in args.tasks or r["method"] not in args.methods or \
                    r["seed"] not in args.seeds or r["on"] != args.on:
                continue
            r["sampled"] = sampled_pass1(model, r["task"], r["method"], r["seed"], r["on"], out, r.get("settings", []))
            saved.write_text(json.dumps(results, indent=1))
            print(table([r]).splitlines()[-1], flush=True)
        return 0
    if args.operands:  # the greedy answers' lines, read as text
        runs = (p for p in out.iterdir() if (p / "eval.jsonl").is_file() and (p / "run_config.yaml").is_file())
        found = [(folder, operand_lines(folder)) for folder in sorted(runs)]  # all read before a line is printed
        if not any(counts for _, counts in found):
            fail(f"{out} holds no finished sum run (a folder with eval.jsonl and run_config.yaml whose eval_dataset "
                 "holds sums); pass --out the folder a run of this script wrote (runs/credit by default)")
        for folder, counts in found:
            if counts:
                print(f"{folder.name}: " + "; ".join(
                    f"{phase} {c['chain_lines']} chain lines, arithmetic right {c['arithmetic_right']}, chain right "
                    f"{c['chain_right']}, right sums of wrong numbers {c['right_sum_wrong_numbers']}"
                    for phase, c in counts.items()))
        return 0
    if args.siblings or args.masks or args.errors or args.pictures:  # the finished run folders in --out, read with the tokenizer
        folders = sorted(p for p in out.iterdir() if (p / "rollouts.jsonl").is_file())
        for folder in folders:  # a damaged one said in one line before the first is drawn or counted
            read_run_file(folder / "rollouts.jsonl", ROLLOUT_KEYS)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        for folder in folders:
            if args.siblings:
                found = tree_siblings(folder, tokenizer)
                if found:
                    print(f"{folder.name}: {found}")
            elif args.errors:
                task = next((t for t in TASKS if folder.name.startswith(t + "-")), None)
                if task and task not in SUMS:  # credit_diagnostic.lines_right reads a sum's lines
                    print(f"{folder.name}: not read (--errors checks the lines of a sum task's responses; {task}'s "
                          "problems are not sums)")
                    continue
                train = model / (TASKS[task][1] + "train.json") if task else None
                if train is None or not train.is_file():
                    print(f"{folder.name}: not read (no task's training set in {model} for it)")
                    continue
                places = error_credit(folder, tokenizer, json.loads(train.read_text()))
                mass = sum(c[3] for c in places.values())
                print(f"{folder.name}: " + "; ".join(
                    f"{place} {up:,} up / {down:,} down / {zero:,} at 0 ({size / max(mass, 1e-12):.0%} of |A|)"
                    for place, (up, down, zero, size) in places.items()))
            elif args.masks:
                kinds = mask_kinds(folder, tokenizer)
                if kinds:
                    kept = sum(k for k, _ in kinds.values())
                    print(f"{folder.name}: kept {kept:,} of {sum(n for _, n in kinds.values()):,} tokens; " +
                          "; ".join(f"{kind} {k:,}/{n:,} ({k / max(n, 1):.0%} kept, {k / max(kept, 1):.0%} of the "
                                    f"kept)" for kind, (k, n) in kinds.items()))
            else:
                drawn = group_picture(folder, tokenizer, "<|im_end|>", out / f"{folder.name}.png")
                print(f"{folder.name}: " + str(drawn or "not drawn (no step with variance, or its tokens do not "
                                                        "re-tokenize)"))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    # results.json gathers every invocation's runs into one table: a run done again replaces its earlier record
    saved = out / "results.json"
    results = read_results(saved) if saved.is_file() else []
    for task in args.tasks:
        for seed in args.seeds:
            for method in args.methods:
                res = one_run(model, task, method, seed, args.on, out, args.sampled, args.set)
                results = [r for r in results if (r["task"], variant(r), r["seed"], r["on"]) !=
                           (task, variant(res), seed, args.on)] + [res]
                saved.write_text(json.dumps(results, indent=1))
                print(table([res]).splitlines()[-1], flush=True)
    print(table(sorted(results, key=run_order)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
