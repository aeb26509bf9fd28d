"""Step checkers the tests pass as step_checker=tests/step_checkers.py:NAME (credit: steps). Nothing here is part of
the product."""

import time


def by_length(lines, record):
    """A verdict from the line's length alone (the same whichever rank checks it): right when it is a multiple of 3,
    unknown when it leaves 2, wrong otherwise."""
    return [None if len(line) % 3 == 2 else len(line) % 3 == 0 for line in lines]


def raises(lines, record):
    raise ValueError("no verdict today")


def hangs(lines, record):
    time.sleep(3600)


def one_short(lines, record):
    return [None] * (len(lines) - 1)


def fails_on_3(lines, record):
    """Fails (raises) on the problem "What is 3 + 3?", and finds every line right on the others."""
    if "3" in record["problem"]:
        raise ValueError("three")
    return [True] * len(lines)


def appends(lines, record):
    """A verdict per line it was given (its length), then a line of its own appended to the list: the worker still
    holds it to the lines it sent."""
    verdicts = [len(line) % 2 == 0 for line in lines]
    lines.append("a line of its own")
    return verdicts


def numpy_verdicts(lines, record):
    """numpy's booleans (numpy.bool_), as a checker that compares arrays returns them: 1 + 1 = 2 right, else wrong."""
    import numpy

    return list(numpy.array([line == "1 + 1 = 2" for line in lines]))


not_a_function = 3  # a name that exists but cannot be called


def sees_the_problem_only(lines, record):
    """Right when its record holds the problem alone (the agreement script's record: never the reference solution)."""
    return [set(record) == {"question"} and "Tim" in record["question"]] * len(lines)
