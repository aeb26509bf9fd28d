"""Finer credit than one advantage per response (credit = monte_carlo or tree, top_entropy_quantile): worked
numbers for segments, values and token advantages, the entropy mask, the settings' checks, and runs through
main() and torchrun. The spec's run is unchanged by all of it (tests/test_variants.py's fixture)."""

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch

import rlvr_driver
import credit as C
import train_rlvr as T
from conftest import ROOT
from run_helpers import main_args, one_line_error


class _Trainer(SimpleNamespace):
    """A trainer's stand-in whose credit method is chosen from its settings as they are now (credit.method)."""
    @property
    def credit_method(self):
        return C.method(self.cfg, self.cfg.step_checker)


def _trainer(**settings):
    cfg = T.Config(device="cpu", **settings)
    tok = SimpleNamespace(decode=lambda ids, **kw: "".join(f"<{i}>" for i in ids))
    return _Trainer(cfg=cfg, tokenizer=tok, device=torch.device("cpu"), precision="fp32", model=None, scorer=None,
                    eos_id=0, decoders=T.Decoders(), warned=set())


def _grow(model, tok, prompt, cfg, eos_id, draw, share_prompt=True):
    """The tree of credit=tree as a run grows it: credit.grow_tree with the trainer's tools (its sampler)."""
    t = _Trainer(cfg=cfg, tokenizer=tok, device=torch.device("cpu"), precision="fp32", model=model, scorer=None,
                 eos_id=eos_id, decoders=T.Decoders(), warned=set())
    return C.grow_tree(t.credit_method, prompt, draw, T.credit_tools(1, prompt, {}, draw, t, share_prompt))


def _continuations(prompt, responses, starts, draw, problem, rows, t, share_prompt=True):
    """monte_carlo's continuation values of the responses in `rows`, as a run samples them."""
    tools = dataclasses.replace(T.credit_tools(1, prompt, problem, draw, t, share_prompt), rows=rows)
    return C.continuation_values(t.credit_method, responses, starts, draw, tools)


def _warn_copies(step, tree, t):
    T.credit_tools(step, None, {}, 0, t).warn("tree copies", C.tree_copies_warning(t.credit_method, tree))


def _group(rewards, tokens, tree=None, draw=3):
    r = torch.tensor(rewards, dtype=torch.float32)
    return T.Group(["x"] * len(rewards), [T.Score(x, None, "wrong") for x in rewards], tokens, [False] * len(rewards), r,
                   T.equal_rewards(r), draw, tree)


# ----------------------------------------------------------------------------------------------
# Segments: cut at a line end or a sentence end, else after credit_segment_tokens


def test_segments_end_at_the_last_line_or_sentence_end_within_the_limit():
    pieces = ["41", " +", " 6", " =", " 47", "\n", "47", " +", " 8", " =", " 55", "\n", "So", " it", ".", " Done", "."]
    assert C.segment_starts(pieces, 32) == [0]  # the whole response fits one segment
    assert C.segment_starts(pieces, 8) == [0, 6, 12]  # after each "\n"; "." then " Done" is a sentence end too
    assert C.segment_starts(pieces, 4) == [0, 4, 6, 10, 12, 15]  # no line end in 0-3: a hard cut at 4
    assert C.segment_end(["3", ".", "5", " x"], 0, 4, whole=False) == 4  # "3.5": no white space after the "."
    assert C.segment_end(["a", ".", " b", "c", "d"], 0, 4, whole=False) == 2
    assert C.segment_end(["a", "b"], 0, 8) == 2
    # two line ends within the limit: the cut is after the last of them (token 3), not the first (token 1)
    assert C.segment_starts(["a", "\n", "b", "\n", "c", "d"], 4) == [0, 4]


# ----------------------------------------------------------------------------------------------
# Tree: node values, each token's advantage, shared tokens trained once


def _tree():
    # levels 2, 2: leaves (0,0) (0,1) (1,0) (1,1); node (0,) is tokens 0-2 of leaves 0 and 1, node (1,) tokens 0-1
    # of leaves 2 and 3; node (1,) ended at EOS, so leaves 2 and 3 are its copies (one segment each)
    leaves = [[5, 6, 7, 8, 0], [5, 6, 7, 9, 9, 0], [4, 0], [4, 0]]
    return C.Tree(leaves, [False] * 4, [[0, 3], [0, 3], [0], [0]], generated=11)


def test_a_hand_built_tree_gives_its_node_values_and_trains_a_shared_token_once():
    """Rewards 1, 0, 0, 0: V(root) = 0.25, V(0) = 0.5, V(1) = 0, the leaves their rewards. Segment advantages
    are changes of value over the group's std + eps (0.5 + 1e-4): node (0,) +0.25 / 0.5001 = 0.49990, leaf 0's
    own segment +0.5 / 0.5001 = 0.99980, leaf 1's -0.99980, node (1,) -0.49990. The shared node (0,) is trained
    by leaf 0 alone (0 in leaf 1), node (1,) by leaf 2 alone (0 in its copy, leaf 3): tree_weighting once, and
    credit_scale group (the earlier definition of the tree)."""
    t = _trainer(group_size=4, credit="tree", tree_branching="2,2", tree_weighting="once", credit_scale="group")
    tree = _tree()
    starts, values, trained = C.tree_values(tree.leaves, tree.segments, [1.0, 0.0, 0.0, 0.0], "once")
    assert values == [[0.25, 0.5, 1.0], [0.25, 0.5, 0.0], [0.25, 0.0], [0.25, 0.0]]
    assert [m.tolist() for m in trained] == [[1] * 5, [0, 0, 0, 1, 1, 1], [1, 1], [0, 0]]
    group = _group([1.0, 0.0, 0.0, 0.0], [5, 6, 2, 2], tree)
    adv = T.compute_advantages(group.rewards, 1e-4, zero_variance=False)
    credit = T.assign_credit(1, torch.tensor([1, 2]), [torch.tensor(x) for x in tree.leaves], group, adv, {"answer": "1"}, t)
    a, b = 0.25 / 0.5001, 0.5 / 0.5001
    expected = [[a, a, a, b, b], [0, 0, 0, -b, -b, -b], [-a, -a], [0, 0]]
    for got, want in zip(credit.token_advantages, expected):
        assert got == pytest.approx(want, abs=1e-6)
    assert credit.generated == 11 and credit.segments == tree.segments
    # each shared token's advantage counted once: the group's tokens, weighted once each, add up to the nodes'
    assert sum(x for w in credit.weights(range(4)) for x in w.tolist()) == pytest.approx(3 * a + 2 * b - 3 * b - 2 * a)


