"""Before any training: where could finer credit than one advantage per response help? (docs/variants.md)

    python benchmarks/credit_diagnostic.py --tasks addition sum3 sum4 sum5 --problems 50 --out runs/diagnostic

On a task's dev problems (runs/smollm2, examples/make_smollm2.py), the start model samples 8 responses per problem
with the run's sampler (its yaml's prompt, temperature 0.8, top-p 0.9, max_new_tokens) and answers each greedily.
Every line of a response is checked arithmetically: line k ("x + y = z") is right when x is the sum of the
problem's first k + 1 numbers, y its next number and z their sum (for the one-line addition task: the number
after "=" is the sum). Reported per task:
  greedy        the start model's greedy accuracy on these problems
  sampled       the sampled responses' accuracy (the verifier's reward)
  wrong, first k lines right   of the wrong responses, the share whose first k lines are all right (k = 1, 2, ..)
  zero-variance groups         groups of 8 whose rewards are all equal (the spec's credit learns nothing there)
  all-wrong groups             and of them, the share holding a response whose first line is right (where a
                               Monte Carlo value gives a gradient the spec's credit cannot)
Fine credit can only win where wrong responses with right early lines are common. Writes OUT/diagnostic.json
and prints a table. Responses are sampled 8 problems (64 rows) per batch, each row from its own stream.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train_rlvr as T  # noqa: E402
import verifier  # noqa: E402

TASKS = {"addition": ("examples/smollm2.yaml", ""), "sum3": ("examples/smollm2_sum3.yaml", "sum3-"),
         "sum4": ("examples/smollm2_sum4.yaml", "sum4-"), "sum5": ("examples/smollm2_sum5.yaml", "sum5-")}
LINE = re.compile(r"^\s*(?:[-*+]\s+)?(\d+)\s*\+\s*(\d+)\s*=\s*(\d+)")


def lines_right(problem: str, response: str) -> list[bool]:
    """Whether each step of the response is right, in order (the steps a right response takes: one for an
    addition, one line per number after the first for a chain)."""
    terms = [int(x) for x in problem.split(" + ")]
    if len(terms) == 2:  # addition: the response continues "a + b =" with the sum
        first = re.match(r"\s*(\d+)", response)
        return [bool(first) and int(first[1]) == sum(terms)]
    right = []
    for k, line in enumerate(response.splitlines()[:len(terms) - 1]):
        m = LINE.match(line)
        right.append(bool(m) and (int(m[1]), int(m[2]), int(m[3])) == (sum(terms[:k + 1]), terms[k + 1],
                                                                        sum(terms[:k + 2])))
    return right + [False] * (len(terms) - 1 - len(right))


def figures(problems: list[dict], greedy: list[str], groups: list[list[str]]) -> dict:
    """The table's figures from the greedy responses and each problem's sampled group."""
    rewards = [[verifier.reward(x, p["answer"]) for x in g] for p, g in zip(problems, groups)]
    steps = len(lines_right(problems[0]["problem"], ""))
    wrong = [lines_right(p["problem"], x) for p, g, r in zip(problems, groups, rewards) for x, v in zip(g, r) if not v]
    all_wrong = [k for k, r in enumerate(rewards) if not any(r)]
    started = [k for k in all_wrong if any(lines_right(problems[k]["problem"], x)[0] for x in groups[k])]
    share = lambda part, whole: round(part / whole, 4) if whole else None  # noqa: E731
    return {
        "problems": len(problems), "steps": steps,
        "greedy": share(sum(verifier.reward(x, p["answer"]) for p, x in zip(problems, greedy)), len(problems)),
        "sampled": share(sum(map(sum, rewards)), sum(map(len, rewards))),
        "wrong_responses": len(wrong),
        "wrong_first_k_right": [share(sum(all(w[:k]) for w in wrong), len(wrong)) for k in range(1, steps + 1)],
        "zero_variance_groups": share(sum(len(set(r)) == 1 for r in rewards), len(rewards)),
        "all_wrong_groups": share(len(all_wrong), len(rewards)),
        "all_wrong_with_a_right_first_line": share(len(started), len(all_wrong)),
    }


@torch.no_grad()
def sample(model, prompts: list[torch.Tensor], cfg, eos_id: int, seed: int, samples: int, batch: int):
    """samples responses per prompt (each row its own stream, keyed by the problem and the sample) and one greedy,
    decoded `batch` problems at a time."""
    groups, greedy = [], []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start:start + batch]
        streams = [torch.Generator().manual_seed(T.stream_seed(seed, "diagnostic", start + i, k))
                   for i in range(len(chunk)) for k in range(samples)]
        out, _ = T.decode(model, [p for p in chunk for _ in range(samples)], cfg.max_new_tokens, eos_id,
                          T.sampling_pick(streams, cfg.temperature, cfg.top_p, "cpu"), T.nullcontext(),
                          drop_finished=True)
        groups += [out[i * samples:(i + 1) * samples] for i in range(len(chunk))]
        out, _ = T.decode(model, chunk, cfg.max_new_tokens, eos_id, T.greedy_pick, T.nullcontext(), drop_finished=True)
        greedy += out
        print(f"  {start + len(chunk)}/{len(prompts)} problems", file=sys.stderr, flush=True)
    return groups, greedy


def dev_problems(dev: Path, n: int, fix: str) -> tuple[list[dict], str | None]:
    """The first n records of a task's dev problems, checked before the model is loaded (the figures read each one as
    a sum, after minutes of sampling): a JSON list of objects whose problem is a sum of whole numbers, as many in each
    as in the first, and whose answer is that sum. Returns the records and None, or [] and the one-line mistake."""
    try:
        records = json.loads(dev.read_text())
    except ValueError as e:  # not JSON (JSONDecodeError), or not text (UnicodeDecodeError)
        return [], f"{dev} is not JSON ({e}); {fix}"
    if not isinstance(records, list):
        kind = {dict: "an object", str: "a string", bool: "true or false", type(None): "null"}.get(type(records),
                                                                                                  "a number")
        return [], f"{dev} holds {kind}, not a list of problems; {fix}"
    if not records:
        return [], f"{dev} holds no problem; {fix}"
    count = None
    for i, r in enumerate(records[:n]):
        if not isinstance(r, dict):
            return [], f"{dev} record {i} is not an object (a problem and its answer); {fix}"
        text = r.get("problem")
        try:
            terms = [int(x) for x in text.split(" + ")] if isinstance(text, str) else []
        except ValueError:
            terms = []
        if len(terms) < 2:  # lines_right reads every problem as a sum, after the sampling
            return [], f"{dev} record {i}'s problem {text!r:.60} is not a sum of whole numbers (23 + 4 + 5); {fix}"
        count = count or len(terms)
        if len(terms) != count:
            return [], (f"{dev} record {i}'s problem {text!r} is a sum of {len(terms)} numbers, record 0's of {count}; "
                        f"a task's sums have one length: {fix}")
        if str(r.get("answer")).strip() != str(sum(terms)):
            return [], f"{dev} record {i}'s answer {r.get('answer')!r} is not its sum {sum(terms)} ({text}); {fix}"
    return records[:n], None


def error(message: str) -> int:
    """A user's mistake: one line on stderr; main returns the exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="runs/smollm2", help="the make_smollm2 folder (model and problem sets)")
    ap.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=["addition", "sum3", "sum4", "sum5"])
    ap.add_argument("--problems", type=int, default=50, help="the first N dev problems of each task")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/diagnostic")
    args = ap.parse_args(argv)
    model_dir, out = Path(args.model), Path(args.out)
    # a user's mistake is said here, before the model is loaded and any response sampled (minutes a task)
    if args.problems < 1:  # a negative N would slice off the last N problems: all but them, silently
        return error(f"--problems {args.problems}: pass how many dev problems of each task to sample, 1 or more")
    if args.samples < 1:
        return error(f"--samples {args.samples}: pass how many responses to sample per problem, 1 or more")
    blocker = next(p for p in (out, *out.parents) if p.exists())  # the folder is made only after the sampling
    if not blocker.is_dir():
        return error(f"--out {out}: {blocker} is a file; pass a folder to write diagnostic.json into")
    dev_records = {}
    for task in args.tasks:
        dev = model_dir / f"{TASKS[task][1]}dev.json"
        if not dev.is_file():
            return error(f"{dev} is missing; run python examples/make_smollm2.py {model_dir} --problems-only "
                         f"--task {task} (and the model first: examples/smollm2.yaml says how)")
        dev_records[task], mistake = dev_problems(dev, args.problems, "write the task's problems again: python "
                                                  f"examples/make_smollm2.py {model_dir} --problems-only --task {task}")
        if mistake:
            return error(mistake)
    if not (model_dir / "config.json").is_file():  # problems written with --problems-only, the model not
        return error(f"{model_dir} holds the problems but no model (no config.json); run python "
                     f"examples/make_smollm2.py {model_dir} (without --problems-only) to write the model beside them")
    torch.manual_seed(0)
    results = {}
    for task in args.tasks:
        config = TASKS[task][0]
        cfg = T.load_config(["--config", str(ROOT / config), f"model={model_dir}"])
        # damaged or foreign model files: the trainer's one line; every task loads the same folder, so it is the
        # first task's load that fails, before any sampling
        try:
            model, tokenizer, eos_id = T.load_model_and_tokenizer(cfg, torch.device("cpu"), "fp32")
        except T.UserError as e:
            return error(str(e))
        try:  # a prompt past the model's context, say: the trainer's one line
            problems = T.check_problems([dict(r, index=i) for i, r in enumerate(dev_records[task])], cfg, tokenizer,
                                        model.config.max_position_embeddings)
        except T.UserError as e:
            return error(str(e))
        print(f"{task}: {len(problems)} dev problems x {args.samples} samples", file=sys.stderr)
        began = time.perf_counter()
        groups, greedy = sample(model, [torch.tensor(p["prompt_ids"]) for p in problems], cfg, eos_id, args.seed,
                                args.samples, 8)
        text = lambda ids: tokenizer.decode(ids.tolist(), skip_special_tokens=True)  # noqa: E731
        results[task] = dict(figures(problems, [text(x) for x in greedy], [[text(x) for x in g] for g in groups]),
                             seconds=round(time.perf_counter() - began, 1))
    out.mkdir(parents=True, exist_ok=True)
    (out / "diagnostic.json").write_text(json.dumps({"seed": args.seed, "samples": args.samples, **results},
                                                    indent=1) + "\n")
    print("| task | steps | greedy | sampled | wrong, first k lines right (k = 1, 2, ..) | zero-variance groups | "
          "all-wrong groups | of them, a right first line |")
    print("|---|---|---|---|---|---|---|---|")
    pct = lambda x: "n/a" if x is None else f"{100 * x:.0f} %"  # noqa: E731
    for task, r in results.items():
        print(f"| {task} | {r['steps']} | {pct(r['greedy'])} | {pct(r['sampled'])} | "
              f"{', '.join(map(pct, r['wrong_first_k_right']))} ({r['wrong_responses']} wrong) | "
              f"{pct(r['zero_variance_groups'])} | {pct(r['all_wrong_groups'])} | "
              f"{pct(r['all_wrong_with_a_right_first_line'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
