"""Build the demo policy: a small Qwen3 that can learn under RLVR on a CPU in minutes.

This script lives in examples/ (not tests/): it is part of the README's quick CPU run.

    python examples/make_demo.py runs/demo            # model + tokenizer + train.json + heldout.json

It writes to the folder a Qwen3 checkpoint loadable with from_pretrained (config, safetensors
weights, tokenizer), `train.json` and `heldout.json` in the trainer's data format (records with
problem, answer, level, subject, type and unique_id, like MATH-500), and `demo.json` (how it was
built: settings, final loss, timings).

The behaviour mirrors what RLVR first teaches a real base model: the model already knows the answer
but often fails the verifier's format. Each problem holds a 5-digit number and the answer is that
number ("What is $1 \\times 48213$?" -> 48213), so every answer depends on its problem, and the
held-out problems (never seen in pre-training) are answered by the copying the model learnt, not
from memory. The pre-training responses give the right number in one of three forms:

    good     " \\boxed{N}<|endoftext|>"                             reward 1
    no box   " It is $N$.<|endoftext|>"                              reward 0 (no_answer)
    ramble   " \\boxed{N}\\n\\nQuestion:\\n<made-up problem>\\n\\nAnswer: \\boxed{M}"  and no EOS

A response that does not stop is scored on its LAST box (verifier.extract_final_answer), so a
missing EOS alone is no failure (a response cut at max_new_tokens after a right box scores 1). The
ramble fails because, like a base model, it goes on to invent the next question and box that one's
answer: its last box is wrong, or unbalanced if it is cut inside it (no_answer). That takes ~30
tokens, so runs use max_new_tokens >= 40. The mix of forms depends on the subject (SUBJECTS): greedy
decoding boxes and stops on Prealgebra, writes no box on Algebra and rambles on Number Theory, so
greedy held-out accuracy starts near 1/3; sampling at temperature 0.8 / top-p 0.9 is right for
roughly 40 % of the rollouts, and most groups of 8 have reward variance.

Tokenizer: the real Qwen3 tokenizer copied from ../shared/qwen3-0.6b-base when that folder exists
(the spec's prompt applies unchanged), otherwise the tiny byte-level BPE of tests/tiny_models.py
(it merges a few digit pairs; numbers it would merge are not used, see one_token_per_digit).

Model: 2 layers, hidden 64, 4 heads, tied embeddings, the tokenizer's whole vocabulary (151,936 rows
for Qwen3). Pre-training only ever sees a few dozen distinct tokens, so it trains a small twin whose
vocabulary is those tokens plus one row shared by all the others; in the full model every unused
row is a copy of that row, so the full model's log-probabilities are exactly the twin's (checked
before saving) at a fraction of the cost of a 151,936-way softmax. Training pushes the shared row's
logit far down, so the trainer's top-p never has to cut through the block of equal unused logits.

Everything is deterministic given --seed (Python's random for the data, torch's seed for the
weights; one CPU thread by default).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from train_rlvr import SPEC_PROMPT, build_prompt  # noqa: E402  (the prompt the trainer uses)

EOS = "<|endoftext|>"
SHORT_PROMPT = SPEC_PROMPT[SPEC_PROMPT.index("Question:"):]  # "Question:\n{problem}\n\nAnswer:"
QWEN = ROOT.parent / "shared" / "qwen3-0.6b-base"

# subject -> (problem text, format mix (good, no box, ramble)). Every problem's answer is the number
# n it contains. The mixes put greedy decoding on each of the three forms (see the module docstring).
SUBJECTS = {
    "Prealgebra": ("What is $1 \\times {n}$?", (0.60, 0.20, 0.20)),    # greedy: box, then stop
    "Algebra": ("What is $x$ if $x={n}$?", (0.25, 0.65, 0.10)),         # greedy: no box
    "Number Theory": ("What is $0 + {n}$?", (0.25, 0.10, 0.65)),        # greedy: box, then ramble
}
FORMS = ("good", "nobox", "ramble")
DIGITS = 5  # every number has 5 digits: a copying head then needs one fixed offset (measured: with
            # 3-7 digits the copying took 4-5x more pre-training steps to appear)
RAMBLE_QUESTIONS = 1            # made-up questions after the ramble's first box (then no EOS at all)


# ----------------------------------------------------------------------------------------------
# The task

def random_problem(rng: random.Random, tokenizer) -> dict:
    subject = rng.choice(sorted(SUBJECTS))
    while True:  # no leading zero (the answer is n itself), one token per digit (see one_token_per_digit)
        n = str(rng.randint(10 ** (DIGITS - 1), 10 ** DIGITS - 1))
        if one_token_per_digit(tokenizer, n):
            break
    return {"problem": SUBJECTS[subject][0].replace("{n}", n), "answer": n, "level": 1, "subject": subject}


def one_token_per_digit(tokenizer, n: str) -> bool:
    """Qwen3's tokenizer always splits numbers into digits; the tiny BPE merges a few digit pairs
    ("23", "45", ...), and such numbers are left out: with one token per digit, every answer token
    sits the same number of tokens after the problem token it copies."""
    return len(tokenizer(f"${n}$", add_special_tokens=False)["input_ids"]) == len(n) + 2


def response_text(problem: dict, form: str, rng: random.Random, tokenizer) -> tuple[str, bool]:
    """(response text, whether it ends with EOS) in one of the three forms."""
    n = problem["answer"]
    if form == "good":
        return f" \\boxed{{{n}}}", True
    if form == "nobox":
        return f" It is ${n}$.", True
    text = f" \\boxed{{{n}}}"
    for _ in range(RAMBLE_QUESTIONS):  # like a base model: it invents the next question and answers it
        other = random_problem(rng, tokenizer)
        text += f"\n\nQuestion:\n{other['problem']}\n\nAnswer: \\boxed{{{other['answer']}}}"
    return text, False


def sample_form(problem: dict, rng: random.Random) -> str:
    return rng.choices(FORMS, weights=SUBJECTS[problem["subject"]][1])[0]


def make_splits(rng: random.Random, n_train: int, n_heldout: int, tokenizer) -> tuple[list[dict], list[dict]]:
    """Held-out problems first; train problems and pre-training problems never repeat them."""
    heldout, seen = [], set()
    while len(heldout) < n_heldout:
        p = random_problem(rng, tokenizer)
        if p["problem"] not in seen:
            seen.add(p["problem"])
            heldout.append(p)
    train = []
    while len(train) < n_train:
        p = random_problem(rng, tokenizer)
        if p["problem"] not in seen:
            seen.add(p["problem"])
            train.append(p)
    for split, records in (("heldout", heldout), ("train", train)):
        for i, p in enumerate(records):
            slug = p["subject"].lower().replace(" ", "_")
            p.update(type=p["subject"], unique_id=f"demo-{split}/{slug}/{i}.json")
    return train, heldout


# ----------------------------------------------------------------------------------------------
# Tokenizer

def load_tokenizer(out: Path, tokenizer_from: str):
    """The real Qwen3 tokenizer when available (copied into `out`), else the tiny BPE of the tests."""
    from transformers import AutoTokenizer

    src = QWEN if tokenizer_from == "auto" else Path(tokenizer_from)
    if tokenizer_from != "tiny" and (src / "tokenizer.json").exists():
        for f in src.iterdir():
            if f.name.startswith("tokenizer"):
                shutil.copyfile(f, out / f.name)  # not copy(): the source may be read-only
        return AutoTokenizer.from_pretrained(out), str(src)
    if tokenizer_from not in ("auto", "tiny"):
        raise SystemExit(f"no tokenizer.json in {src}")
    from tiny_models import build_tiny_tokenizer

    build_tiny_tokenizer(out)
    return AutoTokenizer.from_pretrained(out), "tiny BPE of tests/tiny_models.py"


def encode_example(tokenizer, eos_id: int, problem: dict, response: str, ends: bool,
                   template: str = SPEC_PROMPT) -> tuple[list[int], int]:
    """(prompt ids + response ids, number of prompt ids). Prompt and response are tokenized apart,
    exactly as the trainer sees them: it tokenizes the prompt alone and samples the response."""
    prompt = tokenizer(build_prompt(template, problem["problem"]), add_special_tokens=False)["input_ids"]
    resp = tokenizer(response, add_special_tokens=False)["input_ids"] + ([eos_id] if ends else [])
    return prompt + resp, len(prompt)


def pretraining_examples(tokenizer, eos_id: int, rng: random.Random, args, banned: set) -> list:
    """steps * batch tokenized sequences, in training order. The first short_steps batches use the
    spec prompt's last part only ("Question: ... Answer:", like a Q/A document without the
    instruction): the copy sits at the same offset among 3x fewer tokens, and the copying head forms
    in about half the steps (measured on 2 seeds: ~100 steps instead of ~200)."""
    drafts = []
    while len(drafts) < args.steps * args.batch:
        p = random_problem(rng, tokenizer)
        if p["problem"] in banned:  # held-out problems are never seen before evaluation
            continue
        text, ends = response_text(p, sample_form(p, rng), rng, tokenizer)
        template = SHORT_PROMPT if len(drafts) < args.short_steps * args.batch else SPEC_PROMPT
        drafts.append((build_prompt(template, p["problem"]), text, ends))
    # one batched call per side (the same tokens as one call per text, several times faster)
    prompts = tokenizer([d[0] for d in drafts], add_special_tokens=False)["input_ids"]
    responses = tokenizer([d[1] for d in drafts], add_special_tokens=False)["input_ids"]
    return [(q + r + ([eos_id] if d[2] else []), len(q)) for q, r, d in zip(prompts, responses, drafts)]


def answer_positions(tokenizer, ids: list[int], n_prompt: int) -> list[int]:
    """Positions of the response's first number (the copied answer), to watch the copying learnt."""
    found = []
    for i in range(n_prompt, len(ids)):
        piece = tokenizer.decode([ids[i]]).strip()
        if piece.isdigit():
            found.append(i)
        elif found:
            break
    return found


