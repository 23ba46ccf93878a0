"""artcache: capture a target model's hidden states once, serve them to many draft trainers.

See docs/ for the on-disk format and the protocol; the README's terms are used throughout.
"""

__version__ = "0.1.0"

#: Bumped whenever the bytes of an artifact or the meaning of a fingerprint change.
FORMAT_VERSION = 1
