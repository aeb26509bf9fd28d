"""Runs train_rlvr.main() in its own process with test-only patches, chosen by the environment
variable RLVR_DRIVER (JSON). Nothing here is part of the product.

  fake_rewards: true    rollout 0 of every group scores 1, the rest 0, so every step trains (with
                        several processes, rollout 0 is rank 0's first)
  flat_answers: [...]   with fake_rewards: the problems with these answers score 0 (zero variance)
  text_rewards: true    a text scores 1 when its length is even (by_text), whoever scores it
  writes_lines: true    the sampler favours the tiny tokenizer's newline and EOS (writes_lines): responses of
                        several lines, some ended before max_new_tokens (credit=steps checks finished lines only)
  die_at: [rank, step]  that rank SIGKILLs itself as it starts generating for that step
  hang_at: [rank, step] that rank sleeps (for an hour) as it starts generating for that step
  pause_at: [step, s]   every rank sleeps s seconds as it starts generating for that step (a signal sent when
                        the step says it is generating lands inside it, however fast the machine)
  flip_advantages: true the advantages' sign is negated: training pushes away from the reward
  random_sign: SEED     each step's advantages get a random sign (drawn from random.Random(SEED)):
                        updates as large as the real ones that point nowhere in particular
  signals: [[n, "files" | "rename", "SIGKILL" | "SIGINT" | "SIGTERM"], ...]
                        send that signal to this process inside the n-th checkpoint write, after
                        its weights are written ("files") or just before its rename ("rename")
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train_rlvr as T  # noqa: E402


def first_rollout_wins(scorer, texts, gold):
    return [T.Score(1.0, None, "correct") if i == 0 and T.RANKS.rank == 0 else T.Score(0.0, None, "wrong")
            for i in range(len(texts))]


def by_text(scorer, texts, gold):
    """A reward by the text alone (1 when its length is even): the same for a text whichever rank, batch or call
    scores it, as credit's continuations need for several processes to match one."""
    return [T.Score(1.0, None, "correct") if len(x) % 2 == 0 else T.Score(0.0, None, "wrong") for x in texts]


NEWLINE_ID = 199  # the tiny tokenizer's newline byte token "Ċ" (tests/tiny_models.py; a test checks it)


def writes_lines(newline: float = 3.0, eos: float = 2.0):
    """The rollouts' sampler with the tiny model's logits of the newline (+newline) and of EOS (id 0, +eos) raised
    before temperature and top-p: the random tiny model then writes lines and ends some responses, as a real one
    does (its own odds of either are about 1 in 320 a token). The draw is still the sampler's, from each rollout's
    stream."""
    real = T.sample_next_token

    def sample(logits, temperature, top_p, u):
        logits = logits.clone()
        logits[:, NEWLINE_ID] += newline
        logits[:, 0] += eos
        return real(logits, temperature, top_p, u)
    return sample


def flat_for(answers):
    """first_rollout_wins, except that the problems with these answers score 0 throughout (zero variance)."""
    def score(scorer, texts, gold):
        return [T.Score(0.0, None, "wrong") if gold in answers else s for s in first_rollout_wins(scorer, texts, gold)]
    return score


def main():
    opts = json.loads(os.environ.get("RLVR_DRIVER", "{}"))
    if opts.get("fake_rewards"):
        T.score_rollouts = flat_for(set(opts.get("flat_answers", ())))
    if opts.get("text_rewards"):
        T.score_rollouts = by_text
    if opts.get("writes_lines"):
        T.sample_next_token = writes_lines()
    real_streams = T.rollout_streams

    def streams(seed, step, rollouts, device):
        for key, act in (("die_at", lambda: os.kill(os.getpid(), signal.SIGKILL)), ("hang_at", lambda: time.sleep(3600))):
            if opts.get(key) == [T.RANKS.rank, step]:
                act()
        pause_step, seconds = opts.get("pause_at", (None, 0))
        if pause_step == step:
            time.sleep(seconds)
        return real_streams(seed, step, rollouts, device)
    T.rollout_streams = streams
    if opts.get("flip_advantages"):
        real_advantages = T.compute_advantages
        T.compute_advantages = lambda *args: -real_advantages(*args)
    if "random_sign" in opts:
        import random

        signs, real_advantages = random.Random(opts["random_sign"]), T.compute_advantages
        T.compute_advantages = lambda *args: signs.choice((-1, 1)) * real_advantages(*args)
    writes = {"n": 0}

    def in_checkpoint(when):
        for n, at, name in opts.get("signals", []):
            if n == writes["n"] and at == when:
                os.kill(os.getpid(), getattr(signal, name))

    real_torch_save, real_rename = T.torch.save, os.rename

    def torch_save(obj, path, *a, **k):
        if str(path).endswith("optimizer.pt"):  # the model's weights are already written
            writes["n"] += 1
            in_checkpoint("files")
        return real_torch_save(obj, path, *a, **k)

    def rename(src, dst):
        if Path(src).name.startswith(".tmp-step-"):
            in_checkpoint("rename")
        return real_rename(src, dst)

    T.torch.save, T.os.rename = torch_save, rename
    sys.exit(T.main(sys.argv[1:]))


if __name__ == "__main__":
    main()
