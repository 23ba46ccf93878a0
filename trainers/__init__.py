"""Draft-model trainers fed by artcache: models, losses, metrics, training loops."""
