"""Fibers as fiberd sees them: the ``fiber`` claim, each fiber's record, its end, and the socket's
handle on it.
"""
