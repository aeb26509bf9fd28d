"""credit.py: which tokens of a response earn its advantage, the credit methods' formulas (docs/variants.md, "Credit").

The spec gives every token of response i the same advantage A_i (credit: sequence): the trainer then calls nothing
here. The methods below give each token its own A_it. Like verifier.py, this file stands alone: it imports nothing
from train_rlvr.py. The trainer samples what a method needs (monte_carlo's continuations, the tree's branches, the
sampler's entropies) and hands its tokens, rewards and settings over as plain values.

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
top_entropy_quantile keeps the policy term on the group's highest-entropy tokens only (TRL's, 2506.01939).
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def weights(self, rows) -> list[torch.Tensor]:
        """The loss's A_it of the responses in rows: the token advantages times the entropy mask (float32)."""
        return [torch.tensor(self.token_advantages[i], dtype=torch.float32)
                * (1.0 if self.entropy_mask is None else torch.tensor(self.entropy_mask[i], dtype=torch.float32))
                for i in rows]

    def all_zero(self) -> bool:
        """Every A_it of the group is 0: its gradient is exactly 0 (a monte_carlo value can give a zero-variance
        group a signal, a tree's identical siblings can leave a group with variance none)."""
        return not any(any(a) for a in self.token_advantages)


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
                  None if masks is None else [m.int().tolist() for m in masks], generated)


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
