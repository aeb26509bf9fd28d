"""problems_per_step: P problems per AdamW step, their P x G rollouts sampled in one batched decode, each group
standardized alone, the loss the mean of the groups' losses. CPU, tiny local model; the spec's P = 1 is
tests/default_run.py's run, unchanged bit for bit."""

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import train_rlvr as T
from run_helpers import main_args, one_line_error, verdict


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _trainer(model, tok, **settings):
    cfg = T.Config(device="cpu", group_size=4, max_new_tokens=6, **settings)
    params = [p for p in model.parameters() if p.requires_grad]
    return SimpleNamespace(cfg=cfg, model=model, tokenizer=tok, params=params, device=torch.device("cpu"),
                           precision="fp32", eos_id=0, decoders=T.Decoders(), reference=None, warned=set(),
                           credit_method=T.credit.method(cfg))


def _slot(prompt, responses, rewards):
    r = torch.tensor(rewards, dtype=torch.float32)
    flat = T.equal_rewards(r)
    group = T.Group(["x"] * 4, [verdict(x == 1.0) for x in rewards], [len(x) for x in responses], [False] * 4, r, flat)
    return T.Slot({"index": 0, "answer": "2"}, prompt, responses, group,
                  advantages=T.compute_advantages(r, 1e-4, zero_variance=flat))


def _gradient(t):
    return torch.cat([p.grad.flatten() for p in t.params]).clone()


def test_a_group_without_variance_beside_one_with_halves_the_loss_and_the_gradient(tiny_model):
    """Two groups in one step: (1, 0, 1, 0) and (1, 1, 1, 1). The loss is the mean of the two groups' losses, so
    the step's loss and gradient are exactly half of the first group's alone (its terms divided by 2 G = 8, not 4);
    two zero-variance groups give a gradient of exactly 0."""
    model, tok = tiny_model
    t = _trainer(model, tok)
    prompt = torch.tensor([5, 17, 33])
    responses = [torch.tensor(x) for x in ([7, 9, 0], [11, 0], [13, 14, 15, 0], [21, 0])]
    signal, flat = _slot(prompt, responses, [1.0, 0.0, 1.0, 0.0]), _slot(prompt, responses, [1.0] * 4)
    a = 0.5 / (3 ** -0.5 + 1e-4)  # (r - 0.5) / (sample std 0.57735 + std_eps)
    assert signal.advantages.tolist() == pytest.approx([a, -a, a, -a], abs=1e-6)
    alone = T.step_loss(T.backpropagate_step(1, [signal], t))
    g_alone = _gradient(t)
    both = T.backpropagate_step(1, [signal, flat], t)
    assert both[1].loss == 0.0 and T.step_loss(both) == alone / 2
    torch.testing.assert_close(_gradient(t), g_alone / 2, rtol=1e-6, atol=0)
    assert g_alone.norm() > 0.1  # the first group has a real gradient
    T.backpropagate_step(1, [flat, _slot(prompt, responses, [0.0] * 4)], t)
    assert torch.equal(_gradient(t), torch.zeros_like(g_alone))  # the spec's proof, per step


def test_a_problems_rollouts_do_not_depend_on_the_problems_beside_it_in_the_batch(tiny_model):
    """Prompts of different lengths (one is left-padded in the batch): each problem's tokens are those it gets
    alone, from its own streams (keyed by its draw number)."""
    model, tok = tiny_model
    t = _trainer(model, tok)
    problems = [{"index": i, "prompt_ids": tok(T.build_prompt(T.SPEC_PROMPT, q))["input_ids"]}
                for i, q in enumerate(["What is 9 + 9?", "What is 10 + 10?", "What is 1000 + 1000 + 1000?"])]
    assert len({len(p["prompt_ids"]) for p in problems}) >= 2
    draws = [(k + 1, p, torch.tensor(p["prompt_ids"])) for k, p in enumerate(problems)]
    together = T.sample_groups(1, draws, t)
    for k in range(3):
        alone = T.sample_groups(1, [draws[k]], t)[0]
        assert [r.tolist() for r in together[k][0]] == [r.tolist() for r in alone[0]]
        assert together[k][1] == alone[1]
    assert [r.tolist() for r in together[0][0]] != [r.tolist() for r in together[1][0]]


