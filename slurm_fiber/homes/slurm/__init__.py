"""The Slurm home's foundations: a job from its environment, Slurm's command output, cgroups.

``jobenv`` reads a job from the prolog/epilog/step environment, ``scontrol``
parses `scontrol -o show job`, `scontrol ping` and `squeue --json`, and
``cgroup_layout`` maps Slurm's cgroup v2 tree to jobs and steps. All are pure
(or read only /proc and the cgroup tree) and raise SlurmParseError on bad input.
"""
