"""Before/after evaluation: batched decoding, statistics, the eval table and files, evaluation-only
mode, resume without re-evaluation and bad input. CPU, tiny local models."""

import contextlib
import io
import itertools
import json
import math
import re
import shutil
import signal
from types import SimpleNamespace

import pytest
import torch
import yaml

import train_rlvr as T
import verifier
from conftest import ROOT, SHARED

# ----------------------------------------------------------------------------------------------
# Statistics against known values


@pytest.mark.parametrize("x, n, lo, hi", [  # Newcombe (1998), Statistics in Medicine 17:857, table I, method 3
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718),
    (29, 29, 0.8830, 1.0)])
def test_wilson_interval_matches_published_values(x, n, lo, hi):
    got = T.wilson_interval(x, n)
    assert got == pytest.approx((lo, hi), abs=5e-5)


def test_wilson_interval_by_its_formula_for_15_of_100():
    z = 1.959964
    center, half = (0.15 + z * z / 200) / (1 + z * z / 100), z * math.sqrt(0.15 * 0.85 / 100 + z * z / 40000) / (1 + z * z / 100)
    assert T.wilson_interval(15, 100) == pytest.approx((center - half, center + half), rel=1e-12)
    assert T.wilson_interval(15, 100) == pytest.approx((0.0931, 0.2328), abs=5e-5)
    assert T.wilson_interval(0, 0) == (0.0, 1.0)


@pytest.mark.parametrize("b, c, p", [
    (1, 9, 0.021484375), (9, 1, 0.021484375),   # 2 * 11 / 1024
    (0, 5, 0.0625), (3, 10, 756 / 8192), (5, 5, 1.0), (0, 0, 1.0), (4, 5, 1.0), (0, 30, 2 / 2 ** 30)])
def test_mcnemar_exact_p_known_values(b, c, p):
    assert T.mcnemar_exact_p(b, c) == p


