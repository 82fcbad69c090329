"""The edgefleet wire contract: topics, typed messages and their codec.

Both the controller and the edge agent import this package and nothing of each other.
Only pydantic and the standard library are allowed here, plus ``cryptography`` for Ed25519 in
``signing.py`` and ``paho-mqtt`` in ``paho_client.py`` (the one MQTT client set-up both sides use); each
is imported on its own, never from this package's top level. ``endpoint.py`` (broker URL, credentials,
TLS files, refused CONNACK codes) keeps to the rule.
"""

from fleet_protocol.codec import ProtocolError, decode, decode_chunk, encode, encode_chunk
from fleet_protocol.messages import SCHEMA_VERSION
from fleet_protocol.topics import DEFAULT_PREFIX, Topic, TopicKind, Topics

__all__ = [
    "DEFAULT_PREFIX",
    "SCHEMA_VERSION",
    "ProtocolError",
    "Topic",
    "TopicKind",
    "Topics",
    "decode",
    "decode_chunk",
    "encode",
    "encode_chunk",
]
