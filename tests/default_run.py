"""The spec's run with every setting at its default, on the tests' tiny stand-ins, reduced to what
must never change when a variant is added: the table (without its seconds column), rollouts.jsonl
and the final weights. `python tests/default_run.py OUT.json` writes the fixture
tests/fixtures/default-run/expected.json (see its README); tests/test_variants.py compares a fresh
run with it. Nothing here is part of the product."""

import hashlib
import json
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


def fake_scores(step_of):
    def score(scorer, texts, gold):
        win = step_of["step"] not in FLAT_STEPS
        return [(1.0 if i == 0 and win else 0.0, None, "wrong") for i in range(len(texts))]
    return score


def fingerprint(t: torch.Tensor) -> list[int]:
    bits = t.reshape(-1).float().contiguous().view(torch.int32).to(torch.int64)
    return [int(bits.sum()), int((bits * bits).sum())]


def default_run(folder: Path, extra: list[str] = ()) -> dict:
    """Build the tiny model and data in `folder`, run the spec's step 6 times, return the summary."""
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
    try:
        code = T.main(["--config", str(ROOT / "config.yaml"), f"model={model_dir}", f"dataset={data}",
                       f"output_dir={out}", *SETTINGS, *extra])
    finally:
        T.train_step, T.score_rollouts = real_step, real_score
    assert code == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    weights = load_file(out / "final" / "model.safetensors")
    return {
        # the seconds column dropped (a marker in its place, then cut off; rows of later epochs have none)
        "table": [line.removesuffix("-1.0").rstrip() for m in metrics
                  for line in T.format_row(dict(m, seconds=-1.0)).splitlines()],
        "rollouts_sha256": hashlib.sha256((out / "rollouts.jsonl").read_bytes()).hexdigest(),
        "weights": {k: fingerprint(v) for k, v in sorted(weights.items())},
    }


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        summary = default_run(Path(tmp))
    Path(sys.argv[1]).write_text(json.dumps(summary, indent=1) + "\n")
    print("\n".join(summary["table"]))