def test_a_hand_built_trees_token_advantages_are_the_raw_changes_of_value_by_default():
    """credit_scale auto is SPO-tree's raw V(child) - V(parent) for the tree: the same tree, rewards 1, 0, 0, 0,
    node (0,) 0.5 - 0.25 = +0.25, leaf 0's own segment 1 - 0.5 = +0.5, leaf 1's 0 - 0.5 = -0.5, node (1,)
    0 - 0.25 = -0.25 (not 0.4999 / 0.9998, which divide by the group's std 0.5 + 1e-4). With the default
    tree_weighting leaf every leaf trains its whole path: leaf 1 its node (0,) too, leaf 3 (a copy) node (1,)."""
    t = _trainer(group_size=4, credit="tree", tree_branching="2,2", tree_weighting="once")
    tree = _tree()
    group = _group([1.0, 0.0, 0.0, 0.0], [5, 6, 2, 2], tree)
    adv = T.compute_advantages(group.rewards, 1e-4, zero_variance=False)
    credit = T.assign_credit(1, torch.tensor([1, 2]), [torch.tensor(x) for x in tree.leaves], group, adv, {"answer": "1"}, t)
    assert credit.token_advantages == [[0.25, 0.25, 0.25, 0.5, 0.5], [0, 0, 0, -0.5, -0.5, -0.5], [-0.25, -0.25],
                                       [0, 0]]
    t.cfg.tree_weighting = "leaf"
    credit = T.assign_credit(1, torch.tensor([1, 2]), [torch.tensor(x) for x in tree.leaves], group, adv, {"answer": "1"}, t)
    assert credit.token_advantages == [[0.25, 0.25, 0.25, 0.5, 0.5], [0.25, 0.25, 0.25, -0.5, -0.5, -0.5],
                                       [-0.25, -0.25], [-0.25, -0.25]]


def _tree_222(first_level=((10,), (20,))):
    """A 2,2,2 tree of one token a segment: leaf (a, b, c) is [first_level[a], 30 + 10 a + b, 100 + 4 a + 2 b + c]
    + EOS, its segments [0, 1, 2]."""
    leaves = [[*first_level[a], 30 + 10 * a + b, 100 + 4 * a + 2 * b + c, 0] for a, b, c in C.leaf_paths([2, 2, 2])]
    return C.Tree(leaves, [False] * 8, [[0, len(first_level[0]), len(first_level[0]) + 1]] * 8, generated=20)


def test_per_leaf_weighting_gives_each_depths_node_its_share_of_the_leaves():
    """The 2,2,2 tree, rewards 1 then seven 0s, raw changes: V(root) 1/8, V(0) 1/4, V(0,0) 1/2, leaf 0 1. Summed
    over the leaves (each term / G = 8), the tokens of node (0,) weigh 4/8 = 1/2 of its advantage 0.125, node
    (0,0) 2/8 = 1/4 of its 0.25, leaf 0's own 1/8 of its 0.5: the tree's unbiased estimator. Once, each weighs
    1/8 whatever its depth."""
    t = _trainer(group_size=8, credit="tree", tree_branching="2,2,2")
    tree = _tree_222()
    group = _group([1.0] + [0.0] * 7, [4] * 8, tree)
    adv = T.compute_advantages(group.rewards, 1e-4, zero_variance=False)

    def weight(credit, token):  # a token's weight in the gradient: its advantages over the leaves, / G
        return sum(a for leaf, advs in zip(tree.leaves, credit.token_advantages)
                   for x, a in zip(leaf, advs) if x == token) / 8
    credit = T.assign_credit(1, torch.tensor([1]), [torch.tensor(x) for x in tree.leaves], group, adv, {"answer": "1"}, t)
    assert credit.values[0] == [0.125, 0.25, 0.5, 1.0]
    assert [weight(credit, x) for x in (10, 30, 100)] == [0.125 / 2, 0.25 / 4, 0.5 / 8]
    t.cfg.tree_weighting = "once"
    credit = T.assign_credit(1, torch.tensor([1]), [torch.tensor(x) for x in tree.leaves], group, adv, {"answer": "1"}, t)
    assert [weight(credit, x) for x in (10, 30, 100)] == [0.125 / 8, 0.25 / 8, 0.5 / 8]
    # whitened with once: mean and std over the trained tokens alone (2 + 4 nodes of one token, 8 leaves' own
    # segments of two: the token and EOS), the others stay 0
    t.cfg.credit_scale = "whiten"
    credit = T.assign_credit(1, torch.tensor([1]), [torch.tensor(x) for x in tree.leaves], group, adv, {"answer": "1"}, t)
    nodes = [0.125, -0.125] + [0.25, -0.25, 0.0, 0.0] + [0.5, 0.5, -0.5, -0.5] + [0.0] * 12  # raw changes
    mean, std = sum(nodes) / 22, torch.tensor(nodes).std().item()
    assert credit.token_advantages[0][:3] == pytest.approx([(x - mean) / (std + 1e-4) for x in (0.125, 0.25, 0.5)])
    assert credit.token_advantages[1][:2] == [0.0, 0.0]  # leaf 1 shares nodes (0,) and (0, 0) with leaf 0


def test_identical_siblings_are_one_node_with_the_value_of_all_their_leaves():
    """Both first-level nodes sampled [10]: one node, V = the mean of all 8 leaves = V(root), advantage 0 (not
    +0.125 in four leaves and -0.125 in the other four on the same tokens); its four children are compared with
    it: V(0,0) = 1/2 - 1/8. Rewards 1 then seven 0s, raw, per leaf."""
    t = _trainer(group_size=8, credit="tree", tree_branching="2,2,2")
    tree = _tree_222(first_level=((10,), (10,)))
    group = _group([1.0] + [0.0] * 7, [4] * 8, tree)
    adv = T.compute_advantages(group.rewards, 1e-4, zero_variance=False)
    credit = T.assign_credit(1, torch.tensor([1]), [torch.tensor(x) for x in tree.leaves], group, adv, {"answer": "1"}, t)
    assert credit.values[0] == [0.125, 0.125, 0.5, 1.0] and credit.values[4] == [0.125, 0.125, 0.0, 0.0]
    assert credit.token_advantages[0] == [0.0, 0.375, 0.5, 0.5] and credit.token_advantages[4] == [0.0, -0.125, 0, 0]
    # docs/variants.md's tuned-tree runs kept siblings apart: the page says the tree merges them now
    page = " ".join((ROOT / "docs" / "variants.md").read_text().split())
    assert "rlvr's tree now merges identical siblings (`tree_values`" in page and "and does not: left" not in page


def test_a_tree_whose_responses_end_before_its_last_level_says_how_many_are_copies(capsys):
    """_tree's node (1,) ended at EOS in the first level: leaves 2 and 3 are one response, 3 distinct of 4, said
    once a run; a tree whose every leaf reaches the last level says nothing."""
    t = _trainer(group_size=4, credit="tree", tree_branching="2,2", credit_segment_tokens=3)
    t.warned = set()
    whole = C.Tree([[5, 6, 7, 8, 0], [5, 6, 7, 9, 0], [4, 3, 2, 1, 0], [4, 3, 2, 2, 0]], [False] * 4, [[0, 3]] * 4, 10)
    _warn_copies(1, whole, t)
    assert capsys.readouterr().err == ""
    _warn_copies(2, _tree(), t)
    _warn_copies(3, _tree(), t)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: step 2: credit=tree: the group holds 3 distinct responses of 4: of the responses that "
                   "ended before the tree's last level (2 levels of at most credit_segment_tokens=3 tokens), whose "
                   "copies fill the other leaves, 1 ended with EOS after at most 2 tokens (lower "
                   "credit_segment_tokens, use fewer levels, or credit=sequence) (said once a run)"]


