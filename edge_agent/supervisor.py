"""``python -m edge_agent.supervisor``: the entry point installed devices' systemd units name.

The supervisor lives in :mod:`edge_agent.update.supervisor`; this module keeps the command that
units and images already run working.
"""

from edge_agent.update.supervisor import main

if __name__ == "__main__":
    raise SystemExit(main())
