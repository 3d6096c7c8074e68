"""The Slurm prolog (``slurm-fiber-prolog``, main) and what both node hooks share.

``main`` runs the prolog's steps; ``statedir``, ``grants`` and ``cgroup`` are
its pieces; ``hook`` (one-line reports, time-bounded steps) and ``cli`` (the
bare fast path under slurmd, typer for people) serve the epilog as well.
"""
