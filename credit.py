"""credit.py: which tokens of a response earn its advantage: the credit methods (docs/variants.md, "Credit").

The spec gives every token of response i the same advantage A_i (credit: sequence). The other methods give each
token its own A_it. Each method is a class below with everything that belongs to it: its settings' checks, its
formula, what it samples or checks (through the plain callables the trainer hands it, Tools), what it records per
step, its table column and its rollouts.jsonl fields. The trainer chooses one at the run's start (method) and
reaches it through its assign_credit; a new method is its class here, a line in METHODS and its Config keys
(docs/variants.md, "Adding a variant"). Like verifier.py, this file stands alone: it imports nothing from
train_rlvr.py.

credit=monte_carlo and credit=tree give each segment of a response its change of value, V(end of segment) - V(start),
a value being a mean reward: V at the response's start the group's mean, at its end its own reward, in between the
mean reward of credit_samples continuations sampled from that cut (monte_carlo) or of the tree's leaves under that
node (tree). credit_scale turns the changes into advantages (scale_changes):
  raw     A_it = dV                                    SPO-tree's (arXiv 2505.23564), credit=tree's default (auto)
  whiten  A_it = (dV - mean) / (std + std_eps)         over the group's trained tokens: VinePPO's (2410.01679),
                                                       credit=monte_carlo's default (auto)
  group   A_it = dV / (std(r) + std_eps)               the spec's scale: a response's changes add up to its A_i
                                                       (the values telescope); a zero-variance group gets 0
monte_carlo samples continuations in every group, a zero-variance one too (but with group, whose scale is 0 there):
an all-wrong group in which a response's first line was right has V > 0 after that line, which credits the line and
debits the one that went wrong after it, so its gradient is not 0 (credit=sequence keeps the spec's exactly-zero
one). tree: identical sibling nodes (the same tokens under one parent) are one node, whose value is over all the
leaves under it (no pair of opposite advantages on the same tokens); tree_weighting=leaf trains every leaf's whole
path with its changes, so a node's tokens weigh (its leaves) / G: the tree's unbiased estimator (depth 1 of 2,2,2:
1/2, depth 2: 1/4, a leaf 1/8); once trains a node's tokens in its first leaf alone (1/G whatever its depth).
credit=steps checks each line of a response (checked_step_advantages). top_entropy_quantile keeps the policy term on
the group's highest-entropy tokens only (TRL's, 2506.01939), with any method.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

import torch


@dataclass
class Credit:
    """Every token's advantage of a group (credit other than the spec's, or top_entropy_quantile < 1): for the loss
    (weights) and for rollouts.jsonl the group's segments, values, token advantages and entropy mask."""
    token_advantages: list[list[float]]   # per response of the group: A_it as the loss uses it, before the mask
    segments: list[list[int]]             # per response of the group: the token where each segment starts
    values: list[list[float]]             # per response of the group: V at each segment's start, then at its end
    entropy_mask: list[list[int]] | None  # per response of the group: 1 where the mask keeps the policy term
    generated: int                        # tokens sampled for the step: the group's, continuations and branches
    verdicts: list[list[bool | None]] | None = None  # credit=steps: per response, each line's (True/False/None)
    failed: int = 0                       # credit=steps: the responses whose check failed (their lines: None)
    per_token: bool = True                # rollouts.jsonl gets segments, values, token advantages (not the spec's)

    def weights(self, rows) -> list[torch.Tensor]:
        """The loss's A_it of the responses in rows: the token advantages times the entropy mask (float32)."""
        return [torch.tensor(self.token_advantages[i], dtype=torch.float32)
                * (1.0 if self.entropy_mask is None else torch.tensor(self.entropy_mask[i], dtype=torch.float32))
                for i in rows]

    def all_zero(self) -> bool:
        """Every A_it of the group is 0: its gradient is exactly 0 (a monte_carlo value can give a zero-variance
        group a signal, a tree's identical siblings can leave a group with variance none)."""
        return not any(any(a) for a in self.token_advantages)

    def rollout_fields(self, i: int) -> dict:
        """Response i's fields in rollouts.jsonl: its segments (steps: each line's first token), values (steps: the
        term each line adds) and token advantages; with steps each line's verdict; with the mask its entropy mask."""
        fields = dict(segments=self.segments[i], values=self.values[i],
                      token_advantages=self.token_advantages[i]) if self.per_token else {}
        if self.verdicts is not None:
            fields["line_verdicts"] = self.verdicts[i]
        if self.entropy_mask is not None:
            fields["entropy_mask"] = self.entropy_mask[i]
        return fields


