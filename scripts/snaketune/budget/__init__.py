"""What a run will take, before it is queued: GPU and CPU memory (memplan, fit, stageplan),
disk (diskplan), steps, time and GPU-hours (cost, stagecost), SLURM partitions (slurmfit),
the advice on them and the checks the dry run makes before anything is queued (checks).
Imports the plan wing and those below it."""
