"""The sum tasks' step checker (credit: steps, docs/variants.md): a chain "23 + 4 + 7 + 5" is right line by line.

    python train_rlvr.py --config examples/smollm2_sum4.yaml credit=steps step_checker=examples/sum_steps.py:chain

Line k of a response (k = 0, 1, ...) must add the problem's next number to the last line's result: "x + y = z" with
x the sum of the problem's first k + 1 numbers, y its number k + 1 and z their sum, as
benchmarks/credit_diagnostic.py's lines_right reads a response (23 + 4 = 27, 27 + 7 = 34, 34 + 5 = 39). The running
sum x is checked too: on "23 + 4 + 7 + 5", "20 + 4 = 27" is wrong although 4 is the number added and 27 the sum due. A
chain line may be a markdown bullet, its mark and a space before the sum ("- 23 + 4 = 27", "* 23 + 4 = 27",
"+ 23 + 4 = 27"); a numbered list's "1. 23 + 4 = 27" is not read as one. A chain line written any other way is wrong;
the lines after the chain (the boxed answer) are unknown (None): the verifier scores the answer. Called by rlvr in the
verifier's worker as chain(lines, record) under verifier_timeout, record being the problem's data set record (its
"problem" field holds the numbers).
"""

import re

# a bullet's mark may come first ("- ", "* ", "+ "); what follows the sum is not read
LINE = re.compile(r"^\s*(?:[-*+]\s+)?(\d{1,12})\s*\+\s*(\d{1,12})\s*=\s*(\d{1,12})(?!\d)")


def chain(lines: list[str], record: dict) -> list[bool | None]:
    terms = [int(x) for x in str(record["problem"]).split(" + ")]
    verdicts: list[bool | None] = []
    for k, line in enumerate(lines):
        if k >= len(terms) - 1:
            verdicts.append(None)
            continue
        m = LINE.match(line)
        verdicts.append(bool(m) and (int(m[1]), int(m[2]), int(m[3])) == (sum(terms[:k + 1]), terms[k + 1],
                                                                          sum(terms[:k + 2])))
    return verdicts
