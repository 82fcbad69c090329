"""The agent's local status page and API (``server.py``, ``status.py``, ``page.py``): what a technician on
site needs when the device's uplink is down or misconfigured, from a phone on the site's LAN with no
controller and no internet. It reads the agent's parts and never holds them up."""
