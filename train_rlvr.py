"""rlvr: one-GPU RLVR on a base model, exactly as docs/spec.md describes it.

For each problem: sample a group of rollouts, score them with a final-answer verifier (1 or 0),
standardize the rewards within the group, backpropagate the sequence-sum policy-gradient loss one
response at a time, clip the gradient and take one AdamW step. One table row per step on stdout.

    python train_rlvr.py [--config config.yaml] [key=value ...]

With eval_problems > 0 it also evaluates the model on MATH-500 (greedy by default) before step 1
and after the last step, and prints a before/after table; num_problems=0 evaluates a model only.

Read top to bottom: the settings, the data and prompt, then the spec's moves in the order a step runs them
(rollouts, rewards, advantages, log-probabilities and loss, optimizer step), then the step and the loop
(train_step, run): the spec's path, in its first 950 lines. The credit methods' formulas live in credit.py
(assign_credit is its one door; with the spec's credit nothing there is called), the verifier in verifier.py.
After run, the machinery they call by name: the run's start, config reading and validation, data readers, the
model, the sampler's machinery, decoders, the credit methods' sampling, the tree's sampling, the reward function,
the optimizer step's update norm and undo, the step's record, logging and trackers, evaluation, checkpoints and
the output folder, faults and signals, processes (torchrun), main.
"""

from __future__ import annotations

import argparse
import codecs
import copy
import dataclasses
import datetime
import errno
import gzip
import hashlib
import importlib.util
import inspect
import io
import itertools
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager, nullcontext, redirect_stderr, redirect_stdout, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import yaml
from safetensors.torch import load_file, save_file
from tqdm import tqdm

import credit
import verifier


# ----------------------------------------------------------------------------------------------
# Settings

SPEC_PROMPT = (
    "You are a helpful math assistant.\n"
    "Answer the question and write the final result on a new line as:\n"
    "\\boxed{ANSWER}\n\nQuestion:\n{problem}\n\nAnswer:"
)

MATH_TRAIN_URL = ("https://raw.githubusercontent.com/rasbt/math_full_minus_math500/"
                  "refs/heads/main/math_full_minus_math500.json")


@dataclass
class Config:
    model: str = "Qwen/Qwen3-0.6B-Base"
    revision: str = "da87bfb608c14b7cf20ba1ce41287e8de496c0cd"
    dataset: str = MATH_TRAIN_URL
    dataset_split: str = "train"
    problem_field: str = "problem"
    answer_field: str = "answer"
    dataset_config: str = ""  # a hub set's configuration name (openai/gsm8k: main); empty: its only one
    answer_format: str = "auto"  # how answer_field holds the reference: auto, plain, gsm8k, boxed (reference_answer)
    start_index: int = 0
    num_problems: int = 50
    prompt_template: str = SPEC_PROMPT
    group_size: int = 8
    problems_per_step: int = 1  # P: the groups of one AdamW step, sampled in one batch; the loss their mean (1: the spec)
    temperature: float = 0.8
    top_p: float = 0.9
    max_new_tokens: int = 512
    eos_token: str = "<|endoftext|>"
    learning_rate: float = 1e-5
    lr_schedule: str = "constant"  # constant (the spec), linear or cosine: decays to 0 a step after the last (transformers')
    warmup_steps: int = 0  # steps whose learning rate rises linearly from 0 to learning_rate first
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    std_eps: float = 1e-4
    # variants of the spec's step (docs/variants.md); each default is the spec's
    advantage_std: str = "group"
    loss_aggregation: str = "sequence_sum"
    zero_variance: str = "step"
    resample_limit: int = 8  # zero_variance=resample: groups drawn per optimizer step at most
    format_reward: float = 0.0
    reward_function: str = ""  # path/to/file.py:name, called as name(response, answer, record) -> float; empty: none
    reward_weights: str = ""  # "v,f": v * the verifier's reward + f * reward_function's; empty: the function alone
    kl_coef: float = 0.0
    ppo_epochs: int = 1
    clip_eps: float = 0.2
    clip_eps_high: float = 0.0  # DAPO's clip-higher: the ratio's upper bound is 1 + clip_eps_high (0: clip_eps)
    mask_truncated_completions: bool = False  # TRL's: a response cut at max_new_tokens has no term in the loss
    # which tokens earn the credit (docs/variants.md, "Credit"); each default is the spec's: one A_i per response
    credit: str = "sequence"  # sequence (the spec), monte_carlo (VinePPO, SPO-chain), tree (SPO-tree), steps (checked)
    credit_segment_tokens: int = 32  # a segment's most tokens (cut at a line or sentence end where there is one)
    credit_samples: int = 4  # monte_carlo: continuations sampled at each cut
    credit_scale: str = "auto"  # a change of value as an advantage: auto (the method's paper), raw, group, whiten
    tree_branching: str = "2,2,2"  # tree: the branches at each level, whose product is group_size
    tree_weighting: str = "leaf"  # tree: leaf (every leaf trains its whole path: unbiased) or once (a node once)
    top_entropy_quantile: float = 1.0  # TRL's: the policy term only on the group's highest-entropy tokens (1: all)
    step_checker: str = "arithmetic"  # steps: arithmetic, grounded (built in) or path/to/file.py:name(lines, record)
    step_weight: float = 1.0  # steps: line k's tokens add step_weight x its standardized verdict (step_mode add)
    step_mode: str = "add"  # steps: add (standardized verdicts added to A_i) or first_error (VPPO's verified prefix)
    token_report: bool = False
    seed: int = 0
    device: str = "cuda"
    precision: str = "auto"
    compile: str = "auto"
    logprob_batch_size: int = 1
    prompt_pass: str = "per_response"  # per_response (the spec: prompt + response, one forward each) or shared
    verifier_timeout: float = 2.0
    bad_records: str = "stop"
    max_bad_steps: int = 3
    output_dir: str = "runs/rlvr"
    save_every: int = 10
    keep_last: int = 2
    resume: str = ""
    overwrite: bool = False
    # several processes (torchrun); a plain `python train_rlvr.py` is one process and ignores these
    sharding: str = "auto"
    dist_timeout: float = 1800.0
    # before/after evaluation (the Evaluation section); eval_problems 0 leaves it off
    eval_dataset: str = "HuggingFaceH4/MATH-500"
    eval_split: str = "test"
    eval_dataset_config: str = ""
    eval_answer_format: str = "auto"
    eval_problems: int = 0
    eval_max_new_tokens: int = 2048
    eval_batch_size: int = 16
    eval_samples: int = 1
    eval_temperature: float = 0.8
    eval_top_p: float = 0.9
    eval_every: int = 0
    # watching: none, or trackers separated by commas (tensorboard, wandb, trackio); rank 0 reports
    report_to: str = "none"


# ----------------------------------------------------------------------------------------------
# Data and prompt

def load_problems(cfg: Config) -> list[dict]:
    """num_problems records from start_index, in file order (never shuffled); zero_variance=resample:
    up to resample_limit times as many, as far as the data set goes (replacements: run_candidates)."""
    more = cfg.num_problems * cfg.resample_limit if cfg.zero_variance == "resample" else 0
    records = load_records(cfg.dataset, cfg.dataset_split,
                           {"problem_field": cfg.problem_field, "answer_field": cfg.answer_field},
                           cfg.start_index, cfg.num_problems, up_to=more, config=cfg.dataset_config)
    # record: the data set's own fields, for a reward_function (called as name(response, answer, record))
    return [{"index": r["index"], "problem": r[cfg.problem_field], "answer": r[cfg.answer_field],
             "record": {k: v for k, v in r.items() if k != "index"}} for r in records]


def build_prompt(template: str, problem: str) -> str:
    # str.replace, not str.format: problems are full of LaTeX braces.
    return template.replace("{problem}", problem)


# ----------------------------------------------------------------------------------------------
# Rollouts

@dataclass
class Trainer:
    """What every step uses: the settings, the model and its optimizer, the verifier, the compiled
    decoders and buffers reused from step to step (the weights and AdamW state before the step)."""
    cfg: Config
    model: torch.nn.Module
    tokenizer: object
    params: list
    optimizer: torch.optim.Optimizer
    device: torch.device
    precision: str
    eos_id: int
    copies: StepCopies  # what optimizer_step measures the update against and undoes a non-finite step from
    scorer: verifier.TimedVerifier | None = None  # started with the loop
    reference: torch.nn.Module | None = None  # kl_coef > 0: the frozen starting weights (load_reference)
    decoders: Decoders = dataclasses.field(default_factory=lambda: Decoders())
    warned: set = dataclasses.field(default_factory=set)  # the warnings said once a run (warn_once)
    scheduler: object = None  # lr_schedule or warmup_steps: transformers' LambdaLR over the optimizer (lr_scheduler)
    credit_method: credit.Sequence = dataclasses.field(default_factory=credit.Sequence)  # chosen once (credit.method)


def sample_groups(step: int, draws: list[tuple[int, dict, torch.Tensor]], t: Trainer) -> list[tuple]:
    """This rank's rollouts of each (draw, problem, prompt ids)'s group (rank_share; one process: all of them), every group of
    the step in one batched decode, each rollout drawn from its own random stream (keyed by the draw: the problem's
    place in the data, 1-based), so its tokens depend neither on the number of processes nor on the problems
    beside it in the batch. A credit method that samples the group itself (credit=tree: credit_method.grow) grows
    it instead. Per problem: the responses, whether each was cut at max_new_tokens, the tree (else None), and with
    the entropy mask each response token's entropy, from the sampler's own logits (else None)."""
    mine, G = rank_share(t.cfg.group_size), t.cfg.group_size
    prompts = [ids for _, _, ids in draws]
    progress(f"[step {step}] generating {G} rollouts (problem {draws[0][1]['index']})" if len(draws) == 1 else
             f"[step {step}] generating {len(draws)} x {G} rollouts (problems "
             f"{', '.join(str(p['index']) for _, p, _ in draws)})")
    entropies = [] if t.credit_method.needs_entropies else None
    with agreed("generation", step, rollouts=len(mine) * len(draws), prompt_tokens=max(map(len, prompts)),
                cfg=t.cfg):
        draw, problem, prompt_ids = draws[0]
        tree = t.credit_method.grow(prompt_ids, draw, credit_tools(step, prompt_ids, problem, draw, t))
        if tree is not None:  # every rank grows the whole tree (its prefixes are shared); rank 0's is used
            tree = from_rank0(tree)
            leaves = [prompt_ids.new_tensor(tree.leaves[i]) for i in mine]
            return [(leaves, [tree.cut[i] for i in mine], tree, tree.entropies and [tree.entropies[i] for i in mine])]
        streams = [g for draw, _, _ in draws for g in rollout_streams(t.cfg.seed, draw, mine, t.device)]
        rows = [ids for ids in prompts for _ in mine]  # one object per prompt: its rows share its prompt pass
        with full_weights(t.model):
            responses, cut = generate_rollouts(t.model, rows, t.cfg, t.eos_id, streams, autocast(t.device, t.precision),
                                               t.decoders, entropies)
        n = len(mine)
        return [(responses[k * n:(k + 1) * n], cut[k * n:(k + 1) * n], None,
                 None if entropies is None else entropies[k * n:(k + 1) * n]) for k in range(len(draws))]


def generate_rollouts(model, prompt_ids: torch.Tensor | list[torch.Tensor], cfg: Config, eos_id: int,
                      streams: list[torch.Generator], amp, decoders: Decoders | None = None, entropies: list | None = None
                      ) -> tuple[list[torch.Tensor], list[bool]]:
    """One rollout per random stream (sample with the rollouts' rule): all of one prompt, or with a list row i of
    prompt_ids[i] (several problems' groups). A response is its tokens up to and including the first EOS (none if
    cut at max_new_tokens). entropies: a list that receives each response token's entropy (decode)."""
    prompts = prompt_ids if isinstance(prompt_ids, list) else [prompt_ids] * len(streams)
    return sample(model, prompts, cfg.max_new_tokens, eos_id, amp, cfg, streams, (cfg.temperature, cfg.top_p),
                  use="rollouts", decoders=decoders, entropies=entropies)


def rollout_streams(seed: int, step: int, rollouts, device) -> list[torch.Generator]:
    """Rollout i of step s draws every random number from its own stream (seed, step, i): the
    same tokens whichever process samples it, in whatever batch, and on resume with no RNG state."""
    return [torch.Generator(device=device).manual_seed(stream_seed(seed, "rollout", step, i)) for i in rollouts]