def _pass_at_k_brute_force(n, c, k):
    """The probability that a random k-subset of n samples (c correct) holds a correct one, by counting."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_brute_force_over_all_k_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert T.pass_at_k(n, c, k) == pytest.approx(_pass_at_k_brute_force(n, c, k), abs=1e-12), (n, c, k)
    assert T.pass_at_k(10, 3, 1) == pytest.approx(0.3) and T.pass_at_k(200, 0, 100) == 0.0


# ----------------------------------------------------------------------------------------------
# Decoding: a problem in a batch gets the tokens it gets alone


def _prompts():
    g = torch.Generator().manual_seed(4)
    return [torch.randint(1, 300, (n,), generator=g) for n in (3, 11, 6, 1, 8)]


def test_eval_every_and_eval_samples_without_evaluation_are_said_once(capsys):
    """eval_problems 0 leaves evaluation off: eval_every and eval_samples changed there do nothing, said once; with
    evaluation on, or at their defaults, nothing is said."""
    config = ["--config", str(ROOT / "config.yaml")]
    T.load_config([*config, "eval_every=5", "eval_samples=4"])
    assert capsys.readouterr().err.splitlines() == [
        "warning: eval_every=5 is ignored: it acts only with eval_problems > 0 (evaluation on)",
        "warning: eval_samples=4 is ignored: it acts only with eval_problems > 0 (evaluation on)"]
    T.load_config([*config, "eval_every=5", "eval_samples=4", "eval_problems=3"])
    T.load_config(config)
    assert capsys.readouterr().err == ""


def test_left_padding_masks_and_positions():
    batch, mask, positions = T.left_padded([torch.tensor([5, 6, 7]), torch.tensor([8])], pad_id=0)
    assert batch.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert positions[0].tolist() == [0, 1, 2] and positions[1, 2].item() == 0  # real tokens count from 0
    same = T.left_padded([torch.tensor([1, 2])] * 3, pad_id=0)
    assert same[1] is None and same[2] is None  # one length (the rollouts): no mask, no position ids


@pytest.mark.parametrize("drop_finished", [True, False])
def test_batched_greedy_decoding_gives_each_problem_its_tokens_alone(tiny_model, drop_finished):
    model, _ = tiny_model
    prompts = _prompts()

    def greedy(ps, eos):
        responses, cut = T.decode(model, ps, 10, eos, T.greedy_pick, T.nullcontext(),
                                  drop_finished=drop_finished)
        return [r.tolist() for r in responses], cut
    alone = [greedy([p], -1)[0][0] for p in prompts]
    assert len({tuple(r) for r in alone}) > 1  # the prompts lead to different responses
    # an EOS that some rows emit partway and others never: rows stop at different steps
    eos = alone[0][3]
    alone, alone_cut = zip(*[(r[0], c[0]) for r, c in (greedy([p], eos) for p in prompts)])
    batched, batched_cut = greedy(prompts, eos)
    assert batched == list(alone) and batched_cut == list(alone_cut)
    assert {len(r) for r in batched} != {10} and True in batched_cut  # some stopped at EOS, some were cut


class _EchoPositions(torch.nn.Module):
    """Row r emits (its position id + 1) at every step and EOS (0) once its position reaches 5: a
    check of the position ids and the growing attention mask the decode loop passes."""

    def __init__(self, config):
        super().__init__()
        self.config, self.seen = config, []

    def forward(self, input_ids, past_key_values=None, use_cache=True, logits_to_keep=1, attention_mask=None,
                position_ids=None):
        self.seen.append((attention_mask.shape[1], position_ids[:, -1].tolist()))
        logits = torch.full((input_ids.shape[0], 1, 16), -1e4)
        for r, pos in enumerate(position_ids[:, -1].tolist()):
            logits[r, 0, 0 if pos >= 5 else pos + 1] = 0.0
        return SimpleNamespace(logits=logits)


@pytest.mark.parametrize("drop_finished", [False, True])
def test_each_row_counts_its_own_positions_and_stops_at_its_eos(tiny_model, drop_finished, monkeypatch):
    model, _ = tiny_model
    assert T.HOST_CHECK_EVERY == 1  # the CPU's end test at every token: rows leave right at their EOS
    echo = _EchoPositions(model.config)
    prompts = [torch.tensor([3, 3, 3, 3]), torch.tensor([3]), torch.tensor([3, 3])]
    responses, cut = T.decode(echo, prompts, 8, 0, T.greedy_pick, T.nullcontext(),
                              drop_finished=drop_finished)
    assert [r.tolist() for r in responses] == [[4, 5, 0], [1, 2, 3, 4, 5, 0], [2, 3, 4, 5, 0]]
    assert cut == [False, False, False]
    assert echo.seen[0] == (4, [3, 0, 1]) and echo.seen[1] == (5, [4, 1, 2])  # mask grows by one column
    if drop_finished:  # row 0 left after its EOS (3rd token), row 2 after its 5th
        assert [len(pos) for _, pos in echo.seen] == [3, 3, 3, 2, 2, 1]
        assert echo.seen[3] == (7, [3, 4]) and echo.seen[5] == (9, [5])
    else:
        assert [len(pos) for _, pos in echo.seen] == [3] * 6
    echo.seen.clear()
    monkeypatch.setattr(T, "HOST_CHECK_EVERY", 4)  # the end test every 4 tokens (a GPU's 8): the same responses
    again, _ = T.decode(echo, prompts, 8, 0, T.greedy_pick, T.nullcontext(),
                        drop_finished=drop_finished)
    assert [r.tolist() for r in again] == [r.tolist() for r in responses]
    # rows leave (and the loop stops) only at the checks after tokens 4 and 8: 8 forwards, not 6;
    # row 0 (EOS at token 3) leaves at the first check, rows 1 and 2 never need to
    assert [len(pos) for _, pos in echo.seen] == ([3] * 4 + [2] * 4 if drop_finished else [3] * 8)


def _eval_cfg(**kw):
    base = dict(device="cpu", eval_problems=5, eval_max_new_tokens=8, eval_batch_size=2)
    return T.Config(**{**base, **kw})


def _eval_problems():
    return [{"index": i, "problem": "", "answer": "7", "prompt_ids": p.tolist(), "level": "unknown",
             "subject": "unknown", "unique_id": None} for i, p in enumerate(_prompts())]


SCORER = SimpleNamespace(score=verifier.score)  # the verifier in-process: no worker needed for these


def _evaluate(model, tok, cfg, problems=None):
    records = T.evaluate(model, tok, problems or _eval_problems(), cfg, -1, SCORER, T.nullcontext(), "before", 0)
    return [{k: r[k] for k in ("problem_index", "sample", "response", "tokens", "cut_at_limit", "status")}
            for r in records]


@pytest.mark.parametrize("samples", [1, 3])
def test_evaluation_is_the_same_whatever_the_batch_size(tiny_model, samples):
    model, tok = tiny_model
    runs = [_evaluate(model, tok, _eval_cfg(eval_batch_size=b, eval_samples=samples, eval_temperature=1.0,
                                            eval_top_p=0.95)) for b in (1, 2, 5)]
    assert runs[0] == runs[1] == runs[2]
    assert [(r["problem_index"], r["sample"]) for r in runs[0]] == [(i, s) for i in range(5) for s in range(samples)]
    if samples > 1:  # each sample its own stream: different responses, a problem's own whatever else is evaluated
        assert len({r["response"] for r in runs[0] if r["problem_index"] == 1}) > 1
        alone = _evaluate(model, tok, _eval_cfg(eval_samples=samples, eval_temperature=1.0, eval_top_p=0.95),
                          _eval_problems()[1:2])
        assert alone == [r for r in runs[0] if r["problem_index"] == 1]
        other_seed = _evaluate(model, tok, _eval_cfg(eval_samples=samples, eval_temperature=1.0, eval_top_p=0.95,
                                                     seed=1))
        assert other_seed != runs[0]


@pytest.mark.parametrize("samples", [1, 2])
def test_with_prompt_pass_shared_evaluation_reads_the_prompts_common_start_once(tiny_model, samples):
    """Five prompts that share a 40-token few-shot start (then 3, 11, 6, 1 and 8 tokens of their own): with
    prompt_pass shared each batch runs those 40 once and every row reads only its own rest after them, greedy and
    sampled: the same responses as the per-row passes (on this model; in general up to float rounding)."""
    model, tok = tiny_model
    start = torch.randint(1, 300, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    problems = [dict(p, prompt_ids=start + p["prompt_ids"]) for p in _eval_problems()]
    widths = []
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: widths.append(
        tuple((args[0] if args else kwargs["input_ids"]).shape)), with_kwargs=True)
    kw = dict(eval_batch_size=2, eval_samples=samples, eval_temperature=1.0, eval_top_p=0.95)
    try:
        spec = _evaluate(model, tok, _eval_cfg(**kw), problems)
        spec_widths, widths[:] = list(widths), []
        shared = _evaluate(model, tok, _eval_cfg(prompt_pass="shared", **kw), problems)
    finally:
        hook.remove()
    assert shared == spec and len({r["response"] for r in spec}) > 1
    # the first batch (the shortest prompts: problems 3 and 0, 41 and 43 tokens): per row, one pass over both
    # prompts left-padded to 43; shared, the 40 once, then each row's rest (1 and 3 tokens) left-padded to 3
    assert [w for w in spec_widths if w[1] > 1][:1] == [(2 * samples, 43)]
    assert [w for w in widths if w[1] > 1][:2] == [(1, 40), (2 * samples, 3)]
    assert T.shared_length([torch.tensor(start + [5]), torch.tensor(start + [6, 7])]) == 40
    assert T.shared_length([torch.tensor([5, 6]), torch.tensor([5, 6])]) == 1  # each row keeps its last token
    assert T.shared_length([torch.tensor([5]), torch.tensor([5, 6])]) == 0


@pytest.mark.parametrize("samples", [1, 2])
def test_compiled_evaluation_gives_the_tokens_of_eager_evaluation(tiny_model, inductor, samples, monkeypatch):
    """compile=true: left-padded batches in a static cache, ended rows fed EOS instead of dropped,
    the last (smaller) batch filled up to the same shape: one compiled graph, and every record
    equals eager evaluation's, greedy and sampled, with an EOS that rows reach at different steps."""
    model, tok = tiny_model
    problems = _eval_problems()
    kw = dict(eval_batch_size=2, eval_samples=samples, eval_temperature=1.0, eval_top_p=0.95)

    def run(compile, eos, decoders=None):
        records = T.evaluate(model, tok, problems, _eval_cfg(compile=compile, **kw), eos, SCORER, T.nullcontext(),
                             "before", 0, decoders)
        return [{k: r[k] for k in ("problem_index", "sample", "response", "tokens", "cut_at_limit")} for r in records]
    first = T.greedy_pick if samples == 1 else T.sampling_pick(
        [torch.Generator().manual_seed(T.stream_seed(T.Config().seed, "eval", 0, 0))], 1.0, 0.95, "cpu")
    unended = T.decode(model, [torch.tensor(problems[0]["prompt_ids"])], 8, -1, first,
                       T.nullcontext())[0][0].tolist()
    eos = unended[3]  # problem 0's (first sample's) 4th token: some rows end partway, others run to the limit
    eager = run("false", eos)
    assert {r["tokens"] for r in eager} != {8} and any(r["cut_at_limit"] for r in eager)
    decoders = T.Decoders()
    decoders.plan("eval", problems, 8)
    torch._dynamo.utils.counters.clear()
    assert run("true", eos, decoders) == eager
    decoder = decoders.static["eval"][-1]
    assert decoder.checked and decoders.failed is None and decoder.batch_size == 2 * samples
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # the last batch of 1 took it too


