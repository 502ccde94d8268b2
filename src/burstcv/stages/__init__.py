"""The pipeline's stages, one module each, in run order: ``resolve`` (run.json), ``data``,
``boxes``, ``export``, ``benchmark`` (with ``sizing``), ``gate``, ``deploy``, ``report``.

Each takes the run (``RunRef``), reads its inputs through the run's layout and returns a typed
result (``burstcv_spec.contracts``): all that travels through XCom. Nothing here imports Airflow.
"""