@dataclass
class Tools:
    """What the trainer hands a method for one group: plain callables and values, nothing of the trainer's own.
    Streams are keyed: a key (e.g. ("tree", draw, *path)) names the random stream a continuation draws from, the same
    whichever process samples it."""
    pieces: Callable[[list[int]], list[str]]   # token ids -> each token's text
    text: Callable[[list[int]], str]           # token ids -> their text (special tokens dropped), as scored
    eos_id: int
    rows: range                                # this process's responses of the group (one process: all of them)
    share: Callable[[object], list]            # one value per process, in rank order (one process: [value])
    continue_prompt: Callable | None = None    # (prefixes, room, keys, entropies) -> continuations of prompt + each
    score: Callable | None = None              # (texts, ended) -> each text's reward (the rollouts' own)
    check_lines: Callable | None = None        # (lines, rollout) -> a verdict per line, or None: the check failed
    warn: Callable[[str, str], None] = lambda kind, message: None  # said once a run


# ----------------------------------------------------------------------------------------------
# The methods: the spec's, monte_carlo, tree, steps

@dataclass
class Sequence:
    """credit: sequence, the spec's: every token of response i earns A_i, and nothing here is called (assign: None),
    unless top_entropy_quantile < 1: TRL's entropy mask on the spec's credit."""
    name: ClassVar[str] = "sequence"
    columns: ClassVar[tuple] = ()    # the table's columns of its own: (name, width)
    checker: ClassVar = None         # the step checker the verifier's worker loads (steps)
    quantile: float = 1.0            # top_entropy_quantile

    @property
    def is_spec(self) -> bool:
        """The spec's credit: A_i on every token, nothing to assign (the trainer's assign_credit returns at once)."""
        return self.name == "sequence" and self.quantile >= 1

    @property
    def needs_entropies(self) -> bool:
        """Whether the sampler records each token's entropy (the entropy mask reads it)."""
        return self.quantile < 1

    def grow(self, prompt_ids: torch.Tensor, draw: int, tools: Tools) -> Tree | None:
        """The group sampled as this method needs it, or None: the trainer's rollouts, one per stream."""
        return None

    def assign(self, responses: list[torch.Tensor], group, advantages: torch.Tensor, tools: Tools) -> Credit | None:
        if self.quantile >= 1:
            return None
        starts, values = spec_values(group.rewards)
        return assign(self.name, "raw", group.rewards, group.zero_variance, advantages, group.tokens, starts, values,
                      None, 0.0, group.entropies, self.quantile, sum(group.tokens))

    def trial(self, answer: str, tools: Tools) -> None:
        """A first call of what the method calls at every step, before step 1 (the trainer's callables say a failure
        in one line)."""

    def figures(self, trained: list[Credit], aside: list[Credit]) -> dict:
        """The step's figures of its own (metrics.jsonl), from its groups' credits and those set aside (resample)."""
        return {}

    def cells(self, m: dict) -> list[str]:
        """Its columns' cells in the step's row."""
        return []


@dataclass
class Sampled(Sequence):
    """What monte_carlo and the tree share: segments of at most segment_tokens tokens, values turned into advantages
    by a scale, and the tokens they sample beyond the group's own (the table's `generated`)."""
    columns: ClassVar[tuple] = (("generated", 11),)
    segment_tokens: int = 32
    scale: str = "whiten"
    std_eps: float = 1e-4
    max_new_tokens: int = 512

    def figures(self, trained, aside):
        return {"generated_tokens": sum(c.generated for c in aside + trained)}  # continuations and branches too

    def cells(self, m):
        return [f"{m['generated_tokens']:>5d}"]


@dataclass
class MonteCarlo(Sampled):
    """credit: monte_carlo (VinePPO, SPO-chain): V at each cut of a response is the mean reward of `samples`
    continuations sampled from there (continuation_values)."""
    name: ClassVar[str] = "monte_carlo"
    samples: int = 4
    group_size: int = 8

    def assign(self, responses, group, advantages, tools):
        starts = [segment_starts(tools.pieces(r.tolist()), self.segment_tokens) for r in responses]
        flat = group.zero_variance and self.scale == "group"  # its scale is 0: no continuation can change it
        cuts, sampled = ([[] for _ in responses], 0) if flat else continuation_values(self, responses, starts,
                                                                                       group.draw, tools)
        shares = tools.share((starts, cuts, sampled))
        starts, cuts = [x for s in shares for x in s[0]], [x for s in shares for x in s[1]]
        return assign(self.name, self.scale, group.rewards, group.zero_variance, advantages, group.tokens, starts,
                      chain_values(starts, cuts, group.rewards), None, self.std_eps, group.entropies, self.quantile,
                      sum(group.tokens) + sum(s[2] for s in shares))