def test_responses_are_scored_through_the_verifier_with_each_problems_reference():
    texts = ["so \\boxed{4}", "so \\boxed{5}", "no box here", "\\boxed{\\frac{1}{2}}"]
    scored = T.score_responses(SCORER, texts, ["4", "4", "4", "0.5"])
    assert [s[2] for s in scored] == ["correct", "wrong", "no_answer", "correct"]
    with verifier.TimedVerifier(timeout_s=5.0) as timed:
        assert T.score_responses(timed, texts, ["4", "4", "4", "0.5"]) == scored


# ----------------------------------------------------------------------------------------------
# The summary, the table and the paired line, from records made by hand


def _record(phase, step, i, sample, right, level="1", subject="Algebra", tokens=10, status=None, cut=False):
    return {"phase": phase, "step": step, "problem_index": i, "unique_id": f"u{i}", "level": level,
            "subject": subject, "sample": sample, "response": "", "answer": None, "reference": "1",
            "status": status or ("correct" if right else "wrong"), "reward": float(right), "tokens": tokens,
            "cut_at_limit": cut}


def test_summary_table_and_paired_line_for_greedy_records():
    # problems 0-9; before: 0, 1 right; after: 1-6 right -> improved 5 (2-6), regressed 1 (0), right both 1, wrong both 3
    before = [_record("before", 0, i, 0, i in (0, 1), level=str(1 + i % 2), subject="Algebra" if i < 6 else "unknown",
                      tokens=20, status="no_answer" if i >= 8 else None, cut=i == 9) for i in range(10)]
    after = [_record("after", 4, i, 0, 1 <= i <= 6, level=str(1 + i % 2), subject="Algebra" if i < 6 else "unknown",
                     tokens=5) for i in range(10)]
    summary = T.eval_summary(before + after, T.Config(eval_problems=10))
    groups = {g["group"]: g for g in summary["phases"]["after"]["groups"]}
    assert [g["group"] for g in summary["phases"]["before"]["groups"]] == ["overall", "level 1", "level 2", "Algebra",
                                                                          "unknown"]
    assert groups["overall"]["correct"] == 6 and groups["overall"]["accuracy"] == 0.6
    assert groups["overall"]["wilson95"] == list(T.wilson_interval(6, 10))
    assert (groups["unknown"]["n"], groups["unknown"]["correct"]) == (4, 1)
    paired = summary["comparison"]["paired"]
    assert (paired["improved"], paired["regressed"], paired["right_both_times"], paired["wrong_both_times"]) == (5, 1, 1, 3)
    assert paired["mcnemar_p"] == T.mcnemar_exact_p(5, 1) == 14 / 64
    assert summary["comparison"]["change_points"]["overall"]["accuracy"] == pytest.approx(40.0)
    fmt = summary["phases"]["before"]["format"]
    assert (fmt["no_answer_rate"], fmt["cut_at_limit_rate"], fmt["mean_response_tokens"]) == (0.2, 0.1, 20.0)

    table = T.format_eval_table(summary).splitlines()
    overall = next(l for l in table if l.startswith("overall")).split()
    assert overall == ["overall", "10", "2/10", "20.0%", "[5.7,", "51.0]", "6/10", "60.0%", "[31.3,", "83.2]", "+40.0"]
    assert any(l.startswith("unknown") and " 4 " in l for l in table)
    assert ("paired, per problem: 5 improved, 1 regressed, 1 right both times, 3 wrong both times; "
            "exact McNemar p = 0.219") in table
    assert next(l for l in table if l.startswith("no answer")).split()[2:] == ["20.0%", "0.0%"]
    assert next(l for l in table if l.startswith("mean response tokens")).split()[3:] == ["20.0", "5.0"]


