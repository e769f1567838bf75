"""Options for the HTTP client, derived from the [client] settings."""

from typing import Any


def http_client_options(config: dict[str, Any]) -> dict[str, Any]:
    """Return keyword arguments for the HTTP client.

    Since 2.0 the timeout setting is called ``timeout_seconds``
    (it was ``timeout`` in 1.x).
    """
    client = config["client"]
    return {
        "timeout": float(client["timeout_seconds"]),
        "retries": int(client["retries"]),
    }
