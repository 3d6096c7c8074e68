"""Cgroups: carving a grant's and each fiber's groups, their limits and device rules, and the files
held open.
"""