def _run(tiny_model_dir, tiny_data_file, out, monkeypatch, capsys, *extra, flat=(), err=False):
    """A run of 4 problems whose rollout 0 is right, except the problems whose answers are in `flat` (all wrong).
    Returns its stdout (err: and its stderr)."""
    monkeypatch.setattr(T, "score_rollouts", lambda scorer, texts, gold: [
        verdict(i == 0 and gold not in flat) for i in range(len(texts))])
    code = T.main(main_args(tiny_model_dir, tiny_data_file, out, "num_problems=4", "learning_rate=1e-3",
                            "save_every=1", "keep_last=5", *extra))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out + (captured.err if err else "")


def test_two_problems_a_step_take_one_adamw_step_each_and_the_first_rollouts_match_one_a_step(
        tiny_model_dir, tiny_data_file, tmp_path, monkeypatch, capsys):
    one = _run(tiny_model_dir, tiny_data_file, tmp_path / "p1", monkeypatch, capsys)
    two = _run(tiny_model_dir, tiny_data_file, tmp_path / "p2", monkeypatch, capsys, "problems_per_step=2",
               flat=("2",))
    a, b = _jsonl(tmp_path / "p1" / "rollouts.jsonl"), _jsonl(tmp_path / "p2" / "rollouts.jsonl")
    assert [r["response"] for r in a if r["step"] == 1] == [r["response"] for r in b if r["problem_index"] == 0]
    assert [(r["step"], r["problem_index"]) for r in b[::4]] == [(1, 0), (1, 1), (2, 2), (2, 3)]
    metrics = _jsonl(tmp_path / "p2" / "metrics.jsonl")
    assert [m["problems"] for m in metrics] == [[0, 1], [2, 3]] and [m["problems_drawn"] for m in metrics] == [2, 2]
    # step 1: two groups with variance (1 right of 4 each); problem 1 (answer "2") has none
    assert [[g["correct"] for g in m["groups"]] for m in metrics] == [[1, 0], [1, 1]]
    assert metrics[0]["reward_std"] == pytest.approx(0.25) and metrics[0]["reward_mean"] == 0.125
    assert metrics[0]["correct"] == 1 and metrics[1]["correct"] == 2
    # one AdamW step per P problems: AdamW's step count is the run's steps
    state = torch.load(tmp_path / "p2" / "checkpoints" / "step-000002" / "optimizer.pt", weights_only=False)
    assert {int(s["step"]) for s in state["state"].values()} == {2}
    assert "step  correct/8" in two and "problems" in two.splitlines()[0]
    rows = [line for line in two.splitlines() if line[:1].isdigit()]
    assert len(rows) == 2 and rows[0].split()[1:4] == ["1", "0.125", "0.250000"] and " 0,1 " in rows[0]
    assert "zero-variance groups    1/4" in two and "problems drawn          4 for 2 optimizer steps" in two
    assert "correct rollouts        3/16" in two and "correct rollouts        4/16" in one


