"""Watching a run (docs/watching.md): the tqdm bars on stderr, report_to=tensorboard read back with
TensorBoard's own event reader, report_to=wandb in offline mode read back from its run file, run.png's
figure, and what happens when a package is missing."""

import importlib.util
import json
import re
import struct

import numpy
import pytest

import train_rlvr as T
from conftest import ROOT
from run_helpers import verdict

tensorboard = pytest.importorskip("tensorboard", reason="requirements-test.txt installs tensorboard")
matplotlib = pytest.importorskip("matplotlib", reason="requirements-test.txt installs matplotlib")
wandb = pytest.importorskip("wandb", reason="requirements-test.txt installs wandb")
if importlib.util.find_spec("trackio") is None:  # not imported here: it reads TRACKIO_DIR when imported
    pytest.skip("requirements-test.txt installs trackio", allow_module_level=True)


def _args(model_dir, data, out, *extra):
    return ["--config", str(ROOT / "config.yaml"), f"model={model_dir}", f"dataset={data}", "device=cpu",
            f"output_dir={out}", "group_size=4", "max_new_tokens=8", "num_problems=3", "save_every=2",
            f"eval_dataset={data}", "eval_problems=2", "eval_max_new_tokens=2", *extra]


def _parity_rewards(monkeypatch):
    """Odd-length responses score 1: groups with reward variance, so the steps train."""
    monkeypatch.setattr(T, "score_rollouts", lambda scorer, texts, gold: [verdict(len(t) % 2 == 1) for t in texts])
    monkeypatch.setattr(T, "score_responses", lambda scorer, texts, golds: [
        (float(len(t) % 2 == 1), None, "wrong") for t in texts])


@pytest.fixture(scope="module")
def watched(tiny_model_dir, tiny_data_file, tmp_path_factory):
    """Three steps reported to TensorBoard, wandb and trackio, then resumed from the step-2 checkpoint (redoing 3)."""
    out = tmp_path_factory.mktemp("watched")
    runs = []
    with pytest.MonkeyPatch.context() as mp:
        _parity_rewards(mp)
        mp.setenv("WANDB_MODE", "offline")  # no network: wandb writes its run under output_dir/wandb
        mp.setenv("TRACKIO_DIR", str(out / "trackio-store"))  # trackio's local store (read as it is imported)
        for extra in ([], [f"resume={out / 'checkpoints' / 'step-000002'}"]):
            import contextlib
            import io

            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                code = T.main(_args(tiny_model_dir, tiny_data_file, out, "report_to=tensorboard,wandb,trackio", *extra))
            assert code == 0, err.getvalue()
            runs.append(err.getvalue())
    return out, runs