@dataclass
class TreeCredit(Sampled):
    """credit: tree (SPO-tree, TreeRPO): the group grown as a tree (grow_tree), a node's V the mean reward of the
    leaves under it (tree_values)."""
    name: ClassVar[str] = "tree"
    levels: tuple = (2, 2, 2)
    weighting: str = "leaf"
    scale: str = "raw"

    def grow(self, prompt_ids, draw, tools):
        tree = grow_tree(self, prompt_ids, draw, tools)
        tools.warn("tree copies", tree_copies_warning(self, tree))
        return tree

    def assign(self, responses, group, advantages, tools):
        starts, values, trained = tree_values(group.tree.leaves, group.tree.segments, group.rewards.tolist(),
                                              self.weighting)
        return assign(self.name, self.scale, group.rewards, group.zero_variance, advantages, group.tokens, starts,
                      values, trained, self.std_eps, group.entropies, self.quantile, group.tree.generated)


@dataclass
class Steps(Sequence):
    """credit: steps (checked steps): each line's verdict from the step checker (checked_lines), standardized within
    the group and added to A_i on the line's tokens (checked_step_advantages)."""
    name: ClassVar[str] = "steps"
    columns: ClassVar[tuple] = (("lines r/w/?", 13),)
    checker: object = "arithmetic"   # a built-in's name, or a checker of one's own as (absolute path, name)
    weight: float = 1.0
    mode: str = "add"
    std_eps: float = 1e-4

    def assign(self, responses, group, advantages, tools):
        token_line, verdicts, failed = checked_lines(responses, group, tools)
        return assign_steps(self.mode, advantages, token_line, verdicts, self.weight, self.std_eps, group.entropies,
                            self.quantile, sum(group.tokens), failed)

    def trial(self, answer, tools):
        tools.check_lines(["1 + 1 = 2", f"So the answer is \\boxed{{{answer}}}."], None)

    def figures(self, trained, aside):
        return line_figures(trained)

    def cells(self, m):
        return [f"{m['lines_right']}/{m['lines_wrong']}/{m['lines_unknown']}"]


METHODS = {m.name: m for m in (Sequence, MonteCarlo, TreeCredit, Steps)}


def method(cfg, checker: object = None):
    """The run's credit method, chosen once from its settings (cfg: the trainer's Config, read, not imported);
    checker: steps' step checker as the worker loads it (the trainer resolves a file's path)."""
    keys = dict(quantile=cfg.top_entropy_quantile)
    if cfg.credit in ("monte_carlo", "tree"):
        keys.update(segment_tokens=cfg.credit_segment_tokens, scale=scale_of(cfg.credit, cfg.credit_scale),
                    std_eps=cfg.std_eps, max_new_tokens=cfg.max_new_tokens)
    if cfg.credit == "monte_carlo":
        keys.update(samples=cfg.credit_samples, group_size=cfg.group_size)
    if cfg.credit == "tree":
        keys.update(levels=tuple(tree_levels(cfg.tree_branching)), weighting=cfg.tree_weighting)
    if cfg.credit == "steps":
        keys.update(checker=checker, weight=cfg.step_weight, mode=cfg.step_mode, std_eps=cfg.std_eps)
    return METHODS[cfg.credit](**keys)


# ----------------------------------------------------------------------------------------------
# Their settings: checked before the run, and said when they do nothing

STEP_MODES = ("add", "first_error")                                           # see checked_step_advantages
CREDIT_SCALES = ("auto", "raw", "group", "whiten")                            # see scale_changes
TREE_WEIGHTINGS = ("leaf", "once")                                            # see tree_values

# Settings that act only with a method: (key, whether it acts, the setting it needs).
ACTS_ONLY_WITH = [
    ("tree_branching", lambda c: c.credit == "tree", "credit=tree"),
    ("credit_samples", lambda c: c.credit == "monte_carlo", "credit=monte_carlo"),
    ("credit_segment_tokens", lambda c: c.credit in ("monte_carlo", "tree"), "credit=monte_carlo or credit=tree"),
    ("credit_scale", lambda c: c.credit in ("monte_carlo", "tree"), "credit=monte_carlo or credit=tree"),
    ("step_checker", lambda c: c.credit == "steps", "credit=steps"),
    ("step_mode", lambda c: c.credit == "steps", "credit=steps"),
    ("step_weight", lambda c: c.credit == "steps" and c.step_mode == "add", "credit=steps, step_mode=add"),
    ("tree_weighting", lambda c: c.credit == "tree", "credit=tree"),
]


