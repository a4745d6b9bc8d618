"""The agent demo's calculator (config/agent_demo.yaml): an environment whose instance holds
one rollout's question and whose method ``add`` the model may call."""

import re


class Calculator:
    """A calculator that reads the question it is asked about."""

    def reset(self, **kwargs):
        """Start a rollout: keep the question's two numbers (its last user turn's)."""
        text = kwargs["prompt"][-1]["content"]
        self.numbers = [int(n) for n in re.findall(r"\d+", text)][:2]

    def add(self) -> int:
        """Add the two numbers of the question."""
        return sum(self.numbers)
