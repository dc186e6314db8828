"""The OpenAI-compatible HTTP server (``exl2cpp serve``): FastAPI app over one :class:`exl2cpp.Engine`.

    >>> from exl2cpp.server import ServeConfig, create_app
    >>> app = create_app(ServeConfig(model="smollm2", api_keys=["sk-local"]))   # run with uvicorn

Needs the ``server`` extra: ``pip install exl2cpp[server]``.
"""

from .config import ServeConfig, load_config

__all__ = ["ServeConfig", "create_app", "load_config", "serve"]


def create_app(config: ServeConfig):
    from .app import create_app as _create

    return _create(config)


def serve(config: ServeConfig) -> None:
    from .app import serve as _serve

    _serve(config)