def test_the_tree_copies_warning_names_max_new_tokens_where_the_responses_reached_it(capsys):
    """Segments of 1 token and max_new_tokens 2 in a 2,2,2 tree: every leaf is cut at the limit after the second
    level, 4 distinct of 8; the cause is max_new_tokens (lowering credit_segment_tokens cannot help at 1)."""
    t = _trainer(group_size=8, credit="tree", tree_branching="2,2,2", credit_segment_tokens=1, max_new_tokens=2)
    t.warned = set()
    leaves = [[5, 6], [5, 6], [5, 7], [5, 7], [4, 6], [4, 6], [4, 8], [4, 8]]
    _warn_copies(1, C.Tree(leaves, [True] * 8, [[0, 1]] * 8, 6), t)
    err = capsys.readouterr().err
    assert "the group holds 4 distinct responses of 8" in err
    assert ("whose copies fill the other leaves, 4 reached max_new_tokens=2 (raise max_new_tokens, or use fewer "
            "levels) (said once a run)") in err
    assert "credit_segment_tokens," not in err
    # at 1 token a segment, responses that ended with EOS: fewer levels, not shorter segments
    t.warned = set()
    _warn_copies(1, C.Tree([[5, 0]] * 4 + [[4, 0]] * 4, [False] * 8, [[0, 1]] * 8, 4), t)
    assert ("whose copies fill the other leaves, 4 ended with EOS after at most 2 tokens (use fewer levels, or "
            "credit=sequence) (said once a run)") in capsys.readouterr().err


def test_a_setting_its_method_ignores_is_said_once(capsys):
    """tree_branching without credit=tree, credit_samples with the tree, resample_limit without resampling, the
    clip with one epoch: each changed from its default where it does nothing is a warning; at its default,
    nothing is said."""
    config = ["--config", str(ROOT / "config.yaml")]
    T.load_config([*config, "tree_branching=3,3", "credit_samples=9", "resample_limit=4", "clip_eps=0.3"])
    assert capsys.readouterr().err.splitlines() == [
        "warning: tree_branching=3,3 is ignored: it acts only with credit=tree",
        "warning: credit_samples=9 is ignored: it acts only with credit=monte_carlo",
        "warning: resample_limit=4 is ignored: it acts only with zero_variance=resample",
        "warning: clip_eps=0.3 is ignored: it acts only with ppo_epochs > 1 (one epoch's ratio is 1)"]
    T.load_config([*config, "credit=tree", "credit_samples=9", "credit_segment_tokens=4"])
    assert capsys.readouterr().err.splitlines() == [
        "warning: credit_samples=9 is ignored: it acts only with credit=monte_carlo"]
    T.load_config([*config, "credit=monte_carlo", "credit_samples=9", "ppo_epochs=2", "clip_eps=0.3"])
    assert capsys.readouterr().err == ""


def test_the_summary_counts_the_tokens_sampled_not_the_leaves_shared_prefixes_again():
    """A tree step whose 8 leaves hold 56 tokens but whose branches sampled 44 (the generated column): the summary
    says generation 44 tokens, over the generation and credit phases' 2.2 s (20.0 tokens/s); a step without
    credit counts its response tokens over its generation seconds."""
    m = dict(step=1, group_size=8, correct=1, reward_mean=0.125, reward_std=0.35, response_tokens=56, cut_at_limit=0,
             no_answer=0, verifier_timeouts=0, verifier_crashes=0, policy_loss=-0.5, grad_norm=2.0,
             update_norm=0.1, skipped=False, seconds=3.0, timings={"generation": 2.0, "credit": 0.2},
             generated_tokens=44)
    assert "generation 44 tokens at 20.0 tokens/s" in T.format_summary([m], 3.0)
    spec = {k: v for k, v in m.items() if k != "generated_tokens"}
    assert "generation 56 tokens at 28.0 tokens/s" in T.format_summary([spec], 3.0)


def test_a_groups_continuations_count_among_the_steps_generated_tokens_when_it_is_set_aside():
    """zero_variance=resample with monte_carlo: a group is set aside only after its continuations told that it has no
    signal, so they were sampled: the step's generated tokens are its credit's (40: 24 response tokens and 16 of
    continuations) plus the trained group's (30)."""
    cfg = T.Config(group_size=2, credit="monte_carlo", zero_variance="resample")

    def slot(index, tokens, generated, silent):
        r = torch.tensor([0.0, 0.0] if silent else [1.0, 0.0])
        group = T.Group(["a", "b"], [T.Score(float(x), None, "wrong") for x in r], tokens, [False, False], r, silent)
        c = C.Credit([[0.0] * n for n in tokens], [[0], [0]], [[0.0, 0.0]] * 2, None, generated)
        return T.Slot({"index": index, "answer": "1"}, torch.tensor([1]), [], group, advantages=torch.zeros(2),
                      credit=c, silent=silent, first=T.Pass(0.0, [None, None]))
    aside, trained = slot(4, [12, 12], 40, True), slot(5, [10, 8], 30, False)
    aside.first, trained.set_aside = None, [aside]
    epoch = dict(epoch=1, policy_loss=0.0, grad_norm=1.0, update_norm=0.1, learning_rate=1e-5)
    t = SimpleNamespace(cfg=cfg, credit_method=C.method(cfg))
    record = T.step_report(2, [trained], t, [epoch], T.Stopwatch(torch.device("cpu")))
    assert record.metrics["generated_tokens"] == 70 and record.metrics["problems_drawn"] == 2
    assert [r["set_aside"] for r in record.rollouts[:2]] == [True, True] and "set_aside" not in record.rollouts[2]


def test_a_value_yaml_reads_as_base_60_is_quoted_as_written(tmp_path, capsys):
    """YAML 1.1 reads 4:2 as 242: on the command line and in a file, the message quotes '4:2'."""
    config = ["--config", str(ROOT / "config.yaml")]
    assert T.main([*config, "credit=tree", "tree_branching=4:2"]) == 2
    one_line_error(capsys, "config key 'tree_branching' must be integers >= 2 separated by commas whose product is "
                           "group_size 8 (e.g. 2,2,2 for 8), got '4:2'")
    path = tmp_path / "c.yaml"
    path.write_text("credit: tree\ntree_branching: 4:2\ngroup_size: 1:20\n")
    assert T.main(["--config", str(path)]) == 2
    one_line_error(capsys, "config key 'group_size' must be int, got '1:20'")


def test_the_tree_is_sampled_level_by_level_with_a_stream_per_node(tiny_model):
    """generate_tree on the tiny model: 4 leaves for branching 2,2; the leaves under a node share its tokens; a
    node's tokens come from its own stream, so the tree is the same whichever order or batch draws it."""
    model, tok = tiny_model
    cfg = T.Config(group_size=4, credit="tree", tree_branching="2,2", credit_segment_tokens=3, max_new_tokens=8,
                   temperature=1.0, device="cpu")
    prompt = torch.tensor([5, 17, 33, 100, 7])
    tree = _grow(model, tok, prompt, cfg, -1, 1)
    assert len(tree.leaves) == 4 and all(len(r) == 8 for r in tree.leaves) and all(tree.cut)
    first = [s[1] for s in tree.segments]
    assert tree.leaves[0][:first[0]] == tree.leaves[1][:first[1]] and tree.leaves[2][:first[2]] == \
        tree.leaves[3][:first[3]]
    assert tree.leaves[0][:first[0]] != tree.leaves[2][:first[2]]  # another branch at the root
    assert tree.generated == sum(first[::2]) + 4 * 8 - sum(first)  # each node's tokens sampled once
    assert _grow(model, tok, prompt, cfg, -1, 1) == tree
    assert _grow(model, tok, prompt, cfg, -1, 2) != tree  # another draw


