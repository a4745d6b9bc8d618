"""A reward function of the user's kind, for the GRPO demo (config/grpo_demo.yaml):
it reads the dataset's own `question` column (TRL passes a row's other columns as
keywords) and checks the completion's last number against the sum the question asks for.

    grpo:
      rewards:
        "config/rewards/arith.py:sum_from_question": 0.5

docs/rewards.md has the rules (arguments, return values, errors) and more examples.
"""

import re

QUESTION = re.compile(r"has (\d+) .*? buys (\d+) more")
NUMBER = re.compile(r"-?\d+")


def sum_from_question(prompts, completions, question, **kwargs):
    """1.0 when the completion's last number is the question's sum, else 0.0; None (no
    reward) for a question that is not "X has A things. She buys B more." """
    out = []
    for completion, text in zip(completions, question, strict=True):
        asked = QUESTION.search(text)
        if asked is None:
            out.append(None)
            continue
        numbers = NUMBER.findall(completion)
        want = int(asked[1]) + int(asked[2])
        out.append(1.0 if numbers and int(numbers[-1]) == want else 0.0)
    return out
