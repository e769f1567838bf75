"""The store conformance suite: the same tests against every implementation of each contract."""
