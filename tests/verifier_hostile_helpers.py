"""Module-level (picklable) score functions for the TimedVerifier tests.

``misbehaving_score`` behaves like ``verifier.score`` except for a few magic responses:
"SLEEP" sleeps far past any timeout, "EXIT" kills the worker with os._exit, "RAISE" raises.
"""

import os
import time

import verifier


def misbehaving_score(response, gold):
    if response == "SLEEP":
        time.sleep(3600)
    if response == "EXIT":
        os._exit(3)
    if response == "RAISE":
        raise RuntimeError("score_fn failed on purpose")
    if response == "PID":
        return (0.0, str(os.getpid()), "wrong")
    return verifier.score(response, gold)


def sleep_forever(response, gold):
    time.sleep(3600)
    return (1.0, "never", "correct")