# ----------------------------------------------------------------------------------------------
# Model

def qwen3_config(vocab_size: int, eos_id: int, args):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, max_window_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, head_dim=args.head_dim, max_position_embeddings=512,
        # weights drawn with std 0.1 instead of Qwen3's 0.02 (made for width 1024; 0.1 ~ 1/sqrt(64)):
        # measured, the copying head then forms in ~100 steps for every seed tried; at 0.02 it took
        # 300 to 1000+ steps, or never within 400, depending on the seed
        initializer_range=args.init_std,
        tie_word_embeddings=True, eos_token_id=eos_id, bos_token_id=eos_id, pad_token_id=eos_id)


def full_vocab_logits(logits: torch.Tensor, n_unused: int) -> torch.Tensor:
    """The twin's last row is the one embedding shared by all n_unused tokens (the full model's
    unused rows are copies of it): each has the same logit, so together they enter the softmax as
    one logit + log(n_unused), exactly. Training pushes that logit far down, so the sampler's top-p
    always removes the whole block of equal unused logits at once and never has to split it."""
    if not n_unused:
        return logits
    return torch.cat([logits[..., :-1], logits[..., -1:] + math.log(n_unused)], dim=-1)


def shared_prefix(batch: list[tuple[list[int], int]]) -> int:
    """Length of the token prefix all sequences of the batch share (the spec prompt's fixed
    opening), kept short of every sequence's last prompt token."""
    first, n = batch[0][0], min(n_prompt for _, n_prompt in batch) - 1
    k = 0
    while k < n and all(ids[k] == first[k] for ids, _ in batch):
        k += 1
    return k


