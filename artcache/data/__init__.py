"""Dataset readers (ShareGPT-style conversations) feeding the plan."""

from artcache.data.sharegpt import (
    ShareGPTReadResult,
    locate_sharegpt,
    read_sharegpt,
    to_messages,
)

__all__ = ["ShareGPTReadResult", "locate_sharegpt", "read_sharegpt", "to_messages"]
