"""Scan, validate and pack image datasets.

Great Expectations logs its own bookkeeping at INFO (about 215 lines per import: "Skipping
registering function ...", metric re-declarations, "Loading 'datasources'"), which would bury
the validation summary in a task log. Its logger is set to WARNING here, before any module of
this package imports it, unless the application already gave that logger a level.
"""

from __future__ import annotations

import logging

_gx_logger = logging.getLogger("great_expectations")
if _gx_logger.level == logging.NOTSET:
    _gx_logger.setLevel(logging.WARNING)
