"""Loading a model and scoring it: answers and their matching, lm-eval tasks, log-probs,
generation and scoring of a held-out set, the held-out pass during training. Imports the
core and data."""