def test_a_first_level_node_is_cut_at_its_line_end_and_the_dropped_token_is_counted(monkeypatch):
    """A scripted 2,2 tree (credit_segment_tokens 3, max_new_tokens 8): each first-level node samples <7> "\n" <8>
    and is cut after the line end (segments [0, 2]), the <8> dropped; each leaf then runs to the limit, 8 - 2 = 6
    tokens, no EOS. Generated: 2 nodes x 3 tokens (the dropped one counted) + 4 leaves x 6 = 30."""
    cfg = T.Config(group_size=4, credit="tree", tree_branching="2,2", credit_segment_tokens=3, max_new_tokens=8,
                   device="cpu")
    tok = SimpleNamespace(decode=lambda ids, **kw: "".join("\n" if i == 1 else f"<{i}>" for i in ids))
    calls = []

    def decode(model, prompts, max_new, eos, pick, amp, drop_finished=False, **kwargs):
        calls.append(([p.tolist() for p in prompts], max_new))
        first = len(prompts[0]) == 2
        return [torch.tensor([7, 1, 8] if first else [9] * max_new) for _ in prompts], [False] * len(prompts)
    monkeypatch.setattr(T, "decode", decode)
    tree = _grow(None, tok, torch.tensor([5, 17]), cfg, 0, 1, share_prompt=False)
    assert calls == [([[5, 17]] * 2, 3), ([[5, 17, 7, 1]] * 4, 6)]
    assert tree.leaves == [[7, 1, 9, 9, 9, 9, 9, 9]] * 4 and tree.cut == [True] * 4
    assert tree.segments == [[0, 2]] * 4 and tree.generated == 30


# ----------------------------------------------------------------------------------------------
# Monte Carlo: values from continuations


def test_monte_carlo_values_come_from_each_cuts_continuations(monkeypatch):
    """Response 0 (3 segments) has V = 0.25 at its first cut and 0.75 at its second, response 1 (1 segment) none:
    with rewards 1, 0 (mean 0.5, std 0.7071), segment advantages (0.25 - 0.5), (0.75 - 0.25), (1 - 0.75) over
    0.7071 + 1e-4; response 1's whole -0.5 / 0.7072, which is its A_i. A segment whose value does not change
    gets 0 (credit_scale group)."""
    t = _trainer(group_size=2, credit="monte_carlo", credit_segment_tokens=2, credit_scale="group")
    seen = {}

    def values(method, responses, starts, draw, tools):
        seen.update(starts=starts, draw=draw, mine=list(tools.rows))
        return [[0.25, 0.75], []], 12
    monkeypatch.setattr(C, "continuation_values", values)
    monkeypatch.setattr(C, "segment_starts", lambda pieces, limit: [0, 2, 4] if len(pieces) == 5 else [0])
    responses = [torch.tensor([5, 6, 7, 8, 0]), torch.tensor([9, 0])]
    group = _group([1.0, 0.0], [5, 2])
    adv = T.compute_advantages(group.rewards, 1e-4, zero_variance=False)
    credit = T.assign_credit(1, torch.tensor([1]), responses, group, adv, {"answer": "1"}, t)
    s = 2 ** 0.5 / 2 + 1e-4
    assert seen == {"starts": [[0, 2, 4], [0]], "draw": 3, "mine": [0, 1]}
    assert credit.values == [[0.5, 0.25, 0.75, 1.0], [0.5, 0.0]]
    assert credit.token_advantages[0] == pytest.approx([-0.25 / s] * 2 + [0.5 / s] * 2 + [0.25 / s], rel=1e-6)
    assert credit.token_advantages[1] == pytest.approx([adv[1].item()] * 2, rel=1e-6)
    assert credit.generated == 7 + 12
    monkeypatch.setattr(C, "continuation_values", lambda *a: ([[0.5, 1.0], []], 0))  # the first segment: no change
    credit = T.assign_credit(1, torch.tensor([1]), responses, group, adv, {"answer": "1"}, t)
    assert credit.token_advantages[0][:2] == [0.0, 0.0]
    # credit_scale raw: the changes of value themselves, -0.25, +0.5, +0.25, and response 1's -0.5 (its A_i)
    t.cfg.credit_scale = "raw"
    monkeypatch.setattr(C, "continuation_values", lambda *a: ([[0.25, 0.75], []], 0))
    adv = T.compute_advantages(group.rewards, 1e-4, "none", zero_variance=False)
    credit = T.assign_credit(1, torch.tensor([1]), responses, group, adv, {"answer": "1"}, t)
    assert credit.token_advantages == [[-0.25, -0.25, 0.5, 0.5, 0.25], [-0.5, -0.5]]


def test_continuation_values_average_the_scored_continuations_of_each_cut(monkeypatch):
    """Every (cut, sample) is a row: prompt + the response up to the cut, its own stream (seed, draw, rollout,
    cut, sample), at most max_new_tokens - cut new tokens; the text scored is prefix + continuation."""
    t = _trainer(group_size=4, credit="monte_carlo", credit_samples=2, max_new_tokens=6)  # a mean over 2, not G
    t.scorer, t.model = object(), torch.nn.Linear(1, 1)
    calls = []

    def decode(model, prompts, max_new, eos, pick, amp, drop_finished=False, prefilled=None, entropies=None):
        calls.append(([p.tolist() for p in prompts], max_new, prefilled))
        return [torch.tensor([30 + k, 0]) for k in range(len(prompts))], [False] * len(prompts)
    monkeypatch.setattr(T, "decode", decode)
    # the prompt's pass once (its state "P"), then each batch's rows read their prefixes after it
    monkeypatch.setattr(T, "shared_prompt_state", lambda model, ids, amp: calls.append(ids.tolist()) or ("P",))
    monkeypatch.setattr(T, "after_prompt", lambda model, state, prefixes, amp: (state, [p.tolist() for p in prefixes]))
    seeds = []
    monkeypatch.setattr(T, "stream_seed", lambda seed, *key: seeds.append(key) or 1)
    monkeypatch.setattr(T, "score_rollouts", lambda scorer, texts, gold: [
        T.Score(0.0 if "<30>" in x else 1.0, None, "wrong") for x in texts])
    values, sampled = _continuations(torch.tensor([1]), [torch.tensor([5, 6, 7, 8, 0])], [[0, 2, 4]], 3,
                                     {"answer": "1"}, range(1, 2), t)
    assert calls == [[1], ([[1, 5, 6]] * 2 + [[1, 5, 6, 7, 8]] * 2, 4, (("P",), [[5, 6]] * 2 + [[5, 6, 7, 8]] * 2))]
    assert seeds == [("continuation", 3, 1, 1, 0), ("continuation", 3, 1, 1, 1), ("continuation", 3, 1, 2, 0),
                     ("continuation", 3, 1, 2, 1)]
    assert values == [[0.5, 1.0]] and sampled == 8  # every sample scores 1 but <30>, the first cut's first


class _Scorer:
    """A stand-in for the verifier's worker: score(text, gold, record) as TimedVerifier's, the record seen kept;
    `scored` is the tuple it returns (with a reward_function: verifier reward, answer, status, function value)."""
    def __init__(self, scored):
        self.scored, self.records = scored, []

    def score(self, text, gold, record=None):
        self.records.append(record)
        return self.scored