def setting_checks(cfg, checkers: tuple[str, ...]) -> list[tuple[str, bool, str]]:
    """The credit settings' checks, as (key, whether its value is usable, what it must be); checkers: the built-in
    step checkers' names."""
    path, _, name = cfg.step_checker.rpartition(":")
    user = cfg.step_checker not in checkers
    return [
        ("credit", cfg.credit in METHODS, "one of " + ", ".join(METHODS)),
        ("problems_per_step", cfg.problems_per_step == 1 or cfg.credit != "tree",
         "1 with credit: tree (a tree grows one problem's group at a time; monte_carlo and sequence take several)"),
        ("credit_segment_tokens", 1 <= cfg.credit_segment_tokens <= 2**20, "an integer in [1, 1048576]"),
        ("credit_samples", 1 <= cfg.credit_samples <= 256, "an integer in [1, 256] (continuations at each cut)"),
        ("credit_scale", cfg.credit_scale in CREDIT_SCALES, "one of " + ", ".join(CREDIT_SCALES)),
        ("tree_weighting", cfg.tree_weighting in TREE_WEIGHTINGS, "one of " + ", ".join(TREE_WEIGHTINGS)),
        ("tree_branching", cfg.credit != "tree" or math.prod(tree_levels(cfg.tree_branching) or [0]) == cfg.group_size,
         f"integers >= 2 separated by commas whose product is group_size {cfg.group_size} (e.g. 2,2,2 for 8)"),
        ("top_entropy_quantile", 0 < cfg.top_entropy_quantile <= 1, "a number in (0, 1] (1: every token)"),
        ("step_checker", not user or (path.endswith(".py") and name.isidentifier()),
         f"{' or '.join(checkers)} (built in) or path/to/file.py:function_name (called as name(lines, record) -> a "
         "verdict per line: True, False or None)"),
        ("step_checker", not user or cfg.credit != "steps" or Path(path).expanduser().is_file(),
         f"an existing file: {path} is not one"),
        ("step_weight", math.isfinite(cfg.step_weight) and 0 <= cfg.step_weight <= 1e6,
         "a number in [0, 1e6] (0: the spec's credit)"),
        ("step_mode", cfg.step_mode in STEP_MODES, "one of " + ", ".join(STEP_MODES)),
    ]


def tree_levels(branching: str) -> list[int] | None:
    """tree_branching's branches per level ("2,2,2" -> [2, 2, 2]), None when it is not integers >= 2."""
    try:
        levels = [int(x) for x in branching.split(",")]
    except ValueError:
        return None
    return levels if levels and all(b >= 2 for b in levels) else None


# ----------------------------------------------------------------------------------------------
# The formulas: each token's advantage from its method's values

def assign(method: str, scale: str, rewards: torch.Tensor, zero_variance: bool, advantages: torch.Tensor,
           lengths: list[int], starts: list[list[int]], values: list[list[float]],
           trained: list[torch.Tensor] | None, std_eps: float, entropies: list[list[float]] | None,
           quantile: float, generated: int) -> Credit:
    """The group's Credit from its values along each response (tree_values, chain_values, spec_values): with the
    spec's credit (method sequence) every token keeps its response's A_i (advantages); otherwise each token gets its
    segment's change of value, scaled (scale: a credit_scale resolved by scale_of). entropies: the sampler's, per
    token, when quantile < 1 (entropy_masks)."""
    if method == "sequence":
        token_advantages = [advantages[i].expand(n).clone() for i, n in enumerate(lengths)]
    else:
        changes = [segment_changes(s, v, n) for s, v, n in zip(starts, values, lengths)]
        token_advantages = scale_changes(changes, trained, scale, rewards, zero_variance, std_eps)
    masks = entropy_masks(entropies, quantile)
    return Credit([a.tolist() for a in token_advantages], starts, values,
                  None if masks is None else [m.int().tolist() for m in masks], generated,
                  per_token=method != "sequence")  # the spec's credit with the mask: its mask alone is recorded


# ----------------------------------------------------------------------------------------------
# Segments: cut at a line end or a sentence end, else after credit_segment_tokens

def segment_starts(pieces: list[str], limit: int) -> list[int]:
    """The token index where each segment of a response starts (segment_end, from token 0 to its end)."""
    starts, k = [], 0
    while k < len(pieces):
        starts.append(k)
        k = segment_end(pieces, k, limit)
    return starts


def segment_end(pieces: list[str], start: int, limit: int, whole: bool = True) -> int:
    """Where a segment that starts at token `start` ends (exclusive), the pieces being the tokens' texts: after
    at most `limit` tokens, at the last line end or sentence end inside them (after a token holding a newline,
    or ending in . ! or ? with the next token opening with white space), else after `limit` tokens. whole: the
    pieces are the whole response, so a segment that reaches their end ends there."""
    end = min(start + limit, len(pieces))
    if whole and end == len(pieces):
        return end
    for k in range(end, start, -1):  # a cut after token k - 1
        piece, after = pieces[k - 1], pieces[k] if k < len(pieces) else " "
        if "\n" in piece or (piece.endswith((".", "!", "?")) and after[:1].isspace()):
            return k
    return end


