"""The run loop: drives the state machine over the stores and the adapter; recovery,
approvals, the verifier, agents.
"""
