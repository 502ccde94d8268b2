"""Scan, validate and pack image datasets.

Great Expectations logs about 215 lines of bookkeeping at INFO per import, which would bury the
validation summary in a task log: its logger is set to WARNING here, before any module of this
package imports it, unless the application already gave that logger a level.
"""

from __future__ import annotations

import logging

_gx_logger = logging.getLogger("great_expectations")
if _gx_logger.level == logging.NOTSET:
    _gx_logger.setLevel(logging.WARNING)
