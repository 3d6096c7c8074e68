"""The fiberd socket protocol's shared vocabulary: what both ends of the socket import.

``limits`` (versions, size limits, error codes), ``framing`` (frames and their JSON),
``requests`` (one type per op), ``replies`` (one type per op's answer, and the
envelope) are imported by the client and the server alike; ``validate`` (from a
received body to its typed request, refusing what does not fit) and ``names`` by the
server. Nothing here imports any other part of slurm_fiber (but ``slurm_fiber.errors``,
the coded-error base) or does I/O, so both ends
read one definition of every name. The modules the client imports keep the client's
import budget (slurm_fiber/client/__init__.py); docs/socket-protocol.md is the wire
format.
"""
