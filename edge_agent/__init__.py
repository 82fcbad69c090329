"""The edgefleet edge agent: a device daemon that runs models pushed over MQTT on local cameras."""

__version__ = "0.1.0"
