"""``python -m artcache`` is the ``artcache`` command (:func:`main`, also the console script)."""


def main() -> None:
    """Run the ``artcache`` command line (:func:`artcache.app.cli.main`).

    A Ctrl-C at any time, also while the command line's modules (torch, ...) are still being imported, ends
    with one line on stderr, ``artcache: cancelled by SIGINT (exit 130)``, and exit status ``128 + signal``
    (:func:`artcache.shutdown.stop_exit_status`), never a traceback. Once a command runs, its own handling
    (its cleanup first) prints the same line. Nothing is imported before the ``try`` (the package's
    ``__init__`` imports nothing), so the imports an interrupt can land in all run inside it."""
    try:
        from artcache.app.cli import main as cli

        cli()
    except KeyboardInterrupt:
        import sys

        from artcache.shutdown import cancelled_line, stop_exit_status

        code = stop_exit_status()
        print(cancelled_line(code), file=sys.stderr)
        sys.exit(code)


if __name__ == "__main__":
    main()
