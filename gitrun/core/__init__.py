"""The pure core: records and their codecs, validation, patch and task parsing, the run's
state machine. No pygit2, no I/O of its own beyond reading the files it parses.
"""