def _events(out):
    """The folder as TensorBoard's own reader sees it (the one its app uses: every value a tensor, purges applied)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    return lambda tag: [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in acc.Tensors(tag)]


def test_tensorboard_holds_metrics_jsonl_once_per_step_after_a_resume(watched):
    out, _ = watched
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = _events(out)
    for name, key in (("reward", "reward_mean"), ("reward_std", "reward_std"), ("grad_norm", "grad_norm"),
                      ("loss", "policy_loss"), ("step_time", "seconds"), ("correct", "correct")):
        got = events(name)
        # step 3 ran twice (before and after the resume): purge_step keeps one
        assert [s for s, _ in got] == [1, 2, 3], (name, got)
        assert [v for _, v in got] == pytest.approx([float(m[key]) for m in metrics], rel=1e-6), name
    assert [v for _, v in events("completions/mean_length")] == pytest.approx(
        [m["response_tokens"] / 4 for m in metrics])
    assert [v for _, v in events("frac_reward_zero_std")] == [float(m["reward_std"] == 0) for m in metrics]
    # TRL's clipped_ratio: the fraction of the step's rollouts cut at max_new_tokens, from rollouts.jsonl
    cut = [sum(r["cut_at_limit"] for r in map(json.loads, (out / "rollouts.jsonl").read_text().splitlines())
               if r["step"] == step) / 4 for step in (1, 2, 3)]
    assert [v for _, v in events("completions/clipped_ratio")] == pytest.approx(cut) and 0 < max(cut) <= 1
    summary = json.loads((out / "eval_summary.json").read_text())
    for phase in summary["phases"].values():
        overall = next(g for g in phase["groups"] if g["kind"] == "overall")
        assert [v for s, v in events("eval/accuracy") if s == phase["step"]] == pytest.approx(
            [overall["accuracy"]])
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    text = events("rollouts/text_summary")
    assert [step for step, _ in text] == [1, 2, 3]
    last = text[-1][1].decode()
    assert last.count("\n| ") == 4 and f"| 3 | {rollouts[-1]['reward']} |" in last


def test_the_completion_ratios_are_fractions_of_the_group():
    """TRL's completions/clipped_ratio and no_answer_ratio are fractions of the group (3 of 4 cut
    at the limit: 0.75; 1 of 4 without an answer: 0.25), the mean length tokens per rollout."""
    m = dict(step=2, group_size=4, correct=1, reward_mean=0.25, reward_std=0.5, response_tokens=22, cut_at_limit=3,
             no_answer=1, policy_loss=-0.5, grad_norm=2.0, update_norm=0.1, skipped=False, seconds=1.0,
             timings={"generation": 0.5})
    scalars = T.step_scalars(m, [m])
    assert (scalars["completions/clipped_ratio"], scalars["completions/no_answer_ratio"],
            scalars["completions/mean_length"], scalars["tokens_per_second"]) == (0.75, 0.25, 5.5, 44.0)


def test_frac_reward_zero_std_is_the_fraction_of_the_steps_groups():
    """problems_per_step 2: groups with sample std 0.5 and 0 make frac_reward_zero_std 0.5 (a fraction, not a count
    of 1), and the run's zero-variance groups count 1."""
    groups = [dict(group_size=4, reward_std=0.5, correct=1), dict(group_size=4, reward_std=0.0, correct=0)]
    m = dict(step=1, group_size=4, correct=1, reward_mean=0.125, reward_std=0.25, response_tokens=40, cut_at_limit=0,
             no_answer=0, policy_loss=-0.5, grad_norm=2.0, update_norm=0.1, skipped=False, seconds=1.0,
             timings={"generation": 0.5}, groups=groups, problems=[0, 1])
    scalars = T.step_scalars(m, [m])
    assert (scalars["frac_reward_zero_std"], scalars["run/zero_variance_groups"]) == (0.5, 1)
    assert scalars["completions/mean_length"] == 5.0  # 40 tokens over 2 x 4 rollouts


def _wandb_records(run_file):
    """The records of a wandb run file (what `wandb sync` uploads): 7-byte header, then 32 KiB blocks of
    chunks (crc32, length, type: 1 whole, 2 first, 3 middle, 4 last), each record a wandb Record protobuf."""
    from wandb.proto import wandb_internal_pb2

    data, pos, record = run_file.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        record, pos = record + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            yield parsed
            record = b""


def test_wandb_offline_holds_the_run_and_a_resume_continues_it(watched):
    out, _ = watched
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    run_files = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 2  # the first run and the resumed one
    ids = [[r.run.run_id for r in _wandb_records(f) if r.WhichOneof("record_type") == "run"][0] for f in run_files]
    state = json.loads((out / "checkpoints" / "step-000002" / "state.json").read_text())
    assert ids == [state["wandb_run_id"]] * 2  # the checkpoint's id: the same wandb run
    rows = {}
    for n, f in enumerate(run_files):
        for r in _wandb_records(f):
            if r.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
                rows.setdefault(n, []).append(row)
    first, resumed = ([r for r in rows[n] if "reward" in r] for n in (0, 1))
    assert [r["_step"] for r in first] == [1, 2, 3] and [r["_step"] for r in resumed] == [3]
    for r, m in zip(first[:2] + resumed, metrics):
        assert (r["reward"], r["grad_norm"], r["loss"], r["correct"]) == (
            m["reward_mean"], m["grad_norm"], m["policy_loss"], m["correct"])
    tables = [item for r in _wandb_records(run_files[1]) if r.WhichOneof("record_type") == "history"
              for item in r.history.item if "/".join(item.nested_key) == "rollouts/nrows"]
    assert [json.loads(t.value_json) for t in tables] == [4]  # the step's rollouts as a table
    summary = json.loads((out / "eval_summary.json").read_text())
    accuracy = {r["_step"]: r["eval/accuracy"] for n in rows for r in rows[n] if "eval/accuracy" in r}
    assert accuracy == {p["step"]: next(g["accuracy"] for g in p["groups"] if g["kind"] == "overall")
                        for p in summary["phases"].values()}


