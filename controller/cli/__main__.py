"""``python -m controller.cli``: the same as the ``edgefleet`` command."""

from controller.cli import main

if __name__ == "__main__":
    main()
