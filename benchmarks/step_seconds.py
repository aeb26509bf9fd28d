"""The whole step's seconds per problem at problems_per_step P = 1, 2, 4, 8: the SmolLM2 demo's run, for real.

    python benchmarks/step_seconds.py [--model runs/smollm2] [--problems 16] [--json benchmarks/step_seconds.json]

For each P, train_rlvr.main() runs examples/smollm2.yaml's settings (its prompt, 8 rollouts of up to 48 tokens,
learning rate 3e-6) on the first --problems problems of the demo's train.json, with no evaluation and one
checkpoint at the end, in a process of its own (so each P starts from the same weights and a fresh process).
From each run's metrics.jsonl: the step seconds (generation, rewards, log-probs and backward, the optimizer step)
over the problems, generation's response tokens per second, and the same without the first step (which holds
the first decode's warm-up). The runs draw the same problems and each problem's rollouts from the same random
streams, but after the first step their weights differ (fewer, larger steps), so their responses differ a little.
Run it alone: a second job on a 2-core machine makes every figure several times slower.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(model: Path, p: int, problems: int, out: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "train_rlvr.py"), "--config", str(ROOT / "examples" / "smollm2.yaml"),
           f"model={model}", f"dataset={model / 'train.json'}", f"output_dir={out}", f"num_problems={problems}",
           f"problems_per_step={p}", "eval_problems=0", "save_every=0", "overwrite=true"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"P = {p}: the run failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1]}")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    def figures(ms: list[dict]) -> dict:
        n = sum(len(m.get("problems", [m["problem_index"]])) for m in ms)
        seconds, gen = sum(m["seconds"] for m in ms), sum(m["timings"]["generation"] for m in ms)
        tokens = sum(m["response_tokens"] for m in ms)
        return {"problems": n, "steps": len(ms), "seconds": round(seconds, 2),
                "seconds_per_problem": round(seconds / n, 3), "generation_seconds_per_problem": round(gen / n, 3),
                "response_tokens": tokens, "generation_tokens_per_s": round(tokens / gen, 1)}

    return {"P": p, "all": figures(steps), "after_first_step": figures(steps[1:]) if len(steps) > 1 else None,
            "correct": sum(m["correct"] for m in steps)}


def problems_mistake(model: Path, problems: int) -> str | None:
    """What is wrong with the folder's train.json for runs of `problems` problems (None: nothing), found before
    the first run: not JSON, not a list, fewer records than that, a record that is not a problem."""
    train = model / "train.json"
    fix = f"write it again: python examples/make_smollm2.py {model} --problems-only"
    try:
        records = json.loads(train.read_text())
    except ValueError as e:  # not JSON (JSONDecodeError), or not text (UnicodeDecodeError)
        return f"{train} is not JSON ({e}); {fix}"
    if not isinstance(records, list):
        kind = {dict: "an object", str: "a string", bool: "true or false", type(None): "null"}.get(type(records),
                                                                                                  "a number")
        return f"{train} holds {kind}, not a list of problems; {fix}"
    if len(records) < problems:
        return (f"--problems {problems}: {train} holds {len(records)} problems; pass --problems {len(records)} or "
                "fewer" if records else f"{train} holds no problem; {fix}")
    bad = next((i for i, r in enumerate(records[:problems])
                if not (isinstance(r, dict) and {"problem", "answer"} <= r.keys())), None)
    if bad is not None:
        return f"{train} record {bad} is not a problem (an object with problem and answer); {fix}"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "runs" / "smollm2"), help="examples/make_smollm2.py's folder")
    ap.add_argument("--problems", type=int, default=16, help="problems per run (a multiple of 8)")
    ap.add_argument("--sizes", default="1,2,4,8", help="the P values")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    model = Path(args.model)
    if not (model / "config.json").is_file() or not (model / "train.json").is_file():
        print(f"error: --model {model}: no SmolLM2 folder there; run python examples/make_smollm2.py {model} first",
              file=sys.stderr)
        return 2
    # said before the first run, not after every run is done (minutes each)
    sizes = [x.strip() for x in args.sizes.split(",")]
    if not all(x.isdecimal() and int(x) > 0 for x in sizes):
        print(f"error: --sizes {args.sizes}: pass the P values as whole numbers of 1 or more, separated by commas "
              "(1,2,4,8)", file=sys.stderr)
        return 2
    if args.json and not Path(args.json).parent.is_dir():
        print(f"error: --json {args.json}: no folder {Path(args.json).parent} to write it in; create the folder "
              "first, or pass a path in an existing one", file=sys.stderr)
        return 2
    if args.json and Path(args.json).is_dir():
        print(f"error: --json {args.json} is a folder; pass the path of a file to write the results to",
              file=sys.stderr)
        return 2
    if args.problems < 1:  # 0 or fewer: the trainer refuses it (or evaluates only), after a run has started
        print(f"error: --problems {args.problems}: pass how many problems each run trains, 1 or more (16 by "
              "default)", file=sys.stderr)
        return 2
    mistake = problems_mistake(model, args.problems)
    if mistake:
        print(f"error: {mistake}", file=sys.stderr)
        return 2
    too_big = [p for p in map(int, sizes) if p > args.problems]
    if too_big:  # the trainer refuses it, after the smaller P's runs (minutes each)
        print(f"error: --sizes {args.sizes}: P = {too_big[0]} is more than --problems {args.problems}, the problems "
              f"of a run; pass P values of at most {args.problems}, or --problems {too_big[0]} or more",
              file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for p in map(int, sizes):
            results.append(run(model, p, args.problems, Path(tmp) / f"p{p}"))
            r = results[-1]
            later = r["after_first_step"] or r["all"]
            print(f"P = {p}: {r['all']['steps']} steps, {r['all']['seconds_per_problem']:.2f} s per problem "
                  f"({later['seconds_per_problem']:.2f} after the first step), generation "
                  f"{later['generation_tokens_per_s']:.1f} tokens/s, {r['correct']} correct", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "problems": args.problems,
                                               "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