def test_sampled_records_report_pass_at_1_and_pass_at_k_and_a_per_problem_sign_test():
    # 3 problems x 4 samples; correct counts before [0, 2, 4], after [1, 2, 4]
    counts_before, counts_after = [0, 2, 4], [1, 2, 4]
    before = [_record("before", 0, i, s, s < c) for i, c in enumerate(counts_before) for s in range(4)]
    after = [_record("after", 2, i, s, s < c) for i, c in enumerate(counts_after) for s in range(4)]
    summary = T.eval_summary(before + after, T.Config(eval_problems=3, eval_samples=4))
    overall = summary["phases"]["before"]["groups"][0]
    assert overall["accuracy"] == pytest.approx(6 / 12)
    assert overall["pass_at_k"]["1"] == pytest.approx(sum(T.pass_at_k(4, c, 1) for c in counts_before) / 3)
    assert overall["pass_at_k"]["2"] == pytest.approx(sum(T.pass_at_k(4, c, 2) for c in counts_before) / 3)
    assert overall["pass_at_k"]["4"] == pytest.approx(2 / 3)
    assert overall["wilson95"] == list(T.wilson_interval(6 / 4, 3))  # at n = problems, not n = samples
    paired = summary["comparison"]["paired"]
    assert (paired["improved"], paired["regressed"], paired["right_both_times"], paired["wrong_both_times"],
            paired["unchanged_in_between"]) == (1, 0, 1, 0, 1)
    table = T.format_eval_table(summary)
    assert "before pass@1" in table and "pass@4" in table and "exact sign (McNemar) test p = 1.000" in table