def test_continuation_values_score_with_the_format_bonus_and_the_reward_function(monkeypatch):
    """The real score_rollouts scores the continuations. Every one is right (reward 1); with format_reward 0.5 the
    first cut's (4 tokens of room, none ends at EOS) earn no bonus: 1.0, the second cut's (ending at EOS) 1.5.
    With a reward_function (reward_weights 1,0.25; the verifier says wrong, 0, the function 1) every
    continuation scores 1 * 0 + 0.25 * 1 = 0.25, the function seeing the problem's record."""
    t = _trainer(group_size=2, credit="monte_carlo", credit_samples=2, max_new_tokens=6, format_reward=0.5)
    t.model = torch.nn.Linear(1, 1)
    t.scorer = _Scorer((1.0, "1", "correct"))

    def decode(model, prompts, max_new, eos, pick, amp, drop_finished=False, prefilled=None, entropies=None):
        return [torch.tensor([40, 41, 42, 43] if len(p) == 3 else [50, 0]) for p in prompts], [False] * len(prompts)
    monkeypatch.setattr(T, "decode", decode)
    monkeypatch.setattr(T, "shared_prompt_state", lambda *a: ("P",))
    monkeypatch.setattr(T, "after_prompt", lambda *a: None)
    args = (torch.tensor([1]), [torch.tensor([5, 6, 7, 8, 0])], [[0, 2, 4]], 3, {"answer": "1"}, range(1, 2))
    assert _continuations(*args, t) == ([[1.0, 1.5]], 12)
    t = _trainer(group_size=2, credit="monte_carlo", credit_samples=2, max_new_tokens=6,
                 reward_function="reward.py:score", reward_weights="1,0.25")
    t.model = torch.nn.Linear(1, 1)
    t.scorer = _Scorer((0.0, "1", "wrong", 1.0))
    args = (*args[:4], {"answer": "1", "record": {"id": 7}}, *args[5:])
    assert _continuations(*args, t) == ([[0.25, 0.25]], 12)
    assert t.scorer.records == [{"id": 7}] * 4


def test_a_response_shorter_than_one_segment_has_the_spec_credit_only_at_the_groups_scale(monkeypatch):
    """No cut in any response (2 to 4 tokens, segments of 32): each token's change of value is r_i - mean(r), which
    credit_scale group scales to the spec's A_i exactly as the settings page says; the default whitens those changes
    over the group's 11 tokens (0.75 twice, -0.25 nine times; mean -0.06818, sample std 0.40452): other numbers."""
    monkeypatch.setattr(C, "continuation_values", lambda *a: ([[] for _ in range(4)], 0))
    responses = [torch.tensor([5, 0]), torch.tensor([6, 7, 0]), torch.tensor([8, 0]), torch.tensor([9, 10, 11, 0])]
    group = _group([1.0, 0.0, 0.0, 0.0], [2, 3, 2, 4])
    adv = T.compute_advantages(group.rewards, 1e-4, zero_variance=False)
    t = _trainer(group_size=4, credit="monte_carlo", credit_scale="group")
    credit = T.assign_credit(1, torch.tensor([1]), responses, group, adv, {"answer": "1"}, t)
    assert credit.token_advantages == [[a] * n for a, n in zip(adv.tolist(), [2, 3, 2, 4])]
    t.cfg.credit_scale = "auto"
    credit = T.assign_credit(1, torch.tensor([1]), responses, group, adv, {"answer": "1"}, t)
    x = torch.tensor([0.75] * 2 + [-0.25] * 9)
    assert sum(credit.token_advantages, []) == pytest.approx(((x - x.mean()) / (x.std() + 1e-4)).tolist(), abs=1e-6)
    assert credit.token_advantages[0][0] == pytest.approx(2.02210, abs=1e-5)  # the spec: 1.49970
    page = " ".join((ROOT / "docs" / "settings.md").read_text().split())
    assert ("`monte_carlo` gives each of its tokens its V(end) - V(start) = r_i - mean(r) as `credit_scale` scales it, "
            "which is the spec's A_i only with `credit_scale: group`") in page


def test_at_two_problems_a_step_each_group_has_its_own_continuations_and_whitening(tiny_model_dir, tiny_data_file,
                                                                                   tmp_path, monkeypatch):
    """monte_carlo at P = 2 over 4 problems: each group's continuations are keyed by its own draw (1, 2, 3, 4, not
    the step's first: 1, 1, 3, 3), and each group's token advantages are whitened over its own tokens (mean 0,
    sample std 1 within each group), as docs/variants.md says."""
    monkeypatch.setattr(T, "score_rollouts", rlvr_driver.by_text)
    draws, real = [], C.continuation_values
    monkeypatch.setattr(C, "continuation_values", lambda method, responses, starts, draw, tools: (
        draws.append(draw) or real(method, responses, starts, draw, tools)))
    out = tmp_path / "run"
    assert T.main(main_args(tiny_model_dir, tiny_data_file, out, "num_problems=4", "problems_per_step=2",
                            "learning_rate=1e-3", "credit=monte_carlo", "credit_segment_tokens=2",
                            "credit_samples=2")) == 0
    assert draws == [1, 2, 3, 4]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    for problem in range(4):
        a = torch.tensor(sum((r["token_advantages"] for r in rollouts if r["problem_index"] == problem), []))
        assert abs(a.mean().item()) < 1e-5 and (a.std().item() == pytest.approx(1.0, abs=1e-3) or not a.any())
    page = " ".join((ROOT / "docs" / "variants.md").read_text().split())
    assert ("over every token of the group the loss trains (with `problems_per_step` > 1, each group over its own "
            "tokens)") in page


def test_the_entropy_mask_at_two_problems_a_step_reads_each_groups_own_entropies(tiny_model):
    """P = 2, top_entropy_quantile 0.5: group 1's entropies, sampled in one batch with group 0's, are those it gets
    alone (not group 0's)."""
    model, tok = tiny_model
    t = _Trainer(cfg=T.Config(device="cpu", group_size=4, max_new_tokens=6, top_entropy_quantile=0.5),
                 model=model, tokenizer=tok, device=torch.device("cpu"), precision="fp32", eos_id=0,
                 decoders=T.Decoders())
    draws = [(k + 1, {"index": k}, torch.tensor(tok(T.build_prompt(T.SPEC_PROMPT, q))["input_ids"]))
             for k, q in enumerate(["What is 9 + 9?", "What is 1000 + 1000 + 1000?"])]
    together = T.sample_groups(1, draws, t)
    alone = T.sample_groups(1, [draws[1]], t)[0]
    assert [r.tolist() for r in together[1][0]] == [r.tolist() for r in alone[0]]
    assert together[1][3] == [pytest.approx(e, rel=1e-5, abs=1e-6) for e in alone[3]]
    assert together[1][3] != [pytest.approx(e, rel=1e-5, abs=1e-6) for e in together[0][3]]


# ----------------------------------------------------------------------------------------------
# The spec's credit, and the entropy mask


