"""Framework adapters: ``interop.torch`` and ``interop.cupy``, each imported only once the user has
imported that framework. Nothing here is imported by ``import cgraw``."""
