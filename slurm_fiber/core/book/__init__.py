"""The grant book: the core's pure decisions (admission, epochs, fences, leases, Clone) and their
durable state.
"""
