"""The application: use cases, the workspace registry, reports, agent sessions."""