# ----------------------------------------------------------------------------------------------
# Values along each response, their changes, and the changes as advantages

def spec_values(rewards: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
    """The spec's credit as values (the entropy mask alone): one segment per response, from the group's mean reward
    to its own."""
    return [[0]] * len(rewards), [[float(rewards.mean()), float(r)] for r in rewards]


def chain_values(starts: list[list[int]], cuts: list[list[float]], rewards: torch.Tensor) -> list[list[float]]:
    """monte_carlo: V along each response, the group's mean reward, then each cut's mean continuation reward (cuts;
    none sampled: the mean again), then its own reward."""
    mean = float(rewards.mean())
    return [[mean, *(c or [mean] * (len(st) - 1)), float(r)] for st, c, r in zip(starts, cuts, rewards)]


def tree_values(leaves: list[list[int]], segments: list[list[int]], rewards: list[float], weighting: str = "leaf"):
    """Each leaf's segment starts, values (the root's V is the group's mean reward, a node's the mean reward of the
    leaves under it) and, with weighting once, which of its tokens it trains (None: every one). A node is its
    tokens under its parent's node: identical siblings are one node, and so are a node that ended and its copies
    in the leaves under it. once: a node's tokens are trained by the first leaf under it alone."""
    paths = []  # per leaf: its node at each depth, the root () first; a node is the tuple of its segments' tokens
    for leaf, seg in zip(leaves, segments):
        path = [()]
        for begin, end in zip(seg, [*seg[1:], len(leaf)]):
            path.append((*path[-1], tuple(leaf[begin:end])))
        paths.append(path)
    under = {}  # node -> the rewards of the leaves under it
    for path, reward in zip(paths, rewards):
        for node in path:
            under.setdefault(node, []).append(reward)
    values = [[sum(under[n]) / len(under[n]) for n in path] for path in paths]
    if weighting == "leaf":
        return segments, values, None
    first = {}  # node -> the first leaf under it
    for i, path in enumerate(paths):
        for node in path:
            first.setdefault(node, i)
    trained = [torch.cat([torch.full((len(node[-1]),), float(first[node] == i)) for node in path[1:]])
               for i, path in enumerate(paths)]
    return segments, values, trained


def segment_changes(starts: list[int], values: list[float], length: int) -> torch.Tensor:
    """Each token's change of value: the segment's V(end) - V(start), for every token of the segment."""
    v = torch.tensor(values, dtype=torch.float32)
    return torch.repeat_interleave(v[1:] - v[:-1], torch.tensor(starts[1:] + [length]) - torch.tensor(starts))


def scale_of(method: str, credit_scale: str) -> str:
    """credit_scale, auto resolved to the method's paper's: raw for the tree (SPO-tree), whiten for monte_carlo
    (VinePPO)."""
    if credit_scale != "auto":
        return credit_scale
    return "raw" if method == "tree" else "whiten"


def scale_changes(changes: list[torch.Tensor], trained: list[torch.Tensor] | None, how: str, rewards: torch.Tensor,
                  zero_variance: bool, std_eps: float) -> list[torch.Tensor]:
    """The changes of value as advantages (how: raw, whiten or group, the formulas at the top). trained (the tree's
    once weighting): which tokens the loss trains; whitening counts those alone, and the others stay 0."""
    if how == "group":
        if zero_variance:
            return [torch.zeros_like(c) for c in changes]
        changes = [c / (rewards.std(unbiased=True) + std_eps) for c in changes]
    elif how == "whiten":
        every = torch.cat(changes if trained is None else [c[m.bool()] for c, m in zip(changes, trained)])
        spread = every.std(unbiased=True) if len(every) > 1 else every.new_zeros(())
        changes = [(c - every.mean()) / (spread + std_eps) for c in changes]
    return changes if trained is None else [c * m for c, m in zip(changes, trained)]


# ----------------------------------------------------------------------------------------------
# Checked steps (credit=steps): a verifiable task checks each line itself, at no cost in tokens

def token_lines(pieces: list[str]) -> list[int]:
    """The line of each token, the pieces being the tokens' texts: the line its first character is in, a line's
    closing newline belonging to it (so a token is in line k when the pieces before it hold k newlines)."""
    lines, k = [], 0
    for piece in pieces:
        lines.append(k)
        k += piece.count("\n")
    return lines


def line_starts(token_line: list[int], lines: int) -> list[int]:
    """The token where each of a response's `lines` lines starts (the segments rollouts.jsonl records, one per line
    as its values and verdicts are): the first token in that line or after it, so a line that holds no token of its
    own (a token "\n\n" closes two) starts where the next one does, and a last line with no token (the text after
    a final newline) at the response's end."""
    starts, t = [], 0
    for k in range(lines):
        while t < len(token_line) and token_line[t] < k:
            t += 1
        starts.append(t)
    return starts


def step_terms(verdicts: list[list[bool | None]], std_eps: float) -> list[list[float]]:
    """credit=steps (step_mode add): per response and line k, the step's own advantage before step_weight. Among the
    group's responses whose checked lines before k are all right and whose line k has a verdict, the verdicts (1
    right, 0 wrong) are standardized as the spec standardizes rewards, (v - mean) / (sample std + std_eps); one
    response or equal verdicts: 0, as a zero-variance group's. An unknown line (None), and every line after a
    response's first wrong one, get 0. So a group whose responses all end wrong but differ at line k has a gradient
    on line k: the right line up, the wrong one down (the spec's credit has none there)."""
    terms = [[0.0] * len(v) for v in verdicts]
    for k in range(max(map(len, verdicts), default=0)):
        who = [i for i, v in enumerate(verdicts) if k < len(v) and v[k] is not None and False not in v[:k]]
        v = torch.tensor([float(verdicts[i][k]) for i in who], dtype=torch.float32)
        if len(who) < 2 or bool((v == v[0]).all()):
            continue
        z = (v - v.mean()) / (v.std(unbiased=True) + std_eps)
        for i, x in zip(who, z.tolist()):
            terms[i][k] = x
    return terms


def first_wrong_line(verdicts: list[bool | None]) -> int | None:
    """The index of a response's first line the checker found wrong (None: no wrong line)."""
    return next((k for k, v in enumerate(verdicts) if v is False), None)


def checked_step_advantages(mode: str, advantages: torch.Tensor, token_line: list[list[int]],
                            verdicts: list[list[bool | None]], step_weight: float, std_eps: float
                            ) -> tuple[list[torch.Tensor], list[list[float]]]:
    """Each token's advantage from its line's verdicts, and per response the term each line adds (recorded):
      add (default)   A_it = A_i + step_weight * z_ik, z_ik line k's standardized verdict (step_terms); the first
                      credit from checked steps that needs neither a learned reward model (PRIME, 2502.01456) nor
                      sampled values (VinePPO, SPO): the verdicts are exact
      first_error     A_it = A_i, except in a response with A_i < 0 and a line found wrong: its lines before the
                      first wrong one (the verified prefix) get 0, not A_i; the penalty starts at the error.
                      VPPO's split (2601.18984: a wrong response's verified prefix rewarded, the penalty only from
                      the first error on), here with the group's own A_i and no reward of its own for the prefix
    Every token of a response is in a line (token_lines), its EOS included."""
    if mode == "first_error":
        terms, out = [[0.0] * len(v) for v in verdicts], []
        for i, (lines, v) in enumerate(zip(token_line, verdicts)):
            first, a = first_wrong_line(v), advantages[i].expand(len(lines)).clone()
            if first is not None and float(advantages[i]) < 0:
                a[torch.tensor(lines) < first] = 0.0
                terms[i][:first] = [-float(advantages[i])] * first
            out.append(a)
        return out, terms
    terms = [[step_weight * x for x in t] for t in step_terms(verdicts, std_eps)]
    out = [advantages[i].expand(len(lines)) + torch.tensor([t[k] if k < len(t) else 0.0 for k in lines],
                                                           dtype=torch.float32)
           for i, (lines, t) in enumerate(zip(token_line, terms))]
    return out, terms


def assign_steps(mode: str, advantages: torch.Tensor, token_line: list[list[int]],
                 verdicts: list[list[bool | None]], step_weight: float, std_eps: float,
                 entropies: list[list[float]] | None, quantile: float, generated: int, failed: int = 0) -> Credit:
    """The group's Credit with credit=steps: the token advantages of checked_step_advantages, each response's line
    starts as its segments, each line's added term as its values, the verdicts kept for rollouts.jsonl."""
    token_advantages, terms = checked_step_advantages(mode, advantages, token_line, verdicts, step_weight, std_eps)
    masks = entropy_masks(entropies, quantile)
    starts = [line_starts(t, len(v)) for t, v in zip(token_line, verdicts)]
    return Credit([a.tolist() for a in token_advantages], starts, terms,
                  None if masks is None else [m.int().tolist() for m in masks], generated, verdicts, failed)


# ----------------------------------------------------------------------------------------------
# What monte_carlo and the tree sample, through the trainer's sampler (Tools.continue_prompt)

def continuation_values(m: MonteCarlo, responses: list[torch.Tensor], starts: list[list[int]], draw: int,
                        tools: Tools) -> tuple[list[list[float]], int]:
    """monte_carlo (VinePPO, SPO-chain): V at each cut of this process's responses (their segment starts after the
    first), the mean reward of m.samples continuations of prompt + the response up to the cut (the run's sampler,
    the prompt's pass once), scored as the rollouts are (the verifier, plus format_reward's bonus), each from its own
    stream ("continuation", draw, rollout, cut, sample), group_size x samples of them a batch. Returns the values per
    response and the tokens sampled."""
    rows = [(j, c, k) for j, st in enumerate(starts) for c in range(1, len(st)) for k in range(m.samples)]
    values, sampled = [[0.0] * (len(st) - 1) for st in starts], 0
    for begin in range(0, len(rows), m.group_size * m.samples):
        batch = rows[begin:begin + m.group_size * m.samples]
        prefixes = [responses[j][:starts[j][c]] for j, c, _ in batch]
        rooms = [m.max_new_tokens - len(p) for p in prefixes]
        outs = tools.continue_prompt(prefixes, max(rooms), [("continuation", draw, tools.rows[j], c, k)
                                                            for j, c, k in batch], None)
        outs = [o[:room] for o, room in zip(outs, rooms)]
        sampled += sum(len(o) for o in outs)
        ended = [len(o) > 0 and int(o[-1]) == tools.eos_id for o in outs]
        rewards = tools.score([tools.text(torch.cat([p, o]).tolist()) for p, o in zip(prefixes, outs)], ended)
        for (j, c, _), reward in zip(batch, rewards):
            values[j][c - 1] += reward / m.samples
    return values, sampled


@dataclass
class Tree:
    """credit=tree: the group sampled as a tree. Leaf i (rollout i, in order) is the path of child indices
    leaf_paths(levels)[i]; its response is the segments of the nodes along that path, segment k (starting at
    token segments[i][k]) the node at depth k. A node that ended (EOS or max_new_tokens) has no more segments:
    the leaves under it are copies of it."""
    leaves: list[list[int]]      # each leaf's response tokens
    cut: list[bool]              # each leaf cut at max_new_tokens (no EOS)
    segments: list[list[int]]    # each leaf's segment starts
    generated: int               # tokens sampled for the tree, those cut off at a segment's end included
    entropies: list[list[float]] | None = None  # each leaf token's entropy from the sampler (top_entropy_quantile)


def leaf_paths(levels) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(b) for b in levels)))