def test_levels_are_normalized_and_missing_fields_are_unknown(tmp_path):
    assert [T.normalize_level(v) for v in (3, "Level 3", " level 5 ", 2.0, None, "", "Level ?")] == [
        "3", "3", "5", "2", "unknown", "unknown", "?"]
    data = tmp_path / "e.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [
        {"problem": "a", "answer": "1", "level": "Level 2", "type": "Algebra"},
        {"problem": "b", "answer": "2", "subject": "Geometry", "unique_id": "test/g/1.json", "level": 4}]))
    got = T.load_eval_problems(T.Config(eval_dataset=str(data), eval_problems=2))
    assert [(p["level"], p["subject"], p["unique_id"]) for p in got] == [
        ("2", "unknown", None), ("4", "Geometry", "test/g/1.json")]


def test_the_shared_math500_file_loads_like_the_hub_set():
    data = SHARED / "data" / "math500_test.json"
    if not data.exists():
        pytest.skip("../shared/data not present (fresh clone): real-data check skipped")
    got = T.load_eval_problems(T.Config(eval_dataset=str(data), eval_problems=500))
    assert len(got) == 500 and {p["level"] for p in got} == {"1", "2", "3", "4", "5"}
    assert len({p["subject"] for p in got}) == 7 and got[0]["unique_id"] == "test/precalculus/807.json"


# ----------------------------------------------------------------------------------------------
# End to end: a tiny model whose accuracy moves, eval_every, resume without re-evaluation


def _first_char_odd(text):
    return bool(text) and ord(text[0]) % 2 == 1


def _fake_scores(monkeypatch):
    """The tiny random model answers every prompt alike, so scoring is a property it can learn:
    rollouts score 1 when their text starts with an odd character code. An evaluation problem's
    reference says what is right for it: 'odd' (the trained property), 'even' (the untrained one,
    which the tiny model starts with), 'any' (always right) or 'none' (never), so one run has
    problems that improve, regress, stay right and stay wrong."""
    def rollouts(scorer, texts, gold):
        return [T.Score(float(_first_char_odd(t)), None, "wrong") for t in texts]

    def responses(scorer, texts, golds):
        right = {"odd": _first_char_odd, "even": lambda t: not _first_char_odd(t),
                 "any": lambda t: True, "none": lambda t: False}
        return [(1.0, "x", "correct") if right[g](t) else (0.0, None, "no_answer" if g == "none" else "wrong")
                for t, g in zip(texts, golds)]
    monkeypatch.setattr(T, "score_rollouts", rollouts)
    monkeypatch.setattr(T, "score_responses", responses)


KINDS = ["odd", "odd", "even", "odd", "any", "none", "odd", "even", "odd", "odd", "any", "none"]


@pytest.fixture(scope="module")
def eval_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("evaldata")
    records = [{"problem": f"What is {i} + {i}?", "answer": kind, "level": 1 + i % 3,
                "subject": ["Algebra", "Geometry"][i % 2], "unique_id": f"test/{i}.json"} for i, kind in enumerate(KINDS)]
    (folder / "eval.json").write_text(json.dumps(records))
    (folder / "train.json").write_text(json.dumps([{"problem": f"What is {i} + 1?", "answer": "0"} for i in range(6)]))
    return folder


def _train_args(model_dir, data, out, *extra):
    return ["--config", str(ROOT / "config.yaml"), f"model={model_dir}", f"dataset={data / 'train.json'}",
            "device=cpu", f"output_dir={out}", "group_size=8", "max_new_tokens=1", "temperature=1.0", "top_p=1.0",
            "num_problems=4", "learning_rate=1e-1", "save_every=2", f"eval_dataset={data / 'eval.json'}",
            "eval_problems=12", "eval_max_new_tokens=2", "eval_batch_size=5", "eval_every=2", *extra]


@pytest.fixture(scope="module")
def moved(tiny_model_dir, eval_data, tmp_path_factory):
    """One whole run: evaluations before step 1, after step 2 (eval_every) and after step 4."""
    out = tmp_path_factory.mktemp("moved")
    planned, real_plan = [], T.Decoders.plan
    with pytest.MonkeyPatch.context() as mp:
        _fake_scores(mp)
        mp.setattr(T.Decoders, "plan", lambda self, use, problems, new: (
            planned.append((use, max(len(p["prompt_ids"]) for p in problems), new)),
            real_plan(self, use, problems, new)))
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = T.main(_train_args(tiny_model_dir, eval_data, out))
    assert code == 0, stderr.getvalue()
    return SimpleNamespace(out=out, stdout=stdout.getvalue(), stderr=stderr.getvalue(), planned=planned)


