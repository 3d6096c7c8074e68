"""Warm templates: the parent side (fiberd's view: start, watch, re-warm, fork, stop) and the wire
to the child.
"""
