"""The environment adapter: one worktree per run, its files, the gate, sandboxed commands."""