def grow_tree(m: TreeCredit, prompt_ids: torch.Tensor, draw: int, tools: Tools) -> Tree:
    """credit=tree (SPO-tree, TreeRPO): the group's rollouts as a tree that branches m.levels[k] ways at depth k.
    Every node is one segment, sampled from prompt + its parent's tokens with the run's sampler and its own
    stream ("tree", draw, path): at most segment_tokens tokens, cut at the last line or sentence end in them
    (segment_end; the rest is dropped), except at the last depth, which runs to EOS or max_new_tokens. One batched
    call per depth (the prompt's pass once for the whole tree)."""
    nodes = {(): (prompt_ids.new_empty(0), False)}  # path -> (the tokens from the response's start, ended)
    entropy = {(): []}  # path -> the entropies of its tokens (needs_entropies)
    starts, frontier, generated = {}, [()], 0
    for depth, branches in enumerate(m.levels):
        last = depth == len(m.levels) - 1
        children = [path + (c,) for path in frontier for c in range(branches)]
        live = [p for p in children if not nodes[p[:-1]][1]]
        rooms = [m.max_new_tokens - len(nodes[p[:-1]][0]) for p in live]
        outs, ents = [], [] if m.needs_entropies else None
        if live:
            longest = max(rooms) if last else min(m.segment_tokens, max(rooms))
            outs = tools.continue_prompt([nodes[p[:-1]][0] for p in live], longest, [("tree", draw, *p) for p in live],
                                         ents)
        sampled = dict(zip(live, zip(outs, rooms, ents or [[]] * len(outs))))
        for p in children:
            tokens, ended = nodes[p[:-1]]
            starts[p], entropy[p] = len(tokens), entropy[p[:-1]]
            if not ended:
                out, room, ent = sampled[p]
                generated += len(out)
                out = out[:room]
                stopped = len(out) > 0 and int(out[-1]) == tools.eos_id
                if not last and not stopped:
                    out = out[:segment_end(tools.pieces(out.tolist()), 0, m.segment_tokens, whole=False)]
                tokens, entropy[p] = torch.cat([tokens, out]), entropy[p] + ent[:len(out)]
                ended = last or stopped or len(tokens) >= m.max_new_tokens
            nodes[p] = (tokens, ended)
        frontier = children
    leaves = [nodes[p][0] for p in frontier]
    segments = [[starts[p[:k + 1]] for k in range(len(p)) if starts[p[:k + 1]] < len(nodes[p][0])] for p in frontier]
    return Tree([r.tolist() for r in leaves], [not (len(r) and int(r[-1]) == tools.eos_id) for r in leaves], segments,
                generated, [entropy[p] for p in frontier] if m.needs_entropies else None)


