"""snaketune: the library behind the Snakemake workflow (all logic lives here)."""

__version__ = "0.1.0"
