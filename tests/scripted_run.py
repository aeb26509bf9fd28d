"""One scripted run of main() that several test files read (the `scripted` fixture): the decode loop
runs for real, but the sampled token is replaced by a fixed script, so that the real verifier sees
known responses (right, wrong and missing answers) and every figure of the table and summary is
known in advance. The run records what reached the model, the sampler, the verifier, the loss and
the optimizer. Nothing here is part of the product."""

import contextlib
import copy
import io
import json

import pytest
import torch

import train_rlvr as T
from run_helpers import main_args

# The spec's prompt, written out here rather than taken from the product.


SPEC_TEXT = ("You are a helpful math assistant.\nAnswer the question and write the final result on a new line as:\n"
             "\\boxed{ANSWER}\n\nQuestion:\n")


def cache_of(kwargs):
    """The KV cache a forward call was given, under either name (transformers 5.24 renamed it)."""
    return next((kwargs[k] for k in ("cache", "past_key_values") if kwargs.get(k) is not None), None)


def spec_prompt(problem):
    return SPEC_TEXT + problem + "\n\nAnswer:"


# ----------------------------------------------------------------------------------------------
# The scripted run: 3 problems ("What is i + i?", answer 2i), 4 rollouts each, real verifier


EOS_ID = 0


SCRIPT = {  # step -> the 4 responses' texts; None: no EOS, the response runs to max_new_tokens
    1: ["\\boxed{0}", "\\boxed{1}", "so 0", None],           # rewards 1 0 0 0: the one group with variance
    2: ["\\boxed{3}", "2", "\\boxed{}", "\\boxed{3}"],        # all 0
    3: ["\\boxed{4}"] * 4,                                    # all 1
}


CUT_TEXT = "x = 0 and more"  # the tiny tokenizer makes 9 tokens of it: exactly max_new_tokens


STATUSES = {1: ["correct", "wrong", "no_answer", "no_answer"], 2: ["wrong", "no_answer", "no_answer", "wrong"],
            3: ["correct"] * 4}


SETTINGS = ["num_problems=3", "max_new_tokens=9", "temperature=0.7", "top_p=0.85", "learning_rate=3e-3",
            "max_grad_norm=0.05", "save_every=0"]


def _script_tokens(tok):
    out = {}
    for step, texts in SCRIPT.items():
        out[step] = [tok(CUT_TEXT, add_special_tokens=False)["input_ids"] if t is None
                     else tok(t, add_special_tokens=False)["input_ids"] + [EOS_ID] for t in texts]
    assert len(out[1][3]) == 9
    return out


def run_scripted(tiny_model_dir, tiny_data_file, tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    script = _script_tokens(tok)
    rec = {"forwards": [], "sampling": [], "scored": [], "accumulate": [], "optimizer": []}
    at = {"step": None, "t": 0}
    real_load, real_streams, real_sample = T.load_model_and_tokenizer, T.rollout_streams, T.sample_next_token
    real_score, real_accumulate, real_step = T.score_rollouts, T.accumulate_policy_gradient, T.optimizer_step

    def load(*a, **k):
        model, tokenizer, eos_id = real_load(*a, **k)
        rec["initial"] = copy.deepcopy(model)

        inside = {"model": False}

        def hook(module, args, kwargs):
            inside["model"] = True
            ids = args[0] if args else kwargs["input_ids"]
            rec["forwards"].append({"ids": ids.clone(), "cached": cache_of(kwargs) is not None,
                                    "use_cache": kwargs.get("use_cache")})

        def decoder_hook(module, args, kwargs):  # the decoder alone: the rollouts' prompt pass run once (one row)
            if not inside["model"]:
                hook(module, args, kwargs)
                inside["model"] = False
        model.register_forward_pre_hook(hook, with_kwargs=True)
        model.register_forward_hook(lambda *a: inside.update(model=False))
        model.get_decoder().register_forward_pre_hook(decoder_hook, with_kwargs=True)
        return model, tokenizer, eos_id

    def streams(seed, step, rollouts, device):
        at.update(step=step, t=0)
        return real_streams(seed, step, rollouts, device)

    def sample(logits, temperature, top_p, u):
        rec["sampling"].append((temperature, top_p))
        real_sample(logits, temperature, top_p, u)  # runs, but the script decides
        t, at["t"] = at["t"], at["t"] + 1
        return torch.tensor([r[t] if t < len(r) else EOS_ID for r in script[at["step"]]])

    def score(scorer, texts, gold):
        rec["scored"].append((list(texts), gold))
        return real_score(scorer, texts, gold)

    def accumulate(model, params, prompt_ids, responses, advantages, *a, **k):
        rec["accumulate"].append((prompt_ids.clone(), [r.clone() for r in responses], advantages.clone()))
        return real_accumulate(model, params, prompt_ids, responses, advantages, *a, **k)

    def step(params, optimizer, max_grad_norm, *a):
        call = {"before": [p.detach().clone() for p in params], "raw": [p.grad.clone() for p in params],
                "lr": [g["lr"] for g in optimizer.param_groups], "max_grad_norm": max_grad_norm}
        call["result"] = real_step(params, optimizer, max_grad_norm, *a)
        call["clipped"] = [p.grad.clone() for p in params]
        call["after"] = [p.detach().clone() for p in params]
        rec["optimizer"].append(call)
        return call["result"]

    out = tmp_path_factory.mktemp("scripted") / "run"
    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        for name, fn in [("load_model_and_tokenizer", load), ("rollout_streams", streams),
                         ("sample_next_token", sample), ("score_rollouts", score),
                         ("accumulate_policy_gradient", accumulate), ("optimizer_step", step)]:
            mp.setattr(T, name, fn)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = T.main(main_args(tiny_model_dir, tiny_data_file, out, *SETTINGS))
    assert code == 0, stderr.getvalue()
    rec.update(tok=tok, script=script, out=out, stdout=stdout.getvalue(),
               metrics=[json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()],
               rollouts=[json.loads(l) for l in (out / "rollouts.jsonl").read_text().splitlines()])
    return rec
