"""The composition root: the ``artcache`` command line, typed run configs and ``artcache run``.

The only floor that knows every other one (library ``artcache.*``, drafts ``artcache.trainers``,
harness ``artcache.bench``); nothing below imports it.
"""