def test_a_run_sizes_each_static_cache_once_from_its_longest_prompt(moved, tiny_model, eval_data):
    """run() plans the rollouts' and the evaluation's static caches right after check_problems,
    from the longest tokenized prompt of each set and its max new tokens (one compile per use)."""
    _, tok = tiny_model
    cfg = T.Config()

    def longest(name, n):
        return max(len(tok(T.build_prompt(cfg.prompt_template, r["problem"]), add_special_tokens=False)["input_ids"])
                   for r in json.loads((eval_data / name).read_text())[:n])
    assert moved.planned == [("rollouts", longest("train.json", 4), 1), ("eval", longest("eval.json", 12), 2)]


def _records(out):
    return [json.loads(l) for l in (out / "eval.jsonl").read_text().splitlines()]


def test_before_and_after_on_a_tiny_model_whose_accuracy_moves(moved):
    records = _records(moved.out)
    assert [r["phase"] for r in records] == ["before"] * 12 + ["step-2"] * 12 + ["after"] * 12
    assert [r["step"] for r in records[::12]] == [0, 2, 4]
    assert records[0].keys() >= {"phase", "problem_index", "unique_id", "level", "subject", "sample", "response",
                                 "answer", "status", "reward", "tokens", "cut_at_limit"}
    right = {phase: {r["problem_index"] for r in records if r["phase"] == phase and r["reward"] == 1.0}
             for phase in ("before", "after")}
    assert right["before"] != right["after"] and len(right["after"]) > len(right["before"])  # it learned the property
    improved, regressed = right["after"] - right["before"], right["before"] - right["after"]
    both_right, both_wrong = right["after"] & right["before"], set(range(12)) - right["after"] - right["before"]
    assert improved and regressed and both_right and both_wrong

    # every number of the table and of eval_summary.json, recomputed from eval.jsonl
    summary = json.loads((moved.out / "eval_summary.json").read_text())
    cfg = T.Config(**yaml.safe_load((moved.out / "run_config.yaml").read_text()))
    assert summary == json.loads(json.dumps(T.eval_summary(records, cfg)))
    table = moved.stdout[moved.stdout.index("evaluation: "):].splitlines()
    cells = {re.split(r"\s{2,}", l)[0]: re.split(r"\s{2,}", l) for l in table[1:] if "  " in l}
    for phase, column in (("before", 2), ("after", 5)):
        mine = [r for r in records if r["phase"] == phase]
        for group in ("overall", "level 1", "level 2", "level 3", "Algebra", "Geometry"):
            sub = [r for r in mine if group == "overall" or group in (f"level {r['level']}", r["subject"])]
            c, n = sum(r["reward"] == 1.0 for r in sub), len(sub)
            assert cells[group][1] == str(n) and cells[group][column:column + 3] == [
                f"{c}/{n}", f"{100 * c / n:.1f}%", "[{:.1f}, {:.1f}]".format(*(100 * x for x in T.wilson_interval(c, n)))]
    before, after = (sum(r["reward"] == 1.0 for r in records if r["phase"] == ph) for ph in ("before", "after"))
    assert cells["overall"][8] == f"{100 * (after - before) / 12:+.1f}"
    p = T.mcnemar_exact_p(len(improved), len(regressed))
    assert (f"paired, per problem: {len(improved)} improved, {len(regressed)} regressed, {len(both_right)} right both "
            f"times, {len(both_wrong)} wrong both times; exact McNemar p = {T.format_p(p)}") in table
    no_answer = [sum(r["status"] == "no_answer" for r in records if r["phase"] == ph) / 12 for ph in ("before", "after")]
    assert next(l for l in table if l.startswith("no answer")).split()[2:] == [f"{100 * x:.1f}%" for x in no_answer]


def test_stdout_holds_the_tables_and_stderr_the_progress(moved):
    lines = moved.stdout.splitlines()
    assert lines[0].startswith("step  correct/8") and [l.split()[0] for l in lines[1:5]] == ["1", "2", "3", "4"]
    summary_at, eval_at = lines.index("") + 1, lines.index(next(l for l in lines if l.startswith("evaluation: ")))
    assert lines[summary_at].startswith("correct rollouts") and eval_at > summary_at
    assert "step-2" not in moved.stdout  # the stdout table compares before and after
    # the evaluation's tqdm bar, a line per batch on a pipe: problems done of the total, rate and ETA
    bars = [l for l in moved.stderr.splitlines() if l.startswith("[eval before]: ")]
    assert bars and re.search(r"\| 12/12 \[[0-9:]+<00:00, +[0-9.]+(problem/s|s/problem), tokens_per_s=\d+\]$",
                              bars[-1]), bars
    assert "[eval step-2] accuracy" in moved.stderr and "[eval after] accuracy" in moved.stderr


