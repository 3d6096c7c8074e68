"""Cgroups, split as Slurm splits its cgroup plugin: what every backend shares (common), the
cgroup v2 files (v2), v1 hierarchies and mirrors (v1), the v1 device rule (devices), a carved
group in all its hierarchies (groups), memory readings (memory), the policy that chooses and
carves (manager), plus the slot leaves (leaves), held control files (held_files), the
enforcement record (enforcement) and the hooks' bounded teardown (teardown).
"""