def test_the_spec_credit_is_no_credit_and_with_the_entropy_mask_every_token_gets_a_i(monkeypatch):
    t = _trainer(group_size=2)
    group = _group([1.0, 0.0], [3, 2])
    adv = T.compute_advantages(group.rewards, 1e-4, zero_variance=False)
    responses = [torch.tensor([5, 6, 0]), torch.tensor([9, 0])]
    assert T.assign_credit(1, torch.tensor([1]), responses, group, adv, {"answer": "1"}, t) is None
    t = _trainer(group_size=2, top_entropy_quantile=0.5)
    group.entropies = [[0.1, 0.5, 0.9], [0.2, 0.8]]  # what the sampler recorded
    credit = T.assign_credit(1, torch.tensor([1]), responses, group, adv, {"answer": "1"}, t)
    assert credit.token_advantages == [[adv[0].item()] * 3, [adv[1].item()] * 2]
    # the group's entropies 0.1 0.2 0.5 0.8 0.9: the median 0.5 and above are kept
    assert [w.tolist() for w in credit.weights(range(2))] == [[0.0, adv[0].item(), adv[0].item()], [0.0, adv[1].item()]]
    assert credit.entropy_mask == [[0, 1, 1], [0, 1]]  # what rollouts.jsonl records


def test_the_spec_credit_calls_nothing_in_credit_py(tiny_model_dir, tiny_data_file, tmp_path, monkeypatch):
    """credit: sequence (no entropy mask): a run calls no formula of credit.py, only the chosen method's members
    that say it has nothing to do (assign_credit returns None at once: is_spec); the entropy mask alone calls
    credit.assign and entropy_masks (the profiler sees credit.py's calls)."""
    import sys

    monkeypatch.setattr(T, "score_rollouts", rlvr_driver.by_text)
    for name, extra in (("spec", []), ("mask", ["top_entropy_quantile=0.5"])):
        called = []

        def profile(frame, event, arg):
            if event == "call" and frame.f_code.co_filename == C.__file__:
                called.append(frame.f_code.co_name)
        sys.setprofile(profile)
        try:
            code = T.main(main_args(tiny_model_dir, tiny_data_file, tmp_path / name, "num_problems=2", *extra))
        finally:
            sys.setprofile(None)
        assert code == 0
        if name == "spec":
            assert set(called) == {"setting_checks", "method", "is_spec", "needs_entropies", "grow", "trial", "figures"}
        else:
            assert {"assign", "entropy_masks"} <= set(called)


def test_the_entropy_mask_keeps_the_top_quantile_of_the_groups_tokens(monkeypatch):
    """TRL's rule: the threshold is the (1 - q) quantile of every token's entropy in the group (linear
    interpolation), tokens at or above it keep their policy term: q = 0.5 over 0.1 0.2 0.3 0.5 0.8 0.9 gives
    0.4, q = 0.2 gives 0.8."""
    group = _group([1.0, 0.0], [4, 2])
    group.entropies = [[0.1, 0.5, 0.9, 0.3], [0.2, 0.8]]
    assert [m.tolist() for m in C.entropy_masks(group.entropies, 0.5)] == [[0, 1, 1, 0], [0, 1]]
    assert [m.tolist() for m in C.entropy_masks(group.entropies, 0.2)] == [[0, 0, 1, 0], [0, 1]]
    assert C.entropy_masks(group.entropies, 1.0) is None


def test_entropy_of_a_hand_made_distribution():
    """Logits (0, 0, -inf...) are a fair coin: ln 2; (30, 0, ...) nearly certain: ~0; four equal: ln 4."""
    logits = torch.full((3, 4), -1e9)
    logits[0, :2] = 0.0
    logits[1, 0], logits[1, 1:] = 30.0, 0.0
    logits[2] = 0.0
    assert T.entropy_of(logits).tolist() == pytest.approx([math.log(2), 0.0, math.log(4)], abs=1e-6)


def test_the_samplers_entropies_are_the_forwards_at_the_position_that_predicts_each_token(tiny_model):
    """decode records each token's entropy from the logits it was drawn from; a forward over prompt + response
    but its last token gives, at the positions predicting each response token, the same within float rounding
    (the decode's cached attention against one pass: measured at most 2e-6 here), for every row of the group."""
    model, _ = tiny_model
    prompt = torch.tensor([5, 17, 33, 100, 7])
    streams = [torch.Generator().manual_seed(k) for k in range(4)]
    entropies = []
    responses, _ = T.decode(model, [prompt] * 4, 8, -1, T.sampling_pick(streams, 1.0, 1.0, "cpu"), T.nullcontext(),
                            entropies=entropies)
    assert [len(e) for e in entropies] == [len(r) for r in responses] == [8] * 4
    for r, got in zip(responses, entropies):
        with torch.no_grad():
            logits = model(torch.cat([prompt, r[:-1]])[None]).logits[0, len(prompt) - 1:]
        assert got == pytest.approx(T.entropy_of(logits).tolist(), abs=1e-5)
    # a tree whose first-level nodes are cut at a line end (a token whose id is a multiple of 3), dropping the
    # tokens after it: their entropies go with them
    tree = _grow(model, SimpleNamespace(decode=lambda ids: "\n" if ids[0] % 3 == 0 else "x"), prompt,
                 T.Config(group_size=4, credit="tree", tree_branching="2,2", credit_segment_tokens=4,
                          max_new_tokens=8, temperature=1.0, device="cpu", top_entropy_quantile=0.5), -1, 1)
    assert all(len(seg) == 2 for seg in tree.segments)
    firsts = tree.segments[0][1] + tree.segments[2][1]  # the two first-level nodes' kept tokens
    kept = firsts + sum(len(x) - seg[1] for x, seg in zip(tree.leaves, tree.segments))
    assert tree.generated > kept  # the tokens sampled: the two first-level nodes' (the dropped ones too), the leaves
    for leaf, got in zip(tree.leaves, tree.entropies):
        assert len(got) == len(leaf)
        with torch.no_grad():
            logits = model(torch.cat([prompt, torch.tensor(leaf[:-1])])[None]).logits[0, len(prompt) - 1:]
        assert got == pytest.approx(T.entropy_of(logits).tolist(), abs=1e-5)


@pytest.mark.parametrize("branching", ["2,2", "4,2", "2,4", "2,2,2"])
def test_the_trees_shared_prompt_pass_gives_the_per_row_trees_tokens(branching, tiny_model, monkeypatch):
    """The prompt's pass run once for every row of every depth (its cache repeated, each row then reading its
    parent's tokens) samples the same tree as prompt + parent run for every row; the shared tree runs no
    prompt + parent pass at all (decode takes the prefilled state), the per-row one one per depth."""
    model, _ = tiny_model
    size = math.prod(int(b) for b in branching.split(","))
    cfg = T.Config(group_size=size, credit="tree", tree_branching=branching, credit_segment_tokens=3,
                   max_new_tokens=9, temperature=1.0, device="cpu")
    tok = SimpleNamespace(decode=lambda ids: "\n" if ids[0] % 7 == 0 else "x")  # a line end now and then
    prompt = torch.tensor([5, 17, 33, 100, 7])
    passes, real = [], T.eager_decoder
    monkeypatch.setattr(T, "eager_decoder", lambda *a, **k: passes.append(len(a[1])) or real(*a, **k))
    shared = _grow(model, tok, prompt, cfg, -1, 3)
    assert passes == []
    per_row = _grow(model, tok, prompt, cfg, -1, 3, share_prompt=False)
    assert len(passes) == len(branching.split(","))  # one batched prompt + parent pass per depth
    assert shared == per_row and len(shared.leaves) == size
    assert len({tuple(leaf[:seg[1]]) for leaf, seg in zip(shared.leaves, shared.segments) if len(seg) > 1}) > 1


