"""The child side of a template: the code that runs inside the warm template process and its
spares.
"""