def tree_copies_warning(m: TreeCredit, tree: Tree) -> str | None:
    """What a tree whose responses end before its last level says (once a run): on a task of one-line answers (one
    segment) the 2,2,2 tree is 2 samples copied 4 times, and learns from far less. It names the cause its numbers
    show: responses that ended with EOS, or that reached max_new_tokens. None: every leaf its own response."""
    distinct = {path[:len(seg)]: i for i, (path, seg) in enumerate(zip(leaf_paths(m.levels), tree.segments))}
    if len(distinct) == len(tree.leaves):
        return None
    short = [i for path, i in distinct.items() if len(path) < len(m.levels)]
    cut = [i for i in short if tree.cut[i]]
    causes = []
    if len(cut) < len(short):
        shorter = "lower credit_segment_tokens, use fewer levels" if m.segment_tokens > 1 else "use fewer levels"
        causes.append(f"{len(short) - len(cut)} ended with EOS after at most "
                      f"{max(len(tree.leaves[i]) for i in short if not tree.cut[i])} tokens ({shorter}, or "
                      "credit=sequence)")
    if cut:
        causes.append(f"{len(cut)} reached max_new_tokens={m.max_new_tokens} (raise max_new_tokens, or use fewer "
                      "levels)")
    return (f"credit=tree: the group holds {len(distinct)} distinct responses of {len(tree.leaves)}: of the responses "
            f"that ended before the tree's last level ({len(m.levels)} levels of at most credit_segment_tokens="
            f"{m.segment_tokens} tokens), whose copies fill the other leaves, {' and '.join(causes)} (said once a run)")


