"""Start one bench consumer from a JSON-encoded :class:`artcache.trainers.consumer.ConsumerConfig`.

``python -m artcache.bench.consume '<json>'`` is what ``artcache bench`` runs for every consumer of every
mode (artcache, naive, lockstep), so the modes differ only in the fields the bench sets (the cache
root, ``lockstep_group``) and never in how a consumer is started. It logs like ``artcache consume``
and prints the same summary line as ``artcache consume --json``; a ConfigError (also one found before step 1, such
as checkpoints that cannot fit) or an unknown field exits 2, another artcache error 1, SIGTERM / Ctrl-C (after the
final checkpoint) 143 / 130.
"""

from __future__ import annotations

import json
import sys

import msgspec


def main(argv: list[str] | None = None) -> int:
    from artcache.errors import ArtcacheError, ConfigError
    from artcache.logs import setup_logging
    from artcache.shutdown import Cancelled
    from artcache.trainers.consumer import ConsumerConfig, run_consumer

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m artcache.bench.consume '<ConsumerConfig as JSON>'", file=sys.stderr)
        return 2
    setup_logging(False)
    try:
        cfg = msgspec.json.decode(args[0], type=ConsumerConfig)
        cfg.validate()
    except (msgspec.DecodeError, msgspec.ValidationError, ConfigError) as exc:
        print(f"artcache.bench.consume: error: {exc}", file=sys.stderr)
        return 2
    try:
        summary = run_consumer(cfg)
    except ConfigError as exc:  # bad settings found before step 1 (e.g. checkpoints that cannot fit)
        print(f"artcache.bench.consume: error: {exc}", file=sys.stderr)
        return 2
    except ArtcacheError as exc:
        print(f"artcache.bench.consume: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except Cancelled as exc:  # SIGTERM / Ctrl-C after the final checkpoint: the summary, 128 + the signal
        if exc.summary is not None:
            print(json.dumps(exc.summary))
        return exc.exit_status
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
