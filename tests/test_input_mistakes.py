"""Every mistake in the settings or the data is one line and exit status 2 (or a warning where the
run can go on): the output folder and the config file, a truncated model file, data files, list and
boolean answers, a too large max_new_tokens, an eos_token that is not the model's. CPU, tiny local model."""

import json
import shutil

import pytest

import train_rlvr as T
from conftest import ROOT
from run_helpers import one_line_error, run_args, truncate


# ----------------------------------------------------------------------------------------------
# The output folder, the config file and the model file


def test_output_dir_and_config_file_mistakes(tmp_path, capsys, tiny_model_dir, tiny_data_file):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert T.main(run_args(tiny_model_dir, tiny_data_file, a_file)) == 2
    one_line_error(capsys, f"output_dir {a_file} is a file")
    assert T.main(run_args(tiny_model_dir, tiny_data_file, a_file / "sub")) == 2
    one_line_error(capsys, f"output_dir {a_file / 'sub'} cannot be written (Not a directory)")
    assert T.main(["--config", str(tmp_path)]) == 2
    one_line_error(capsys, f"config file {tmp_path} cannot be read (Is a directory)")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("model: caf\xe9\n".encode("latin-1"))
    assert T.main(["--config", str(latin)]) == 2
    one_line_error(capsys, "is not UTF-8 text (byte 0xe9 at offset 10)")
    assert T.main(["--config", str(ROOT / "config.yaml"), "learning_rate=1e39"]) == 2
    one_line_error(capsys, "'learning_rate' must be a number in (0, 1e37]")


def test_a_truncated_model_file_is_one_line(tmp_path, capsys, tiny_model_dir, tiny_data_file):
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    truncate(broken / "model.safetensors")
    assert T.main(run_args(broken, tiny_data_file, tmp_path / "o")) == 2
    one_line_error(capsys, f"could not load model '{broken}'")


# ----------------------------------------------------------------------------------------------
# The data


@pytest.mark.parametrize("content, fragment", [
    (b"", "is empty"),
    ('[{"problem": "caf\xe9", "answer": "1"}]'.encode("latin-1"), "is not UTF-8 text (byte 0xe9 on line 1)"),
    (b'{"problem": "a", "answer": "1"}\n{"problem": "b", "answer": "2"}\n{"problem": "c" "answer": "3"}\n',
     "line 3 is not a JSON record"),
])
def test_data_file_mistakes_name_the_problem(tmp_path, capsys, tiny_model_dir, content, fragment):
    data = tmp_path / "d.jsonl"
    data.write_bytes(content)
    assert T.main(run_args(tiny_model_dir, data, tmp_path / "o")) == 2
    one_line_error(capsys, f"dataset file {data} {fragment}")


def _check(problems, tokenizer, **settings):
    return T.check_problems([dict(p, index=i) for i, p in enumerate(problems)], T.Config(**settings), tokenizer, 2048)


def test_list_and_boolean_answers_are_refused_numbers_still_work(tiny_model, tmp_path, capsys, tiny_model_dir):
    _, tok = tiny_model
    good = _check([{"problem": "1+4?", "answer": 5}, {"problem": "half?", "answer": 0.5},
                   {"problem": "x", "answer": "7"}], tok)
    assert [p["answer"] for p in good] == ["5", "0.5", "7"]
    with pytest.raises(T.UserError) as e:
        _check([{"problem": "a", "answer": "1"}, {"problem": "b", "answer": ["5"]}, {"problem": "c", "answer": True}],
               tok)
    assert str(e.value) == ("dataset record 1: 'answer' is a JSON list (['5']), not a text or a number (write several "
                            "answers as one text, e.g. \"3, 5\") (and 1 more); fix the data, move start_index, or set "
                            "bad_records: skip")
    with pytest.raises(T.UserError, match=r"^eval_dataset record 0: 'answer' is a JSON boolean \(False\), .*; fix the "
                                          r"data, or set bad_records: skip$"):
        T.check_problems([{"index": 0, "problem": "p", "answer": False}], T.Config(), tok, 2048, 64, "eval_dataset")
    kept = _check([{"problem": "a", "answer": ["5"]}, {"problem": "b", "answer": 3},
                   {"problem": "c", "answer": {"x": 1}}], tok, bad_records="skip")
    assert [(p["index"], p["answer"]) for p in kept] == [(1, "3")]
    assert "skipping dataset record 2: 'answer' is a JSON object ({'x': 1})" in capsys.readouterr().err
    data = tmp_path / "lists.json"  # through datasets, as a user's file arrives
    data.write_text(json.dumps([{"problem": f"p{i}", "answer": [str(i)]} for i in range(3)]))
    assert T.main(run_args(tiny_model_dir, data, tmp_path / "o")) == 2
    one_line_error(capsys, "dataset record 0: 'answer' is a JSON list (['0'])", "(and 2 more)")
    assert not (tmp_path / "o").exists()


def test_a_too_large_max_new_tokens_is_named_first(tiny_model):
    _, tok = tiny_model
    with pytest.raises(T.UserError) as e:
        _check([{"problem": "What is 1 + 1?", "answer": "2"}], tok, max_new_tokens=100000)
    assert str(e.value).endswith("with max_new_tokens 100000 it exceeds the model's context of 2048; lower "
                                 "max_new_tokens, move start_index, or set bad_records: skip")
    with pytest.raises(T.UserError) as e:  # the advice is for the first record named
        _check([{"problem": "a", "answer": [2]}, {"problem": "What is 1 + 1?", "answer": "2"}], tok,
               max_new_tokens=100000)
    assert str(e.value).endswith("(and 1 more); fix the data, move start_index, or set bad_records: skip")


def test_an_eos_token_that_is_not_the_models_is_warned_once(tiny_model, tiny_model_dir, tiny_data_file, tmp_path,
                                                           capsys):
    model, tok = tiny_model
    other = tok.convert_ids_to_tokens(5)
    assert T.main(run_args(tiny_model_dir, tiny_data_file, tmp_path / "a", "num_problems=1", f"eos_token={other}")) == 0
    warnings = [l for l in capsys.readouterr().err.splitlines() if l.startswith("warning: eos_token")]
    assert warnings == [f"warning: eos_token {other!r} (id 5) is not the EOS of {tiny_model_dir}'s generation config "
                        "('<|endoftext|>' (id 0)); rollouts that never produce it run to max_new_tokens"]
    assert T.main(run_args(tiny_model_dir, tiny_data_file, tmp_path / "b", "num_problems=1")) == 0
    assert "warning: eos_token" not in capsys.readouterr().err
    model.generation_config.eos_token_id = [0, 5]  # a list of ends (e.g. an instruct model's two)
    T.warn_if_not_model_eos(model, tok, T.Config(eos_token=other), 5)
    assert capsys.readouterr().err == ""
    T.warn_if_not_model_eos(model, tok, T.Config(eos_token="x"), 7)
    assert "('<|endoftext|>' (id 0), " in capsys.readouterr().err