# ----------------------------------------------------------------------------------------------
# What steps checks, through the verifier's worker (Tools.check_lines)

def checked_lines(responses: list[torch.Tensor], group, tools: Tools
                  ) -> tuple[list[list[int]], list[list[bool | None]], int]:
    """credit=steps: each response's token lines (token_lines: the line a token's first character is in) and the
    step checker's verdict for every line of its text (True, False or None), from this process's responses, shared
    with every process; and how many responses' checks failed (their lines unknown). A response's lines are its
    text split at "\\n" alone, as token_lines counts them (str.splitlines would also split at "\\r" or "\\u2028").
    The last line of a response cut at max_new_tokens was never finished: it is not checked, and unknown."""
    token_line = [token_lines(tools.pieces(r.tolist())) for r in responses]
    checked, failed = [], 0
    for i in tools.rows:
        lines = group.texts[i].split("\n")
        finished = lines[:-1] if group.cut[i] else lines
        verdicts = tools.check_lines(finished, i)
        if verdicts is None:
            failed += 1
            verdicts = [None] * len(finished)
        checked.append(verdicts + [None] * (len(lines) - len(finished)))
    shares = tools.share((token_line, checked, failed))
    return [x for s in shares for x in s[0]], [x for s in shares for x in s[1]], sum(s[2] for s in shares)


def line_figures(credits: list[Credit]) -> dict:
    """credit=steps: the step's lines the checker found right, wrong or could not check (unknown), the lines
    checked (right + wrong), the share of responses with no checked line (a policy that learns to write no
    checkable line games the checker: this shows it) and the responses whose check failed."""
    verdicts = [v for c in credits for v in c.verdicts]
    right, wrong = (sum(line is x for v in verdicts for line in v) for x in (True, False))
    every = sum(len(v) for v in verdicts)
    return dict(lines_checked=right + wrong, lines_right=right, lines_wrong=wrong, lines_unknown=every - right - wrong,
                responses_unchecked=sum(all(line is None for line in v) for v in verdicts) / len(verdicts),
                step_checker_failures=sum(c.failed for c in credits))


# ----------------------------------------------------------------------------------------------
# The entropy mask

def entropy_masks(entropies: list[list[float]] | None, q: float) -> list[torch.Tensor] | None:
    """top_entropy_quantile q < 1: per token of the group's responses, whether the policy's entropy there is at
    least the group's (1 - q) quantile (torch.quantile over every response token of the group, TRL's rule). The
    entropy is of the distribution the loss trains (no temperature), from the logits the sampler drew each token
    from (the trainer's decode records them: no forward more)."""
    if q >= 1:
        return None
    tensors = [torch.tensor(e, dtype=torch.float32) for e in entropies]
    threshold = torch.quantile(torch.cat(tensors), 1 - q)
    return [(e >= threshold).float() for e in tensors]
