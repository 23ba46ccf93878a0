"""The draft floor (``artcache.trainers``): draft models, losses, metrics and the consumer that trains them.

Each draft is a package with the same files (``config``, ``model``, ``loss``, ``adapter``, ``export``);
its adapter puts it behind :class:`artcache.trainers.draft.Draft`. :data:`ADAPTERS` is the one place a
draft is registered: the consumer (``--draft``), the run configs and ``artcache export`` take their
draft names from it. This module imports nothing heavy, so the composition root can read the names
without loading torch.
"""

#: draft name -> ``"module:class"`` of its :class:`~artcache.trainers.draft.Draft` adapter. A new draft
#: adds one line here (its adapter is imported only when that draft is built or exported).
ADAPTERS: dict[str, str] = {
    "dflash": "artcache.trainers.dflash.adapter:DFlashAdapter",
    "eagle3": "artcache.trainers.eagle3.adapter:Eagle3Adapter",
    "dspark": "artcache.trainers.dspark.adapter:DSparkAdapter",
}

#: The accepted ``--draft`` values, in registration order.
DRAFT_NAMES: tuple[str, ...] = tuple(ADAPTERS)

#: ``--compile`` values (:mod:`artcache.trainers.speed`): ``auto`` = ``on`` on CUDA for runs of at least
#: ``AUTO_COMPILE_MIN_STEPS`` steps, else ``off`` (and on every CPU run).
COMPILE_MODES: tuple[str, ...] = ("auto", "off", "on", "graphs")
#: lm_head cross-entropy implementations (:mod:`artcache.trainers.lm_head_ce`).
CE_IMPLS: tuple[str, ...] = ("reference", "chunked", "liger")
#: ``--loss-impl`` values: ``auto`` = ``chunked`` on CUDA, ``reference`` on a CPU.
LOSS_IMPLS: tuple[str, ...] = ("auto", *CE_IMPLS)

__all__ = ["ADAPTERS", "CE_IMPLS", "COMPILE_MODES", "DRAFT_NAMES", "LOSS_IMPLS"]