def pretrain(examples: list[tuple[list[int], int]], used: list[int], n_unused: int, eos_id: int, args,
             watch=None) -> tuple:
    """Supervised next-token training of the small twin on the response tokens (the prompt is
    given, as in RLVR). Returns (model, losses).

    The prompt's fixed opening (about 28 tokens of Qwen3's ~45-token prompt) is the same in every
    sequence: it runs once per batch, and its key/value cache is repeated for every row, which is the
    same computation as running it in every row (its gradient sums over the rows through the repeat)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    remap = {t: i for i, t in enumerate(used)}
    torch.manual_seed(args.seed)
    cfg = qwen3_config(len(used) + (n_unused > 0), remap[eos_id], args)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    # warm-up, constant, then a linear decay over the last 30 %: the constant phase keeps the rate
    # high while the copying circuit forms, the decay settles the format mix
    warm, decay = max(1, args.steps // 20), max(1, int(args.steps * 0.3))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm, max(0.0, (args.steps - s) / decay)))
    losses, copied = [], []
    model.train()
    for step in range(args.steps):
        batch = examples[step * args.batch:(step + 1) * args.batch]
        k = shared_prefix(batch)
        width = max(len(ids) for ids, _ in batch) - k
        x = torch.zeros(len(batch), width, dtype=torch.long)
        y = torch.full((len(batch), width), -100, dtype=torch.long)  # -100: no loss (prompt, padding)
        for i, (ids, n_prompt) in enumerate(batch):
            small = torch.tensor([remap[t] for t in ids])
            x[i, :len(ids) - k] = small[k:]  # right padding: causal attention never lets a real token see it
            y[i, n_prompt - 1 - k:len(ids) - 1 - k] = small[n_prompt:]  # position t predicts token t + 1
        cache = DynamicCache(config=cfg)
        if k:
            model.model(torch.tensor([[remap[t] for t in batch[0][0][:k]]]), cache=cache, use_cache=True)
            cache.batch_repeat_interleave(len(batch))
        logits = model(x, cache=cache, use_cache=True).logits
        keep = y != -100
        loss = torch.nn.functional.cross_entropy(full_vocab_logits(logits[keep], n_unused), y[keep])
        log_now = (step + 1) % max(1, args.steps // 10) == 0
        if watch is not None and log_now:  # teacher-forced accuracy on the copied answer's tokens
            rows = [(i, j - 1 - k, remap[ids[j]]) for i, (ids, n_prompt) in enumerate(batch)
                    for j in answer_positions(watch, ids, n_prompt)]
            r, c, tgt = (torch.tensor(v) for v in zip(*rows))
            copied.append(float((logits[r, c].argmax(-1) == tgt).float().mean()))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log_now:
            acc = f", answer tokens copied {copied[-1]:.3f}" if copied else ""
            print(f"  pre-training step {step + 1}/{args.steps}: loss {sum(losses[-50:]) / len(losses[-50:]):.4f}{acc}",
                  file=sys.stderr, flush=True)
    return model.eval(), losses


def expand_to_full_vocab(small, used: list[int], vocab_size: int, eos_id: int, args):
    """The full-vocabulary model: the twin's weights, its embedding rows placed at their real token
    ids, and its last (shared) row in every other row of the tied embedding and LM head."""
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_config(qwen3_config(vocab_size, eos_id, args), dtype=torch.float32)
    state = small.state_dict()
    emb = state["model.embed_tokens.weight"]
    big = emb[len(used):].expand(vocab_size, -1).clone() if len(emb) > len(used) else torch.zeros(vocab_size, emb.shape[1])
    big[torch.tensor(used)] = emb[:len(used)]
    state = {k: v for k, v in state.items() if k != "lm_head.weight"}  # tied to the embedding
    state["model.embed_tokens.weight"] = big
    missing, unexpected = full.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    full.tie_weights()
    return full.eval()


@torch.no_grad()
def check_equivalent(small, full, example: tuple[list[int], int], used: list[int], n_unused: int) -> float:
    """Largest difference between the two models' log-probabilities of a sequence's tokens."""
    ids, _ = example
    remap = {t: i for i, t in enumerate(used)}
    ls = full_vocab_logits(small(torch.tensor([[remap[t] for t in ids]])).logits[0], n_unused)
    lp_small = ls.log_softmax(-1)[:-1].gather(-1, torch.tensor([remap[t] for t in ids[1:]])[:, None])
    lp_full = full(torch.tensor([ids])).logits[0].log_softmax(-1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])
    return float((lp_small - lp_full).abs().max())


# ----------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="output folder (model, tokenizer, train.json, heldout.json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", default="auto",
                    help="auto (../shared/qwen3-0.6b-base if present, else tiny), tiny, or a folder")
    ap.add_argument("--steps", type=int, default=300, help="pre-training steps")
    ap.add_argument("--short-steps", type=int, default=150, help="of which the first use the short prompt")
    ap.add_argument("--batch", type=int, default=32, help="pre-training sequences per step")
    ap.add_argument("--lr", type=float, default=1e-2, help="pre-training peak learning rate")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--init-std", type=float, default=0.1, help="std of the initial weights")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (the model is too small to gain from more; on a busy machine "
                         "extra threads mostly wait on each other)")
    ap.add_argument("--train-problems", type=int, default=500)
    ap.add_argument("--heldout-problems", type=int, default=500)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    torch.set_num_threads(args.threads)
    out = Path(args.folder)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, tok_source = load_tokenizer(out, args.tokenizer)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    assert tokenizer.convert_ids_to_tokens(eos_id) == EOS, "the tokenizer has no <|endoftext|> token"

    rng = random.Random(args.seed)
    train, heldout = make_splits(rng, args.train_problems, args.heldout_problems, tokenizer)
    examples = pretraining_examples(tokenizer, eos_id, rng, args, {p["problem"] for p in heldout})

    # the token ids pre-training and the data sets use; every other row of the embedding stays 0
    used = {eos_id}
    for ids, _ in examples:
        used.update(ids)
    for p in train + heldout:
        used.update(encode_example(tokenizer, eos_id, p, response_text(p, "good", rng, tokenizer)[0], True)[0])
    used = sorted(used)
    vocab_size = max(len(tokenizer), eos_id + 1)
    if tok_source != "tiny BPE of tests/tiny_models.py":
        from transformers import AutoConfig

        vocab_size = AutoConfig.from_pretrained(QWEN if args.tokenizer == "auto" else args.tokenizer).vocab_size
    n_unused = vocab_size - len(used)
    print(f"tokenizer: {tok_source}; vocabulary {vocab_size}, {len(used)} tokens used; "
          f"{len(examples)} pre-training sequences", file=sys.stderr, flush=True)

    t1 = time.perf_counter()
    small, losses = pretrain(examples, used, n_unused, eos_id, args, watch=tokenizer)
    t2 = time.perf_counter()
    full = expand_to_full_vocab(small, used, vocab_size, eos_id, args)
    diff = check_equivalent(copy.deepcopy(small).double(), copy.deepcopy(full).double(), examples[0], used, n_unused)
    assert diff < 1e-9, f"the full-vocabulary model differs from its twin by {diff}"

    full.generation_config.eos_token_id = eos_id
    full.generation_config.pad_token_id = eos_id
    full.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    for name, records in (("train.json", train), ("heldout.json", heldout)):
        (out / name).write_text(json.dumps(records, indent=1))
    n_params = sum(p.numel() for p in full.parameters())
    info = {"seed": args.seed, "tokenizer": tok_source, "vocab_size": vocab_size, "tokens_used": len(used),
            "hidden": args.hidden, "layers": args.layers, "parameters": n_params,
            "parameters_in_used_rows": n_params - max(0, n_unused - 1) * args.hidden,
            "pretrain_steps": args.steps, "batch": args.batch, "lr": args.lr,
            "final_loss": sum(losses[-50:]) / len(losses[-50:]), "twin_max_logprob_diff": diff,
            "subjects": {s: {"problem": t, "mix": dict(zip(FORMS, m))} for s, (t, m) in SUBJECTS.items()},
            "seconds": {"data": round(t1 - t0, 1), "pretrain": round(t2 - t1, 1),
                        "total": round(time.perf_counter() - t0, 1)}}
    (out / "demo.json").write_text(json.dumps(info, indent=1))
    print(f"wrote {out}: {n_params:,} parameters ({info['parameters_in_used_rows']:,} distinct), "
          f"final pre-training loss {info['final_loss']:.4f}, {info['seconds']['total']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