def test_trackio_local_store_holds_each_step_once_after_a_resume(watched):
    out, _ = watched
    from trackio.sqlite_storage import SQLiteStorage

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    state = json.loads((out / "checkpoints" / "step-000002" / "state.json").read_text())
    assert SQLiteStorage.get_runs("rlvr") == [state["trackio_run"]]  # the resumed run continued it
    logs = SQLiteStorage.get_logs("rlvr", state["trackio_run"])
    steps = [l for l in logs if "reward" in l]
    assert [l["step"] for l in steps] == [1, 2, 3]
    for l, m in zip(steps, metrics):
        assert (l["reward"], l["grad_norm"], l["loss"], l["correct"]) == (
            m["reward_mean"], m["grad_norm"], m["policy_loss"], m["correct"])
        assert [r["reward"] for r in l["rollouts"]["_value"]] == [
            r["reward"] for r in map(json.loads, (out / "rollouts.jsonl").read_text().splitlines())
            if r["step"] == m["step"]]
    assert SQLiteStorage.get_run_config("rlvr", state["trackio_run"])["group_size"] == 4


def test_the_step_bar_prints_a_line_per_step_off_a_terminal(watched):
    _, (first, resumed) = watched
    bar = [l for l in first.splitlines() if l.startswith("steps: ")]
    assert [re.search(r"\| (\d)/3 \[", l).group(1) for l in bar] == ["1", "2", "3"]
    assert re.search(r"\| 3/3 \[[0-9:]+<00:00, +[0-9.]+(s/step|step/s), correct=\d/4\]$", bar[-1]), bar[-1]
    assert [re.search(r"\| (\d)/3 \[", l).group(1) for l in resumed.splitlines() if l.startswith("steps: ")] == ["3"]
    assert "[step 3] generating 4 rollouts" in first and "[step 3] rewards" in first  # the progress lines stay