REAL_EVALUATE = T.evaluate


def _spy_evaluate(monkeypatch, stop_at_phase=None):
    """Record the phases evaluate() is called for; optionally deliver a SIGINT as one starts."""
    phases, real = [], REAL_EVALUATE

    def spy(model, tokenizer, problems, cfg, eos_id, scorer, amp, phase, step, decoders=None):
        phases.append(phase)
        if phase == stop_at_phase:
            T.STOP["signal"] = signal.SIGINT
        return real(model, tokenizer, problems, cfg, eos_id, scorer, amp, phase, step, decoders)
    monkeypatch.setattr(T, "evaluate", spy)
    return phases


def test_resume_does_not_redo_an_evaluation_and_ends_where_the_whole_run_did(moved, tiny_model_dir, eval_data,
                                                                            tmp_path, monkeypatch, capsys):
    _fake_scores(monkeypatch)
    out = tmp_path / "run"
    args = _train_args(tiny_model_dir, eval_data, out)
    # 1. stopped by SIGINT in step 3: the checkpoint of step 2 holds the evaluations before and after step 2
    calls, real_generate = [], T.generate_rollouts

    def generate(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            T.STOP["signal"] = signal.SIGINT
        return real_generate(*a, **k)
    monkeypatch.setattr(T, "generate_rollouts", generate)
    phases = _spy_evaluate(monkeypatch)
    assert T.main(args) == 130
    assert phases == ["before", "step-2"]
    assert json.loads((T.list_checkpoints(out)[-1] / "state.json").read_text())["eval_steps_done"] == [0, 2]
    monkeypatch.setattr(T, "generate_rollouts", real_generate)

    # 2. resumed, and stopped again as the after-evaluation starts: nothing evaluated again
    phases = _spy_evaluate(monkeypatch, stop_at_phase="after")
    assert T.main(args + ["resume=auto"]) == 130
    assert phases == ["after"]
    assert "stopped by SIGINT during the after evaluation" in capsys.readouterr().err
    assert json.loads((T.list_checkpoints(out)[-1] / "state.json").read_text())["eval_steps_done"] == [0, 2]

    # 3. resumed: only the after-evaluation runs, and the checkpoint records it
    phases = _spy_evaluate(monkeypatch)
    assert T.main(args + ["resume=auto"]) == 0
    assert phases == ["after"]
    assert json.loads((T.list_checkpoints(out)[-1] / "state.json").read_text())["eval_steps_done"] == [0, 2, 4]
    assert (out / "eval.jsonl").read_text() == (moved.out / "eval.jsonl").read_text()
    assert (out / "eval_summary.json").read_text() == (moved.out / "eval_summary.json").read_text()
    first = capsys.readouterr().out

    # 4. resuming the finished run evaluates nothing and prints the same tables
    phases = _spy_evaluate(monkeypatch)
    assert T.main(args + ["resume=auto"]) == 0
    assert phases == []
    again = capsys.readouterr().out
    assert again[again.index("evaluation: "):] == first[first.index("evaluation: "):]


def test_a_run_extended_to_more_problems_renames_its_old_after(tmp_path):
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(_record(ph, s, 0, 0, True)) + "\n"
                                                 for ph, s in (("before", 0), ("after", 4))))
    assert [r["phase"] for r in T.read_eval_log(tmp_path, [0, 4], 6)] == ["before", "step-4"]
    assert T.read_eval_log(tmp_path, None, 6) == []


# ----------------------------------------------------------------------------------------------
# Evaluation only


def test_evaluation_only_writes_its_three_files_and_builds_no_optimizer(tiny_model_dir, eval_data, tmp_path,
                                                                        monkeypatch, capsys):
    def no_optimizer(*a, **k):
        raise AssertionError("evaluation only must not build an optimizer")
    monkeypatch.setattr(T.torch.optim, "AdamW", no_optimizer)
    out = tmp_path / "eval"
    args = ["--config", str(ROOT / "config.yaml"), f"model={tiny_model_dir}", "device=cpu", f"output_dir={out}",
            "dataset=/nonexistent/train.json", "num_problems=0", "eval_problems=4", "eval_max_new_tokens=3",
            f"eval_dataset={eval_data / 'eval.json'}"]
    assert T.main(args) == 0
    captured = capsys.readouterr()
    assert sorted(p.name for p in out.iterdir()) == ["eval.jsonl", "eval_summary.json", "run_config.yaml"]  # no lock
    records = _records(out)
    assert [(r["phase"], r["step"], r["problem_index"]) for r in records] == [("model", None, i) for i in range(4)]
    assert all(r["status"] in ("wrong", "no_answer") and r["tokens"] <= 3 for r in records)  # the real verifier
    lines = captured.out.splitlines()
    assert lines[0].startswith("evaluation: 4 problems of ") and lines[1].split()[:3] == ["group", "n", "model"]
    assert "paired" not in captured.out and "[eval model] accuracy" in captured.err
    summary = json.loads((out / "eval_summary.json").read_text())
    assert list(summary["phases"]) == ["model"] and "comparison" not in summary

    assert T.main(args) == 2  # an evaluation is not overwritten silently
    assert "already holds an evaluation" in capsys.readouterr().err
    assert T.main(args + ["overwrite=true"]) == 0