def test_the_continuations_shared_prompt_pass_gives_the_per_row_continuations(tiny_model, monkeypatch):
    """monte_carlo's continuations with the prompt's pass run once (its cache repeated, each row then reading its
    prefix) sample the same tokens, so the same values, as prompt + prefix run for every row; the shared ones run
    no prompt + prefix pass at all (decode takes the prefilled state), the per-row ones one per batch of
    group_size x credit_samples rows (3 responses, 2 cuts each, 2 samples: 12 rows, batches of 8 and 4). With no
    EOS each row runs to its room, max_new_tokens - its cut: 2 x (10 + 8 + 11 + 9 + 9 + 8) = 110 tokens."""
    model, _ = tiny_model
    t = _trainer(group_size=4, credit="monte_carlo", credit_samples=2, max_new_tokens=12, temperature=1.0)
    t.model, t.eos_id = model, -1  # no EOS: every continuation runs to max_new_tokens, its tokens all compared
    texts = []
    monkeypatch.setattr(T, "score_rollouts", lambda scorer, xs, gold: [
        texts.append(x) or T.Score(float(len(texts) % 3 == 0), None, "wrong") for x in xs])
    passes, real = [], T.eager_decoder
    monkeypatch.setattr(T, "eager_decoder", lambda *a, **k: passes.append(len(a[1])) or real(*a, **k))
    responses = [torch.tensor([7, 8, 9, 10, 11, 12]), torch.tensor([20, 21, 22, 23]), torch.tensor([30, 31, 32, 33, 34])]
    args = (torch.tensor([5, 17, 33, 100, 7]), responses, [[0, 2, 4], [0, 1, 3], [0, 3, 4]], 3, {"answer": "1"},
            range(0, 3))
    shared = _continuations(*args, t)
    shared_texts, texts[:] = list(texts), []
    assert passes == []
    per_row = _continuations(*args, t, share_prompt=False)
    assert passes == [8, 4]
    assert texts == shared_texts and per_row == shared and shared[1] == 2 * (10 + 8 + 11 + 9 + 9 + 8)
    assert len(set(texts)) == 12  # each row its own stream: no two continuations alike


def test_a_zero_variance_group_keeps_every_advantage_zero_and_samples_no_continuation_at_the_groups_scale(
        monkeypatch):
    """credit_scale group (the spec's scale, 0 in a zero-variance group): no continuation, every A_it 0."""
    t = _trainer(group_size=2, credit="monte_carlo", credit_scale="group")
    monkeypatch.setattr(C, "continuation_values", lambda *a: pytest.fail("continuations of a zero-variance group"))
    group = _group([1.0, 1.0], [3, 2])
    adv = T.compute_advantages(group.rewards, 1e-4, zero_variance=True)
    credit = T.assign_credit(1, torch.tensor([1]), [torch.tensor([5, 6, 0]), torch.tensor([9, 0])], group, adv,
                             {"answer": "1"}, t)
    assert credit.token_advantages == [[0.0] * 3, [0.0] * 2] and credit.all_zero()


def test_monte_carlo_credits_a_right_first_line_in_an_all_wrong_group(monkeypatch):
    """VinePPO's case: rewards 0, 0 (zero variance), response 0's first line right (its continuations' mean
    V = 0.5), response 1's not (V = 0). Raw: response 0's first segment +0.5, its second 0 - 0.5 = -0.5,
    response 1's 0: a gradient (credit.all_zero() False), where the spec's credit has none. Whitened (auto, VinePPO's):
    over the 8 tokens .5 .5 -.5 -.5 -.5 0 0 0, mean -0.0625, sample std 0.41726: +0.5 -> 0.5625 / 0.41736 = 1.34775."""
    t = _trainer(group_size=2, credit="monte_carlo", credit_segment_tokens=2, credit_scale="raw")
    monkeypatch.setattr(C, "continuation_values", lambda *a, **k: ([[0.5], [0.0]], 16))
    monkeypatch.setattr(C, "segment_starts", lambda pieces, limit: [0, 2])
    responses = [torch.tensor([5, 6, 7, 8, 0]), torch.tensor([9, 10, 0])]
    group = _group([0.0, 0.0], [5, 3])
    adv = T.compute_advantages(group.rewards, 1e-4, zero_variance=True)
    credit = T.assign_credit(1, torch.tensor([1]), responses, group, adv, {"answer": "1"}, t)
    assert credit.values == [[0.0, 0.5, 0.0], [0.0, 0.0, 0.0]]
    assert credit.token_advantages == [[0.5, 0.5, -0.5, -0.5, -0.5], [0.0, 0.0, 0.0]] and not credit.all_zero()
    assert group.zero_variance  # its passes run (train_step's silent: all_zero), where the spec's would not
    assert credit.generated == 8 + 16
    t.cfg.credit_scale = "auto"
    credit = T.assign_credit(1, torch.tensor([1]), responses, group, adv, {"answer": "1"}, t)
    x = [0.5, 0.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0]
    mean = sum(x) / 8
    std = math.sqrt(sum((v - mean) ** 2 for v in x) / 7)
    assert (mean, round(std, 5)) == (-0.0625, 0.41726)
    assert sum(credit.token_advantages, []) == pytest.approx([(v - mean) / (std + 1e-4) for v in x], abs=1e-6)
    assert credit.token_advantages[0][0] == pytest.approx(1.34775, abs=1e-5)


# ----------------------------------------------------------------------------------------------
# Settings and runs


@pytest.mark.parametrize("setting, message", [
    ("credit=vine", "config key 'credit' must be one of sequence, monte_carlo, tree, steps, got 'vine'"),
    ("credit_samples=0", "config key 'credit_samples' must be an integer in [1, 256]"),
    ("credit_segment_tokens=0", "config key 'credit_segment_tokens' must be an integer in [1, 1048576]"),
    ("tree_branching=3,3", "config key 'tree_branching' must be integers >= 2 separated by commas whose product is "
                           "group_size 4 (e.g. 2,2,2 for 8), got '3,3'"),
    ("tree_branching=4,1", "config key 'tree_branching' must be integers >= 2"),
    ("top_entropy_quantile=0", "config key 'top_entropy_quantile' must be a number in (0, 1] (1: every token), got 0.0"),
])
def test_each_credit_setting_out_of_range_is_one_line(setting, message, tiny_model_dir, tiny_data_file, tmp_path,
                                                      capsys):
    extra = ["credit=tree"] if setting.startswith("tree_branching") else []
    assert T.main(main_args(tiny_model_dir, tiny_data_file, tmp_path / "o", *extra, setting)) == 2
    one_line_error(capsys, message)
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def credit_runs(tiny_model_dir, tiny_data_file, tmp_path_factory):
    """Two steps of each method on the tiny model, rewards by the response's text (rlvr_driver.by_text)."""
    mp = pytest.MonkeyPatch()
    mp.setattr(T, "score_rollouts", rlvr_driver.by_text)
    runs = {}
    for name, extra in (("monte_carlo", ["credit=monte_carlo", "credit_segment_tokens=2", "credit_samples=2"]),
                        ("tree", ["credit=tree", "tree_branching=2,2", "credit_segment_tokens=3"]),
                        ("entropy", ["top_entropy_quantile=0.3"])):
        out = tmp_path_factory.mktemp(name) / "run"
        assert T.main(main_args(tiny_model_dir, tiny_data_file, out, "num_problems=2", "learning_rate=1e-3",
                                "save_every=1", "token_report=true", *extra)) == 0
        runs[name] = out
    mp.undo()
    return runs


