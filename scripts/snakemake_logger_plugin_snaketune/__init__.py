"""snaketune's terminal, as a Snakemake logger plugin: ``--logger snaketune`` (the profiles
set it). Snakemake finds its logger plugins by this module's name; the handler lives in
``snaketune.app.terminal``."""

from snaketune.app.terminal import LogHandler

__all__ = ["LogHandler"]
