"""The spec's run with every setting at its default, on the tests' tiny stand-ins, reduced to what
must never change when a variant is added or the code is rearranged.

    python tests/default_run.py FOLDER     # writes FOLDER/expected.json and FOLDER/weights.safetensors

The fixture tests/fixtures/default-run is written this way (its README). Two uses:

- On any machine (tests/test_variants.py): what every CPU computes alike is compared exactly (the
  sampled responses, rewards, advantages, token counts, the table's first five columns); the
  float32 figures within the rounding another CPU's kernels make (`compare`).
- Bit for bit, on one machine: run it at the commit before a change and after it, and `cmp` the two
  expected.json (they hold the whole table, the sha256 of rollouts.jsonl and the bit patterns of the
  final weights). Nothing here is part of the product."""

import hashlib
import json
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import train_rlvr as T  # noqa: E402
from tiny_models import build_tiny_qwen3, build_tiny_tokenizer  # noqa: E402

# fake rewards (rollout 0 of each group is right) make every step train; steps 3 and 5 score all
# rollouts 0, so the run also shows the spec's zero-variance step (a zero gradient, momentum moving)
FLAT_STEPS = (3, 5)
SETTINGS = ["device=cpu", "group_size=4", "max_new_tokens=6", "num_problems=6", "learning_rate=1e-3",
            "save_every=0"]
EXACT = ("step", "problem_index", "rollout", "response", "answer", "status", "reward", "advantage", "tokens",
         "cut_at_limit")

# How far another CPU's float32 kernels take a figure. Each figure is a float32 reduction whose longest
# sum is the vocabulary's logsumexp (V terms), and a sum of n terms rounded in another order moves by at
# most n u times the sum of its terms' sizes (u = 2^-24, float32's unit roundoff): so each figure within
# V u of the size of what it adds up. For the loss, that is sum_i |A_i log p_i| / G, not the loss itself:
# the advantages sum to 0, so the loss is a difference of much larger terms. Measured across five kernel
# selections of one machine (ATEN_CPU_CAPABILITY avx512, avx2, default; MKL_ENABLE_INSTRUCTIONS AVX2,
# SSE4_2): at most 1.1e-7 relative (log-probs, grad norms), 3.9e-8 (update norms), 1.9e-8 of sum |A log p|
# (the loss); V u is 1.9e-5 for the tiny tokenizer's 320 tokens.
# The weights are compared as a whole, against how far the run moved them: AdamW's update m / (sqrt(v) +
# eps) turns a rounding-level difference of a near-zero gradient into a difference the size of the update
# itself, so they agree only as far as such weights are few. Measured at most 3.0e-6 of the distance
# moved (5.9e-5 when even the starting weights differed in their last bits); allowed 1e-3.
WEIGHTS_TOLERANCE = 1e-3


def fake_scores(step_of):
    def score(scorer, texts, gold):
        win = step_of["step"] not in FLAT_STEPS
        return [T.Score(1.0, None, "correct") if i == 0 and win else T.Score(0.0, None, "wrong") for i in range(len(texts))]
    return score


def fingerprint(t: torch.Tensor) -> list[int]:
    bits = t.reshape(-1).float().contiguous().view(torch.int32).to(torch.int64)
    return [int(bits.sum()), int((bits * bits).sum())]