@pytest.mark.parametrize("name", ["monte_carlo", "tree"])
def test_a_runs_rollouts_hold_each_tokens_credit_and_its_values_telescope(credit_runs, name):
    """rollouts.jsonl: segments, values (one more), token_advantages (one per token); a response's values run from
    the group's mean to its reward; each token's advantage is its segment's change of value as the method's
    paper scales it (the defaults: the tree's raw, monte_carlo's whitened over the step's tokens); metrics count
    the tokens generated, continuations and branches included, and the table shows them."""
    out = credit_runs[name]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(m["reward_std"] > 0 for m in metrics)
    for m in metrics:
        group = [r for r in rollouts if r["step"] == m["step"]]
        changes = []
        for r in group:
            assert len(r["values"]) == len(r["segments"]) + 1 and len(r["token_advantages"]) == r["tokens"]
            assert r["segments"][0] == 0 and r["segments"] == sorted(set(r["segments"]))
            assert r["values"][0] == pytest.approx(m["reward_mean"]) and r["values"][-1] == r["reward"]
            ends = [*r["segments"][1:], r["tokens"]]
            changes.append([r["values"][k + 1] - r["values"][k] for k in range(len(ends))
                            for _ in range(ends[k] - r["segments"][k])])
        flat = torch.tensor(sum(changes, []))
        if name == "monte_carlo":
            flat = (flat - flat.mean()) / (flat.std() + 1e-4)
        assert sum((r["token_advantages"] for r in group), []) == pytest.approx(flat.tolist(), abs=1e-5)
        assert m["generated_tokens"] >= (m["response_tokens"] if name == "monte_carlo" else 1)
    assert (out / "credit.png").stat().st_size > 5_000


def test_the_entropy_mask_alone_keeps_the_spec_credit_and_trains_fewer_tokens(credit_runs):
    out = credit_runs["entropy"]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert all("segments" not in r for r in rollouts)  # credit=sequence: the spec's records
    tokens = [json.loads(line) for line in (out / "tokens.jsonl").read_text().splitlines()]
    assert tokens and all(set(t["token_advantages"]) == {t["advantage"]} for t in tokens)
    # each record's mask, one per token; q = 0.3 keeps the tokens above the 0.7 quantile (linear interpolation
    # between the n sorted entropies: at least 0.3 (n - 1) of them, ties at the threshold keep more), and the
    # token records carry the same mask
    for step in {r["step"] for r in rollouts}:
        group = [r for r in rollouts if r["step"] == step]
        assert all(len(r["entropy_mask"]) == r["tokens"] and set(r["entropy_mask"]) <= {0, 1} for r in group)
        kept, every = sum(sum(r["entropy_mask"]) for r in group), sum(r["tokens"] for r in group)
        assert 0.3 * (every - 1) <= kept < every
    masks = {(r["step"], r["rollout"]): r["entropy_mask"] for r in rollouts}
    assert all(t["entropy_mask"] == masks[t["step"], t["rollout"]] for t in tokens)
    assert (out / "credit.png").stat().st_size > 5_000


def test_a_resume_that_changes_the_credit_is_refused(credit_runs, tiny_model_dir, tiny_data_file, capsys):
    out = credit_runs["tree"]
    for changed in ("credit=monte_carlo", "tree_branching=4", "credit_segment_tokens=4", "top_entropy_quantile=0.5"):
        extra = ["credit=tree", "tree_branching=2,2", "credit_segment_tokens=3"]
        extra = [e for e in extra if e.split("=")[0] != changed.split("=")[0]] + [changed]
        assert T.main(main_args(tiny_model_dir, tiny_data_file, out, "num_problems=3", "learning_rate=1e-3",
                                "save_every=1", "token_report=true", "resume=auto", *extra)) == 2
        assert changed.split("=")[0] in one_line_error(capsys, "cannot resume")


def test_zero_variance_skip_keeps_the_monte_carlo_gradient_of_a_zero_variance_group(tiny_model_dir, tiny_data_file,
                                                                                     tmp_path, monkeypatch):
    """zero_variance=skip skips a group whose credit is all zero, not every group with equal rewards: monte_carlo's
    values give these six zero-variance groups of 2 a gradient, which skip keeps (the same grad and update norms as
    step at every step; it used to print grad norm 0 and throw the continuations' gradient away)."""
    monkeypatch.setattr(T, "score_rollouts", rlvr_driver.by_text)
    runs = {}
    for how in ("step", "skip"):
        out = tmp_path / how
        assert T.main(main_args(tiny_model_dir, tiny_data_file, out, "num_problems=6", "learning_rate=1e-3",
                                "group_size=2", "credit=monte_carlo", "credit_segment_tokens=2", "credit_samples=2",
                                f"zero_variance={how}")) == 0
        runs[how] = [(m["reward_std"], m["grad_norm"], m["update_norm"])
                     for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    assert all(std == 0 and grad > 0 for std, grad, _ in runs["step"])
    assert runs["skip"] == runs["step"]


def test_a_new_credit_method_is_its_class_in_credit_py_and_nothing_in_the_trainer(tiny_model_dir, tiny_data_file,
                                                                                   tmp_path, monkeypatch, capsys):
    """A toy method added here alone, no line of the trainer changed: `last` gives response i's A_i to its last
    token only; its column `last` and its figure `last_trained` count the responses whose last token it trains.
    The run's rollouts carry its token advantages, its metrics the figure, its table the column."""
    from dataclasses import dataclass
    from typing import ClassVar

    @dataclass
    class Last(C.Sequence):
        name: ClassVar[str] = "last"
        columns: ClassVar[tuple] = (("last", 6),)

        def assign(self, responses, group, advantages, tools):
            token_advantages = [[0.0] * (n - 1) + [float(a)] for a, n in zip(advantages, group.tokens)]
            return C.Credit(token_advantages, [[0]] * len(token_advantages), [[0.0, 0.0]] * len(token_advantages),
                            None, sum(group.tokens))

        def figures(self, trained, aside):
            return {"last_trained": sum(a[-1] != 0 for c in trained if c for a in c.token_advantages)}

        def cells(self, m):
            return [str(m["last_trained"])]
    monkeypatch.setitem(C.METHODS, "last", Last)
    monkeypatch.setattr(T, "score_rollouts", rlvr_driver.by_text)
    out = tmp_path / "run"
    assert T.main(main_args(tiny_model_dir, tiny_data_file, out, "num_problems=3", "learning_rate=1e-3",
                            "credit=last")) == 0
    table = capsys.readouterr().out.splitlines()
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert table[0].split()[-2:] == ["last", "seconds"]
    for m in metrics:
        group = [r for r in rollouts if r["step"] == m["step"]]
        assert all(r["token_advantages"] == [0.0] * (r["tokens"] - 1) + [pytest.approx(r["advantage"])]
                   for r in group)
        assert m["last_trained"] == sum(r["advantage"] != 0 for r in group)
        assert next(line for line in table if line.split()[:1] == [str(m["step"])]).split()[-2] == \
            str(m["last_trained"])
    assert any(m["last_trained"] for m in metrics) and any(m["grad_norm"] > 0 for m in metrics)