def test_run_png_draws_the_runs_numbers(watched, tiny_model_dir, capsys):
    out, _ = watched
    assert (out / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    fig = T.run_figure(metrics, records)
    correct, norms, tokens, accuracy = fig.axes
    assert [p.get_height() for p in correct.patches] == [m["correct"] for m in metrics]
    grad, update = norms.get_lines()
    gap = float("nan")  # a log axis: 0 is drawn as a gap
    numpy.testing.assert_equal(grad.get_ydata(), [m["grad_norm"] or gap for m in metrics])
    numpy.testing.assert_equal(update.get_ydata(), [m["update_norm"] or gap for m in metrics])
    assert norms.get_yscale() == "log"
    assert list(tokens.get_lines()[0].get_ydata()) == [m["response_tokens"] for m in metrics]
    for line, phase in zip(accuracy.get_lines(), ("before", "after")):
        mine = [r for r in records if r["phase"] == phase]
        accuracy_of = sum(r["reward"] for r in mine) / len(mine)
        assert list(line.get_ydata()) == [accuracy_of, accuracy_of]  # overall and its one level, "level 1"
    assert [t.get_text() for t in accuracy.get_xticklabels()] == ["overall", "level 1"]
    (out / "run.png").unlink()
    assert T.main(["--plot", str(out)]) == 0 and (out / "run.png").exists()
    assert T.main(["--plot", str(tiny_model_dir)]) == 2
    assert capsys.readouterr().err.strip().endswith("holds no metrics.jsonl with a step in it; pass a run's output_dir")


def _hand_made_run():
    """Ten steps of a group of 8 with zero-variance groups at 0 and at 8 correct, and an evaluation whose
    "after" is 100 % on every level."""
    correct = [2, 0, 8, 5, 8, 0, 3, 8, 6, 8]
    metrics = [dict(step=s, group_size=8, correct=c, reward_std=0.0 if c in (0, 8) else 0.5, response_tokens=90 - s,
                    grad_norm=0.0 if c in (0, 8) else 3.0 + s / 10, update_norm=0.0 if c in (0, 8) else 0.01)
               for s, c in enumerate(correct, 1)]
    evals = [dict(phase=phase, step=0 if phase == "before" else 10, sample=0, problem_index=i, level=str(1 + i % 3),
                  subject="Algebra", reward=1.0 if phase == "after" or i % 2 else 0.0, status="ok", cut_at_limit=False,
                  tokens=9) for phase in ("before", "after") for i in range(12)]
    return metrics, evals


def _drawn(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()  # lays it out: the extents below are the PNG's, in pixels
    return fig


def _whole_markers(ax):
    """Every marker of the Axes' lines drawn whole: inside the Axes, or not clipped by it."""
    box = ax.get_window_extent()
    for line in ax.get_lines():
        if line.get_marker() in (None, "None", "") or not line.get_clip_on():
            continue
        r = line.get_markersize() * ax.figure.dpi / 72 / 2
        for x, y in ax.transData.transform(line.get_xydata()):
            if numpy.isfinite(y):
                assert box.x0 <= x - r and x + r <= box.x1 and box.y0 <= y - r and y + r <= box.y1, (
                    ax.get_title(), line.get_label(), ax.transData.inverted().transform((x, y)))


def test_run_png_crosses_the_steps_with_no_gradient_not_every_zero_variance_group():
    """With credit: steps (or monte_carlo) a zero-variance group can have a gradient: step 2 (0 correct, grad norm
    2.5) is a grey bar without a cross; the crosses are at the steps whose grad norm is 0."""
    metrics, _ = _hand_made_run()
    metrics[1] = dict(metrics[1], grad_norm=2.5, update_norm=0.01)
    fig = _drawn(T.run_figure(metrics, []))
    crosses = [line for line in fig.axes[0].get_lines() if line.get_marker() == "x"]
    assert [list(map(int, line.get_xdata())) for line in crosses] == [[3, 5, 6, 8, 10]]
    grey = [m["step"] for p, m in zip(fig.axes[0].patches, metrics) if tuple(p.get_facecolor())[:3] != (
        fig.axes[0].patches[0].get_facecolor()[:3])]
    assert grey == [2, 3, 5, 6, 8, 10]


@pytest.mark.parametrize("evaluated", [True, False])
def test_run_png_names_every_axis_and_hides_nothing(evaluated):
    metrics, evals = _hand_made_run()
    fig = _drawn(T.run_figure(metrics, evals if evaluated else []))
    axes = fig.axes
    assert len(axes) == (4 if evaluated else 3)
    for ax in axes:
        assert ax.get_xlabel() and ax.get_ylabel(), ax.get_title()
        assert ax.get_window_extent().height > fig.dpi, ax.get_title()  # laid out: each panel over an inch tall
    assert [ax.get_xlabel() for ax in axes[:3]] == ["step"] * 3
    assert axes[0].get_xlim() == axes[1].get_xlim() == axes[2].get_xlim()  # a step at one x on every panel
    # the legend names both colours of the bars, the grey of the zero-variance groups among them
    bars = {tuple(p.get_facecolor()) for p in axes[0].patches}
    legend = axes[0].get_legend()
    named = {}
    for handle, text in zip(legend.legend_handles, legend.get_texts()):
        for h in handle if isinstance(handle, tuple) else (handle,):
            if hasattr(h, "get_facecolor") and not hasattr(h, "get_marker"):
                named[tuple(h.get_facecolor())] = text.get_text()
    flat = {tuple(p.get_facecolor()) for p, m in zip(axes[0].patches, metrics) if m["reward_std"] == 0}
    varied = bars - flat
    assert len(flat) == len(varied) == 1
    assert named.get(flat.pop()) == "zero-variance group"
    assert named.get(varied.pop()) == "correct rollouts"
    crosses = [line for line in legend.legend_handles if getattr(line, "get_marker", lambda: None)() == "x"]
    assert [t.get_text() for h, t in zip(legend.legend_handles, legend.get_texts()) if h in crosses] == [
        "no gradient (grad norm 0)"]
    # no legend over any data: each lies outside every Axes, inside the figure
    legends = [ax.get_legend() for ax in axes if ax.get_legend()]
    assert len(legends) == (3 if evaluated else 2)
    for leg in legends:
        box = leg.get_window_extent()
        assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1
        for ax in axes:
            assert not box.overlaps(ax.get_window_extent()), (leg.get_texts()[0].get_text(), ax.get_title())
    for ax in axes:  # the crosses at 0 correct, the "after" points at 100 %
        _whole_markers(ax)
    if evaluated:
        after = axes[3].get_lines()[-1]
        assert list(after.get_ydata()) == [1.0] * 4 and axes[3].get_ylim()[1] > 1


def test_run_png_lays_out_a_run_without_zero_variance_steps():
    import warnings

    metrics, evals = _hand_made_run()
    metrics = [{**m, "correct": 4, "reward_std": 0.5, "grad_norm": 3.0, "update_norm": 0.01} for m in metrics[:3]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns when constrained layout gives up
        fig = _drawn(T.run_figure(metrics, evals))
    for ax in fig.axes:
        assert ax.get_window_extent().height > fig.dpi, ax.get_title()  # each panel over an inch tall
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == [
        "correct rollouts", "zero-variance group", "no gradient (grad norm 0)"]


def test_run_png_counts_each_steps_p_x_g_rollouts_with_several_problems_a_step():
    """problems_per_step 2, groups of 4: step 2's 6 correct of 8 is a bar of 6 on an axis of 8, not a full 4/4."""
    metrics = [dict(step=s, group_size=4, problems=p, correct=c, reward_std=0.5, response_tokens=20, grad_norm=1.0,
                    update_norm=0.01) for s, p, c in ((1, [0, 1], 1), (2, [2, 3], 6), (3, [4], 2))]
    ax = _drawn(T.run_figure(metrics, [])).axes[0]
    assert ax.get_ylabel() == "correct / 2 x 4" and ax.get_ylim() == (0, 8)
    assert [p.get_height() for p in ax.patches] == [1, 6, 2]
    one = _drawn(T.run_figure([{k: v for k, v in m.items() if k != "problems"} for m in metrics], [])).axes[0]
    assert (one.get_ylabel(), one.get_ylim()) == ("correct / 4", (0, 4))  # the spec's P = 1: correct / G


def test_run_png_is_the_same_bytes_for_the_same_logs():
    import io

    metrics, evals = _hand_made_run()
    pngs = []
    for _ in range(2):
        buffer = io.BytesIO()
        T.run_figure(metrics, evals).savefig(buffer, format="png", dpi=100)
        pngs.append(buffer.getvalue())
    assert pngs[0] == pngs[1]


def test_a_missing_package_is_one_line_and_nothing_fails(tiny_model_dir, tiny_data_file, tmp_path, monkeypatch,
                                                       capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in (
        "tensorboard", "matplotlib") else real(name, *a))
    # the tracker: refused before the model loads (that model does not exist)
    assert T.main(_args("/no/such/model", tiny_data_file, tmp_path / "a", "report_to=tensorboard")) == 2
    assert capsys.readouterr().err == ("error: report_to names tensorboard, which is not installed here; "
                                       "pip install tensorboard (or drop it from report_to)\n")
    assert T.main(_args(tiny_model_dir, tiny_data_file, tmp_path / "a", "report_to=tensorbord")) == 2
    assert "config key 'report_to' must be none or one or more of tensorboard" in capsys.readouterr().err
    # the picture: said once, the run succeeds
    assert T.main(_args(tiny_model_dir, tiny_data_file, tmp_path / "b", "num_problems=1", "eval_problems=0")) == 0
    assert capsys.readouterr().err.count("needs matplotlib (pip install matplotlib") == 1
    assert not (tmp_path / "b" / "run.png").exists()


def test_the_trackers_leave_stdout_to_the_table(tiny_model_dir, tiny_data_file, tmp_path):
    """`python train_rlvr.py > table.txt` with every tracker on: trackio and wandb print on stderr or not at all
    (trackio's exit hook would print on stdout if its run were left open)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "WANDB_MODE": "offline", "TRACKIO_DIR": str(tmp_path / "store")}
    proc = subprocess.run([sys.executable, str(ROOT / "train_rlvr.py"), *_args(
        tiny_model_dir, tiny_data_file, tmp_path / "run", "num_problems=1", "eval_problems=0",
        "report_to=tensorboard,wandb,trackio")], capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == T.format_header(4) and lines[1].startswith("1 ") and lines[2] == ""
    assert lines[3].startswith("correct rollouts") and lines[-1].startswith("total time") and len(lines) == 10
    assert "Trackio" in proc.stderr
    assert "\x1b[" not in proc.stderr  # trackio's terminal colours, left out of a stderr that is no terminal



def test_wandb_without_a_key_is_one_line_before_output_dir_is_touched(tiny_model_dir, tiny_data_file, tmp_path,
                                                                     monkeypatch):
    """No WANDB_API_KEY, no `wandb login` (.netrc), no WANDB_MODE: wandb.init would raise after the table
    header and the empty logs; the run says so in one line first and leaves no output_dir. A key in the
    wrong form is one line too; WANDB_MODE=offline needs none."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    env["HOME"] = str(tmp_path / "home")  # no ~/.netrc, no ~/.config/wandb/settings
    args = [sys.executable, str(ROOT / "train_rlvr.py"), *_args(tiny_model_dir, tiny_data_file, tmp_path / "run",
                                                                 "num_problems=1", "report_to=wandb")]
    for extra, message in (({}, "error: report_to names wandb, but wandb has no API key here (no WANDB_API_KEY, no "
                                "`wandb login`); run `wandb login`, or set WANDB_MODE=offline to keep the run's wandb "
                                "files under output_dir (wandb sync uploads them later)"),
                           ({"WANDB_API_KEY": "abc"}, "error: report_to names wandb, but its credentials cannot be "
                            "used (WANDB_API_KEY invalid: API key must have 40+ characters, has 3.); run `wandb login` "
                            "again, or set WANDB_MODE=offline")):
        proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env={**env, **extra})
        assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.strip() == message, proc.stderr
        assert not (tmp_path / "run").exists()
    for mode in ("offline", "disabled"):
        monkeypatch.setenv("WANDB_MODE", mode)
        assert T.wandb_can_log()


@pytest.mark.parametrize("users", [False, True])
def test_wandb_takes_the_users_project_and_dir_else_rlvr_and_output_dir(tmp_path, monkeypatch, users):
    """wandb.init's project and dir: WANDB_PROJECT and WANDB_DIR when set (wandb's own convention), else
    project rlvr and output_dir (wandb writes its wandb/ folder there). A stand-in wandb records the call."""
    import sys
    import types

    calls = []
    fake = types.ModuleType("wandb")
    fake.Settings = lambda **kwargs: kwargs
    fake.init = lambda **kwargs: calls.append(kwargs) or types.SimpleNamespace(id="run-id")
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for key in ("WANDB_PROJECT", "WANDB_DIR"):
        monkeypatch.delenv(key, raising=False)
    if users:
        monkeypatch.setenv("WANDB_PROJECT", "my-project")
        monkeypatch.setenv("WANDB_DIR", str(tmp_path / "my-wandb"))
    out = tmp_path / "run"
    w = T.open_watch(T.Config(report_to="wandb", output_dir=str(out)), out, 0, 3, {})
    w.bar.close()
    assert len(calls) == 1 and w.wandb.id == "run-id"
    want = ("my-project", str(tmp_path / "my-wandb")) if users else ("rlvr", str(out))
    assert (calls[0]["project"], calls[0]["dir"]) == want
    assert calls[0]["id"] is None and calls[0]["resume"] is None  # a fresh run: no id to continue
    assert calls[0]["settings"] == {"console": "off", "silent": True}  # wandb leaves stdout (the table) alone