def test_a_resume_between_steps_of_two_problems_is_exact(tiny_model_dir, tiny_data_file, tmp_path, monkeypatch,
                                                          capsys):
    whole = tmp_path / "whole"
    _run(tiny_model_dir, tiny_data_file, whole, monkeypatch, capsys, "problems_per_step=2")
    cut = tmp_path / "cut"
    _run(tiny_model_dir, tiny_data_file, cut, monkeypatch, capsys, "problems_per_step=2", "num_problems=2")
    _run(tiny_model_dir, tiny_data_file, cut, monkeypatch, capsys, "problems_per_step=2", "resume=auto")
    assert (cut / "rollouts.jsonl").read_bytes() == (whole / "rollouts.jsonl").read_bytes()
    wa, wb = load_file(whole / "final" / "model.safetensors"), load_file(cut / "final" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    state = json.loads((whole / "checkpoints" / "step-000001" / "state.json").read_text())
    assert state["next_record"] == 2  # the data position after a step of two problems
    code = T.main(main_args(tiny_model_dir, tiny_data_file, cut, "num_problems=4", "learning_rate=1e-3",
                            "problems_per_step=1", "resume=auto"))
    assert code == 2
    one_line_error(capsys, "problems_per_step")


def test_a_finished_run_extended_on_resume_trains_each_problem_up_to_num_problems_once(
        tiny_model_dir, tiny_data_file, tmp_path, monkeypatch, capsys):
    """5 problems, 2 a step: 0,1 / 2,3 / 4. Resumed with num_problems=8 it trains 5,6 / 7 (not 5,6 and never 7:
    the problems done are counted, not the steps times P); with 6, problem 5 alone; with 3 it is refused."""
    import shutil
    done = tmp_path / "done"
    table = _run(tiny_model_dir, tiny_data_file, done, monkeypatch, capsys, "problems_per_step=2", "num_problems=5")
    # the header's correct/8 is two groups of 4; the last step took one problem: its row says its own /4
    rows = [line.split() for line in table.splitlines() if line.split()[:1] in (["step"], ["1"], ["2"], ["3"])]
    assert rows[0][1] == "correct/8" and [r[1] for r in rows[1:]] == ["2", "2", "1/4"]
    for n, trained in ((8, [[0, 1], [2, 3], [4], [5, 6], [7]]), (6, [[0, 1], [2, 3], [4], [5]])):
        shutil.copytree(done, tmp_path / f"to{n}")
        out = _run(tiny_model_dir, tiny_data_file, tmp_path / f"to{n}", monkeypatch, capsys, "problems_per_step=2",
                   f"num_problems={n}", "resume=auto")
        # the resumed table shows the steps before it as they were: step 3 of one problem, 1/4
        assert [line.split()[1] for line in out.splitlines() if line.split()[:1] == ["3"]] == ["1/4"]
        assert [m["problems"] for m in _jsonl(tmp_path / f"to{n}" / "metrics.jsonl")] == trained
        assert f"problems drawn          {n} for {len(trained)} optimizer steps" in out
    code = T.main(main_args(tiny_model_dir, tiny_data_file, done, "learning_rate=1e-3", "save_every=1",
                            "keep_last=5", "problems_per_step=2", "num_problems=3", "resume=auto"))
    assert code == 2
    assert one_line_error(capsys) == (f"error: cannot resume {done / 'checkpoints' / 'step-000003'}: it has trained 5 "
                                      "problems but num_problems is 3; set num_problems to at least 5")


def test_zero_variance_skip_and_resample_act_per_group(tiny_model_dir, tiny_data_file, tmp_path, monkeypatch, capsys):
    """Problems 1 and 2 (answers "2", "4") have no variance. skip: step 1 (problems 0, 1) still steps, step 2
    (2, 3) too; resample: each slot whose group is flat draws the next problem, the slots refilled in one decode."""
    skip = tmp_path / "skip"
    _run(tiny_model_dir, tiny_data_file, skip, monkeypatch, capsys, "problems_per_step=2", "zero_variance=skip",
         "num_problems=2", flat=("2",))
    _run(tiny_model_dir, tiny_data_file, tmp_path / "skip2", monkeypatch, capsys, "problems_per_step=2",
         "zero_variance=skip", "num_problems=2", flat=("0", "2"))
    assert _jsonl(skip / "metrics.jsonl")[0]["update_norm"] > 0
    assert _jsonl(tmp_path / "skip2" / "metrics.jsonl")[0]["update_norm"] == 0.0  # both groups flat: no AdamW step
    out = _run(tiny_model_dir, tiny_data_file, tmp_path / "resample", monkeypatch, capsys, "problems_per_step=2",
               "zero_variance=resample", "resample_limit=2", flat=("0", "2"), err=True)
    m = _jsonl(tmp_path / "resample" / "metrics.jsonl")
    # step 1: problems 0 and 1 are flat; both slots refill in one decode, with 2 and 3
    assert "generating 2 x 4 rollouts (problems 0, 1)" in out and "generating 2 x 4 rollouts (problems 2, 3)" in out
    assert m[0]["problems"] == [2, 3] and m[0]["problems_drawn"] == 4
    assert [g["problem_index"] for g in m[0]["set_aside"]] == [0, 1] and m[1]["problems"] == [4, 5]
    rollouts = _jsonl(tmp_path / "resample" / "rollouts.jsonl")
    assert [(r["problem_index"], r.get("set_aside", False)) for r in rollouts[:16:4]] == \
           [(0, True), (2, False), (1, True), (3, False)]
    assert "problems drawn          6 for 2 optimizer steps; 2 zero-variance groups set aside" in out
    # resample_limit is each slot's: problems 1 and 2 flat, slot 1 draws 1 then 2 and trains on 2 (its limit
    # of 2 groups), though slot 0 left its draws unused and the step's candidates hold 3 (with variance)
    _run(tiny_model_dir, tiny_data_file, tmp_path / "limit", monkeypatch, capsys, "problems_per_step=2",
         "zero_variance=resample", "resample_limit=2", flat=("2", "4"))
    m = _jsonl(tmp_path / "limit" / "metrics.jsonl")
    assert m[0]["problems"] == [0, 2] and m[0]["problems_drawn"] == 3 and m[1]["problems"] == [3, 4]


@pytest.mark.parametrize("setting, fragment", [
    ("problems_per_step=0", "config key 'problems_per_step' must be an integer in [1, num_problems 4]"),
    ("problems_per_step=-2", "config key 'problems_per_step' must be an integer in [1, num_problems 4]"),
    ("problems_per_step=5", "config key 'problems_per_step' must be an integer in [1, num_problems 4]"),
    ("problems_per_step=2.5", "problems_per_step"),
    ("credit=tree", "config key 'problems_per_step' must be 1 with credit: tree"),
])
def test_bad_problems_per_step_is_one_line_and_exit_2(tiny_model_dir, tiny_data_file, tmp_path, capsys, setting,
                                                      fragment):
    extra = [setting, "problems_per_step=2"] if setting == "credit=tree" else [setting]
    code = T.main(main_args(tiny_model_dir, tiny_data_file, tmp_path / "bad", "num_problems=4", *extra))
    assert code == 2
    one_line_error(capsys, fragment)
    assert not (tmp_path / "bad").exists()


def test_left_padding_counts_each_rows_positions_from_its_first_real_token():
    """Prompts of lengths 3 and 2: the second is padded on the left, its pad masked and its positions 0, 1 at its
    real tokens (the mask's cumsum - 1; the pad's position is 1, never read)."""
    batch, mask, positions = T.left_padded([torch.tensor([5, 6, 7]), torch.tensor([8, 9])], 0)
    assert batch.tolist() == [[5, 6, 7], [0, 8, 9]] and mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert positions.tolist() == [[0, 1, 2], [1, 0, 1]]
    assert T.left_padded([torch.tensor([5, 6]), torch.tensor([8, 9])], 0)[1:] == (None, None)  # one length: no mask


def test_the_next_steps_candidates_follow_the_problems_trained():
    """5 problems at P = 2 after 2 steps (0,1 / 2,3): the last step takes problem 4 alone, draw 5; after 1 step,
    problems 2 and 3 (draws 3, 4)."""
    problems = [{"index": i} for i in range(5)]
    cfg = T.Config(num_problems=5, problems_per_step=2)
    s = T.RunState(None, [], problems, [], T.run_steps(5, cfg), 5, [])
    s.history = [dict(step=1, problem_index=0, problems=[0, 1], problems_drawn=2)]
    assert T.run_candidates(s, cfg) == ([problems[2], problems[3]], 3, 2)
    s.history.append(dict(step=2, problem_index=2, problems=[2, 3], problems_drawn=2))
    assert T.run_candidates(s, cfg) == ([problems[4]], 5, 1)


def test_the_kl_figure_is_per_token_of_every_group_of_the_step():
    """Two groups with 14 and 4 response tokens and k3 sums 1.0 and 0.8: kl 1.8 / 18 = 0.1 (not over the first
    group's 14 tokens alone: 0.1286); the clipped fraction likewise over the 18 tokens."""
    slots = [T.Slot({"index": k}, None, [], _group_of(tokens)) for k, tokens in enumerate(([4, 2, 5, 3], [1, 1, 1, 1]))]
    done = [T.Pass(-0.5, [0.0] * 4, kl=1.0, clipped=9.0), T.Pass(-0.25, [0.0] * 4, kl=0.8, clipped=0.0)]
    figures = T.epoch_figures(1, done, 2.0, 0.1, slots, T.Config(kl_coef=0.1, ppo_epochs=2, problems_per_step=2))
    assert figures["kl"] == pytest.approx(0.1, abs=1e-12) and figures["clipped_fraction"] == 0.5
    assert figures["policy_loss"] == -0.75


def _group_of(tokens):
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    return T.Group(["x"] * 4, [verdict(x == 1.0) for x in r.tolist()], tokens, [False] * 4, r, False)


def test_the_rollout_streams_are_keyed_by_each_problems_draw(tiny_model_dir, tiny_data_file, tmp_path, monkeypatch,
                                                             capsys):
    """4 problems at P = 2: each group's streams are keyed by its own draw (its place in the data: 1, 2, 3, 4),
    not by the step (1, 1, 2, 2), so a problem's rollouts are those it gets at P = 1."""
    keys, real = [], T.rollout_streams
    monkeypatch.setattr(T, "rollout_streams", lambda seed, draw, rollouts, device: keys.append(draw) or real(
        seed, draw, rollouts, device))
    _run(tiny_model_dir, tiny_data_file, tmp_path / "p2", monkeypatch, capsys, "problems_per_step=2")
    assert keys == [1, 2, 3, 4]


def test_the_schedule_spans_the_runs_steps_not_its_problems():
    """5 problems, 2 a step: 3 steps (the last takes one), and a linear schedule decays over those 3."""
    cfg = T.Config(num_problems=5, problems_per_step=2, lr_schedule="linear", learning_rate=1.0)
    assert T.run_steps(5, cfg) == 3
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = T.lr_scheduler(cfg, opt, T.run_steps(5, cfg))
    rates = []
    for _ in range(3):
        rates.append(opt.param_groups[0]["lr"])
        T.next_learning_rate(scheduler)
    assert rates == pytest.approx([1.0, 2 / 3, 1 / 3])
    with pytest.raises(T.UserError, match="below the run's 3 steps"):
        T.validate_config(T.Config(num_problems=5, problems_per_step=2, warmup_steps=3))


def test_an_evaluation_only_run_takes_any_problems_per_step():
    """num_problems 0 trains nothing, so a yaml's problems_per_step 2 is not refused there (warmup_steps neither);
    0 still is, in its own words."""
    T.validate_config(T.Config(num_problems=0, eval_problems=2, problems_per_step=2, warmup_steps=3))
    with pytest.raises(T.UserError, match=r"^config key 'problems_per_step' must be an integer >= 1, got 0$"):
        T.validate_config(T.Config(num_problems=0, eval_problems=2, problems_per_step=0))


def test_the_memory_check_counts_every_row_of_the_steps_batch(monkeypatch):
    """check_memory's lower bound for the batch: G x P rows of (prompt + max_new_tokens) keys and values plus one
    step's float32 scores. Qwen3-0.6B's shape, a 100-token prompt, 512 new tokens: 8 rows need 0.576 GB."""
    config = SimpleNamespace(head_dim=128, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                             num_hidden_layers=28, vocab_size=151936)
    model, problems = SimpleNamespace(config=config), [{"prompt_ids": [1] * 100}]
    per_row = 612 * 28 * 2 * 8 * 128 * 2 + 3 * 151936 * 4
    assert 8 * per_row == 576_098_304
    monkeypatch.setattr(T, "available_memory", lambda device: 8 * per_row)
    T.check_memory(T.Config(max_new_tokens=512), model, problems, torch.device("cpu"))  # 8 rows fit exactly
    with pytest.raises(T.UserError, match=r"group_size 8 x problems_per_step 2 with max_new_tokens 512 needs at "
                                          r"least 1\.2 GB on cpu for generation, but 0\.6 GB are available; lower group_size, "
                                          r"problems_per_step or max_new_tokens"):
        T.check_memory(T.Config(max_new_tokens=512, problems_per_step=2), model, problems, torch.device("cpu"))
