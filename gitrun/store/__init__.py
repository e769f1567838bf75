"""The store: repositories, ref compare-and-swap, locks, atomic files, checkpoint log,
lease, receipt log, witness, keys.
"""
