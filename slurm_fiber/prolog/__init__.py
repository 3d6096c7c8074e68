"""The Slurm prolog (``slurm-fiber-prolog``, main).

``main`` runs the prolog's steps; ``statedir`` and ``grants`` are its pieces.
What it shares with the epilog (``Hook``, the command line, the job's cgroup)
is in slurm_fiber.hooks.
"""