def test_evaluation_only_never_writes_into_a_training_run(eval_data, tmp_path, capsys, monkeypatch):
    _no_model(monkeypatch)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert T.main(["--config", str(ROOT / "config.yaml"), "device=cpu", f"output_dir={tmp_path}", "num_problems=0",
                   "eval_problems=1", "overwrite=true", f"eval_dataset={eval_data / 'eval.json'}"]) == 2
    _assert_one_error_line(capsys.readouterr().err, "holds a training run; evaluation only (num_problems=0) writes")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != T.LOCK_FILE) == ["metrics.jsonl"]


# ----------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, before the model loads


def _no_model(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model must not load")
    monkeypatch.setattr(T, "load_model_and_tokenizer", refuse)


def _assert_one_error_line(err, fragment):
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: ") and fragment in lines[-1], err
    assert sum(l.startswith("error") for l in lines) == 1 and "Traceback" not in err


@pytest.mark.parametrize("records, extra, fragment", [
    ([{"question": "q", "answer": "1"}], [], "eval_dataset has no field 'problem' (set problem_field); its fields are: question, answer"),
    ([{"problem": "q", "solution": "1"}], [], "eval_dataset has no field 'answer' (set answer_field)"),
    ([{"problem": "q", "answer": "1"}] * 2, [], "eval_dataset has 2 records but eval_problems = 3; lower eval_problems"),
])
@pytest.mark.parametrize("mode", ["train", "eval-only"])
def test_eval_data_errors_are_one_line_before_the_model_loads(tiny_data_file, tmp_path, capsys, monkeypatch,
                                                             records, extra, fragment, mode):
    _no_model(monkeypatch)
    data = tmp_path / "e.json"
    data.write_text(json.dumps(records))
    args = ["--config", str(ROOT / "config.yaml"), "device=cpu", f"output_dir={tmp_path / 'out'}",
            f"dataset={tiny_data_file}", f"eval_dataset={data}", "eval_problems=3",
            *(["num_problems=2"] if mode == "train" else ["num_problems=0"]), *extra]
    assert T.main(args) == 2
    _assert_one_error_line(capsys.readouterr().err, fragment)


def test_missing_eval_file_is_one_line(tmp_path, capsys, monkeypatch):
    _no_model(monkeypatch)
    assert T.main(["--config", str(ROOT / "config.yaml"), "device=cpu", f"output_dir={tmp_path}", "num_problems=0",
                   "eval_problems=5", f"eval_dataset={tmp_path / 'nope.json'}"]) == 2
    _assert_one_error_line(capsys.readouterr().err, "eval_dataset file")


def test_an_eval_prompt_too_long_for_the_context_follows_bad_records(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "e.json"
    data.write_text(json.dumps([{"problem": "What is 1 + 1?", "answer": "2"}, {"problem": "x " * 3000, "answer": "1"}]))
    args = ["--config", str(ROOT / "config.yaml"), f"model={tiny_model_dir}", "device=cpu", "num_problems=0",
            "eval_problems=2", f"eval_dataset={data}", "eval_max_new_tokens=2"]
    assert T.main(args + [f"output_dir={tmp_path / 'a'}"]) == 2
    _assert_one_error_line(capsys.readouterr().err, "eval_dataset record 1: its prompt has")
    assert T.main(args + [f"output_dir={tmp_path / 'b'}", "bad_records=skip"]) == 0
    assert "skipping eval_dataset record 1" in capsys.readouterr().err
    assert [r["problem_index"] for r in _records(tmp_path / "b")] == [0]


def test_eval_settings_default_to_off_and_the_anchors_evaluation():
    cfg = T.load_config(["--config", str(ROOT / "config.yaml")])
    assert (cfg.eval_dataset, cfg.eval_split, cfg.eval_problems) == ("HuggingFaceH4/MATH-500", "test", 0)
    assert (cfg.eval_max_new_tokens, cfg.eval_samples, cfg.eval_every) == (2048, 1, 0)
    with pytest.raises(T.UserError, match="'resume' must be empty with num_problems 0"):
        T.load_config(["--config", str(ROOT / "config.yaml"), "num_problems=0", "eval_problems=5", "resume=auto"])
