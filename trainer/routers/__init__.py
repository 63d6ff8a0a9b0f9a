"""Routers: one contract (:class:`trainer.routers.base.Router`); the kinds (``kmeans``, ``mlp``)
are registered in :mod:`trainer.kinds`, which also loads saved routers (:func:`trainer.kinds.load_router`)."""
