"""``python -m artcache`` is the ``artcache`` command."""

from artcache.app.cli import main

if __name__ == "__main__":
    main()
