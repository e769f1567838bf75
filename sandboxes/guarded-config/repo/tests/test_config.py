from appcfg import http_client_options, load_config


def test_server_defaults():
    config = load_config()
    assert config["server"] == {"host": "127.0.0.1", "port": 8080}


def test_override_is_deep_merged():
    config = load_config({"server": {"port": 9000}})
    assert config["server"] == {"host": "127.0.0.1", "port": 9000}


def test_client_retries_override():
    config = load_config({"client": {"retries": 5}})
    assert config["client"]["retries"] == 5


def test_client_options_from_defaults():
    options = http_client_options(load_config())
    assert options == {"timeout": 30.0, "retries": 3}


def test_timeout_seconds_override():
    config = load_config({"client": {"timeout_seconds": 5}})
    assert http_client_options(config)["timeout"] == 5.0


def test_legacy_timeout_override_still_honoured():
    # Deployments upgraded from 1.x still set the old key name.
    config = load_config({"client": {"timeout": 12}})
    assert http_client_options(config)["timeout"] == 12.0
