"""Run the service with uvicorn on the configured host and port: ``python -m burstcv_serving``."""

from __future__ import annotations

import logging

import uvicorn

from burstcv_serving.main import create_app
from burstcv_serving.settings import Settings


def main() -> None:
    """Read settings from the environment, then serve until interrupted."""
    settings = Settings()
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        server_header=False,
    )


if __name__ == "__main__":
    main()
