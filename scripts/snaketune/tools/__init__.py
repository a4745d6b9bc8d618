"""A user's tools and the loop that calls them: the tools a GRPO run's model calls while it
trains (``grpo.tools``, ``grpo.environment``) and in its evaluation, each call run in a
process of its own. Imports the core, data and evaluation (a user's function is loaded as a
reward is, the evaluation's greedy generation)."""
