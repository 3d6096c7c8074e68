"""Every node of a Slurm job: each node's fiberd reached from the first through Slurm.

``wire`` is the line format a relay speaks on its standard streams, ``relay`` the
command that runs on each node (one ``srun --overlap`` step per node) and connects its
fiberd, ``link`` the first node's end of one relay (connections to that node's fiberd
as ``FiberdClient``s), ``handout`` the nodes of the job with a ``TaskRunner`` each and
the record of the nodes lost.
"""
