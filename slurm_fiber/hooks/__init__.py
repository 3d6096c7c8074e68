"""What both Slurm node hooks share: the prolog (slurm_fiber.prolog) and the epilog
(slurm_fiber.epilog) import from here, never from each other.

``hook`` runs a hook as named, time-bounded steps with one-line reports; ``cli``
is the command line of both (bare and fast under slurmd, typer for people);
``cgroup`` is the per-job cgroup v2 subtree the prolog delegates and the
epilog removes (one ``job_cgroup`` for both, so they agree on the path).
"""
