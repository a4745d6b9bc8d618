"""What a config asks for, worked out before any compute: the schema and validation, sweeps,
RunSpec (a run's settings resolved once), the topology, the stages and targets of the
workflow. Imports the core, data, evaluation and the methods."""
