"""What a user runs and reads: the `snaketune` command, the report and its plots, the
offline demo fixtures. The top wing: it may import any other."""