def default_run(folder: Path, extra: list[str] = ()) -> dict:
    """Build the tiny model and data in `folder`, run the spec's step 6 times, return the summary
    (the run is in folder/run, the starting model in folder/model)."""
    from safetensors.torch import load_file

    model_dir = folder / "model"
    build_tiny_qwen3(model_dir, vocab_size=len(build_tiny_tokenizer(model_dir)))
    data = folder / "problems.json"
    data.write_text(json.dumps([{"problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(12)]))
    out = folder / "run"
    step_of = {"step": 0}
    real_step, real_score = T.train_step, T.score_rollouts

    def counting_step(step, *args, **kwargs):
        step_of["step"] = step
        return real_step(step, *args, **kwargs)
    T.train_step, T.score_rollouts = counting_step, fake_scores(step_of)
    args = ["--config", str(ROOT / "config.yaml"), f"model={model_dir}", f"dataset={data}", f"output_dir={out}",
            *SETTINGS, *extra]
    try:
        code = T.main(args)
    finally:
        T.train_step, T.score_rollouts = real_step, real_score
    assert code == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    weights = load_file(out / "final" / "model.safetensors")
    extras = T.table_extras(T.load_config(args))  # the run's extra columns (none for the spec's)
    return {
        # the seconds column dropped (a marker in its place, then cut off; rows of later epochs have none)
        "table": [line.removesuffix("-1.0").rstrip() for m in metrics
                  for line in T.format_row(dict(m, seconds=-1.0), extras).splitlines()],
        "rollouts_sha256": hashlib.sha256((out / "rollouts.jsonl").read_bytes()).hexdigest(),
        "weights": {k: fingerprint(v) for k, v in sorted(weights.items())},
        "steps": [{k: m[k] for k in ("step", "correct", "reward_mean", "reward_std", "response_tokens", "policy_loss",
                                     "grad_norm", "update_norm", "skipped")} for m in metrics],
        "rollouts": [{k: r[k] for k in (*EXACT, "sequence_log_prob")} for r in rollouts],
    }


def compare(got: dict, want: dict, got_dir: Path, want_weights: Path, vocab_size: int) -> list[str]:
    """What differs between two summaries beyond what another CPU's rounding explains (see above);
    got_dir: the folder default_run ran in (its run/final and its starting model/)."""
    from safetensors.torch import load_file

    rho, bad = vocab_size * 2.0 ** -24, []

    def close(what, a, b, size):
        if a is None or b is None:
            if a is not b:
                bad.append(f"{what}: {a} != {b}")
        elif not abs(a - b) <= rho * size:
            bad.append(f"{what}: {a} != {b} (more than {rho:.1e} x {size:.3g})")

    if [r.split()[:5] for r in got["table"]] != [r.split()[:5] for r in want["table"]]:
        bad.append(f"the table's first five columns: {got['table']} != {want['table']}")
    exact = lambda rows: [{k: r[k] for k in EXACT} for r in rows]  # noqa: E731
    if exact(got["rollouts"]) != exact(want["rollouts"]):
        bad.append("the rollouts (responses, rewards, advantages, tokens) differ")
        return bad
    for a, b in zip(got["rollouts"], want["rollouts"]):
        close(f"step {a['step']} rollout {a['rollout']} sequence_log_prob", a["sequence_log_prob"],
              b["sequence_log_prob"], abs(b["sequence_log_prob"] or 0))
    for a, b in zip(got["steps"], want["steps"], strict=True):
        if (a["skipped"], a["correct"]) != (b["skipped"], b["correct"]):
            bad.append(f"step {a['step']}: skipped/correct {a['skipped'], a['correct']} != {b['skipped'], b['correct']}")
        group = [r for r in want["rollouts"] if r["step"] == b["step"] and r["sequence_log_prob"] is not None]
        terms = sum(abs(r["advantage"] * r["sequence_log_prob"]) for r in group) / max(len(group), 1)
        close(f"step {a['step']} policy_loss", a["policy_loss"], b["policy_loss"], terms)
        for key in ("grad_norm", "update_norm"):
            close(f"step {a['step']} {key}", a[key], b[key], abs(b[key] or 0))
    start = load_file(got_dir / "model" / "model.safetensors")
    w, v = load_file(got_dir / "run" / "final" / "model.safetensors"), load_file(want_weights)
    if w.keys() != v.keys():
        return bad + [f"the final weights' names differ: {sorted(w)} != {sorted(v)}"]
    tied = start.get("lm_head.weight", start.get("model.embed_tokens.weight"))
    flat = lambda d: torch.cat([d[k].double().flatten() for k in sorted(w)])  # noqa: E731
    moved = (flat(v) - flat({k: start.get(k, tied) for k in w})).norm()
    apart = (flat(w) - flat(v)).norm()
    if not apart <= WEIGHTS_TOLERANCE * moved:
        bad.append(f"the final weights are {apart:.3g} apart, more than {WEIGHTS_TOLERANCE} x the {moved:.3g} moved")
    return bad


if __name__ == "__main__":
    import tempfile

    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        summary = default_run(Path(tmp))
        shutil.copyfile(Path(tmp) / "run" / "final" / "model.safetensors", target / "weights.safetensors")
    (target / "expected.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("\n".join(summary["table"]))
