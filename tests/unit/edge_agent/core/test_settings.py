from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.cli import run
from edge_agent.core.settings import SettingsError, load_settings, parse_settings

GOOD = """
device_id: site-1
mqtt_url: mqtt://agent:s3cret@broker.local:1884
data_dir: {data}
cameras:
  - id: door
    source: rtsp://10.0.0.5/stream
  - id: usb
    source: "0"
inference:
  threads: 1
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "agent.yaml"
    path.write_text(text.format(data=tmp_path / "data"))
    return path


def test_good_config_loads_with_defaults_and_hides_the_password(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, GOOD))
    assert s.device_id == "site-1"
    assert (s.mqtt_url.host, s.mqtt_url.port, s.mqtt_url.username) == ("broker.local", 1884, "agent")
    assert s.mqtt_url.password is not None and s.mqtt_url.password.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(s) and "s3cret" not in str(s.mqtt_url)
    assert s.heartbeat_interval_s == 5 and s.inference.max_batch == 4 and s.outbox.max_messages == 100_000
    assert s.inference.providers[0] == "TensorrtExecutionProvider"
    assert not s.cameras[0].is_file and not s.cameras[1].is_file


def test_password_from_environment_overrides_the_file() -> None:
    s = parse_settings(
        {"device_id": "d1", "data_dir": "/tmp/x", "mqtt_url": "mqtt://u@h:1"},
        env={"EDGEFLEET_MQTT_PASSWORD": "from-env"},
    )
    assert s.mqtt_url.password is not None and s.mqtt_url.password.get_secret_value() == "from-env"


def test_unknown_key_is_rejected_naming_it(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD + "  max_batchh: 3\n")
    with pytest.raises(SettingsError, match=r"inference\.max_batchh: unknown key"):
        load_settings(path)


def test_unknown_camera_key_is_named_with_its_position(tmp_path: Path) -> None:
    text = GOOD.replace('source: "0"', 'source: "0"\n    fsp: 5')
    with pytest.raises(SettingsError, match=r"cameras\.1\.fsp: unknown key"):
        load_settings(write(tmp_path, text))


def test_bad_device_id_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"device_id"):
        load_settings(write(tmp_path, GOOD.replace("site-1", "bad/id+#")))


def test_bad_mqtt_url_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"mqtt_url.*scheme"):
        load_settings(write(tmp_path, GOOD.replace("mqtt://agent", "http://agent")))


def test_yaml_syntax_error_is_a_settings_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="not valid YAML"):
        load_settings(write(tmp_path, "device_id: [unclosed\n"))


def test_missing_file_is_a_settings_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot read"):
        load_settings(tmp_path / "nope.yaml")


def test_validate_config_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write(tmp_path, GOOD)
    assert run(good, validate_config=True) == 0
    assert capsys.readouterr().out.strip() == "OK"
    good.write_text(GOOD.format(data=tmp_path) + "bogus: 1\n")
    assert run(good, validate_config=True) == 2
    err = capsys.readouterr().err
    assert "bogus: unknown key" in err and "Traceback" not in err


def test_artifact_public_key_from_the_file_or_the_environment_and_checked() -> None:
    from fleet_protocol.signing import generate_private_key, public_key_b64

    key_a = public_key_b64(generate_private_key().public_key())
    key_b = public_key_b64(generate_private_key().public_key())
    base = {"device_id": "d1", "data_dir": "/tmp/x"}
    s = parse_settings(base, env={})
    assert s.artifact_public_key is None and s.require_signed_artifacts is True
    assert parse_settings({**base, "artifact_public_key": key_a}, env={}).artifact_public_key == key_a
    s = parse_settings({**base, "artifact_public_key": key_a}, env={"EDGEFLEET_ARTIFACT_PUBLIC_KEY": key_b})
    assert s.artifact_public_key == key_b
    with pytest.raises(SettingsError, match=r"artifact_public_key: .*32 raw bytes"):
        parse_settings({**base, "artifact_public_key": "c2hvcnQ="}, env={})
    with pytest.raises(SettingsError, match="EDGEFLEET_ARTIFACT_PUBLIC_KEY"):
        parse_settings(base, env={"EDGEFLEET_ARTIFACT_PUBLIC_KEY": "not a key"})
