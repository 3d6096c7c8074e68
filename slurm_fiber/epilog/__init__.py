"""The Slurm epilog (``slurm-fiber-epilog``, main) and how it finds a finished job's
leftover processes (survivors)."""