def stream_seed(seed: int, *key) -> int:
    """The seed of the random stream named by key, e.g. ("rollout", step, i): a hash, so streams
    of different keys are unrelated and none depends on how many others exist or who draws them."""
    digest = hashlib.blake2b(repr((int(seed), *key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: what manual_seed takes


def sampling_pick(streams: list[torch.Generator], temperature: float, top_p: float, device):
    """The next-token rule of the rollouts: temperature + top-p, row i drawing from streams[i].
    `rows` names the batch's rows still decoded when finished ones were dropped (None: all)."""
    uniforms = Uniforms(streams, device)

    def pick(logits, rows=None):
        return sample_next_token(logits, temperature, top_p, uniforms(rows))
    return pick


def sample_next_token(logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """One token per row, drawn from the nucleus only: an inverse CDF over the kept tokens in
    token-id order with one float64 uniform per row (`u`, shape rows x 1), so the draw depends on
    the kept set, its probabilities and u alone, not on how they were found."""
    weights = nucleus_weights(logits, temperature, top_p)
    cdf = torch.cumsum(weights, dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    # A target below the total always lands on a kept token: the cdf rises only at kept tokens and
    # reaches the total at the last one. A product u * total that rounds up to the total is moved
    # to the float just below it, which selects that last kept token (no host sync, no extra pass).
    target = torch.minimum(u.to(cdf.device) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)


def nucleus_weights(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Unnormalized sampling weights: exp(logits / temperature - max) on the top-p nucleus, 0 elsewhere
    (transformers' temperature + top-p; no top-k). A row whose largest score overflows float32 (NaN in
    transformers) takes the limit temperature -> 0: the argmax, tied maxima sharing the weight."""
    scores = logits.float() / temperature
    top = scores.amax(dim=-1, keepdim=True)
    overflow = ~top.isfinite()
    if not sampler_on_host(scores.device) or bool(overflow.any()):  # CUDA: no branch, no sync
        largest = logits.float() == logits.float().amax(dim=-1, keepdim=True)
        scores = torch.where(overflow, torch.where(largest, 0.0, -math.inf), scores)
        top = top.masked_fill(overflow, 0.0)
    kept = top_p_mask(scores, top_p)
    return (scores - top).exp_().masked_fill_(~kept, 0.0)


# ----------------------------------------------------------------------------------------------
# Rewards

class Score(NamedTuple):
    """One rollout's verdict (score_rollouts)."""
    reward: float          # the verifier's 1 or 0 (with a reward_function: its reward_weights' mix)
    answer: str | None     # the final answer the verifier read (None: no \boxed{} answer)
    status: str            # correct, wrong, no_answer, or timeout / crash (a call that gave no result)
    error: str | None = None  # timeout or crash: why, in one line


@dataclass
class Group:
    """The whole group's rollouts, in rollout order (gathered from every rank)."""
    texts: list[str]
    scored: list[Score]  # per rollout
    tokens: list[int]
    cut: list[bool]
    rewards: torch.Tensor
    zero_variance: bool  # every reward equal: decided here, once (equal_rewards); every later move reads it
    draw: int = 0  # the draw that keyed its random streams (the step's, without resampling)
    tree: credit.Tree | None = None  # credit=tree: how the group was sampled
    entropies: list[list[float]] | None = None  # top_entropy_quantile: each token's, from the sampler's logits


def score_group(step: int, responses: list[torch.Tensor], cut: list[bool], problem: dict, t: Trainer, draw: int = 0,
                tree: credit.Tree | None = None, entropies: list | None = None) -> Group:
    """Score this rank's rollouts against the problem's answer (a reward_function also gets its data set record);
    every rank receives the whole group (its advantages standardize over all of it), and its tokens' entropies if
    sampled."""
    texts = [t.tokenizer.decode(r.tolist(), skip_special_tokens=True) for r in responses]
    with agreed("rewards", step, cfg=t.cfg):  # a signal stops it between two calls, within one verifier_timeout
        scored = score_rollouts(t.scorer, texts, problem["answer"], **user_reward(t.cfg, problem))
    mine = (texts, scored, [len(r) for r in responses], cut, entropies or [None] * len(responses))
    group = [x for share in gather_objects(mine) for x in zip(*share)]
    texts, scored, tokens, cut, entropies = map(list, zip(*group))
    values = [s.reward + format_bonus(s.status, c, t.cfg.format_reward) for s, c in zip(scored, cut)]
    rewards = torch.tensor(values, dtype=torch.float32)
    check_rewards(step, values, rewards, scored, t)
    progress(f"[step {step}] rewards {rewards.tolist()}; backward")
    return Group(texts, scored, tokens, cut, rewards, equal_rewards(rewards), draw, tree,
                 None if entropies[0] is None else entropies)


FAILED = ("timeout", "crash")  # a call of the verifier (and reward_function) that gave no result: reward 0


def equal_rewards(rewards: torch.Tensor) -> bool:
    """A zero-variance group: its advantages are all exactly 0, so its gradient is 0 (the spec's
    check that nothing moves but AdamW's momentum and weight decay)."""
    return bool((rewards == rewards[0]).all())


def score_rollouts(scorer: verifier.TimedVerifier, texts: list[str], gold: str, record: dict | None = None,
                   weights: tuple[float, float] = (0.0, 1.0)) -> list[Score]:
    """A Score per rollout. The verifier runs in a worker process with a hard wall-clock limit: an overrun or a
    crash scores 0 with status 'timeout' or 'crash', and why (one line). With a reward_function (a record given),
    the same worker calls it within the same limit and returns its value too, and the reward is v * the
    verifier's + f * the function's (weights: reward_weights; by default the function's alone); its hang or
    failure scores 0 too. The status stays the verifier's."""
    scored = []
    for text in texts:
        check_stop(local=True)  # between two calls: a signal waits for one call at most, not the group's
        reward, answer, status, *function = scorer.score(text, gold, record)  # function: reward_function's value
        if status in FAILED:
            scored.append(Score(reward, answer, status, getattr(scorer, "last_error", None) or status))
        else:
            scored.append(Score(weights[0] * reward + weights[1] * function[0] if function else reward, answer, status))
    return scored


def user_reward(cfg: Config, problem: dict) -> dict:
    """score_rollouts' arguments for a reward_function: the problem's record and reward_weights (none without one)."""
    if not cfg.reward_function:
        return {}
    return {"record": problem.get("record") or {}, "weights": reward_weights(cfg.reward_weights) or (0.0, 1.0)}


def format_bonus(status: str, was_cut: bool, weight: float) -> float:
    """format_reward: weight w for a response that ends with EOS (not cut at the limit) and holds a
    final \\boxed{} answer the verifier could read (status correct or wrong, not no_answer), as the
    prompt asks; 0 otherwise. The verifier's reward, and so the correct count, stays its own."""
    return weight if weight and status in ("correct", "wrong") and not was_cut else 0.0


# ----------------------------------------------------------------------------------------------
# Advantages

def compute_advantages(rewards: torch.Tensor, std_eps: float, advantage_std: str = "group", *,
                       zero_variance: bool) -> torch.Tensor:
    """Within the group only (advantage_std):
      group (the spec):   A_i = (r_i - mean(r)) / (std_unbiased(r) + eps)
      none  (Dr. GRPO):   A_i =  r_i - mean(r)

    A zero-variance group (the Group's flag, decided by equal_rewards when it was scored) has every advantage
    exactly 0 (for 8 x 0.1, whose float32 mean need not be 0.1, the formula would leave a rounding residue)."""
    if zero_variance:
        return torch.zeros_like(rewards)
    if advantage_std == "none":
        return rewards - rewards.mean()
    return (rewards - rewards.mean()) / (rewards.std(unbiased=True) + std_eps)


def assign_credit(step: int, prompt_ids: torch.Tensor, responses: list[torch.Tensor], group: Group,
                  advantages: torch.Tensor, problem: dict, t: Trainer) -> credit.Credit | None:
    """Which tokens earn the advantage (the spec's last paragraph): the run's credit method, chosen once at its start
    (credit.method: its formula, settings, figures and columns in credit.py). None: the spec's A_i on every token of
    response i (credit=sequence, no entropy mask), and nothing else runs. Otherwise each token's own A_it, the
    method given what it may call (credit_tools: the sampler, the verifier, the step checker)."""
    if t.credit_method.is_spec:
        return None
    with agreed("credit", step, prompt_tokens=len(prompt_ids), cfg=t.cfg):
        return t.credit_method.assign(responses, group, advantages,
                                      credit_tools(step, prompt_ids, problem, group.draw, t))


# ----------------------------------------------------------------------------------------------
# Log-probabilities and loss

@dataclass
class LossTerms:
    """What goes into each response's term beyond the spec's (the settings of one pass; with the
    defaults, the spec's term alone). loss_terms builds it from the settings."""
    divisors: list[int]                       # per response of this rank (loss_divisors)
    reference: torch.nn.Module | None = None  # kl_coef > 0: the frozen weights the run started from
    kl_coef: float = 0.0
    old: list | None = None                   # a later epoch of ppo_epochs: the first pass's token log-probs
    clip_low: float = 0.2                     # the ratio is clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    masked: list[bool] | None = None          # mask_truncated_completions: the responses that have no term
    weights: list | None = None               # credit / top_entropy_quantile: A_it per token (credit.Credit.weights)


@dataclass
class Pass:
    """What one forward + backward pass over a group's responses measured (accumulate_policy_gradient;
    backpropagate_group sums the ranks' into the whole group's)."""
    loss: float                               # the policy loss: the terms summed in response order
    seq_log_probs: list                       # sum_t l_it per response (None: the pass was skipped)
    token_log_probs: list | None = None       # l_it per response of this rank, detached (None: skipped)
    kl: float = 0.0                           # sum of k3 over the tokens (kl_coef)
    clipped: float = 0.0                      # tokens whose ratio the clip holds (ppo_epochs > 1)


def backpropagate_step(step: int, slots: list[Slot], t: Trainer) -> list[Pass]:
    """The step's gradient: zeroed once, each group's added (backpropagate_group), then summed across ranks so that
    every rank holds the whole step's. With P groups the loss is the mean of their losses (each group's terms
    divided by P more), so a learning rate means per group what it means with one. Returns each group's Pass."""
    zero_gradients(t.params)
    passes = [backpropagate_group(step, s, t, len(slots)) for s in slots]
    if not all(s.silent for s in slots) or t.cfg.kl_coef:
        sum_gradients(t.params)
    note(f"step {step}: optimizer step")
    check_stop()  # the last safe point: nothing of this step has touched the weights or AdamW yet
    return passes


def backpropagate_group(step: int, s: Slot, t: Trainer, groups: int = 1) -> Pass:
    """accumulate_policy_gradient over this rank's responses of the slot's group, added to the gradient
    (backpropagate_step zeroes and sums it across ranks); a later epoch of ppo_epochs reads the first pass's token
    log-probs (s.first); groups: the step's P. Returns the group's Pass (its loss divided by P; token log-probs:
    this rank's)."""
    mine, group = rank_share(t.cfg.group_size), s.group
    terms = loss_terms(t, group, s.first and s.first.token_log_probs, mine,
                       None if s.credit is None else [w.to(t.device) for w in s.credit.weights(mine)], groups)
    if t.cfg.mask_truncated_completions and all(group.cut) and not s.silent:
        warn_once(t, "every response masked", f"warning: step {step}: every response of a group with reward variance "
                  f"was cut at max_new_tokens ({t.cfg.max_new_tokens}) and mask_truncated_completions leaves each out "
                  "of the loss, so it trains nothing (said once a run; raise max_new_tokens or set "
                  "mask_truncated_completions: false)")
    with agreed("backward", step, longest=max(len(r) for r in s.responses), prompt_tokens=len(s.prompt_ids),
                cfg=t.cfg):
        p = accumulate_policy_gradient(t.model, t.params, s.prompt_ids, s.responses, s.advantages[
            mine.start:mine.stop].to(t.device), t.cfg.group_size, autocast(t.device, t.precision),
            t.cfg.logprob_batch_size, terms.divisors, terms, s.silent, zero=False,
            shared=t.cfg.prompt_pass == "shared")
    shares = gather_objects((p.loss, p.seq_log_probs, p.kl, p.clipped))
    return Pass(sum(x[0] for x in shares), [x for share in shares for x in share[1]], p.token_log_probs,
                sum(x[2] for x in shares), sum(x[3] for x in shares))


def masked_responses(group: Group, cfg: Config) -> list[bool]:
    """mask_truncated_completions (TRL's): the responses cut at max_new_tokens, which have no term in the loss and
    whose tokens no per-token figure counts; decided here alone."""
    return [cfg.mask_truncated_completions and c for c in group.cut]


def loss_terms(t: Trainer, group: Group, first_pass: list | None, mine: range, weights: list | None = None,
               groups: int = 1) -> LossTerms:
    """The settings' LossTerms for this rank's responses: the divisors of loss_aggregation (a masked
    response's tokens do not count) times the step's P groups, the KL's reference, a later epoch's old
    log-probs, the clip range, and with credit its token advantages (weights)."""
    cfg = t.cfg
    masked = masked_responses(group, cfg)
    counted = [0 if m else n for n, m in zip(group.tokens, masked)]
    divisors = loss_divisors(cfg.loss_aggregation, counted if any(masked) else group.tokens, cfg.max_new_tokens)
    return LossTerms([d * groups for d in divisors[mine.start:mine.stop]], t.reference, cfg.kl_coef, first_pass, cfg.clip_eps,
                     cfg.clip_eps_high or cfg.clip_eps, masked[mine.start:mine.stop] if any(masked) else None, weights)


def accumulate_policy_gradient(model, params, prompt_ids, responses, advantages, group_size, amp,
                               logprob_batch_size: int = 1, divisors: list[int] | None = None,
                               terms: LossTerms | None = None, silent: bool = False, zero: bool = True,
                               shared: bool = False) -> Pass:
    """Zero the gradient once (zero=False: add to it), then forward + backward one response at a time (the spec), so only one response's
    graph is alive at once; logprob_batch_size > 1 runs that many per forward + backward (batch_token_log_probs):
    the same gradient up to float rounding. shared (prompt_pass: shared): the prompt's forward once for the group
    (SharedPrompt), each response's forward after it and its backward stopping at it, then one backward through
    the prompt: the same gradient up to float rounding, the prompt read once, not once per response. Every
    response's term comes from response_loss. A zero-variance group (every A_i = 0) has an exactly-zero gradient:
    its passes are skipped, unless a KL term gives it one."""
    if zero:
        zero_gradients(params)
    terms = terms or LossTerms([group_size] * len(responses) if divisors is None else divisors)
    if silent and not terms.kl_coef:
        return Pass(0.0, [None] * len(responses))
    losses, seq_lps, token_lps, kls, held = [], [], [], [], []
    size = max(1, int(logprob_batch_size))
    prompt = shared_prompt(model, prompt_ids, amp) if shared else None
    with torch.no_grad():
        ref_prompt = shared_prompt(terms.reference, prompt_ids, amp) if shared and terms.kl_coef else None
    for start in range(0, len(responses), size):
        check_stop()  # safe point for SIGINT/SIGTERM: the weights are untouched until the optimizer step
        chunk = responses[start:start + size]
        lps = (prompt.token_log_probs(model, chunk, amp) if prompt else
               [token_log_probs(model, prompt_ids, chunk[0], amp)] if len(chunk) == 1
               else batch_token_log_probs(model, prompt_ids, chunk, amp))
        refs = [None] * len(chunk)
        if terms.kl_coef:
            with torch.no_grad():
                refs = (ref_prompt.token_log_probs(terms.reference, chunk, amp) if ref_prompt else
                        [token_log_probs(terms.reference, prompt_ids, r, amp) for r in chunk])
        seqs = [sequence_log_prob(lp) for lp in lps]
        parts = [response_loss(advantages[start + j], lp, seq, terms, start + j, ref) for j, (lp, seq, ref) in
                 enumerate(zip(lps, seqs, refs))]
        live = [loss for loss, _, _ in parts if loss.requires_grad]
        if live:
            (live[0] if len(live) == 1 else torch.stack(live).sum()).backward()
        losses += [loss.detach() for loss, _, _ in parts]
        kls += [kl for _, kl, _ in parts if kl is not None]
        held += [h for _, _, h in parts if h is not None]
        seq_lps += [seq.detach() for seq in seqs]
        token_lps += [lp.detach() for lp in lps]
    if prompt:
        prompt.backward()  # the prompt's share of every response's gradient, summed: one backward through it
    # one host sync for the whole group, not two per response
    loss_values, seq_log_probs = torch.stack([torch.stack(losses), torch.stack(seq_lps)]).tolist()
    total = 0.0
    for value in loss_values:  # summed in response order
        total += value
    nothing = losses[0].new_zeros((), dtype=torch.float32)  # on the model's device, like the sums beside it
    sums = torch.stack([torch.stack(x).sum().float() if x else nothing for x in (kls, held)]).tolist()
    return Pass(total, seq_log_probs, token_lps, *sums)


def response_loss(advantage: torch.Tensor, log_probs: torch.Tensor, seq_log_prob: torch.Tensor, terms: LossTerms,
                  i: int, ref_log_probs: torch.Tensor | None = None):
    """Response i's term of the loss, its tokens' terms summed and divided by divisor_i (loss_divisors),
    and what it measured (the KL's sum, the tokens the clip holds; None when off). seq_log_prob is
    sequence_log_prob(log_probs), summed once by the caller, which also reports it:
      the spec (and every first epoch)   -A_i sum_t l_it                                 policy_loss
      a later epoch of ppo_epochs        -sum_t min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i)
      with kl_coef = beta > 0, plus      +beta sum_t k3_it              (q_it: the reference's) kl_k3
      mask_truncated_completions         0 for a response cut at max_new_tokens (TRL's: its tokens leave
                                         the loss, the KL's too)
      credit, top_entropy_quantile       -sum_t A_it l_it, A_it the token's own (assign_credit) token_policy_loss
                                         (and in a later epoch's clipped objective in place of A_i)
    Variants' terms sit here beside the spec's: docs/variants.md, "adding a variant"."""
    divisor, kl, held = terms.divisors[i], None, None
    if terms.masked is not None and terms.masked[i]:
        return torch.zeros((), device=log_probs.device), kl, held
    a = advantage if terms.weights is None else terms.weights[i]  # credit: A_it per token
    if terms.old is None:
        loss = policy_loss(a, seq_log_prob, divisor) if terms.weights is None else token_policy_loss(a, log_probs,
                                                                                                     divisor)
    else:
        objective, held = clipped_objective(a, log_probs, terms.old[i], terms.clip_low, terms.clip_high)
        loss = -objective / divisor
    if terms.kl_coef:
        k3 = kl_k3(ref_log_probs, log_probs)
        kl = k3.detach().sum()
        loss = loss + terms.kl_coef * k3.sum() / divisor
    return loss, kl, held


def sequence_log_prob(token_log_probs: torch.Tensor) -> torch.Tensor:
    """sequence_log_prob_i = sum_t log p_theta(response_token_t | prompt, earlier_response_tokens).
    A SUM over the response, never a mean over its length."""
    return token_log_probs.sum()


def policy_loss(advantage: torch.Tensor, seq_log_prob: torch.Tensor, divisor: int) -> torch.Tensor:
    """One response's term of policy_loss = -(1/G) * sum_i stopgrad(A_i) * sequence_log_prob_i
    (divisor G, the spec), or of a variant's aggregation (divisor from loss_divisors)."""
    return -(advantage.detach() * seq_log_prob) / divisor


def token_policy_loss(token_advantages: torch.Tensor, log_probs: torch.Tensor, divisor: int) -> torch.Tensor:
    """One response's term with a token's own advantage (credit, top_entropy_quantile): -sum_t A_it l_it / divisor,
    the spec's term when every A_it is A_i (summed in another order: why the spec's run keeps policy_loss)."""
    return -(token_advantages.detach() * log_probs).sum() / divisor


def kl_k3(ref_log_probs: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """kl_coef: the k3 estimator of KL(policy || reference) per token, with q_it the frozen reference's
    log-probability:  k3_it = exp(q_it - l_it) - (q_it - l_it) - 1.  Never negative; exactly 0, with
    a zero gradient, where q_it = l_it (so at step 1, whose weights are the reference's)."""
    d = ref_log_probs - log_probs
    return torch.exp(d) - d - 1


def clipped_objective(advantage: torch.Tensor, log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                      clip_low: float, clip_high: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ppo_epochs > 1, every epoch after the first: PPO's clipped objective summed over a response's tokens,
      sum_t min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i),   rho_it = exp(l_it - l_old_it),
    l_old the log-probabilities of the group's first pass, eps_low = clip_eps, eps_high = clip_eps_high
    (DAPO's clip-higher; default eps_low); and how many tokens the clip holds (their ratio outside the
    range on the side A_i pushes it to: their gradient is 0)."""
    a, high = advantage.detach(), clip_low if clip_high is None else clip_high
    ratio = torch.exp(log_probs - old_log_probs)
    objective = torch.minimum(ratio * a, ratio.clamp(1 - clip_low, 1 + high) * a).sum()
    held = ((ratio < 1 - clip_low) & (a < 0)) | ((ratio > 1 + high) & (a > 0))
    return objective, held.sum()


def loss_divisors(aggregation: str, lengths: list[int], max_new_tokens: int) -> list[int]:
    """How each response's token sum is scaled (loss_aggregation); lengths are the group's L_i
    (EOS included), G = len(lengths). Response i's term is -A_i * (sum_t x_it) / divisor_i with
    x_it = l_it, the token log-probabilities (a KL or ratio term per token can use the same divisors):
      sequence_sum  (the spec):       -(1/G) sum_i A_i sum_t l_it                  divisor G
      sequence_mean (GRPO paper):     -(1/G) sum_i A_i (1/L_i) sum_t l_it          divisor G L_i
      token_mean    (DAPO):           -(1/sum_j L_j) sum_i A_i sum_t l_it          divisor sum_j L_j
      dr_grpo       (Dr. GRPO):       -(1/(G max_new_tokens)) sum_i A_i sum_t l_it  divisor G max_new_tokens
    Integers, so the spec's divisor G is exactly the one it always was. token_mean and dr_grpo are
    the spec's loss times a positive factor per group; sequence_mean weighs short responses up."""
    G = len(lengths)
    if aggregation == "sequence_mean":
        return [G * n for n in lengths]
    if aggregation == "token_mean":
        return [sum(lengths)] * G
    if aggregation == "dr_grpo":
        return [G * max_new_tokens] * G
    return [G] * G


def token_log_probs(model, prompt_ids: torch.Tensor, response_ids: torch.Tensor, amp) -> torch.Tensor:
    """log p_theta(response_t | prompt, response_<t) for every response token (EOS included), float32.

    The model reads prompt + response[:-1] (no padding); the LM head runs only on the last
    len(response) positions, the first of which predicts the first response token."""
    input_ids = torch.cat([prompt_ids, response_ids[:-1]]).unsqueeze(0)
    with amp:
        # use_cache=False: one forward over the whole sequence, no KV cache built for nothing
        logits = model(input_ids, use_cache=False, logits_to_keep=len(response_ids)).logits[0]
    return gathered_log_probs(logits, response_ids)


def batch_token_log_probs(model, prompt_ids: torch.Tensor, responses: list[torch.Tensor], amp) -> list[torch.Tensor]:
    """token_log_probs of several responses to one prompt in one forward pass (logprob_batch_size).

    Row i is prompt + response_i[:-1], padded on the right: every pad comes after all the real
    tokens of its row, so causal attention never lets a real position see one and no position
    moves. The LM head runs on the last max(len) positions; row i uses the first len(response_i)."""
    longest = max(len(r) for r in responses)
    ids = prompt_ids.new_zeros(len(responses), len(prompt_ids) + longest - 1)
    ids[:, :len(prompt_ids)] = prompt_ids
    for i, r in enumerate(responses):
        ids[i, len(prompt_ids):len(prompt_ids) + len(r) - 1] = r[:-1]
    with amp:
        logits = model(ids, use_cache=False, logits_to_keep=longest).logits
    return [gathered_log_probs(logits[i, :len(r)], r) for i, r in enumerate(responses)]


def gathered_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] in float32: the gathered logit minus logsumexp (no full log-softmax tensor)."""
    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def zero_gradients(params: list[torch.nn.Parameter]) -> None:
    """Explicit zero tensors (not None), so a skipped backward still leaves a real zero gradient."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()


# ----------------------------------------------------------------------------------------------
# Optimizer step

def lr_scheduler(cfg: Config, optimizer, steps: int):
    """lr_schedule and warmup_steps as transformers' get_scheduler builds them (TRL's lr_scheduler_type), over the
    run's steps: the learning rate of step k (from 0) is learning_rate times
      constant, with warmup W    min(1, k / W)
      linear                     k / W during the warmup, then (steps - k) / (steps - W)
      cosine                     k / W during the warmup, then 0.5 (1 + cos(pi (k - W) / (steps - W)))
    One scheduler step per training step (every epoch of a step takes that step's rate; a step skipped or undone
    still moves the schedule on). None for the spec: a constant rate with no warmup, no scheduler at all."""
    if cfg.lr_schedule == "constant" and not cfg.warmup_steps:
        return None
    from transformers import get_scheduler
    name = "constant_with_warmup" if cfg.lr_schedule == "constant" else cfg.lr_schedule
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=steps)


def next_learning_rate(scheduler, steps: int = 1) -> None:
    """The schedule moved on by `steps` training steps (a resumed run: the steps done)."""
    if scheduler is None:
        return
    import warnings
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": a skipped step's, a resume's
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            scheduler.step()


def step_or_skip(slots: list[Slot], loss: float, t: Trainer) -> tuple[float, float | None]:
    """optimizer_step, the spec's: a zero-variance group too takes its AdamW step, with a zero
    gradient (momentum and weight decay still move the weights). zero_variance=skip takes none for
    a group with no signal (Slot.silent: with credit, every A_it 0, so a monte_carlo value that gives a
    zero-variance group a gradient is kept; with P groups: when no group of the step has one): weights, AdamW
    moments and step count stay as they are; grad norm and update norm 0."""
    if t.cfg.zero_variance == "skip" and all(s.silent for s in slots):
        return 0.0, 0.0
    return optimizer_step(t.params, t.optimizer, t.cfg.max_grad_norm, loss, t.copies)


def optimizer_step(params, optimizer, max_grad_norm: float, loss: float = 0.0, copies: StepCopies | None = None
                   ) -> tuple[float, float | None]:
    """clip_grad_norm_ (it returns the norm BEFORE clipping), then one AdamW step; the update norm is measured
    against a copy of the weights taken before it (copies.before). A non-finite loss or gradient norm skips the
    step (update norm None); a step that leaves a weight non-finite (a far too large learning rate) is undone from
    that copy and a copy of the AdamW state, on every rank under fsdp. Only a step that could leave one non-finite
    (step_could_overflow) pays for the state's copy and the finiteness check: with the spec's settings none can."""
    total = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    grad_norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)  # fsdp: a DTensor
    if not (math.isfinite(grad_norm) and math.isfinite(loss)):
        return grad_norm, None
    copies = copies or StepCopies(update_norm_buffers(params, torch.device("cpu")))
    weights = [local(p).detach() for p in params]
    for b, w in zip(copies.before, weights):
        b.copy_(w, non_blocking=True)  # stream-ordered before the step's in-place updates
    risky = step_could_overflow(optimizer, copies, weights)
    saved = snapshot_optimizer_state(optimizer, copies.state, copies.before[0].device) if risky else None
    optimizer.step()
    if risky:
        finite, copies.largest = weights_range(weights)
        if not finite:
            with torch.no_grad():
                for w, b in zip(weights, copies.before):
                    w.copy_(b)
            restore_optimizer_state(optimizer, saved)  # copies.largest stays inf: the next step is checked too
            return grad_norm, None
    moved = update_norm(copies.before, weights)
    return grad_norm, math.sqrt(sum_over_ranks(moved * moved)) if RANKS.sharding == "fsdp" else moved


# ----------------------------------------------------------------------------------------------
# The step and the loop

# The spec's step, one call per move, each defined above in the spec's order; each move exchanges
# with the other processes what it needs (their shares of the group) itself. A fault is raised where
# it happens (agreed turns it into its message); run's loop ends every early stop in stop_run.

def train_step(step: int, candidates: list[dict], draw: int, problems: int, t: Trainer) -> StepRecord:
    """One problem (problems_per_step: P), one AdamW step: sample the group, score it, standardize the rewards within
    it, backpropagate the policy loss one response at a time, clip and step, report. The spec's step is
    candidates = [its problem], draw = step, problems = 1, ppo_epochs = 1 (variants: draw_groups, docs/variants.md)."""
    clock = Stopwatch(t.device)
    slots = draw_groups(step, candidates, draw, range(problems), t, clock)
    for s in slots:
        weigh_group(step, s, t, clock)
    if t.cfg.zero_variance == "resample":  # DAPO's dynamic sampling, once the credit has said which groups are silent
        resample_silent(step, slots, candidates, draw, t, clock)
    epochs = []
    for epoch in range(1, t.cfg.ppo_epochs + 1):  # the spec: one
        done = backpropagate_step(step, slots, t)
        clock.lap("logprob_backward")
        lr = t.optimizer.param_groups[0]["lr"]
        grad_norm, moved = step_or_skip(slots, sum(p.loss for p in done), t)
        clock.lap("optimizer")
        epochs.append(dict(epoch_figures(epoch, done, grad_norm, moved, slots, t.cfg), learning_rate=lr))
        for s, p in zip(slots, done):
            s.first = s.first or p
        if moved is None:  # undone (non-finite): the step takes no further epoch
            break
    next_learning_rate(t.scheduler)
    for s in slots:
        s.changes = token_changes(s, epochs, t)
    return step_report(step, slots, t, epochs, clock)


def weigh_group(step: int, s: Slot, t: Trainer, clock) -> None:
    """The slot's advantages (the spec's formula), which tokens earn them (assign_credit; the spec's: None), and
    whether its group has a signal at all: decided here, once, after the credit (a checked line or a monte_carlo
    value can give a zero-variance group one), and read by every later move (resample, the passes, skip)."""
    s.advantages = compute_advantages(s.group.rewards, t.cfg.std_eps, t.cfg.advantage_std,
                                      zero_variance=s.group.zero_variance)
    s.credit = assign_credit(step, s.prompt_ids, s.responses, s.group, s.advantages, s.problem, t)  # spec: None
    s.silent = s.group.zero_variance if s.credit is None else s.credit.all_zero()
    if s.credit is not None:
        clock.lap("credit")


@dataclass
class Slot:
    """One problem of the step and what the step computes for it (one slot a step: the spec's)."""
    problem: dict
    prompt_ids: torch.Tensor
    responses: list[torch.Tensor]  # this rank's
    group: Group
    set_aside: list[Slot] = dataclasses.field(default_factory=list)  # the silent slots drawn for it first (resample)
    advantages: torch.Tensor | None = None
    credit: credit.Credit | None = None
    silent: bool = False  # every advantage 0, so its gradient is exactly 0 (its passes are skipped): weigh_group's
    first: Pass | None = None  # the first epoch's pass
    changes: list | None = None  # token_report: token_changes


def draw_groups(step: int, candidates: list[dict], draw: int, picks, t: Trainer, clock) -> list[Slot]:
    """sample_groups and score_group for candidates[c] of each c in picks, all in one batched decode: candidate c is
    drawn with draw number draw + c (its place in the data, which keys its random streams). One Slot per pick."""
    draws = [(draw + c, candidates[c], torch.tensor(candidates[c]["prompt_ids"], device=t.device))
             for c in picks]  # tokenized once, by check_problems
    sampled = sample_groups(step, draws, t)  # this rank's share of each group
    clock.lap("generation")
    slots = [Slot(problem, prompt_ids, responses, score_group(step, responses, cut, problem, t, d, tree, entropies))
             for (d, problem, prompt_ids), (responses, cut, tree, entropies) in zip(draws, sampled)]
    clock.lap("rewards")
    return slots


def resample_silent(step: int, slots: list[Slot], candidates: list[dict], draw: int, t: Trainer, clock) -> None:
    """zero_variance=resample (DAPO's dynamic sampling): a slot whose group has no signal (Slot.silent, decided after
    its credit: with credit=steps an all-wrong group whose lines differ is kept) sets it aside and takes the next
    candidate (every such slot in one further decode), until its group has a signal, it has drawn resample_limit
    groups, or the candidates run out (the last drawn is trained on)."""
    later = len(slots)  # the next candidate not drawn yet
    while True:
        pending = []
        for k, s in enumerate(slots):
            if s.silent and later < len(candidates) and len(s.set_aside) + 1 < t.cfg.resample_limit:
                progress(f"[step {step}] zero-variance group of problem {s.problem['index']} set aside; drawing the "
                         "next")
                pending.append(k)
                later += 1
        if not pending:
            return
        for k, new in zip(pending, draw_groups(step, candidates, draw, range(later - len(pending), later), t, clock)):
            new.set_aside = slots[k].set_aside + [slots[k]]
            weigh_group(step, new, t, clock)
            slots[k] = new


def step_loss(done: list[Pass]) -> float:
    """The step's policy loss: its groups' losses (each already divided by P) added in slot order."""
    loss = done[0].loss
    for p in done[1:]:
        loss += p.loss
    return loss


def epoch_figures(epoch: int, done: list[Pass], grad_norm: float, moved: float | None, slots: list[Slot],
                  cfg: Config) -> dict:
    """One epoch's loss and norms; with kl_coef the mean k3 per token of the loss, with ppo_epochs > 1
    the fraction of the loss's tokens the clip holds (mask_truncated_completions: kept tokens only)."""
    figures = dict(epoch=epoch, policy_loss=step_loss(done), grad_norm=grad_norm, update_norm=moved)
    kept = sum(n for s in slots for n, m in zip(s.group.tokens, masked_responses(s.group, cfg)) if not m)
    if cfg.kl_coef:
        figures["kl"] = sum(p.kl for p in done) / max(1, kept)
    if cfg.ppo_epochs > 1:
        figures["clipped_fraction"] = sum(p.clipped for p in done) / max(1, kept)
    return figures


@dataclass
class RunState:
    """Where a run is: the steps done (their metrics), the evaluations, the last checkpoint written."""
    out: Path
    argv: list[str]
    problems: list[dict]
    eval_set: list[dict]
    steps: int  # optimizer steps in all: num_problems (as far as the data set goes) / problems_per_step
    trains: int  # the problems trained on (num_problems, as far as the data set goes)
    extras: list[str]  # the table's extra columns (table_extras)
    history: list[dict] = dataclasses.field(default_factory=list)
    eval_log: list[dict] = dataclasses.field(default_factory=list)
    last_saved: int = 0
    step: int = 0  # the step being trained
    started: float = 0.0
    first_step: int = 1  # the first step this process trains (a resumed run: after the checkpoint's)
    resumed: dict = dataclasses.field(default_factory=dict)  # a resumed run: its checkpoint's state.json
    watch: Watch | None = None  # the step bar and the trackers, while the loop runs


def run(cfg: Config, device: torch.device, precision: str, od: OutputDir, problems: list[dict],
        argv: list[str], eval_set: list[dict] = ()) -> int:
    """The loop: evaluate before; for each problem: train, log, evaluate if due, checkpoint if due;
    evaluate after the last; save. Every way of stopping early ends in stop_run."""
    t, s = load_training(cfg, device, precision, od, problems, argv, eval_set)
    with signals_caught():
        try:
            with open_scorer(cfg, t.credit_method.checker) as t.scorer:
                try_reward_function(t.scorer, s.problems[0], cfg)
                t.credit_method.trial(s.problems[0]["answer"], credit_tools(0, None, s.problems[0], 0, t))
                begin_output(od, cfg)  # the first change to output_dir, now that everything has loaded
                s.eval_log = on_rank0(read_eval_log, s.out, s.resumed.get("eval_steps_done"), s.steps)
                say(format_header(cfg.group_size * cfg.problems_per_step, s.extras))
                for m in s.history:  # a resumed run shows the whole table, as an uninterrupted one would
                    say(format_row(m, s.extras, cfg.group_size * cfg.problems_per_step))
                s.started, s.first_step = time.perf_counter(), len(s.history) + 1
                s.watch = open_watch(cfg, s.out, len(s.history), s.steps, s.resumed)
                if evaluate_if_due(len(s.history), t, s) and s.history:  # the base model, or what a stopped run left
                    write_checkpoint(len(s.history), t, s)  # resumed: the checkpoint of this step now records it
                for step in range(len(s.history) + 1, s.steps + 1):
                    s.step = step
                    log_step(train_step(step, *run_candidates(s, cfg), t), t, s)
                    evaluate_if_due(step, t, s)  # after step N (eval_every) or after the last step
                    checkpoint_if_due(step, t, s)
        except (Interrupted, StopRun) as e:
            return stop_run(e, t, s)
        finally:
            close_watch(s.watch, s.out)
    progress(f"saving the final model to {s.out / 'final'}")
    try:
        save_final(t.model, t.tokenizer, s.out)
    except OSError as e:
        progress(f"could not write {s.out / 'final'} ({e.strerror or e}); the checkpoint of step {len(s.history)} "
                 f"is complete: free some space, then {resume_command(argv)} writes final/")
        return 1
    say(format_summary(s.history, time.perf_counter() - s.started, s.first_step))
    if s.eval_log:
        say("\n" + format_eval_table(write_eval_files(s.out, s.eval_log, cfg)))
    return 0


# Everything below is the machinery the step and the loop above call: reading and checking the settings
# and the data, loading the model, decoding, the tree's sampling, the reward function's worker, the
# optimizer step's undo, logging, evaluation, checkpoints, faults and signals, processes and main.


# ----------------------------------------------------------------------------------------------
# The run's start

def load_training(cfg: Config, device: torch.device, precision: str, od: OutputDir, problems: list[dict],
                  argv: list[str], eval_set: list[dict]) -> tuple[Trainer, RunState]:
    """The model, optimizer and checked problems; a resumed run's weights, AdamW state and steps. Changes no file."""
    model, tokenizer, eos_id, problems, eval_set, decoders = start_model(cfg, device, precision, eval_set, problems)
    check_memory(cfg, model, problems, device)
    check_prompt_pass(cfg, model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    copies, reference = StepCopies(update_norm_buffers(params, device)), load_reference(cfg, device, precision)
    t = Trainer(cfg, model, tokenizer, params, optimizer, device, precision, eos_id, copies, reference=reference,
                decoders=decoders, credit_method=credit.method(cfg, user_function(cfg.step_checker)))
    trains = min(cfg.num_problems, len(problems))  # load_records refuses a data set short of num_problems
    s = RunState(od.path, argv, problems, list(eval_set), run_steps(trains, cfg), trains,
                 table_extras(cfg, t.credit_method))
    t.scheduler = lr_scheduler(cfg, optimizer, s.steps)  # before a checkpoint's AdamW state: its base rate is cfg's
    if od.resume_from is not None:
        s.history, s.resumed = load_checkpoint(od.resume_from, model, optimizer, problems)
        s.last_saved = len(s.history)
        # the problems still to train, P a step: a finished run extended (num_problems raised) trains exactly the
        # rest, each once, though its last step took fewer than P (find_resume_checkpoint refuses a smaller one)
        s.steps = len(s.history) + run_steps(trains - problems_trained(s.history), cfg)
        next_learning_rate(t.scheduler, len(s.history))  # the rate of each step is a function of the step alone
        progress(f"resumed from {od.resume_from} after step {len(s.history)}")
    on_rank0(check_disk, cfg, model, od.path, len(s.history), s.steps)
    return t, s


def start_model(cfg: Config, device: torch.device, precision: str, eval_set: list[dict], problems: list[dict] = (),
                ) -> tuple:
    """How every run starts, training or evaluation only: the seeds, the model and its tokenizer, the problems and
    the evaluation problems checked against them (check_problems), each use's decoder planned (Decoders.plan)."""
    random.seed(cfg.seed)  # nothing here draws from these; seeded so that nothing a model does can vary
    torch.manual_seed(cfg.seed)
    progress(f"loading {cfg.model} on {device} ({precision})" + ("" if problems else " for evaluation only"))
    model, tokenizer, eos_id = load_model_and_tokenizer(cfg, device, precision)
    context, decoders = model.config.max_position_embeddings, Decoders()
    if problems:
        problems = check_problems(problems, cfg, tokenizer, context)
        decoders.plan("rollouts", problems, cfg.max_new_tokens)
    if eval_set:
        eval_set = check_problems(eval_set, cfg, tokenizer, context, cfg.eval_max_new_tokens, "eval_dataset")
        decoders.plan("eval", eval_set, cfg.eval_max_new_tokens)
    return model, tokenizer, eos_id, problems, eval_set, decoders


def run_steps(trains: int, cfg: Config) -> int:
    """The optimizer steps of a run that trains on `trains` problems: P a step, the last step the rest."""
    return -(-trains // max(1, cfg.problems_per_step))  # validate_config asks for P >= 1 after calling this


def run_candidates(s: RunState, cfg: Config) -> tuple[list[dict], int, int]:
    """The problems the next step may draw, the draw number of the first (1-based: its place in the data) and
    how many the step trains on (P; the last step the rest). P; with zero_variance=resample up to resample_limit
    for each, as many as the data set holds beyond those the steps still to come take (so each has its own)."""
    drawn, done = problems_drawn(s.history), problems_trained(s.history)
    take = min(cfg.problems_per_step, s.trains - done)
    later = s.trains - done - take  # the problems of the steps after this one
    n = take if cfg.zero_variance != "resample" else max(take, min(take * cfg.resample_limit,
                                                                   len(s.problems) - drawn - later))
    return s.problems[drawn:drawn + n], drawn + 1, take


# ----------------------------------------------------------------------------------------------
# Config reading and validation

PRECISIONS = ("auto", "fp32", "bf16-autocast", "bf16")

ADVANTAGE_STDS = ("group", "none")                                            # see compute_advantages

LOSS_AGGREGATIONS = ("sequence_sum", "sequence_mean", "token_mean", "dr_grpo")  # see loss_divisors

ZERO_VARIANCES = ("step", "skip", "resample")                                 # see step_or_skip, draw_groups

ANSWER_FORMATS = ("auto", "plain", "gsm8k", "boxed")                          # see reference_answer

LR_SCHEDULES = ("constant", "linear", "cosine")                               # see lr_scheduler

PROMPT_PASSES = ("per_response", "shared")                                    # see SharedPrompt


# Keys that may differ between a checkpoint and the run that resumes it: none of them changes a
# number of the steps already taken. Every other key does, and a difference is refused.
RESUME_MAY_DIFFER = frozenset({"output_dir", "save_every", "keep_last", "resume", "overwrite", "verifier_timeout",
                               "num_problems", "max_bad_steps", "eval_batch_size", "sharding", "dist_timeout",
                               "report_to"})


class UserError(Exception):
    """A mistake in the config, the data or the command line: one line to stderr, exit status 2."""


def load_config(argv: list[str] | None = None) -> Config | Path:
    """YAML file, then key=value overrides from the command line; every value typed and checked (--plot: its folder)."""
    parser = argparse.ArgumentParser(description="RLVR training: one AdamW step per problem.")
    parser.add_argument("--config", help="YAML file of settings (default: config.yaml)")
    parser.add_argument("--plot", metavar="FOLDER", help="draw FOLDER/run.png from a run's logs, and stop")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override a setting of the YAML")
    args = parser.parse_args(argv)
    if args.plot:  # main draws it, from the logs alone: a setting would be silently ignored
        extra = args.overrides + ([f"--config {args.config}"] if args.config else [])
        if extra:
            raise UserError(f"--plot draws a finished run's pictures from its logs and takes no settings (got "
                            f"{extra[0]}); run: python train_rlvr.py --plot {args.plot}")
        return Path(args.plot)
    values = read_config_file(Path(args.config or "config.yaml"), explicit=args.config is not None)
    for item in args.overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise UserError(f"command-line setting '{item}' must look like key=value")
        try:
            values[key] = yaml.load(raw, Loader=ConfigLoader) if raw else ""
        except yaml.YAMLError:
            values[key] = raw
        if isinstance(values[key], (dict, list)) or values[key] is None:
            values[key] = raw

    types = {f.name: f.type for f in dataclasses.fields(Config)}
    unknown = sorted(set(values) - set(types))
    if unknown:
        raise UserError(f"unknown config key '{unknown[0]}'; known keys: {', '.join(types)}")
    type_of = {"str": str, "int": int, "float": float, "bool": bool}
    cfg = Config(**{k: _coerce(k, v, type_of[types[k]]) for k, v in values.items()})
    validate_config(cfg)
    check_trackers(cfg)
    warn_ignored(cfg)
    return cfg


class ConfigLoader(yaml.SafeLoader):
    """YAML 1.1 reads 4:2 as the base-60 number 242 (and 1:30.5 as 90.5): no setting is written that way, so a
    value with a colon stays the text the user wrote, and a message about it quotes that text."""

    def resolve(self, kind, value, implicit):
        tag = super().resolve(kind, value, implicit)
        numbers = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
        return "tag:yaml.org,2002:str" if kind is yaml.ScalarNode and ":" in value and tag in numbers else tag


# Settings that act only when another has a certain value: (key, whether it acts, the setting it needs).
ACTS_ONLY_WITH = [
    *credit.ACTS_ONLY_WITH,  # the credit methods' settings
    ("resample_limit", lambda c: c.zero_variance == "resample", "zero_variance=resample"),
    ("clip_eps", lambda c: c.ppo_epochs > 1, "ppo_epochs > 1 (one epoch's ratio is 1)"),
    ("clip_eps_high", lambda c: c.ppo_epochs > 1, "ppo_epochs > 1 (one epoch's ratio is 1)"),
    ("eval_every", lambda c: c.eval_problems > 0, "eval_problems > 0 (evaluation on)"),
    ("eval_samples", lambda c: c.eval_problems > 0, "eval_problems > 0 (evaluation on)"),
]


def warn_ignored(cfg: Config) -> None:
    """A setting changed from its default where it does nothing is said once, before the run starts."""
    default = Config()
    for key, acts, needs in ACTS_ONLY_WITH:
        if getattr(cfg, key) != getattr(default, key) and not acts(cfg):
            progress(f"warning: {key}={getattr(cfg, key)} is ignored: it acts only with {needs}")


def read_config_file(path: Path, explicit: bool) -> dict:
    if not path.exists():
        if explicit:
            raise UserError(f"config file {path} not found; pass an existing file to --config")
        progress("no config.yaml here: using the built-in defaults (the spec's setup)")
        return {}
    try:
        values = yaml.load(path.read_text(encoding="utf-8"), Loader=ConfigLoader) or {}
    except yaml.YAMLError as e:
        raise UserError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}")
    except UnicodeDecodeError as e:
        raise UserError(f"config file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                        f"{e.start}); save it as UTF-8")
    except OSError as e:  # a folder, unreadable, ...
        raise UserError(f"config file {path} cannot be read ({e.strerror or e}); pass a YAML file to --config")
    if not isinstance(values, dict):
        raise UserError(f"config file {path} must hold 'key: value' lines")
    return values


def _coerce(key: str, value, typ: type):
    """Turn a YAML or command-line value into the field's type, or raise a UserError naming the key."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(value, typ) and not (typ is int and isinstance(value, bool)):
        return value
    if typ is float and number:
        return float(value)
    if typ is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if typ in (int, float) and isinstance(value, str):  # YAML 1.1 reads "1e-5" as a string
        with suppress(ValueError):
            return typ(value)
    if typ is str and (number or isinstance(value, bool)):  # a numeric revision; YAML reads compile: true as a bool
        return str(value).lower() if isinstance(value, bool) else str(value)
    raise UserError(f"config key '{key}' must be {typ.__name__}, got {value!r}")


def validate_config(cfg: Config) -> None:
    for f in dataclasses.fields(cfg):
        if f.type == "float" and not math.isfinite(getattr(cfg, f.name)):
            raise UserError(f"config key '{f.name}' must be a finite number, got {getattr(cfg, f.name)!r}")
    for key, ok, want in training_checks(cfg) + run_checks(cfg):
        if not ok:
            raise UserError(f"config key '{key}' must be {want}, got {getattr(cfg, key)!r}")


def training_checks(cfg: Config) -> list[tuple[str, bool, str]]:
    """The training's settings (the step's, its variants', the credit method's), as (key, whether its value is
    usable, what it must be)."""
    return [
        ("group_size", 2 <= cfg.group_size <= 65536, "an integer in [2, 65536] (advantages need a sample std)"),
        ("temperature", cfg.temperature > 0, "a number > 0"),
        ("top_p", 0 < cfg.top_p <= 1, "a number in (0, 1]"),
        ("max_new_tokens", 1 <= cfg.max_new_tokens <= 2**20, "an integer in [1, 1048576]"),
        ("num_problems", cfg.num_problems >= 0, "an integer >= 0 (0: evaluation only)"),
        ("problems_per_step", 1 <= cfg.problems_per_step and (cfg.problems_per_step <= cfg.num_problems
                                                              or cfg.num_problems == 0),  # evaluation only: unused
         f"an integer in [1, num_problems {cfg.num_problems}] (the problems of one optimizer step)"
         if cfg.num_problems else "an integer >= 1"),
        ("start_index", cfg.start_index >= 0, "an integer >= 0"),
        # AdamW turns lr / (1 - beta1**t) and lr * weight_decay into float32 scalars: beyond ~3e38 it raises
        ("learning_rate", 0 < cfg.learning_rate <= 1e37, "a number in (0, 1e37] (AdamW's step size is a float32)"),
        ("weight_decay", 0 <= cfg.weight_decay and cfg.learning_rate * cfg.weight_decay <= 1e37,
         "a number >= 0 with learning_rate * weight_decay <= 1e37"),
        ("max_grad_norm", cfg.max_grad_norm > 0, "a number > 0"),
        ("lr_schedule", cfg.lr_schedule in LR_SCHEDULES, "one of " + ", ".join(LR_SCHEDULES)),
        ("warmup_steps", 0 <= cfg.warmup_steps and (cfg.warmup_steps < run_steps(cfg.num_problems, cfg)
                                                    or cfg.num_problems == 0),
         f"an integer >= 0 and below the run's {run_steps(cfg.num_problems, cfg)} steps (num_problems / "
         "problems_per_step: at or beyond it the learning rate would never reach learning_rate)"),
        # a value that rounds to 0 in float32 (the rewards' dtype) would make zero-variance groups 0/0 = NaN
        ("std_eps", 0 < float(torch.tensor(cfg.std_eps, dtype=torch.float32)) < math.inf,
         "a number > 0 that float32 can hold (>= 1e-45; it keeps a zero-variance group from dividing by 0)"),
        ("advantage_std", cfg.advantage_std in ADVANTAGE_STDS, "one of " + ", ".join(ADVANTAGE_STDS)),
        ("loss_aggregation", cfg.loss_aggregation in LOSS_AGGREGATIONS, "one of " + ", ".join(LOSS_AGGREGATIONS)),
        ("zero_variance", cfg.zero_variance in ZERO_VARIANCES, "one of " + ", ".join(ZERO_VARIANCES)),
        ("resample_limit", 1 <= cfg.resample_limit <= 1024, "an integer in [1, 1024] (groups drawn per step)"),
        ("format_reward", 0 <= cfg.format_reward <= 1e6, "a number in [0, 1e6] (0: off)"),
        ("answer_format", cfg.answer_format in ANSWER_FORMATS, "one of " + ", ".join(ANSWER_FORMATS)),
        ("eval_answer_format", cfg.eval_answer_format in ANSWER_FORMATS, "one of " + ", ".join(ANSWER_FORMATS)),
        *reward_checks(cfg),
        ("kl_coef", 0 <= cfg.kl_coef <= 1e6, "a number in [0, 1e6] (0: no KL term, no reference model)"),
        ("ppo_epochs", 1 <= cfg.ppo_epochs <= 64, "an integer in [1, 64] (optimizer steps per group)"),
        ("clip_eps", 0 < cfg.clip_eps < 1, "a number in (0, 1) (the ratio is clipped to [1 - eps, 1 + eps])"),
        ("clip_eps_high", 0 <= cfg.clip_eps_high <= 10, "0 (equal to clip_eps) or a number in (0, 10] (DAPO: 0.28)"),
        *credit.setting_checks(cfg, tuple(verifier.STEP_CHECKERS)),
    ]


def run_checks(cfg: Config) -> list[tuple[str, bool, str]]:
    """The run's other settings (seed, device, files, trackers, evaluation), as training_checks gives them."""
    return [
        ("seed", 0 <= cfg.seed < 2**63, "an integer in [0, 2**63) (torch's seeds are 64-bit)"),
        ("compile", cfg.compile in ("auto", "true", "false"), "auto, true or false"),
        ("logprob_batch_size", cfg.logprob_batch_size >= 1, "an integer >= 1"),
        ("prompt_pass", cfg.prompt_pass in PROMPT_PASSES, "one of " + ", ".join(PROMPT_PASSES)),
        # the worker's poll timer takes up to ~24 days (2**31 ms); a day is more than any answer needs
        ("verifier_timeout", 0 < cfg.verifier_timeout <= 86400, "a number of seconds in (0, 86400]"),
        ("bad_records", cfg.bad_records in ("stop", "skip"), "stop or skip"),
        ("sharding", cfg.sharding in ("auto", "replicate", "fsdp"), "auto, replicate or fsdp"),
        ("dist_timeout", 0 < cfg.dist_timeout <= 86400, "a number of seconds in (0, 86400]"),
        ("max_bad_steps", cfg.max_bad_steps >= 1, "an integer >= 1"),
        ("save_every", cfg.save_every >= 0, "an integer >= 0 (0: only after the last step)"),
        ("keep_last", cfg.keep_last >= 1, "an integer >= 1"),
        ("precision", cfg.precision in PRECISIONS, "one of " + ", ".join(PRECISIONS)),
        ("device", cfg.device == "cpu" or cfg.device.split(":")[0] == "cuda", "cpu, cuda or cuda:N"),
        ("prompt_template", cfg.prompt_template.count("{problem}") >= 1, "a text with a {problem} placeholder (each one is replaced)"),
        ("model", cfg.model.strip() != "", "a hub id or a local folder"),
        ("dataset", cfg.dataset.strip() != "", "a hub name, a URL or a local JSON/JSONL/Parquet file"),
        ("output_dir", cfg.output_dir.strip() != "", "a folder path"),
        ("report_to", cfg.report_to == "none" or set(trackers_named(cfg)) <= set(TRACKERS),
         "none or one or more of " + ", ".join(TRACKERS) + ", separated by commas"),
        *eval_checks(cfg),
    ]


def reward_checks(cfg: Config) -> list[tuple[str, bool, str]]:
    """reward_function and reward_weights, in validate_config's (key, ok, what it must be) form."""
    if not cfg.reward_function:
        return [("reward_weights", not cfg.reward_weights, "empty without a reward_function (it weighs the "
                 "verifier's reward against the function's)")]
    path, _, name = cfg.reward_function.rpartition(":")  # a name without a file's path: no ".py" before it
    return [("reward_function", path.endswith(".py") and name.isidentifier(),
             "path/to/file.py:function_name (the function is called as name(response, answer, record) -> float)"),
            ("reward_function", Path(path).expanduser().is_file(),
             f"an existing file: {cfg.reward_function.rpartition(':')[0]} is not one"),
            ("reward_weights", not cfg.reward_weights or reward_weights(cfg.reward_weights) is not None,
             "empty (the function alone) or two finite numbers 'v,f', not both 0: v * the verifier's reward + f * "
             "the function's")]


def reward_weights(text: str) -> tuple[float, float] | None:
    """reward_weights' (verifier, function) weights ("1,0.5" -> (1.0, 0.5)), None when it is not two finite numbers
    or both are 0 (every reward 0: nothing could learn)."""
    try:
        weights = tuple(float(x) for x in text.split(","))
    except ValueError:
        return None
    return weights if len(weights) == 2 and all(map(math.isfinite, weights)) and any(weights) else None


def eval_checks(cfg: Config) -> list[tuple[str, bool, str]]:
    """The evaluation settings' checks, in validate_config's (key, ok, what it must be) form."""
    return [
        ("eval_problems", cfg.eval_problems >= 0, "an integer >= 0 (0: no evaluation)"),
        ("eval_problems", cfg.eval_problems >= 1 or cfg.num_problems >= 1,
         "an integer >= 1 when num_problems is 0 (evaluation only)"),
        ("eval_dataset", cfg.eval_dataset.strip() != "", "a hub name, a URL or a local JSON/JSONL/Parquet file"),
        ("eval_max_new_tokens", cfg.eval_max_new_tokens >= 1, "an integer >= 1"),
        ("eval_batch_size", cfg.eval_batch_size >= 1, "an integer >= 1 (problems decoded together)"),
        ("eval_samples", cfg.eval_samples >= 1, "an integer >= 1 (1: greedy)"),
        ("eval_temperature", cfg.eval_temperature > 0, "a number > 0"),
        ("eval_top_p", 0 < cfg.eval_top_p <= 1, "a number in (0, 1]"),
        ("eval_every", cfg.eval_every >= 0, "an integer >= 0 (0: before and after only)"),
        ("resume", not (cfg.resume and cfg.num_problems == 0), "empty with num_problems 0 (evaluation only runs once)"),
    ]


def resolve_device(cfg: Config) -> torch.device:
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("device is 'cuda' but this machine has no CUDA GPU; "
                        "run with device=cpu (python train_rlvr.py device=cpu) or set device: cpu in config.yaml")
    if cfg.device == "cuda" and launched_world() > 1:  # torchrun: one GPU per process
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(cfg.device)


def resolve_precision(cfg: Config, device: torch.device) -> str:
    # float32 master weights by default: at lr 1e-5 most single AdamW updates of a bfloat16 weight
    # (8 bits of mantissa) round away to nothing. bf16 autocast makes the CUDA forward passes fast.
    if cfg.precision == "auto":
        return "bf16-autocast" if device.type == "cuda" else "fp32"
    return cfg.precision


def autocast(device: torch.device, precision: str):
    return torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16-autocast" else nullcontext()


# ----------------------------------------------------------------------------------------------
# Data readers and answer formats

def check_problems(problems: list[dict], cfg: Config, tokenizer, context: int,
                   max_new_tokens: int | None = None, setting: str = "dataset") -> list[dict]:
    """Refuse (bad_records: stop) or leave out (skip), before training, the records that cannot be used:
    an empty or non-text problem; an empty, list, object or boolean answer (numbers become text); an
    answer whose reference cannot be read in its answer_format; a prompt that with max_new_tokens (the
    eval set: eval_max_new_tokens) overflows the model's context. Says once how the references were read."""
    budget, budget_key = (cfg.max_new_tokens, "max_new_tokens") if max_new_tokens is None else (
        max_new_tokens, "eval_max_new_tokens")
    format_key = "answer_format" if setting == "dataset" else "eval_answer_format"
    answer_format = getattr(cfg, format_key)
    good, bad, too_long, forms = [], [], [], Counter()
    for p in problems:
        answer = p["answer"]
        if not isinstance(p["problem"], str) or not p["problem"].strip():
            bad.append(f"{setting} record {p['index']}: '{cfg.problem_field}' is not a non-empty text")
        elif isinstance(answer, bool) or not isinstance(answer, (str, int, float, type(None))):
            # str() of a list or a boolean ("['5']", "True") can never match a response: a silent zero reward
            kind = {bool: "boolean", list: "list", dict: "object"}.get(type(answer), type(answer).__name__)
            bad.append(f"{setting} record {p['index']}: '{cfg.answer_field}' is a JSON {kind} ({str(answer)[:40]}), "
                       "not a text or a number (write several answers as one text, e.g. \"3, 5\")")
        elif answer is None or str(answer).strip() == "":
            bad.append(f"{setting} record {p['index']}: '{cfg.answer_field}' is empty")
        elif (reference := reference_answer(answer, answer_format))[0] is None:
            bad.append(f"{setting} record {p['index']}: '{cfg.answer_field}' has no {ANSWER_FORMS[reference[1]]} "
                       f"to read the reference from ({format_key} {answer_format}: {str(answer)[-40:]!r})")
        else:
            ids = tokenizer(build_prompt(cfg.prompt_template, p["problem"]), add_special_tokens=False)["input_ids"]
            n = len(ids)
            if n + budget > context:
                too_long.append(len(bad))
                bad.append(f"{setting} record {p['index']}: its prompt has {n} tokens, and with {budget_key} "
                           f"{budget} it exceeds the model's context of {context}")
            else:
                forms[reference[1]] += 1
                good.append(dict(p, answer=reference[0], prompt_ids=ids, extracted=reference[0] != str(answer)))
    if bad and cfg.bad_records == "stop":
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        first = f"lower {budget_key}" if too_long[:1] == [0] else "fix the data"  # the fix for bad[0] comes first
        move = ", move start_index" if setting == "dataset" else ""
        raise UserError(f"{bad[0]}{more}; {first}{move}, or set bad_records: skip")
    for msg in bad:
        progress(f"skipping {msg}")
    if not good:
        raise UserError(f"no {setting} record is usable; fix the data or the settings above")
    progress(f"{setting} answers ({format_key} {answer_format}): " + ", ".join(
        f"{ANSWER_FORMS[form]} in {n}" for form, n in forms.most_common()) + f" of {len(good)} records")
    return good


ANSWER_FORMS = {"plain": "the field as written", "gsm8k": "text after the last '####'", "boxed": "last \\boxed{}"}


def reference_answer(value, answer_format: str) -> tuple[str | None, str]:
    """The reference answer an answer field holds, and the form it was read in (None: there is none):
    plain: the field as written (a number as its text); gsm8k: the text after the last '####' of a
    worked solution (GSM8K: "... 48 + 24 = 72\\n#### 72"); boxed: the content of the last \\boxed{} of a
    worked solution (MATH's solution field), read by the verifier's own extraction. auto: gsm8k where
    the text holds '####', boxed where it holds a \\boxed{} or \\fbox{}, else plain (short answers)."""
    text = str(value)
    form = answer_format
    if form == "auto":
        form = "gsm8k" if "####" in text else "boxed" if "\\boxed" in text or "\\fbox" in text else "plain"
    if form == "gsm8k":
        _, sep, after = text.rpartition("####")
        return (after.strip() or None) if sep else None, form
    if form == "boxed":
        return verifier.extract_final_answer(text), form
    return text, form


def load_records(source: str, split: str, fields: dict[str, str], start: int, count: int,
                 setting: str = "dataset", count_keys: tuple[str, ...] = ("start_index", "num_problems"),
                 up_to: int = 0, config: str = "") -> list[dict]:
    """Records start .. start + count - 1 (up_to > count: up to that many, as far as the data set goes) of
    a hub name (its configuration `config`), URL, local copy of a hub set (a folder) or local
    .json/.jsonl(.gz)/.parquet file, in file order, each a dict of all its fields plus "index" (its
    place in the file). Every record must have the `fields` (setting -> field name)."""
    end = start + count
    if config and data_builder(source):
        raise UserError(f"{setting}_config {config!r} names a configuration of a hub set, and {setting} {source} is a "
                        f"file, which has none; set {setting}_config to empty (or {setting} to the hub set)")
    if data_builder(source) == "json" and Path(source).is_file():  # read only as far as the run needs
        rows = read_json_records(Path(source), setting, max(end, start + up_to))
        names = list(dict.fromkeys(k for r in rows for k in r))
        rows = [{k: r.get(k) for k in names} for r in rows]  # every field in every record, as datasets gives them
    else:
        rows = open_dataset(source, split, setting, config)
        names = rows.column_names
    if len(rows) == 0:  # else the field check below would name a field, and a fix, that are not the problem
        raise no_records(f"{setting} file {source}" if Path(source).is_file() else f"{setting} {source} (split "
                         f"{split})", setting)
    for key, field in fields.items():
        if field not in names:
            raise UserError(f"{setting} has no field '{field}' (set {key}); its fields are: {', '.join(names)}")
    if len(rows) < end:
        raise UserError(f"{setting} has {len(rows)} records but {' + '.join(count_keys)} = {end}; "
                        f"lower {' or '.join(reversed(count_keys))}")
    return [dict(rows[i], index=i) for i in range(start, max(end, min(start + up_to, len(rows))))]


def no_records(what: str, setting: str) -> UserError:
    return UserError(f"{what} holds no records; point {setting} at a data set with problems in it")


DATA_SUFFIXES = {".json": "json", ".jsonl": "json", ".json.gz": "json", ".jsonl.gz": "json", ".parquet": "parquet"}


def data_builder(source: str) -> str | None:
    """The datasets builder for a file name or URL ("json" reads .gz too), None for a hub name."""
    name = source.split("?")[0].lower()
    return next((b for suffix, b in DATA_SUFFIXES.items() if name.endswith(suffix)), None)


MAX_RECORD_BYTES = 4 << 20  # one record of a data file: a problem of 4 MiB fits no model's context anyway

READ_CHUNK = 1 << 16


def check_data_path(path: Path, what: str) -> None:
    if path.is_dir():
        raise UserError(f"{what} {path} is a folder; set it to a .json/.jsonl/.json.gz/.jsonl.gz/.parquet file")
    if path.stat().st_size == 0:
        raise UserError(f"{what} file {path} is empty; point it at a file of records")


def read_json_records(path: Path, what: str, stop: int) -> list[dict]:
    """The first `stop` records of a local JSON array, JSON Lines or one-object (one record) file, read
    only as far as they go, each at most MAX_RECORD_BYTES: a huge file or line costs neither time nor
    memory. Damage (not UTF-8, not JSON, a record over the limit) is one line naming file and place."""
    check_data_path(path, what)
    try:
        with (gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")) as f:
            first = b""
            while not first.strip() and (chunk := f.read(READ_CHUNK)):
                first = chunk.lstrip()[:1]
            if not first:
                raise no_records(f"{what} file {path}", what)
            f.seek(0)
            return (json_array_records if first == b"[" else json_lines_records)(f, path, what, stop)
    except (OSError, EOFError) as e:  # a damaged gzip stream (BadGzipFile is an OSError)
        raise UserError(f"{what} file {path} is not a readable {'gzip ' if path.suffix == '.gz' else ''}file ({e}); "
                        "re-download or unpack it") from None


def _utf8(raw: bytes, path: Path, what: str, line: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(path, what, raw[e.start], line + raw.count(b"\n", 0, e.start)) from None


def _not_utf8(path: Path, what: str, byte: int, line: int) -> UserError:
    return UserError(f"{what} file {path} is not UTF-8 text (byte {byte:#04x} on line {line}); save it as UTF-8")


def _too_long(path: Path, what: str, where: str) -> UserError:
    return UserError(f"{what} file {path}: {where} is over {MAX_RECORD_BYTES >> 20} MiB, the most one record may "
                     "take; write one problem with its answer per record (JSON Lines: one record a line)")


def json_lines_records(f, path: Path, what: str, stop: int) -> list[dict]:
    records, number = [], 0
    while len(records) < stop and (line := f.readline(MAX_RECORD_BYTES + 1)):
        number += 1
        if len(line) > MAX_RECORD_BYTES:
            raise _too_long(path, what, f"line {number}")
        if not line.strip():
            continue
        text = _utf8(line, path, what, number)
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            if number == 1 and text.lstrip()[:1] == "{":  # one object over several lines: one record
                return [json_document(text + _utf8(f.read(MAX_RECORD_BYTES), path, what, 2), path, what)]
            raise UserError(f"{what} file {path} line {number} is not a JSON record ({e.msg}, column {e.colno}); "
                            "fix or remove that line") from None
        records.append(_record(record, path, what, f"line {number}"))
    return records


def json_document(text: str, path: Path, what: str) -> dict:
    if len(text.encode()) > MAX_RECORD_BYTES:
        raise _too_long(path, what, "its one JSON object")
    try:
        return _record(json.loads(text), path, what, "its JSON object")
    except json.JSONDecodeError as e:
        raise UserError(f"{what} file {path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None


def json_array_records(f, path: Path, what: str, stop: int) -> list[dict]:
    """The elements of a JSON array, decoded one at a time from a window of the file."""
    w, records = JsonWindow(f, path, what), []
    w.more()
    w.pos = w.text.index("[") + 1
    if w.skip_space() == "]":
        return records
    while len(records) < stop:
        w.skip_space()
        records.append(_record(w.next_value(f"record {len(records)}"), path, what, f"record {len(records)}"))
        sep = w.skip_space()
        if sep == "]":
            break
        if sep != ",":
            w.fail("Expecting ',' delimiter" if sep else "Expecting ']'", w.pos)
        w.pos += 1
    return records


class JsonWindow:
    """The part of a JSON file being decoded (text from pos on), read on a chunk at a time; the UTF-8
    decoding is incremental (a character split between two chunks is whole in the next), and
    lines_before counts the newlines already dropped, for the line numbers of messages."""

    def __init__(self, f, path: Path, what: str):
        self.f, self.path, self.what = f, path, what
        self.decoder, self.utf8 = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8")()
        self.text, self.pos, self.lines_before, self.eof = "", 0, 0, False

    def more(self) -> bool:
        if self.eof:
            return False
        chunk = self.f.read(READ_CHUNK)
        self.eof = not chunk
        self.lines_before += self.text.count("\n", 0, self.pos)
        try:
            new = self.utf8.decode(chunk, final=not chunk)
        except UnicodeDecodeError as e:
            line = self.lines_before + self.text.count("\n", self.pos) + chunk.count(b"\n", 0, e.start) + 1
            raise _not_utf8(self.path, self.what, chunk[e.start], line) from None
        self.text, self.pos = self.text[self.pos:] + new, 0
        return bool(chunk)

    def skip_space(self) -> str:
        """The next character that is not white space ("": the end of the file)."""
        while True:
            while self.pos < len(self.text) and self.text[self.pos].isspace():
                self.pos += 1
            if self.pos < len(self.text) or not self.more():
                return self.text[self.pos:self.pos + 1]

    def next_value(self, where: str):
        """The JSON value at pos (pos moves past it), reading on while the window holds only part of it."""
        while True:
            try:
                value, end = self.decoder.raw_decode(self.text, self.pos)
                break
            except json.JSONDecodeError as e:  # incomplete in this window, or invalid: read on to tell
                if len(self.text) - self.pos > MAX_RECORD_BYTES:
                    raise _too_long(self.path, self.what, where) from None
                if self.eof:
                    self.fail(e.msg, e.pos)
                self.more()
        if end - self.pos > MAX_RECORD_BYTES:
            raise _too_long(self.path, self.what, where)
        self.pos = end
        return value

    def fail(self, message: str, at: int):
        line = self.lines_before + self.text.count("\n", 0, at) + 1
        column = at - self.text.rfind("\n", 0, at)
        raise UserError(f"{self.what} file {self.path} is not valid JSON: {message} at line {line}, column {column}")


def _record(value, path: Path, what: str, where: str) -> dict:
    if not isinstance(value, dict):
        raise UserError(f"{what} file {path}: {where} is a JSON {type(value).__name__}, not an object of fields; "
                        "each record must be {\"problem\": ..., \"answer\": ...}")
    return value


def network_problem(source: str) -> str | None:
    """Why a URL or hub name cannot be fetched, if the cause is the network: the host does not resolve."""
    host = urlparse(source).hostname if "://" in source else "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError as e:
        return f"no network: cannot resolve {host} ({e.strerror or e})"
    return None


def missing_local_path(value: str) -> str | None:
    """Why a value not on disk is read as a local path, not a hub id (`name`, `org/name`): it starts with
    `.`, `/` or `~`, ends with `/`, holds a backslash or two `/`, or its first part is a folder here
    (`runs/dmeo` beside runs/): a typo named at once, not sent to the hub. None: it may be a hub id."""
    if Path(value).expanduser().exists() or value.startswith(("http://", "https://")):
        return None
    parts = value.split("/")
    if value.startswith((".", "/", "~")) or value.endswith("/") or "\\" in value or len(parts) > 2:
        return "read as a path: a hub id is org/name"
    if len(parts) == 2 and Path(parts[0]).expanduser().is_dir():
        return f"read as a path, since {parts[0]}/ is a folder here"
    return None


@contextmanager
def hub_offline(offline: bool):
    """With no network, the hub libraries read their local cache only and give up at once: no
    retries, no messages (datasets and huggingface_hub check these flags at each call)."""
    import huggingface_hub.constants as hub
    flags = [m for m in (hub, sys.modules.get("datasets.config")) if m is not None] if offline else []
    saved = [m.HF_HUB_OFFLINE for m in flags]
    for m in flags:
        m.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for m, value in zip(flags, saved):
            m.HF_HUB_OFFLINE = value


def local_copy_hint(what: str, source: str) -> str:
    """An offline copy of the default data sets (only for them), where the checkout has ../shared/data beside it."""
    name = {("dataset", MATH_TRAIN_URL): "math_train.jsonl.gz",
            ("eval_dataset", Config.eval_dataset): "math500_test.json"}.get((what, source))
    copy = Path(__file__).resolve().parent.parent / "shared" / "data" / (name or "-")
    return f", e.g. {what}={min(os.path.relpath(copy), str(copy), key=len)}" if name and copy.is_file() else ""


def open_dataset(source: str, split: str, what: str = "dataset", config: str = ""):
    """A datasets.Dataset from a hub name (its configuration `config`, when the set has several), a URL,
    a local copy of a hub set (a folder: its README's configurations, or its data files) or a local
    .parquet file; every failure a one-line UserError naming the source and the fix. (Local JSON
    files: read_json_records.)"""
    import datasets
    datasets.disable_progress_bars()
    builder, is_url, local = data_builder(source), source.startswith(("http://", "https://")), Path(source)
    if not is_url and local.exists():
        if builder is None and not local.is_dir():
            raise UserError(f"{what} file {source} is not a .json/.jsonl/.json.gz/.jsonl.gz/.parquet file")
        if not local.is_dir():
            check_data_path(local, what)
    elif builder and not is_url:
        raise UserError(f"{what} file {source} not found; set {what}: to an existing file, a URL or a hub name")
    elif not is_url and missing_local_path(source):
        raise UserError(f"{what} {source}: no such file or folder ({missing_local_path(source)}); set {what}: to "
                        "an existing file or folder, a URL or a hub name")
    hub_name = not builder and not is_url and not local.exists()
    offline = network_problem(source) if hub_name else None  # asked once, up front: the hub client would retry
    try:
        if builder:
            return datasets.load_dataset(builder, data_files=source, split="train")
        with hub_offline(offline is not None):  # a cached copy still loads
            return datasets.load_dataset(source, split=split, **({"name": config} if config else {}))
    except Exception as e:  # network, hub or format problems: one line, not a traceback
        if local.is_file() and "corresponds to no data" in str(e):  # datasets' words for a file of 0 rows
            raise no_records(f"{what} file {source}", what) from None
        if configs := re.search(r"(?:available configs|Available): (\[.*?\])", str(e)):  # missing or unknown
            raise UserError(f"{what} {source} has several configurations, {configs[1]}, "
                            + (f"and none is called {config!r}" if config else "and no default") +
                            f"; set {what}_config to one of them") from None
        offline = offline or (None if local.exists() else network_problem(source))
        if offline:
            raise UserError(f"could not load {what} {source!r}: {offline}; connect to the internet, or download it "
                            f"and set {what}: to the local file{local_copy_hint(what, source)}")
        detail = str(e).splitlines()[0] if str(e) else ""
        raise UserError(f"could not load {what} {source!r}: {type(e).__name__}: {detail}")


# ----------------------------------------------------------------------------------------------
# The model

def load_model_and_tokenizer(cfg: Config, device: torch.device, precision: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    if missing_local_path(cfg.model):
        raise UserError(f"model {cfg.model}: no such folder ({missing_local_path(cfg.model)}); set model: to a "
                        "local model folder or a hub id")
    # no network: asked once, up front; then only the local hub cache is read (the hub client would retry ~50 s)
    offline = None if Path(cfg.model).expanduser().exists() else network_problem("https://huggingface.co")
    local = {"local_files_only": True} if offline else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model, revision=cfg.revision, **local)
        model = AutoModelForCausalLM.from_pretrained(cfg.model, revision=cfg.revision, dtype=dtype, **local)
    except Exception as e:  # missing, unreachable, truncated or foreign files: one line, not a traceback
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        hint = "set model: to a hub id or a local folder"
        if offline:
            detail = "it is not in the local hub cache"
            hint = f"{offline}; connect, or set model: to a local folder of the model (config, tokenizer, weights)"
        raise UserError(f"could not load model {cfg.model!r} at revision {cfg.revision!r}: {detail}; {hint}") from None
    eos_id = resolve_eos_id(tokenizer, cfg, model.config.vocab_size)
    warn_if_not_model_eos(model, tokenizer, cfg, eos_id)
    return shard_model(model, device).eval(), tokenizer, eos_id


def resolve_eos_id(tokenizer, cfg: Config, vocab_size: int) -> int:
    # An unknown token maps to the unk id, whose text differs (Qwen's unk token IS <|endoftext|>).
    eos_id = tokenizer.convert_tokens_to_ids(cfg.eos_token)
    if eos_id is None or eos_id >= vocab_size or tokenizer.convert_ids_to_tokens(eos_id) != cfg.eos_token:
        raise UserError(f"eos_token {cfg.eos_token!r} is not a token of {cfg.model}; set eos_token to its EOS")
    return eos_id


def warn_if_not_model_eos(model, tokenizer, cfg: Config, eos_id: int) -> None:
    """eos_token is a real token but not one the model ends its texts with: every rollout would run to
    max_new_tokens. Allowed (a prompt format may stop at its own marker), but said once."""
    ends = getattr(model.generation_config, "eos_token_id", None)
    ends = [] if ends is None else [ends] if isinstance(ends, int) else list(ends)
    if ends and eos_id not in ends:
        names = ", ".join(f"{tokenizer.convert_ids_to_tokens(i)!r} (id {i})" for i in ends)
        progress(f"warning: eos_token {cfg.eos_token!r} (id {eos_id}) is not the EOS of {cfg.model}'s generation "
                 f"config ({names}); rollouts that never produce it run to max_new_tokens")


def load_reference(cfg: Config, device: torch.device, precision: str) -> torch.nn.Module | None:
    """kl_coef > 0: the frozen reference, the starting weights (a resumed run's too: resume refuses another
    model or revision): `model` loaded again from the local files, no gradient, sharded like the policy.
    One more copy of the weights (Qwen3-0.6B: 2.4 GB float32, 1.2 GB bf16; fsdp: 1/world of it)."""
    if not cfg.kl_coef:
        return None
    from transformers import AutoModelForCausalLM
    progress(f"loading the reference model for the KL term (kl_coef {cfg.kl_coef})")
    reference = AutoModelForCausalLM.from_pretrained(cfg.model, revision=cfg.revision, local_files_only=True,
                                                     dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    reference.requires_grad_(False)
    return shard_model(reference, device).eval()


def check_memory(cfg: Config, model, problems: list[dict], device: torch.device) -> None:
    """Refuse up front a group that cannot fit: the KV cache of group_size rollouts of the longest prompt
    + max_new_tokens (keys and values, every layer, 2 bytes each at least) plus one decode step's float32
    scores. A lower bound, so it never refuses a run that could fit: a failure deep in step 1 becomes one line."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    length = max(len(p["prompt_ids"]) for p in problems) + cfg.max_new_tokens
    rows = cfg.group_size * cfg.problems_per_step  # problems_per_step: every group of the step in one batch
    need = rows * (length * c.num_hidden_layers * 2 * kv_heads * head_dim * 2 + 3 * c.vocab_size * 4)
    have = available_memory(device)
    if need > have:
        what = f"group_size {cfg.group_size}" + (f" x problems_per_step {cfg.problems_per_step}"
                                                 if cfg.problems_per_step > 1 else "")
        raise UserError(f"{what} with max_new_tokens {cfg.max_new_tokens} needs at least "
                        f"{need / 1e9:.1f} GB on {device} for generation, but {have / 1e9:.1f} GB are available; "
                        f"lower group_size{', problems_per_step' if cfg.problems_per_step > 1 else ''} or max_new_tokens")


def check_prompt_pass(cfg: Config, model) -> None:
    """prompt_pass: shared reads each response after the prompt's keys and values of every layer: a model whose
    cache keeps a window of them (sliding-window attention) would see fewer than the spec's forward does."""
    from transformers import DynamicCache
    kinds = {type(layer).__name__ for layer in DynamicCache(config=model.config).layers}
    if cfg.prompt_pass == "shared" and kinds != {"DynamicLayer"}:
        raise UserError(f"prompt_pass shared needs a model whose every layer attends to the whole sequence; "
                        f"{cfg.model} has cache layers {', '.join(sorted(kinds))} (sliding-window attention); set "
                        "prompt_pass: per_response")


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62  # unknown: do not refuse


# ----------------------------------------------------------------------------------------------
# The sampler's machinery

@torch.no_grad()
def sample(model, prompts: list[torch.Tensor], room: int, eos_id: int, amp, cfg: Config, streams: list | None = None,
           rule: tuple[float, float] | None = None, *, prefixes: list[torch.Tensor] | None = None, prompt_state=None,
           use: str | None = None, decoders: Decoders | None = None, rows: int | None = None,
           entropies: list | None = None, common_prefix: bool = False) -> tuple[list[torch.Tensor], list[bool]]:
    """The one sampler: the rollouts, the credit methods' continuations and branches, and evaluation call it. Row i
    continues prompts[i] by at most `room` tokens, each drawn with the rule (temperature, top_p) from streams[i]
    (sampling_pick), or greedily (rule None); sampling comes from these arguments alone (no transformers defaults
    or generation_config leak in). With prefixes: the one prompt, then row i's prefix, the prompt's pass run once
    (prompt_state: shared_prompt_state's, reused by every call for the group; None: prompt + prefix for every
    row), ended rows dropped. Otherwise the decode of `use` (rollouts, eval): eager, or with `compile` the
    StaticDecoder of `decoders` (the same logits in float32). common_prefix (evaluation with prompt_pass shared,
    eager): the prompts' common first tokens (a few-shot prompt's examples) run once, each row then reading its own
    rest after them, as a prompt and its prefixes (the same tokens up to float rounding). entropies: a list that
    receives each response token's entropy (decode)."""
    pick = greedy_pick if rule is None else sampling_pick(streams, *rule, prompts[0].device)
    shared = common_prefix and not compile_decode(cfg, prompts[0].device) and shared_length(prompts)
    if shared:
        prompt_state = shared_prompt_state(model, prompts[0][:shared], amp)
        prompts, prefixes = [prompts[0][:shared]], [p[shared:] for p in prompts]
    if prefixes is not None:
        return decode(model, [torch.cat([prompts[0], p]) for p in prefixes], room, eos_id, pick, amp,
                      drop_finished=True, entropies=entropies,
                      prefilled=prompt_state and after_prompt(model, prompt_state, prefixes, amp))
    with weight_cast_cache(amp, prompts[0].device.type):
        return compiled_or_eager(model, prompts, room, eos_id, pick, amp, cfg, streams or [], use, rows,
                                 decoders=decoders, entropies=entropies)

# (each row's uniforms, the nucleus without a sort)

def greedy_pick(logits: torch.Tensor, rows=None) -> torch.Tensor:
    """Greedy decoding: the argmax of the float32 logits, no warper (the first of tied maxima)."""
    return logits.float().argmax(dim=-1)


UNIFORM_BLOCK = 64  # uniforms drawn per stream at a time


class Uniforms:
    """The sampler's float64 uniforms: each call gives every row named in `rows` (default: all) the
    next number of its own stream (streams[i]), as a (rows, 1) tensor. Drawn UNIFORM_BLOCK at a time
    (one launch per 64 tokens); on the CPU a block is exactly the next 64 single draws (mt19937,
    tested); on CUDA (Philox) other numbers, still row i's t-th depending on (seed, step, rollout, t)
    alone. A stream set back since its block (the eager retry of a failed compiled decode) draws anew."""

    def __init__(self, streams: list[torch.Generator], device):
        self.streams = list(streams)
        self.block = torch.empty(len(self.streams), UNIFORM_BLOCK, dtype=torch.float64, device=device)
        self.used = [UNIFORM_BLOCK] * len(self.streams)  # how many of each stream's block were handed out
        self.marks = [None] * len(self.streams)  # each stream's state just after its block was drawn
        self.subset = (None, None)  # the last rows named and their index tensor (new only when rows leave)

    def __call__(self, rows=None) -> torch.Tensor:
        every = list(range(len(self.streams)))
        rows = every if rows is None else list(rows)
        stale = [i for i in rows if self.used[i] == UNIFORM_BLOCK
                 or not torch.equal(self.streams[i].get_state(), self.marks[i])]
        if stale:
            self.block = self.block.clone()  # the views handed out earlier keep their numbers
            for i in stale:
                self.block[i].uniform_(generator=self.streams[i])
                self.used[i], self.marks[i] = 0, self.streams[i].get_state()
        cols = [self.used[i] for i in rows]
        for i in rows:
            self.used[i] += 1
        if rows == every and min(cols) == max(cols):  # every row at the same place: always so in decode
            return self.block[:, cols[0], None]  # a view: no copy
        if self.subset[0] != rows:
            self.subset = rows, torch.tensor(rows, device=self.block.device)
        at = cols[0] if min(cols) == max(cols) else torch.tensor(cols, device=self.block.device)
        return self.block[self.subset[1], at].unsqueeze(-1)


def shared_length(prompts: list[torch.Tensor]) -> int:
    """How many first tokens every prompt shares, short of the shortest one's last (each row keeps a token of its own
    to feed after them)."""
    n = min(len(p) for p in prompts) - 1
    if n <= 0:
        return 0
    same = torch.stack([p[:n] == prompts[0][:n] for p in prompts]).all(0)
    return int(same.int().cumprod(0).sum())


def top_p_mask(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """The kept set of top_p_reference, bit for bit (on CUDA it is top_p_reference: no sync). On the CPU
    no ids are sorted: the removed tokens are the r lowest VALUES, so the kept set is every score >= the
    r-th lowest; rows where that value ties a removed token, or with NaN, go to top_p_reference."""
    if top_p >= 1.0:  # transformers adds no top-p warper at 1.0: every token with a finite score
        return torch.isfinite(scores) | (scores == scores.max(dim=-1, keepdim=True).values)
    if not sampler_on_host(scores.device):
        return top_p_reference(scores, top_p)
    values = sorted_values(scores).to(scores.device)
    cumulative = values.softmax(dim=-1).cumsum(dim=-1)
    n_removed = (cumulative <= (1 - top_p)).sum(dim=-1, keepdim=True).clamp(max=scores.shape[-1] - 1)
    threshold = values.gather(-1, n_removed)
    split_tie = (n_removed > 0) & (values.gather(-1, (n_removed - 1).clamp(min=0)) == threshold)
    mask = scores >= threshold
    bad = (split_tie | values[..., -1:].isnan()).squeeze(-1)
    if bool(bad.any()):
        rows = bad.nonzero().squeeze(-1)
        mask[rows] = top_p_reference(scores[rows], top_p)
    return mask


def sorted_values(scores: torch.Tensor) -> torch.Tensor:
    """Each row's values in ascending order: what torch.sort(scores).values holds (tied tokens have
    equal values, so their order cannot show). On CPU, numpy's vectorized sort of the values alone
    takes ~4 ms for 8 x 151,936 scores, torch.sort (which also builds the permutation) ~100 ms."""
    if scores.device.type == "cpu":
        import numpy as np
        return torch.from_numpy(np.sort(scores.detach().contiguous().numpy(), axis=-1))
    return torch.sort(scores, dim=-1).values


def sampler_on_host(device) -> bool:
    """Whether the sampler runs on the CPU, where numpy can sort and a branch on a tensor's value
    costs nothing. On CUDA such a branch stops the host until the GPU catches up (a sync), so the
    CUDA path takes none (the tests run it on CPU tensors by making this False)."""
    return torch.device(device).type == "cpu"



# ----------------------------------------------------------------------------------------------
# Decoders
# (eager, static, compiled, bf16, the prompt pass)

def top_p_reference(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Kept-token mask of transformers' TopPLogitsWarper: sort ascending, drop the tokens whose
    cumulative probability is <= 1 - top_p, always keep the most likely one."""
    sorted_scores, order = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - top_p)
    remove[..., -1:] = False
    return ~remove.scatter(-1, order, remove)


# The decoding machinery: one decode loop for rollouts and evaluation, eager or compiled.

def compiled_or_eager(model, prompts: list[torch.Tensor], max_new_tokens: int, eos_id: int, pick, amp, cfg: Config,
                      streams: list[torch.Generator], use: str, rows: int | None = None,
                      decoders: Decoders | None = None, entropies: list | None = None):
    """decode() through the compiled StaticDecoder of `use` (held by `decoders`) when the `compile`
    setting asks for it, checked against eager decoding at its first generation; eager after any
    failure, for the rest of the run. Eager evaluation drops ended rows; the compiled one keeps its
    shape (`rows`: the batch is filled up to that many rows, so the last batch takes the same graph)."""
    shared = use == "rollouts" and share_prompt_pass(model, prompts, amp, decoders)
    if decoders is not None and decoders.failed is None and compile_decode(cfg, prompts[0].device):
        states = [g.get_state() for g in streams]
        try:
            decoder = decoders.get(model, amp, use)
            check_compiled_decode(decoder, model, prompts, max_new_tokens, amp, rows)
            return decode(model, prompts, max_new_tokens, eos_id, pick, amp, decoder=decoder, rows=rows,
                          shared=shared, entropies=entropies)
        except (torch.OutOfMemoryError, Interrupted, NonFiniteScores):
            raise
        except Exception as e:  # torch.compile and CUDA graphs are the least portable part: never let them stop a run
            decoders.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            decoders.static.clear()
            progress(f"compiled decoding failed ({decoders.failed}); decoding eagerly from now on "
                     "(compile: false skips the attempt)")
            for g, state in zip(streams, states):  # the eager retry draws the same random numbers
                g.set_state(state)
            if entropies is not None:
                entropies.clear()
    return decode(model, prompts, max_new_tokens, eos_id, pick, amp, drop_finished=use == "eval", shared=shared,
                  entropies=entropies)


def share_prompt_pass(model, prompts: list[torch.Tensor], amp, decoders: Decoders | None) -> bool:
    """Whether the rollouts' prompt pass runs once for the whole group (prompt_pass; a run's Decoders keep the
    answer, a call without them runs every row's). In float32 its numbers must be the batched pass's bit for
    bit: compared once a run, at the first group (one batched pass more); where they differ (a BLAS whose
    kernels depend on the number of rows), every row's prompt runs as before, and the run says so. In bf16
    the decode paths differ by ulps already: shared without a check."""
    if decoders is None or len(prompts) < 2 or any(p is not prompts[0] for p in prompts) or RANKS.sharding == "fsdp":
        return False  # fsdp: its root forward must come first (FSDP2's lazy init), and each rank holds a few rows
    if decoders.shared_prompt is not None:
        return decoders.shared_prompt
    low = isinstance(amp, torch.autocast) or next(model.parameters()).dtype != torch.float32
    decoders.shared_prompt = low or same_prompt_pass(model, torch.stack(prompts), amp)
    if not decoders.shared_prompt:
        progress("the prompt's pass run once differs in its last bits from the pass over every row on this machine; "
                 "each rollout's prompt is run (slower, the same numbers)")
    return decoders.shared_prompt


@torch.no_grad()
def same_prompt_pass(model, batch: torch.Tensor, amp) -> bool:
    """Whether prompt_pass gives the same logits, keys and values shared as batched, bit for bit."""
    from transformers import DynamicCache
    caches = [DynamicCache(config=model.config) for _ in range(2)]
    with amp:
        logits = [prompt_pass(model, batch, c, cache_arg(model), shared) for c, shared in zip(caches, (True, False))]
    return torch.equal(*logits) and all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                                        for a, b in zip(*(c.layers for c in caches)))


def prompt_pass(model, batch: torch.Tensor, cache, cache_name: str, shared: bool = False, **padding) -> torch.Tensor:
    """The prompt's forward pass into `cache`: each row's next-token logits. `shared` (the rollouts: one prompt in
    every row) runs the prompt once, 1/rows of the work, and repeats its keys and values to every row; the LM head
    still runs on all the rows together, as the batched pass's does (a BLAS may round one row apart otherwise)."""
    if not shared:
        return next_token_scores(model, batch, cache, cache_name, **padding)
    decoder = model.get_decoder()
    hidden = decoder(batch[:1], **{cache_arg(decoder): cache}, use_cache=True).last_hidden_state[:, -1:]
    cache.batch_repeat_interleave(len(batch))
    return model.get_output_embeddings()(hidden.expand(len(batch), -1, -1).contiguous())[:, -1]


CHECK_EVERY = 8  # on a GPU decode asks whether every row is done (and the scores finite) every this many tokens

HOST_CHECK_EVERY = 1  # on the CPU: every token


def check_every(device) -> int:
    """How often decode asks whether every row is done: on a GPU every CHECK_EVERY tokens (each answer stops the
    host until the GPU catches up); on the CPU, where the answer is already on the host, at every token, so a
    group stops at its last EOS and not up to 7 decode steps of the whole batch later (SmolLM2's 18-token
    groups ran 24). The responses are the same either way: ended rows are fed EOS and cut at their first."""
    return HOST_CHECK_EVERY if sampler_on_host(device) else CHECK_EVERY


def decode(model, prompts: list[torch.Tensor], max_new_tokens: int, eos_id: int, pick, amp,
           decoder: StaticDecoder | None = None, drop_finished: bool = False, rows: int | None = None,
           shared: bool = False, entropies: list | None = None, prefilled: tuple | None = None):
    """The one decode loop: row i continues prompts[i], one token per step chosen by pick(logits, rows),
    until every row has emitted EOS or max_new_tokens; returns responses_of the tokens. A finished row
    is fed EOS, so the batch keeps its shape and numbers; the host checks for the end every check_every
    tokens (on a GPU one sync per CHECK_EVERY tokens). drop_finished (eager evaluation) drops ended rows
    at those checks (pick then gets the rows' original indices); a compiled `decoder` keeps every row,
    filled up to `rows`. shared: every row is one prompt, whose pass runs once (prompt_pass). prefilled: the
    prompts' pass already run (after_prompt: eager_decoder's four). entropies: a list that receives each response
    token's entropy, -sum p log p of the scores that drew it (the distribution the loss trains: no temperature)."""
    n, device = len(prompts), prompts[0].device
    safe_id = max(eos_id, 0)  # a valid token id (the pad id), fed in place of ids drawn from unusable scores
    logits, step, cache, padding = prefilled or prompts_passed(model, prompts, max_new_tokens, safe_id, amp, decoder,
                                                               rows, shared)
    width = len(logits)
    record = None if entropies is None else torch.full((width, max_new_tokens), math.nan, device=device)
    tokens = torch.full((width, max_new_tokens), eos_id, dtype=torch.long, device=device)
    finished = torch.arange(width, device=device) >= n  # the filler rows are done from the start
    live = list(range(width)) if drop_finished else None  # the rows still in the batch, by original index
    index = torch.arange(width, device=device)
    first_bad = torch.tensor(max_new_tokens + 1, device=device)  # the first new token drawn from unusable scores
    counts = torch.arange(1, max_new_tokens + 1, device=device)  # counts[t]: a device scalar, no host-to-device copy
    steps, period = 0, check_every(device)
    for t in range(max_new_tokens):
        if record is not None:
            record[index, t] = entropy_of(logits)
        drawn = pick(logits[:n]) if live is None else pick(logits, live)
        if len(drawn) < len(logits):
            drawn = torch.cat([drawn, drawn.new_full((len(logits) - len(drawn),), safe_id)])
        # NaN or +inf scores draw an out-of-range id: it never reaches the next forward (the safe id
        # goes in its place), and the run stops at the next check, as if it had stopped right here
        unusable = (logits.isnan() | logits.isposinf()).any()
        first_bad = torch.where(unusable, torch.minimum(first_bad, counts[t]), first_bad)
        nxt = torch.where(finished[index], eos_id, torch.where(unusable, safe_id, drawn))
        tokens[index, t] = nxt
        finished[index] |= nxt == eos_id
        steps = t + 1
        if steps % period == 0 or steps == max_new_tokens:
            done, bad = torch.stack([finished.all().long(), first_bad]).tolist()  # the one host sync
            if bad <= max_new_tokens:
                raise NonFiniteScores(f"the model's next-token scores are NaN or infinite at new token {bad}")
            if steps == max_new_tokens or done:
                break
            if live is not None and finished[index].any():  # the ended rows leave the batch
                keep = (~finished[index]).nonzero().squeeze(-1)
                live = [live[i] for i in keep.tolist()]
                index, nxt = torch.tensor(live, device=device), nxt[keep]
                drop_rows(cache, padding, keep)
        check_stop(local=True)  # safe point for SIGINT/SIGTERM
        logits = step(torch.where(nxt < 0, safe_id, nxt)[:, None])
    responses, cut = responses_of(tokens[:n, :steps], eos_id)
    if entropies is not None:
        entropies.extend(record[i, :len(r)].tolist() for i, r in enumerate(responses))
    return responses, cut


def prompts_passed(model, prompts: list[torch.Tensor], max_new_tokens: int, pad_id: int, amp,
                   decoder: StaticDecoder | None, rows: int | None, shared: bool) -> tuple:
    """decode's start: the prompts' pass, through the compiled `decoder` (its rows filled up to `rows`) or eagerly;
    the first logits, the one-token step, and the eager cache and padding (None with the compiled decoder)."""
    if decoder is None:
        batch, mask, positions = left_padded(prompts, pad_id)
        return eager_decoder(model, batch, mask, positions, amp, shared=shared)
    batch, mask, positions = filled_batch(prompts, rows, pad_id)
    return decoder.prefill(batch, max_new_tokens, mask, positions, shared=shared and mask is None), decoder.step, \
        None, None


def entropy_of(logits: torch.Tensor) -> torch.Tensor:
    """Each row's entropy -sum_v p log p of softmax(logits), in float32."""
    log_p = logits.float().log_softmax(dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)


def drop_rows(cache, padding: dict, keep: torch.Tensor) -> None:
    """Keep only the rows `keep` of an eager decode's KV cache, attention mask and positions."""
    for layer in cache.layers:
        layer.batch_select_indices(keep)
    for key in padding:
        padding[key] = padding[key][keep]


def responses_of(tokens: torch.Tensor, eos_id: int) -> tuple[list[torch.Tensor], list[bool]]:
    """Each row's response, up to and including its first EOS, and whether it was cut at the limit."""
    responses, cut = [], []
    for row in tokens:
        eos_at = (row == eos_id).nonzero()
        responses.append(row[:int(eos_at[0]) + 1 if len(eos_at) else len(row)].clone())
        cut.append(len(eos_at) == 0)
    return responses, cut


def left_padded(prompts: list[torch.Tensor], pad_id: int):
    """The prompts as one batch, plus the attention mask and position ids that padding needs. Prompts
    of one length (the rollouts: one prompt repeated) are stacked as they are, with no mask. Otherwise
    each row is left-padded to the longest, its pads masked and its positions counting its real
    tokens only (cumsum of the mask - 1): its numbers are the row's alone up to float rounding."""
    if len({len(p) for p in prompts}) == 1:
        return torch.stack(prompts), None, None
    width = max(len(p) for p in prompts)
    batch = prompts[0].new_full((len(prompts), width), pad_id)
    mask = torch.zeros_like(batch)
    for i, p in enumerate(prompts):
        batch[i, width - len(p):], mask[i, width - len(p):] = p, 1
    return batch, mask, (mask.cumsum(dim=-1) - 1).masked_fill_(mask == 0, 1)


def eager_decoder(model, batch: torch.Tensor, mask, positions, amp, shared: bool = False):
    """Eager decoding with a DynamicCache: the prompt's last logits (prompt_pass), and the step function
    that feeds one token per row (growing the attention mask and moving each row's position by one)."""
    from transformers import DynamicCache
    cache, name = DynamicCache(config=model.config), cache_arg(model)
    padding = {} if mask is None else {"attention_mask": mask, "position_ids": positions}
    with amp:
        logits = prompt_pass(model, batch, cache, name, shared and mask is None, **padding)
    return logits, eager_step(model, cache, padding, amp), cache, padding


def eager_step(model, cache, padding: dict, amp):
    """The step function of an eager decode: one token per row into `cache`, the mask and positions moved on."""
    name = cache_arg(model)

    def step(ids):
        if padding:  # one more real column per row; each row's position moves on by one
            mask = padding["attention_mask"]
            padding["attention_mask"] = torch.cat([mask, mask.new_ones(len(ids), 1)], dim=1)
            padding["position_ids"] = padding["position_ids"][:, -1:] + 1
        with amp:
            return next_token_scores(model, ids, cache, name, **padding)
    return step


def shared_prompt_state(model, prompt_ids: torch.Tensor, amp) -> tuple:
    """One prompt's pass, once: its one-row KV cache and its last position's logits (after_prompt reuses them)."""
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    with amp:
        return cache, next_token_scores(model, prompt_ids[None], cache, cache_arg(model))


def after_prompt(model, prompt_state: tuple, suffixes: list[torch.Tensor], amp) -> tuple:
    """eager_decoder's (logits, step, cache, padding) for rows that each continue one prompt with tokens of their
    own (a tree's nodes): the prompt's cache (shared_prompt_state) repeated to every row, then the rows' tokens fed
    after it, left-padded within their block (the pads masked, the positions counting real tokens only)."""
    cache, last = copy.deepcopy(prompt_state[0]), prompt_state[1]
    cache.batch_repeat_interleave(len(suffixes))
    width, before = max(len(x) for x in suffixes), cache.get_seq_length()
    if width == 0:  # the first level: every row is the prompt
        return last.expand(len(suffixes), -1).contiguous(), eager_step(model, cache, {}, amp), cache, {}
    ids = last.new_zeros((len(suffixes), width), dtype=torch.long)
    mask = ids.new_zeros((len(suffixes), before + width))
    positions = ids.new_ones((len(suffixes), width))
    mask[:, :before] = 1
    for i, x in enumerate(suffixes):
        ids[i, width - len(x):], mask[i, before + width - len(x):] = x, 1
        positions[i, width - len(x):] = torch.arange(before, before + len(x))
    padding = {"attention_mask": mask, "position_ids": positions}
    with amp:
        logits = next_token_scores(model, ids, cache, cache_arg(model), **padding)
    return logits, eager_step(model, cache, padding, amp), cache, padding


def filled_batch(prompts: list[torch.Tensor], rows: int | None, pad_id: int):
    """left_padded(prompts) for the compiled decoder. With `rows` (evaluation): copies of the first
    prompt appended up to that many rows (the graph's one batch; the extra rows are decoded and
    thrown away), and always a mask and position ids, so that every batch takes the same graph."""
    if rows is None:
        return left_padded(prompts, pad_id)
    batch, mask, positions = left_padded(list(prompts) + [prompts[0]] * max(0, rows - len(prompts)), pad_id)
    if mask is None:
        mask = torch.ones_like(batch)
        positions = torch.arange(batch.shape[1], device=batch.device).expand_as(batch).clone()
    return batch, mask, positions


def weight_cast_cache(amp, device_type: str):
    # An outer (disabled) autocast region keeps autocast's weight-cast cache alive across the decode
    # steps: each float32 weight is cast to bf16 once per generation, not once per token (85 -> 25 ms
    # per decode step on the CPU stand-in). The cached casts are the same casts: no number changes.
    return torch.autocast(device_type, enabled=False) if isinstance(amp, torch.autocast) else nullcontext()


def cache_arg(model) -> str:
    """The name of forward's KV-cache argument: transformers 5.24 renamed past_key_values to cache
    (the old name goes away in 5.40); earlier 5.x releases know only past_key_values."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def next_token_scores(model, ids: torch.Tensor, cache, cache_name: str, **kwargs) -> torch.Tensor:
    """The last position's logits of a forward pass that reads and extends the KV cache."""
    return model(ids, **{cache_name: cache}, use_cache=True, logits_to_keep=1, **kwargs).logits[:, -1]


class NonFiniteScores(Exception):
    """The model gave NaN or +inf logits: sampling from them would draw a token outside the vocabulary."""


def compile_decode(cfg: Config, device: torch.device) -> bool:
    """The `compile` setting: auto (on for CUDA, off elsewhere), true or false. Never with fsdp
    sharding: its weights are gathered per generation, which a compiled static graph cannot follow."""
    if RANKS.sharding == "fsdp":
        return False
    return cfg.compile == "true" or (cfg.compile == "auto" and device.type == "cuda")


@dataclass
class Decoders:
    """The compiled decoders of one model, kept from step to step: a StaticDecoder per use (rollouts,
    eval), its cache sized once from the longest prompt of its problems (plan), and why compiling
    failed, if it did (every later generation then decodes eagerly)."""
    lengths: dict = dataclasses.field(default_factory=dict)  # use -> the longest prompt + its max new tokens
    static: dict = dataclasses.field(default_factory=dict)   # use -> (model, bf16 autocast?, StaticDecoder)
    failed: str | None = None
    shared_prompt: bool | None = None  # the rollouts' prompt pass runs once (share_prompt_pass; None: not asked yet)

    def plan(self, use: str, problems: list[dict], max_new_tokens: int) -> None:
        """After check_problems: no later prompt makes the cache grow and recompile the decode step."""
        self.lengths[use] = max((len(p["prompt_ids"]) for p in problems), default=0) + max_new_tokens

    def get(self, model, amp, use: str = "rollouts") -> StaticDecoder:
        bf16 = isinstance(amp, torch.autocast) and amp.fast_dtype == torch.bfloat16
        if use not in self.static or self.static[use][:2] != (model, bf16):  # another model: a new decoder
            self.static[use] = (model, bf16, StaticDecoder(model, amp))
        decoder = self.static[use][2]
        decoder.planned = self.lengths.get(use, 0)
        return decoder


class StaticDecoder:
    """GPU decoding: a StaticCache and the one-token decode step under torch.compile (CUDA graphs on CUDA), built once
    per use and kept across steps; the cache is sized once (Decoders.plan), since a longer prompt would recompile.
    Padded batches (evaluation) carry mask and positions as graph inputs, updated in place. Under bf16 autocast it
    decodes with bf16_linear_copy(model) (one weight cast per step, not per token). Exact in float32 only: in bf16
    the cache keeps bfloat16 values and compiled kernels round differently, a few bf16 ulps (compiled_tolerance)."""

    def __init__(self, model, amp):
        self.bf16 = isinstance(amp, torch.autocast) and amp.fast_dtype == torch.bfloat16
        # the dtype the logits are computed in, which sets the compiled-vs-eager tolerance
        self.low_precision = self.bf16 or next(model.parameters()).dtype == torch.bfloat16
        self.device_type = next(model.parameters()).device.type
        self.model, self.pairs = bf16_linear_copy(model) if self.bf16 else (model, [])
        self.cache, self.cache_len, self.batch_size = None, 0, 0
        self.mask = self.positions = None  # a padded batch's graph inputs
        self.filled = 0  # columns of the cache written so far (a Python int: no sync)
        self.cache_name = cache_arg(self.model)
        self.checked = False  # compared with eager decoding at the first generation (check_compiled_decode)
        self.planned = 0  # the cache length the whole run needs (Decoders.plan)
        mode = "reduce-overhead" if self.device_type == "cuda" else "default"
        self.compiled_step = torch.compile(self._forward, mode=mode, dynamic=False)

    def _amp(self):
        return torch.autocast(self.device_type, dtype=torch.bfloat16) if self.bf16 else nullcontext()

    def _forward(self, ids: torch.Tensor, mask=None, positions=None) -> torch.Tensor:
        padding = {} if mask is None else {"attention_mask": mask, "position_ids": positions}
        with self._amp():
            return next_token_scores(self.model, ids, self.cache, self.cache_name, **padding)

    def prefill(self, batch: torch.Tensor, max_new_tokens: int, mask=None, positions=None,
                shared: bool = False) -> torch.Tensor:
        """Refresh the bf16 twin, run the prompt eagerly (its length varies) into a DynamicCache, copy
        it into the static cache (allocated once, `planned` long). Under autocast Qwen3 gives float32
        keys and bfloat16 values, which StaticCache cannot hold: both are stored in bfloat16."""
        from transformers import DynamicCache, StaticCache
        for master, low in self.pairs:
            low.copy_(master)
        prompt_cache = DynamicCache(config=self.model.config)
        padding = {} if mask is None else {"attention_mask": mask, "position_ids": positions}
        with self._amp():
            logits = prompt_pass(self.model, batch, prompt_cache, self.cache_name, shared, **padding)
        need = max(batch.shape[1] + max_new_tokens, self.planned)
        if self.cache is None or need > self.cache_len or batch.shape[0] != self.batch_size:
            self.cache_len, self.batch_size = -(-need // 256) * 256, batch.shape[0]
            self.cache = StaticCache(config=self.model.config, max_cache_len=self.cache_len)
            self.mask = None
        for src, layer in zip(prompt_cache.layers, self.cache.layers):
            if not layer.is_initialized:
                layer.lazy_initialization(src.keys, src.values)
                if self.bf16:
                    for name in ("keys", "values"):
                        if getattr(layer, name).dtype != torch.bfloat16:
                            setattr(layer, name, torch.zeros_like(getattr(layer, name), dtype=torch.bfloat16))
                            torch._dynamo.mark_static_address(getattr(layer, name))
                    layer.update = stored_as_cache_dtype(layer)
            layer.keys[:, :, :src.keys.shape[2]].copy_(src.keys)
            layer.values[:, :, :src.values.shape[2]].copy_(src.values)
            layer.cumulative_length.fill_(src.keys.shape[2])
        self.filled = batch.shape[1]
        if mask is not None:  # the columns after the prompt are masked until their token is written
            if self.mask is None:
                self.mask = mask.new_zeros(self.batch_size, self.cache_len)
                self.positions = positions.new_zeros(self.batch_size, 1)
            self.mask.zero_()[:, :self.filled].copy_(mask)
            self.positions.copy_(positions[:, -1:])
        return logits

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        if self.device_type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        padding = ()
        if self.mask is not None:  # the new token's column becomes visible; each row moves on by one
            self.mask[:, self.filled] = 1
            self.positions += 1
            padding = (self.mask, self.positions)
        self.filled += 1
        with packed_gqa():
            return self.compiled_step(ids, *padding).clone()  # the graph's output buffer is reused by the next step


def bf16_linear_copy(model) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A twin of `model` for sampling under bf16 autocast: every nn.Linear weight and bias in bfloat16
    (the casts autocast makes at every forward, so the same numbers), everything else shared with the
    float32 master (a tied LM head gets its own copy). Returns (twin, [(master, bf16 copy)])."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    twin = copy.deepcopy(model, memo)
    pairs = []
    for name, module in twin.named_modules():
        if isinstance(module, torch.nn.Linear):
            for attr in ("weight", "bias"):
                master = getattr(model.get_submodule(name), attr)
                if master is not None:
                    low = torch.nn.Parameter(master.detach().to(torch.bfloat16), requires_grad=False)
                    setattr(module, attr, low)
                    pairs.append((master, low))
    return twin, pairs


def stored_as_cache_dtype(layer):
    """The layer's update, casting new keys and values to the cache's dtype first: what Inductor's
    index_copy_ does implicitly, so the step also runs uncompiled (TORCH_COMPILE_DISABLE)."""
    update = layer.update

    def cast_update(key_states, value_states, *args, **kwargs):
        return update(key_states.to(layer.keys.dtype), value_states.to(layer.values.dtype), *args, **kwargs)
    return cast_update


@contextmanager
def packed_gqa():
    """Grouped-query attention of one query token without repeating K and V to every head: under
    torch.compile with a mask transformers' sdpa path copies the whole static cache per layer per
    step (repeat_kv); eager packs the query heads instead. Same sums; the compiled check holds it."""
    from transformers.integrations import sdpa_attention
    if not hasattr(sdpa_attention, "is_torchdynamo_compiling"):  # transformers before the one-query packing (5.17):
        yield  # its sdpa path repeats K and V eagerly too; compiled, it copies the cache (slower, the same sums)
        return
    was = sdpa_attention.is_torchdynamo_compiling
    sdpa_attention.is_torchdynamo_compiling = _traced_as_eager  # one function object: dynamo guards on it
    try:
        yield
    finally:
        sdpa_attention.is_torchdynamo_compiling = was


def _traced_as_eager() -> bool:
    return False


def check_compiled_decode(decoder: StaticDecoder, model, prompts: list[torch.Tensor], max_new_tokens: int, amp,
                          rows: int | None = None) -> None:
    """At the decoder's first generation: compare a few decode steps with eager decoding; beyond the
    tolerance (or NaN) raise, so that compiled_or_eager falls back to eager with the difference on stderr."""
    if decoder.checked:
        return
    worst, scale = compiled_decode_difference(decoder, model, prompts, max_new_tokens, amp, rows)
    tolerance = compiled_tolerance(scale, decoder.low_precision)
    if not worst <= tolerance:  # NaN fails too
        raise RuntimeError(f"its logits differ from eager decoding by {worst:.3g} (tolerance {tolerance:.3g} "
                           f"for logits up to {scale:.3g})")
    decoder.checked = True


def compiled_decode_difference(decoder: StaticDecoder, model, prompts: list[torch.Tensor], max_new_tokens: int,
                               amp, rows: int | None = None, steps: int = 4) -> tuple[float, float]:
    """(max |compiled - eager| over the logits of a prefill and `steps` decode steps, the largest |eager
    logit|): both fed eager's argmax, at the generation's shapes, so the graph checked is the one used."""
    batch, mask, positions = filled_batch(prompts, rows, 0)
    compiled = decoder.prefill(batch, max_new_tokens, mask, positions)
    eager, eager_step, _, _ = eager_decoder(model, batch, mask, positions, amp)
    worst, scale = (compiled.float() - eager.float()).abs().max(), eager.float().abs().max()
    for _ in range(steps):
        ids = eager.argmax(dim=-1, keepdim=True)
        compiled = decoder.step(ids)
        eager = eager_step(ids)
        worst = torch.maximum(worst, (compiled.float() - eager.float()).abs().max())
        scale = torch.maximum(scale, eager.float().abs().max())
    return float(worst), float(scale)


def compiled_tolerance(scale: float, bf16: bool) -> float:
    """How far compiled logits may lie from eager ones, relative to the largest |logit| (`scale`).
    Measured (benchmarks/compiled_vs_eager.py, 8 steps): float32 6e-7, bf16 autocast 1.9e-2, bf16
    weights 7.9e-3. Allowed: float32 1e-5, bf16 1/16 (8 bf16 ulps); a real fault (a step without its
    context, a stale weight copy) moves logits by a sizeable part of their range."""
    return (0.0625 if bf16 else 1e-5) * max(scale, 1.0)


# ----------------------------------------------------------------------------------------------
# The prompt read once in the log-probability pass (prompt_pass: shared)

@dataclass
class SharedPrompt:
    """prompt_pass: shared. The prompt's forward, run once for a group: its keys and values at every layer and the
    logits of its last position (outputs, with their graph), and float32 leaf copies of them (leaves) that each
    response's forward reads, so that each response's backward stops there, adding its share to the leaves'
    gradients. backward() then runs once through the prompt with the sums. The same gradient as the spec's
    forward over prompt + response per response (attention over the same keys; the sums in another order)."""
    outputs: list[torch.Tensor]
    leaves: list[torch.Tensor]

    def token_log_probs(self, model, responses: list[torch.Tensor], amp) -> list[torch.Tensor]:
        """token_log_probs of each response after the shared prompt, in one forward: row i is response_i[:-1],
        padded on the right (every pad after the row's real tokens: causal attention never lets a real position
        see one), after the prompt's keys and values; its first token's log-probability is from the prompt's last
        logits."""
        from transformers import DynamicCache
        *kv, last = self.leaves
        longest = max(len(r) for r in responses)
        rest = None
        if longest > 1:
            cache, dtypes = DynamicCache(config=model.config), [t.dtype for t in self.outputs]
            for k in range(0, len(kv), 2):
                cache.update(*(kv[k + j].to(dtypes[k + j]).expand(len(responses), -1, -1, -1) for j in (0, 1)), k // 2)
            ids = responses[0].new_zeros(len(responses), longest - 1)
            for i, r in enumerate(responses):
                ids[i, :len(r) - 1] = r[:-1]
            with amp:
                rest = model(ids, **{cache_arg(model): cache}, use_cache=True).logits
        return [gathered_log_probs(torch.cat([last.to(self.outputs[-1].dtype)[None], rest[i, :len(r) - 1]])
                                   if len(r) > 1 else last[None], r) for i, r in enumerate(responses)]

    def backward(self) -> None:
        pairs = [(o, leaf.grad.to(o.dtype)) for o, leaf in zip(self.outputs, self.leaves) if leaf.grad is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def shared_prompt(model, prompt_ids: torch.Tensor, amp) -> SharedPrompt:
    """The prompt's forward for prompt_pass: shared (under torch.no_grad, as for the KL's frozen reference, the
    leaves are plain copies). The sampler's prompt pass (shared_prompt_state), here with its graph."""
    cache, last = shared_prompt_state(model, prompt_ids, amp)
    outputs = [t for layer in cache.layers for t in (layer.keys, layer.values)] + [last[0]]
    return SharedPrompt(outputs, [t.detach().float().requires_grad_(torch.is_grad_enabled()) for t in outputs])


# ----------------------------------------------------------------------------------------------
# What a credit method may call (credit.Tools)

def credit_tools(step: int, prompt_ids: torch.Tensor | None, problem: dict, draw: int, t: Trainer,
                 share_prompt: bool = True) -> credit.Tools:
    """What a credit method may call for one group, as plain callables: the run's sampler continuing the group's
    prompt (share_prompt: the prompt's pass once for every call, its keys and values repeated to every row, which
    then reads only its prefix; False: prompt + prefix for every row, the same tokens up to float rounding), the
    rollouts' scoring (the verifier and format_reward's bonus), the step checker in the verifier's worker (a failure
    said once and counted; at the trial call, before step 1, one line), the tokenizer, and this process's share of
    the group."""
    amp, state = autocast(t.device, t.precision), {}

    def continue_prompt(prefixes, room, keys, entropies=None):
        streams = [torch.Generator(device=t.device).manual_seed(stream_seed(t.cfg.seed, *key)) for key in keys]
        with full_weights(t.model), torch.no_grad():
            if share_prompt and "prompt" not in state:
                state["prompt"] = shared_prompt_state(t.model, prompt_ids, amp)
            return sample(t.model, [prompt_ids], room, t.eos_id, amp, t.cfg, streams, (t.cfg.temperature, t.cfg.top_p),
                          prefixes=prefixes, prompt_state=state.get("prompt"), entropies=entropies)[0]

    def score(texts, ended):
        return [s.reward + format_bonus(s.status, not e, t.cfg.format_reward) for s, e in zip(
            score_rollouts(t.scorer, texts, problem["answer"], **user_reward(t.cfg, problem)), ended)]

    def check_lines(lines, rollout):
        check_stop(local=True)  # between two calls, as the rewards' scoring
        verdicts, status = t.scorer.check_steps(lines, problem.get("record") or {}, problem["problem"])
        if verdicts is None:
            why = ("did not return within verifier_timeout" if status == "timeout" else "failed")
            if rollout is None:  # the trial call
                raise UserError(step_checker_unusable(t.cfg, (f"{why} {t.cfg.verifier_timeout:g} s" if status ==
                                                              "timeout" else f"failed: {t.scorer.last_error}")
                                                      + f" (a trial call on dataset record {problem['index']})"))
            warn_once(t, "step checker failed", f"warning: step {step}: step_checker {t.cfg.step_checker} {why} on "
                      f"rollout {rollout}: {t.scorer.last_error} (its lines count as unknown; said once a run, each "
                      "failure is counted: metrics.jsonl's step_checker_failures)")
        return verdicts

    return credit.Tools(pieces=lambda ids: [t.tokenizer.decode([i]) for i in ids],
                        text=lambda ids: t.tokenizer.decode(ids, skip_special_tokens=True), eos_id=t.eos_id,
                        rows=rank_share(t.cfg.group_size), share=gather_objects, continue_prompt=continue_prompt,
                        score=score, check_lines=check_lines,
                        warn=lambda kind, message: message and warn_once(t, kind, f"warning: step {step}: {message}"))


# ----------------------------------------------------------------------------------------------
# The rewards' checks and the reward function

def check_rewards(step: int, values: list[float], rewards: torch.Tensor, scored: list[Score], t: Trainer) -> None:
    """What a reward_function can get wrong, caught at the step it happens (every rank holds the same group):
    a failure is said once a run with its reason (each is counted: verifier_crashes, verifier_timeouts); a group
    whose every call failed stops the run (bad_records: stop) or trains on its zeros (skip); a reward that the
    group's float32 figures cannot hold (the sample std squares the rewards' spread) stops it."""
    cfg = t.cfg
    failed = [(i, s.error or s.status) for i, s in enumerate(scored) if s.status in FAILED]
    if failed and cfg.reward_function:
        fn = f"reward_function {cfg.reward_function}"
        warn_once(t, "reward failed", f"warning: step {step}: {fn} failed on rollout {failed[0][0]}: {failed[0][1]} "
                  f"(scored 0; said once a run, each failure is counted: metrics.jsonl's verifier_crashes and "
                  f"verifier_timeouts, the summary's verifier overruns, rollouts.jsonl's error)")
        if len(failed) == len(scored):
            if cfg.bad_records == "stop":
                raise StopRun(f"step {step}: {fn} failed on all {len(scored)} rollouts (the first: {failed[0][1]}); "
                              "fix it, or set bad_records: skip to train on with their rewards 0", code=2)
            progress(f"warning: step {step}: {fn} failed on all {len(scored)} rollouts (bad_records: skip): "
                     "their rewards are 0")
    if not (torch.isfinite(rewards).all() and torch.isfinite(rewards.mean()) and torch.isfinite(rewards.std())):
        i = max(range(len(values)), key=lambda k: abs(values[k]))
        source = (f"reward_function {cfg.reward_function} with reward_weights '{cfg.reward_weights}'"
                  if cfg.reward_weights else f"reward_function {cfg.reward_function}")
        raise StopRun(f"step {step}: rollout {i}'s reward {values[i]:g} ({source}) is too large for the group's "
                      f"float32 mean and sample std (float32 holds up to 3.4e38, and the std squares the rewards' "
                      f"spread); scale the rewards down", code=2)


def reward_file(cfg: Config) -> tuple[str, str] | None:
    """reward_function's (absolute path, function name) for the verifier's worker, which loads it; None without one."""
    return user_function(cfg.reward_function) if cfg.reward_function else None


def user_function(setting: str) -> tuple[str, str] | str:
    """A setting that names a function of one's own, path/to/file.py:name, as (absolute path from the current folder,
    name): the worker loads that file whatever its folder, and a resumed run that names the same file by another
    path (./ck.py, /abs/ck.py) names the same function. A built-in's name (step_checker arithmetic) as it is."""
    path, sep, name = setting.rpartition(":")
    return (str(Path(path).expanduser().resolve()), name) if sep else setting


@contextmanager
def open_scorer(cfg: Config, step_checker=None):
    """The run's TimedVerifier, its worker started (with a reward_function, or a step checker of one's own
    (credit=steps), its file imported there, within verifier_timeout: an import that raises, hangs or exits is one
    line)."""
    scorer = verifier.TimedVerifier(timeout_s=cfg.verifier_timeout, reward_function=reward_file(cfg),
                                    step_checker=step_checker)
    try:
        scorer.__enter__()
    except verifier.RewardFunctionError as e:  # which file: the worker says (None: an import that hung)
        checker = e.which == "step_checker" or e.which is None and not cfg.reward_function
        raise SharedError((step_checker_unusable if checker else reward_function_unusable)(
            cfg, f"failed: {e} (importing it)"))
    try:
        yield scorer
    finally:
        scorer.__exit__(None, None, None)


def try_reward_function(scorer: verifier.TimedVerifier, problem: dict, cfg: Config) -> None:
    """A trial call of reward_function on the first record (a response that boxes its answer), before step 1:
    an exception, hang or non-number result is one line, not 50 zero rewards (a missing function, a wrong
    signature, a file that cannot be imported: open_scorer)."""
    if not cfg.reward_function:
        return
    result = scorer.score(f"\\boxed{{{problem['answer']}}}", problem["answer"], problem["record"])
    if result[2] in FAILED:
        why = (f"did not return within verifier_timeout {cfg.verifier_timeout:g} s" if result[2] == "timeout"
               else f"failed: {scorer.last_error}")
        raise UserError(reward_function_unusable(cfg, f"{why} (a trial call on dataset record {problem['index']})"))


def step_checker_unusable(cfg: Config, why: str) -> str:
    return (f"step_checker {cfg.step_checker} {why}; fix it: it is called as name(lines: list[str], record: dict) "
            "and returns a list with a verdict per line (True, False or None)")


def reward_function_unusable(cfg: Config, why: str) -> str:
    return (f"reward_function {cfg.reward_function} {why}; fix it: it is called as name(response: str, answer: str, "
            "record: dict) and returns a number")


# ----------------------------------------------------------------------------------------------
# The optimizer step's update norm, undo and copies

@dataclass
class StepCopies:
    """What optimizer_step keeps from step to step: a float32 copy of the weights before each step (update_norm_buffers;
    the update norm is measured against it and a non-finite step undone from it), the copies of AdamW's state a
    step that could overflow takes first (snapshot_optimizer_state), and an upper bound on the largest |weight|
    (None: to be measured), which decides whether a step could overflow."""
    before: list[torch.Tensor]
    state: dict = dataclasses.field(default_factory=dict)
    largest: float | None = None


OVERFLOW_MARGIN = 1e37  # float32 holds up to 3.4e38: a bound below this is finite with room for the bound's rounding


def step_could_overflow(optimizer, copies: StepCopies, weights: list[torch.Tensor]) -> bool:
    """Whether AdamW's next step could leave a weight non-finite; where it cannot, no state copy and no finiteness
    check are needed (the same step, the same numbers, two passes over the model fewer). AdamW's step is
      w' = w (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps),     m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t)
    and for any finite gradients (the step is taken only with a finite gradient norm) Cauchy-Schwarz bounds the
    ratio: m_t = (1 - b1) sum_k b1^(t-k) g_k and v_t = (1 - b2) sum_k b2^(t-k) g_k^2 give
      |m_hat| / sqrt(v_hat) <= (1 - b1) / (1 - b1^t) sqrt((1 - b2^t) / (1 - b2)) sqrt(sum_{j<t} (b1^2 / b2)^j)
    (1 at t = 1; at most 7.3 for PyTorch's betas 0.9, 0.999), so |w'| <= largest |1 - lr wd| + lr bound. A bound
    under OVERFLOW_MARGIN (with 0.1 % more for rounding) cannot overflow, and becomes the next step's `largest`;
    otherwise the step is taken with the state copied and the weights checked (and `largest` measured). Another
    optimizer than AdamW, several parameter groups or betas without the bound (b1^2 >= b2): always checked."""
    group = optimizer.param_groups[0]
    if (type(optimizer) is not torch.optim.AdamW or len(optimizer.param_groups) > 1 or group["amsgrad"]
            or group["maximize"]):
        return True
    (b1, b2), lr, wd = group["betas"], float(group["lr"]), float(group["weight_decay"])
    if not b1 * b1 < b2:
        return True
    if copies.largest is None:
        finite, copies.largest = weights_range(weights)
        if not finite:
            return True
    t = 1 + max((int(s["step"]) for s in optimizer.state.values()), default=0)
    r = b1 * b1 / b2
    ratio = (1 - b1) / (1 - b1 ** t) * math.sqrt((1 - b2 ** t) / (1 - b2) * (1 - r ** t) / (1 - r))
    after = copies.largest * abs(1 - lr * wd) + lr * ratio * 1.001
    if not after < OVERFLOW_MARGIN:  # NaN too
        return True
    copies.largest = after
    return False


def weights_range(weights: list[torch.Tensor]) -> tuple[bool, float]:
    """Whether every weight is finite, and the largest |weight|, over every rank (fsdp: each holds a shard): each
    tensor's min and max (a NaN turns both NaN; no overflow, no copy of a weight)."""
    ends = torch.stack([torch.stack(torch.aminmax(w)).float() for w in weights if w.numel()])
    largest = max_over_ranks(float(ends.abs().max()) if bool(ends.isfinite().all()) else math.inf)
    return math.isfinite(largest), largest


def update_norm(before: list[torch.Tensor], weights: list[torch.Tensor]) -> float:
    """The norm of weights - before: float32 differences (into `before`, in place: no second copy of the weights,
    and the next step copies the weights again), per-tensor norms in float64 combined in float64."""
    if before[0].device != weights[0].device:
        return update_norm_across_devices(before, weights)
    torch._foreach_sub_(before, weights)  # before - after, in place: exact for small updates
    return _combined_norm(torch._foreach_norm(before, 2, dtype=torch.float64))


def update_norm_across_devices(before: list[torch.Tensor], weights: list[torch.Tensor]) -> float:
    """update_norm for host buffers of CUDA weights, one tensor at a time: bit for bit the in-place path's norms."""
    return _combined_norm([torch._foreach_norm([w.float() - b.to(w.device, non_blocking=True)], 2,
                                               dtype=torch.float64)[0] for w, b in zip(weights, before)])


def _combined_norm(norms: list[torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.stack(norms).double()))


def snapshot_optimizer_state(optimizer, buffers: dict, device=None) -> dict:
    """The optimizer's per-parameter state as it is now: tensors copied into `buffers` on `device`
    (default: the host, pinned for CUDA tensors), allocated once and reused; the rest by value."""
    device = torch.device("cpu") if device is None else torch.device(device)
    saved = {}
    for p, state in optimizer.state.items():
        saved[p] = {}
        for key, value in state.items():
            if torch.is_tensor(value):
                value = local(value)
                buf = buffers.get((id(p), key))
                if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
                    pin = value.is_cuda and device.type == "cpu"
                    buf = buffers[(id(p), key)] = torch.empty(value.shape, dtype=value.dtype, device=device,
                                                              pin_memory=pin)
                buf.copy_(value, non_blocking=True)
                value = buf
            saved[p][key] = value
    return saved


def restore_optimizer_state(optimizer, saved: dict) -> None:
    for p in list(optimizer.state):
        if p not in saved:  # the state was created by the step being undone (the run's first)
            del optimizer.state[p]
            continue
        for key, value in saved[p].items():
            if torch.is_tensor(value):
                local(optimizer.state[p][key]).copy_(value)
            else:
                optimizer.state[p][key] = value


UNDO_RESERVE = 16 << 30  # bytes of GPU memory left for generation, evaluation and the backward pass


def optimizer_buffer_bytes(params) -> int:
    """What optimizer_step keeps to undo a step: a float32 copy of the weights and a copy of
    AdamW's two moments, in the weights' dtype (12 bytes per parameter in float32)."""
    return sum(local(p).numel() * (4 + 2 * p.element_size()) for p in params)


def optimizer_buffer_device(device: torch.device, need: int, free: int) -> torch.device:
    """On the GPU when its free memory holds them twice over (with the gradients and moments the first
    step allocates) plus UNDO_RESERVE, else in pinned host memory (PCIe twice a step); same numbers."""
    return device if device.type == "cuda" and free >= 2 * need + UNDO_RESERVE else torch.device("cpu")


def update_norm_buffers(params, device: torch.device) -> list[torch.Tensor]:
    """float32 buffers for the weights before each step, allocated once where optimizer_buffer_device
    puts them (pinned on the host, for asynchronous copies); the AdamW state's copies follow them."""
    where = torch.device("cpu")
    if device.type == "cuda":
        need, free = optimizer_buffer_bytes(params), available_memory(device)
        where = optimizer_buffer_device(device, need, free)
        place = f"on {where}" if where.type == "cuda" else "in pinned host memory (copied across PCIe every step)"
        progress(f"optimizer step: the copies that undo a non-finite step ({need / 1e9:.1f} GB) are kept {place}; "
                 f"{free / 1e9:.1f} GB free on {device}")
    on_host = where.type == "cpu"  # else beside each weight (empty_like keeps its device)
    buffers = [torch.empty_like(local(p), dtype=torch.float32, device="cpu" if on_host else None) for p in params]
    return [b.pin_memory() for b in buffers] if device.type == "cuda" and on_host else buffers


# ----------------------------------------------------------------------------------------------
# The step's record
# (its metrics, rollouts and tokens, and the clock of its phases)

@dataclass
class StepRecord:
    """What a step leaves for log_step: its metrics (a table row, metrics.jsonl), its rollouts
    (rollouts.jsonl) and, with token_report, each response's tokens before and after (tokens.jsonl)."""
    metrics: dict
    rollouts: list[dict]
    tokens: list[dict] = dataclasses.field(default_factory=list)


def step_report(step: int, slots: list[Slot], t: Trainer, epochs: list[dict], clock) -> StepRecord:
    """The step's record. The metrics' loss and norms are the first epoch's (the spec's step); with ppo_epochs > 1
    every epoch's are under "epochs"; with P problems each group's figures under "groups". Each slot's groups set
    aside (zero_variance=resample) come before it in the rollouts; the credit method's own figures are its."""
    cfg = t.cfg
    first, figures = epochs[0], step_figures(cfg, [s.group for s in slots])
    set_aside = [x for s in slots for x in s.set_aside]
    metrics = {"step": step, "problem_index": slots[0].problem["index"], **{k: figures[k] for k in TABLE_FIGURES},
               "policy_loss": first["policy_loss"], "grad_norm": first["grad_norm"],
               "update_norm": first["update_norm"], "skipped": any(e["update_norm"] is None for e in epochs),
               "seconds": clock.total(), **{k: v for k, v in figures.items() if k not in TABLE_FIGURES}}
    metrics.update({k: first[k] for k in ("kl", "clipped_fraction", "learning_rate") if k in first})
    if cfg.problems_per_step > 1:
        metrics["problems"] = [s.problem["index"] for s in slots]
        metrics["groups"] = [dict(problem_index=s.problem["index"], **group_figures(cfg, s.group)) for s in slots]
    if cfg.ppo_epochs > 1:
        metrics["epochs"] = epochs
    if cfg.zero_variance == "resample" or cfg.problems_per_step > 1:
        metrics["problems_drawn"] = len(set_aside) + len(slots)
    if cfg.zero_variance == "resample":
        metrics["set_aside"] = [dict(problem_index=x.problem["index"], **group_figures(cfg, x.group))
                                for x in set_aside]
    metrics.update(t.credit_method.figures([s.credit for s in slots], [x.credit for x in set_aside]))
    metrics["timings"] = clock.timings
    rollouts, tokens = [], []
    for s in slots:
        rollouts += [r for x in s.set_aside for r in slot_rollouts(step, x, cfg)]
        mine = slot_rollouts(step, s, cfg)
        rollouts += mine
        tokens += [dict(step=step, problem_index=s.problem["index"], rollout=r["rollout"], reward=r["reward"],
                        advantage=r["advantage"], **c, **({} if s.credit is None else
                                                          {"token_advantages": s.credit.token_advantages[r["rollout"]]}),
                        **({"entropy_mask": r["entropy_mask"]} if "entropy_mask" in r else {}))
                   for r, c in zip(mine, s.changes or [])]
    return StepRecord(metrics, rollouts, tokens)


def slot_rollouts(step: int, s: Slot, cfg: Config) -> list[dict]:
    """The group's rollouts.jsonl lines, with credit its segments, values and token advantages; a group set aside
    (zero_variance=resample: it had no pass) is marked and has no sequence log-probabilities."""
    aside = s.first is None
    mine = group_rollouts(step, s.problem, cfg, s.group, s.advantages,
                          [None] * cfg.group_size if aside else s.first.seq_log_probs, set_aside=aside)
    for i, r in enumerate(mine if s.credit is not None else []):
        r.update(s.credit.rollout_fields(i))
    return mine


TABLE_FIGURES = ("group_size", "correct", "reward_mean", "reward_std", "response_tokens")  # before the loss


def group_figures(cfg, group: Group) -> dict:
    statuses = [s.status for s in group.scored]
    # correct: the verifier's verdicts (not the reward: format_reward, reward_function, reward_weights change that);
    # reward_std of a zero-variance group (8 x 0.1) is 0
    return dict(group_size=cfg.group_size, correct=statuses.count("correct"),
                reward_mean=float(group.rewards.mean()),
                reward_std=0.0 if group.zero_variance else float(group.rewards.std(unbiased=True)),
                response_tokens=sum(group.tokens), cut_at_limit=sum(group.cut), no_answer=statuses.count("no_answer"),
                verifier_timeouts=statuses.count("timeout"), verifier_crashes=statuses.count("crash"))


def step_figures(cfg: Config, groups: list[Group]) -> dict:
    """group_figures of the step: its one group's (the spec), or with P groups their counts summed, the mean
    reward over all their rollouts and the mean of their sample stds (0 only when every group has zero variance)."""
    each = [group_figures(cfg, g) for g in groups]
    if len(each) == 1:
        return each[0]
    return {k: sum(f[k] for f in each) for k in each[0]} | dict(
        group_size=cfg.group_size, reward_mean=float(torch.cat([g.rewards for g in groups]).mean()),
        reward_std=sum(f["reward_std"] for f in each) / len(each))


def group_rollouts(step, problem, cfg, group: Group, advantages, seq_log_probs, set_aside: bool = False) -> list[dict]:
    # reward: the verifier's, plus format_reward's bonus when that is on
    # reference: where answer_format read it out of a longer text (a worked solution), what it read
    return [dict(step=step, problem_index=problem["index"], rollout=i, response=group.texts[i],
                 answer=group.scored[i].answer, status=group.scored[i].status, reward=float(group.rewards[i]),
                 advantage=float(advantages[i]), tokens=group.tokens[i], cut_at_limit=group.cut[i],
                 sequence_log_prob=seq_log_probs[i], **({"set_aside": True} if set_aside else {}),
                 **({"reference": problem["answer"]} if problem.get("extracted") else {}),
                 **({"error": group.scored[i].error} if group.scored[i].error else {}))
            for i in range(cfg.group_size)]


class Stopwatch:
    """A step's phase timings. On CUDA each lap waits for the GPU, so a phase is charged its own kernels."""

    def __init__(self, device: torch.device):
        self.device, self.timings = device, {}
        self.start = self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        # a phase met again (a resampled group, another epoch) adds up
        self.timings[phase], self.last = self.timings.get(phase, 0.0) + (now - self.last), now

    def total(self) -> float:
        self.timings["step"] = self.last - self.start
        return self.timings["step"]



# ----------------------------------------------------------------------------------------------
# Logging and trackers

def token_changes(slot: Slot, epochs: list[dict], t: Trainer) -> list | None:
    """token_report, for a group with reward variance whose step's update was taken: every response token's
    log-probability before the step (the first pass's) and after it (one more forward per response),
    the whole group's (gathered; rank 0 writes them to tokens.jsonl)."""
    if not t.cfg.token_report or slot.silent or epochs[-1]["update_norm"] is None:
        return None
    amp = autocast(t.device, t.precision)
    with torch.no_grad():
        after = [token_log_probs(t.model, slot.prompt_ids, r, amp) for r in slot.responses]
    mine = [(r.tolist(), b.tolist(), a.tolist()) for r, b, a in zip(slot.responses, slot.first.token_log_probs, after)]
    group = [x for share in gather_objects(mine) for x in share]
    return [{"token_ids": ids, "tokens": [t.tokenizer.decode([i]) for i in ids], "before": b, "after": a}
            for ids, b, a in group]


def log_step(record: StepRecord, t: Trainer, s: RunState) -> None:
    """The step's row on stdout and its lines in metrics.jsonl, rollouts.jsonl (and tokens.jsonl). After
    max_bad_steps non-finite steps in a row (each one undone) the run stops."""
    metrics = record.metrics
    append_jsonl(s.out / "metrics.jsonl", [metrics])
    if record.tokens:
        append_jsonl(s.out / "tokens.jsonl", record.tokens)
    append_jsonl(s.out / "rollouts.jsonl", record.rollouts)
    s.history.append(metrics)
    say(format_row(metrics, s.extras, t.cfg.group_size * t.cfg.problems_per_step))
    bar_advanced(s.watch.bar, 1, correct=f"{metrics['correct']}/{rollouts_of(metrics)}")
    send_to_trackers(s.watch, step_scalars(metrics, s.history), metrics["step"], record.rollouts)
    bad = next((k for k, m in enumerate(reversed(s.history)) if not m["skipped"]), len(s.history))  # in a row
    if bad >= t.cfg.max_bad_steps:
        raise StopRun(f"{bad} steps in a row had a non-finite loss, gradient norm or update (the last at step "
                      f"{metrics['step']}); lower learning_rate or check the data and the model")


# Column name, cell width, format. The first seven are the spec's table, character for character.
COLUMNS = [("step", 6), ("correct/{G}", 11), ("reward mean", 13), ("sample std", 12),
           ("response tokens", 17), ("policy loss", 13), ("grad norm", 11), ("update norm", 13),
           ("seconds", 0)]


class Column(NamedTuple):
    """A column shown only when its variant is on, before the seconds (the spec's table stays as it is): its name,
    its width and its cell in a row, from the step's record m, the row's epoch e and the epoch's index k."""
    name: str
    width: int
    cell: object  # (m, e, k) -> str


def table_extras(cfg: Config, method: credit.Sequence | None = None) -> list[Column]:
    """The extra columns of a run, decided once from its settings (run passes them to every row): the epoch and the
    clipped fraction with ppo_epochs > 1, the KL with kl_coef, the credit method's own (the tokens generated for
    the step with monte_carlo or tree, the lines the step checker found right, wrong and unknown with steps: on the
    first epoch's row), the problems the step took with problems_per_step > 1 (then correct/{P x G} counts the
    step's rollouts). None for the spec's run."""
    method = method or credit.method(cfg)
    first = [Column(name, width, lambda m, e, k, j=j: method.cells(m)[j] if k == 0 else "")
             for j, (name, width) in enumerate(method.columns)]
    return ([Column("epoch", 7, lambda m, e, k: str(e["epoch"])),
             Column("clipped", 9, lambda m, e, k: f"{e['clipped_fraction']:.3f}")] if cfg.ppo_epochs > 1 else []) + (
        [Column("kl", 11, lambda m, e, k: f"{e['kl']:.3e}")] if cfg.kl_coef else []) + first + (
        [Column("problems", 10, lambda m, e, k: ",".join(map(str, m["problems"])) if k == 0 else "")]
        if cfg.problems_per_step > 1 else [])


def table_columns(extras=()) -> list[tuple[str, int]]:
    return COLUMNS[:-1] + [(c.name, c.width) for c in extras] + COLUMNS[-1:]


def _row(cells: list[str], columns=COLUMNS) -> str:
    out = ""
    for cell, (_, width) in zip(cells, columns):
        out += cell.ljust(width) if len(cell) < width else cell + "  "
    return out.rstrip()


def format_header(group_size: int, extras=()) -> str:
    return _row([name.replace("{G}", str(group_size)) for name, _ in table_columns(extras)], table_columns(extras))


def _fixed(x: float, digits: int) -> str:
    s = f"{x:.{digits}f}"
    return s[1:] if s.startswith("-") and float(s) == 0 else s  # never print -0.000000


def format_row(m: dict, extras=(), header_rollouts: int = 0) -> str:
    """The step's row with the run's extra columns (table_extras); with ppo_epochs > 1 one row per epoch (its loss,
    norms, clipped fraction and KL), with zero_variance=resample a marked row for each group set aside before it.
    header_rollouts: the header's correct/N; a step of fewer rollouts (problems_per_step's last step, which takes
    the problems left) says its own count, correct/n."""
    columns = table_columns(extras)
    n = rollouts_of(m) if header_rollouts else 0
    correct = f"{m['correct']}/{n}" if n != header_rollouts else str(m["correct"])
    group = [correct, _fixed(m["reward_mean"], 3), _fixed(m["reward_std"], 6), f"{m['response_tokens']:>4d}"]
    lines = [_row([str(m["step"]), str(g["correct"]), _fixed(g["reward_mean"], 3), _fixed(g["reward_std"], 6),
                   f"{g['response_tokens']:>4d}", f"set aside (problem {g['problem_index']})"], columns)
             for g in m.get("set_aside", [])]
    for k, e in enumerate(m.get("epochs", [m])):
        cells = [str(m["step"]), *(group if k == 0 else [""] * 4), _fixed(float(e["policy_loss"]), 6),
                 _fixed(float(e["grad_norm"]), 3), "skipped" if e["update_norm"] is None else f"{e['update_norm']:.3e}"]
        cells += [c.cell(m, e, k) for c in extras]
        lines.append(_row(cells + [f"{m['seconds']:.1f}" if k == 0 else ""], columns))
    return "\n".join(lines)


def format_summary(metrics: list[dict], total_seconds: float, first_step: int = 1) -> str:
    """The end of the table. total_seconds: this process's time from first_step (1 unless resumed) to its
    last, evaluations and checkpoints included; the steps' own seconds count those before a resume too."""
    n_rollouts = sum(rollouts_of(m) for m in metrics)
    n_correct = sum(m["correct"] for m in metrics)
    flat, groups = sum(flat_groups(m) for m in metrics), sum(len(step_groups(m)) for m in metrics)
    grad_steps = [m["step"] for m in metrics if not m["skipped"] and m["grad_norm"] > 0]
    moved = [m["step"] for m in metrics if not m["skipped"] and m["update_norm"] > 0]
    skipped = [m["step"] for m in metrics if m["skipped"]]
    # the tokens sampled, over the seconds of sampling them: with credit (generated_tokens) the tree's branches (not
    # its leaves' shared prefixes again) and monte_carlo's continuations too, sampled in the credit phase
    gen_tokens = sum(m.get("generated_tokens", m["response_tokens"] + sum(g["response_tokens"]
                                                                          for g in m.get("set_aside", [])))
                     for m in metrics)
    gen_seconds = sum(m["timings"]["generation"] + m["timings"].get("credit", 0.0) * ("generated_tokens" in m)
                      for m in metrics)
    timeouts = sum(m["verifier_timeouts"] + m["verifier_crashes"] for m in metrics)
    checks = [m["step_checker_failures"] for m in metrics if "step_checker_failures" in m]  # credit=steps

    def listed(steps):
        return ": " + ", ".join(map(str, steps)) if 0 < len(steps) <= 20 else ""

    drawn = [m["problems_drawn"] for m in metrics if "problems_drawn" in m]
    lines = [
        "", f"correct rollouts        {n_correct}/{n_rollouts} (mean reward "
            f"{n_correct / n_rollouts if n_rollouts else 0.0:.4f})",
        f"zero-variance groups    {flat}/{groups}",
        f"non-zero gradient       {len(grad_steps)} steps{listed(grad_steps)}",
        f"weights changed         {len(moved)} steps{listed(moved)}",
        f"skipped (non-finite)    {len(skipped)} steps{listed(skipped)}",
        f"verifier overruns       {timeouts} rollouts scored 0 after a timeout or a crash" + (
            f"; {sum(checks)} step checks failed the same way (their lines unknown)" if checks else ""),
        f"total time              {total_time(metrics, total_seconds, first_step)}; generation {gen_tokens} tokens "
        f"at {gen_tokens / gen_seconds if gen_seconds else 0.0:.1f} tokens/s",
    ]
    if drawn:  # zero_variance=resample or problems_per_step
        lines.insert(3, f"problems drawn          {sum(drawn)} for {len(metrics)} optimizer steps; "
                        f"{sum(drawn) - groups} zero-variance groups set aside")
    return "\n".join(lines)


def step_groups(m: dict) -> list[dict]:
    """The figures of each group a step trained on: its record's own (with P problems, those under "groups")."""
    return m.get("groups", [m])


def rollouts_of(m: dict) -> int:
    """The rollouts a step trained on: its group's (with P problems, its groups')."""
    return m["group_size"] * len(step_groups(m))


def flat_groups(m: dict) -> int:
    """The step's zero-variance groups: 0 or 1 (with P problems, up to P)."""
    return sum(g["reward_std"] == 0 for g in step_groups(m))


def total_time(metrics: list[dict], total_seconds: float, first_step: int) -> str:
    steps = sum(m["seconds"] for m in metrics)
    if first_step <= 1:
        return f"{steps:.1f} s in the {len(metrics)} steps, {total_seconds:.1f} s with evaluation and checkpoints"
    before = sum(m["seconds"] for m in metrics if m["step"] < first_step)
    here = f"steps {first_step}-{metrics[-1]['step']}" if metrics[-1]["step"] >= first_step else "no step left"
    return (f"{steps:.1f} s in the {len(metrics)} steps ({before:.1f} s of them before the resume); this process "
            f"{total_seconds:.1f} s for {here} with evaluation and checkpoints")


def warn_once(t: Trainer, kind: str, msg: str) -> None:
    """A warning of this kind said once a run (at its first occurrence), not at every step it holds for."""
    if kind not in t.warned:
        t.warned.add(kind)
        progress(msg)


def progress(msg: str) -> None:
    # stderr, so that stdout holds only the table and the summary; rank 0's alone. tqdm.write keeps a
    # bar drawn on a terminal below the line.
    if process_rank() == 0:
        tqdm.write(msg, file=sys.stderr)
        sys.stderr.flush()


def say(text: str) -> None:
    """A table line on stdout (rank 0 alone prints in a multi-process run)."""
    if process_rank() == 0:
        print(text, flush=True)


class _Unseen(io.TextIOBase):
    """Where a bar draws itself when stderr is not a terminal: nowhere (its line goes out through progress)."""

    def write(self, text: str) -> int:
        return len(text)


class _Plain(io.TextIOBase):
    """stderr without terminal colour codes, for a library that prints them onto a log file or a pipe."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(re.sub(r"\x1b\[[0-9;]*m", "", text))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def plain_stderr():
    return sys.stderr if sys.stderr.isatty() else _Plain(sys.stderr)


def progress_bar(desc: str, total: int, done: int, unit: str) -> tqdm:
    """A tqdm bar on stderr with rate and ETA (rank 0's; elsewhere a disabled one): redrawn in place on
    a terminal; on a log file or a pipe it draws nowhere and bar_advanced prints its line, one per update."""
    screen = sys.stderr.isatty()
    return tqdm(total=total, initial=done, desc=desc, unit=unit, file=sys.stderr if screen else _Unseen(),
                dynamic_ncols=screen, disable=process_rank() != 0)


def bar_advanced(bar: tqdm, n: int, **postfix) -> None:
    """Move the bar n on (and set its postfix); off a terminal, print its line."""
    if bar.disable:
        return
    if postfix:
        bar.set_postfix(postfix, refresh=False)
    bar.update(n)
    if not sys.stderr.isatty():  # progress_bar drew it nowhere
        progress(str(bar))


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # "nan", "inf": strict JSON has no NaN
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    return x


def append_jsonl(path: Path, records: list[dict]) -> None:
    if process_rank() != 0:  # rank 0 writes the logs
        return
    with path.open("a") as f:
        for r in records:
            f.write(json.dumps(_json_safe(r)) + "\n")


def read_jsonl(path: Path, keys: tuple[str, ...] = ()) -> list[dict]:
    """The records of one of a run's own JSON Lines files ([] when there is none), each an object with
    `keys`. A last line cut short (no newline: a crash mid-write) is left out with a note, as resume
    leaves it out; any other damage is one error naming the file and the line."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    body, tail = (raw, b"") if raw.endswith(b"\n") else (raw[:raw.rfind(b"\n") + 1], raw[raw.rfind(b"\n") + 1:])
    records = [parse_json_line(path, number, line, keys)
               for number, line in enumerate(body.split(b"\n")[:-1], 1) if line.strip()]
    if tail.strip():
        number = body.count(b"\n") + 1
        try:
            records.append(parse_json_line(path, number, tail, keys))
        except UserError:
            progress(f"{path}: its last line ({number}) was cut short by an interrupted write; left out")
    return records


def parse_json_line(path: Path, number: int, line: bytes, keys: tuple[str, ...]) -> dict:
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"{path} line {number} is not UTF-8 text (byte {line[e.start]:#04x}): the file is damaged; "
                        f"{JSONL_FIX}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path} line {number} is not a JSON record ({e.msg}, column {e.colno}): the file is "
                        f"damaged; {JSONL_FIX}") from None
    missing = [k for k in keys if k not in record] if isinstance(record, dict) else ["an object"]
    if missing:
        raise UserError(f"{path} line {number} is not a record rlvr writes (it lacks {missing[0]}); {JSONL_FIX}")
    return record


JSONL_FIX = "restore it from the newest checkpoint (checkpoints/step-*/ keep a copy of the logs) or delete that line"


# Watching a run: the step bar, the trackers of report_to (each imported only when named), run.png.
TRACKERS = ("tensorboard", "wandb", "trackio")  # report_to's names; each one's pip package has its name


def trackers_named(cfg: Config) -> list[str]:
    return [] if cfg.report_to == "none" else [name.strip() for name in cfg.report_to.split(",")]


def check_trackers(cfg: Config) -> None:
    """A tracker named in report_to must be installed, and wandb must have a way to send the run: said
    before the model loads and before output_dir is touched (wandb.init would stop after the table began)."""
    for name in trackers_named(cfg):
        if importlib.util.find_spec(name) is None:
            raise UserError(f"report_to names {name}, which is not installed here; pip install {name} "
                            "(or drop it from report_to)")
    if "wandb" in trackers_named(cfg) and not wandb_can_log():
        raise UserError("report_to names wandb, but wandb has no API key here (no WANDB_API_KEY, no `wandb login`); "
                        "run `wandb login`, or set WANDB_MODE=offline to keep the run's wandb files under output_dir "
                        "(wandb sync uploads them later)")


def wandb_can_log() -> bool:
    """Whether wandb.init can start a run here without asking for a key: offline or disabled, or an API key
    in the environment, a settings file or .netrc (wandb's own search, without a prompt or the network)."""
    if os.environ.get("WANDB_MODE", "").strip().lower() in ("offline", "dryrun", "disabled"):
        return True
    import wandb
    try:
        with redirect_stderr(io.StringIO()):  # "Loaded credentials ...": not the run's business
            return bool(wandb.login(verify=False, prompt=False))
    except TypeError:  # a wandb before login(prompt=...): its own init says what is missing
        return True
    except Exception as e:  # a key in the wrong form (wandb.errors.AuthenticationError)
        raise UserError(f"report_to names wandb, but its credentials cannot be used ({str(e).splitlines()[0]}); "
                        "run `wandb login` again, or set WANDB_MODE=offline") from None


@dataclass
class Watch:
    """What watches the run besides stdout and the logs (rank 0's): the bar over the steps and the open trackers."""
    bar: tqdm
    tensorboard: object = None  # torch.utils.tensorboard.SummaryWriter
    wandb: object = None  # a wandb Run
    trackio: object = None  # a trackio Run
    trackio_from: int = 0  # the first step trackio's store does not hold yet (a resumed run's store may)


def open_watch(cfg: Config, out: Path, done: int, total: int, resumed: dict) -> Watch:
    """The step bar from `done` of `total`, and the trackers of report_to, continuing a resumed run's (resumed:
    its checkpoint's state.json; TensorBoard purges the steps redone; wandb continues the run whose id it keeps)."""
    w = Watch(progress_bar("steps", total, done, "step"))
    if process_rank() != 0:
        return w
    if "tensorboard" in trackers_named(cfg):
        from torch.utils.tensorboard import SummaryWriter
        # purge_step 0: a fresh run drops an earlier run's events in the folder (overwrite=true)
        w.tensorboard = SummaryWriter(str(out / "tensorboard"), purge_step=done + 1 if done else 0)
        settings = yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False, allow_unicode=True)
        w.tensorboard.add_text("config", "    " + settings.replace("\n", "\n    "), done)
    if "wandb" in trackers_named(cfg):
        import wandb
        run_id = resumed.get("wandb_run_id")
        # console off: wandb must not wrap stdout (the table) or stderr. The user's WANDB_PROJECT and
        # WANDB_DIR win; else project rlvr, files under output_dir/wandb (WANDB_MODE=offline: local only)
        w.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT") or "rlvr",
                             dir=os.environ.get("WANDB_DIR") or str(out), id=run_id,
                             resume="allow" if run_id else None, config=dataclasses.asdict(cfg),
                             settings=wandb.Settings(console="off", silent=True))
    if "trackio" in trackers_named(cfg):
        w.trackio, w.trackio_from = open_trackio(cfg, out, resumed)
    return w


def open_trackio(cfg: Config, out: Path, resumed: dict) -> tuple[object, int]:
    """A trackio run in its local store ($TRACKIO_DIR, else the Hugging Face cache), named after output_dir
    and its start time, or the one a resumed checkpoint names. trackio has no purge: a resumed run sends
    only the steps after the store's last (a redone step has the same numbers). Returns the run and that step."""
    import trackio
    from trackio.sqlite_storage import SQLiteStorage
    name = resumed.get("trackio_run")
    name = name or f"{out.resolve().name}-{time.strftime('%Y%m%d-%H%M%S')}"
    project = os.environ.get("TRACKIO_PROJECT", "rlvr")
    held = SQLiteStorage.get_max_step_for_run(project, name) if resumed else None
    with redirect_stdout(plain_stderr()):  # trackio announces itself on stdout, which holds only the table
        run = trackio.init(project=project, name=name, resume="allow", config=dataclasses.asdict(cfg), embed=False,
                           auto_log_gpu=False, auto_log_cpu=False)
    return run, 0 if held is None else held + 1


def tracker_ids(w: Watch | None) -> dict:
    """What a checkpoint keeps so that a resumed run continues the same tracker run."""
    return {**({"wandb_run_id": w.wandb.id} if w is not None and w.wandb is not None else {}),
            **({"trackio_run": w.trackio.name} if w is not None and w.trackio is not None else {})}


def step_scalars(m: dict, history: list[dict]) -> dict[str, float]:
    """The step's numbers under TRL's names (where the meaning is the same), and the summary's counts so far."""
    g, gen = rollouts_of(m), m["timings"].get("generation", 0.0)
    scalars = {
        "reward": m["reward_mean"], "reward_std": m["reward_std"],
        "frac_reward_zero_std": flat_groups(m) / len(step_groups(m)),
        "correct": m["correct"], "completions/mean_length": m["response_tokens"] / g,
        "completions/clipped_ratio": m["cut_at_limit"] / g, "completions/no_answer_ratio": m["no_answer"] / g,
        "loss": float(m["policy_loss"]), "grad_norm": float(m["grad_norm"]), "step_time": m["seconds"],
        "tokens_per_second": m["response_tokens"] / gen if gen > 0 else 0.0,
        "run/correct_rollouts": sum(h["correct"] for h in history),
        "run/zero_variance_groups": sum(flat_groups(h) for h in history),
        "run/skipped_steps": sum(h["skipped"] for h in history),
    }
    if m["update_norm"] is not None:  # a skipped step has none
        scalars["update_norm"] = m["update_norm"]
    if "kl" in m:  # kl_coef
        scalars["kl"] = m["kl"]
    if "learning_rate" in m:  # a step before this was recorded has none
        scalars["learning_rate"] = m["learning_rate"]
    if "epochs" in m:  # ppo_epochs > 1: the last epoch's (the first's is always 0)
        scalars["clip_ratio/region_mean"] = m["epochs"][-1]["clipped_fraction"]
    if "problems_drawn" in m:  # zero_variance=resample or problems_per_step
        scalars["problems_drawn"] = m["problems_drawn"]
    return scalars


def rollouts_markdown(rollouts: list[dict]) -> str:
    """The step's rollouts as a Markdown table (TensorBoard's text panel)."""
    def cell(x) -> str:
        return str(x).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| rollout | reward | advantage | status | answer | tokens | response |", "|---" * 7 + "|"]
    lines += [f"| {r['rollout']} | {r['reward']} | {r['advantage']:.3f} | {r['status']} | {cell(r['answer'])} | "
              f"{r['tokens']} | {cell(r['response'])} |" for r in rollouts]
    return "\n".join(lines)


def send_to_trackers(w: Watch, scalars: dict[str, float], step: int, rollouts: list[dict] | None = None) -> None:
    """The scalars, and the step's rollouts as a table when given, to every open tracker at `step`."""
    if w.tensorboard is not None:
        for name, value in scalars.items():
            w.tensorboard.add_scalar(name, value, step)
        if rollouts is not None:
            w.tensorboard.add_text("rollouts", rollouts_markdown(rollouts), step)
        w.tensorboard.flush()
    columns = ["rollout", "reward", "advantage", "status", "answer", "tokens", "response"]
    trackio = w.trackio if w.trackio is not None and step >= w.trackio_from else None  # else its store has the step
    for run, module in ((w.wandb, "wandb"), (trackio, "trackio")):
        if run is not None:  # the table: wandb.Table or trackio.Table
            table = {} if rollouts is None else {"rollouts": importlib.import_module(module).Table(
                columns=columns, data=[[r[c] for c in columns] for r in rollouts])}
            run.log({**scalars, **table}, step=step)


def report_eval(w: Watch, records: list[dict], samples: int) -> None:
    """An evaluation's accuracy overall, per level and per subject to every tracker, at its weights' step."""
    summary = summarize_phase(records, samples)
    send_to_trackers(w, {"eval/accuracy" if g["kind"] == "overall" else f"eval/{g['kind']}/{g['group']}": g["accuracy"]
                         for g in summary["groups"]}, summary["step"])


def close_watch(w: Watch | None, out: Path) -> None:
    """The end of every run (finished or stopped): close the bar and the trackers, draw run.png."""
    if w is None:
        return
    w.bar.close()
    if w.tensorboard is not None:
        w.tensorboard.close()
    if w.wandb is not None:
        w.wandb.finish()
    if w.trackio is not None:
        import trackio
        with redirect_stdout(plain_stderr()):  # trackio.finish, not the run's: else trackio's exit hook finishes it
            trackio.finish()                # again and prints on stdout
    if process_rank() == 0:
        try:
            plot_run(out)
        except UserError as e:  # a picture's place is taken: said, and the run's outcome stands
            progress(str(e))
        except Exception as e:  # the picture is a convenience: the run's outcome stands without it
            progress(f"could not draw {out / 'run.png'} ({type(e).__name__}: {str(e)[:160]})")


def plot_run(out: Path, required: bool = False) -> Path | None:
    """Draw output_dir/run.png from metrics.jsonl and eval.jsonl; without matplotlib, say how (--plot: an error)."""
    if importlib.util.find_spec("matplotlib") is None:
        if required:
            raise UserError("--plot needs matplotlib; pip install matplotlib")
        progress(f"no {out / 'run.png'}: the picture of the run needs matplotlib (pip install matplotlib, "
                 f"then python train_rlvr.py --plot {out})")
        return None
    metrics = read_jsonl(out / "metrics.jsonl", ("step", "correct", "reward_std", "response_tokens", "grad_norm",
                                                 "update_norm"))
    if not metrics:
        if required:
            raise UserError(f"--plot: {out} holds no metrics.jsonl with a step in it; pass a run's output_dir")
        return None
    evals = read_jsonl(out / "eval.jsonl", ("step", "phase", "sample", "reward"))
    save_picture(run_figure(metrics, evals), out / "run.png")
    tokens = read_jsonl(out / "tokens.jsonl", ("step", "rollout", "reward", "tokens", "before", "after"))
    if tokens:  # token_report
        save_picture(token_figure(tokens), out / "tokens.png")
    if tokens and "token_advantages" in tokens[-1]:  # token_report with a credit
        save_picture(credit_figure(tokens), out / "credit.png")
    return out / "run.png"


def save_picture(fig, path: Path) -> None:
    try:
        fig.savefig(path, dpi=100)
    except OSError as e:  # a folder or an unwritable file in its place
        raise UserError(f"cannot write {path} ({e.strerror or e}); move what is there away and draw it again with "
                        f"python train_rlvr.py --plot {path.parent}") from None
    progress(f"wrote {path}")


def run_figure(metrics: list[dict], eval_records: list[dict]):
    """run.png: per step the correct count (zero-variance groups marked), the grad norm (before clipping) and
    update norm (log scale), the response tokens; if evaluated, accuracy per level before and after (95 % Wilson)."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    phases = list(dict.fromkeys(r["phase"] for r in eval_records))
    fig = Figure(figsize=(10, 11 if phases else 8.5), layout="constrained")
    axes = fig.subplots(4 if phases else 3, 1)
    for ax in axes[1:3]:  # one step sits at one x on every step panel (a log panel ends at its last nonzero value)
        ax.sharex(axes[0])
    steps = [m["step"] for m in metrics]
    # each bar counts its step's rollouts: P x G with problems_per_step (the last step may hold fewer problems)
    g = metrics[0]["group_size"] if metrics else 8
    p = max((len(m.get("problems", [0])) for m in metrics), default=1)
    flat = [m["reward_std"] == 0 for m in metrics]
    # no gradient: grad norm exactly 0. With the spec's credit that is every zero-variance group; with a credit that
    # gives a zero-variance group a signal (checked lines, monte_carlo's values) or a KL term, some have one
    still = [m["grad_norm"] == 0 for m in metrics]
    axes[0].bar(steps, [m["correct"] for m in metrics], color=["0.7" if f else "tab:green" for f in flat])
    if any(still):  # unclipped: a cross at 0 would be cut in half by the axis (and an empty unclipped line
        # has no extent: constrained layout would collapse every panel)
        axes[0].plot([s for s, z in zip(steps, still) if z], [0] * sum(still), "x", color="tab:red", clip_on=False)
    outside = dict(loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0, fontsize="small")  # no data under it
    # the bars are one artist of two colours: the legend names each colour itself
    axes[0].legend([Patch(color="tab:green"), Patch(color="0.7"), Line2D([], [], ls="", marker="x", color="tab:red")],
                   ["correct rollouts", "zero-variance group", "no gradient (grad norm 0)"], **outside)
    axes[0].set(xlabel="step", ylabel=f"correct / {g}" if p == 1 else f"correct / {p} x {g}", ylim=(0, p * g),
                title="rewards per step")
    def positive(x):  # a log axis has no 0 (a zero-variance group's gradient): a gap, not a line to the edge
        return float(x) if x is not None and float(x) > 0 else float("nan")

    axes[1].plot(steps, [positive(m["grad_norm"]) for m in metrics], ".-", label="grad norm (before clipping)")
    axes[1].plot(steps, [positive(m["update_norm"]) for m in metrics], ".-", label="update norm")
    axes[1].set(yscale="log", xlabel="step", ylabel="norm", title="gradient and update (log scale; 0 not drawn)")
    axes[2].plot(steps, [m["response_tokens"] for m in metrics], ".-", color="tab:purple")
    axes[2].set(ylabel="tokens", xlabel="step", title="response tokens per step (the whole group)")
    if phases:
        samples = max(r["sample"] for r in eval_records) + 1
        for k, phase in enumerate([phases[0], phases[-1]] if len(phases) > 1 else phases):
            groups = [g for g in summarize_phase([r for r in eval_records if r["phase"] == phase], samples)["groups"]
                      if g["kind"] != "subject"]
            x = [i + (k - 0.5) * 0.3 for i in range(len(groups))]
            acc = [g["accuracy"] for g in groups]
            errors = [[abs(a - g["wilson95"][j]) for a, g in zip(acc, groups)] for j in (0, 1)]  # below, above
            axes[3].errorbar(x, acc, yerr=errors, fmt="o", capsize=3, label=phase)
        axes[3].set_xticks(range(len(groups)), [g["group"] for g in groups])
        axes[3].set_xlim(-0.5, len(groups) - 0.5)
        # headroom: a marker at 0 or 1 (100 %) would be cut in half by the edge of the axis
        axes[3].set(xlabel="evaluation problems: overall and per level", ylabel="accuracy", ylim=(-0.05, 1.05),
                    yticks=[0, 0.2, 0.4, 0.6, 0.8, 1], title="evaluation accuracy with 95 % Wilson intervals")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax is not axes[0] and ax.get_legend_handles_labels()[0]:
            ax.legend(**outside)
    return fig


def token_figure(records: list[dict]):
    """tokens.png (token_report): the best-rewarded response of the last step in tokens.jsonl, each token on
    a background coloured by the change of its log-probability over that step (after - before; blue up, red
    down, white unchanged), and the mean change inside its last \\boxed{} (the answer) against the rest."""
    last = [r for r in records if r["step"] == records[-1]["step"]]
    rec = max(last, key=lambda r: (r["reward"], -r["rollout"]))
    change = [a - b for a, b in zip(rec["after"], rec["before"])]
    inside, outside = answer_changes(rec["tokens"], change)
    mean = lambda v: f"{sum(v) / len(v):+.4f} ({len(v)} token{'s' * (len(v) != 1)})" if v else "none"  # noqa: E731
    title = (f"step {rec['step']}, problem {rec['problem_index']}, rollout {rec['rollout']}: reward {rec['reward']:g}, "
             f"advantage {rec['advantage']:+.3f}\nbackground: the change of each token's log-probability over the "
             f"step\nmean change inside the last \\boxed{{}}: {mean(inside)}; elsewhere: {mean(outside)}")
    return text_figure(wrapped_tokens(rec["tokens"], change, 96), title, "log-probability after - before")


def credit_figure(records: list[dict]):
    """credit.png (token_report with a credit other than the spec's, or the entropy mask): the last step's whole
    group, each response from a new line after its rollout and reward, each token on a background coloured by the
    advantage A_it the loss gave it (blue pushed up, red down, white 0: a token trained in another leaf of a tree,
    a segment whose value did not change, or a token the entropy mask leaves out)."""
    last = sorted((r for r in records if r["step"] == records[-1]["step"]), key=lambda r: r["rollout"])
    lines, row = [], 0
    for rec in last:
        head = f"#{rec['rollout']} r={rec['reward']:g}: "
        credit = [a * m for a, m in zip(rec["token_advantages"], rec.get("entropy_mask", [1] * len(rec["tokens"])))]
        body = wrapped_tokens(rec["tokens"], credit, 96 - len(head))
        lines += [(0, row, head, 0.0)] + [(x + len(head), y + row, shown, a) for x, y, shown, a in body]
        row += body[-1][1] + 1 if body else 1
    title = (f"step {last[0]['step']}, problem {last[0]['problem_index']}: the group's token advantages\n"
             "background: the advantage A_it the loss gave each token" +
             (" (white under the entropy mask)" if "entropy_mask" in last[0] else ""))
    return text_figure(lines, title, "token advantage A_it")


def text_figure(lines: list[tuple[int, int, str, float]], title: str, label: str):
    """Tokens laid out as lines (wrapped_tokens: column, row, text, value), each on a background coloured by its
    value on a symmetric blue-white-red scale, the title above, the colour bar below."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import RendererAgg
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.font_manager import FontProperties
    scale, cols = max(max(abs(c) for _, _, _, c in lines), 1e-12), 96
    rows, used = lines[-1][1] + 1, max(x + len(shown) for x, _, shown, _ in lines)
    # Laid out by hand in inches, the figure as big as its text: one x unit is one character of the
    # monospaced font, one y unit one row. The character's width is measured as the picture is saved (100
    # dpi): hinting rounds each advance to whole pixels (0.63 em there, not the font's 0.602).
    size, row_h, dpi = 8, 0.22, 100

    def inches(text, **font):
        return RendererAgg(1, 1, dpi).get_text_width_height_descent(text, FontProperties(**font), ismath=False)[0] / dpi

    char_w = inches("0" * cols, family="monospace", size=size) / cols
    width = max(used * char_w, *(inches(line, size=9) + 0.05 for line in title.split("\n")))  # the text or the title
    title_h = 0.22 * (title.count("\n") + 1) - 0.04
    text_h, bar_h, margin, side = rows * row_h, 0.12, 0.15, 0.3  # side: the colour bar's end labels
    fig_w, fig_h = width + 2 * side, margin + title_h + text_h + 0.3 + bar_h + 0.5
    fig = Figure(figsize=(fig_w, fig_h), dpi=dpi)
    ax = fig.add_axes([side / fig_w, 1 - (margin + title_h + text_h) / fig_h, width / fig_w, text_h / fig_h])
    ax.set(xlim=(0, width / char_w), ylim=(rows, 0))
    ax.axis("off")
    cmap, norm = colormaps["RdBu"], Normalize(-scale, scale)
    for x, y, shown, c in lines:
        ax.text(x, y + 0.5, shown, family="monospace", fontsize=size, va="center", color=_ink(cmap(norm(c))),
                parse_math=False, bbox=dict(facecolor=cmap(norm(c)), edgecolor="none", pad=0.6))  # $ is text
    ax.set_title(title, fontsize=9, loc="left", pad=0.1 * 72)
    bar = fig.add_axes([side / fig_w, 0.5 / fig_h, width / fig_w, bar_h / fig_h])
    fig.colorbar(ScalarMappable(norm, cmap), cax=bar, orientation="horizontal", label=label)
    return fig


def answer_changes(tokens: list[str], change: list[float]) -> tuple[list[float], list[float]]:
    """The changes of the tokens that overlap the last \\boxed{} (the answer), and those of the rest."""
    ends, pos = [], 0
    for piece in tokens:
        pos += len(piece)
        ends.append(pos)
    lo, hi = boxed_span("".join(tokens))
    in_box = [e > lo and e - len(piece) < hi for e, piece in zip(ends, tokens)]
    return [c for c, b in zip(change, in_box) if b], [c for c, b in zip(change, in_box) if not b]


def wrapped_tokens(tokens: list[str], change: list[float], cols: int) -> list[tuple[int, int, str, float]]:
    """(column, row, text shown, change) of each token, rows wrapped at `cols` characters."""
    lines, x, y = [], 0, 0
    for piece, c in zip(tokens, change):
        shown = piece.replace("\n", "\u23ce") or "\u2205"
        if x + len(shown) > cols and x:
            x, y = 0, y + 1
        lines.append((x, y, shown, c))
        x += len(shown)
    return lines


def _ink(rgba) -> str:
    """Black or white, whichever contrasts more with the cell (WCAG relative luminance)."""
    lum = sum(w * (v / 12.92 if v <= 0.04045 else ((v + 0.055) / 1.055) ** 2.4)
              for w, v in zip((0.2126, 0.7152, 0.0722), rgba[:3]))
    return "white" if (1.05 / (lum + 0.05)) > ((lum + 0.05) / 0.05) else "black"


def boxed_span(text: str) -> tuple[int, int]:
    """Character span of the last \\boxed{...} of a text, braces matched; (0, 0) if none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return 0, 0
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return start, i + 1
    return start, len(text)


# ----------------------------------------------------------------------------------------------
# Evaluation

# The step table shows that the weights moved; this shows whether the model got better at math.
# Before step 1, after the last step and every eval_every steps, the first eval_problems problems of
# eval_dataset (MATH-500 by default) are answered with the training prompt and EOS through the
# rollouts' decode loop (greedy, or eval_samples sampled responses each) and scored by the same TimedVerifier.

Z95 = 1.959964  # the two-sided 95 % normal quantile


def evaluate_if_due(step: int, t: Trainer, s: RunState) -> bool:
    """Evaluate the weights after `step` if the settings ask for it and the log lacks it, into the log and
    the eval files. Returns whether it evaluated. A signal or CUDA out of memory in it stops the run."""
    cfg, last = t.cfg, s.steps
    due = cfg.eval_problems > 0 and (step in (0, last) or (cfg.eval_every > 0 and step % cfg.eval_every == 0))
    if not s.eval_set or not due or any(r["step"] == step for r in s.eval_log):
        return False
    phase = eval_phase(step, last)
    t0 = time.perf_counter()
    try:
        records = evaluate(t.model, t.tokenizer, s.eval_set, cfg, t.eos_id, t.scorer, autocast(t.device, t.precision),
                           phase, step, t.decoders)
    except Interrupted:
        raise StopRun(f"stopped by {signal.Signals(STOP['signal']).name} during the {phase} evaluation",
                      stop_code()) from None
    except StopRun as e:  # CUDA out of memory (on any rank)
        raise StopRun(str(e), stop_code()) from None
    note(f"after the {phase} evaluation")
    s.eval_log.extend(records)
    write_eval_files(s.out, s.eval_log, cfg)
    report_eval(s.watch, records, cfg.eval_samples)
    progress(eval_line(phase, records, cfg.eval_samples, time.perf_counter() - t0))
    return True


def load_eval_problems(cfg: Config) -> list[dict]:
    """The first eval_problems records of eval_dataset, in file order: problem_field, answer_field, and level,
    subject, unique_id ("unknown" / None where absent). Loaded before the model: a missing field costs no load."""
    if cfg.eval_problems == 0:
        return []
    records = load_records(cfg.eval_dataset, cfg.eval_split,
                           {"problem_field": cfg.problem_field, "answer_field": cfg.answer_field},
                           0, cfg.eval_problems, setting="eval_dataset", count_keys=("eval_problems",),
                           config=cfg.eval_dataset_config)
    subject = lambda r: str(r["subject"]).strip() if str(r.get("subject") or "").strip() else "unknown"  # noqa: E731
    return [{"index": r["index"], "problem": r[cfg.problem_field], "answer": r[cfg.answer_field],
             "level": normalize_level(r.get("level")), "subject": subject(r), "unique_id": r.get("unique_id")}
            for r in records]


def normalize_level(value) -> str:
    """A MATH level as "1".."5": MATH-500 on the hub has ints, the training file "Level 3" texts."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = "" if value is None else str(value).strip()
    if text.lower().startswith("level"):
        text = text[5:].strip()
    return text or "unknown"


def eval_phase(step: int, last_step: int) -> str:
    """The name of the evaluation of the weights after `step`: before, step-N or after."""
    return "before" if step == 0 else "after" if step == last_step else f"step-{step}"


@torch.no_grad()
def evaluate(model, tokenizer, problems: list[dict], cfg: Config, eos_id: int, scorer, amp,
             phase: str, step: int | None, decoders: Decoders | None = None) -> list[dict]:
    """Answer every problem with the current weights, eval_samples responses each, and score them:
    one record per problem and sample, in file order (problem, then sample).

    eval_batch_size problems decode together, by prompt length (less padding). Each row is its own:
    greedy is its argmax; sample s of problem i draws from its stream (seed, "eval", i, s), the same
    before and after training (common random numbers: a fairer paired comparison). So neither batch
    size nor order changes a token, up to float rounding of the padded batch (an exact near-tie).
    With `compile` on (CUDA by default) the batches decode through the compiled StaticDecoder "eval":
    one graph of eval_batch_size x eval_samples rows, checked against eager decoding first."""
    k, device = cfg.eval_samples, next(model.parameters()).device
    order = sorted(range(len(problems)), key=lambda i: (len(problems[i]["prompt_ids"]), i))
    order = order[RANKS.rank::RANKS.world]  # several processes: each its share (every problem alone: all)
    records: list[dict | None] = [None] * (len(problems) * k)
    t0, tokens = time.perf_counter(), 0
    width = min(cfg.eval_batch_size, len(order)) * k  # the compiled decoder's one batch shape
    # several processes: an interrupt or a failure in any rank's share stops them all
    with progress_bar(f"[eval {phase}]", len(order), 0, "problem") as bar, agreed(phase, None, cfg=cfg), \
            weight_cast_cache(amp, device.type), full_weights(model):  # the bar: rank 0's share
        for start in range(0, len(order), cfg.eval_batch_size):
            check_stop(local=True)  # safe point for SIGINT/SIGTERM (ranks run different numbers of batches)
            batch = order[start:start + cfg.eval_batch_size]
            tokens += evaluate_batch(model, tokenizer, problems, batch, records, cfg, eos_id, scorer, amp, phase,
                                     step, width, decoders)
            seconds = time.perf_counter() - t0
            bar_advanced(bar, len(batch), tokens_per_s=f"{tokens / seconds if seconds > 0 else 0.0:.0f}")
    shares = gather_objects([(n, r) for n, r in enumerate(records) if r is not None])
    for n, r in (x for share in shares for x in share):
        records[n] = r
    return records


def evaluate_batch(model, tokenizer, problems: list[dict], batch: list[int], records: list, cfg: Config, eos_id: int,
                   scorer, amp, phase: str, step: int | None, width: int, decoders: Decoders | None = None) -> int:
    """Decode and score one batch of problems (eval_samples rows each) into `records`; returns the tokens made."""
    k, device = cfg.eval_samples, next(model.parameters()).device
    rows = [(i, s) for i in batch for s in range(k)]
    prompt = {i: torch.tensor(problems[i]["prompt_ids"], device=device) for i in batch}
    streams = [torch.Generator(device=device).manual_seed(stream_seed(cfg.seed, "eval", problems[i]["index"], s))
               for i, s in rows] if k > 1 else None  # greedy: no stream
    responses, cut = sample(model, [prompt[i] for i, _ in rows], cfg.eval_max_new_tokens, eos_id, amp, cfg, streams,
                            None if k == 1 else (cfg.eval_temperature, cfg.eval_top_p), use="eval",
                            decoders=decoders, rows=width, common_prefix=cfg.prompt_pass == "shared")
    texts = [tokenizer.decode(r.tolist(), skip_special_tokens=True) for r in responses]
    scored = score_responses(scorer, texts, [problems[i]["answer"] for i, _ in rows])
    for (i, s), text, response, was_cut, (reward, answer, status) in zip(rows, texts, responses, cut, scored):
        p = problems[i]
        records[i * k + s] = dict(phase=phase, step=step, problem_index=p["index"], unique_id=p.get("unique_id"),
                                  level=p.get("level", "unknown"), subject=p.get("subject", "unknown"), sample=s,
                                  response=text, answer=answer, reference=p["answer"], status=status, reward=reward,
                                  tokens=len(response), cut_at_limit=was_cut)
    return sum(len(r) for r in responses)


def score_responses(scorer: verifier.TimedVerifier, texts: list[str], golds: list[str]) -> list[tuple]:
    """(reward, extracted answer, status) per response, each against its own problem's reference,
    through the rollouts' TimedVerifier (statuses correct, wrong, no_answer, timeout, crash)."""
    return [scorer.score(text, gold) for text, gold in zip(texts, golds)]


# Statistics

def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion successes / n (Wilson 1927): unlike the normal
    approximation it stays inside [0, 1] and is not degenerate at 0 or n successes."""
    if n == 0:
        return 0.0, 1.0
    p, z2 = successes / n, z * z
    center = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, center - half), min(1.0, center + half)


def mcnemar_exact_p(improved: int, regressed: int) -> float:
    """The exact two-sided McNemar test of paired right/wrong outcomes: with no change, each discordant
    problem goes either way alike, so p = min(1, 2 * P(X <= min(improved, regressed))) with
    X ~ Binomial(improved + regressed, 1/2). Integer arithmetic, one rounding; 1 when no problem changed."""
    n = improved + regressed
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(improved, regressed) + 1))
    return min(1.0, 2 * tail / 2 ** n)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k (Chen et al. 2021) of n samples, c correct: 1 - C(n - c, k) / C(n, k), a stable product."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _group_key(kind: str, name: str):
    # overall first; levels in numeric order; then subjects alphabetically; "unknown" last in each
    return ({"overall": 0, "level": 1, "subject": 2}[kind], name == "unknown",
            (0, int(name)) if name.isdigit() else (1, name))


def correct_counts(records: list[dict]) -> dict[int, int]:
    """Per problem (dataset index, in the records' order), its correct responses."""
    out: dict[int, int] = {}
    for r in records:
        out[r["problem_index"]] = out.get(r["problem_index"], 0) + (r["reward"] == 1.0)
    return out


def summarize_phase(records: list[dict], samples: int) -> dict:
    """Every number of one evaluation: per group (overall, each level, each subject) the problems n, correct
    responses, accuracy (mean pass@1; greedy: correct / n) with its 95 % Wilson interval, for samples > 1
    pass@j for j = 1, 2, 4, ..., samples; and the format figures."""
    correct, meta = correct_counts(records), {r["problem_index"]: r for r in records}
    groups: dict[tuple[str, str], list[int]] = {}
    for i, r in meta.items():
        for key in (("overall", "overall"), ("level", r["level"]), ("subject", r["subject"])):
            groups.setdefault(key, []).append(i)
    js = sorted({samples, *(2 ** e for e in range(samples.bit_length()) if 2 ** e <= samples)})
    rows = []
    for (kind, name) in sorted(groups, key=lambda g: _group_key(*g)):
        ids = groups[(kind, name)]
        n, c = len(ids), sum(correct[i] for i in ids)
        row = {"group": name if kind != "level" else f"level {name}", "kind": kind, "n": n, "correct": c,
               "accuracy": c / (n * samples), "wilson95": list(wilson_interval(c / samples, n))}
        if samples > 1:
            row["pass_at_k"] = {str(j): sum(pass_at_k(samples, correct[i], j) for i in ids) / n for j in js}
            row["pass_at_k_wilson95"] = list(wilson_interval(row["pass_at_k"][str(samples)] * n, n))
        rows.append(row)
    statuses = [r["status"] for r in records]
    n = len(records)
    return {"step": records[0]["step"], "problems": len(meta), "samples": samples, "responses": n, "groups": rows,
            "format": {"no_answer_rate": statuses.count("no_answer") / n,
                       "cut_at_limit_rate": sum(r["cut_at_limit"] for r in records) / n,
                       "mean_response_tokens": sum(r["tokens"] for r in records) / n,
                       "verifier_overruns": statuses.count("timeout") + statuses.count("crash")}}


def paired_comparison(before: list[dict], after: list[dict], samples: int) -> dict:
    """Per problem, its correct responses before vs after: improved (more), regressed (fewer), right
    both times (all right in both), wrong both times (none right in both), unchanged in between (samples
    > 1). p: the exact McNemar test on improved vs regressed; for samples > 1 the exact sign test on the
    per-problem counts (one problem's samples are not independent: not separate pairs)."""
    b, a = correct_counts(before), correct_counts(after)
    both = sorted(set(b) & set(a))
    res = dict(problems=len(both), improved=sum(a[i] > b[i] for i in both), regressed=sum(a[i] < b[i] for i in both),
               right_both_times=sum(a[i] == b[i] == samples for i in both),
               wrong_both_times=sum(a[i] == b[i] == 0 for i in both))
    res["unchanged_in_between"] = len(both) - sum(res[k] for k in ("improved", "regressed", "right_both_times",
                                                                   "wrong_both_times"))
    res["mcnemar_p"] = mcnemar_exact_p(res["improved"], res["regressed"])
    return res


def eval_summary(records: list[dict], cfg: Config) -> dict:
    """eval_summary.json: the settings, each phase's summary, before vs after (points per group, paired) if both."""
    by_phase: dict[str, list[dict]] = {}
    for r in sorted(records, key=lambda r: -1 if r["step"] is None else r["step"]):
        by_phase.setdefault(r["phase"], []).append(r)
    phases = {name: summarize_phase(rs, cfg.eval_samples) for name, rs in by_phase.items()}
    summary = {
        "settings": {k: getattr(cfg, k) for k in ("model", "revision", "eval_dataset", "eval_split", "eval_problems",
                                                   "eval_max_new_tokens", "eval_samples", "eval_temperature",
                                                   "eval_top_p", "eval_every", "seed", "prompt_template", "eos_token")},
        "decoding": "greedy" if cfg.eval_samples == 1 else "sampled", "phases": phases}
    if "before" in phases and "after" in phases:
        b, a = phases["before"]["groups"], {g["group"]: g for g in phases["after"]["groups"]}
        k = str(cfg.eval_samples)
        change = {g["group"]: {"accuracy": 100 * (a[g["group"]]["accuracy"] - g["accuracy"]),
                               **({f"pass_at_{k}": 100 * (a[g["group"]]["pass_at_k"][k] - g["pass_at_k"][k])}
                                  if cfg.eval_samples > 1 else {})} for g in b if g["group"] in a}
        summary["comparison"] = {"from": "before", "to": "after", "change_points": change,
                                 "paired": paired_comparison(by_phase["before"], by_phase["after"], cfg.eval_samples)}
    return summary


def write_eval_files(out: Path, records: list[dict], cfg: Config) -> dict:
    """eval.jsonl (every record so far) and eval_summary.json, each written whole and renamed into place."""
    summary = eval_summary(records, cfg)
    if process_rank() != 0:  # rank 0 writes
        return summary
    for name, text in (("eval.jsonl", "".join(json.dumps(_json_safe(r)) + "\n" for r in records)),
                       ("eval_summary.json", json.dumps(_json_safe(summary), indent=1) + "\n")):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)
    return summary


def read_eval_log(out: Path, steps_done: list[int] | None, last_step: int) -> list[dict]:
    """A resumed run's evaluation records (eval.jsonl as its checkpoint had it), with each phase
    named for this run's last step: a run extended to more problems turns its old `after` into step-N."""
    path = out / "eval.jsonl"
    if not steps_done or not path.exists():
        return []
    return [dict(r, phase=eval_phase(r["step"], last_step)) for r in read_jsonl(path, ("step",))
            if r["step"] in steps_done]


def eval_steps_done(records: list[dict], cfg: Config) -> list[int] | None:
    """For a checkpoint: the steps whose weights were evaluated (None with evaluation off: no key in state.json)."""
    return sorted({r["step"] for r in records}) if cfg.eval_problems else None


# What the user reads

def _percent(x: float) -> str:
    return f"{100 * x:.1f}%"


def _interval(lo_hi) -> str:
    return f"[{100 * lo_hi[0]:.1f}, {100 * lo_hi[1]:.1f}]"


def _points(x: float) -> str:
    s = f"{x:+.1f}"
    return "+0.0" if float(s) == 0 else s


def format_p(p: float) -> str:
    return f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


def _columns(rows: list[list[str]], left: int = 1) -> list[str]:
    """Rows of cells as aligned text: the first `left` columns left-aligned, the rest right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def format_eval_table(summary: dict) -> str:
    """The evaluation table for stdout: one row per group (overall, each level, each subject); per
    phase the accuracy (greedy: correct/n and %; sampled: mean pass@1 and pass@k), each with its
    95 % Wilson interval; the change in percentage points; the paired line; the format lines."""
    s, phases = summary["settings"], summary["phases"]
    names = [n for n in ("before", "after") if n in phases] or [n for n in phases if n == "model"] or list(phases)[-1:]
    k = phases[names[0]]["samples"]
    how = ("greedy" if k == 1 else
           f"{k} samples per problem at temperature {s['eval_temperature']}, top-p {s['eval_top_p']}")
    lines = [f"evaluation: {phases[names[0]]['problems']} problems of {s['eval_dataset']}"
             f"{' (' + s['eval_split'] + ')' if not Path(s['eval_dataset']).suffix else ''}, {how}, "
             f"up to {s['eval_max_new_tokens']} new tokens; intervals: 95 % Wilson"]
    comparing = len(names) == 2
    header = ["group", "n"]
    for name in names:
        header += [name, "", "95% CI"] if k == 1 else [f"{name} pass@1", "95% CI", f"pass@{k}", "95% CI"]
    if comparing:
        header += ["change"] if k == 1 else ["change pass@1", f"pass@{k}"]
    table = [header]
    groups = {name: {g["group"]: g for g in phases[name]["groups"]} for name in names}
    for g in phases[names[0]]["groups"]:
        row = [g["group"], str(g["n"])]
        for name in names:
            h = groups[name].get(g["group"])
            if h is None:
                row += ["-"] * (3 if k == 1 else 4)
            elif k == 1:
                row += [f"{h['correct']}/{h['n']}", _percent(h["accuracy"]), _interval(h["wilson95"])]
            else:
                row += [_percent(h["accuracy"]), _interval(h["wilson95"]), _percent(h["pass_at_k"][str(k)]),
                        _interval(h["pass_at_k_wilson95"])]
        if comparing:
            change = summary["comparison"]["change_points"].get(g["group"])  # pass@1, and pass@k if sampled
            row += ["-" if change is None else _points(change[key]) for key in ("accuracy", f"pass_at_{k}")[:min(k, 2)]]
        table.append(row)
    lines += _columns(table, left=1)
    if comparing:
        c = summary["comparison"]["paired"]
        counts = (f"{c['improved']} improved, {c['regressed']} regressed, {c['right_both_times']} right both "
                  f"times, {c['wrong_both_times']} wrong both times")
        lines += ["", f"paired, per problem: {counts}; exact McNemar p = {format_p(c['mcnemar_p'])}" if k == 1 else
                  f"paired, per problem (correct samples of {k}): {counts}, {c['unchanged_in_between']} unchanged "
                  f"in between; exact sign (McNemar) test p = {format_p(c['mcnemar_p'])}"]
    fmt = [["", *names]] + [[label, *[shown(phases[n]["format"][key]) for n in names]] for label, key, shown in (
        ("no answer", "no_answer_rate", _percent), ("cut at limit", "cut_at_limit_rate", _percent),
        ("mean response tokens", "mean_response_tokens", "{:.1f}".format),
        ("verifier overruns", "verifier_overruns", str))]
    lines += [""] + _columns(fmt, left=1)
    return "\n".join(lines)


def eval_line(phase: str, records: list[dict], samples: int, seconds: float) -> str:
    """One line on stderr when an evaluation ends (what eval_every prints at step N)."""
    p = summarize_phase(records, samples)
    overall, f = p["groups"][0], p["format"]
    tokens = sum(r["tokens"] for r in records)
    return (f"[eval {phase}] accuracy {_percent(overall['accuracy'])} ({overall['correct']}/{len(records)} responses "
            f"correct) on {p['problems']} problems; no answer {_percent(f['no_answer_rate'])}, cut at limit "
            f"{_percent(f['cut_at_limit_rate'])}, {f['mean_response_tokens']:.1f} tokens per response; "
            f"{seconds:.1f} s ({p['problems'] / seconds if seconds > 0 else 0.0:.2f} problems/s, "
            f"{tokens / seconds if seconds > 0 else 0.0:.0f} tokens/s)")


# ----------------------------------------------------------------------------------------------
# Checkpoints and the output folder

LOG_FILES = ("metrics.jsonl", "rollouts.jsonl")  # a run's logs; every checkpoint holds a copy


# Every file a run appends to (the logs, and those of token_report and evaluation when on): a checkpoint
# keeps a copy of each one there is, a resume puts back the checkpoint's (dropping what was logged after
# it), a fresh start and overwrite=true remove them. A new appended file belongs here (tests/test_output_dir.py).
APPENDED_FILES = (*LOG_FILES, "tokens.jsonl", "eval.jsonl")


# The resolved settings at the top of output_dir. Not config.yaml, the user's name (--config
# output_dir/config.yaml, or output_dir=., must not replace the file it reads); checkpoints keep config.yaml.
RUN_CONFIG = "run_config.yaml"

RUN_CONFIG_MARK = "# rlvr: the resolved settings of the run in this folder\n"  # without it: not ours

RUN_FILES = (*APPENDED_FILES, RUN_CONFIG, "eval_summary.json", "run.png", "tokens.png", "credit.png")  # what a run writes at the top

CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "state.json", "config.yaml", *LOG_FILES)

MANIFEST = "manifest.json"                       # size and sha256 of every file beside it, written last

LOCK_FILE = ".rlvr.lock"


def checkpoint_if_due(step: int, t: Trainer, s: RunState) -> None:
    """A checkpoint every save_every steps and after the last; after a signal during the optimizer step
    (on any rank) the complete step is saved, and the run stops."""
    signalled = agreed_signal()
    if (t.cfg.save_every and step % t.cfg.save_every == 0) or step == s.steps or signalled:
        write_checkpoint(step, t, s)
    if signalled:
        raise StopRun(f"stopped by {signal.Signals(signalled).name} after step {step}", 128 + signalled)


def write_checkpoint(step: int, t: Trainer, s: RunState) -> None:
    """save_checkpoint on every rank alike, after comparing the replicas (it holds the weights every rank
    has). One that cannot be written (a full disk; the previous ones are intact) stops the run."""
    progress(f"[step {step}] writing checkpoint")
    try:
        check_replicas(t.params)
        save_checkpoint(s.out, step, t.model, t.optimizer, t.cfg, next_record(s.problems, problems_drawn(s.history)),
                        eval_steps_done(s.eval_log, t.cfg), tracker_ids(s.watch))
        failed = None
    except StopRun as e:
        failed = str(e)
    failed = from_rank0(failed)
    if failed is not None:
        raise StopRun(failed)
    s.last_saved = step
    RANKS.resume_hint = (f"The checkpoint of step {step} in {s.out / 'checkpoints'} is complete; to continue: "
                         f"{resume_command(s.argv)}")


def save_checkpoint(out: Path, step: int, model, optimizer, cfg: Config, next_record: int | None,
                    eval_steps: list[int] | None = None, tracker_ids: dict | None = None) -> Path:
    """Weights, optimizer state, step counter, config and the logs up to this step, with a manifest, written to a
    temporary folder, fsynced, then renamed into place: a crash mid-write leaves the previous checkpoints intact.
    Keeps the last keep_last. No RNG state: every rollout's stream derives from (seed, step, rollout). eval_steps
    (with eval.jsonl) spares a resumed run the evaluations done; tracker_ids let it continue the tracker runs. A
    full disk raises StopRun with the space needed, after removing the partial folder."""
    model_state, optimizer_state = full_states(model, optimizer)  # every rank takes part (fsdp gathers)
    root = out / "checkpoints"
    final, tmp = root / f"step-{step:06d}", root / f".tmp-step-{step:06d}-{os.getpid()}"
    if RANKS.rank != 0:  # rank 0 writes
        return final
    root.mkdir(exist_ok=True)
    need = checkpoint_bytes(model, optimizer, out)
    if shutil.disk_usage(root).free < need:
        raise StopRun(no_space_message(root, need))
    shutil.rmtree(tmp, ignore_errors=True)
    state = {"step": step, "next_record": next_record}  # data position: the next step's record (None after the last)
    state.update({} if eval_steps is None else {"eval_steps_done": eval_steps})
    state.update(tracker_ids or {})
    try:
        tmp.mkdir()
        save_file({k: v.contiguous() for k, v in untied(model, model_state).items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        usual_mode(tmp / "model.safetensors")
        torch.save(optimizer_state, tmp / "optimizer.pt")
        write_checkpoint_rest(tmp, out, cfg, state)
    except (OSError, RuntimeError) as e:  # torch's zip writer reports a full disk as "unexpected pos"
        shutil.rmtree(tmp, ignore_errors=True)
        if getattr(e, "errno", None) == errno.ENOSPC or shutil.disk_usage(root).free < need:
            raise StopRun(no_space_message(root, need)) from None
        raise
    place_checkpoint(tmp, final)
    ours = [c for c in list_checkpoints(out) if read_manifest(c) is not None]
    for stale in ours[:-cfg.keep_last]:
        remove_own_files(stale)
    return final


def write_checkpoint_rest(tmp: Path, out: Path, cfg: Config, state: dict) -> None:
    """A checkpoint folder's files beside the weights: the logs, config.yaml, state.json, then the
    manifest (size and sha256 of each file); every file and the folder fsynced."""
    for name in APPENDED_FILES:
        if name in LOG_FILES or (out / name).exists():
            shutil.copyfile(out / name, tmp / name)
    (tmp / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False, allow_unicode=True))
    (tmp / "state.json").write_text(json.dumps(state))
    write_manifest(tmp, state["step"])
    for f in tmp.iterdir():
        _fsync(f)
    _fsync(tmp)


def place_checkpoint(tmp: Path, final: Path) -> None:
    """Rename the complete folder tmp to final. A final already there is kept under another name when
    it has no rlvr manifest (not verifiably ours), else replaced (this step written again after a resume)."""
    root = final.parent
    if final.exists() and read_manifest(final) is None:
        aside = root / f"{final.name}.kept-{int(time.time())}"
        os.rename(final, aside)
        progress(f"{final} has no rlvr manifest; moved it to {aside} instead of replacing it")
    if final.exists():
        old = root / f".old-{final.name}-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)  # a crash between the renames: recover_checkpoint_rewrite restores old
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    _fsync(root)


def usual_mode(path: Path) -> None:
    """The mode the umask gives a new file (0644 under the usual 022): safetensors writes its files 0600."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def list_checkpoints(out: Path) -> list[Path]:
    """Checkpoint folders, oldest first; a half-written one is still .tmp-step-N (intact? verify_checkpoint)."""
    found = [p for p in (out / "checkpoints").glob("step-*") if p.name[5:].isdigit() and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path, step: int | None) -> None:
    files = {f.name: {"size": f.stat().st_size, "sha256": sha256_file(f)}
             for f in sorted(folder.iterdir()) if f.is_file() and f.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps({"rlvr": 1, "step": step, "files": files}, indent=1))


def read_manifest(folder: Path) -> dict | None:
    """The manifest of a folder rlvr wrote, or None (missing, unreadable, or someone else's)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None
    except (OSError, ValueError):
        return None


def verify_checkpoint(ckpt: Path) -> str | None:
    """What is wrong with a checkpoint folder, or None when it is intact: every file its manifest
    lists is there with its size and sha256, and the step counter, the manifest and the logs agree."""
    manifest = read_manifest(ckpt)
    if manifest is None:
        return f"{MANIFEST} is missing or unreadable"
    files = manifest["files"]
    for name in CHECKPOINT_FILES:
        if name not in files:
            return f"{MANIFEST} does not list {name}"
    for name, want in files.items():  # sizes first (cheap), then the contents
        f = ckpt / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want.get("size"):
            return f"{name} has {f.stat().st_size} bytes, its manifest says {want.get('size')} (truncated or replaced)"
    for name, want in files.items():
        if sha256_file(ckpt / name) != want.get("sha256"):
            return f"{name} does not match the sha256 in its manifest (damaged)"
    try:
        step = read_state(ckpt)["step"]
        logged = [json.loads(line)["step"] for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    except (ValueError, KeyError, TypeError):
        return "state.json or metrics.jsonl does not hold what rlvr writes"
    if not (step == manifest.get("step") and logged == list(range(1, step + 1))):
        return (f"its step counter ({step}), manifest ({manifest.get('step')}) and metrics.jsonl "
                f"({len(logged)} steps) disagree")
    return None


def checkpoint_bytes(model, optimizer, out: Path) -> int:
    """About what a checkpoint takes on disk: the weights, the AdamW state and the logs."""
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}  # tied once
    state = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    return (sum(tensors.values()) + sum(v.numel() * v.element_size() for v in state)
            + sum((out / name).stat().st_size for name in APPENDED_FILES if (out / name).is_file()))


def run_disk_need(cfg: Config, model, out: Path, done: int, steps: int) -> tuple[int, int]:
    """The most the checkpoints and final/ of the steps to come take on disk, known before step 1: a checkpoint is
    the weights, AdamW's two moments in their dtype and the logs, keep_last + 1 at once while one is written; final/
    the weights again. Checkpoints in output_dir count as taken. Returns that need and one checkpoint's size."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied tensor once; fsdp: whole
    moments = sum(2 * p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    ckpt = weights + moments + sum((out / n).stat().st_size for n in APPENDED_FILES if (out / n).is_file())
    writes = len({k for k in range(done + 1, steps + 1) if cfg.save_every and k % cfg.save_every == 0} | {steps})
    held = len(list_checkpoints(out))
    return max(0, min(cfg.keep_last + 1, held + writes) - held) * ckpt + weights, ckpt


def check_disk(cfg: Config, model, out: Path, done: int, steps: int) -> None:
    """Refuse before step 1 a run whose checkpoints cannot fit: else the steps before the first one are lost."""
    need, ckpt = run_disk_need(cfg, model, out, done, steps)
    free = shutil.disk_usage(out).free
    if free < need:
        raise UserError(f"not enough space in output_dir {out}: this run's checkpoints ({human_bytes(ckpt)} each, "
                        f"up to keep_last + 1 = {cfg.keep_last + 1} while one is written) and final/ need "
                        f"{human_bytes(need)} and {human_bytes(free)} are free; free some space, lower keep_last, "
                        "or choose another output_dir")


def no_space_message(folder: Path, need: int) -> str:
    free = shutil.disk_usage(folder).free
    return (f"no space left in {folder}: a checkpoint needs about {human_bytes(need)} and {human_bytes(free)} are "
            "free; free some space (the README lists what a run needs)")


def recover_checkpoint_rewrite(root: Path) -> None:
    """Undo what a crash between the two renames of a checkpoint rewrite left in `root`: a rewrite of
    step-N renames step-N to .old-step-N-<pid>, then .tmp-step-N-<pid> to step-N; killed in between, it
    leaves no step-N, and the .old- copy (complete) is renamed back. Runs before anything looks for
    checkpoints and deletes nothing; begin_output removes the leftovers later."""
    if not root.is_dir():
        return
    for old in sorted(root.glob(".old-step-*")):
        name = old.name[len(".old-"):].rsplit("-", 1)[0]  # .old-step-000004-1234 -> step-000004
        if name[5:].isdigit() and not (root / name).exists():
            os.rename(old, root / name)
            _fsync(root)
            progress(f"restored {root / name} from {old.name} (a checkpoint rewrite was interrupted)")


def next_record(problems: list[dict], drawn: int) -> int | None:
    return problems[drawn]["index"] if drawn < len(problems) else None


def problems_drawn(history: list[dict]) -> int:
    """The problems the steps done have drawn: one each (P with problems_per_step), more with zero_variance=resample."""
    return sum(m.get("problems_drawn", 1) for m in history)


def problems_trained(history: list[dict]) -> int:
    """The problems the steps done have trained on: one each, or the P (the last step: the rest) of "problems"."""
    return sum(len(m["problems"]) if "problems" in m else 1 for m in history)


def read_state(ckpt: Path) -> dict:
    """A checkpoint's state.json: its step, data position, evaluations done and tracker runs (save_checkpoint)."""
    return json.loads((ckpt / "state.json").read_text())


def checkpoint_history(ckpt: Path, problems: list[dict]) -> tuple[list[dict], dict]:
    """The metrics of a verified checkpoint's steps, once its data position is checked against the data, and its
    state.json (read here once: the evaluations done, the tracker runs to continue)."""
    state = read_state(ckpt)
    history = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    here = next_record(problems, problems_drawn(history))
    if state.get("next_record") is not None and here != state["next_record"]:
        raise UserError(f"cannot resume {ckpt}: its next problem is dataset record {state['next_record']}, "
                        f"but the data now give record {here}; the data set changed since the checkpoint")
    return history, state


def load_checkpoint(ckpt: Path, model, optimizer, problems: list[dict]) -> tuple[list[dict], dict]:
    """Restore the weights and the optimizer state of a verified checkpoint; return the metrics of its
    steps and its state.json (every rank gets rank 0's). Rank 0 reads it and sends each rank its part (replica or shard): other machines need no copy
    of output_dir. set_optimizer_state_dict creates the absent state with a step at lr 0 (no weight moves)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    history, state = on_rank0(checkpoint_history, ckpt, problems)
    # strict=False: a tied weight is in the file once; check_weight_names does the checking instead
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=RANKS.world > 1, strict=False)
    for name, read, load in (
            ("model.safetensors", load_file, lambda state: set_model_state_dict(
                model, check_weight_names(model, state), options=options)),
            ("optimizer.pt", lambda f: torch.load(f, map_location="cpu", weights_only=True),
             lambda state: load_optimizer_state(model, optimizer, state, options))):
        try:
            load(read(ckpt / name) if RANKS.rank == 0 else {})
        except Exception as e:  # intact file of another model or optimizer: name it, not torch's advice
            raise UserError(f"cannot resume {ckpt}: {name} does not fit this model and optimizer "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None
    return history, state


def load_optimizer_state(model, optimizer, state: dict, options) -> None:
    """set_optimizer_state_dict, unless the checkpoint's AdamW has no state yet (every step skipped): the
    API makes a state with a step at lr 0 and keeps it when the loaded one is empty (measured: 24
    entries, step 1), so the next step's bias correction would differ from the uninterrupted run's."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    if from_rank0(bool(state.get("state")) if RANKS.rank == 0 else None):
        set_optimizer_state_dict(model, optimizer, state, options=options)


def full_states(model, optimizer) -> tuple[dict, dict | None]:
    """The model's state and the optimizer's (or None), whole and keyed by parameter name, on rank 0:
    one file each serves 1 process, N replicas or N shards alike. fsdp gathers: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    # cpu_offload for fsdp only (the full state lands on rank 0's host alone); one process and replicas
    # hand over their own tensors, not a copy of a GPU's whole state on the host at once
    options = StateDictOptions(full_state_dict=True, cpu_offload=RANKS.sharding == "fsdp")
    model_state = get_model_state_dict(model, options=options)
    if optimizer is not None and not optimizer.state:  # no step taken yet since the start or resume
        # measured: without gradients either, the API would first take a step at lr 0 to make a state
        zero_gradients([p for p in model.parameters() if p.requires_grad])
    return model_state, None if optimizer is None else get_optimizer_state_dict(model, optimizer, options=options)


def weight_names(model) -> list[list[str]]:
    """The state-dict names of each weight; a tied one has two (Qwen3: model.embed_tokens.weight, lm_head.weight)."""
    names = {}
    for name, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(name)
    return list(names.values())


def untied(model, state: dict) -> dict:
    """state with each weight once, under its first name: get_model_state_dict lists a tied weight under
    both names (measured: one tensor twice; fsdp, two copies), and save_file refuses a tensor twice."""
    return {names[0]: state[names[0]] for names in weight_names(model)}


def check_weight_names(model, state: dict) -> dict:
    """state, if it holds every weight of the model (a tied one under either name: older rlvr
    wrote lm_head.weight) and nothing else: set_model_state_dict with full_state_dict silently fills a
    missing weight with the model's own (measured: strict=True accepts a file without a layer)."""
    if RANKS.rank == 0:
        groups = weight_names(model)
        missing = [names[0] for names in groups if not state.keys() & set(names)]
        extra = sorted(state.keys() - {n for names in groups for n in names})
        if missing or extra:
            raise ValueError(f"missing weights {missing[:3]}, unexpected weights {extra[:3]}")
    return state


def find_resume_checkpoint(cfg: Config, out: Path, holds: list[str]) -> Path | None:
    """The checkpoint to resume: resume=auto takes the newest intact one in output_dir and names
    the damaged ones it skips; an explicit PATH must be intact, and may lie outside output_dir only
    when output_dir holds no other run (or with overwrite=true)."""
    if not cfg.resume:
        return None
    if cfg.resume == "auto":
        found, skipped, ckpt = list_checkpoints(out), [], None
        for candidate in reversed(found):
            if (problem := verify_checkpoint(candidate)) is None:
                ckpt = candidate
                break
            skipped.append(f"{candidate.name} ({problem})")
        if skipped:
            progress(f"resume=auto: skipping damaged checkpoints: {'; '.join(skipped)}")
        if ckpt is None:
            if found and not cfg.overwrite:
                raise UserError(f"resume=auto: no intact checkpoint in {out / 'checkpoints'}; resume=PATH an intact "
                                "one, or start over with overwrite=true")
            progress(f"resume=auto: no checkpoint in {out / 'checkpoints'}; starting at step 1")
            return None
    else:
        ckpt = Path(cfg.resume)
        if not (ckpt / MANIFEST).exists() and not (ckpt / "state.json").exists():
            raise UserError(f"resume: {ckpt} is not a checkpoint folder; use resume=auto or a folder under "
                            f"{out / 'checkpoints'}")
        if problem := verify_checkpoint(ckpt):
            raise UserError(f"cannot resume {ckpt}: {problem}; resume another checkpoint (resume=auto takes the "
                            "newest intact one)")
        if ckpt.resolve().parent != (out / "checkpoints").resolve() and holds and not cfg.overwrite:
            raise UserError(f"resume={ckpt} is not a checkpoint of output_dir {out}, which holds another run "
                            f"({', '.join(holds)}); set output_dir to the checkpoint's run, choose an empty "
                            "output_dir, or pass overwrite=true to replace that run")
    saved = dataclasses.asdict(Config())
    saved.update(yaml.safe_load((ckpt / "config.yaml").read_text()) or {})
    # a decaying schedule spans the run's steps: there num_problems changes every step's learning rate
    may_differ = RESUME_MAY_DIFFER - ({"num_problems"} if cfg.lr_schedule != "constant" else set())
    differ = [k for k, v in dataclasses.asdict(cfg).items() if k not in may_differ and not same_setting(k, saved.get(k), v)]
    if differ:
        raise UserError(f"cannot resume {ckpt}: these settings differ from the checkpoint's and change the math: "
                        f"{', '.join(differ)}; set them back or start a new run in another output_dir")
    done = problems_trained([json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()])
    if cfg.num_problems < done:
        raise UserError(f"cannot resume {ckpt}: it has trained {done} problems but num_problems is "
                        f"{cfg.num_problems}; set num_problems to at least {done}")
    return ckpt


def same_setting(key: str, saved, now) -> bool:
    """A checkpoint's setting and the resuming run's are the same: equal, or the same file's function by two paths."""
    if key in ("reward_function", "step_checker") and isinstance(saved, str) and saved and now:
        return user_function(saved) == user_function(now)
    return saved == now


def held_run(out: Path) -> list[str]:
    """What in output_dir a new run would replace: logs with a step in them, checkpoints, final/
    (whoever wrote them). Empty logs of a start that failed before its first step do not count."""
    found = [name for name in APPENDED_FILES if (out / name).is_file() and (out / name).stat().st_size > 0]
    for folder in ("checkpoints", "final"):
        if (out / folder).is_dir() and any((out / folder).iterdir()):
            found.append(f"{folder}/")
    return found


def foreign_files(out: Path) -> list[Path]:
    """Files where a run writes (final/, checkpoints/step-*) that no rlvr manifest lists."""
    found = []
    for folder in [out / "final", *list_checkpoints(out)]:
        if folder.is_dir():
            listed = set((read_manifest(folder) or {"files": {}})["files"]) | {MANIFEST}
            found += [f for f in folder.iterdir() if f.name not in listed]
    return found


def own_run_config(out: Path) -> bool:
    """Whether output_dir's run_config.yaml, if there is one, is one rlvr wrote (its first line is ours)."""
    try:
        with open(out / RUN_CONFIG, encoding="utf-8", errors="replace") as f:
            return f.readline() == RUN_CONFIG_MARK
    except FileNotFoundError:
        return True
    except OSError:
        return False


def remove_own_files(folder: Path) -> None:
    """Delete the files its manifest lists, the manifest, then the folder if empty: what rlvr did not write stays."""
    for name in (read_manifest(folder) or {"files": {}})["files"]:
        (folder / name).unlink(missing_ok=True)
    (folder / MANIFEST).unlink(missing_ok=True)
    if not any(folder.iterdir()):
        folder.rmdir()


@dataclass
class OutputDir:
    """output_dir, locked for the life of the process; nothing in it changes before begin_output (all loaded)."""
    path: Path
    resume_from: Path | None
    replace: bool      # overwrite: remove the previous run's own files in begin_output
    created: bool      # made by this process (removed again if the start fails)
    lock_fd: int


def prepare_output_dir(cfg: Config) -> OutputDir:
    """Lock output_dir and decide what happens to it: resume a checkpoint, replace a run (overwrite=true) or
    start afresh. Changes nothing yet: a run is never replaced silently, nor before the new one has loaded."""
    out = Path(cfg.output_dir)
    fd, created = lock_output_dir(out, cfg)
    try:
        recover_checkpoint_rewrite(out / "checkpoints")  # restores our own folder; deletes nothing
        holds = held_run(out)
        if cfg.num_problems == 0 and set(holds) - {"eval.jsonl"}:
            raise UserError(f"output_dir {out} holds a training run; evaluation only (num_problems=0) writes to a "
                            "folder of its own: pass another output_dir, e.g. output_dir=runs/eval")
        ckpt = find_resume_checkpoint(cfg, out, holds) if cfg.num_problems else None
        if cfg.num_problems == 0 and holds and not cfg.overwrite:
            raise UserError(f"output_dir {out} already holds an evaluation; choose another output_dir or pass "
                            "overwrite=true")
        if ckpt is None and holds and not (cfg.overwrite or cfg.resume == "auto"):
            raise UserError(f"output_dir {out} already holds a run ({', '.join(holds)}); resume it with "
                            "resume=auto, choose another output_dir, or pass overwrite=true")
        if not own_run_config(out):
            raise UserError(f"output_dir {out} holds a {RUN_CONFIG} that rlvr did not write (rlvr writes its settings "
                            "there); move it away or choose another output_dir")
        replace = bool(holds) and (ckpt is None or ckpt.resolve().parent != (out / "checkpoints").resolve())
        if replace and (foreign := foreign_files(out)):
            raise UserError(f"output_dir {out} holds files rlvr did not write where a run writes ({foreign[0]}"
                            f"{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}); move them away or "
                            "choose another output_dir")
    except BaseException:
        release_output_dir(OutputDir(out, None, False, created, fd))
        raise
    return OutputDir(out, ckpt, replace, created, fd)


def lock_output_dir(out: Path, cfg: Config | None = None) -> tuple[int, bool]:
    """An exclusive lock on output_dir, released by the OS when the process ends however it ends."""
    import fcntl
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir {out} is a file; choose a folder path for output_dir")
    made = [p for p in (out, *out.parents) if not p.exists()]  # the folders mkdir makes, deepest first
    created, made_lock = bool(made), not (out / LOCK_FILE).exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        undo_lock(out, None, made, made_lock)
        raise unwritable(out, cfg, e) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise UserError(f"output_dir {out} is in use by another run (pid {holder}); wait for it to finish or "
                        "choose another output_dir") from None
    if not same_file(fd, out / LOCK_FILE):  # the run that held it removed it as we opened it: lock the new one
        os.close(fd)
        return lock_output_dir(out, cfg)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as e:  # a full disk (or quota) at the very start: nothing may stay behind
        undo_lock(out, fd, made, made_lock)
        raise unwritable(out, cfg, e) from None
    return fd, created


def same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def unwritable(out: Path, cfg: Config | None, e: OSError) -> UserError:
    """The error for an output_dir that cannot be written; a full disk (or quota) says what a run needs."""
    return UserError(no_room_message(out, cfg) if e.errno in (errno.ENOSPC, errno.EDQUOT) else
                     f"output_dir {out} cannot be written ({e.strerror or e}); choose another output_dir")


def human_bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def no_room_message(out: Path, cfg: Config | None) -> str:
    return (f"no space left in output_dir {out} (not even for its lock file {LOCK_FILE}): {disk_need(cfg)}; free "
            "some space or choose another output_dir")


def disk_need(cfg: Config | None) -> str:
    """What a run needs on disk, as far as it can be told before its model loads: from the size of a
    local model's weight files; else per parameter (run_disk_need measures it once the model is loaded)."""
    keep = (cfg.keep_last if cfg else Config.keep_last) + 1
    folder = Path(cfg.model).expanduser() if cfg else None
    files = [f for f in folder.iterdir() if f.suffix in (".safetensors", ".bin")] if folder and folder.is_dir() else []
    if not files:
        return (f"a run's checkpoints take 12 bytes a parameter in float32 (weights and AdamW's two moments), up to "
                f"keep_last + 1 = {keep} of them at once, and final/ 4 more (Qwen3-0.6B: about 24 GB in all)")
    weights = sum(f.stat().st_size for f in files)
    return (f"a run of {cfg.model} needs about {human_bytes((3 * keep + 1) * weights)} (checkpoints of "
            f"{human_bytes(3 * weights)}, keep_last + 1 = {keep} of them while one is written, and final/)")


def undo_lock(out: Path, fd: int | None, made: list[Path], made_lock: bool) -> None:
    """Take back what a failed lock_output_dir made: the lock file and the folders, if they are new."""
    if fd is not None:
        os.close(fd)
    if made_lock:
        with suppress(OSError):  # never made (creating it is what failed)
            (out / LOCK_FILE).unlink()
    for folder in made:
        try:
            folder.rmdir()
        except OSError:  # not made (mkdir failed), or not empty: left as it is, and its parents too
            break


def begin_output(od: OutputDir, cfg: Config) -> None:
    """Everything has loaded: now remove the leftovers of interrupted checkpoint writes and the previous
    run's own files (overwrite=true), and start (or restore) the logs. Rank 0 alone writes."""
    if process_rank() != 0:
        return
    out, root = od.path, od.path / "checkpoints"
    for stale in [*root.glob(".tmp-step-*"), *root.glob(".old-step-*")]:  # interrupted writes (ours by name)
        shutil.rmtree(stale, ignore_errors=True)
    if od.replace:
        for name in RUN_FILES:
            (out / name).unlink(missing_ok=True)
        for folder in [*list_checkpoints(out), out / "final"]:
            if folder.is_dir() and read_manifest(folder) is not None:
                remove_own_files(folder)
    if cfg.num_problems and od.resume_from is None:  # evaluation only (num_problems=0): no training outputs
        for name in RUN_FILES:  # what is left of our own files describes no run of this folder's logs
            (out / name).unlink(missing_ok=True)
        for name in LOG_FILES:
            (out / name).write_text("")
    elif cfg.num_problems:  # the logs as the checkpoint has them: drops any step, token or evaluation logged after it
        for name in APPENDED_FILES:
            if (od.resume_from / name).exists():
                shutil.copyfile(od.resume_from / name, out / name)
            else:
                (out / name).unlink(missing_ok=True)
    settings = yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False, allow_unicode=True)
    (out / RUN_CONFIG).write_text(RUN_CONFIG_MARK + settings)


def release_output_dir(od: OutputDir) -> None:
    """Unlock; a folder this process made and left empty (the start failed) is removed again."""
    if od.lock_fd < 0:  # another rank's copy: rank 0 holds the folder
        return
    (od.path / LOCK_FILE).unlink(missing_ok=True)  # while it is still locked: see lock_output_dir's same_file
    os.close(od.lock_fd)
    if od.created and not any(od.path.iterdir()):
        od.path.rmdir()


def save_final(model, tokenizer, out: Path) -> None:
    model_state, _ = full_states(model, None)  # every rank takes part (fsdp gathers); rank 0 writes
    if RANKS.rank != 0:
        return
    model.save_pretrained(out / "final", safe_serialization=True, state_dict=untied(model, model_state))
    for weights in (out / "final").glob("*.safetensors"):
        usual_mode(weights)
    tokenizer.save_pretrained(out / "final")
    write_manifest(out / "final", None)  # marks every file as rlvr's own (overwrite removes exactly these)


def resume_command(argv: list[str]) -> str:
    kept = [a for a in argv if not a.startswith(("resume=", "overwrite="))]
    launcher = ["python"]
    if RANKS.world > 1:  # any number of processes may resume it; the same launch is the obvious one
        launcher = ["torchrun", f"--nproc_per_node {os.environ.get('LOCAL_WORLD_SIZE', RANKS.world)}"]
    return " ".join([*launcher, "train_rlvr.py", *map(shlex.quote, kept), "resume=auto"])


# ----------------------------------------------------------------------------------------------
# Faults and signals

class Interrupted(Exception):
    """SIGINT or SIGTERM arrived; raised at the next safe point of a step."""


class StopRun(Exception):
    """Why the run stops early, with its exit status (1 unless a signal); stop_run saves and says how to resume."""

    def __init__(self, reason: str, code: int = 1):
        super().__init__(reason)
        self.code = code


STOP = {"signal": None}  # set by the signal handler, read at safe points


def stop_run(e: Interrupted | StopRun, t: Trainer, s: RunState) -> int:
    """Every early stop ends here (a signal, a fault, too many bad steps, an unwritable checkpoint): write
    the last completed step's checkpoint if missing, say what is kept, print the resume command once."""
    reason, code = ((f"stopped by {signal.Signals(STOP['signal']).name} during step {s.step}", stop_code())
                    if isinstance(e, Interrupted) else (str(e), e.code))
    if len(s.history) > s.last_saved and not reason.startswith("no space left"):
        try:
            write_checkpoint(len(s.history), t, s)
        except StopRun as failed:
            reason = f"{reason}; {failed}"
    done, saved = len(s.history), s.last_saved
    if saved == done and done:
        kept = f"checkpoint of step {saved} in {s.out / 'checkpoints'}"
    elif saved:
        kept = (f"the last checkpoint is step {saved}; metrics.jsonl and rollouts.jsonl keep steps 1-{done}, and "
                f"resuming redoes steps {saved + 1}-{done} with the same random streams")
    else:
        kept = "no checkpoint was written" if done else "no step completed"
    progress(f"{reason}; {kept}. To continue: {resume_command(s.argv)}")
    return code


def stop_code() -> int:
    """The exit status of a run stopped by a signal (128 + its number) or by anything else (1)."""
    return 1 if STOP["signal"] is None else 128 + STOP["signal"]


def check_stop(local: bool = False, failure: str | None = None) -> None:
    """A safe point: nothing of the current step has touched the weights or the optimizer yet. Raises
    Interrupted after SIGINT/SIGTERM, StopRun(failure) if this step failed (out of memory, unusable scores).
    Several processes stop together or not at all: every rank tells (a collective) whether a signal reached
    it or its share failed. Points that ranks reach a different number of times (decode steps, evaluation
    batches) check this rank alone (local); an interrupt there waits for the end of its phase (agreed)."""
    signum = STOP["signal"] or 0
    if local or RANKS.world == 1:
        if failure:
            raise StopRun(failure)
        if signum:
            raise Interrupted()
        return
    code = int(max_over_ranks(signum + (1000 if failure else 0)))
    if code >= 1000:
        failed = [(r, m) for r, m in enumerate(gather_objects(failure)) if m]
        raise StopRun(f"rank {failed[0][0]}: {failed[0][1]}")
    if code:
        STOP["signal"] = code  # also on a rank the signal did not reach: every rank exits alike
        raise Interrupted()


@contextmanager
def agreed(phase: str, step: int | None, **facts):
    """A phase that every rank runs. A fault inside it (CUDA out of memory, unusable scores, a signal at
    a local safe point) becomes its message (fault_message); at its end the ranks learn whether any failed
    or was signalled, and stop together (check_stop). One process: at once."""
    where = f"step {step}: {phase}" if step is not None else f"the {phase} evaluation"
    note(where)
    failure = None
    try:
        yield
    except (torch.OutOfMemoryError, NonFiniteScores) as e:
        failure = fault_message(e, phase, step, **facts)
    except Interrupted:
        if RANKS.world == 1:
            raise
    note(f"{where}, done: waiting for the other ranks")  # a rank that never gets here is the one that hangs
    check_stop(failure=failure)


def fault_message(error: Exception, phase: str, step: int | None, cfg: Config, prompt_tokens: int = 0,
                  rollouts: int = 0, longest: int = 0) -> str:
    """What the user reads when a phase cannot go on: every fault's message, in one place."""
    if isinstance(error, NonFiniteScores):
        where = f"step {step}" if step is not None else f"the {phase} evaluation"
        return (f"{where}: {error}; the weights no longer give finite scores (lower learning_rate; "
                "the checkpoint holds the last completed step)")
    if phase == "generation":
        return (f"CUDA out of memory at step {step} while generating {rollouts} rollouts of up to "
                f"{cfg.max_new_tokens} tokens after a {prompt_tokens}-token prompt; lower max_new_tokens "
                "or group_size, or set precision: bf16")
    if phase == "credit":
        return (f"CUDA out of memory at step {step} in the credit method's own sampling (continuations of up to "
                f"{cfg.max_new_tokens} tokens after a {prompt_tokens}-token prompt); lower credit_samples, "
                "max_new_tokens or group_size")
    if phase == "backward":
        return (f"CUDA out of memory at step {step} in the backward pass of a response of up to {longest} "
                f"tokens after a {prompt_tokens}-token prompt; lower max_new_tokens, set "
                "logprob_batch_size: 1 or precision: bf16")
    return (f"CUDA out of memory in the {phase} evaluation ({cfg.eval_batch_size} problems x {cfg.eval_samples} "
            f"responses of up to {cfg.eval_max_new_tokens} tokens); lower eval_batch_size or eval_max_new_tokens")


def agreed_signal() -> int:
    """The signal that stops the run now, if any: this process's, or (several processes) any rank's."""
    signum = int(max_over_ranks(STOP["signal"] or 0))
    if signum:
        STOP["signal"] = signum
    return signum


@contextmanager
def signals_caught():
    """Inside: SIGINT and SIGTERM are noted in STOP for the next safe point (check_stop); then the old handlers."""
    def handler(signum, frame):
        if STOP["signal"] is not None:
            if RANKS.world > 1:  # torchrun passes the terminal's Ctrl-C on again: the ranks stop together
                return
            os._exit(128 + signum)  # second signal: at once; checkpoints are renamed into place whole
        STOP["signal"] = signum
        again = "" if RANKS.world > 1 else " (send it again to exit at once)"
        if process_rank() == 0:  # os.write, not print: a handler may run in the middle of another write
            os.write(2, f"\n{signal.Signals(signum).name}: stopping at the next safe point{again}\n".encode())
    STOP["signal"] = None
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


# ----------------------------------------------------------------------------------------------
# Processes (torchrun)

# `torchrun --nproc_per_node N train_rlvr.py` starts N copies of this script (one per GPU, or CPU processes with
# device=cpu), joined by torch.distributed (NCCL on CUDA, gloo on the CPU). The step stays the spec's: rank r samples,
# scores and backpropagates rollouts r*G/N .. (r+1)*G/N - 1 of the group, each from its own random stream (the tokens do
# not depend on N); the rewards are exchanged so every rank standardizes the whole group; each term keeps its -1/G
# factor and the gradients are summed across ranks (replicate: an all-reduce; fsdp: FSDP2's reduce-scatter, set to sum):
# the one-process step up to float summation order. Every rank clips and steps alike; rank 0 alone prints and writes.
# `python train_rlvr.py` is one process: RANKS keeps its defaults, no collective runs.

@dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    sharding: str = "none"  # none (one process), replicate or fsdp
    device: str = "cpu"     # where collectives' tensors live (NCCL: the GPU)
    resume_hint: str = ""   # what a rank that loses contact with the others says about resuming
    # the watchdog and main threads share the store's client; watchdog_off: a clean end, the store goes away
    store_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    watchdog_off: threading.Event = dataclasses.field(default_factory=threading.Event)


RANKS = Ranks()              # this process's place, set once by init_processes


def launched_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def process_rank() -> int:
    """This process's rank, also before the process group exists (torchrun sets RANK)."""
    return RANKS.rank if RANKS.world > 1 else int(os.environ.get("RANK", "0"))


def check_world(cfg: Config) -> None:
    world = launched_world()
    if cfg.group_size % world:
        raise UserError(f"group_size {cfg.group_size} does not split over {world} processes; choose a group_size "
                        "divisible by the number of processes (nproc_per_node x nnodes)")
    if world > 1 and cfg.device not in ("cuda", "cpu"):
        raise UserError(f"device {cfg.device!r}: under torchrun each process takes cuda:LOCAL_RANK; set device=cuda "
                        "or device=cpu")


def init_processes(cfg: Config, device: torch.device) -> None:
    """Join the other processes torchrun started (env://), if there are any."""
    if launched_world() == 1:
        if cfg.sharding == "fsdp":
            progress("sharding=fsdp shards across the processes of torchrun; one process holds the whole model")
        return
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)  # object collectives on NCCL use the current device
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None,
                            timeout=datetime.timedelta(seconds=cfg.dist_timeout))
    RANKS.rank, RANKS.world, RANKS.device = dist.get_rank(), dist.get_world_size(), str(device)
    RANKS.sharding = "fsdp" if cfg.sharding == "fsdp" else "replicate"
    start_watchdog(min(cfg.dist_timeout, 30.0))


def end_processes(cleanly: bool) -> None:
    if RANKS.world > 1 and cleanly:
        dist.barrier()
        with RANKS.store_lock:  # the watchdog stops first and never calls a store being torn down
            RANKS.watchdog_off.set()
            dist.destroy_process_group()


def rank_share(group_size: int) -> range:
    """This rank's rollouts of the group: a contiguous block, so rank order is rollout order."""
    k = group_size // RANKS.world
    return range(RANKS.rank * k, (RANKS.rank + 1) * k)


def gather_objects(obj) -> list:
    """obj from every rank, in rank order (one process: [obj])."""
    if RANKS.world == 1:
        return [obj]
    out = [None] * RANKS.world
    dist.all_gather_object(out, obj)
    return out


def from_rank0(obj):
    """Rank 0's obj on every rank (one process: obj)."""
    if RANKS.world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _over_ranks(op: str):
    """A function of x: x reduced over the ranks by ReduceOp `op` (in float64; one process: x)."""
    def reduce(x: float) -> float:
        if RANKS.world == 1:
            return x
        t = torch.tensor([float(x)], dtype=torch.float64, device=RANKS.device)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        return float(t.item())
    return reduce


max_over_ranks, sum_over_ranks = _over_ranks("MAX"), _over_ranks("SUM")


class SharedError(UserError):
    """A UserError rank 0 found and every rank raises: reported once, by rank 0."""


def on_rank0(fn, *args):
    """fn(*args) on rank 0 alone (the output folder is rank 0's); its result, or its UserError, on every rank."""
    result, error = None, None
    if process_rank() == 0:
        try:
            result = fn(*args)
        except UserError as e:
            error = str(e)
    result, error = from_rank0((result, error))
    if error is not None:
        raise SharedError(error)
    return result


def sum_gradients(params) -> None:
    """replicate: sum the gradients of each rank's own responses (fsdp's reduce-scatter already summed them)."""
    if RANKS.sharding == "replicate":
        for p in params:
            dist.all_reduce(p.grad)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the shard of an FSDP parameter (a DTensor), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def shard_model(model, device: torch.device):
    """fsdp: FSDP2 fully_shard per decoder layer and at the root (weights, gradients and AdamW state
    sharded; the reduce-scatter sums, not averages). Otherwise the whole model on the device."""
    if RANKS.sharding != "fsdp":
        return model.to(device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (RANKS.world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in fsdp_modules(model):
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    return model


def fsdp_modules(model) -> list:
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def full_weights(model):
    """fsdp: each layer's weights gathered whole for a generation (one all-gather per layer, not per token)."""
    modules = fsdp_modules(model) if RANKS.sharding == "fsdp" else []
    for m in modules:
        m.unshard()
        m.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for m in modules:
            m.set_reshard_after_forward(True)
            m.reshard()


def fingerprint(params) -> list[int]:
    """A cheap exact fingerprint of the weights: per tensor, the wrapping int64 sums of its float
    bit patterns and of their squares. Replicas that drifted apart by one bit differ here."""
    out = []
    for p in params:
        bits = local(p).detach().contiguous().view(-1).view(torch.int32).to(torch.int64)
        out += [int(bits.sum()), int((bits * bits).sum())]
    return out


def check_replicas(params) -> None:
    """replicate: every rank must hold the same weights (checked at each checkpoint)."""
    if RANKS.sharding == "replicate":
        prints = gather_objects(fingerprint(params))
        differ = [r for r, f in enumerate(prints) if f != prints[0]]
        if differ:
            raise StopRun(f"the weights of rank {differ[0]} differ from rank 0's (a replica drifted; the ranks must "
                          "run the same code on the same hardware type); nothing was written")


def _store():
    return dist.distributed_c10d._get_default_store()


def store_get(key: str) -> bytes | None:
    with RANKS.store_lock:
        store = _store()
        return store.get(key) if store.check([key]) else None


def store_set(key: str, value: str) -> None:
    with RANKS.store_lock:
        _store().set(key, value)


def note(where: str) -> None:
    """What this rank is doing now, kept in the store: a rank that waits for it in vain names it."""
    if RANKS.world > 1:
        store_set(f"rlvr/at/{RANKS.rank}", where)


def whereabouts() -> str:
    """Which ranks are gone (no heartbeat over 3 s) and where each rank last was."""
    def beats():
        return [store_get(f"rlvr/beat/{r}") for r in range(RANKS.world)]
    first = beats()
    time.sleep(3.0)  # a live rank beats every second
    gone = [r for r, (a, b) in enumerate(zip(first, beats())) if a == b and r != RANKS.rank]
    at = [(store_get(f"rlvr/at/{r}") or b"start-up").decode() for r in range(RANKS.world)]
    behind = [r for r in range(RANKS.world) if at[r] != at[RANKS.rank]]
    who = (f"rank {', '.join(map(str, gone))} stopped (no heartbeat)" if gone
           else f"every rank still beats: rank {', '.join(map(str, behind)) or '?'} hangs")
    return f"{who}; " + "; ".join(f"rank {r} at {where}" for r, where in enumerate(at))


def lost_contact(message: str) -> None:
    """Another rank died or hangs: say so (which one, and where every rank was), and end this
    process now; its collectives could only wait. Every checkpoint already written is complete."""
    with suppress(Exception):  # the store itself may be gone (the launcher or rank 0's machine)
        message += f": {whereabouts()}"
    os.write(2, f"rank {RANKS.rank}: {message}; stopping. {RANKS.resume_hint}\n".encode())
    os._exit(1)


def start_watchdog(silence: float) -> None:
    """A heartbeat per rank in the store, and a thread that watches the others': a rank silent for `silence`
    seconds died (SIGKILL, a lost machine) or is stuck holding the interpreter (one that sleeps while others
    wait meets the collective timeout, dist_timeout). Beside torchrun's agent, which ends the other workers
    when one exits: measured without it on the CPU, a hung rank outlived the run by the agent's 30 s kill
    grace (49 s to the end, not 20 s, dist_timeout 4); with no worker exiting (a lost machine) only
    dist_timeout (default 1800 s) would end the run, not `silence` (30 s)."""
    me = RANKS.rank

    def watch():
        seen = {r: (None, time.monotonic()) for r in range(RANKS.world) if r != me}
        beat = 0
        while not RANKS.watchdog_off.is_set():
            beat += 1
            try:
                store_set(f"rlvr/beat/{me}", str(beat))
                for r, (last, since) in seen.items():
                    value = store_get(f"rlvr/beat/{r}")
                    if value != last:
                        seen[r] = (value, time.monotonic())
                    elif time.monotonic() - since > silence:
                        lost_contact(f"rank {r} stopped responding (no heartbeat for {silence:.0f} s: it died, or "
                                     "hangs holding the interpreter)")
            except Exception as e:
                if RANKS.watchdog_off.is_set():  # the store was torn down between the check and the call
                    return
                lost_contact(f"lost the process group's store ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
            time.sleep(1.0)

    threading.Thread(target=watch, name="rlvr-watchdog", daemon=True).start()


# ----------------------------------------------------------------------------------------------
# main

def main(argv: list[str] | None = None) -> int:
    code = run_main(sys.argv[1:] if argv is None else argv)
    if RANKS.world > 1:
        # Every file is written and closed and the ranks have met; skip the interpreter's teardown, in which gloo's
        # process group (still held by torch's DeviceMesh registry) went down once in CI with SIGABRT
        # ("terminate called without an active exception") after a run that had finished.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def run_main(argv: list[str]) -> int:
    od = None
    try:
        cfg = load_config(argv)
        if isinstance(cfg, Path):  # --plot FOLDER
            plot_run(cfg, required=True)
            return 0
        check_world(cfg)
        device = resolve_device(cfg)
        precision = resolve_precision(cfg, device)
        init_processes(cfg, device)
        od = shared_output_dir(cfg)
        eval_set = load_eval_problems(cfg)  # before the model loads: a missing field costs nothing
        if cfg.num_problems == 0:
            code = evaluate_only(cfg, device, precision, od, eval_set)
        else:
            code = run(cfg, device, precision, od, load_problems(cfg), argv, eval_set)
        end_processes(cleanly=True)
        return code
    except UserError as e:
        report_error(e)
        if RANKS.world == 1 and process_rank() != 0:
            time.sleep(3.0)  # torchrun, no process group yet: rank 0 says it; torchrun kills all once one exits
        return 2
    except KeyboardInterrupt:  # before training started (the signal handlers take over after that)
        if process_rank() == 0:
            print("interrupted while loading; output_dir was not changed", file=sys.stderr)
        return 130
    except RuntimeError as e:  # several processes: a collective that timed out or lost its peer
        if RANKS.world == 1:
            raise
        detail = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        lost_contact(f"waiting for the other ranks failed ({detail})")
    finally:
        if od is not None:
            release_output_dir(od)


def report_error(e: UserError) -> None:
    """One line on stderr: rank 0's; another rank's only if it is its own (not one every rank hit)."""
    if process_rank() == 0:
        print(f"error: {e}", file=sys.stderr)
    elif RANKS.world > 1 and not isinstance(e, SharedError):
        print(f"rank {RANKS.rank}: error: {e}", file=sys.stderr)


def shared_output_dir(cfg: Config) -> OutputDir:
    """Rank 0 locks output_dir and decides what happens to it; the others get its decision (never the folder)."""
    od = on_rank0(prepare_output_dir, cfg)
    return od if process_rank() == 0 else dataclasses.replace(od, lock_fd=-1, created=False)


def evaluate_only(cfg: Config, device: torch.device, precision: str, od: OutputDir, eval_set: list[dict]) -> int:
    """num_problems 0: evaluate `model` once, as it is (phase "model"). No optimizer, no training data,
    no training outputs: output_dir gets run_config.yaml, eval.jsonl and eval_summary.json."""
    model, tokenizer, eos_id, _, eval_set, decoders = start_model(cfg, device, precision, eval_set)
    with signals_caught():
        try:
            begin_output(od, cfg)  # an earlier evaluation (overwrite=true) goes now, not before the model loaded
            with verifier.TimedVerifier(timeout_s=cfg.verifier_timeout) as scorer:
                t0 = time.perf_counter()
                records = evaluate(model, tokenizer, eval_set, cfg, eos_id, scorer, autocast(device, precision),
                                   "model", None, decoders)
        except Interrupted:
            progress(f"stopped by {signal.Signals(STOP['signal']).name} during the evaluation; no result written")
            return stop_code()
        except StopRun as e:  # CUDA out of memory
            progress(f"{e}; no result written")
            return 1
    progress(eval_line("model", records, cfg.eval_samples, time.perf_counter() - t0))
    say(format_eval_table(write_eval_files(out=od.path, records=records, cfg=cfg)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
