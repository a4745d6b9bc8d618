"""What a config asks for, worked out before any compute: the schema and validation, sweeps,
RunSpec (a run's settings resolved once), the memory, disk and SLURM-fit plans, the
topology, the stages and targets of the workflow, the checks `snaketune validate` runs, the
summary table. Imports the core, data, evaluation and the methods."""
